#ifndef KOKKOSMOE_EXCHANGE_HANDLE_HPP
#define KOKKOSMOE_EXCHANGE_HANDLE_HPP

/// \file KokkosMoE_Exchange_Handle.hpp
/// \brief The dispatch handle: what one dispatch delivered (the expert-major
/// rows this rank's experts read) and everything its combine needs to send
/// the experts' outputs back exactly, pinned to one placement generation and
/// one communicator epoch, with the ledger of both directions.
///
/// A handle is movable, not copyable: it owns the buffers of its step (the
/// expert rows and whatever its algorithm keeps for the reverse) until it is
/// destroyed; the exchange's workspace hands a buffer out again only when no
/// handle holds it.

#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>

#include <any>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief One all-to-all stage as dispatched, kept for its exact reverse.
template <class MemorySpace>
struct StageRecord {
  std::string name;
  int comm = 0;  ///< 0 = EP, 1 = node-local, 2 = relay
  std::vector<index_t> send_counts;  ///< by peer slot of the stage's communicator
  std::vector<index_t> recv_counts;
  /// Stage input row -> send position (rows are permuted before sending);
  /// empty when the stage sends its input in order.
  Kokkos::View<index_t*, MemorySpace> send_perm;
  index_t input_rows = 0;
};

/// \brief Result of a dispatch; pass it to the same exchange's combine.
/// \tparam T type of the hidden and expert rows (float or bf16_t).
template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct DispatchHandle {
  using memory_space = MemorySpace;
  using value_type = T;

  DispatchHandle() = default;
  DispatchHandle(DispatchHandle const&) = delete;
  DispatchHandle& operator=(DispatchHandle const&) = delete;
  DispatchHandle(DispatchHandle&&) = default;
  DispatchHandle& operator=(DispatchHandle&&) = default;

  // Identity.
  Algorithm algorithm = Algorithm::flat;
  int wave = 0;                  ///< pooled-wave: the wave this handle moved (0 otherwise)
  std::uint64_t generation = 0;  ///< placement generation of the routes
  std::uint64_t epoch = 0;       ///< communicator epoch of the exchange
  GenerationHandle generation_ref;  ///< registry reference (empty without a registry)

  // Sender side: the plans of the step (views shared with the caller).
  RoutePlan<MemorySpace> routes;
  DispatchPlan<MemorySpace> plan;

  // Receive side, expert-major: rows [expert_offsets[q], expert_offsets[q+1])
  // of expert_rows are for local slot q, in (local slot, source peer, send
  // position) order; the experts read them and write one output row each.
  std::vector<index_t> expert_counts;   ///< [L] rows per local slot
  std::vector<index_t> expert_offsets;  ///< [L + 1]
  Kokkos::View<index_t*, MemorySpace> expert_offsets_d;  ///< device copy of expert_offsets
  RowMatrix<T, MemorySpace> expert_rows;                 ///< [rows, d] decoded expert inputs
  /// Pooled-wave: per expert row, its source peer slot << 32 | the route's
  /// position among that source's routes to this rank. Sorting a slot's rows
  /// of all waves by it gives the flat exchange's order (empty otherwise).
  Kokkos::View<std::int64_t*, MemorySpace> arrival_key;

  /// EP-order receive split: rows from each source peer slot (all waves of a
  /// pooled-wave step together are this split minus drops). Flat and
  /// hierarchical: arrived_meta holds the metadata of the arrived rows in the
  /// flat arrival order (by source peer slot, then the source's send order)
  /// and repack maps them to expert-major; both are empty for pooled-wave.
  std::vector<index_t> recv_counts;
  Kokkos::View<RowMeta*, MemorySpace> arrived_meta;
  RepackPlan<MemorySpace> repack;

  /// Exchanges that return partial sums (hierarchical_dedup): how the
  /// gate-weighted combine must read the return buffer. combine_route_index
  /// [T, k] is the route plan's route_index with -1 for every route whose
  /// result arrives inside another route's row, and combine_gate (by route)
  /// the weight of each row that remains: the gate for a row of one route,
  /// 1 for a partial sum whose gates were applied where it was summed.
  /// Empty for exchanges that return one row per route (see combine_routes).
  Kokkos::View<index_t**, Kokkos::LayoutRight, MemorySpace> combine_route_index;
  Kokkos::View<float*, MemorySpace> combine_gate;

  ByteLedger ledger;     ///< this rank's moves (combine's filled by combine)
  std::any state;        ///< the algorithm's own record for the reverse

  // Completion. dispatch_start returns a handle whose rows are still moving
  // (delivered false): nothing may read expert_rows before dispatch_finish.
  // combine_start leaves the returned rows moving until combine_finish
  // (combined true). `flight` holds the transfer and its buffers meanwhile.
  bool delivered = false;
  bool combine_started = false;
  bool combined = false;
  RowsInFlight flight;
  std::any pending;      ///< the algorithm's record between start and finish
  PayloadBuffer<MemorySpace> pending_returned;  ///< a combine in flight: the caller's return buffer
  double seconds = 0;    ///< time spent inside this direction's start and finish

  index_t rows() const { return static_cast<index_t>(expert_rows.extent(0)); }
  int num_local_slots() const { return static_cast<int>(expert_counts.size()); }
};

/// \brief The routes as combine() (KokkosMoE_Combine.hpp) must read the
/// return buffer that h's combine filled: `routes` itself for an exchange
/// that returns one row per route, else `routes` with the handle's
/// combine_route_index and combine_gate (partial sums of a node-deduplicating
/// exchange, each added once with weight 1).
template <class T, class MS>
RoutePlan<MS> combine_routes(RoutePlan<MS> routes, DispatchHandle<T, MS> const& h) {
  if (h.combine_route_index.extent(0) == 0 && h.combine_gate.extent(0) == 0) return routes;
  routes.route_index = h.combine_route_index;
  routes.gate = h.combine_gate;
  return routes;
}

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
