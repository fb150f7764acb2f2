#ifndef KMOE_EXCHANGE_UTIL_HPP
#define KMOE_EXCHANGE_UTIL_HPP

// One distributed MoE step with scalar experts through any exchange
// algorithm, as the contract reads: route plan -> dispatch plan -> for every
// wave { exchange.dispatch -> scalar experts on the expert rows ->
// exchange.combine } -> combine.

#include "kmoe_sim.hpp"

#include <KokkosMoE_Exchange.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>

#include <numeric>
#include <random>

namespace kmoe_test {

struct StepResult {
  KokkosMoE::RowMatrix<float, MS> out;
  KokkosMoE::Exchange::ByteLedger ledger;  // this rank's (every wave)
  std::vector<KokkosMoE::index_t> arrival_ids;       // global route ids in arrival order (flat, hierarchical)
  std::vector<KokkosMoE::index_t> expert_major_ids;  // global route ids expert-major
  std::vector<KokkosMoE::index_t> slot_counts;       // rows per local slot (every wave)
  std::vector<KokkosMoE::index_t> send_counts;
  std::vector<KokkosMoE::index_t> recv_counts;
};

/// An exchange configuration with dispatch rows of `type` (returns in fp32
/// for fp32 rows, bf16 otherwise).
inline KokkosMoE::Exchange::ExchangeConfig exchange_config(KokkosMoE::PayloadType type,
                                                           KokkosMoE::Exchange::TransportOptions options = {}) {
  KokkosMoE::Exchange::ExchangeConfig c;
  c.payload = type;
  c.return_payload = type == KokkosMoE::PayloadType::fp32 ? KokkosMoE::PayloadType::fp32 : KokkosMoE::PayloadType::bf16;
  c.watchdog_seconds = options.watchdog_seconds;
  return c;
}

/// Scalar experts on expert-major rows: y = scale[expert of local slot q] * x.
inline KokkosMoE::RowMatrix<float, MS> scalar_expert_rows(KokkosMoE::RowMatrix<float, MS> const& x,
                                                         Kokkos::View<KokkosMoE::index_t*, MS> const& off,
                                                         KokkosMoE::Placement const& p, int rank, std::vector<float> const& scale) {
  auto const& slots = p.slots_of_rank(rank);
  std::vector<float> slot_scale;
  for (int s : slots) slot_scale.push_back(scale[static_cast<std::size_t>(p.slot(s).expert)]);
  KokkosMoE::Vector<float, MS> sc("test::slot_scale", slot_scale.size());
  auto hs = Kokkos::create_mirror_view(sc);
  for (std::size_t i = 0; i < slot_scale.size(); ++i) hs(i) = slot_scale[i];
  Kokkos::deep_copy(sc, hs);
  KokkosMoE::RowMatrix<float, MS> y("test::y", x.extent(0), x.extent(1));
  int const L = static_cast<int>(slot_scale.size());
  Kokkos::parallel_for(
      "test::scalar_experts",
      Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {static_cast<KokkosMoE::index_t>(x.extent(0)), static_cast<KokkosMoE::index_t>(x.extent(1))}),
      KOKKOS_LAMBDA(KokkosMoE::index_t i, KokkosMoE::index_t c) {
        int q = 0;
        while (q + 1 < L && off(q + 1) <= i) ++q;
        y(i, c) = sc(q) * x(i, c);
      });
  return y;
}

/// The route and dispatch plans of one rank's routes.
inline std::pair<KokkosMoE::RoutePlan<MS>, KokkosMoE::DispatchPlan<MS>> plans_of(KokkosMoE::Topology::CommunicatorSet const& comms,
                                                                                 KokkosMoE::Placement const& placement,
                                                                                 HostRoutes const& routes, int rank,
                                                                                 KokkosMoE::index_t id_base, int origin_node) {
  using namespace KokkosMoE;
  Exec exec;
  auto table = make_table(routes, placement.num_experts());
  Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
  if (!routes.slot.empty()) {
    explicit_slot = Kokkos::View<int**, Kokkos::LayoutRight, MS>("test::explicit", routes.tokens, routes.k);
    auto h = Kokkos::create_mirror_view(explicit_slot);
    for (int i = 0; i < routes.tokens * routes.k; ++i) h.data()[i] = routes.slot[static_cast<std::size_t>(i)];
    Kokkos::deep_copy(explicit_slot, h);
  }
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, rank, origin_node);
  auto rp = make_route_plan(exec, table, dp, choice, rank, id_base, explicit_slot);
  auto plan = make_dispatch_plan(exec, rp, placement, comms.ep().peer_order());
  return {rp, plan};
}

/// Virtual nodes of rpn consecutive ranks over the world.
inline KokkosMoE::Topology::Topology nodes_of(int rpn) {
  KokkosMoE::Topology::LayoutSpec s;
  s.kind = KokkosMoE::Topology::LayoutKind::virtual_nodes;
  s.ranks_per_node = rpn;
  return KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, s);
}

/// The node of every rank.
inline std::vector<int> nodes_vector(KokkosMoE::Topology::Topology const& t) {
  std::vector<int> n;
  for (int r = 0; r < t.size(); ++r) n.push_back(t.node_of(r));
  return n;
}

/// Round-robin placement of `experts` experts over the ranks of
/// node_of_rank (expert e on rank e mod ranks), plus one replica of expert
/// `replica` on the last rank.
inline KokkosMoE::Placement round_robin_with_replica(int experts, int replica, std::vector<int> const& node_of_rank) {
  int const size = static_cast<int>(node_of_rank.size());
  std::vector<KokkosMoE::SlotInfo> slots;
  for (int e = 0; e < experts; ++e) slots.push_back(KokkosMoE::SlotInfo{e, e % size, -1, 0, 0});
  slots.push_back(KokkosMoE::SlotInfo{replica, size - 1, -1, 0, 0});
  return KokkosMoE::Placement(experts, size, slots, node_of_rank);
}

/// Random routings: uniform, every route to rank 0, odd ranks without
/// tokens, one hot expert (every token's first route).
enum class Dist { uniform, one_rank, empty_ranks, hot_expert };

inline HostRoutes random_routes(Dist dist, int rank, int size, int experts, int k, std::mt19937& rng, int& tokens_out) {
  int tokens = 5 + static_cast<int>(rng() % 12);
  if (dist == Dist::empty_ranks && rank % 2 == 1) tokens = 0;
  HostRoutes h;
  h.tokens = tokens;
  h.k = k;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int const target_rank_expert = 0;  // expert 0 lives on rank 0
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> ids(static_cast<std::size_t>(experts));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int j = 0; j < k; ++j) {
      int e = ids[static_cast<std::size_t>(j)];
      if (dist == Dist::one_rank) e = (target_rank_expert + j * size) % experts;  // all on rank 0
      if (dist == Dist::hot_expert && j == 0) e = 1;
      if (dist == Dist::hot_expert && j > 0 && e == 1) e = ids[static_cast<std::size_t>(k)];
      h.expert.push_back(e);
      h.gate.push_back(u(rng));
      h.accepted.push_back(1);
    }
  }
  tokens_out = tokens;
  return h;
}

/// The planner tests' cluster: nodes of half the ranks (one node for one
/// rank or an odd count), 3 P + 1 experts round robin plus a replica of
/// expert 1 on the last rank, every expert's scale 1.5.
struct PlannerLayout {
  int rpn;
  KokkosMoE::Topology::Topology topo;
  std::vector<int> nor;
  int experts;
  KokkosMoE::Placement placement;
  std::vector<float> scale;
  explicit PlannerLayout(int size)
      : rpn(size % 2 == 0 && size > 1 ? size / 2 : size),
        topo(nodes_of(rpn)),
        nor(nodes_vector(topo)),
        experts(3 * size + 1),
        placement(round_robin_with_replica(experts, 1, nor)),
        scale(static_cast<std::size_t>(experts), 1.5f) {}
};

/// One case's top-3 routes of `dist` (drawn from seed + rank + 10 dist),
/// this rank's route plan and every rank's, gathered: what the planner
/// reads. Collective over MPI_COMM_WORLD.
struct PlannerRoutes {
  HostRoutes routes;
  int tokens = 0;
  KokkosMoE::RoutePlan<MS> mine;
  KokkosMoE::Exchange::RankRoutePlans all;
};
inline PlannerRoutes planner_routes(PlannerLayout const& l, Dist dist, unsigned seed, int rank, int size) {
  using namespace KokkosMoE;
  PlannerRoutes r;
  std::mt19937 rng(seed + static_cast<unsigned>(rank) + 10u * static_cast<unsigned>(dist));
  r.routes = random_routes(dist, rank, size, l.experts, 3, rng, r.tokens);
  Kokkos::DefaultExecutionSpace exec;
  auto table = make_table(r.routes, l.experts);
  r.mine = make_route_plan(exec, table, make_device_placement<MS>(l.placement),
                           make_replica_choice<MS>(l.placement, rank, l.nor[static_cast<std::size_t>(rank)]), rank);
  r.all = Exchange::allgather_routes(MPI_COMM_WORLD, r.mine);
  return r;
}

/// Global route ids: bases[r] is the id of rank r's first route when every
/// rank has `mine` routes of its own; total is all ranks' routes.
/// Collective over MPI_COMM_WORLD.
struct RouteBases {
  std::vector<KokkosMoE::index_t> bases;
  KokkosMoE::index_t total = 0;
};
inline RouteBases route_bases(KokkosMoE::index_t mine) {
  RouteBases r;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  r.bases.resize(static_cast<std::size_t>(size));
  MPI_Allgather(&mine, 1, MPI_INT64_T, r.bases.data(), 1, MPI_INT64_T, MPI_COMM_WORLD);
  for (auto& b : r.bases) {
    KokkosMoE::index_t const c = b;
    b = r.total;
    r.total += c;
  }
  return r;
}

/// One step through an exchange (any algorithm of the contract) built on
/// `placement`. bases[r] is the global route id of rank r's first route.
template <class ExchangeT>
StepResult run_step(ExchangeT& xchg, KokkosMoE::Placement const& placement, HostRoutes const& routes,
                    KokkosMoE::RowMatrix<float, MS> const& hidden, std::vector<float> const& scale, int rank,
                    KokkosMoE::index_t id_base, std::vector<KokkosMoE::index_t> const& bases, int origin_node = -1) {
  using namespace KokkosMoE;
  Exec exec;
  auto const [rp, plan] = plans_of(xchg.communicators(), placement, routes, rank, id_base, origin_node);
  PayloadBuffer<MS> returned("test::returned", xchg.config().return_payload, static_cast<int>(hidden.extent(1)), plan.rows());
  // Every row of the return buffer must be written by the combines (zeros
  // for dropped routes): stale bytes would show as NaNs in the output.
  Kokkos::deep_copy(returned.bytes, static_cast<unsigned char>(0xFF));
  StepResult r;
  RoutePlan<MS> combine_routes = rp;  // a deduplicating exchange's partial sums are read through its handle
  for (int w = 0; w < xchg.waves(); ++w) {
    auto h = xchg.dispatch(exec, rp, plan, hidden, w);
    auto y = scalar_expert_rows(h.expert_rows, h.expert_offsets_d, placement, rank, scale);
    xchg.combine(exec, h, y, returned);
    combine_routes = Exchange::combine_routes(rp, h);
    r.ledger.append(h.ledger);
    if (r.slot_counts.empty()) r.slot_counts.assign(h.expert_counts.size(), 0);
    for (std::size_t q = 0; q < h.expert_counts.size(); ++q) r.slot_counts[q] += h.expert_counts[q];
    if (w == 0) {
      r.recv_counts = h.recv_counts;
      auto am = to_host_vector(h.arrived_meta);
      for (auto const& m : am) r.arrival_ids.push_back(bases.empty() ? m.route : bases[static_cast<std::size_t>(m.origin_rank)] + m.route);
      auto perm = to_host_vector(h.repack.perm);
      for (auto p : perm) r.expert_major_ids.push_back(r.arrival_ids[static_cast<std::size_t>(p)]);
    }
  }
  r.out = RowMatrix<float, MS>("test::out", routes.tokens, hidden.extent(1));
  combine(exec, combine_routes, plan, returned, r.out);
  r.send_counts = plan.counts;
  return r;
}

}  // namespace kmoe_test

#endif
