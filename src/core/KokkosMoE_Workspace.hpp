#ifndef KOKKOSMOE_WORKSPACE_HPP
#define KOKKOSMOE_WORKSPACE_HPP

/// \file KokkosMoE_Workspace.hpp
/// \brief The one reusable-buffer type: labelled, grow-only views handed out
/// again only when nobody else still holds them.
///
/// Fresh allocations are first-touched by the kernels or transports that fill
/// them, which is expensive on every platform; reusing them makes repeated
/// steps cheap. A buffer is reused only when the workspace holds its last
/// reference (View use count), so a dispatch handle or any other object that
/// keeps rows keeps them intact: a request with that label while it is held
/// gets another buffer, and the workspace keeps both, so that steps with
/// several of them in flight at once (a chunked schedule's chunks, waves)
/// find theirs again next time instead of first-touching new memory. A
/// request takes the smallest free buffer of its shape that is large enough,
/// else grows the largest free one (leading extent: the largest request),
/// else adds one. The trailing extents and the element type are part of a
/// buffer's shape, and each shape under a label has buffers of its own (the
/// routed and the shared experts' intermediate rows under one label keep
/// theirs). Views come back uninitialised.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Types.hpp>

#include <any>
#include <array>
#include <cstddef>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace KokkosMoE {

template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class Workspace {
 public:
  using memory_space = MemorySpace;

  /// \param prefix label prefix of every allocation (profiling tools show
  /// "<prefix>::<label>").
  explicit Workspace(std::string prefix = "KokkosMoE::Workspace") : prefix_(std::move(prefix)) {}

  /// \brief A view of type V (rank 1 or 2, in this workspace's memory space)
  /// with leading extent n (and trailing extent n1 for rank 2), allocated on
  /// exec without initialisation or reused as described above.
  template <class V, class Exec>
  V get(Exec const& exec, std::string const& label, index_t n, std::size_t n1 = 0) {
    static_assert(std::is_same<typename V::memory_space, MemorySpace>::value, "Workspace::get: view of another memory space");
    static_assert(Compat::view_rank<V> == 1 || Compat::view_rank<V> == 2, "Workspace::get: rank-1 or rank-2 views");
    KOKKOSMOE_REQUIRE(n >= 0, "Workspace::get('" << label << "'): negative extent " << n);
    auto& pool = buffers_[label];
    auto of_shape = [n1](Entry& e) -> V* {
      V* v = std::any_cast<V>(&e.view);
      return v && (Compat::view_rank<V> == 1 || v->extent(1) == n1) ? v : nullptr;
    };
    constexpr std::size_t none = static_cast<std::size_t>(-1);
    std::size_t fit = none, grow = none;
    for (std::size_t i = 0; i < pool.size(); ++i) {
      V* v = of_shape(pool[i]);
      if (!v || v->use_count() > 1) continue;
      auto const have = static_cast<index_t>(v->extent(0));
      if (have >= n) {
        if (fit == none || have < static_cast<index_t>(of_shape(pool[fit])->extent(0))) fit = i;
      } else if (grow == none || have > static_cast<index_t>(of_shape(pool[grow])->extent(0))) {
        grow = i;
      }
    }
    if (fit == none) {
      index_t extent = n;
      if (grow != none) {
        // Release before allocating (the peak is one buffer); a failed
        // allocation leaves the pool without it, never with a hole.
        extent = Compat::max<index_t>(n, static_cast<index_t>(of_shape(pool[grow])->extent(0)));
        pool.erase(pool.begin() + static_cast<std::ptrdiff_t>(grow));
      }
      V fresh = allocate<V>(exec, prefix_ + "::" + label, extent, n1);
      auto const bytes = static_cast<std::int64_t>(fresh.span() * sizeof(typename V::value_type));
      pool.push_back(Entry{std::move(fresh), &use_count_of<V>, bytes});
      fit = pool.size() - 1;
    }
    V const& held = *of_shape(pool[fit]);
    using range = std::pair<index_t, index_t>;
    if constexpr (Compat::view_rank<V> == 1) {
      return Kokkos::subview(held, range(0, n));
    } else {
      return Kokkos::subview(held, range(0, n), Kokkos::ALL);
    }
  }

  /// \brief [n, n1] row-major rows of T.
  template <class T, class Exec>
  RowMatrix<T, MemorySpace> matrix(Exec const& exec, std::string const& label, index_t n, std::size_t n1) {
    return get<RowMatrix<T, MemorySpace>>(exec, label, n, n1);
  }

  /// \brief [n] entries of T.
  template <class T, class Exec>
  Kokkos::View<T*, MemorySpace> vector(Exec const& exec, std::string const& label, index_t n) {
    return get<Kokkos::View<T*, MemorySpace>>(exec, label, n);
  }

  /// \brief Drops every buffer this workspace holds (views handed out stay
  /// valid). A pool keeps as many buffers per label and shape as were ever
  /// held at once; this is how to give them back.
  void clear() { buffers_.clear(); }

  /// \brief Number of labels.
  std::size_t size() const { return buffers_.size(); }

  /// \brief Bytes of every buffer this workspace holds.
  std::int64_t held_bytes() const {
    std::int64_t b = 0;
    for (auto const& [label, pool] : buffers_)
      for (auto const& e : pool) b += e.bytes;
    return b;
  }

  /// \brief Number of buffers under a label (0 for an unknown one).
  std::size_t buffers(std::string const& label) const {
    auto const it = buffers_.find(label);
    return it == buffers_.end() ? 0 : it->second.size();
  }

 private:
  /// One buffer and how to read its use count without knowing its type.
  struct Entry {
    std::any view;
    long (*use_count)(std::any const&) = nullptr;
    std::int64_t bytes = 0;
  };
  template <class V>
  static long use_count_of(std::any const& a) {
    return static_cast<long>(std::any_cast<V const&>(a).use_count());
  }

  template <class V, class Exec>
  static V allocate(Exec const& exec, std::string const& label, index_t n, std::size_t n1) {
    if constexpr (Compat::view_rank<V> == 1) {
      (void)n1;
      return V(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, label), n);
    } else {
      return V(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, label), n, n1);
    }
  }

  std::string prefix_;
  std::map<std::string, std::vector<Entry>> buffers_;
};

/// \brief A transient view for one call, labelled "KokkosMoE::<what>":
/// drawn from ws under "<what>" when a workspace is given (so that repeated
/// steps reuse it, see Workspace), else freshly allocated. Uninitialised
/// either way.
template <class V, class Exec, class MS>
V scratch(Workspace<MS>* ws, Exec const& exec, std::string const& label, index_t n, std::size_t n1 = 0) {
  if (ws) {
    std::string const ours = "KokkosMoE::";
    return ws->template get<V>(exec, label.compare(0, ours.size(), ours) == 0 ? label.substr(ours.size()) : label, n, n1);
  }
  auto const alloc = Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, label);
  if constexpr (Compat::view_rank<V> == 1) {
    return V(alloc, n);
  } else {
    return V(alloc, n, n1);
  }
}

namespace Impl {
/// A rank-1 view of another view's elements in its memory space: the view
/// itself for rank 1, its contiguous span (row-major order for LayoutRight)
/// as an unmanaged rank-1 view otherwise.
template <class V>
auto flat_elements(V const& v) {
  if constexpr (Compat::view_rank<V> == 1) {
    return v;
  } else {
    KOKKOSMOE_REQUIRE(v.span_is_contiguous(), "'" << v.label() << "': its elements in one run need a contiguous view");
    return Kokkos::View<typename V::value_type*, typename V::memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(v.data(),
                                                                                                                   v.size());
  }
}
}  // namespace Impl

/// \brief Host values of a view (rank 1, or a contiguous view of any rank in
/// its element order), copied on exec and fenced, without a host mirror (a
/// mirror is an allocation, and on a device its release fences every
/// stream).
template <class Exec, class V>
void copy_to_host(Exec const& exec, V const& v, std::vector<typename V::non_const_value_type>& out) {
  using T = typename V::non_const_value_type;
  auto const flat = Impl::flat_elements(v);
  out.resize(flat.extent(0));
  if (out.empty()) return;
  Kokkos::deep_copy(exec, Kokkos::View<T*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(out.data(), out.size()), flat);
  Compat::fence(exec, "KokkosMoE::copy_to_host");
}

template <class Exec, class V>
std::vector<typename V::non_const_value_type> copy_to_host(Exec const& exec, V const& v) {
  std::vector<typename V::non_const_value_type> out;
  copy_to_host(exec, v, out);
  return out;
}

/// \brief Copies host values into the front of a view (rank 1, or a
/// contiguous view of any rank in its element order) on exec and fences (the
/// host vector may go right after), without a mirror.
template <class Exec, class V>
void copy_from_host(Exec const& exec, std::vector<typename V::non_const_value_type> const& in, V const& v) {
  using T = typename V::non_const_value_type;
  auto const flat = Impl::flat_elements(v);
  KOKKOSMOE_REQUIRE(in.size() <= flat.extent(0), "copy_from_host: " << in.size() << " values for " << flat.extent(0) << " entries");
  if (in.empty()) return;
  Kokkos::deep_copy(exec, Kokkos::subview(flat, std::pair<std::size_t, std::size_t>(0, in.size())),
                    Kokkos::View<T const*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(in.data(), in.size()));
  Compat::fence(exec, "KokkosMoE::copy_from_host");
}

/// \brief A transient device copy of host values (see scratch).
template <class T, class Exec, class MS>
Kokkos::View<T*, MS> scratch_copy(Workspace<MS>* ws, Exec const& exec, std::string const& label, std::vector<T> const& in) {
  auto v = scratch<Kokkos::View<T*, MS>>(ws, exec, label, static_cast<index_t>(in.size()));
  copy_from_host(exec, in, v);
  return v;
}

}  // namespace KokkosMoE

#endif
