#ifndef KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP
#define KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP

/// \file impl/KokkosMoE_Exchange_Common.hpp
/// \brief Pieces shared by the exchange algorithms.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <map>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {
namespace Impl {

/// Grow-only buffers reused across calls. A buffer is handed out again only
/// when nobody else holds it (its use count is the workspace's own), so a
/// dispatch handle that still references rows keeps them intact. Fresh
/// allocations are first-touched by the kernels or transports that fill them,
/// which is expensive on every platform; reuse makes repeated steps cheap.
template <class MS>
class Workspace {
 public:
  using rows_view = Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS>;

  template <class Exec>
  rows_view rows(Exec const& exec, std::string const& key, index_t n, std::size_t row_bytes) {
    auto& v = rows_[key];
    if (v.extent(1) != row_bytes || static_cast<index_t>(v.extent(0)) < n || v.use_count() > 1) {
      index_t const grow = Compat::max<index_t>(n, static_cast<index_t>(v.extent(1) == row_bytes ? v.extent(0) : 0));
      v = rows_view();
      v = rows_view(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Exchange::" + key), grow, row_bytes);
    }
    return Kokkos::subview(v, std::pair<index_t, index_t>(0, n), Kokkos::ALL);
  }

  template <class Exec>
  PayloadBuffer<MS> payload(Exec const& exec, std::string const& key, PayloadType type, int width, index_t n) {
    PayloadBuffer<MS> b;
    b.type = type;
    b.width = width;
    b.bytes = rows(exec, key, n, static_cast<std::size_t>(payload_row_bytes(type, width)));
    return b;
  }

  template <class Exec>
  Kokkos::View<RowMeta*, MS> meta(Exec const& exec, std::string const& key, index_t n) {
    auto& v = meta_[key];
    if (static_cast<index_t>(v.extent(0)) < n || v.use_count() > 1) {
      v = Kokkos::View<RowMeta*, MS>();
      v = Kokkos::View<RowMeta*, MS>(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Exchange::" + key), n);
    }
    return Kokkos::subview(v, std::pair<index_t, index_t>(0, n));
  }

 private:
  std::map<std::string, rows_view> rows_;
  std::map<std::string, Kokkos::View<RowMeta*, MS>> meta_;
};

/// Stage stopwatch: lap() fences the instance and returns the seconds since
/// the previous lap (or construction).
template <class Exec>
class Lap {
 public:
  explicit Lap(Exec const& exec) : exec_(exec) {}
  double operator()() {
    Compat::fence(exec_, "KokkosMoE::Exchange: stage end");
    double const t = timer_.seconds();
    timer_.reset();
    return t;
  }

 private:
  Exec exec_;
  Kokkos::Timer timer_;
};

inline std::vector<index_t> offsets_of(std::vector<index_t> const& counts) {
  std::vector<index_t> off(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

inline std::vector<int> node_of_rank(Topology::CommunicatorSet const& comms) {
  std::vector<int> n(static_cast<std::size_t>(comms.topology().size()));
  for (int r = 0; r < comms.topology().size(); ++r) n[static_cast<std::size_t>(r)] = comms.topology().node_of(r);
  return n;
}

template <class MS>
ByteLedger new_ledger(char const* algorithm, PayloadBuffer<MS> const& rows, int ranks) {
  ByteLedger l;
  l.algorithm = algorithm;
  l.payload = to_string(rows.type);
  l.width = rows.width;
  l.row_bytes = rows.row_bytes();
  l.meta_row_bytes = sizeof(RowMeta);
  l.ranks = ranks;
  return l;
}

/// Local check of a handle before its combine: same algorithm, this
/// communicator epoch, a live placement generation, one return row per
/// arrived row, not combined before. Returns the problem ("" when fine); the
/// caller agrees on it with the other ranks.
template <class MS>
std::string handle_problem(Topology::CommunicatorSet const& comms, DispatchHandle<MS> const& h, char const* algorithm,
                           index_t back_rows, PlacementRegistry const* registry, std::uint64_t last_generation) {
  try {
    KOKKOSMOE_REQUIRE(h.algorithm == algorithm, "a " << h.algorithm << " dispatch handle was given to the " << algorithm << " combine");
    comms.check_epoch(h.epoch, "dispatch handle");
    if (registry) {
      registry->check_handle(h.generation_ref, h.generation);
    } else {
      KOKKOSMOE_REQUIRE(h.generation == last_generation, "dispatch handle of placement generation "
                                                             << h.generation << " does not match the generation " << last_generation
                                                             << " this exchange dispatches");
    }
    KOKKOSMOE_REQUIRE(!h.combined, "the dispatch handle was already combined");
    KOKKOSMOE_REQUIRE(back_rows == h.recv_offsets.back(), "combine got " << back_rows << " return rows for "
                                                                          << h.recv_offsets.back() << " dispatched rows");
  } catch (std::exception const& e) {
    return e.what();
  }
  return {};
}

/// Runs f and returns its exception message ("" when it returns normally).
template <class F>
std::string problem_of(F&& f) {
  try {
    f();
  } catch (std::exception const& e) {
    return e.what();
  }
  return {};
}

/// dst row p = src row index(p) for p < dst rows (payload rows and metadata).
template <class Exec, class SrcView, class IndexF, class DstView>
void gather_meta(Exec const& exec, SrcView const& src, IndexF const& index, DstView const& dst, char const* label) {
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(dst.extent(0))),
                       KOKKOS_LAMBDA(index_t p) { dst(p) = src(index(p)); });
}

/// dst row index(p) = src row p for p < src rows.
template <class Exec, class MS, class IndexF>
void scatter_rows(Exec const& exec, PayloadBuffer<MS> const& src, IndexF const& index, PayloadBuffer<MS> const& dst,
                  char const* label) {
  KOKKOSMOE_REQUIRE(src.type == dst.type && src.width == dst.width, label << ": payload types differ");
  index_t const rows = src.rows();
  if (rows == 0) return;
  auto in = src.bytes;
  auto out = dst.bytes;
  std::int64_t const rb = src.row_bytes();
  using policy_t = Kokkos::TeamPolicy<Exec>;
  Kokkos::parallel_for(
      label, KokkosMoE::Impl::row_policy(exec, rows), KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
        index_t const p = team.league_rank();
        KokkosMoE::Impl::copy_row_bytes(team, &in(p, 0), &out(index(p), 0), rb);
      });
}

/// Host copy of a device vector.
template <class V>
std::vector<typename V::non_const_value_type> host_vector(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.extent(0));
}

/// Host copy of one [i, :, :] plane of a rank-3 view, flattened.
template <class V>
std::vector<typename V::non_const_value_type> host_vector_3d(V const& v, int i) {
  auto plane = Kokkos::subview(v, i, Kokkos::ALL, Kokkos::ALL);
  Kokkos::View<typename V::non_const_value_type**, Kokkos::LayoutRight, Kokkos::HostSpace> h("KokkosMoE::host_plane", plane.extent(0),
                                                                                            plane.extent(1));
  Kokkos::deep_copy(h, plane);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.size());
}

/// Device copy of a host vector.
template <class MS, class T>
Kokkos::View<T*, MS> device_vector(std::vector<T> const& v, char const* label) {
  Kokkos::View<T*, MS> d(std::string(label), v.size());
  auto h = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < v.size(); ++i) h(i) = v[i];
  Kokkos::deep_copy(d, h);
  return d;
}

}  // namespace Impl
}  // namespace Exchange
}  // namespace KokkosMoE

#endif
