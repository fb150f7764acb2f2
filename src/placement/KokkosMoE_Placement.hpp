#ifndef KOKKOSMOE_PLACEMENT_HPP
#define KOKKOSMOE_PLACEMENT_HPP

/// \file KokkosMoE_Placement.hpp
/// \brief One placement generation of one MoE layer: which logical expert
/// every physical slot stores, on which rank and node, its replica rank,
/// checkpoint version and parameter digest; and the per-route replica choice.
///
/// Identity namespaces: logical expert id (0..E-1), physical slot id
/// (0..S-1, unique within the generation), replica rank (index among one
/// expert's copies: ascending slot order unless the slots set it), global
/// rank, node id.
/// A rank's local slots are its slots in ascending slot id order; that order
/// is the expert-major segment order on the receiving rank.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Types.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief One physical slot.
struct SlotInfo {
  int expert = -1;             ///< logical expert stored in the slot
  int rank = -1;               ///< global rank holding the slot
  int node = -1;               ///< node of that rank (-1: filled from the rank -> node map)
  std::uint64_t version = 0;   ///< checkpoint version of the stored parameters
  std::uint64_t digest = 0;    ///< content digest of the stored parameters
  /// Replica rank among the expert's copies. -1 everywhere: copies are
  /// numbered in ascending slot order. Otherwise every slot sets it and each
  /// expert's values are exactly 0..copies-1 (EPLB numbers copies in the
  /// order the solver created them, which need not be slot order).
  int replica = -1;
};

/// \brief An immutable placement generation (host data; device mirrors are
/// built by the consumers that need them).
class Placement {
 public:
  Placement() = default;
  /// \brief Validates and indexes slots: every expert in [0, E) has at least
  /// one slot, every slot's rank is in [0, ranks), nodes consistent with
  /// node_of_rank (when given; a slot with node -1 takes its rank's node),
  /// replica ranks either all -1 (ascending slot order) or all given and a
  /// permutation of 0..copies-1 per expert. Throws Error naming the
  /// offending slot.
  Placement(int num_experts, int num_ranks, std::vector<SlotInfo> slots,
            std::vector<int> const& node_of_rank = {}, std::uint64_t generation = 0);

  int num_experts() const { return num_experts_; }
  int num_ranks() const { return num_ranks_; }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  std::uint64_t generation() const { return generation_; }
  SlotInfo const& slot(int s) const { return slots_.at(static_cast<std::size_t>(s)); }
  std::vector<SlotInfo> const& slots() const { return slots_; }

  /// \brief phy2log[s] = logical expert of slot s.
  std::vector<int> const& phy2log() const { return phy2log_; }
  /// \brief replica_rank[s] = index of slot s among its expert's copies.
  std::vector<int> const& replica_rank() const { return replica_rank_; }
  /// \brief logcnt[e] = number of copies of expert e.
  std::vector<int> const& logcnt() const { return logcnt_; }
  /// \brief Padded log2phy: [E][max copies], -1 padding; read through logcnt.
  std::vector<std::vector<int>> const& log2phy() const { return log2phy_; }
  int max_copies() const { return max_copies_; }
  /// \brief Slots of a rank in ascending slot id order (its local slot order).
  std::vector<int> const& slots_of_rank(int r) const { return rank_slots_.at(static_cast<std::size_t>(r)); }
  /// \brief Position of slot s in its rank's local slot order.
  int local_index(int s) const { return local_index_.at(static_cast<std::size_t>(s)); }

  /// \brief The rank -> node map given at construction (empty when none was given).
  std::vector<int> const& node_of_rank() const { return node_of_rank_; }
  /// \brief Number of slots of rank r.
  int num_slots_of_rank(int r) const { return static_cast<int>(slots_of_rank(r).size()); }

  /// \brief Same slots, new generation id.
  Placement with_generation(std::uint64_t generation) const;
  /// \brief Same slots with the given per-slot parameter digests ([S]).
  Placement with_digests(std::vector<std::uint64_t> const& digest_of_slot) const;
  /// \brief Same slots; every copy of expert e gets digest_of_expert[e] ([E]) and
  /// checkpoint version `version`.
  Placement with_expert_digests(std::vector<std::uint64_t> const& digest_of_expert, std::uint64_t version) const;
  /// \brief Same slots with nodes taken from node_of_rank ([ranks]); slots whose
  /// node is already set must agree.
  Placement with_nodes(std::vector<int> const& node_of_rank) const;

  /// \brief A placement where expert e lives only on rank e * ranks / E (contiguous blocks).
  static Placement contiguous(int num_experts, int num_ranks, std::vector<int> const& node_of_rank = {});
  /// \brief A placement where expert e lives only on rank e % ranks.
  static Placement round_robin(int num_experts, int num_ranks, std::vector<int> const& node_of_rank = {});

 private:
  int num_experts_ = 0;
  int num_ranks_ = 0;
  std::uint64_t generation_ = 0;
  std::vector<SlotInfo> slots_;
  std::vector<int> phy2log_, replica_rank_, logcnt_, local_index_;
  std::vector<std::vector<int>> log2phy_, rank_slots_;
  std::vector<int> node_of_rank_;
  int max_copies_ = 0;
};

/// \brief Checks that every slot's node matches node_of_rank ([ranks] of the
/// EP communicator, in EP rank order): the placement's rank count must equal
/// node_of_rank.size(), and a slot whose node is unset (-1) or differs from its
/// rank's node is an error naming the slot, its expert, rank and both nodes.
void validate_placement_nodes(Placement const& placement, std::vector<int> const& node_of_rank);

/// \brief Checks a placement against a topology of the EP communicator
/// (anything with size() and node_of(rank), e.g. KokkosMoE::Topology::Topology):
/// every slot's rank is an EP rank and its node is the topology's node of that
/// rank. Throws Error naming the first offending slot.
template <class TopologyLike>
void validate_placement_topology(Placement const& placement, TopologyLike const& topology) {
  std::vector<int> node_of_rank(static_cast<std::size_t>(topology.size()));
  for (int r = 0; r < topology.size(); ++r) node_of_rank[static_cast<std::size_t>(r)] = topology.node_of(r);
  validate_placement_nodes(placement, node_of_rank);
}

/// \brief How a route's physical replica is chosen among its expert's copies.
enum class ReplicaPolicy {
  locality,     ///< same rank, then same node, then least predicted load, then lowest slot
  round_robin,  ///< copy (route id mod copies), in replica-rank (log2phy) order
  hash,         ///< copy (mix(route id) mod copies), in replica-rank (log2phy) order
};
inline EnumTable<ReplicaPolicy> const& names_of(ReplicaPolicy) {
  static EnumTable<ReplicaPolicy> const t{"replica policy",
                                          {{ReplicaPolicy::locality, "locality"},
                                           {ReplicaPolicy::round_robin, "round_robin"},
                                           {ReplicaPolicy::hash, "hash"}}};
  return t;
}

/// \brief Per-route replica choice usable in kernels: slot(expert, route_id)
/// returns exactly one physical slot storing that expert.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct ReplicaChoice {
  ReplicaPolicy policy = ReplicaPolicy::locality;
  Kokkos::View<int*, MemorySpace> table;        ///< [E] chosen slot (locality policy)
  Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> log2phy;  ///< [E][max copies]
  Kokkos::View<int*, MemorySpace> logcnt;       ///< [E]

  KOKKOS_INLINE_FUNCTION static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
  }

  KOKKOS_INLINE_FUNCTION int slot(int expert, index_t route_id) const {
    if (policy == ReplicaPolicy::locality) return table(expert);
    int const copies = logcnt(expert);
    std::uint64_t const key = policy == ReplicaPolicy::hash ? mix(static_cast<std::uint64_t>(route_id))
                                                             : static_cast<std::uint64_t>(route_id);
    return log2phy(expert, static_cast<int>(key % static_cast<std::uint64_t>(copies)));
  }
};

/// \brief Host-side locality choice for routes originating on origin_rank:
/// for every expert the compatible copy on the same rank, else on the same
/// node, else anywhere; ties by least predicted load (slot_load, may be empty)
/// then lowest slot. Compatible: stores the expert, has checkpoint version
/// `version` (when version != 0) and its rank is in [0, ranks).
/// Throws Error when an expert has no compatible copy.
std::vector<int> locality_choice(Placement const& placement, int origin_rank, int origin_node,
                                 std::vector<double> const& slot_load = {}, std::uint64_t version = 0);

/// \brief Slots of every expert that are compatible with checkpoint version
/// `version` (any version when 0) and lie on a rank in [0, ranks), in
/// replica-rank order. Throws Error naming an expert without one.
std::vector<std::vector<int>> compatible_copies(Placement const& placement, std::uint64_t version = 0);

/// \brief Builds the device-side choice for routes originating on origin_rank.
/// Every policy chooses among the compatible copies only (see
/// compatible_copies): locality through locality_choice, round-robin and hash
/// over the compatible copies in replica-rank order. slot(e, route) therefore
/// returns exactly one compatible slot storing e.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
ReplicaChoice<MemorySpace> make_replica_choice(Placement const& placement, int origin_rank, int origin_node,
                                               ReplicaPolicy policy = ReplicaPolicy::locality,
                                               std::vector<double> const& slot_load = {},
                                               std::uint64_t version = 0) {
  int const E = placement.num_experts();
  auto const copies = compatible_copies(placement, version);
  int max_copies = 1;
  for (auto const& cp : copies)
    if (static_cast<int>(cp.size()) > max_copies) max_copies = static_cast<int>(cp.size());
  // Views are built complete and then aggregated (no assignment into
  // default-constructed views).
  Kokkos::View<int*, MemorySpace> table("KokkosMoE::ReplicaChoice::table", E);
  Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> log2phy("KokkosMoE::ReplicaChoice::log2phy", E, max_copies);
  Kokkos::View<int*, MemorySpace> logcnt("KokkosMoE::ReplicaChoice::logcnt", E);
  auto ht = Kokkos::create_mirror_view(table);
  auto hl = Kokkos::create_mirror_view(log2phy);
  auto hc = Kokkos::create_mirror_view(logcnt);
  std::vector<int> chosen;
  if (policy == ReplicaPolicy::locality) chosen = locality_choice(placement, origin_rank, origin_node, slot_load, version);
  for (int e = 0; e < E; ++e) {
    auto const& cp = copies[static_cast<std::size_t>(e)];
    hc(e) = static_cast<int>(cp.size());
    for (int j = 0; j < max_copies; ++j) hl(e, j) = j < static_cast<int>(cp.size()) ? cp[static_cast<std::size_t>(j)] : -1;
    ht(e) = chosen.empty() ? cp.front() : chosen[static_cast<std::size_t>(e)];
  }
  Kokkos::deep_copy(table, ht);
  Kokkos::deep_copy(log2phy, hl);
  Kokkos::deep_copy(logcnt, hc);
  return ReplicaChoice<MemorySpace>{policy, table, log2phy, logcnt};
}

/// \brief As make_replica_choice, after checking the placement against the
/// topology of the EP communicator (validate_placement_topology); the origin
/// node is the topology's node of origin_rank.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space, class TopologyLike>
ReplicaChoice<MemorySpace> make_checked_replica_choice(Placement const& placement, TopologyLike const& topology,
                                                       int origin_rank, ReplicaPolicy policy = ReplicaPolicy::locality,
                                                       std::vector<double> const& slot_load = {},
                                                       std::uint64_t version = 0) {
  validate_placement_topology(placement, topology);
  KOKKOSMOE_REQUIRE(origin_rank >= 0 && origin_rank < topology.size(),
                    "replica choice: origin rank " << origin_rank << " outside the EP communicator of "
                                                   << topology.size() << " ranks");
  return make_replica_choice<MemorySpace>(placement, origin_rank, topology.node_of(origin_rank), policy, slot_load,
                                          version);
}

/// \brief Device-side view of a placement for kernels: per physical slot its
/// logical expert, rank, node and position among its rank's local slots.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct DevicePlacement {
  std::uint64_t generation = 0;
  int num_experts = 0;
  int num_ranks = 0;
  Kokkos::View<int*, MemorySpace> phy2log;      ///< [S]
  Kokkos::View<int*, MemorySpace> slot_rank;    ///< [S]
  Kokkos::View<int*, MemorySpace> slot_node;    ///< [S]
  Kokkos::View<int*, MemorySpace> local_index;  ///< [S]
  int num_slots() const { return static_cast<int>(phy2log.extent(0)); }
};

/// \brief Copies the slot tables of a placement to MemorySpace.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
DevicePlacement<MemorySpace> make_device_placement(Placement const& p) {
  DevicePlacement<MemorySpace> d;
  d.generation = p.generation();
  d.num_experts = p.num_experts();
  d.num_ranks = p.num_ranks();
  int const S = p.num_slots();
  d.phy2log = Kokkos::View<int*, MemorySpace>("KokkosMoE::DevicePlacement::phy2log", S);
  d.slot_rank = Kokkos::View<int*, MemorySpace>("KokkosMoE::DevicePlacement::slot_rank", S);
  d.slot_node = Kokkos::View<int*, MemorySpace>("KokkosMoE::DevicePlacement::slot_node", S);
  d.local_index = Kokkos::View<int*, MemorySpace>("KokkosMoE::DevicePlacement::local_index", S);
  auto h0 = Kokkos::create_mirror_view(d.phy2log);
  auto h1 = Kokkos::create_mirror_view(d.slot_rank);
  auto h2 = Kokkos::create_mirror_view(d.slot_node);
  auto h3 = Kokkos::create_mirror_view(d.local_index);
  for (int s = 0; s < S; ++s) {
    h0(s) = p.slot(s).expert;
    h1(s) = p.slot(s).rank;
    h2(s) = p.slot(s).node;
    h3(s) = p.local_index(s);
  }
  Kokkos::deep_copy(d.phy2log, h0);
  Kokkos::deep_copy(d.slot_rank, h1);
  Kokkos::deep_copy(d.slot_node, h2);
  Kokkos::deep_copy(d.local_index, h3);
  return d;
}

}  // namespace KokkosMoE

#endif
