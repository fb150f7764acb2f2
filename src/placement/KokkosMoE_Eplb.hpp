#ifndef KOKKOSMOE_EPLB_HPP
#define KOKKOSMOE_EPLB_HPP

/// \file KokkosMoE_Eplb.hpp
/// \brief Placement policies for L layers at once: contiguous, round-robin,
/// explicit slot lists and the EPLB solver (hierarchical and global), plus
/// the ideal per-rank load of any placement.
///
/// EPLB (expert-parallel load balancer) for one layer with loads l[E],
/// S physical slots, G expert groups, N nodes and R ranks (GPUs):
///  1. sum the load of every contiguous group of E/G experts and pack the G
///     groups onto the N nodes (balanced packing, G/N groups per node);
///  2. on every node, start from one copy of each of its experts (ascending
///     logical id) and add S/N - E/N redundant copies one at a time, each to
///     the expert with the largest load/copies (ties: lowest logical id);
///     a copy's replica rank is the expert's copy count before it was added;
///  3. pack the node's S/N copies (in the order of step 2: first copies, then
///     redundant copies in creation order) onto its R/N ranks with the same
///     balanced packing, weighting each copy by load/copies.
/// Balanced packing: items sorted by weight descending (stable sort, so
/// equal weights keep their order); each item goes to the lightest pack that
/// still has room (ties: lowest pack); every pack receives the same number
/// of items; an item's position in its pack is the order it arrived in.
/// Hierarchical mode needs G % N == 0; otherwise (or when eplb_global is
/// requested) the same routine runs with one group and one node (global
/// mode). Ranks are node-major: node n holds ranks [n R/N, (n+1) R/N), and
/// slot ids are rank-major: slot = rank * (S/R) + position in the pack.
///
/// Arithmetic: when every load is a non-negative integer (<= 2^53) and the
/// scaled sums fit in 63 bits, all comparisons are exact (per-copy loads are
/// scaled by the least common multiple of the copy counts); otherwise they
/// use double precision, in a fixed order.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Placement.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief How a layer's placement is built.
enum class PlacementPolicy {
  contiguous,         ///< Placement::contiguous: one copy, rank e * R / E
  round_robin,        ///< Placement::round_robin: one copy, rank e % R
  explicit_slots,     ///< the caller's slot list
  eplb,               ///< eplb_hierarchical when groups % nodes == 0, else eplb_global
  eplb_hierarchical,  ///< EPLB with group -> node packing (groups % nodes == 0 required)
  eplb_global,        ///< EPLB with one group and one node
};
/// \brief "contiguous", "round_robin", "explicit", "eplb", "eplb_hierarchical", "eplb_global".
inline EnumTable<PlacementPolicy> const& names_of(PlacementPolicy) {
  static EnumTable<PlacementPolicy> const t{"placement policy",
                                            {{PlacementPolicy::contiguous, "contiguous"},
                                             {PlacementPolicy::round_robin, "round_robin"},
                                             {PlacementPolicy::explicit_slots, "explicit"},
                                             {PlacementPolicy::eplb, "eplb"},
                                             {PlacementPolicy::eplb_hierarchical, "eplb_hierarchical"},
                                             {PlacementPolicy::eplb_global, "eplb_global"}}};
  return t;
}

/// \brief True for the EPLB policies (eplb, eplb_hierarchical, eplb_global).
inline bool is_eplb(PlacementPolicy p) {
  return p == PlacementPolicy::eplb || p == PlacementPolicy::eplb_hierarchical || p == PlacementPolicy::eplb_global;
}

/// \brief Inputs of a placement policy besides the loads.
struct PlacementSpec {
  PlacementPolicy policy = PlacementPolicy::eplb;
  int physical_slots = 0;  ///< S (EPLB only; must be a multiple of ranks and >= experts)
  int groups = 1;          ///< G expert groups (EPLB hierarchical: experts % groups == 0)
  int nodes = 1;           ///< N nodes; ranks % nodes == 0; ranks are node-major
  int ranks = 1;           ///< R ranks (GPUs) of the EP communicator
  std::uint64_t version = 0;     ///< checkpoint version written into every slot
  std::uint64_t generation = 0;  ///< generation id of the built placements
  /// explicit_slots: one slot list per layer, or one list used for every layer.
  std::vector<std::vector<SlotInfo>> explicit_slots;
};

/// \brief Ideal per-rank load of a placement: rank r carries load[e]/copies(e)
/// for every slot of expert e it holds.
struct RankLoadSummary {
  std::vector<double> rank_load;  ///< [ranks]
  double total = 0;
  double mean = 0;  ///< total / ranks
  double max = 0;
  double max_over_mean = 1;  ///< max / mean; 1 when the total is 0
  /// Exact form (integer loads): rank_load[r] == scaled[r] / scale as rationals.
  bool exact = false;
  std::int64_t scale = 1;
  std::vector<std::int64_t> scaled;
  /// \brief "10/3" (reduced fraction) when exact, else the decimal value.
  std::string rank_load_text(int r) const;
  /// \brief max/mean as "5/3" when exact, else the decimal value.
  std::string max_over_mean_text() const;
};

/// \brief Per-rank ideal load of `placement` for logical loads `load` ([E], >= 0).
RankLoadSummary rank_load_summary(Placement const& placement, std::vector<double> const& load);

/// \brief One layer's placement and the views the EPLB literature reports.
struct LayerPlacement {
  Placement placement;
  PlacementPolicy policy = PlacementPolicy::contiguous;  ///< the policy that ran (eplb resolved)
  std::vector<std::vector<int>> phy2log_by_rank;       ///< [R][slots of rank]: expert per local slot
  std::vector<std::vector<int>> replica_rank_by_rank;  ///< [R][slots of rank]: replica rank per local slot
  std::vector<std::vector<int>> log2phy;               ///< [E][max copies], -1 padded
  std::vector<int> logcnt;                             ///< [E]
  RankLoadSummary load;                                ///< ideal per-rank load
};

/// \brief Solves one layer with EPLB (spec.policy: eplb, eplb_hierarchical or
/// eplb_global). Throws Error, before any work, naming every inconsistent
/// value (negative or non-finite load, S % R, R % N, E % G, S < E, ...).
LayerPlacement eplb_layer(std::vector<double> const& load, PlacementSpec const& spec);

/// \brief Builds the placement of every layer (load is [L][E]; every layer
/// has the same E) with spec.policy. For contiguous/round-robin/explicit the
/// loads only feed the ideal rank load.
std::vector<LayerPlacement> build_placements(std::vector<std::vector<double>> const& load, PlacementSpec const& spec);

/// \brief Router counts ([L][E], int64) converted to loads.
std::vector<std::vector<double>> loads_from_counts(std::vector<std::vector<std::int64_t>> const& counts);

/// \brief Reduced fraction text "n/d" ("n" when d == 1).
std::string fraction_text(std::int64_t num, std::int64_t den);

}  // namespace KokkosMoE

#endif
