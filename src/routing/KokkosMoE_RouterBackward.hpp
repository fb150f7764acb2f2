#ifndef KOKKOSMOE_ROUTER_BACKWARD_HPP
#define KOKKOSMOE_ROUTER_BACKWARD_HPP

/// \file KokkosMoE_RouterBackward.hpp
/// \brief Gradients of the router: gate gradients to logits, and the load
/// balance loss with its exact logit gradient.
///
/// Gates. For token t with selected experts e_1..e_k (selection is not
/// differentiable: gradients flow only through the selected experts' scores,
/// and the correction bias, used for selection only, gets none), affinities
/// a_j = score(z)_{e_j} (softmax over all E logits, or the sigmoid of the
/// logit), S = sum_j a_j, and gates g_j = s a_j / S with normalization (s =
/// route_scale) or s a_j without. Given dg:
///
///     da_j = s (dg_j - sum_i dg_i g_i / s) / S       (normalized; s dg_j otherwise)
///     softmax:  dz_e = p_e (da(e) - sum_j da_j a_j),  da(e) = da_j if e = e_j else 0
///     sigmoid:  dz_{e_j} = da_j a_j (1 - a_j)
///
/// Balance loss. Every supported form is L = sum_e q_e P_e over a group of
/// tokens, with q the hard routing statistic (stopped in backward) and P_e
/// the mean over the group's N tokens of a per-token distribution p_t over
/// experts (the softmax probabilities, or for sigmoid scores the scores
/// normalized to sum 1, as in DeepSeek-V3). Its exact gradient is
///
///     dL/dz_{t,j} = c_{t,j} / N * (q_j - sum_e p_{t,e} q_e)
///
/// with c = p_{t,j} for softmax and (1 - sigmoid(z_{t,j})) p_{t,j} for
/// normalized sigmoid scores (for softmax this is p_{t,j}/N (q_j - sum_e
/// p_{t,e} q_e)). The forms (f_e = count_e / (N k), the fraction of the
/// group's routes that selected e):
///
///  - switch (Switch Transformer / GShard): q_e = alpha E f_e; one group of
///    all tokens of the scope (the ranks of the given communicator: per rank
///    with MPI_COMM_SELF, per expert-parallel group with its communicator).
///    Balanced routing gives L = alpha; alpha E sum_e f_e P_e in general.
///  - sequence (DeepSeek-V3's sequence-wise loss): the switch term of every
///    sequence (contiguous blocks of sequence_length tokens on a rank),
///    averaged over the sequences of the scope.
///  - device (DeepSeek-V2's device-level loss): experts grouped by device,
///    f'_i = mean over device i's experts of E f_e, P'_i = sum of their P_e,
///    L = alpha sum_i f'_i P'_i, i.e. q_e = alpha f'_{device(e)}.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_Types.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

namespace Impl {

/// The router backward kernels' mapping: a team thread per token (or per
/// chunk of tokens) and vector lanes over its experts, coalesced on a GPU;
/// one lane per thread on hosts. Scores are recomputed from the logits where
/// they are needed, so no kernel keeps a per-token array and E is unbounded.
template <class Exec>
struct TokenTeams {
  static constexpr bool host = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;
  static constexpr int per_team = host ? 1 : 4;  ///< tokens (team threads) per team
  static constexpr int lanes = host ? 1 : 32;    ///< vector lanes per token
  using Policy = Kokkos::TeamPolicy<Exec>;
  using Member = typename Policy::member_type;
  static Policy policy(Exec const& exec, index_t items) {
    return Policy(exec, static_cast<int>((items + per_team - 1) / per_team), per_team, lanes);
  }
  /// The item of this team thread (>= items for the last team's spare threads).
  KOKKOS_INLINE_FUNCTION static index_t item(Member const& team) {
    return static_cast<index_t>(team.league_rank()) * per_team + team.team_rank();
  }
};

/// Partial sums over experts: partial l adds experts l, l + 8, l + 16, ...
/// in order, and the 8 partials are added in order, so a sum has the same
/// bits for every backend and vector length.
constexpr int score_partials = 8;
struct ScorePartials {
  float v[score_partials];
};
struct ScorePartialsSum {
  using reducer = ScorePartialsSum;
  using value_type = ScorePartials;
  using result_view_type = Kokkos::View<value_type, Kokkos::HostSpace, Kokkos::MemoryUnmanaged>;
  value_type* value;
  KOKKOS_INLINE_FUNCTION explicit ScorePartialsSum(value_type& v) : value(&v) {}
  // Every partial has one contributing lane; the others add +0.
  KOKKOS_INLINE_FUNCTION void join(value_type& dest, value_type const& src) const {
    for (int l = 0; l < score_partials; ++l) dest.v[l] += src.v[l];
  }
  KOKKOS_INLINE_FUNCTION void init(value_type& v) const {
    for (int l = 0; l < score_partials; ++l) v.v[l] = 0.0f;
  }
  KOKKOS_INLINE_FUNCTION value_type& reference() const { return *value; }
  result_view_type view() const { return result_view_type(value); }
  KOKKOS_INLINE_FUNCTION bool references_scalar() const { return true; }
};

/// sum_e f(e) over e in [0, E) in the fixed partial order, on the calling
/// thread's vector lanes; every lane gets the total.
template <class Member, class F>
KOKKOS_INLINE_FUNCTION float ordered_sum(Member const& team, int E, F const& f) {
  ScorePartials parts;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, score_partials),
      [&](int l, ScorePartials& acc) {
        float s = 0.0f;
        for (int e = l; e < E; e += score_partials) s += f(e);
        acc.v[l] += s;
      },
      ScorePartialsSum(parts));
  float total = parts.v[0];
  for (int l = 1; l < score_partials; ++l) total += parts.v[l];
  return total;
}

/// How a score comes from a logit.
enum class ScoreKind : int { softmax, sigmoid, identity };

/// One token's scores, recomputed from its logits on demand: softmax
/// exp(z - max) / sum, sigmoid 1 / (1 + exp(-z)) (divided by the sum of
/// the token's sigmoids when normalized), identity z.
struct TokenScore {
  ScoreKind kind = ScoreKind::identity;
  float m = 0.0f;      ///< softmax: the largest logit
  float sum = 1.0f;    ///< the divisor (softmax, normalized sigmoid)
  bool divide = false;
  KOKKOS_INLINE_FUNCTION float raw(float z) const {
    return kind == ScoreKind::softmax ? Compat::exp(z - m) : kind == ScoreKind::sigmoid ? 1.0f / (1.0f + Compat::exp(-z)) : z;
  }
  KOKKOS_INLINE_FUNCTION float operator()(float z) const { return divide ? raw(z) / sum : raw(z); }
};

/// Token t's TokenScore (its max and sum over the vector lanes).
template <class Member, class Logits>
KOKKOS_INLINE_FUNCTION TokenScore token_score(Member const& team, Logits const& z, index_t t, int E, ScoreKind kind,
                                              bool normalized) {
  TokenScore s;
  s.kind = kind;
  if (kind == ScoreKind::softmax) {
    float m = z(t, 0);
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, E), [&](int e, float& mx) { mx = Compat::max(mx, z(t, e)); }, Kokkos::Max<float>(m));
    s.m = m;
  }
  if (kind == ScoreKind::softmax || (kind == ScoreKind::sigmoid && normalized)) {
    s.sum = ordered_sum(team, E, [&](int e) { return s.raw(z(t, e)); });
    s.divide = true;
  }
  return s;
}

}  // namespace Impl

/// \brief dlogits [T, E] (+)= the gradient through the gates of `table`
/// (which `config`'s router produced from `logits`) given dgate [T, k] (zero
/// for dropped routes, whose gates did not reach the output; their
/// affinities still enter the normalization). Softmax and sigmoid scores;
/// identity scores pass da straight to the selected inputs. Any E; a team
/// thread per token with vector lanes over the experts.
/// \param accumulate add to dlogits instead of overwriting it
template <class Exec, class MS>
void router_backward(Exec const& exec, RouterConfig const& config, Kokkos::View<const float**, Kokkos::LayoutRight, MS> logits,
                     RouteTable<MS> const& table, Kokkos::View<const float**, Kokkos::LayoutRight, MS> dgate,
                     Kokkos::View<float**, Kokkos::LayoutRight, MS> dlogits, bool accumulate = false) {
  index_t const T = static_cast<index_t>(logits.extent(0));
  int const E = config.num_experts, k = config.top_k;
  KOKKOSMOE_REQUIRE(static_cast<int>(logits.extent(1)) == E && table.num_tokens() == T && table.top_k() == k &&
                        static_cast<index_t>(dgate.extent(0)) == T && static_cast<int>(dgate.extent(1)) == k &&
                        static_cast<index_t>(dlogits.extent(0)) == T && static_cast<int>(dlogits.extent(1)) == E,
                    "router_backward: logits " << logits.extent(0) << "x" << logits.extent(1) << ", routes " << table.num_tokens()
                                               << "x" << table.top_k() << ", dgate " << dgate.extent(0) << "x" << dgate.extent(1)
                                               << ", dlogits " << dlogits.extent(0) << "x" << dlogits.extent(1)
                                               << "; the router has E = " << E << ", k = " << k);
  using Teams = Impl::TokenTeams<Exec>;
  using Impl::ScoreKind;
  ScoreKind const kind = config.score == ScoreFunction::softmax   ? ScoreKind::softmax
                         : config.score == ScoreFunction::sigmoid ? ScoreKind::sigmoid
                                                                  : ScoreKind::identity;
  bool const normalize = config.normalize;
  float const scale = config.route_scale;
  auto expert = table.expert;
  Compat::ScopedRegion region("KokkosMoE::router_backward");
  if (T == 0) return;
  Kokkos::parallel_for(
      "KokkosMoE::router_backward[team]", Teams::policy(exec, T), KOKKOS_LAMBDA(typename Teams::Member const& team) {
        index_t const t = Teams::item(team);
        if (t >= T) return;
        Impl::TokenScore const p = Impl::token_score(team, logits, t, E, kind, false);
        float S = 0.0f;
        for (int j = 0; j < k; ++j) S += p(logits(t, expert(t, j)));
        float const denom = (normalize && S > 0.0f) ? S : 1.0f;
        // sum_i dg_i a_i / S (the normalization's share).
        float cross = 0.0f;
        if (normalize && S > 0.0f)
          for (int j = 0; j < k; ++j) cross += dgate(t, j) * p(logits(t, expert(t, j))) / S;
        float dot = 0.0f;  // softmax: sum_j da_j a_j
        if (kind == ScoreKind::softmax)
          for (int j = 0; j < k; ++j) dot += scale * (dgate(t, j) - cross) / denom * p(logits(t, expert(t, j)));
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E), [&](int e) {
          float const pe = p(logits(t, e));
          float v = accumulate ? dlogits(t, e) : 0.0f;
          if (kind == ScoreKind::softmax) v -= pe * dot;
          for (int j = 0; j < k; ++j) {
            if (expert(t, j) != e) continue;
            float const da = scale * (dgate(t, j) - cross) / denom;
            v += kind == ScoreKind::softmax ? pe * da : kind == ScoreKind::sigmoid ? da * pe * (1.0f - pe) : da;
          }
          dlogits(t, e) = v;
        });
      });
  Compat::fence(exec, "KokkosMoE::router_backward");
}

/// \brief Which balance loss (see the file comment).
enum class BalanceLossForm { switch_gshard, sequence, device };

/// \brief Balance loss settings.
struct BalanceLossConfig {
  BalanceLossForm form = BalanceLossForm::switch_gshard;
  double alpha = 1.0;             ///< the loss coefficient
  index_t sequence_length = 0;    ///< sequence: tokens per sequence (> 0, divides every rank's T)
  std::vector<int> expert_device; ///< device: [E] device of every expert (ids from 0)
};

/// \brief The loss and its statistics, the same on every rank of the scope
/// (switch and device; for sequence, f and P are those of the scope's
/// sequences pooled, for reading only).
struct BalanceLossResult {
  double loss = 0.0;              ///< L (sequence: mean over the scope's sequences)
  double balanced = 0.0;          ///< L of perfectly balanced routing (alpha)
  std::vector<double> f;          ///< [E] fraction of routes per expert
  std::vector<double> P;          ///< [E] mean distribution per expert
  std::vector<double> q;          ///< [E] the stopped statistic (switch, device)
  index_t tokens = 0;             ///< tokens of the scope
};

/// \brief Collective over `scope`: the balance loss of every rank's routing
/// (`table` from `logits` by a router with `config`) and, when dlogits is
/// given (non-empty), dlogits += weight * dL/dlogits for this rank's tokens.
/// Softmax and sigmoid scores. Throws CollectiveError (every rank) on
/// mismatched shapes or settings. Its device scratch comes from ws when one
/// is given.
template <class Exec, class MS>
BalanceLossResult balance_loss(Exec const& exec, RouterConfig const& config, BalanceLossConfig const& bl,
                               Kokkos::View<const float**, Kokkos::LayoutRight, MS> logits, RouteTable<MS> const& table,
                               MPI_Comm scope, Kokkos::View<float**, Kokkos::LayoutRight, MS> dlogits = {},
                               float weight = 1.0f, double watchdog_seconds = 300.0, Workspace<MS>* ws = nullptr) {
  index_t const T = static_cast<index_t>(logits.extent(0));
  int const E = config.num_experts, k = config.top_k;
  bool const want_grad = dlogits.data() != nullptr;
  index_t const S = bl.form == BalanceLossForm::sequence ? bl.sequence_length : T;
  collective(scope, "balance_loss", [&] {
    KOKKOSMOE_REQUIRE(config.score == ScoreFunction::softmax || config.score == ScoreFunction::sigmoid,
                      "balance_loss: the router's scores must be softmax or sigmoid");
    KOKKOSMOE_REQUIRE(static_cast<int>(logits.extent(1)) == E && table.num_tokens() == T && table.top_k() == k,
                      "balance_loss: logits " << logits.extent(0) << "x" << logits.extent(1) << ", routes " << table.num_tokens()
                                              << "x" << table.top_k() << "; the router has E = " << E << ", k = " << k);
    KOKKOSMOE_REQUIRE(!want_grad || (static_cast<index_t>(dlogits.extent(0)) == T && static_cast<int>(dlogits.extent(1)) == E),
                      "balance_loss: dlogits is " << dlogits.extent(0) << "x" << dlogits.extent(1) << ", expected " << T << "x" << E);
    KOKKOSMOE_REQUIRE(bl.alpha >= 0.0, "balance_loss: alpha = " << bl.alpha << " is negative");
    if (bl.form == BalanceLossForm::sequence)
      KOKKOSMOE_REQUIRE(S > 0 && T % S == 0,
                        "balance_loss: sequence_length = " << S << " must be > 0 and divide this rank's " << T << " tokens");
    if (bl.form == BalanceLossForm::device) {
      KOKKOSMOE_REQUIRE(static_cast<int>(bl.expert_device.size()) == E,
                        "balance_loss: expert_device has " << bl.expert_device.size() << " entries for " << E << " experts");
      for (int e = 0; e < E; ++e)
        KOKKOSMOE_REQUIRE(bl.expert_device[static_cast<std::size_t>(e)] >= 0,
                          "balance_loss: expert_device[" << e << "] = " << bl.expert_device[static_cast<std::size_t>(e)]);
    }
  }, watchdog_seconds);

  Compat::ScopedRegion region("KokkosMoE::balance_loss");
  bool const softmax = config.score == ScoreFunction::softmax;
  bool const per_sequence = bl.form == BalanceLossForm::sequence;
  // Statistics over chunks of tokens (a sequence each, or 256 tokens), one
  // team thread per chunk in token order (its lanes over the experts),
  // summed on the host in chunk order: the same sums for any execution
  // space and vector length.
  index_t const chunk = per_sequence ? S : index_t(256);
  index_t const chunks = (T + chunk - 1) / chunk;
  index_t const groups = per_sequence ? chunks : (T > 0 ? 1 : 0);
  auto const psum = scratch<Kokkos::View<double**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::balance_loss::psum", chunks,
                                                                           static_cast<std::size_t>(E));
  auto const count = scratch<Kokkos::View<std::int64_t**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::balance_loss::count", chunks,
                                                                                   static_cast<std::size_t>(E));
  Kokkos::deep_copy(exec, psum, 0.0);
  Kokkos::deep_copy(exec, count, std::int64_t(0));
  auto expert = table.expert;
  using Teams = Impl::TokenTeams<Exec>;
  Impl::ScoreKind const kind = softmax ? Impl::ScoreKind::softmax : Impl::ScoreKind::sigmoid;
  if (chunks > 0)
    Kokkos::parallel_for(
        "KokkosMoE::balance_loss[statistics]", Teams::policy(exec, chunks), KOKKOS_LAMBDA(typename Teams::Member const& team) {
          index_t const c = Teams::item(team);
          if (c >= chunks) return;
          index_t const end = (c + 1) * chunk < T ? (c + 1) * chunk : T;
          for (index_t t = c * chunk; t < end; ++t) {
            Impl::TokenScore const p = Impl::token_score(team, logits, t, E, kind, true);
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E),
                                 [&](int e) { psum(c, e) += static_cast<double>(p(logits(t, e))); });
            Kokkos::single(Kokkos::PerThread(team), [&]() {
              for (int j = 0; j < k; ++j) count(c, expert(t, j)) += 1;
            });
          }
        });
  // Host copies without mirrors (psum and count are contiguous rows).
  std::size_t const cells = static_cast<std::size_t>(chunks) * static_cast<std::size_t>(E);
  using unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
  auto const hpc = copy_to_host(exec, Kokkos::View<double const*, MS, unmanaged>(psum.data(), cells));
  auto const hcc = copy_to_host(exec, Kokkos::View<std::int64_t const*, MS, unmanaged>(count.data(), cells));
  // Per group ([groups, E]: the sequences, or one row of all chunks).
  std::vector<double> hp_values(static_cast<std::size_t>(groups) * static_cast<std::size_t>(E), 0.0);
  std::vector<std::int64_t> hc_values(hp_values.size(), 0);
  auto hp = [&](index_t g, int e) -> double& { return hp_values[static_cast<std::size_t>(g) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)]; };
  auto hc = [&](index_t g, int e) -> std::int64_t& { return hc_values[static_cast<std::size_t>(g) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)]; };
  for (index_t c = 0; c < chunks; ++c)
    for (int e = 0; e < E; ++e) {
      index_t const g = per_sequence ? c : 0;
      std::size_t const at = static_cast<std::size_t>(c) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e);
      hp(g, e) += hpc[at];
      hc(g, e) += hcc[at];
    }

  BalanceLossResult r;
  r.balanced = bl.alpha;
  r.f.assign(static_cast<std::size_t>(E), 0.0);
  r.P.assign(static_cast<std::size_t>(E), 0.0);
  r.q.assign(static_cast<std::size_t>(E), 0.0);
  // Pooled statistics of the scope: counts, distribution sums, tokens and groups.
  std::vector<double> local(2 * static_cast<std::size_t>(E) + 2, 0.0), pooled(local.size());
  for (index_t g = 0; g < groups; ++g)
    for (int e = 0; e < E; ++e) {
      local[static_cast<std::size_t>(e)] += static_cast<double>(hc(g, e));
      local[static_cast<std::size_t>(E + e)] += hp(g, e);
    }
  local[2 * static_cast<std::size_t>(E)] = static_cast<double>(T);
  local[2 * static_cast<std::size_t>(E) + 1] = static_cast<double>(groups);
  allreduce_watched(local.data(), pooled.data(), static_cast<int>(local.size()), MPI_DOUBLE, MPI_SUM, scope,
                    "balance_loss: statistics", watchdog_seconds);
  double const N = pooled[2 * static_cast<std::size_t>(E)];
  double const scope_groups = pooled[2 * static_cast<std::size_t>(E) + 1];
  r.tokens = static_cast<index_t>(N);
  for (int e = 0; e < E; ++e) {
    r.f[static_cast<std::size_t>(e)] = N > 0 ? pooled[static_cast<std::size_t>(e)] / (N * k) : 0.0;
    r.P[static_cast<std::size_t>(e)] = N > 0 ? pooled[static_cast<std::size_t>(E + e)] / N : 0.0;
  }

  // q per group ([groups, E] for sequences, one row otherwise) and the loss.
  index_t const qrows = per_sequence ? groups : 1;
  auto const q = scratch<Kokkos::View<float**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::balance_loss::q", qrows,
                                                                        static_cast<std::size_t>(E));
  std::vector<float> hq_values(static_cast<std::size_t>(qrows) * static_cast<std::size_t>(E), 0.0f);
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace, unmanaged> hq(hq_values.data(), qrows, E);
  double group_scale = 0.0;  // 1 / N of the gradient, times the group weight
  if (bl.form == BalanceLossForm::sequence) {
    double local_loss = 0.0;
    for (index_t g = 0; g < groups; ++g) {
      double term = 0.0;
      for (int e = 0; e < E; ++e) {
        double const qe = bl.alpha * E * static_cast<double>(hc(g, e)) / (static_cast<double>(S) * k);
        hq(g, e) = static_cast<float>(qe);
        term += qe * hp(g, e) / static_cast<double>(S);
      }
      local_loss += term;
    }
    double total = 0.0;
    allreduce_watched(&local_loss, &total, 1, MPI_DOUBLE, MPI_SUM, scope, "balance_loss: sequence terms", watchdog_seconds);
    r.loss = scope_groups > 0 ? total / scope_groups : 0.0;
    group_scale = scope_groups > 0 ? 1.0 / (static_cast<double>(S) * scope_groups) : 0.0;
  } else {
    std::vector<double> qe(static_cast<std::size_t>(E), 0.0);
    if (bl.form == BalanceLossForm::switch_gshard) {
      for (int e = 0; e < E; ++e) qe[static_cast<std::size_t>(e)] = bl.alpha * E * r.f[static_cast<std::size_t>(e)];
    } else {
      int D = 0;
      for (int dev : bl.expert_device) D = std::max(D, dev + 1);
      std::vector<double> fsum(static_cast<std::size_t>(D), 0.0), members(static_cast<std::size_t>(D), 0.0);
      for (int e = 0; e < E; ++e) {
        std::size_t const i = static_cast<std::size_t>(bl.expert_device[static_cast<std::size_t>(e)]);
        fsum[i] += E * r.f[static_cast<std::size_t>(e)];
        members[i] += 1.0;
      }
      for (int e = 0; e < E; ++e) {
        std::size_t const i = static_cast<std::size_t>(bl.expert_device[static_cast<std::size_t>(e)]);
        qe[static_cast<std::size_t>(e)] = bl.alpha * fsum[i] / members[i];
      }
    }
    for (int e = 0; e < E; ++e) {
      r.q[static_cast<std::size_t>(e)] = qe[static_cast<std::size_t>(e)];
      r.loss += qe[static_cast<std::size_t>(e)] * r.P[static_cast<std::size_t>(e)];
      if (qrows > 0) hq(0, e) = static_cast<float>(qe[static_cast<std::size_t>(e)]);
    }
    group_scale = N > 0 ? 1.0 / N : 0.0;
  }
  if (!want_grad || T == 0) return r;

  Kokkos::deep_copy(exec, q, hq);
  float const gscale = static_cast<float>(group_scale) * weight;
  Kokkos::parallel_for(
      "KokkosMoE::balance_loss[gradient]", Teams::policy(exec, T), KOKKOS_LAMBDA(typename Teams::Member const& team) {
        index_t const t = Teams::item(team);
        if (t >= T) return;
        Impl::TokenScore const p = Impl::token_score(team, logits, t, E, kind, true);
        index_t const row = per_sequence ? t / S : 0;
        float const mean_q = Impl::ordered_sum(team, E, [&](int e) { return p(logits(t, e)) * q(row, e); });
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E), [&](int j) {
          float const z = logits(t, j);
          float c = p(z);
          if (!softmax) c *= 1.0f - 1.0f / (1.0f + Compat::exp(-z));
          dlogits(t, j) += gscale * c * (q(row, j) - mean_q);
        });
      });
  Compat::fence(exec, "KokkosMoE::balance_loss");
  return r;
}

}  // namespace KokkosMoE

#endif
