#ifndef KOKKOSMOE_EXCHANGE_HANDLE_HPP
#define KOKKOSMOE_EXCHANGE_HANDLE_HPP

/// \file KokkosMoE_Exchange_Handle.hpp
/// \brief The dispatch handle: everything combine needs to reverse a dispatch
/// exactly, pinned to one placement generation and one communicator epoch.

#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>

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
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct DispatchHandle {
  using memory_space = MemorySpace;
  std::string algorithm;
  std::uint64_t generation = 0;  ///< placement generation of the routes
  std::uint64_t epoch = 0;       ///< communicator epoch of the exchange
  GenerationHandle generation_ref;  ///< registry reference (empty without a registry)
  DispatchPlan<MemorySpace> plan;   ///< source side: counts, offsets, permutation, inverse
  /// EP-order receive split (rows from each source peer slot), identical for
  /// every algorithm: arrived rows are in flat arrival order.
  std::vector<index_t> recv_counts;
  std::vector<index_t> recv_offsets;
  PayloadBuffer<MemorySpace> arrived;            ///< rows in arrival order
  Kokkos::View<RowMeta*, MemorySpace> arrived_meta;
  RepackPlan<MemorySpace> repack;                ///< arrival -> expert-major
  std::vector<StageRecord<MemorySpace>> stages;  ///< hierarchical stages
  /// Arrival position -> position in the rows as they came off the last
  /// stage (hierarchical); empty when arrival order is the transport order.
  Kokkos::View<index_t*, MemorySpace> canonical_from;
  ByteLedger ledger;  ///< this rank's moves (dispatch; combine filled by combine)
  bool combined = false;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
