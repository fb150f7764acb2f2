// kmoe-bench experts: GFLOP/s of each expert runner (grouped, blas, padded,
// block) on L local experts with uniform, Zipf-skewed and decode-sized
// segments, next to one dense GEMM chain of the same useful FLOPs (three
// KokkosMoE::gemm calls: Kokkos Kernels / BLAS for fp32, cuBLAS tensor cores
// for bf16 in CUDA builds; on hosts the bf16 runs are compared with the fp32
// chain, there being no bf16 BLAS) measured in the same run with the same
// number of threads.
//
// gflops = useful matmul FLOPs (6 * routed rows * d * d_ff) / runner wall
// time, so padding a runner executes costs it; exec_gflops counts executed
// rows; ratio = gflops / dense_gflops (wall times, medians). cpu_ratio is the
// same ratio from process CPU times, a diagnostic for loaded machines (host
// execution spaces only: on a GPU the CPU time is time spent waiting).
// Decode cases (decode_r<R>: R rows for every expert) add the weight stream:
// weight_gbps = bytes of the experts' weights read once / runner time, next
// to read_gbps, the same run's read bandwidth of a large array, and
// bw_ratio = weight_gbps / read_gbps. bf16 runs also time the same runner
// on fp32 weights and rows: vs_fp32 = fp32 time / bf16 time.
// --backward adds experts_<runner>_backward_<case> (uniform and zipf cases):
// the experts' backward (dX and the three weight gradients from the
// forward's saved activations, Experts::Backward; the same backward serves
// every runner) with ratio = backward time / that runner's forward time
// (six GEMMs against three: about 2 when both run at GEMM speed).
// --backward-products fp32|bf16 chooses the backward's operands
// (Experts::BackwardProducts; default: bf16 for bf16 runs, as their forward
// multiplies, fp32 otherwise); the line's products= and path= say what ran.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Experts_Backward.hpp>
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

/// Read bandwidth of a large array (a sum over 256 MiB of floats, several
/// times any cache) on exec: bytes / median time.
/// Sum of v: on hosts 64-element chunks with 16 independent partial sums
/// (vectorized, so that the loads and not the additions set the pace); on
/// devices one element per thread (coalesced).
float sum_of(Exec const& exec, Kokkos::View<float*, MS> const& v) {
  float sum = 0;
  if constexpr (Experts::Impl::is_host_exec<Exec>()) {
    std::size_t const chunks = v.extent(0) / 64;
    Kokkos::parallel_reduce(
        "bench::read", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, chunks),
        [=](std::size_t c, float& acc) {
          float part[16] = {};
          float const* p = v.data() + 64 * c;
          for (int i = 0; i < 64; i += 16)
            for (int j = 0; j < 16; ++j) part[j] += p[i + j];
          for (int j = 0; j < 16; ++j) acc += part[j];
        },
        sum);
  } else {
    Kokkos::parallel_reduce(
        "bench::read", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, v.extent(0)),
        KOKKOS_LAMBDA(std::size_t i, float& acc) { acc += v(i); }, sum);
  }
  return sum;
}

double read_gbps(Exec const& exec, int warmup, int reps) {
  std::size_t const n = std::size_t(64) << 20;
  Kokkos::View<float*, MS> big(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "bench::read"), n);
  Kokkos::deep_copy(exec, big, 1.0f);
  double sink = 0;
  Timing const t = measure(warmup, reps, [&] { sink += sum_of(exec, big); });
  KOKKOSMOE_REQUIRE(sink > 0, "bench experts: the read bandwidth probe summed nothing");
  return static_cast<double>(n * sizeof(float)) / t.wall * 1e-9;
}

int run(int argc, char** argv) {
  CLI::App app{"expert runners (grouped, blas, padded, block) next to a dense GEMM chain of the same FLOPs"};
  int experts = 8, d = 2048, dff = 1408, reps = 3, warmup = 1, decode_threshold = -1;
  std::string decode_rows = "1,4,16";
  index_t rows = 16384, block = 128, alignment = 64, capacity = 0;
  double zipf = 1.2;
  bool backward = false;
  std::string runners = "grouped,blas,padded,block", cases = "uniform,zipf,decode", dtype = "fp32", isa = "auto",
              kernel = "auto", backward_products;
  app.add_option("--experts", experts, "local experts L")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "routed rows (uniform and zipf cases)")->check(CLI::NonNegativeNumber);
  app.add_option("--d", d, "hidden width")->check(CLI::PositiveNumber);
  app.add_option("--dff", dff, "expert intermediate width")->check(CLI::PositiveNumber);
  app.add_option("--zipf", zipf, "Zipf exponent s of the skewed case")->check(CLI::NonNegativeNumber);
  app.add_option("--decode-rows", decode_rows, "rows per expert of the decode cases, comma-separated (cases decode_r<R>)");
  app.add_option("--decode-threshold", decode_threshold, "grouped host kernel: decode kernel up to this many rows per tile "
                                                         "(-1: the library default, 0: never)")
      ->check(CLI::Range(-1, 8));
  app.add_option("--runners", runners, "comma-separated: grouped,blas,padded,block");
  app.add_option("--cases", cases, "comma-separated: uniform,zipf,decode");
  app.add_option("--block-size", block, "block runner: B")->check(CLI::PositiveNumber);
  app.add_option("--alignment", alignment, "padded runner: capacity alignment a")->check(CLI::PositiveNumber);
  app.add_option("--capacity", capacity, "padded runner: capacity C (0: the largest segment)")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", dtype, "weights and rows: fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--host-isa", isa, "grouped host micro-kernels: auto, avx512, avx2, generic");
  app.add_option("--grouped-kernel", kernel, "grouped mapping: auto, host_simd, portable");
  app.add_flag("--backward", backward, "also time the experts' backward (uniform and zipf cases)");
  app.add_option("--backward-products", backward_products, "the backward's GEMM operands: fp32 or bf16 (default: the dtype)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed repetitions first")->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  Exec exec;
  // Host threads (BLAS, CPU-time ratios): a device space's concurrency counts its own threads.
  int const threads = kmoe_bench::host_threads();
  constexpr bool host_exec = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;
  bool const bf16 = dtype == "bf16";
  Experts::BackwardOptions backward_options;
  backward_options.products = (backward_products.empty() ? bf16 : backward_products == "bf16") ? Experts::BackwardProducts::bf16
                                                                                                : Experts::BackwardProducts::fp32;
  // The dense baseline in the runner's element type where a vendor GEMM takes
  // bf16 (cuBLAS), else the fp32 chain.
  constexpr bool dense_bf16_available = have_vendor_gemm<Exec, bf16_t>();
  bool const dense_bf16 = bf16 && dense_bf16_available;
  int const blas_threads = kmoe_bench::set_blas_threads(threads);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  std::vector<int> slot_expert(static_cast<std::size_t>(experts));
  for (int q = 0; q < experts; ++q) slot_expert[static_cast<std::size_t>(q)] = q;
  // fp32 weights always (bf16 runs compare with them), bf16 for bf16 runs.
  ExpertWeights<float, MS> wf("bench::experts", slot_expert, d, dff);
  wf.randomize(exec, 17);
  ExpertWeights<bf16_t, MS> wb;
  if (bf16) {
    wb = ExpertWeights<bf16_t, MS>("bench::experts", slot_expert, d, dff);
    wb.randomize(exec, 17);
  }
  // Dense baseline operands.
  RowMatrix<float, MS> W1("bench::W1", dff, d), W2("bench::W2", dff, d), W3("bench::W3", d, dff);
  Kokkos::deep_copy(W1, 0.01f);
  Kokkos::deep_copy(W2, 0.02f);
  Kokkos::deep_copy(W3, 0.01f);
  RowMatrix<bf16_t, MS> B1, B2, B3;
  if (dense_bf16) {
    B1 = RowMatrix<bf16_t, MS>("bench::B1", dff, d);
    B2 = RowMatrix<bf16_t, MS>("bench::B2", dff, d);
    B3 = RowMatrix<bf16_t, MS>("bench::B3", d, dff);
    Kokkos::deep_copy(B1, to_bf16(0.01f));
    Kokkos::deep_copy(B2, to_bf16(0.02f));
    Kokkos::deep_copy(B3, to_bf16(0.01f));
  }
  std::vector<index_t> decode_list;
  for (std::string const& r : split(decode_rows)) {
    long long const v = std::stoll(r);
    KOKKOSMOE_REQUIRE(v >= 1, "--decode-rows: '" << r << "' is not a positive row count");
    decode_list.push_back(static_cast<index_t>(v));
  }
  double const read_bw = read_gbps(exec, warmup, reps);
  if (rank == 0) {
    std::printf("# experts: L = %d, d = %d, d_ff = %d, dtype %s, threads = %d (%s), BLAS threads = %d, host ISA %s, "
                "dense baseline %s, read bandwidth %.4g GB/s\n",
                experts, d, dff, dtype.c_str(), threads, Exec::name(), blas_threads,
                Experts::Impl::is_host_exec<Exec>() ? Experts::Impl::host_kernel_table(isa).isa : "n/a",
                dense_bf16 ? "bf16 chain (vendor GEMM)" : "fp32 chain", read_bw);
    std::fflush(stdout);
  }

  std::vector<std::pair<std::string, std::vector<index_t>>> case_counts;
  for (std::string const& c : split(cases)) {
    if (c == "uniform")
      case_counts.push_back({c, split_rows(rows, experts, 0.0)});
    else if (c == "zipf")
      case_counts.push_back({c, split_rows(rows, experts, zipf)});
    else if (c == "decode")
      for (index_t r : decode_list)
        case_counts.push_back({"decode_r" + std::to_string(r), std::vector<index_t>(static_cast<std::size_t>(experts), r)});
    else
      KOKKOSMOE_THROW("--cases: unknown case '" << c << "' (expected uniform, zipf or decode)");
  }
  for (auto const& [c, counts] : case_counts) {
    bool const decode_case = c.rfind("decode", 0) == 0;
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
    auto dense_chain = [&](auto const& A1, auto const& A2, auto const& A3, auto tag) {
      using T = decltype(tag);
      RowMatrix<T, MS> X("bench::dense_X", n, d), G("bench::G", n, dff), U("bench::U", n, dff), Y("bench::dense_Y", n, d);
      Kokkos::deep_copy(X, from_float<T>(0.5f));
      dense = measure(warmup, reps, [&] {
        gemm(exec, 'N', 'T', 1.0f, X, A1, 0.0f, G);
        gemm(exec, 'N', 'T', 1.0f, X, A2, 0.0f, U);
        gemm(exec, 'N', 'T', 1.0f, G, A3, 0.0f, Y);
        Compat::fence(exec, "bench::dense");
      });
    };
    if (dense_bf16)
      dense_chain(B1, B2, B3, bf16_t{});
    else
      dense_chain(W1, W2, W3, float{});
    double const dense_gflops = useful / dense.wall * 1e-9;
    double const dense_cpu_gflops = useful / dense.cpu * 1e-9 * threads;
    if (rank == 0) {
      std::printf("# case %s: %lld rows, counts [%s], dense chain %.4g s = %.4g GFLOP/s (%.4g by CPU time) (%s)\n",
                  c.c_str(), static_cast<long long>(n), join(counts).c_str(), dense.wall, dense_gflops, dense_cpu_gflops,
                  dense_bf16 ? "vendor bf16" : have_kokkos_kernels() ? "Kokkos Kernels" : "portable gemm");
      std::fflush(stdout);
    }

    // The backward of this case (one for every runner), timed once.
    Timing bwd;
    Experts::BackwardLedger bledger;
    if (backward && !decode_case) {
      auto bench_backward = [&](auto const& w, auto tag) {
        using T = decltype(tag);
        RowMatrix<T, MS> X("bench::X", n, d), Y("bench::Y", n, d), dY("bench::dY", n, d), dX("bench::dX", n, d);
        Kokkos::deep_copy(X, from_float<T>(0.5f));
        Kokkos::deep_copy(dY, from_float<T>(0.25f));
        Experts::Backward<Exec, MS> bw(backward_options);
        Experts::SavedActivations<MS> saved;
        Experts::ExpertGradients<MS> grads(w);
        bw.forward_keep(exec, w, X, offsets, Y, saved);
        return measure(warmup, reps, [&] { bledger = bw.backward(exec, w, X, offsets, dY, dX, grads, saved); });
      };
      bwd = bf16 ? bench_backward(wb, bf16_t{}) : bench_backward(wf, float{});
    }
    for (std::string const& r : split(runners)) {
      RunnerOptions o;
      o.kind = from_string<Experts::RunnerKind>(r);
      o.block_size = block;
      o.alignment = alignment;
      o.capacity = capacity;
      o.host_isa = isa;
      o.grouped_kernel = from_string<Experts::GroupedKernel>(kernel);
      o.decode_rows = decode_threshold;
      Runner<Exec, MS> runner(o);
      RunLedger ledger;
      auto bench_with = [&](auto const& w, auto tag) {
        using T = decltype(tag);
        RowMatrix<T, MS> X("bench::X", n, d), Y("bench::Y", n, d);
        Kokkos::deep_copy(X, from_float<T>(0.5f));
        return measure(warmup, reps, [&] { ledger = runner.run(exec, w, X, offsets, Y); });
      };
      Timing fp32;
      if (bf16) fp32 = bench_with(wf, float{});
      Timing const t = bf16 ? bench_with(wb, bf16_t{}) : bench_with(wf, float{});
      double const gflops = useful / t.wall * 1e-9;
      double const cpu_gflops = useful / t.cpu * 1e-9 * threads;
      std::vector<std::pair<std::string, std::string>> fields = {
          {"gflops", kmoe_bench::fmt(gflops)},
          {"dense_gflops", kmoe_bench::fmt(dense_gflops)},
          {"threads", std::to_string(threads)},
          {"blas_threads", std::to_string(blas_threads)},
          {"ms", kmoe_bench::fmt(t.wall * 1e3)},
          {"cpu_ratio", host_exec ? kmoe_bench::fmt(cpu_gflops / dense_cpu_gflops) : std::string("none")},
          {"rows", std::to_string(ledger.useful_rows)},
          {"executed_rows", std::to_string(ledger.executed_rows)},
          {"decode_rows", std::to_string(ledger.decode_rows)},
          {"utilization", kmoe_bench::fmt(ledger.utilization)},
          {"exec_gflops", kmoe_bench::fmt(static_cast<double>(ledger.matmul_flops) / t.wall * 1e-9)},
          {"launches", std::to_string(ledger.kernel_launches)},
          {"path", ledger.path}};
      if (bf16) fields.push_back({"vs_fp32", kmoe_bench::fmt(fp32.wall / t.wall)});
      if (decode_case) {
        // Each non-empty expert's three matrices are read once.
        index_t nonempty = 0;
        for (index_t x : counts) nonempty += x > 0 ? 1 : 0;
        double const bytes = 3.0 * static_cast<double>(nonempty) * d * dff * (bf16 ? 2.0 : 4.0);
        double const weight_gbps = bytes / t.wall * 1e-9;
        fields.push_back({"weight_gbps", kmoe_bench::fmt(weight_gbps)});
        fields.push_back({"read_gbps", kmoe_bench::fmt(read_bw)});
        fields.push_back({"bw_ratio", kmoe_bench::fmt(weight_gbps / read_bw)});
      }
      kmoe_bench::print_bench("experts_" + r + (bf16 ? "_bf16_" : "_") + c, fields, gflops / dense_gflops);
      if (backward && !decode_case) {
        double const bflops = 12.0 * static_cast<double>(n) * d * dff;
        kmoe_bench::print_bench("experts_" + r + (bf16 ? "_bf16" : "") + "_backward_" + c,
                                {{"backward_ms", kmoe_bench::fmt(bwd.wall * 1e3)},
                                 {"forward_ms", kmoe_bench::fmt(t.wall * 1e3)},
                                 {"gflops", kmoe_bench::fmt(bflops / bwd.wall * 1e-9)},
                                 {"dense_gflops", kmoe_bench::fmt(dense_gflops)},
                                 {"threads", std::to_string(threads)},
                                 {"launches", std::to_string(bledger.kernel_launches)},
                                 {"products", to_string(backward_options.products)},
                                 {"path", bledger.path}},
                                bwd.wall / t.wall);
      }
    }
  }
  return 0;
}

kmoe_bench::Register reg("experts", "expert runners GFLOP/s next to a dense GEMM chain of the same FLOPs", run);

}  // namespace
