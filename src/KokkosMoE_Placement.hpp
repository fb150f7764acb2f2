#ifndef KOKKOSMOE_PLACEMENT_HPP
#define KOKKOSMOE_PLACEMENT_HPP

/// \file KokkosMoE_Placement.hpp
/// \brief One placement generation of one MoE layer: which logical expert
/// every physical slot stores, on which rank and node, its replica rank,
/// checkpoint version and parameter digest; and the per-route replica choice.
///
/// Identity namespaces: logical expert id (0..E-1), physical slot id
/// (0..S-1, unique within the generation), replica rank (index among one
/// expert's copies, in ascending slot order), global rank, node id.
/// A rank's local slots are its slots in ascending slot id order; that order
/// is the expert-major segment order on the receiving rank.

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
};

/// \brief An immutable placement generation (host data; device mirrors are
/// built by the consumers that need them).
class Placement {
 public:
  Placement() = default;
  /// \brief Validates and indexes slots: every expert in [0, E) has at least
  /// one slot, every slot's rank is in [0, ranks), nodes consistent with
  /// node_of_rank (when given). Throws Error naming the offending slot.
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

  /// \brief Same slots, new generation id.
  Placement with_generation(std::uint64_t generation) const;

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
  int max_copies_ = 0;
};

/// \brief How a route's physical replica is chosen among its expert's copies.
enum class ReplicaPolicy {
  locality,     ///< same rank, then same node, then least predicted load, then lowest slot
  round_robin,  ///< copy (route id mod copies), in slot order
  hash,         ///< copy (mix(route id) mod copies), in slot order
};
std::string to_string(ReplicaPolicy p);
ReplicaPolicy replica_policy_from_string(std::string const& name);

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

/// \brief Builds the device-side choice for routes originating on origin_rank.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
ReplicaChoice<MemorySpace> make_replica_choice(Placement const& placement, int origin_rank, int origin_node,
                                               ReplicaPolicy policy = ReplicaPolicy::locality,
                                               std::vector<double> const& slot_load = {},
                                               std::uint64_t version = 0) {
  ReplicaChoice<MemorySpace> c;
  c.policy = policy;
  int const E = placement.num_experts();
  c.table = Kokkos::View<int*, MemorySpace>("KokkosMoE::ReplicaChoice::table", E);
  c.log2phy = Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace>("KokkosMoE::ReplicaChoice::log2phy", E,
                                                                    placement.max_copies());
  c.logcnt = Kokkos::View<int*, MemorySpace>("KokkosMoE::ReplicaChoice::logcnt", E);
  auto ht = Kokkos::create_mirror_view(c.table);
  auto hl = Kokkos::create_mirror_view(c.log2phy);
  auto hc = Kokkos::create_mirror_view(c.logcnt);
  std::vector<int> chosen;
  if (policy == ReplicaPolicy::locality) chosen = locality_choice(placement, origin_rank, origin_node, slot_load, version);
  for (int e = 0; e < E; ++e) {
    hc(e) = placement.logcnt()[e];
    for (int j = 0; j < placement.max_copies(); ++j) hl(e, j) = placement.log2phy()[e][j];
    ht(e) = chosen.empty() ? placement.log2phy()[e][0] : chosen[e];
  }
  Kokkos::deep_copy(c.table, ht);
  Kokkos::deep_copy(c.log2phy, hl);
  Kokkos::deep_copy(c.logcnt, hc);
  return c;
}

}  // namespace KokkosMoE

#endif
