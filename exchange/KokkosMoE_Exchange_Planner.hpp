#ifndef KOKKOSMOE_EXCHANGE_PLANNER_HPP
#define KOKKOSMOE_EXCHANGE_PLANNER_HPP

/// \file KokkosMoE_Exchange_Planner.hpp
/// \brief The ledgers the flat, hierarchical and pooled-wave exchanges would
/// report, computed from the routes alone (no data moves, no MPI): used to
/// study clusters one does not have (thousands of simulated ranks in one
/// process) and checked against the ledgers the real exchanges measure.
/// No time is computed.

#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_Exchange_PooledWave.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief The accepted routes of one rank in route order (token-major, then
/// k-slot): destination global rank and local slot index at the destination.
struct RankRoutes {
  std::vector<int> dest;
  std::vector<int> local_slot;
};

/// \brief Collective over comm: every rank's routes, on every rank (index =
/// rank in comm).
std::vector<RankRoutes> allgather_routes(MPI_Comm comm, RankRoutes const& mine);

/// \brief Row formats of a planned exchange.
struct PlanFormat {
  PayloadType payload = PayloadType::bf16;
  PayloadType return_payload = PayloadType::bf16;
  int width = 0;
};

/// \brief Per-rank ledgers (index = global rank) of the flat exchange.
std::vector<ByteLedger> plan_flat(Topology::Topology const& topo, Topology::CommLayout const& layout,
                                  std::vector<RankRoutes> const& routes, PlanFormat const& format);

/// \brief Per-rank ledgers of the hierarchical exchange (relays and rails of layout).
std::vector<ByteLedger> plan_hierarchical(Topology::Topology const& topo, Topology::CommLayout const& layout,
                                          std::vector<RankRoutes> const& routes, PlanFormat const& format);

/// \brief Per-rank ledgers of the pooled-wave exchange, drops included
/// (config.local_experts is the static L).
std::vector<ByteLedger> plan_pooled_wave(Topology::Topology const& topo, Topology::CommLayout const& layout,
                                         std::vector<RankRoutes> const& routes, PlanFormat const& format,
                                         PooledWaveConfig const& config);

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

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
