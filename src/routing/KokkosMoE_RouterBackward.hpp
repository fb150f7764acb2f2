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

/// Per-token distribution of the balance loss and the router's scores:
/// softmax probabilities, or sigmoid scores (normalized when `normalized`).
template <class Logits>
KOKKOS_INLINE_FUNCTION void token_scores(Logits const& z, index_t t, int E, bool softmax, bool normalized, float* out) {
  if (softmax) {
    float m = z(t, 0);
    for (int e = 1; e < E; ++e) m = Compat::max(m, z(t, e));
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += (out[e] = Compat::exp(z(t, e) - m));
    for (int e = 0; e < E; ++e) out[e] /= sum;
  } else {
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += (out[e] = 1.0f / (1.0f + Compat::exp(-z(t, e))));
    if (normalized)
      for (int e = 0; e < E; ++e) out[e] /= sum;
  }
}

/// Largest E the per-token kernels keep in registers.
constexpr int router_backward_max_experts = 1024;

}  // namespace Impl

/// \brief dlogits [T, E] (+)= the gradient through the gates of `table`
/// (which `config`'s router produced from `logits`) given dgate [T, k] (zero
/// for dropped routes, whose gates did not reach the output; their
/// affinities still enter the normalization). Softmax and sigmoid scores;
/// identity scores pass da straight to the selected inputs.
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
  KOKKOSMOE_REQUIRE(E <= Impl::router_backward_max_experts,
                    "router_backward: E = " << E << " experts, at most " << Impl::router_backward_max_experts);
  int const score = config.score == ScoreFunction::softmax ? 0 : config.score == ScoreFunction::sigmoid ? 1 : 2;
  bool const normalize = config.normalize;
  float const scale = config.route_scale;
  auto expert = table.expert;
  Compat::ScopedRegion region("KokkosMoE::router_backward");
  Kokkos::parallel_for(
      "KokkosMoE::router_backward", Kokkos::RangePolicy<Exec, Kokkos::IndexType<index_t>>(exec, 0, T),
      KOKKOS_LAMBDA(index_t t) {
        float p[Impl::router_backward_max_experts];
        if (score == 2) {
          for (int e = 0; e < E; ++e) p[e] = logits(t, e);
        } else {
          Impl::token_scores(logits, t, E, score == 0, false, p);
        }
        float S = 0.0f;
        for (int j = 0; j < k; ++j) S += p[expert(t, j)];
        float const denom = (normalize && S > 0.0f) ? S : 1.0f;
        // sum_i dg_i a_i / S (the normalization's share).
        float cross = 0.0f;
        if (normalize && S > 0.0f)
          for (int j = 0; j < k; ++j) cross += dgate(t, j) * p[expert(t, j)] / S;
        for (int e = 0; e < E; ++e)
          if (!accumulate) dlogits(t, e) = 0.0f;
        if (score == 0) {
          float dot = 0.0f;  // sum_j da_j a_j
          for (int j = 0; j < k; ++j) dot += scale * (dgate(t, j) - cross) / denom * p[expert(t, j)];
          for (int e = 0; e < E; ++e) dlogits(t, e) -= p[e] * dot;
          for (int j = 0; j < k; ++j) {
            int const e = expert(t, j);
            dlogits(t, e) += p[e] * scale * (dgate(t, j) - cross) / denom;
          }
        } else {
          for (int j = 0; j < k; ++j) {
            int const e = expert(t, j);
            float const da = scale * (dgate(t, j) - cross) / denom;
            dlogits(t, e) += score == 1 ? da * p[e] * (1.0f - p[e]) : da;
          }
        }
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
/// mismatched shapes or settings.
template <class Exec, class MS>
BalanceLossResult balance_loss(Exec const& exec, RouterConfig const& config, BalanceLossConfig const& bl,
                               Kokkos::View<const float**, Kokkos::LayoutRight, MS> logits, RouteTable<MS> const& table,
                               MPI_Comm scope, Kokkos::View<float**, Kokkos::LayoutRight, MS> dlogits = {},
                               float weight = 1.0f, double watchdog_seconds = 300.0) {
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
    KOKKOSMOE_REQUIRE(E <= Impl::router_backward_max_experts,
                      "balance_loss: E = " << E << " experts, at most " << Impl::router_backward_max_experts);
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
  // thread per chunk in token order, summed on the host in chunk order:
  // the same bits for any execution space.
  index_t const chunk = per_sequence ? S : index_t(256);
  index_t const chunks = (T + chunk - 1) / chunk;
  index_t const groups = per_sequence ? chunks : (T > 0 ? 1 : 0);
  Kokkos::View<double**, Kokkos::LayoutRight, MS> psum("KokkosMoE::balance_loss::psum", chunks, E);
  Kokkos::View<std::int64_t**, Kokkos::LayoutRight, MS> count("KokkosMoE::balance_loss::count", chunks, E);
  auto expert = table.expert;
  Kokkos::parallel_for(
      "KokkosMoE::balance_loss[statistics]", Kokkos::RangePolicy<Exec, Kokkos::IndexType<index_t>>(exec, 0, chunks),
      KOKKOS_LAMBDA(index_t c) {
        float p[Impl::router_backward_max_experts];
        index_t const end = (c + 1) * chunk < T ? (c + 1) * chunk : T;
        for (index_t t = c * chunk; t < end; ++t) {
          Impl::token_scores(logits, t, E, softmax, true, p);
          for (int e = 0; e < E; ++e) psum(c, e) += static_cast<double>(p[e]);
          for (int j = 0; j < k; ++j) count(c, expert(t, j)) += 1;
        }
      });
  auto hpc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), psum);
  auto hcc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), count);
  // Per group ([groups, E]: the sequences, or one row of all chunks).
  Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace> hp("KokkosMoE::balance_loss::group_psum", groups, E);
  Kokkos::View<std::int64_t**, Kokkos::LayoutRight, Kokkos::HostSpace> hc("KokkosMoE::balance_loss::group_count", groups, E);
  for (index_t c = 0; c < chunks; ++c)
    for (int e = 0; e < E; ++e) {
      index_t const g = per_sequence ? c : 0;
      hp(g, e) += hpc(c, e);
      hc(g, e) += hcc(c, e);
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
  Kokkos::View<float**, Kokkos::LayoutRight, MS> q("KokkosMoE::balance_loss::q", qrows, E);
  auto hq = Kokkos::create_mirror_view(q);
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
      "KokkosMoE::balance_loss[gradient]", Kokkos::RangePolicy<Exec, Kokkos::IndexType<index_t>>(exec, 0, T),
      KOKKOS_LAMBDA(index_t t) {
        float p[Impl::router_backward_max_experts];
        Impl::token_scores(logits, t, E, softmax, true, p);
        index_t const row = per_sequence ? t / S : 0;
        float mean_q = 0.0f;
        for (int e = 0; e < E; ++e) mean_q += p[e] * q(row, e);
        for (int j = 0; j < E; ++j) {
          float c = p[j];
          if (!softmax) c *= 1.0f - 1.0f / (1.0f + Compat::exp(-logits(t, j)));
          dlogits(t, j) += gscale * c * (q(row, j) - mean_q);
        }
      });
  Compat::fence(exec, "KokkosMoE::balance_loss");
  return r;
}

}  // namespace KokkosMoE

#endif
