#ifndef KOKKOSMOE_EXCHANGE_PLANNER_HPP
#define KOKKOSMOE_EXCHANGE_PLANNER_HPP

/// \file KokkosMoE_Exchange_Planner.hpp
/// \brief The ledgers the flat, hierarchical and pooled-wave exchanges would
/// report, computed from the routes alone (no data moves, no MPI): used to
/// study clusters one does not have (thousands of simulated ranks in one
/// process) and checked against the ledgers the real exchanges measure.
/// No time is computed.

#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_Exchange_PooledWaveShape.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Host route plans, one per rank (index = global rank).
using RankRoutePlans = std::vector<RoutePlan<Kokkos::HostSpace>>;

/// \brief Collective over comm: every rank's route plan, on every rank, in
/// host memory (index = rank in comm).
template <class MS>
RankRoutePlans allgather_routes(MPI_Comm comm, RoutePlan<MS> const& mine);

/// \brief Everything a planned exchange depends on.
struct PlanInput {
  Topology::Topology const& topology;
  Topology::CommLayout const& layout;
  RankRoutePlans const& routes;    ///< every rank's accepted routes
  Placement const& placement;      ///< where their slots live
  ExchangeConfig const& config;    ///< payloads, pooled-wave shape
  int width;                       ///< hidden width d
  /// The rows' own type (the exchange's T: fp32 for float, bf16 for
  /// bf16_t): with payloads of that type the flat exchange moves rows
  /// straight to and from their expert-major places (ExchangeConfig::receive_into_experts).
  PayloadType rows = PayloadType::fp32;
  /// Whether the exchange's rows are in memory MPI reads as host memory (the
  /// default memory space's, unless told): there, with every rank on one
  /// host, the flat exchange over MPI sends each peer its rows as one message
  /// gathered from the hidden rows (ExchangeBase::sends_from_hidden), not
  /// one message per slot run.
  bool host_rows = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Kokkos::DefaultExecutionSpace::memory_space>::accessible;
};

/// \brief Per-rank ledgers (index = global rank) of the flat exchange.
std::vector<ByteLedger> plan_flat(PlanInput const& in);

/// \brief Per-rank ledgers of the hierarchical exchange (relays and rails of the layout).
std::vector<ByteLedger> plan_hierarchical(PlanInput const& in);

/// \brief The unit record of node deduplication (hierarchical_dedup): int32
/// fields [origin rank, routes n, then per route (physical slot,
/// destination rank, route = token * top_k + k-slot, float32 gate)], top_k
/// route entries (unused ones zero), so its width is fixed by top_k.
struct UnitMeta {
  static constexpr int header = 2;
  static constexpr int per_route = 4;
  static int ints(int top_k) { return header + per_route * top_k; }
  static std::int64_t bytes(int top_k) { return static_cast<std::int64_t>(ints(top_k)) * 4; }
  static char const* schema() {
    return "int32 origin_rank, int32 routes, top_k x (int32 slot, int32 dest_rank, int32 route, float32 gate)";
  }
};

/// \brief Per-rank ledgers of the node-deduplicating hierarchical exchange
/// (one unit per token and remote node; relays and rails of the layout).
std::vector<ByteLedger> plan_hierarchical_dedup(PlanInput const& in);

/// \brief Per-rank ledgers of the pooled-wave exchange, drops included.
std::vector<ByteLedger> plan_pooled_wave(PlanInput const& in);

/// \brief Sum of per-rank ledgers.
ByteLedger sum_ledgers(std::vector<ByteLedger> const& ledgers);

/// \brief Maxima that matter at scale: inter-node payload bytes a node sends
/// (dispatch), payload bytes a relay forwards between nodes, rows a relay
/// handles (forwarded + scattered), and directed inter-node message pairs of
/// a node.
struct LedgerMaxima {
  std::int64_t node_inter_bytes = 0;
  int node_inter_bytes_node = -1;
  std::int64_t node_inter_messages = 0;
  std::int64_t relay_inter_bytes = 0;
  int relay_inter_bytes_rank = -1;
  std::int64_t relay_rows = 0;
  int relay_rows_rank = -1;
};
LedgerMaxima ledger_maxima(Topology::Topology const& topo, std::vector<ByteLedger> const& ledgers);

namespace Impl {
RoutePlan<Kokkos::HostSpace> gathered_route_plan(int origin_rank, index_t num_tokens, int top_k, index_t id_base,
                                                 std::uint64_t generation, std::vector<int> const* fields, std::vector<float> gate);
std::vector<std::vector<int>> allgather_ints(MPI_Comm comm, std::vector<int> const& mine);
std::vector<std::vector<float>> allgather_floats(MPI_Comm comm, std::vector<float> const& mine);
std::vector<std::vector<std::int64_t>> allgather_int64s(MPI_Comm comm, std::vector<std::int64_t> const& mine);
}  // namespace Impl

template <class MS>
RankRoutePlans allgather_routes(MPI_Comm comm, RoutePlan<MS> const& mine) {
  auto const h = to_host(mine);
  auto ints = [](Kokkos::View<int*, Kokkos::HostSpace> const& v) { return std::vector<int>(v.data(), v.data() + v.extent(0)); };
  // Per rank: its header, then token, k-slot, expert, slot, destination rank, and the gates.
  std::vector<int> const header = {h.origin_rank, static_cast<int>(h.num_tokens), h.top_k};
  std::vector<std::vector<std::vector<int>>> all;
  for (auto const& f : {header, ints(h.token), ints(h.kslot), ints(h.expert), ints(h.slot), ints(h.dest_rank)})
    all.push_back(Impl::allgather_ints(comm, f));
  auto const gates = Impl::allgather_floats(comm, std::vector<float>(h.gate.data(), h.gate.data() + h.gate.extent(0)));
  auto const bases = Impl::allgather_int64s(comm, {static_cast<std::int64_t>(h.id_base), static_cast<std::int64_t>(h.generation)});
  RankRoutePlans out;
  for (std::size_t r = 0; r < gates.size(); ++r) {
    std::vector<int> const fields[5] = {all[1][r], all[2][r], all[3][r], all[4][r], all[5][r]};
    out.push_back(Impl::gathered_route_plan(all[0][r][0], all[0][r][1], all[0][r][2], bases[r][0],
                                            static_cast<std::uint64_t>(bases[r][1]), fields, gates[r]));
  }
  return out;
}

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
