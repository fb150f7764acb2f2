#include <KokkosMoE_Eplb.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <sstream>

namespace KokkosMoE {

namespace {

// Integer loads up to 2^53 are exact in double; scaled sums stay below 2^62.
constexpr double kMaxExactLoad = 9007199254740992.0;  // 2^53
constexpr std::int64_t kMaxScaled = std::int64_t(1) << 62;

__extension__ typedef __int128 int128_t;

bool integral_loads(std::vector<double> const& load) {
  long double total = 0;
  for (double l : load) {
    if (!(l >= 0) || l > kMaxExactLoad || std::floor(l) != l) return false;
    total += l;
  }
  return total < static_cast<long double>(kMaxScaled);
}

// lcm of the values, 0 when it would exceed limit.
std::int64_t bounded_lcm(std::vector<int> const& values, std::int64_t limit) {
  std::int64_t m = 1;
  for (int v : values) {
    if (v <= 0) continue;
    std::int64_t const g = std::gcd(m, static_cast<std::int64_t>(v));
    int128_t const next = static_cast<int128_t>(m / g) * v;
    if (next > limit) return 0;
    m = static_cast<std::int64_t>(next);
  }
  return m;
}

// Balanced packing: items by weight descending (stable), each to the lightest
// pack with room (ties: lowest pack); equal item count per pack.
template <class W>
void balanced_packing(std::vector<W> const& weight, int packs, std::vector<int>& pack_of, std::vector<int>& pos_in_pack) {
  int const n = static_cast<int>(weight.size());
  int const per_pack = n / packs;
  std::vector<int> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  // The lightest pack that is not full (ties: the lowest index), from a
  // heap: O(n log packs).
  std::vector<int> pack_items(static_cast<std::size_t>(packs), 0);
  using entry = std::pair<W, int>;
  std::priority_queue<entry, std::vector<entry>, std::greater<entry>> open;
  for (int p = 0; p < packs; ++p)
    if (per_pack > 0) open.push({W(0), p});
  pack_of.assign(static_cast<std::size_t>(n), -1);
  pos_in_pack.assign(static_cast<std::size_t>(n), -1);
  for (int i : order) {
    if (open.empty()) break;  // n is a multiple of packs: never before the last item
    auto [w, best] = open.top();
    open.pop();
    pack_of[i] = best;
    pos_in_pack[i] = pack_items[best]++;
    if (pack_items[best] < per_pack) open.push({w + weight[i], best});
  }
}

std::vector<std::vector<int>> by_rank(Placement const& p, std::vector<int> const& per_slot) {
  std::vector<std::vector<int>> out(static_cast<std::size_t>(p.num_ranks()));
  for (int r = 0; r < p.num_ranks(); ++r)
    for (int s : p.slots_of_rank(r)) out[static_cast<std::size_t>(r)].push_back(per_slot[static_cast<std::size_t>(s)]);
  return out;
}

LayerPlacement describe(Placement placement, PlacementPolicy policy, std::vector<double> const& load) {
  LayerPlacement lp;
  lp.placement = std::move(placement);
  lp.policy = policy;
  lp.phy2log_by_rank = by_rank(lp.placement, lp.placement.phy2log());
  lp.replica_rank_by_rank = by_rank(lp.placement, lp.placement.replica_rank());
  lp.log2phy = lp.placement.log2phy();
  lp.logcnt = lp.placement.logcnt();
  lp.load = rank_load_summary(lp.placement, load);
  return lp;
}

void check_loads(std::vector<double> const& load, char const* what) {
  KOKKOSMOE_REQUIRE(!load.empty(), what << ": the load vector is empty (no experts)");
  for (std::size_t e = 0; e < load.size(); ++e)
    KOKKOSMOE_REQUIRE(std::isfinite(load[e]) && load[e] >= 0,
                      what << ": load of expert " << e << " is " << load[e] << " (must be finite and >= 0)");
}

std::vector<int> node_major_nodes(int ranks, int nodes) {
  std::vector<int> node_of_rank(static_cast<std::size_t>(ranks));
  int const rpn = ranks / nodes;
  for (int r = 0; r < ranks; ++r) node_of_rank[static_cast<std::size_t>(r)] = r / rpn;
  return node_of_rank;
}

}  // namespace

std::string fraction_text(std::int64_t num, std::int64_t den) {
  KOKKOSMOE_REQUIRE(den != 0, "fraction_text: zero denominator");
  if (den < 0) {
    num = -num;
    den = -den;
  }
  std::int64_t const g = std::gcd(num < 0 ? -num : num, den);
  if (g > 1) {
    num /= g;
    den /= g;
  }
  std::ostringstream os;
  os << num;
  if (den != 1) os << "/" << den;
  return os.str();
}

namespace {
std::string decimal_text(double v) {
  std::ostringstream os;
  os.precision(15);
  os << v;
  return os.str();
}
}  // namespace

std::string RankLoadSummary::rank_load_text(int r) const {
  if (exact) return fraction_text(scaled.at(static_cast<std::size_t>(r)), scale);
  return decimal_text(rank_load.at(static_cast<std::size_t>(r)));
}

std::string RankLoadSummary::max_over_mean_text() const {
  if (exact) {
    std::int64_t total_scaled = 0, max_scaled = 0;
    for (auto v : scaled) {
      total_scaled += v;
      max_scaled = std::max(max_scaled, v);
    }
    if (total_scaled == 0) return "1";
    std::int64_t num = 0;
    if (!__builtin_mul_overflow(max_scaled, static_cast<std::int64_t>(scaled.size()), &num))
      return fraction_text(num, total_scaled);
  }
  return decimal_text(max_over_mean);
}

RankLoadSummary rank_load_summary(Placement const& placement, std::vector<double> const& load) {
  check_loads(load, "rank_load_summary");
  KOKKOSMOE_REQUIRE(static_cast<int>(load.size()) == placement.num_experts(),
                    "rank_load_summary: " << load.size() << " loads for " << placement.num_experts() << " experts");
  int const R = placement.num_ranks();
  RankLoadSummary out;
  out.rank_load.assign(static_cast<std::size_t>(R), 0.0);
  auto const& cnt = placement.logcnt();
  std::int64_t const M = integral_loads(load) ? bounded_lcm(cnt, kMaxScaled) : 0;
  bool exact = M > 0;
  if (exact) {
    long double total = 0;
    for (double l : load) total += static_cast<long double>(l) * M;
    exact = total < static_cast<long double>(kMaxScaled);
  }
  if (exact) {
    out.exact = true;
    out.scale = M;
    out.scaled.assign(static_cast<std::size_t>(R), 0);
    for (int s = 0; s < placement.num_slots(); ++s) {
      int const e = placement.phy2log()[s];
      out.scaled[static_cast<std::size_t>(placement.slot(s).rank)] +=
          static_cast<std::int64_t>(load[static_cast<std::size_t>(e)]) * (M / cnt[static_cast<std::size_t>(e)]);
    }
    std::int64_t total = 0, mx = 0;
    for (int r = 0; r < R; ++r) {
      out.rank_load[r] = static_cast<double>(out.scaled[r]) / static_cast<double>(M);
      total += out.scaled[r];
      mx = std::max(mx, out.scaled[r]);
    }
    out.total = static_cast<double>(total) / static_cast<double>(M);
    out.mean = out.total / R;
    out.max = static_cast<double>(mx) / static_cast<double>(M);
    out.max_over_mean = total == 0 ? 1.0 : static_cast<double>(mx) * R / static_cast<double>(total);
    return out;
  }
  for (int s = 0; s < placement.num_slots(); ++s) {
    int const e = placement.phy2log()[s];
    out.rank_load[static_cast<std::size_t>(placement.slot(s).rank)] +=
        load[static_cast<std::size_t>(e)] / cnt[static_cast<std::size_t>(e)];
  }
  for (double v : out.rank_load) {
    out.total += v;
    out.max = std::max(out.max, v);
  }
  out.mean = out.total / R;
  out.max_over_mean = out.total == 0 ? 1.0 : out.max / out.mean;
  return out;
}

LayerPlacement eplb_layer(std::vector<double> const& load, PlacementSpec const& spec) {
  check_loads(load, "EPLB");
  int const E = static_cast<int>(load.size());
  int const S = spec.physical_slots, G = spec.groups, N = spec.nodes, R = spec.ranks;
  KOKKOSMOE_REQUIRE(spec.policy == PlacementPolicy::eplb || spec.policy == PlacementPolicy::eplb_hierarchical ||
                        spec.policy == PlacementPolicy::eplb_global,
                    "eplb_layer: policy is " << to_string(spec.policy) << ", expected an eplb policy");
  KOKKOSMOE_REQUIRE(R > 0, "EPLB: ranks must be positive (got " << R << ")");
  KOKKOSMOE_REQUIRE(N > 0, "EPLB: nodes must be positive (got " << N << ")");
  KOKKOSMOE_REQUIRE(G > 0, "EPLB: groups must be positive (got " << G << ")");
  KOKKOSMOE_REQUIRE(R % N == 0, "EPLB: ranks (" << R << ") must be a multiple of nodes (" << N << ")");
  KOKKOSMOE_REQUIRE(S > 0 && S % R == 0,
                    "EPLB: physical slots (" << S << ") must be a positive multiple of ranks (" << R << ")");
  KOKKOSMOE_REQUIRE(S >= E, "EPLB: physical slots (" << S << ") must be at least the number of experts (" << E << ")");
  bool hierarchical = false;
  if (spec.policy == PlacementPolicy::eplb_hierarchical) {
    KOKKOSMOE_REQUIRE(G % N == 0, "EPLB hierarchical: groups (" << G << ") must be a multiple of nodes (" << N
                                                                << "); use eplb or eplb_global");
    hierarchical = true;
  } else if (spec.policy == PlacementPolicy::eplb) {
    hierarchical = G % N == 0;
  }
  if (hierarchical)
    KOKKOSMOE_REQUIRE(E % G == 0,
                      "EPLB hierarchical: experts (" << E << ") must be a multiple of groups (" << G << ")");

  int const num_nodes = hierarchical ? N : 1;
  int const num_groups = hierarchical ? G : 1;
  int const group_size = E / num_groups;
  int const slots_per_node = S / num_nodes;
  int const ranks_per_node = R / num_nodes;
  int const slots_per_rank = S / R;
  bool const exact = integral_loads(load);
  std::vector<std::int64_t> iload(static_cast<std::size_t>(E), 0);
  if (exact)
    for (int e = 0; e < E; ++e) iload[e] = static_cast<std::int64_t>(load[e]);

  // Step 1: groups -> nodes.
  std::vector<int> node_of_group, pos_unused;
  if (exact) {
    std::vector<std::int64_t> w(static_cast<std::size_t>(num_groups), 0);
    for (int e = 0; e < E; ++e) w[e / group_size] += iload[e];
    balanced_packing(w, num_nodes, node_of_group, pos_unused);
  } else {
    std::vector<double> w(static_cast<std::size_t>(num_groups), 0.0);
    for (int e = 0; e < E; ++e) w[e / group_size] += load[e];
    balanced_packing(w, num_nodes, node_of_group, pos_unused);
  }

  std::vector<SlotInfo> slots(static_cast<std::size_t>(S));
  std::vector<int> const real_node = node_major_nodes(R, N);
  for (int n = 0; n < num_nodes; ++n) {
    // Step 2: the node's experts (ascending id), then redundant copies.
    std::vector<int> experts;
    for (int e = 0; e < E; ++e)
      if (node_of_group[e / group_size] == n) experts.push_back(e);
    int const local_experts = static_cast<int>(experts.size());
    std::vector<int> copies(static_cast<std::size_t>(local_experts), 1);
    std::vector<int> item_expert(experts.begin(), experts.end());  // local expert index per item
    std::vector<int> item_local(static_cast<std::size_t>(local_experts));
    std::iota(item_local.begin(), item_local.end(), 0);
    std::vector<int> item_replica(static_cast<std::size_t>(local_experts), 0);
    // The expert with the largest load per copy gets the next copy (ties:
    // the lowest local index), from a heap: O((slots - experts) log experts).
    auto larger = [&](int j, int best) {
      if (exact)  // load_j / copies_j > load_best / copies_best, exactly.
        return static_cast<int128_t>(iload[experts[j]]) * copies[best] > static_cast<int128_t>(iload[experts[best]]) * copies[j];
      return load[experts[j]] / copies[j] > load[experts[best]] / copies[best];
    };
    // Heap order: a below b when b should be chosen first.
    auto below = [&](int a, int b) { return larger(b, a) || (!larger(a, b) && b < a); };
    std::priority_queue<int, std::vector<int>, decltype(below)> next(below);
    KOKKOSMOE_REQUIRE(local_experts > 0 || slots_per_node == 0, "EPLB: node " << n << " got no experts for its " << slots_per_node << " slots");
    if (slots_per_node > local_experts)
      for (int j = 0; j < local_experts; ++j) next.push(j);
    for (int i = local_experts; i < slots_per_node; ++i) {
      int const best = next.top();
      next.pop();
      item_expert.push_back(experts[best]);
      item_local.push_back(best);
      item_replica.push_back(copies[best]++);
      next.push(best);
    }
    // Step 3: copies -> ranks of the node, weighted by load / copies.
    std::vector<int> pack_of, pos_in_pack;
    std::int64_t const M = exact ? bounded_lcm(copies, kMaxScaled) : 0;
    bool scaled_ok = M > 0;
    if (scaled_ok) {
      long double total = 0;
      for (int e : experts) total += static_cast<long double>(iload[e]) * M;
      scaled_ok = total < static_cast<long double>(kMaxScaled);
    }
    if (scaled_ok) {
      std::vector<std::int64_t> w(item_expert.size());
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = iload[item_expert[i]] * (M / copies[item_local[i]]);
      balanced_packing(w, ranks_per_node, pack_of, pos_in_pack);
    } else {
      std::vector<double> w(item_expert.size());
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = load[item_expert[i]] / copies[item_local[i]];
      balanced_packing(w, ranks_per_node, pack_of, pos_in_pack);
    }
    for (std::size_t i = 0; i < item_expert.size(); ++i) {
      int const rank = n * ranks_per_node + pack_of[i];
      int const slot = rank * slots_per_rank + pos_in_pack[i];
      SlotInfo& sl = slots[static_cast<std::size_t>(slot)];
      sl.expert = item_expert[i];
      sl.rank = rank;
      sl.node = real_node[static_cast<std::size_t>(rank)];
      sl.version = spec.version;
      sl.replica = item_replica[i];
    }
  }
  Placement placement(E, R, std::move(slots), real_node, spec.generation);
  return describe(std::move(placement),
                  hierarchical ? PlacementPolicy::eplb_hierarchical : PlacementPolicy::eplb_global, load);
}

std::vector<LayerPlacement> build_placements(std::vector<std::vector<double>> const& load, PlacementSpec const& spec) {
  KOKKOSMOE_REQUIRE(!load.empty(), "build_placements: no layers");
  std::size_t const E = load.front().size();
  for (std::size_t l = 0; l < load.size(); ++l)
    KOKKOSMOE_REQUIRE(load[l].size() == E, "build_placements: layer " << l << " has " << load[l].size()
                                                                      << " expert loads, layer 0 has " << E);
  if (spec.policy == PlacementPolicy::explicit_slots)
    KOKKOSMOE_REQUIRE(spec.explicit_slots.size() == 1 || spec.explicit_slots.size() == load.size(),
                      "explicit placement: " << spec.explicit_slots.size() << " slot lists for " << load.size()
                                             << " layers (expected 1 or " << load.size() << ")");
  std::vector<int> node_of_rank;
  if (spec.policy != PlacementPolicy::eplb && spec.policy != PlacementPolicy::eplb_hierarchical &&
      spec.policy != PlacementPolicy::eplb_global) {
    KOKKOSMOE_REQUIRE(spec.ranks > 0 && spec.nodes > 0 && spec.ranks % spec.nodes == 0,
                      "placement: ranks (" << spec.ranks << ") must be a positive multiple of nodes (" << spec.nodes
                                           << ")");
    node_of_rank = node_major_nodes(spec.ranks, spec.nodes);
  }
  std::vector<LayerPlacement> out;
  out.reserve(load.size());
  for (std::size_t l = 0; l < load.size(); ++l) {
    auto const& ld = load[l];
    check_loads(ld, "placement");
    int const E_l = static_cast<int>(ld.size());
    try {
      switch (spec.policy) {
        case PlacementPolicy::contiguous:
          out.push_back(describe(Placement::contiguous(E_l, spec.ranks, node_of_rank)
                                     .with_expert_digests(std::vector<std::uint64_t>(ld.size(), 0), spec.version)
                                     .with_generation(spec.generation),
                                 spec.policy, ld));
          break;
        case PlacementPolicy::round_robin:
          out.push_back(describe(Placement::round_robin(E_l, spec.ranks, node_of_rank)
                                     .with_expert_digests(std::vector<std::uint64_t>(ld.size(), 0), spec.version)
                                     .with_generation(spec.generation),
                                 spec.policy, ld));
          break;
        case PlacementPolicy::explicit_slots: {
          auto const& sl = spec.explicit_slots.size() == 1 ? spec.explicit_slots.front() : spec.explicit_slots[l];
          out.push_back(describe(Placement(E_l, spec.ranks, sl, node_of_rank, spec.generation), spec.policy, ld));
          break;
        }
        default: out.push_back(eplb_layer(ld, spec)); break;
      }
    } catch (Error const& e) {
      throw Error("layer " + std::to_string(l) + ": " + e.what());
    }
  }
  return out;
}

std::vector<std::vector<double>> loads_from_counts(std::vector<std::vector<std::int64_t>> const& counts) {
  std::vector<std::vector<double>> out(counts.size());
  for (std::size_t l = 0; l < counts.size(); ++l) {
    out[l].reserve(counts[l].size());
    for (std::size_t e = 0; e < counts[l].size(); ++e) {
      KOKKOSMOE_REQUIRE(counts[l][e] >= 0, "layer " << l << ", expert " << e << ": negative count " << counts[l][e]);
      out[l].push_back(static_cast<double>(counts[l][e]));
    }
  }
  return out;
}

}  // namespace KokkosMoE
