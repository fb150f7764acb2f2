#ifndef KOKKOSMOE_MIGRATION_HPP
#define KOKKOSMOE_MIGRATION_HPP

/// \file KokkosMoE_Migration.hpp
/// \brief Migration between two placements of the same experts on the same
/// ranks: one action per target slot, its source slot and bytes, the peak
/// resident bytes during the switch, and the execution over MPI with digest
/// verification.
///
/// Actions, decided per target slot t (expert e, rank r, node n):
///  - retain: r holds e in the source placement in a slot not yet claimed by
///    another target slot of r; the storage of that source slot becomes t
///    (no bytes move). A source slot with the same id as t is claimed first,
///    then the lowest unclaimed one.
///  - same_rank_duplicate: r holds e in the source placement but every such
///    slot is already retained by another target slot; a local copy from the
///    lowest of them.
///  - same_node_copy: another rank of node n holds e; copied from the lowest
///    such source slot.
///  - cross_node_copy: only ranks of other nodes hold e; copied from the
///    lowest such source slot.
/// Source preference is therefore: same rank, then same node, then lowest slot.
///
/// Peak resident bytes during the overlap (old and new weights coexist):
///   peak(r) = sum of bytes of every source slot of r
///           + sum of bytes of every target slot of r whose action is not retain
/// (a retained slot shares the storage of its source slot and is counted
/// once). The plan reports peak(r) for every rank, its maximum and its sum.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Placement.hpp>

#include <mpi.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

enum class MigrationAction { retain = 0, same_rank_duplicate = 1, same_node_copy = 2, cross_node_copy = 3 };
constexpr int kNumMigrationActions = 4;
/// \brief "retain", "same_rank_duplicate", "same_node_copy", "cross_node_copy".
inline EnumTable<MigrationAction> const& names_of(MigrationAction) {
  static EnumTable<MigrationAction> const t{"migration action",
                                            {{MigrationAction::retain, "retain"},
                                             {MigrationAction::same_rank_duplicate, "same_rank_duplicate"},
                                             {MigrationAction::same_node_copy, "same_node_copy"},
                                             {MigrationAction::cross_node_copy, "cross_node_copy"}}};
  return t;
}

/// \brief What happens to one target slot.
struct MigrationStep {
  int target_slot = -1;
  int expert = -1;
  int target_rank = -1;
  int target_node = -1;
  MigrationAction action = MigrationAction::retain;
  int source_slot = -1;  ///< the source-placement slot the parameters come from (or stay in)
  int source_rank = -1;
  int source_node = -1;
  std::int64_t bytes = 0;  ///< parameter bytes of the slot (moved unless the action is retain)
};

/// \brief Bytes and counts per action class (index: MigrationAction). For
/// retain the bytes are kept in place, for the other classes they move.
struct MigrationBytes {
  std::array<std::int64_t, kNumMigrationActions> bytes{};  ///< retain: bytes kept in place
  std::array<std::int64_t, kNumMigrationActions> count{};
  std::int64_t bytes_of(MigrationAction a) const { return bytes[static_cast<std::size_t>(a)]; }
  std::int64_t count_of(MigrationAction a) const { return count[static_cast<std::size_t>(a)]; }
};

/// \brief One action per target slot (steps[t] is target slot t).
struct MigrationPlan {
  std::uint64_t source_generation = 0, target_generation = 0;
  int num_experts = 0, num_ranks = 0, source_slots = 0, target_slots = 0;
  std::vector<std::int64_t> bytes_of_expert;  ///< [E]
  std::vector<MigrationStep> steps;           ///< [target slots]
  /// Per action class: bytes moved (same-rank copies, same-node and
  /// cross-node sends) and, for retain, bytes kept in place.
  MigrationBytes totals;
  std::vector<std::int64_t> source_resident_bytes;  ///< [ranks] before
  std::vector<std::int64_t> target_resident_bytes;  ///< [ranks] after
  std::vector<std::int64_t> peak_resident_bytes;    ///< [ranks] during the overlap (formula above)
  std::int64_t peak_resident_bytes_max = 0;
  std::int64_t peak_resident_bytes_total = 0;
  /// \brief Bytes sent by `rank` per action class (same-rank duplicates count as local copies).
  MigrationBytes sent_by(int rank) const;
  /// \brief Bytes received (or copied locally, or retained) by `rank` per action class.
  MigrationBytes received_by(int rank) const;
  /// \brief Content digest of the plan, for agreement checks across ranks.
  std::uint64_t fingerprint() const;
};

/// \brief Plans the switch from `source` to `target` (same experts and
/// ranks). bytes_of_expert: parameter bytes of each expert ([E], >= 0).
/// Nodes come from the slots' node fields, which must be set (build the
/// placements with a rank -> node map). Throws Error naming what differs.
MigrationPlan plan_migration(Placement const& source, Placement const& target,
                             std::vector<std::int64_t> const& bytes_of_expert);
/// \brief Same, every expert has bytes_per_expert bytes.
MigrationPlan plan_migration(Placement const& source, Placement const& target, std::int64_t bytes_per_expert);

/// \brief Host parameter bytes of one slot.
using ParameterBlob = std::vector<unsigned char>;

/// \brief Execution options.
struct MigrationOptions {
  /// Check every local source blob against its source slot digest before
  /// anything moves (a mismatch is a collective error naming the slot).
  bool verify_sources = true;
  /// Largest single message; bigger blobs are sent in several messages.
  std::int64_t max_message_bytes = std::int64_t(1) << 30;
};

/// \brief What execute_migration did.
struct MigrationLedger {
  MigrationBytes sent;      ///< this rank: bytes handed to MPI_Isend (copies) or memcpy (duplicates), per class
  MigrationBytes received;  ///< this rank: bytes of completed receives (MPI_Get_count), local copies and retains
  MigrationBytes sent_total;  ///< sum of `sent` over all ranks
  std::int64_t messages_sent = 0, messages_received = 0;
  std::vector<std::uint64_t> target_digests;  ///< digest of every local target blob, local slot order
};

/// \brief Collective over comm (size == the placements' rank count, rank i
/// of comm is placement rank i): moves expert parameters from the source
/// placement's slots to the target placement's slots following `plan`.
/// \param source_blobs  one blob per local source slot (source.slots_of_rank(me) order),
///                      of bytes_of_expert[expert] bytes each
/// \param target_blobs  out: one blob per local target slot (target.slots_of_rank(me) order)
/// Same-rank actions are local copies (never messages); other copies are
/// nonblocking point-to-point messages on a duplicate of comm, posted in
/// target-slot order on every rank. Before anything moves, every rank checks
/// that all ranks hold the same plan, that the blobs have the planned sizes,
/// that every target slot's digest equals its source slot's digest and
/// (verify_sources) that each local source blob matches its digest. After the
/// transfer every target blob's digest is compared with its source slot's
/// digest. Every failure is a CollectiveError on all ranks naming the slot,
/// ranks and digests.
MigrationLedger execute_migration(MPI_Comm comm, MigrationPlan const& plan, Placement const& source,
                                  Placement const& target, std::vector<ParameterBlob> const& source_blobs,
                                  std::vector<ParameterBlob>& target_blobs, MigrationOptions const& options = {});

/// \brief Collective: every rank passes the digests of its local slots
/// (placement.slots_of_rank(me) order); every rank gets all slots' digests in
/// slot order (for PlacementRegistry::publish).
std::vector<std::uint64_t> gather_slot_digests(MPI_Comm comm, Placement const& placement,
                                               std::vector<std::uint64_t> const& local_digests);

}  // namespace KokkosMoE

#endif
