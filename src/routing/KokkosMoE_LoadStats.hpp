#ifndef KOKKOSMOE_LOADSTATS_HPP
#define KOKKOSMOE_LOADSTATS_HPP

/// \file KokkosMoE_LoadStats.hpp
/// \brief Router load statistics: per-expert route counts (local and reduced
/// over a communicator) and the DeepSeek-V3 sequence-wise balance loss.
///
/// Balance loss of one sequence of T tokens, E experts, top-k:
///   f_e = E / (k * T) * (number of tokens whose k selected experts include e)
///   P_e = (1 / T) * sum_t s'_te,   s'_te = s_te / sum_j s_tj
///   L   = alpha * sum_e f_e * P_e
/// where s are the router scores (score-function output, no correction bias)
/// and the selection counts every selected route, admitted or not. f and P
/// are computed in double with a fixed summation order, so L is bitwise
/// reproducible on every backend and thread count.

#include <KokkosMoE_Admission.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Types.hpp>

#include <mpi.h>

#include <type_traits>
#include <vector>

namespace KokkosMoE {

/// \brief Sequence-wise balance loss and its factors (host values).
struct BalanceLoss {
  double loss = 0.0;             ///< alpha * sum_e f_e * P_e
  std::vector<double> f;         ///< [E] E / (k T) * selected count
  std::vector<double> P;         ///< [E] mean normalized score
  std::vector<index_t> selected; ///< [E] selected routes per expert
};

/// \brief [E] number of selected routes per expert (every route of `expert`,
/// admitted or not). Exact (integer reduction).
template <class ExecutionSpace, class ExpertView>
Kokkos::View<index_t*, typename ExpertView::memory_space> selected_expert_counts(ExecutionSpace const& exec,
                                                                                ExpertView const& expert_view,
                                                                                int num_experts) {
  using MemorySpace = typename ExpertView::memory_space;
  Kokkos::View<const int**, Kokkos::LayoutRight, MemorySpace> expert = expert_view;
  KOKKOSMOE_REQUIRE(num_experts > 0, "selected_expert_counts: num_experts must be > 0 (got " << num_experts << ")");
  Kokkos::View<index_t*, MemorySpace> counts(
      Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::LoadStats::selected_counts"), num_experts);
  Impl::route_histogram(exec, static_cast<index_t>(expert.extent(0)), static_cast<int>(expert.extent(1)),
                        Impl::ExpertBin<MemorySpace>{expert}, counts);
  return counts;
}

/// \brief DeepSeek-V3 sequence-wise balance loss of one sequence (see the
/// file comment for the definition).
/// \param scores [T, E] router scores of the sequence's tokens (Router::scores())
/// \param expert [T, k] selected experts of the same tokens
/// \param alpha balance factor (>= 0)
/// \return loss, f, P and the selected counts; all zeros for T = 0
template <class ExecutionSpace, class ScoresView, class ExpertView>
BalanceLoss sequence_balance_loss(ExecutionSpace const& exec, ScoresView const& scores_view, ExpertView const& expert_view,
                                  double alpha) {
  using MemorySpace = typename ScoresView::memory_space;
  static_assert(std::is_same<MemorySpace, typename ExpertView::memory_space>::value,
                "sequence_balance_loss: scores and experts must share a memory space");
  Kokkos::View<const float**, Kokkos::LayoutRight, MemorySpace> scores = scores_view;
  Kokkos::View<const int**, Kokkos::LayoutRight, MemorySpace> expert = expert_view;
  index_t const T = static_cast<index_t>(scores.extent(0));
  int const E = static_cast<int>(scores.extent(1));
  int const k = static_cast<int>(expert.extent(1));
  KOKKOSMOE_REQUIRE(static_cast<index_t>(expert.extent(0)) == T && E > 0 && k > 0 && k <= E,
                    "sequence_balance_loss: scores are " << scores.extent(0) << "x" << scores.extent(1) << ", experts "
                                                         << expert.extent(0) << "x" << expert.extent(1)
                                                         << " (need equal rows, E > 0, 0 < k <= E)");
  KOKKOSMOE_REQUIRE(alpha >= 0.0, "sequence_balance_loss: alpha must be >= 0 (got " << alpha << ")");
  BalanceLoss out;
  out.f.assign(static_cast<std::size_t>(E), 0.0);
  out.P.assign(static_cast<std::size_t>(E), 0.0);
  out.selected.assign(static_cast<std::size_t>(E), 0);
  if (T == 0) return out;
  out.selected = Impl::to_host_vector(exec, selected_expert_counts(exec, expert, E));

  using range_t = Kokkos::RangePolicy<ExecutionSpace>;
  Kokkos::View<double*, MemorySpace> rowsum(
      Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::LoadStats::rowsum"), T);
  Kokkos::parallel_for(
      "KokkosMoE::LoadStats::rowsum", range_t(exec, 0, T), KOKKOS_LAMBDA(index_t t) {
        double s = 0.0;
        for (int e = 0; e < E; ++e) s += static_cast<double>(scores(t, e));
        rowsum(t) = s;
      });
  // Fixed chunking: the summation order does not depend on the backend.
  index_t const chunks = Compat::min<index_t>(T, 64);
  Kokkos::View<double**, Kokkos::LayoutRight, MemorySpace> part(
      Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::LoadStats::partial_P"), chunks, E);
  Kokkos::parallel_for(
      "KokkosMoE::LoadStats::partial_P", range_t(exec, 0, chunks * E), KOKKOS_LAMBDA(index_t i) {
        index_t const c = i / E;
        int const e = static_cast<int>(i % E);
        index_t const t0 = T * c / chunks, t1 = T * (c + 1) / chunks;
        double s = 0.0;
        for (index_t t = t0; t < t1; ++t)
          if (rowsum(t) > 0.0) s += static_cast<double>(scores(t, e)) / rowsum(t);
        part(c, e) = s;
      });
  auto hpart = Kokkos::create_mirror_view(Kokkos::HostSpace(), part);
  Kokkos::deep_copy(exec, hpart, part);
  Compat::fence(exec, "KokkosMoE::LoadStats::sequence_balance_loss");
  double loss = 0.0;
  for (int e = 0; e < E; ++e) {
    double p = 0.0;
    for (index_t c = 0; c < chunks; ++c) p += hpart(c, e);
    out.P[e] = p / static_cast<double>(T);
    out.f[e] = static_cast<double>(E) / (static_cast<double>(k) * static_cast<double>(T)) *
               static_cast<double>(out.selected[e]);
    loss += out.f[e] * out.P[e];
  }
  out.loss = alpha * loss;
  return out;
}

/// \brief Collective over comm: the element-wise sum of every rank's counts
/// (MPI_Allreduce), as a new view in the same memory space; `counts` is not
/// modified. Every rank must pass the same extent. Throws Error naming the
/// MPI call on failure (on communicators with MPI_ERRORS_RETURN).
template <class ExecutionSpace, class CountsView>
Kokkos::View<index_t*, typename CountsView::memory_space> reduce_expert_counts(ExecutionSpace const& exec,
                                                                              CountsView const& counts_view,
                                                                              MPI_Comm comm) {
  using MemorySpace = typename CountsView::memory_space;
  Kokkos::View<const index_t*, MemorySpace> counts = counts_view;
  Kokkos::View<index_t*, Kokkos::HostSpace> h("KokkosMoE::LoadStats::counts_host", counts.extent(0));
  Kokkos::deep_copy(exec, h, counts);
  Compat::fence(exec, "KokkosMoE::LoadStats::reduce_expert_counts");
  static_assert(sizeof(index_t) == sizeof(std::int64_t), "index_t is 64-bit");
  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, h.data(), static_cast<int>(h.extent(0)), MPI_INT64_T, MPI_SUM, comm),
                      comm);
  Kokkos::View<index_t*, MemorySpace> out(
      Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::LoadStats::global_counts"), counts.extent(0));
  Kokkos::deep_copy(exec, out, h);
  Compat::fence(exec, "KokkosMoE::LoadStats::reduce_expert_counts");
  return out;
}

/// \brief Collective over comm: attempted, accepted and dropped summed over ranks.
RouteCounts reduce_route_counts(RouteCounts const& local, MPI_Comm comm, double watchdog_seconds = 0.0);

}  // namespace KokkosMoE

#endif
