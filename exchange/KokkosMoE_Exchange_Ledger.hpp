#ifndef KOKKOSMOE_EXCHANGE_LEDGER_HPP
#define KOKKOSMOE_EXCHANGE_LEDGER_HPP

/// \file KokkosMoE_Exchange_Ledger.hpp
/// \brief Byte ledgers: what an exchange moved, per direction and stage,
/// split by link class (same rank, intra-node, inter-node). These are logical
/// bytes of the declared row representation, never converted into time.

#include <KokkosMoE_EnumNames.hpp>

#include <mpi.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Where a row goes relative to its sender.
enum class LinkClass : int { same_rank = 0, intra_node = 1, inter_node = 2 };
constexpr int num_link_classes = 3;

inline EnumTable<LinkClass> const& names_of(LinkClass) {
  static EnumTable<LinkClass> const t{"link class",
                                      {{LinkClass::same_rank, "same_rank"},
                                       {LinkClass::intra_node, "intra_node"},
                                       {LinkClass::inter_node, "inter_node"}}};
  return t;
}

/// \brief Counts of one link class.
struct ClassCounts {
  std::int64_t rows = 0;
  std::int64_t payload_bytes = 0;
  std::int64_t meta_bytes = 0;
  /// Messages the rows travel in (local copies for same_rank): per
  /// (sender, receiver) pair with rows, the payload's and, where rows carry
  /// metadata, the metadata's, each one message or one per run when a
  /// stage sends runs separately (transfer_messages: the MPI transport's
  /// rule; NCCL sends every run on its own). Count agreements are not rows
  /// and not counted here.
  std::int64_t messages = 0;
  /// Directed (sender, receiver) pairs whose transfers carried payload rows
  /// (each pair once per stage, however many transfers or messages it
  /// took); summed over stages and ranks it counts pair-stages.
  std::int64_t pairs = 0;
  /// Node deduplication (hierarchical_dedup): rows this class did not carry
  /// because one row stood for several routes of a token (routes carried
  /// minus rows), and their payload bytes.
  std::int64_t dedup_saved_rows = 0;
  std::int64_t dedup_saved_bytes = 0;
};

/// \brief One stage of one direction (e.g. "gather to relay").
struct StageLedger {
  std::string name;
  std::string communicator;
  std::array<ClassCounts, num_link_classes> by_class{};
  std::int64_t relay_rows = 0;   ///< rows this stage moves only because of relaying
  std::int64_t relay_bytes = 0;  ///< their payload + metadata bytes
  std::int64_t padding_rows = 0; ///< rows that carry no route (static shapes; MPI does not send them)
  std::int64_t header_rows = 0;  ///< in-band header rows (pooled-wave)
  /// The same-rank rows are written where they arrive (or read where they
  /// are): they count as delivered, but nothing copies them.
  bool self_in_place = false;
  /// Communicators of count rounds the stage runs besides the one over its
  /// own (each a count message to every peer): a hierarchical dispatch that
  /// receives into the expert rows agrees every rank's slot counts over EP
  /// in its first stage.
  std::vector<std::string> extra_count_rounds{};
  double seconds = 0;             ///< wall time of the stage on this rank (max over ranks once reduced); 0 when planned
  /// Receivers add_sends counted a pair for already (this rank's stage
  /// only: not reported, compared or reduced).
  std::vector<int> paired{};

  ClassCounts total() const;
};

/// \brief One direction (dispatch or combine).
struct DirectionLedger {
  std::vector<StageLedger> stages;
  std::int64_t useful_rows = 0;     ///< routes carried (each counted once, at its final destination)
  std::int64_t sender_drops = 0;    ///< routes the sender could not place (static shapes)
  std::int64_t receiver_drops = 0;  ///< routes the receiver could not place (static shapes)
  /// Rows need no repack copy at their ends: dispatched rows land in their
  /// expert rows, results leave from them (ExchangeConfig::
  /// receive_into_experts); the cost model prices no decode or encode pass then.
  bool rows_in_place = false;

  /// \brief Sum over stages for one class.
  ClassCounts by_class(LinkClass c) const;
  std::int64_t relay_rows() const;
  std::int64_t relay_bytes() const;
  std::int64_t padding_rows() const;
  /// \brief Payload bytes that crossed nodes (all stages).
  std::int64_t inter_node_payload_bytes() const { return by_class(LinkClass::inter_node).payload_bytes; }
  /// \brief Directed rank pairs that carried payload, summed over stages.
  std::int64_t pairs() const;
};

/// \brief The ledger of one exchange call (or a sum of calls / ranks).
struct ByteLedger {
  std::string algorithm;  ///< flat, hierarchical, pooled_wave
  std::string payload;    ///< dispatch payload type name
  std::string combine_payload;  ///< combine (return) payload type name
  int width = 0;
  std::int64_t row_bytes = 0;          ///< dispatch row bytes
  std::int64_t combine_row_bytes = 0;  ///< combine row bytes
  std::int64_t meta_row_bytes = 0;
  int ranks = 1;          ///< ranks summed into this ledger
  DirectionLedger dispatch;
  DirectionLedger combine;

  /// \brief JSON object text (every field, per stage and class, plus totals).
  std::string to_json(int indent = 2) const;
  /// \brief Adds another ledger of the same algorithm and stage structure
  /// (another rank's, or another step's).
  void accumulate(ByteLedger const& other);
  /// \brief Appends the ledger of the call that followed this one on the same
  /// rank (the next wave of a step): stages are concatenated per direction,
  /// useful rows and drops summed. An empty ledger (no algorithm) becomes a
  /// copy of `next`.
  void append(ByteLedger const& next);
  /// \brief Collective over comm: the sum of every rank's ledger, on every
  /// rank (stage times: the slowest rank's), under the watchdog when > 0.
  ByteLedger reduced(MPI_Comm comm, double watchdog_seconds = 0.0) const;
  /// \brief Human-readable table (one line per direction, stage and class).
  std::string table() const;
};

/// \brief Throws Error unless the hierarchical ledger's inter-node payload
/// bytes equal the flat one's in both directions (same routes).
void check_inter_node_equal(ByteLedger const& flat, ByteLedger const& hierarchical);

/// \brief Messages that carry `rows` rows of `row_bytes` bytes laid out in
/// `runs` separate runs (> 0 rows each) from one rank to one peer: one
/// contiguous message per run, so that large runs take an MPI's single-copy
/// path, unless the runs average under 64 KiB; then one message of an
/// indexed datatype (the MPI packs them). The transport sends runs by this
/// rule and the planner predicts it.
inline std::int64_t transfer_messages(std::int64_t runs, std::int64_t rows, std::int64_t row_bytes) {
  if (rows <= 0 || runs <= 0) return 0;
  return runs > 1 && rows * row_bytes < runs * (std::int64_t(64) << 10) ? 1 : runs;
}

/// \brief Adds one stage's moves to `stage` from this rank's perspective:
/// rows[p] rows go to peer p (global rank peer_global[p]); me is the sender.
/// runs[p] (when given) is the number of runs those rows travel in (see
/// transfer_messages), 1 otherwise; their metadata travels in meta_runs[p]
/// runs where given, else in the same runs as the rows. routes[p] (when
/// given) is the number of routes those rows stand for (node
/// deduplication); the rows and bytes that saved are counted per class.
void add_sends(StageLedger& stage, std::vector<std::int64_t> const& rows, std::vector<int> const& peer_global, int me,
               std::vector<int> const& node_of_rank, std::int64_t row_bytes, std::int64_t meta_row_bytes,
               std::vector<std::int64_t> const* runs = nullptr, std::vector<std::int64_t> const* meta_runs = nullptr,
               std::vector<std::int64_t> const* routes = nullptr);

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
