#include <KokkosMoE_BiasController.hpp>
#include <KokkosMoE_LoadStats.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_Router.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

namespace KokkosMoE {

// ---- names -------------------------------------------------------------------

SetScore set_score_from_string(std::string const& name, int* m) {
  for (SetScore s : {SetScore::none, SetScore::max, SetScore::top_m_sum})
    if (to_string(s) == name) return s;
  // "top<N>_sum"
  if (name.size() > 7 && name.compare(0, 3, "top") == 0 && name.compare(name.size() - 4, 4, "_sum") == 0) {
    std::string const digits = name.substr(3, name.size() - 7);
    bool const all_digits =
        !digits.empty() && digits.size() <= 4 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; });
    if (all_digits) {
      if (m) *m = std::stoi(digits);
      return SetScore::top_m_sum;
    }
  }
  KOKKOSMOE_THROW("unknown group/domain score '" << name << "' (expected none, max, top_m_sum or top<N>_sum such as top2_sum)");
}

// ---- admission -----------------------------------------------------------------

void AdmissionConfig::validate(int num_experts) const {
  if (policy == AdmissionPolicy::dropless) return;
  KOKKOSMOE_REQUIRE(std::isfinite(capacity_factor) && capacity_factor > 0.0,
                    "admission " << to_string(policy) << ": capacity_factor must be finite and > 0 (got "
                                 << capacity_factor << ")");
  if (policy == AdmissionPolicy::expert_capacity) return;
  KOKKOSMOE_REQUIRE(num_devices > 0, "admission device_capacity: num_devices must be > 0 (got " << num_devices << ")");
  KOKKOSMOE_REQUIRE(static_cast<int>(expert_device.size()) == num_experts,
                    "admission device_capacity: expert_device has " << expert_device.size() << " entries for "
                                                                   << num_experts << " experts");
  for (std::size_t e = 0; e < expert_device.size(); ++e)
    KOKKOSMOE_REQUIRE(expert_device[e] >= 0 && expert_device[e] < num_devices,
                      "admission device_capacity: expert " << e << " is on device " << expert_device[e] << ", outside [0, "
                                                           << num_devices << ")");
}

// ---- router configuration ------------------------------------------------------

int RouterConfig::num_domains() const {
  int d = -1;
  for (int x : expert_domain) d = std::max(d, x);
  return d + 1;
}

int RouterConfig::min_eligible_experts() const {
  if (group_limited()) return group_mask == GroupMask::zero ? num_experts : topk_groups * (num_experts / num_groups);
  if (domain_limited()) {
    std::vector<int> sizes(static_cast<std::size_t>(std::max(0, num_domains())), 0);
    for (int x : expert_domain)
      if (x >= 0) ++sizes[static_cast<std::size_t>(x)];
    sizes.erase(std::remove(sizes.begin(), sizes.end(), 0), sizes.end());
    std::sort(sizes.begin(), sizes.end());
    int n = 0;
    for (int i = 0; i < std::min<int>(max_domains, static_cast<int>(sizes.size())); ++i) n += sizes[i];
    return n;
  }
  return num_experts;
}

void RouterConfig::validate() const {
  int const E = num_experts;
  KOKKOSMOE_REQUIRE(E >= 1, "router: num_experts must be >= 1 (got " << E << ")");
  KOKKOSMOE_REQUIRE(top_k >= 1, "router: top_k must be >= 1 (got " << top_k << ")");
  KOKKOSMOE_REQUIRE(top_k <= E, "router: top_k " << top_k << " > num_experts " << E);
  KOKKOSMOE_REQUIRE(select_mapping != SelectMapping::team || top_k <= 16,
                    "router: the team selection mapping keeps at most 16 experts per token (top_k = " << top_k << ")");
  KOKKOSMOE_REQUIRE(num_groups >= 1, "router: num_groups must be >= 1 (got " << num_groups << ")");
  KOKKOSMOE_REQUIRE(E % num_groups == 0,
                    "router: num_groups " << num_groups << " does not divide num_experts " << E);
  KOKKOSMOE_REQUIRE(topk_groups >= 1, "router: topk_groups must be >= 1 (got " << topk_groups << ")");
  KOKKOSMOE_REQUIRE(topk_groups <= num_groups,
                    "router: topk_groups " << topk_groups << " > num_groups " << num_groups);
  KOKKOSMOE_REQUIRE(group_score != SetScore::none || topk_groups == num_groups || num_groups == 1,
                    "router: topk_groups " << topk_groups << " < num_groups " << num_groups
                                           << " needs a group score (max or top_m_sum), got none");
  if (group_score == SetScore::top_m_sum) {
    int const gsize = E / num_groups;
    KOKKOSMOE_REQUIRE(group_top_m >= 1 && group_top_m <= Impl::router_max_top_m && group_top_m <= gsize,
                      "router: group_top_m " << group_top_m << " must be in [1, min(" << Impl::router_max_top_m
                                             << ", group size " << gsize << ")]");
  }
  KOKKOSMOE_REQUIRE(max_domains >= 0, "router: max_domains must be >= 0 (got " << max_domains << ")");
  if (max_domains > 0) {
    KOKKOSMOE_REQUIRE(static_cast<int>(expert_domain.size()) == E,
                      "router: expert_domain has " << expert_domain.size() << " entries for " << E
                                                   << " experts (domain-limited routing with max_domains "
                                                   << max_domains << ")");
    for (std::size_t e = 0; e < expert_domain.size(); ++e)
      KOKKOSMOE_REQUIRE(expert_domain[e] >= 0,
                        "router: expert_domain[" << e << "] = " << expert_domain[e] << " (domain ids must be >= 0)");
    KOKKOSMOE_REQUIRE(max_domains <= num_domains(),
                      "router: max_domains " << max_domains << " > number of domains " << num_domains());
    KOKKOSMOE_REQUIRE(domain_score == SetScore::max || domain_score == SetScore::top_m_sum,
                      "router: domain_score must be max or top_m_sum (got " << to_string(domain_score) << ")");
    if (domain_score == SetScore::top_m_sum)
      KOKKOSMOE_REQUIRE(domain_top_m >= 1 && domain_top_m <= Impl::router_max_top_m,
                        "router: domain_top_m " << domain_top_m << " must be in [1, " << Impl::router_max_top_m << "]");
    KOKKOSMOE_REQUIRE(!group_limited(), "router: group-limited (topk_groups " << topk_groups << " of " << num_groups
                                                                              << ") and domain-limited (max_domains "
                                                                              << max_domains
                                                                              << ") selection cannot be combined");
  } else {
    KOKKOSMOE_REQUIRE(expert_domain.empty() || static_cast<int>(expert_domain.size()) == E,
                      "router: expert_domain has " << expert_domain.size() << " entries for " << E << " experts");
  }
  int const eligible = min_eligible_experts();
  KOKKOSMOE_REQUIRE(top_k <= eligible,
                    "router: top_k " << top_k << " > eligible experts " << eligible
                                     << (group_limited() ? " (topk_groups x group size)"
                                                         : domain_limited() ? " (experts of the max_domains smallest domains)"
                                                                            : ""));
  KOKKOSMOE_REQUIRE(std::isfinite(route_scale) && route_scale > 0.0f,
                    "router: route_scale must be finite and > 0 (got " << route_scale << ")");
  admission.validate(E);
}

std::vector<int> expert_domains(Placement const& placement, bool by_node) {
  std::vector<int> domain(static_cast<std::size_t>(placement.num_experts()), -1);
  for (int s = 0; s < placement.num_slots(); ++s) {
    SlotInfo const& sl = placement.slot(s);
    int const d = by_node ? sl.node : sl.rank;
    KOKKOSMOE_REQUIRE(d >= 0, "expert_domains: slot " << s << " (expert " << sl.expert << ") has no "
                                                      << (by_node ? "node" : "rank"));
    int& cur = domain[static_cast<std::size_t>(sl.expert)];
    KOKKOSMOE_REQUIRE(cur < 0 || cur == d, "expert_domains: expert " << sl.expert << " has copies on "
                                                                     << (by_node ? "nodes " : "ranks ") << cur << " and "
                                                                     << d << "; a domain-limited router needs one "
                                                                     << (by_node ? "node" : "rank") << " per expert");
    cur = d;
  }
  return domain;
}

// ---- load statistics -------------------------------------------------------------

RouteCounts reduce_route_counts(RouteCounts const& local, MPI_Comm comm, double watchdog_seconds) {
  std::int64_t v[3] = {local.attempted, local.accepted, local.dropped};
  allreduce_watched(v, v, 3, MPI_INT64_T, MPI_SUM, comm, "route count reduction", watchdog_seconds);
  RouteCounts out;
  out.attempted = v[0];
  out.accepted = v[1];
  out.dropped = v[2];
  return out;
}

// ---- bias schedule -------------------------------------------------------------

BiasSchedule BiasSchedule::constant(double gamma) { return piecewise({{0, gamma}}); }

BiasSchedule BiasSchedule::piecewise(std::vector<std::pair<std::int64_t, double>> breakpoints) {
  KOKKOSMOE_REQUIRE(!breakpoints.empty(), "bias schedule: at least one breakpoint (step 0) is needed");
  KOKKOSMOE_REQUIRE(breakpoints.front().first == 0,
                    "bias schedule: the first breakpoint must be at step 0 (got " << breakpoints.front().first << ")");
  for (std::size_t i = 0; i < breakpoints.size(); ++i) {
    double const g = breakpoints[i].second;
    KOKKOSMOE_REQUIRE(std::isfinite(g) && g >= 0.0,
                      "bias schedule: gamma at step " << breakpoints[i].first << " must be finite and >= 0 (got " << g
                                                      << ")");
    KOKKOSMOE_REQUIRE(i == 0 || breakpoints[i].first > breakpoints[i - 1].first,
                      "bias schedule: breakpoint steps must increase (" << breakpoints[i - 1].first << " then "
                                                                        << breakpoints[i].first << ")");
  }
  BiasSchedule s;
  s.points_ = std::move(breakpoints);
  return s;
}

double BiasSchedule::gamma(std::int64_t step) const {
  double g = 0.0;
  for (auto const& p : points_) {
    if (p.first > step) break;
    g = p.second;
  }
  return g;
}

}  // namespace KokkosMoE
