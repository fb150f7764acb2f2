#ifndef KMOE_SIM_HPP
#define KMOE_SIM_HPP

// In-process multi-rank MoE pipeline used by the permutation tests: route
// tables -> route plans -> dispatch plans -> pack -> simulated all-to-all ->
// repack -> scalar experts -> unrepack -> simulated return -> combine.

#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_SimulatedExchange.hpp>

#include <vector>

namespace kmoe_test {

using MS = Kokkos::DefaultExecutionSpace::memory_space;
using Exec = Kokkos::DefaultExecutionSpace;

/// Host description of one rank's routes.
struct HostRoutes {
  int tokens = 0;
  int k = 0;
  std::vector<int> expert;     // [T*k]
  std::vector<float> gate;     // [T*k]
  std::vector<int> accepted;   // [T*k]
  std::vector<int> slot;       // [T*k] explicit slot (empty: locality choice)
};

inline KokkosMoE::RouteTable<MS> make_table(HostRoutes const& h, int experts) {
  KokkosMoE::RouteTable<MS> t("test::table", h.tokens, h.k, experts);
  auto e = Kokkos::create_mirror_view(t.expert);
  auto g = Kokkos::create_mirror_view(t.gate);
  auto a = Kokkos::create_mirror_view(t.accepted);
  for (int i = 0; i < h.tokens; ++i)
    for (int j = 0; j < h.k; ++j) {
      e(i, j) = h.expert[i * h.k + j];
      g(i, j) = h.gate[i * h.k + j];
      a(i, j) = static_cast<std::uint8_t>(h.accepted.empty() ? 1 : h.accepted[i * h.k + j]);
    }
  Kokkos::deep_copy(t.expert, e);
  Kokkos::deep_copy(t.gate, g);
  Kokkos::deep_copy(t.accepted, a);
  return t;
}

/// Everything one simulated rank holds after a forward pass.
struct SimRank {
  KokkosMoE::RoutePlan<MS> routes;
  KokkosMoE::DispatchPlan<MS> dispatch;
  KokkosMoE::PayloadBuffer<MS> send;
  Kokkos::View<KokkosMoE::RowMeta*, MS> meta;
  KokkosMoE::PayloadBuffer<MS> arrived;
  Kokkos::View<KokkosMoE::RowMeta*, MS> arrived_meta;
  KokkosMoE::RepackPlan<MS> repack;
  KokkosMoE::RowMatrix<float, MS> x_em;   // expert inputs (decoded, fp32)
  KokkosMoE::RowMatrix<float, MS> y_em;   // expert outputs
  KokkosMoE::PayloadBuffer<MS> back;      // expert outputs in arrival order
  KokkosMoE::PayloadBuffer<MS> returned;  // expert outputs in send order
  std::vector<KokkosMoE::index_t> recv_counts;
  KokkosMoE::index_t id_base = 0;
};

/// Scalar experts: y row = scale[expert of its local slot] * x row (fp32).
inline void scalar_experts(SimRank& r, KokkosMoE::Placement const& p, int rank, std::vector<float> const& scale) {
  auto const& slots = p.slots_of_rank(rank);
  KokkosMoE::RowMatrix<float, MS> y("test::y_em", r.x_em.extent(0), r.x_em.extent(1));
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r.x_em);
  auto hy = Kokkos::create_mirror_view(y);
  for (std::size_t q = 0; q < slots.size(); ++q) {
    float const s = scale[static_cast<std::size_t>(p.slot(slots[q]).expert)];
    for (auto i = r.repack.slot_offsets[q]; i < r.repack.slot_offsets[q + 1]; ++i)
      for (std::size_t c = 0; c < hx.extent(1); ++c) hy(i, c) = s * hx(i, c);
  }
  Kokkos::deep_copy(y, hy);
  r.y_em = y;
}

/// Runs the forward pipeline over simulated ranks. hidden[r] is [T_r, d].
inline std::vector<SimRank> simulate(KokkosMoE::Placement const& placement, std::vector<HostRoutes> const& routes,
                                     std::vector<KokkosMoE::RowMatrix<float, MS>> const& hidden, std::vector<int> const& peer_order,
                                     KokkosMoE::PayloadType type, std::vector<float> const& scale,
                                     KokkosMoE::ReplicaPolicy policy = KokkosMoE::ReplicaPolicy::locality,
                                     std::vector<int> const& node_of_rank = {}) {
  using namespace KokkosMoE;
  Exec exec;
  int const N = static_cast<int>(routes.size());
  int const d = static_cast<int>(hidden[0].extent(1));
  auto const dp = make_device_placement<MS>(placement);
  std::vector<SimRank> sim(static_cast<std::size_t>(N));
  std::vector<PayloadBuffer<MS>> sends;
  std::vector<Kokkos::View<RowMeta*, MS>> metas;
  std::vector<std::vector<index_t>> counts;
  index_t base = 0;
  for (int r = 0; r < N; ++r) {
    auto& s = sim[static_cast<std::size_t>(r)];
    auto table = make_table(routes[r], placement.num_experts());
    Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
    if (!routes[r].slot.empty()) {
      explicit_slot = Kokkos::View<int**, Kokkos::LayoutRight, MS>("test::explicit", routes[r].tokens, routes[r].k);
      auto h = Kokkos::create_mirror_view(explicit_slot);
      for (int i = 0; i < routes[r].tokens * routes[r].k; ++i) h.data()[i] = routes[r].slot[static_cast<std::size_t>(i)];
      Kokkos::deep_copy(explicit_slot, h);
    }
    auto choice = make_replica_choice<MS>(placement, r, node_of_rank.empty() ? -1 : node_of_rank[static_cast<std::size_t>(r)], policy);
    s.id_base = base;
    s.routes = make_route_plan(exec, table, dp, choice, r, base, explicit_slot);
    base += static_cast<index_t>(routes[r].tokens) * routes[r].k;
    s.dispatch = make_dispatch_plan(exec, s.routes, placement, peer_order);
    s.send = PayloadBuffer<MS>("test::send", type, d, s.dispatch.rows());
    s.meta = Kokkos::View<RowMeta*, MS>("test::meta", s.dispatch.rows());
    pack(exec, s.routes, s.dispatch, hidden[r], s.send, s.meta);
    sends.push_back(s.send);
    metas.push_back(s.meta);
    counts.push_back(s.dispatch.counts);
  }
  std::vector<std::vector<index_t>> recv_counts;
  std::vector<Kokkos::View<RowMeta*, MS>> recv_meta;
  auto arrived = simulated_alltoallv(exec, sends, counts, peer_order, recv_counts, metas, &recv_meta);
  std::vector<PayloadBuffer<MS>> backs;
  PayloadType const back_type = type == PayloadType::fp32 ? PayloadType::fp32 : PayloadType::bf16;
  for (int r = 0; r < N; ++r) {
    auto& s = sim[static_cast<std::size_t>(r)];
    s.arrived = arrived[r];
    s.arrived_meta = recv_meta[r];
    s.recv_counts = recv_counts[r];
    s.repack = make_repack_plan(exec, s.arrived_meta, placement, r);
    s.x_em = RowMatrix<float, MS>("test::x_em", s.repack.rows(), d);
    repack(exec, s.repack, s.arrived, s.x_em);
    scalar_experts(s, placement, r, scale);
    s.back = PayloadBuffer<MS>("test::back", back_type, d, s.repack.rows());
    unrepack(exec, s.repack, s.y_em, s.back);
    backs.push_back(s.back);
  }
  std::vector<std::vector<index_t>> ret_counts;
  auto returned = simulated_alltoallv(exec, backs, recv_counts, peer_order, ret_counts);
  for (int r = 0; r < N; ++r) sim[static_cast<std::size_t>(r)].returned = returned[r];
  return sim;
}

template <class V>
std::vector<typename V::non_const_value_type> to_host_vector(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.size());
}

}  // namespace kmoe_test

#endif
