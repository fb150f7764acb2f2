// kmoe-bench experts: GFLOP/s of each expert runner (grouped, blas, padded,
// block) on L local experts with uniform, Zipf-skewed and decode-sized
// segments, next to one dense GEMM chain of the same useful FLOPs (three
// KokkosMoE::gemm calls: Kokkos Kernels / BLAS when available) measured in
// the same run with the same number of threads.
//
// gflops = useful matmul FLOPs (6 * routed rows * d * d_ff) / runner wall
// time, so padding a runner executes costs it; exec_gflops counts executed
// rows; ratio = gflops / dense_gflops (wall times, medians). cpu_ratio is the
// same ratio from process CPU times, a diagnostic for loaded machines.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Gemm.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace KokkosMoE;
using namespace KokkosMoE::Experts;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

std::vector<std::string> split(std::string const& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

/// Splits n rows over L experts: uniform, or proportional to k^-s (k = 1..L,
/// largest remainder so the counts sum to n).
std::vector<index_t> split_rows(index_t n, int L, double zipf_s) {
  std::vector<double> w(static_cast<std::size_t>(L));
  double total = 0;
  for (int k = 0; k < L; ++k) total += (w[static_cast<std::size_t>(k)] = zipf_s > 0 ? std::pow(k + 1.0, -zipf_s) : 1.0);
  std::vector<index_t> counts(static_cast<std::size_t>(L));
  std::vector<std::pair<double, int>> rem;
  index_t assigned = 0;
  for (int k = 0; k < L; ++k) {
    double const exact = static_cast<double>(n) * w[static_cast<std::size_t>(k)] / total;
    counts[static_cast<std::size_t>(k)] = static_cast<index_t>(std::floor(exact));
    assigned += counts[static_cast<std::size_t>(k)];
    rem.push_back({exact - std::floor(exact), k});
  }
  std::sort(rem.begin(), rem.end(), [](auto const& a, auto const& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  for (index_t i = 0; i < n - assigned; ++i) ++counts[static_cast<std::size_t>(rem[static_cast<std::size_t>(i)].second)];
  return counts;
}

/// Median wall and process-CPU seconds of reps calls after warmup calls
/// (the CPU time tells how much a loaded machine stretched the wall time).
struct Timing {
  double wall = 0, cpu = 0;
};
double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
template <class F>
Timing measure(int warmup, int reps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> wall, cpu;
  for (int i = 0; i < std::max(1, reps); ++i) {
    double const c0 = cpu_seconds();
    Kokkos::Timer timer;
    f();
    wall.push_back(timer.seconds());
    cpu.push_back(cpu_seconds() - c0);
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return Timing{wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

std::string join(std::vector<index_t> const& v) {
  std::ostringstream os;
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  return os.str();
}

int run(int argc, char** argv) {
  CLI::App app{"expert runners (grouped, blas, padded, block) next to a dense GEMM chain of the same FLOPs"};
  int experts = 8, d = 2048, dff = 1408, decode_rows = 16, reps = 3, warmup = 1;
  index_t rows = 16384, block = 128, alignment = 64, capacity = 0;
  double zipf = 1.2;
  std::string runners = "grouped,blas,padded,block", cases = "uniform,zipf,decode", dtype = "fp32", isa = "auto",
              kernel = "auto";
  app.add_option("--experts", experts, "local experts L")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "routed rows (uniform and zipf cases)")->check(CLI::NonNegativeNumber);
  app.add_option("--d", d, "hidden width")->check(CLI::PositiveNumber);
  app.add_option("--dff", dff, "expert intermediate width")->check(CLI::PositiveNumber);
  app.add_option("--zipf", zipf, "Zipf exponent s of the skewed case")->check(CLI::NonNegativeNumber);
  app.add_option("--decode-rows", decode_rows, "rows per expert in the decode case")->check(CLI::PositiveNumber);
  app.add_option("--runners", runners, "comma-separated: grouped,blas,padded,block");
  app.add_option("--cases", cases, "comma-separated: uniform,zipf,decode");
  app.add_option("--block-size", block, "block runner: B")->check(CLI::PositiveNumber);
  app.add_option("--alignment", alignment, "padded runner: capacity alignment a")->check(CLI::PositiveNumber);
  app.add_option("--capacity", capacity, "padded runner: capacity C (0: the largest segment)")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", dtype, "weights and rows: fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--host-isa", isa, "grouped host micro-kernels: auto, avx512, avx2, generic");
  app.add_option("--grouped-kernel", kernel, "grouped mapping: auto, host_simd, portable");
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed repetitions first")->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  Exec exec;
  int const threads = Exec().concurrency();
  int const blas_threads = kmoe_bench::set_blas_threads(threads);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  std::vector<int> slot_expert(static_cast<std::size_t>(experts));
  for (int q = 0; q < experts; ++q) slot_expert[static_cast<std::size_t>(q)] = q;
  ExpertWeights<float, MS> wf;
  ExpertWeights<bf16_t, MS> wb;
  if (dtype == "fp32") {
    wf = ExpertWeights<float, MS>("bench::experts", slot_expert, d, dff);
    wf.randomize(exec, 17);
  } else {
    wb = ExpertWeights<bf16_t, MS>("bench::experts", slot_expert, d, dff);
    wb.randomize(exec, 17);
  }
  // Dense baseline operands (FP32 SGEMM chain).
  RowMatrix<float, MS> W1("bench::W1", dff, d), W2("bench::W2", dff, d), W3("bench::W3", d, dff);
  Kokkos::deep_copy(W1, 0.01f);
  Kokkos::deep_copy(W2, 0.02f);
  Kokkos::deep_copy(W3, 0.01f);
  if (rank == 0) {
    std::printf("# experts: L = %d, d = %d, d_ff = %d, dtype %s, threads = %d (%s), BLAS threads = %d, host ISA %s\n",
                experts, d, dff, dtype.c_str(), threads, Exec::name(), blas_threads,
                Experts::Impl::is_host_exec<Exec>() ? Experts::Impl::host_kernel_table(isa).isa : "n/a");
    std::fflush(stdout);
  }

  for (std::string const& c : split(cases)) {
    std::vector<index_t> counts;
    if (c == "uniform")
      counts = split_rows(rows, experts, 0.0);
    else if (c == "zipf")
      counts = split_rows(rows, experts, zipf);
    else if (c == "decode")
      counts.assign(static_cast<std::size_t>(experts), decode_rows);
    else
      KOKKOSMOE_THROW("--cases: unknown case '" << c << "' (expected uniform, zipf or decode)");
    index_t n = 0;
    for (index_t x : counts) n += x;
    Kokkos::View<index_t*, MS> offsets("bench::offsets", counts.size() + 1);
    {
      auto h = Kokkos::create_mirror_view(offsets);
      h(0) = 0;
      for (std::size_t q = 0; q < counts.size(); ++q) h(q + 1) = h(q) + counts[q];
      Kokkos::deep_copy(offsets, h);
    }
    double const useful = 6.0 * static_cast<double>(n) * d * dff;

    // Dense chain: G = X W1^T, U = X W2^T, Y = G W3^T on all n rows.
    Timing dense;
    {
      RowMatrix<float, MS> X("bench::dense_X", n, d), G("bench::G", n, dff), U("bench::U", n, dff), Y("bench::dense_Y", n, d);
      Kokkos::deep_copy(X, 0.5f);
      dense = measure(warmup, reps, [&] {
        gemm(exec, 'N', 'T', 1.0f, X, W1, 0.0f, G);
        gemm(exec, 'N', 'T', 1.0f, X, W2, 0.0f, U);
        gemm(exec, 'N', 'T', 1.0f, G, W3, 0.0f, Y);
        Compat::fence(exec, "bench::dense");
      });
    }
    double const dense_gflops = useful / dense.wall * 1e-9;
    double const dense_cpu_gflops = useful / dense.cpu * 1e-9 * threads;
    if (rank == 0) {
      std::printf("# case %s: %lld rows, counts [%s], dense chain %.4g s = %.4g GFLOP/s (%.4g by CPU time) (%s)\n",
                  c.c_str(), static_cast<long long>(n), join(counts).c_str(), dense.wall, dense_gflops, dense_cpu_gflops,
                  have_kokkos_kernels() ? "Kokkos Kernels" : "portable gemm");
      std::fflush(stdout);
    }

    for (std::string const& r : split(runners)) {
      RunnerOptions o;
      o.kind = from_string<Experts::RunnerKind>(r);
      o.block_size = block;
      o.alignment = alignment;
      o.capacity = capacity;
      o.host_isa = isa;
      o.grouped_kernel = from_string<Experts::GroupedKernel>(kernel);
      Runner<Exec, MS> runner(o);
      RunLedger ledger;
      Timing t;
      auto bench_with = [&](auto const& w, auto const& X, auto const& Y) {
        t = measure(warmup, reps, [&] { ledger = runner.run(exec, w, X, offsets, Y); });
      };
      if (dtype == "fp32") {
        RowMatrix<float, MS> X("bench::X", n, d), Y("bench::Y", n, d);
        Kokkos::deep_copy(X, 0.5f);
        bench_with(wf, X, Y);
      } else {
        RowMatrix<bf16_t, MS> X("bench::X", n, d), Y("bench::Y", n, d);
        Kokkos::deep_copy(X, to_bf16(0.5f));
        bench_with(wb, X, Y);
      }
      double const gflops = useful / t.wall * 1e-9;
      double const cpu_gflops = useful / t.cpu * 1e-9 * threads;
      kmoe_bench::print_bench("experts_" + r + "_" + c,
                              {{"gflops", kmoe_bench::fmt(gflops)},
                               {"dense_gflops", kmoe_bench::fmt(dense_gflops)},
                               {"threads", std::to_string(threads)},
                               {"blas_threads", std::to_string(blas_threads)},
                               {"ms", kmoe_bench::fmt(t.wall * 1e3)},
                               {"cpu_ratio", kmoe_bench::fmt(cpu_gflops / dense_cpu_gflops)},
                               {"rows", std::to_string(ledger.useful_rows)},
                               {"executed_rows", std::to_string(ledger.executed_rows)},
                               {"utilization", kmoe_bench::fmt(ledger.utilization)},
                               {"exec_gflops", kmoe_bench::fmt(static_cast<double>(ledger.matmul_flops) / t.wall * 1e-9)},
                               {"launches", std::to_string(ledger.kernel_launches)},
                               {"path", ledger.path}},
                              gflops / dense_gflops);
    }
  }
  return 0;
}

kmoe_bench::Register reg("experts", "expert runners GFLOP/s next to a dense GEMM chain of the same FLOPs", run);

}  // namespace
