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
/// keeps rows keeps them intact: the next request with that label gets a new
/// allocation instead. The leading extent grows to the largest request; the
/// trailing extents are part of the buffer's shape (a request with other
/// trailing extents reallocates). Views come back uninitialised.

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
    auto& slot = buffers_[label];
    V* held = std::any_cast<V>(&slot);
    bool const same_shape = held && (Compat::view_rank<V> == 1 || held->extent(1) == n1);
    if (!same_shape || static_cast<index_t>(held->extent(0)) < n || held->use_count() > 1) {
      index_t const grow = same_shape ? Compat::max<index_t>(n, static_cast<index_t>(held->extent(0))) : n;
      slot.reset();  // release before allocating: the peak is one buffer
      V fresh = allocate<V>(exec, prefix_ + "::" + label, grow, n1);
      slot = fresh;
      held = std::any_cast<V>(&slot);
    }
    using range = std::pair<index_t, index_t>;
    if constexpr (Compat::view_rank<V> == 1) {
      return Kokkos::subview(*held, range(0, n));
    } else {
      return Kokkos::subview(*held, range(0, n), Kokkos::ALL);
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

  /// \brief Drops every buffer this workspace holds (views handed out stay valid).
  void clear() { buffers_.clear(); }

  /// \brief Number of labelled buffers.
  std::size_t size() const { return buffers_.size(); }

 private:
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
  std::map<std::string, std::any> buffers_;
};

}  // namespace KokkosMoE

#endif
