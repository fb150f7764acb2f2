#ifndef KOKKOSMOE_ROUTER_HPP
#define KOKKOSMOE_ROUTER_HPP

/// \file KokkosMoE_Router.hpp
/// \brief The MoE router: hidden rows -> logits -> scores -> (group- or
/// domain-limited) top-k selection with a correction bias -> gates ->
/// admission -> RouteTable.
///
/// Semantics (every ordering is "larger value first, ties to the lower index"):
///  - score s_te: softmax over all E logits of the token, sigmoid of each
///    logit, or the input itself (ScoreFunction::identity).
///  - selection value v_te = s_te + b_e when the correction bias is enabled,
///    s_te otherwise. v is used only to choose groups, domains and experts.
///  - group limit: E experts form num_groups contiguous groups of E/num_groups;
///    group score = max of v over the group, or the sum of its top m values
///    (added largest first); the topk_groups best groups are kept.
///  - domain limit: expert_domain maps every expert to a domain (a rank or a
///    node); domain score = max or top-m sum of v over the domain's experts
///    (all of them when the domain has fewer than m); the max_domains best
///    non-empty domains are kept, so a token reaches at most max_domains
///    domains.
///  - top-k: the k best experts by v among the experts of the kept groups /
///    domains (all experts without a limit), listed in that order.
///  - gate of a selected expert: s_te (never v), divided by the sum of s over
///    the selected experts when normalize is set (unless that sum is 0), then
///    multiplied by route_scale.
/// Logits must be finite; NaN selection values count as -infinity.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Admission.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <impl/KokkosMoE_RouterSelect.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace KokkosMoE {

class Placement;

/// \brief How logits become scores.
enum class ScoreFunction {
  softmax,   ///< softmax over all routed experts of a token
  sigmoid,   ///< 1 / (1 + exp(-logit)), independent per expert
  identity,  ///< the input already holds scores (affinities)
};

/// \brief How a group or domain is scored from the selection values of its experts.
enum class SetScore {
  none,       ///< no limit (groups only)
  max,        ///< largest value
  top_m_sum,  ///< sum of the m largest values (m = group_top_m / domain_top_m; 2 for DeepSeek-V3)
};

/// \brief "softmax", "sigmoid", "identity".
inline EnumTable<ScoreFunction> const& names_of(ScoreFunction) {
  static EnumTable<ScoreFunction> const t{"score function",
                                          {{ScoreFunction::softmax, "softmax"},
                                           {ScoreFunction::sigmoid, "sigmoid"},
                                           {ScoreFunction::identity, "identity"}}};
  return t;
}
/// \brief "none", "max", "top_m_sum".
inline EnumTable<SetScore> const& names_of(SetScore) {
  static EnumTable<SetScore> const t{"group/domain score",
                                     {{SetScore::none, "none"},
                                      {SetScore::max, "max"},
                                      {SetScore::top_m_sum, "top_m_sum"}}};
  return t;
}
/// \brief Inverse of to_string(SetScore); also accepts "topN_sum" (e.g. "top2_sum"),
/// which sets *m to N when m is given. Throws Error naming the accepted names.
SetScore set_score_from_string(std::string const& name, int* m = nullptr);

/// \brief How the selection kernel maps tokens to the hardware.
enum class SelectMapping {
  automatic,  ///< thread on host execution spaces, team elsewhere (team needs top_k <= 16)
  thread,     ///< one thread per token (the CPU mapping)
  team,       ///< a team of vector lanes per token (the GPU mapping; top_k <= 16)
};
/// \brief "auto", "thread", "team".
inline EnumTable<SelectMapping> const& names_of(SelectMapping) {
  static EnumTable<SelectMapping> const t{
      "selection mapping", {{SelectMapping::automatic, "auto"}, {SelectMapping::thread, "thread"}, {SelectMapping::team, "team"}}};
  return t;
}

/// \brief What a group limit does to the experts of the groups it leaves
/// out. The two are both in use: DeepSeek's reference code excludes them
/// (their selection values become -inf); Hugging Face transformers' DeepSeek-V3
/// fills them with 0.0, so that, with a negative correction bias, an expert
/// of a dropped group can still win over a kept expert whose score plus bias
/// is below zero.
enum class GroupMask {
  exclude,  ///< the dropped groups' experts cannot be chosen
  zero,     ///< their selection values are 0.0 (ties: the lower expert index)
};

inline EnumTable<GroupMask> const& names_of(GroupMask) {
  static EnumTable<GroupMask> const t{"group mask", {{GroupMask::exclude, "exclude"}, {GroupMask::zero, "zero"}}};
  return t;
}

/// \brief Router settings. The group limit and the domain limit are exclusive.
struct RouterConfig {
  int num_experts = 0;   ///< E routed experts
  int top_k = 1;         ///< k experts per token
  ScoreFunction score = ScoreFunction::softmax;
  bool use_correction_bias = false;  ///< add the router's bias to the selection values

  int num_groups = 1;                ///< contiguous expert groups (must divide E)
  int topk_groups = 1;               ///< groups kept per token (group limit active when < num_groups)
  SetScore group_score = SetScore::none;
  int group_top_m = 2;               ///< m of SetScore::top_m_sum for groups
  GroupMask group_mask = GroupMask::exclude;  ///< the dropped groups' experts: excluded, or selection value 0

  std::vector<int> expert_domain;    ///< [E] domain of every expert; empty: no domain limit
  int max_domains = 0;               ///< domains kept per token (domain limit active when > 0)
  SetScore domain_score = SetScore::max;
  int domain_top_m = 2;              ///< m of SetScore::top_m_sum for domains

  bool normalize = false;            ///< divide gates by their sum over the selected experts
  float route_scale = 1.0f;          ///< gates are multiplied by this (after normalization)

  AdmissionConfig admission;         ///< admission policy applied after selection
  SelectMapping select_mapping = SelectMapping::automatic;  ///< selection kernel mapping (same results)

  /// \brief True when groups restrict the candidates.
  bool group_limited() const { return group_score != SetScore::none && topk_groups < num_groups; }
  /// \brief True when domains restrict the candidates.
  bool domain_limited() const { return max_domains > 0; }
  /// \brief Number of domains (largest id in expert_domain + 1; 0 without a map).
  int num_domains() const;
  /// \brief Smallest number of experts a token can choose from under the limits.
  int min_eligible_experts() const;

  /// \brief Throws Error with a message naming every offending value unless the
  /// configuration is usable: E >= 1; 1 <= top_k <= min_eligible_experts();
  /// num_groups >= 1 divides E; 1 <= topk_groups <= num_groups; a group score
  /// when topk_groups < num_groups; 1 <= group_top_m <= min(16, E/num_groups);
  /// expert_domain of size E with ids >= 0 when max_domains > 0;
  /// max_domains <= num_domains(); domain score max or top_m_sum with
  /// 1 <= domain_top_m <= 16; no group limit together with a domain limit;
  /// finite route_scale > 0; valid admission settings.
  void validate() const;
};

/// \brief expert -> domain map for RouterConfig::expert_domain from a placement:
/// the rank (by_node = false) or the node (by_node = true) holding every
/// expert. Throws Error when an expert's copies lie in more than one domain
/// or a slot has no node.
std::vector<int> expert_domains(Placement const& placement, bool by_node);

/// \brief Per-call inputs of Router::route besides the activations.
template <class MemorySpace>
struct RouteOptions {
  /// [T] nonzero: the token belongs to a protected sequence (admitted first); empty: none.
  Kokkos::View<const std::uint8_t*, MemorySpace> protected_tokens;
  /// GEMM implementation for the logits.
  GemmPath gemm_path = GemmPath::automatic;
};

/// \brief The router for one MoE layer. Owns the correction bias and the
/// work views of the last call (logits, scores, selected affinities, kept
/// groups / domains), which stay valid until the next call.
///
/// Not thread-safe; calls on one Router must be ordered. Every operation
/// runs on the given execution space instance and fences it before return.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class Router {
 public:
  using memory_space = MemorySpace;
  template <class T>
  using Mat = Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace>;

  /// \brief Validates config (throws Error before any allocation) and sets the
  /// correction bias to zero.
  explicit Router(RouterConfig config) : config_(std::move(config)) {
    config_.validate();
    int const E = config_.num_experts;
    bias_ = Kokkos::View<float*, MemorySpace>("KokkosMoE::Router::correction_bias", E);
    zero_bias_ = Kokkos::View<float*, MemorySpace>("KokkosMoE::Router::zero_bias", E);
    if (config_.domain_limited()) {
      int const D = config_.num_domains();
      std::vector<int> offsets(static_cast<std::size_t>(D) + 1, 0), members(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) ++offsets[static_cast<std::size_t>(config_.expert_domain[e]) + 1];
      for (int d = 0; d < D; ++d) offsets[d + 1] += offsets[d];
      std::vector<int> fill(offsets.begin(), offsets.end() - 1);
      for (int e = 0; e < E; ++e) members[static_cast<std::size_t>(fill[config_.expert_domain[e]]++)] = e;
      typename MemorySpace::execution_space exec;
      domain_offsets_ = Impl::to_device_ints<MemorySpace>(exec, offsets, "KokkosMoE::Router::domain_offsets");
      domain_members_ = Impl::to_device_ints<MemorySpace>(exec, members, "KokkosMoE::Router::domain_members");
      domain_of_ = Impl::to_device_ints<MemorySpace>(exec, config_.expert_domain, "KokkosMoE::Router::domain_of");
    }
  }

  RouterConfig const& config() const { return config_; }

  /// \brief [E] FP32 correction bias used by the next call when
  /// config().use_correction_bias is set. Writable (checkpoint restore, bias
  /// controller); changing it never alters a RouteTable already produced.
  Kokkos::View<float*, MemorySpace> correction_bias() const { return bias_; }

  /// \brief Routes T tokens from their hidden rows: logits = hidden * weight^T
  /// with FP32 accumulation through KokkosMoE::gemm, then route_logits().
  /// \param hidden [T, d] float or bf16_t rows
  /// \param weight [E, d] float or bf16_t router weight
  /// \param table output; (re)allocated when its extents are not [T, k] / [E]
  /// \return the admission statistics
  template <class ExecutionSpace, class HiddenView, class WeightView>
  AdmissionStats route(ExecutionSpace const& exec, HiddenView const& hidden, WeightView const& weight,
                       RouteTable<MemorySpace>& table, RouteOptions<MemorySpace> const& options = {}) {
    static_assert(Compat::view_rank<HiddenView> == 2 && Compat::view_rank<WeightView> == 2,
                  "Router::route: hidden and weight must be rank-2 views");
    using HT = typename HiddenView::non_const_value_type;
    using WT = typename WeightView::non_const_value_type;
    static_assert((std::is_same<HT, float>::value || std::is_same<HT, bf16_t>::value) &&
                      (std::is_same<WT, float>::value || std::is_same<WT, bf16_t>::value),
                  "Router::route: hidden and weight hold float or bf16_t");
    index_t const T = static_cast<index_t>(hidden.extent(0));
    KOKKOSMOE_REQUIRE(static_cast<int>(weight.extent(0)) == config_.num_experts && weight.extent(1) == hidden.extent(1),
                      "Router::route: hidden is " << hidden.extent(0) << "x" << hidden.extent(1) << ", weight is "
                                                  << weight.extent(0) << "x" << weight.extent(1) << ", expected weight "
                                                  << config_.num_experts << "x" << hidden.extent(1));
    check_call(T, options);
    logits_ = Mat<float>();  // the workspace reuses what nobody else holds
    logits_ = work_.template matrix<float>(exec, "logits", T, static_cast<std::size_t>(config_.num_experts));
    {
      Compat::ScopedRegion region("KokkosMoE::Router::logits");
      gemm_path_ = gemm(exec, 'N', 'T', 1.0f, hidden, weight, 0.0f, logits_, options.gemm_path);
    }
    return route_logits(exec, Mat<const float>(logits_), table, options);
  }

  /// \brief Routes T tokens from precomputed logits (or scores for
  /// ScoreFunction::identity), [T, E] FP32: selection, gates, then admission
  /// under config().admission with the original score of every route
  /// (selected_scores()) as its priority and options.protected_tokens first.
  /// table.expert_counts = admitted routes per expert (exact integer
  /// reduction); table.counts = attempted / accepted / dropped.
  /// \param table output; (re)allocated when its extents are not [T, k] / [E]
  /// \return the admission statistics
  template <class ExecutionSpace>
  AdmissionStats route_logits(ExecutionSpace const& exec, Impl::type_identity_t<Mat<const float>> logits,
                              RouteTable<MemorySpace>& table, RouteOptions<MemorySpace> const& options = {}) {
    index_t const T = static_cast<index_t>(logits.extent(0));
    int const E = config_.num_experts, k = config_.top_k;
    KOKKOSMOE_REQUIRE(static_cast<int>(logits.extent(1)) == E,
                      "Router::route_logits: logits are " << logits.extent(0) << "x" << logits.extent(1) << ", expected "
                                                          << T << "x" << E);
    check_call(T, options);
    Compat::ScopedRegion region("KokkosMoE::Router::route");
    if (table.num_tokens() != T || table.top_k() != k || table.num_experts() != E ||
        table.gate.extent(0) != static_cast<std::size_t>(T) || table.accepted.extent(0) != static_cast<std::size_t>(T))
      table = RouteTable<MemorySpace>("KokkosMoE::Router::routes", T, k, E);
    select(exec, logits, table);
    AdmissionStats stats =
        admit(exec, config_.admission, table, Mat<const float>(affinity_), options.protected_tokens, &work_);
    Compat::fence(exec, "KokkosMoE::Router::route");
    return stats;
  }

  /// \brief Selection and gates without admission: writes table.expert and
  /// table.gate (and the work views); table.accepted, expert_counts and counts
  /// are left unchanged. For callers that admit separately with admit().
  /// Does not fence exec.
  template <class ExecutionSpace>
  void select(ExecutionSpace const& exec, Impl::type_identity_t<Mat<const float>> logits, RouteTable<MemorySpace>& table) {
    index_t const T = static_cast<index_t>(logits.extent(0));
    int const E = config_.num_experts, k = config_.top_k;
    KOKKOSMOE_REQUIRE(static_cast<int>(logits.extent(1)) == E && table.num_tokens() == T && table.top_k() == k &&
                          table.num_experts() == E,
                      "Router::select: logits " << logits.extent(0) << "x" << logits.extent(1) << ", table "
                                                << table.num_tokens() << "x" << table.top_k() << " for "
                                                << table.num_experts() << " experts; expected " << T << "x" << E
                                                << ", " << T << "x" << k << ", " << E);
    KOKKOSMOE_REQUIRE(T <= index_t(0x7FFFFFFF), "Router: at most 2^31-1 tokens per call (got " << T << ")");
    ensure_work(exec, T);
    if (T == 0) return;
    if (k <= 1)
      launch_select<ExecutionSpace, 1>(exec, logits, table);
    else if (k <= 2)
      launch_select<ExecutionSpace, 2>(exec, logits, table);
    else if (k <= 4)
      launch_select<ExecutionSpace, 4>(exec, logits, table);
    else if (k <= 8)
      launch_select<ExecutionSpace, 8>(exec, logits, table);
    else if (k <= 16)
      launch_select<ExecutionSpace, 16>(exec, logits, table);
    else
      launch_select<ExecutionSpace, 0>(exec, logits, table);
  }

  /// \brief [T, E] scores (score-function output, no bias) of the last call.
  Mat<float> scores() const { return scores_; }
  /// \brief [T, k] original score of every selected expert of the last call
  /// (the admission priority of the route).
  Mat<float> selected_scores() const { return affinity_; }
  /// \brief [T, topk_groups] kept groups of the last call, best first; empty
  /// without a group limit.
  Mat<int> selected_groups() const { return config_.group_limited() ? kept_ : Mat<int>(); }
  /// \brief [T, max_domains] kept domains of the last call, best first (-1:
  /// fewer non-empty domains than max_domains); empty without a domain limit.
  Mat<int> selected_domains() const { return config_.domain_limited() ? kept_ : Mat<int>(); }
  /// \brief [T, E] logits of the last route() from hidden rows.
  Mat<float> logits() const { return logits_; }
  /// \brief GEMM path of the last route() from hidden rows.
  GemmPath gemm_path() const { return gemm_path_; }

  /// Bytes of the buffers the router keeps between calls.
  std::int64_t held_bytes() const { return work_.held_bytes(); }

 private:
  void check_call(index_t T, RouteOptions<MemorySpace> const& options) const {
    KOKKOSMOE_REQUIRE(T <= index_t(0x7FFFFFFF), "Router: at most 2^31-1 tokens per call (got " << T << ")");
    KOKKOSMOE_REQUIRE(options.protected_tokens.size() == 0 || static_cast<index_t>(options.protected_tokens.extent(0)) == T,
                      "Router: protected_tokens has " << options.protected_tokens.extent(0) << " entries for " << T
                                                      << " tokens");
  }

  template <class ExecutionSpace, int K>
  void launch_select(ExecutionSpace const& exec, Mat<const float> const& logits, RouteTable<MemorySpace>& table) {
    int const E = config_.num_experts;
    Impl::RouterSelect<MemorySpace, K> f;
    f.input = logits;
    f.scores = scores_;
    f.bias = config_.use_correction_bias ? bias_ : zero_bias_;
    f.expert = table.expert;
    f.gate = table.gate;
    f.affinity = affinity_;
    f.set_scores = set_scores_;
    f.kept = kept_;
    f.domain_offsets = domain_offsets_;
    f.domain_members = domain_members_;
    f.E = E;
    f.k = config_.top_k;
    f.score = config_.score == ScoreFunction::softmax   ? Impl::KernelScore::softmax
              : config_.score == ScoreFunction::sigmoid ? Impl::KernelScore::sigmoid
                                                        : Impl::KernelScore::identity;
    f.normalize = config_.normalize;
    f.route_scale = config_.route_scale;
    if (config_.group_limited()) {
      f.limit = Impl::KernelLimit::groups;
      f.num_sets = config_.num_groups;
      f.keep_sets = config_.topk_groups;
      f.group_size = E / config_.num_groups;
      f.set_mode = config_.group_score == SetScore::max ? Impl::KernelSetScore::max : Impl::KernelSetScore::top_m_sum;
      f.top_m = config_.group_top_m;
      f.zero_masked = config_.group_mask == GroupMask::zero;
    } else if (config_.domain_limited()) {
      f.limit = Impl::KernelLimit::domains;
      f.num_sets = config_.num_domains();
      f.keep_sets = config_.max_domains;
      f.set_mode = config_.domain_score == SetScore::max ? Impl::KernelSetScore::max : Impl::KernelSetScore::top_m_sum;
      f.top_m = config_.domain_top_m;
    }
    index_t const T = static_cast<index_t>(logits.extent(0));
    constexpr bool host = Kokkos::SpaceAccessibility<ExecutionSpace, Kokkos::HostSpace>::accessible;
    SelectMapping const m = config_.select_mapping;
    if constexpr (K > 0) {
      if (m == SelectMapping::team || (m == SelectMapping::automatic && !host)) {
        using team_kernel = Impl::RouterSelectTeam<MemorySpace, K>;
        team_kernel g;
        static_cast<Impl::RouterSelect<MemorySpace, K>&>(g) = f;
        g.domain_of = domain_of_;
        g.num_tokens = T;
        g.tokens_per_team = host ? 1 : 4;
        int const lanes = host ? 1 : team_kernel::lanes;
        Kokkos::TeamPolicy<ExecutionSpace> policy(exec, static_cast<int>((T + g.tokens_per_team - 1) / g.tokens_per_team),
                                                  g.tokens_per_team, lanes);
        policy.set_scratch_size(0, Kokkos::PerTeam(team_kernel::bytes_per_token() * static_cast<std::size_t>(g.tokens_per_team)));
        Compat::ScopedRegion region("KokkosMoE::Router::select[team]");
        Kokkos::parallel_for("KokkosMoE::Router::select[team]", policy, g);
        return;
      }
    }
    Compat::ScopedRegion region("KokkosMoE::Router::select[thread]");
    Kokkos::parallel_for("KokkosMoE::Router::select[thread]", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, T), f);
  }

  template <class ExecutionSpace>
  void ensure_work(ExecutionSpace const& exec, index_t T) {
    int const E = config_.num_experts, k = config_.top_k;
    scores_ = Mat<float>();
    affinity_ = Mat<float>();
    scores_ = work_.template matrix<float>(exec, "scores", T, static_cast<std::size_t>(E));
    affinity_ = work_.template matrix<float>(exec, "affinity", T, static_cast<std::size_t>(k));
    int sets = 0, keep = 0;
    if (config_.group_limited()) {
      sets = config_.num_groups;
      keep = config_.topk_groups;
    } else if (config_.domain_limited()) {
      sets = config_.num_domains();
      keep = config_.max_domains;
    }
    set_scores_ = Mat<float>();
    kept_ = Mat<int>();
    if (sets > 0) set_scores_ = work_.template matrix<float>(exec, "set_scores", T, static_cast<std::size_t>(sets));
    if (keep > 0) kept_ = work_.template matrix<int>(exec, "kept", T, static_cast<std::size_t>(keep));
  }

  RouterConfig config_;
  Kokkos::View<float*, MemorySpace> bias_, zero_bias_;
  Kokkos::View<int*, MemorySpace> domain_offsets_, domain_members_, domain_of_;
  Mat<float> logits_, scores_, affinity_, set_scores_;
  Mat<int> kept_;
  Workspace<MemorySpace> work_{"KokkosMoE::Router"};
  GemmPath gemm_path_ = GemmPath::automatic;
};

}  // namespace KokkosMoE

#endif
