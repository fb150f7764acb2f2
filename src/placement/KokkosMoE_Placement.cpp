#include <KokkosMoE_Placement.hpp>

#include <algorithm>
#include <limits>

namespace KokkosMoE {

Placement::Placement(int num_experts, int num_ranks, std::vector<SlotInfo> slots, std::vector<int> const& node_of_rank,
                     std::uint64_t generation)
    : num_experts_(num_experts), num_ranks_(num_ranks), generation_(generation), slots_(std::move(slots)),
      node_of_rank_(node_of_rank) {
  KOKKOSMOE_REQUIRE(num_experts > 0, "a placement needs at least one expert (got " << num_experts << ")");
  KOKKOSMOE_REQUIRE(num_ranks > 0, "a placement needs at least one rank (got " << num_ranks << ")");
  KOKKOSMOE_REQUIRE(node_of_rank.empty() || static_cast<int>(node_of_rank.size()) == num_ranks,
                    "node_of_rank has " << node_of_rank.size() << " entries for " << num_ranks << " ranks");
  int const S = static_cast<int>(slots_.size());
  phy2log_.resize(static_cast<std::size_t>(S));
  replica_rank_.resize(static_cast<std::size_t>(S));
  local_index_.resize(static_cast<std::size_t>(S));
  logcnt_.assign(static_cast<std::size_t>(num_experts), 0);
  rank_slots_.assign(static_cast<std::size_t>(num_ranks), {});
  int given_replicas = 0;
  for (int s = 0; s < S; ++s) {
    auto& sl = slots_[static_cast<std::size_t>(s)];
    KOKKOSMOE_REQUIRE(sl.expert >= 0 && sl.expert < num_experts,
                      "slot " << s << " stores expert " << sl.expert << ", outside [0, " << num_experts << ")");
    KOKKOSMOE_REQUIRE(sl.rank >= 0 && sl.rank < num_ranks,
                      "slot " << s << " is on rank " << sl.rank << ", outside [0, " << num_ranks << ")");
    KOKKOSMOE_REQUIRE(sl.replica >= -1, "slot " << s << " has replica rank " << sl.replica << " (expected -1 or >= 0)");
    if (!node_of_rank.empty()) {
      int const node = node_of_rank[static_cast<std::size_t>(sl.rank)];
      KOKKOSMOE_REQUIRE(sl.node < 0 || sl.node == node,
                        "slot " << s << " says node " << sl.node << " but its rank " << sl.rank << " is on node " << node);
      sl.node = node;
    }
    if (sl.replica >= 0) ++given_replicas;
    phy2log_[s] = sl.expert;
    replica_rank_[s] = logcnt_[static_cast<std::size_t>(sl.expert)]++;
    local_index_[s] = static_cast<int>(rank_slots_[static_cast<std::size_t>(sl.rank)].size());
    rank_slots_[static_cast<std::size_t>(sl.rank)].push_back(s);
  }
  KOKKOSMOE_REQUIRE(given_replicas == 0 || given_replicas == S,
                    given_replicas << " of " << S << " slots set a replica rank; set it on every slot or on none");
  for (int e = 0; e < num_experts; ++e)
    KOKKOSMOE_REQUIRE(logcnt_[e] > 0, "expert " << e << " has no physical slot in the placement");
  max_copies_ = *std::max_element(logcnt_.begin(), logcnt_.end());
  log2phy_.assign(static_cast<std::size_t>(num_experts), std::vector<int>(static_cast<std::size_t>(max_copies_), -1));
  for (int s = 0; s < S; ++s) {
    auto const& sl = slots_[static_cast<std::size_t>(s)];
    if (given_replicas > 0) {
      KOKKOSMOE_REQUIRE(sl.replica < logcnt_[static_cast<std::size_t>(sl.expert)],
                        "slot " << s << " has replica rank " << sl.replica << " but expert " << sl.expert << " has only "
                                << logcnt_[static_cast<std::size_t>(sl.expert)] << " copies");
      int& entry = log2phy_[static_cast<std::size_t>(sl.expert)][static_cast<std::size_t>(sl.replica)];
      KOKKOSMOE_REQUIRE(entry < 0, "slots " << entry << " and " << s << " both are replica " << sl.replica << " of expert "
                                            << sl.expert);
      entry = s;
      replica_rank_[s] = sl.replica;
    } else {
      log2phy_[static_cast<std::size_t>(phy2log_[s])][static_cast<std::size_t>(replica_rank_[s])] = s;
    }
  }
}

Placement Placement::with_generation(std::uint64_t generation) const {
  Placement p = *this;
  p.generation_ = generation;
  return p;
}

Placement Placement::with_digests(std::vector<std::uint64_t> const& digest_of_slot) const {
  KOKKOSMOE_REQUIRE(static_cast<int>(digest_of_slot.size()) == num_slots(),
                    "with_digests: " << digest_of_slot.size() << " digests for " << num_slots() << " slots");
  Placement p = *this;
  for (std::size_t s = 0; s < p.slots_.size(); ++s) p.slots_[s].digest = digest_of_slot[s];
  return p;
}

Placement Placement::with_expert_digests(std::vector<std::uint64_t> const& digest_of_expert, std::uint64_t version) const {
  KOKKOSMOE_REQUIRE(static_cast<int>(digest_of_expert.size()) == num_experts(),
                    "with_expert_digests: " << digest_of_expert.size() << " digests for " << num_experts() << " experts");
  Placement p = *this;
  for (auto& sl : p.slots_) {
    sl.digest = digest_of_expert[static_cast<std::size_t>(sl.expert)];
    sl.version = version;
  }
  return p;
}

Placement Placement::with_nodes(std::vector<int> const& node_of_rank) const {
  return Placement(num_experts_, num_ranks_, slots_, node_of_rank, generation_);
}

void validate_placement_nodes(Placement const& placement, std::vector<int> const& node_of_rank) {
  KOKKOSMOE_REQUIRE(static_cast<int>(node_of_rank.size()) == placement.num_ranks(),
                    "placement generation " << placement.generation() << " spans " << placement.num_ranks()
                                            << " ranks but the EP communicator has " << node_of_rank.size());
  for (int s = 0; s < placement.num_slots(); ++s) {
    auto const& sl = placement.slot(s);
    int const node = node_of_rank[static_cast<std::size_t>(sl.rank)];
    KOKKOSMOE_REQUIRE(sl.node == node, "placement generation " << placement.generation() << ": slot " << s << " (expert "
                                                               << sl.expert << ", rank " << sl.rank << ") says node "
                                                               << sl.node << " but the topology puts rank " << sl.rank
                                                               << " on node " << node);
  }
}

Placement Placement::contiguous(int num_experts, int num_ranks, std::vector<int> const& node_of_rank) {
  KOKKOSMOE_REQUIRE(num_experts > 0 && num_ranks > 0, "contiguous placement of " << num_experts << " experts on " << num_ranks << " ranks");
  std::vector<SlotInfo> slots;
  for (int e = 0; e < num_experts; ++e) {
    SlotInfo s;
    s.expert = e;
    s.rank = static_cast<int>(static_cast<long long>(e) * num_ranks / num_experts);
    slots.push_back(s);
  }
  return Placement(num_experts, num_ranks, std::move(slots), node_of_rank);
}

Placement Placement::round_robin(int num_experts, int num_ranks, std::vector<int> const& node_of_rank) {
  KOKKOSMOE_REQUIRE(num_experts > 0 && num_ranks > 0, "round-robin placement of " << num_experts << " experts on " << num_ranks << " ranks");
  // Slots are numbered rank-major so each rank's local slots are contiguous.
  std::vector<SlotInfo> slots;
  for (int r = 0; r < num_ranks; ++r)
    for (int e = r; e < num_experts; e += num_ranks) {
      SlotInfo s;
      s.expert = e;
      s.rank = r;
      slots.push_back(s);
    }
  return Placement(num_experts, num_ranks, std::move(slots), node_of_rank);
}

std::vector<std::vector<int>> compatible_copies(Placement const& placement, std::uint64_t version) {
  int const E = placement.num_experts();
  std::vector<std::vector<int>> out(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) {
    for (int j = 0; j < placement.logcnt()[e]; ++j) {
      int const s = placement.log2phy()[e][j];
      auto const& sl = placement.slot(s);
      if (sl.expert != e || (version != 0 && sl.version != version)) continue;
      if (sl.rank < 0 || sl.rank >= placement.num_ranks()) continue;
      out[static_cast<std::size_t>(e)].push_back(s);
    }
    KOKKOSMOE_REQUIRE(!out[static_cast<std::size_t>(e)].empty(),
                      "expert " << e << " has no compatible replica"
                                << (version != 0 ? " at checkpoint version " + std::to_string(version) : std::string())
                                << " in placement generation " << placement.generation());
  }
  return out;
}

std::vector<int> locality_choice(Placement const& placement, int origin_rank, int origin_node,
                                 std::vector<double> const& slot_load, std::uint64_t version) {
  KOKKOSMOE_REQUIRE(slot_load.empty() || static_cast<int>(slot_load.size()) == placement.num_slots(),
                    "slot_load has " << slot_load.size() << " entries for " << placement.num_slots() << " slots");
  int const E = placement.num_experts();
  std::vector<int> chosen(static_cast<std::size_t>(E), -1);
  for (int e = 0; e < E; ++e) {
    int best = -1, best_class = 3;
    double best_load = std::numeric_limits<double>::infinity();
    for (int j = 0; j < placement.logcnt()[e]; ++j) {
      int const s = placement.log2phy()[e][j];
      auto const& sl = placement.slot(s);
      if (sl.expert != e) continue;
      if (version != 0 && sl.version != version) continue;
      if (sl.rank < 0 || sl.rank >= placement.num_ranks()) continue;
      int const cls = sl.rank == origin_rank ? 0 : (origin_node >= 0 && sl.node == origin_node ? 1 : 2);
      double const load = slot_load.empty() ? 0.0 : slot_load[static_cast<std::size_t>(s)];
      if (cls < best_class || (cls == best_class && (load < best_load || (load == best_load && s < best)))) {
        best = s;
        best_class = cls;
        best_load = load;
      }
    }
    KOKKOSMOE_REQUIRE(best >= 0, "expert " << e << " has no compatible replica for rank " << origin_rank
                                           << (version != 0 ? " at checkpoint version " + std::to_string(version) : std::string()));
    chosen[static_cast<std::size_t>(e)] = best;
  }
  return chosen;
}

}  // namespace KokkosMoE
