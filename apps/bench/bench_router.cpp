// kmoe-bench router: time of everything the router does after the logits
// (scores, correction bias, group-limited top-k, gates, dropless admission and
// per-expert counts) next to the logits GEMM (hidden [T, d] x weight [E, d]^T)
// measured in the same run on the same execution space instance.
//
//   BENCH name=router_select tokens_per_s=<T / select_s> select_s=... gemm_s=...
//         threads=<host threads = BLAS threads> ratio=<select_s / gemm_s>

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Router.hpp>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

int run(int argc, char** argv) {
  CLI::App app{"router selection + gating time next to the logits GEMM"};
  int tokens = 16384, experts = 256, top_k = 8, groups = 8, topk_groups = 4, hidden_dim = 4096, reps = 5, warmup = 1;
  std::string score = "sigmoid";
  app.add_option("--tokens", tokens, "tokens T")->check(CLI::NonNegativeNumber);
  app.add_option("--experts", experts, "routed experts E")->check(CLI::PositiveNumber);
  app.add_option("--top-k", top_k, "experts per token k")->check(CLI::PositiveNumber);
  app.add_option("--groups", groups, "expert groups")->check(CLI::PositiveNumber);
  app.add_option("--topk-groups", topk_groups, "groups kept per token (top-2-sum group score)")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden_dim, "hidden width d of the logits GEMM")->check(CLI::PositiveNumber);
  app.add_option("--score", score, "score function")->check(CLI::IsMember({"sigmoid", "softmax"}));
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed repetitions first")->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }

  RouterConfig config;
  config.num_experts = experts;
  config.top_k = top_k;
  config.score = from_string<ScoreFunction>(score);
  config.use_correction_bias = true;
  config.num_groups = groups;
  config.topk_groups = topk_groups;
  config.group_score = SetScore::top_m_sum;
  config.group_top_m = 2;
  config.normalize = true;
  config.route_scale = 2.5f;
  Router<MS> router(config);  // validates before anything is allocated

  int const threads = kmoe_bench::host_threads();
  int const blas_threads = kmoe_bench::set_blas_threads(threads);

  Exec exec;
  RowMatrix<float, MS> hidden(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "bench::hidden"), tokens, hidden_dim);
  RowMatrix<float, MS> weight(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "bench::weight"), experts, hidden_dim);
  RowMatrix<float, MS> logits(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "bench::logits"), tokens, experts);
  {
    auto hh = Kokkos::create_mirror_view(hidden);
    auto hw = Kokkos::create_mirror_view(weight);
    auto hb = Kokkos::create_mirror_view(router.correction_bias());
    std::mt19937 rng(2024);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int t = 0; t < tokens; ++t)
      for (int i = 0; i < hidden_dim; ++i) hh(t, i) = nd(rng);
    float const ws = 1.0f / std::sqrt(static_cast<float>(hidden_dim));
    for (int e = 0; e < experts; ++e)
      for (int i = 0; i < hidden_dim; ++i) hw(e, i) = ws * nd(rng);
    for (int e = 0; e < experts; ++e) hb(e) = 0.01f * nd(rng);
    Kokkos::deep_copy(exec, hidden, hh);
    Kokkos::deep_copy(exec, weight, hw);
    Kokkos::deep_copy(exec, router.correction_bias(), hb);
    exec.fence();
  }

  GemmPath path = GemmPath::automatic;
  double const gemm_s = kmoe_bench::median_seconds(warmup, reps, [&] {
    path = gemm(exec, 'N', 'T', 1.0f, hidden, weight, 0.0f, logits);
    exec.fence();
  });
  RouteTable<MS> table;
  Kokkos::View<const float**, Kokkos::LayoutRight, MS> clogits = logits;
  double const select_s = kmoe_bench::median_seconds(warmup, reps, [&] {
    router.route_logits(exec, clogits, table);
    exec.fence();
  });
  KOKKOSMOE_REQUIRE(table.counts.accepted == static_cast<index_t>(tokens) * top_k,
                    "bench router: " << table.counts.accepted << " accepted routes, expected " << tokens * top_k);

  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::printf("# router: T=%d E=%d k=%d groups=%d keep=%d (top2 sum) score=%s+bias d=%d gemm=%s "
                "host_threads=%d blas_threads=%d exec=%s\n",
                tokens, experts, top_k, groups, topk_groups, score.c_str(), hidden_dim,
                to_string(path).c_str(), threads, blas_threads, Exec::name());
  }
  double const tps = select_s > 0 ? tokens / select_s : 0.0;
  kmoe_bench::print_bench("router_select",
                          {{"tokens_per_s", kmoe_bench::fmt(tps, 4)},
                           {"select_s", kmoe_bench::fmt(select_s, 4)},
                           {"gemm_s", kmoe_bench::fmt(gemm_s, 4)},
                           {"threads", std::to_string(threads)}},
                          gemm_s > 0 ? select_s / gemm_s : 0.0);
  return 0;
}

kmoe_bench::Register reg("router",
                         "router selection + gating (after the logits) time and tokens/s next to the logits GEMM",
                         run);

}  // namespace
