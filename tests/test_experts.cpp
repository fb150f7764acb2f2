// Expert runners: every runner (and every grouped-kernel mapping and host
// ISA available here) agrees with an fp64 host reference on odd shapes, empty
// and 1-row segments, fp32 and bf16; the row/FLOP ledgers match the
// accounting table; scalar test experts follow the fixtures; bad inputs are
// rejected before any kernel runs; initialisation depends only on
// (seed, logical expert).

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Experts_Canary.hpp>
#include <KokkosMoE_Experts_Reference.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace KokkosMoE;
using namespace KokkosMoE::Experts;

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;

template <class T>
RowMatrix<T> random_rows(index_t n, int d, std::mt19937& rng) {
  RowMatrix<T> X("X", n, d);
  auto h = Kokkos::create_mirror_view(X);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (index_t i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) h(i, j) = from_float<T>(u(rng));
  Kokkos::deep_copy(X, h);
  return X;
}

Kokkos::View<index_t*, Mem> make_offsets(std::vector<index_t> const& counts) {
  Kokkos::View<index_t*, Mem> o("offsets", counts.size() + 1);
  auto h = Kokkos::create_mirror_view(o);
  h(0) = 0;
  for (std::size_t q = 0; q < counts.size(); ++q) h(q + 1) = h(q) + counts[q];
  Kokkos::deep_copy(o, h);
  return o;
}

template <class V>
std::vector<float> to_host(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

std::vector<int> iota_experts(int L, int first = 0) {
  std::vector<int> e(static_cast<std::size_t>(L));
  for (int q = 0; q < L; ++q) e[static_cast<std::size_t>(q)] = first + 3 * q;  // non-contiguous logical ids
  return e;
}

/// Largest violation of |y - ref| <= tol (<= 0 means all within tolerance).
/// With `bf16_h` (runs whose intermediate rows are bf16: path "bf16dot"),
/// one bf16 rounding of every h_j adds up to 2^-8 sum_j |h_j w_cj| (the
/// reference's down_magnitude); h_exp = -6 allows for bf16 gate and up
/// products too (the cuBLAS grouped path: rounding g and u moves h by up to
/// about 2^-8 relative, then h itself is rounded).
template <class YV>
double worst_error(YV const& Y, std::vector<double> const& ref, bool bf16_out, std::vector<double> const* bf16_h = nullptr,
                   int h_exp = -8) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Y);
  double scale = 0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  double worst = -1;
  int const d = static_cast<int>(Y.extent(1));
  for (std::size_t i = 0; i < Y.extent(0); ++i)
    for (int c = 0; c < d; ++c) {
      double const r = ref[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)];
      double const y = to_float(h(i, c));
      double tol = 2e-5 * (1.0 + scale) + (bf16_out ? 8e-3 * std::fabs(r) : 0.0);
      if (bf16_h) tol += std::ldexp((*bf16_h)[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)], h_exp);
      if (!std::isfinite(y)) return 1e30;
      worst = std::max(worst, std::fabs(y - r) - tol);
    }
  return worst;
}

struct Config {
  std::string name;
  RunnerOptions options;
};

std::vector<Config> runner_configs() {
  std::vector<Config> c;
  auto add = [&](std::string name, RunnerOptions o) { c.push_back(Config{std::move(name), std::move(o)}); };
  RunnerOptions o;
  o.kind = RunnerKind::grouped;
  add("grouped", o);
  // The host SIMD kernels need a host execution space (tests run on the default one).
  if constexpr (Experts::Impl::is_host_exec<Kokkos::DefaultExecutionSpace>())
    for (auto const& isa : Experts::Impl::host_kernel_isas()) {
      RunnerOptions g = o;
      g.grouped_kernel = GroupedKernel::host_simd;
      g.host_isa = isa;
      add("grouped/host:" + isa, g);
      g.host_column_groups = 3;
      add("grouped/host:" + isa + "/3 column groups", g);
    }
  RunnerOptions p = o;
  p.grouped_kernel = GroupedKernel::portable;
  add("grouped/portable", p);
  RunnerOptions b;
  b.kind = RunnerKind::blas;
  add("blas", b);
  b.gemm_path = GemmPath::generic;
  add("blas/generic gemm", b);
  RunnerOptions pad;
  pad.kind = RunnerKind::padded;
  pad.alignment = 4;
  add("padded C=max a=4", pad);
  pad.capacity = 75;
  pad.alignment = 1;
  add("padded C=75", pad);
  RunnerOptions blk;
  blk.kind = RunnerKind::block;
  blk.block_size = 8;
  add("block B=8", blk);
  blk.block_size = 1;
  blk.grouped_kernel = GroupedKernel::portable;
  add("block B=1 portable", blk);
  return c;
}

struct Shape {
  int d, d_ff;
  std::vector<index_t> counts;
};

std::string describe(Shape const& s) {
  std::ostringstream os;
  os << "d=" << s.d << " d_ff=" << s.d_ff << " counts=[";
  for (std::size_t q = 0; q < s.counts.size(); ++q) os << (q ? "," : "") << s.counts[q];
  os << "]";
  return os.str();
}

template <class WT, class XT, class YT>
void check_all_runners(Shape const& s, std::uint64_t seed) {
  std::mt19937 rng(static_cast<unsigned>(seed));
  int const L = static_cast<int>(s.counts.size());
  ExpertWeights<WT, Mem> w("w", iota_experts(L, 1), s.d, s.d_ff);
  w.randomize(seed);
  index_t n = 0;
  for (index_t c : s.counts) n += c;
  auto X = random_rows<XT>(n, s.d, rng);
  auto offsets = make_offsets(s.counts);
  std::vector<double> magnitude;
  std::vector<double> const ref = reference_run(w, X, offsets, &magnitude);
  for (Config const& cfg : runner_configs()) {
    if (cfg.options.kind == RunnerKind::padded && cfg.options.capacity > 0 && !s.counts.empty() &&
        *std::max_element(s.counts.begin(), s.counts.end()) > cfg.options.capacity)
      continue;
    RowMatrix<YT> Y("Y", n, s.d);
    Kokkos::deep_copy(Y, from_float<YT>(1e30f));  // stale values must not survive
    RunLedger const l = run(Kokkos::DefaultExecutionSpace(), cfg.options, w, X, offsets, Y);
    INFO(cfg.name << " [" << l.path << "] " << describe(s) << " W " << to_string(weight_dtype_of<WT>()) << " X "
                  << to_string(weight_dtype_of<XT>()) << " Y " << to_string(weight_dtype_of<YT>()));
    // The cuBLAS grouped path with bf16 weights rounds GU, H and Y to bf16
    // (cublasGemmGroupedBatchedEx writes C in the operands' type).
    bool const bf16_vendor = std::is_same<WT, bf16_t>::value && l.path.find("cublas") != std::string::npos;
    bool const bf16_h = bf16_vendor || l.path.find("bf16dot") != std::string::npos;
    CHECK(worst_error(Y, ref, bf16_vendor || std::is_same<YT, bf16_t>::value, bf16_h ? &magnitude : nullptr,
                      bf16_vendor ? -6 : -8) <= 0.0);
    CHECK(l.useful_rows == n);
    CHECK(l.executed_rows >= n);
    CHECK(l.matmul_flops == 6 * l.executed_rows * s.d * s.d_ff);
  }
}

std::vector<Shape> test_shapes() {
  std::vector<Shape> shapes = {
      {13, 15, {13, 0, 1, 0, 17}},   // odd sizes, empty slots between non-empty ones, a 1-row segment
      {15, 17, {0, 0, 0}},           // zero rows
      {5, 7, {}},                    // a rank without local slots
      {17, 13, {1, 1, 0, 1}},        // 1-row segments only
      {1, 1, {2, 0, 3}},             // degenerate widths
      {40, 300, {70, 16, 0, 33}},    // several row tiles, a k-chunk boundary in phase 2
  };
  std::mt19937 rng(2024);
  for (int i = 0; i < 3; ++i) {
    Shape s;
    s.d = std::uniform_int_distribution<int>(1, 80)(rng);
    s.d_ff = std::uniform_int_distribution<int>(1, 100)(rng);
    int const L = std::uniform_int_distribution<int>(1, 6)(rng);
    for (int q = 0; q < L; ++q) {
      bool const empty = std::uniform_int_distribution<int>(0, 9)(rng) < 3;
      s.counts.push_back(empty ? 0 : std::uniform_int_distribution<index_t>(1, 70)(rng));
    }
    shapes.push_back(s);
  }
  return shapes;
}

}  // namespace

TEST_CASE("all runners agree with the fp64 reference (fp32)", "[experts][runners]") {
  std::uint64_t seed = 11;
  for (Shape const& s : test_shapes()) check_all_runners<float, float, float>(s, seed++);
}

TEST_CASE("all runners agree with the fp64 reference (bf16 weights and rows)", "[experts][runners][bf16]") {
  std::uint64_t seed = 101;
  for (Shape const& s : test_shapes()) {
    check_all_runners<bf16_t, bf16_t, bf16_t>(s, seed++);
    check_all_runners<bf16_t, float, float>(s, seed++);
  }
}

TEST_CASE("a 12x3071x517-like shape: 12 rows, d = 517, d_ff = 3071", "[experts][runners][large]") {
  Shape const s{517, 3071, {12, 0, 1}};
  check_all_runners<float, float, float>(s, 5);
  check_all_runners<bf16_t, bf16_t, float>(s, 6);
}

TEST_CASE("accounting table: counts [2,2,1,1,1,1], d = 3, d_ff = 4, C = 3, a = 2, B = 2", "[experts][ledger]") {
  std::vector<index_t> const counts = {2, 2, 1, 1, 1, 1};
  ExpertWeights<float, Mem> w("acct", iota_experts(6), 3, 4);
  w.randomize(3);
  std::mt19937 rng(3);
  auto X = random_rows<float>(8, 3, rng);
  auto offsets = make_offsets(counts);
  std::vector<double> const ref = reference_run(w, X, offsets);

  RunnerOptions grouped;
  RunnerOptions padded;
  padded.kind = RunnerKind::padded;
  padded.capacity = 3;
  padded.alignment = 2;
  RunnerOptions block;
  block.kind = RunnerKind::block;
  block.block_size = 2;
  RunnerOptions blas;
  blas.kind = RunnerKind::blas;

  struct Expect {
    RunnerOptions o;
    index_t executed, capacity, flops;
  };
  for (Expect const& e : {Expect{grouped, 8, 8, 576}, Expect{padded, 24, 18, 1728}, Expect{block, 12, 12, 864},
                          Expect{blas, 8, 8, 576}}) {
    RowMatrix<float> Y("Y", 8, 3);
    RunLedger const l = run(Kokkos::DefaultExecutionSpace(), e.o, w, X, offsets, Y);
    RunLedger const p = plan_ledger(e.o, counts, 3, 4);
    INFO(to_string(e.o.kind) << " [" << l.path << "]");
    CHECK(l.useful_rows == 8);
    CHECK(l.executed_rows == e.executed);
    CHECK(l.capacity_rows == e.capacity);
    CHECK(l.padding_rows == e.executed - 8);
    CHECK(l.matmul_flops == e.flops);
    CHECK(l.useful_flops == 576);
    CHECK(l.utilization == Approx(8.0 / static_cast<double>(e.executed)));
    CHECK(l.nonempty_slots == 6);
    CHECK(p.executed_rows == l.executed_rows);
    CHECK(p.capacity_rows == l.capacity_rows);
    CHECK(p.matmul_flops == l.matmul_flops);
    CHECK(l.descriptor_bytes >= static_cast<index_t>(7 * sizeof(index_t)));
    CHECK(worst_error(Y, ref, false) <= 0.0);
  }
  // Padded: 24 executed rows = 6 slots x round_up(3, 2); the row map is the descriptor.
  RunLedger const pl = plan_ledger(padded, counts, 3, 4);
  CHECK(pl.descriptor_bytes == static_cast<index_t>((7 + 24) * sizeof(index_t)));
}

TEST_CASE("grouped: one launch per GEMM phase whatever the segments", "[experts][ledger]") {
  ExpertWeights<float, Mem> w("w", iota_experts(7), 8, 12);
  w.randomize(1);
  std::vector<index_t> const counts = {0, 0, 1, 0, 100, 0, 3};
  std::mt19937 rng(1);
  auto X = random_rows<float>(104, 8, rng);
  auto offsets = make_offsets(counts);
  RowMatrix<float> Y("Y", 104, 8);
  for (GroupedKernel k : {GroupedKernel::automatic, GroupedKernel::portable}) {
    RunnerOptions o;
    o.grouped_kernel = k;
    RunLedger const l = run(Kokkos::DefaultExecutionSpace(), o, w, X, offsets, Y);
    // The vendor path (where the build has one) is two grouped GEMM calls and the SwiGLU kernel.
    bool const vendor = k == GroupedKernel::automatic &&
                        Experts::Impl::GroupedVendor<Kokkos::DefaultExecutionSpace, float, float, float>::available;
    CHECK(l.kernel_launches == (vendor ? 3 : 2));
    CHECK(l.nonempty_slots == 3);
    CHECK(worst_error(Y, reference_run(w, X, offsets), false) <= 0.0);
  }
  RunnerOptions b;
  b.kind = RunnerKind::blas;
  // 3 non-empty segments x (gate, up, activation, down).
  CHECK(run(Kokkos::DefaultExecutionSpace(), b, w, X, offsets, Y).kernel_launches == 12);
}

TEST_CASE("a Runner reuses its buffers across shapes", "[experts][runners]") {
  std::mt19937 rng(9);
  for (RunnerKind kind : {RunnerKind::grouped, RunnerKind::blas, RunnerKind::padded, RunnerKind::block}) {
    RunnerOptions o;
    o.kind = kind;
    o.block_size = 4;
    Runner<> runner(o);
    for (auto const& counts : {std::vector<index_t>{5, 0, 9}, std::vector<index_t>{40, 33, 1}, std::vector<index_t>{0, 2, 0}}) {
      ExpertWeights<bf16_t, Mem> w("w", iota_experts(3), 24, 20);
      w.randomize(4);
      index_t n = 0;
      for (index_t c : counts) n += c;
      auto X = random_rows<bf16_t>(n, 24, rng);
      auto offsets = make_offsets(counts);
      RowMatrix<float> Y("Y", n, 24);
      RunLedger const l = runner.run(Kokkos::DefaultExecutionSpace(), w, X, offsets, Y);
      INFO(to_string(kind) << " n=" << n << " [" << l.path << "]");
      std::vector<double> magnitude;
      auto const ref = reference_run(w, X, offsets, &magnitude);
      // The cuBLAS grouped path rounds GU, H and Y to bf16 (see check_all_runners).
      bool const vendor = l.path.find("cublas") != std::string::npos;
      bool const bf16_h = vendor || l.path.find("bf16dot") != std::string::npos;
      CHECK(worst_error(Y, ref, vendor, bf16_h ? &magnitude : nullptr, vendor ? -6 : -8) <= 0.0);
    }
  }
}

TEST_CASE("scalar test experts follow the dispatch_v17 fixture's expert scales", "[experts][scalar]") {
  auto const fx = kmoe_test::fixture("dispatch_v17.json");
  std::vector<float> const scale = fx["inputs"]["expert_scale"].get<std::vector<float>>();
  // Rank 1's slots in the fixture store experts 0 and 1; rank 2's store 1 and 2.
  std::vector<std::vector<int>> const slot_sets = {{0, 1}, {1, 2}, {0, 1, 2, 3}, {}};
  auto const hidden = fx["inputs"]["hidden"]["rank1"].get<std::vector<std::vector<float>>>();
  for (auto const& slots : slot_sets) {
    auto w = ExpertWeights<float, Mem>::scalar("scalar", slots, 3, scale);
    CHECK(w.has_scalar());
    CHECK_FALSE(w.has_swiglu());
    // Every slot gets both hidden rows, expert-major.
    std::vector<index_t> counts(slots.size(), 2);
    index_t const n = static_cast<index_t>(2 * slots.size());
    RowMatrix<bf16_t> X("X", n, 3);
    auto hx = Kokkos::create_mirror_view(X);
    for (index_t r = 0; r < n; ++r)
      for (int c = 0; c < 3; ++c) hx(r, c) = to_bf16(hidden[static_cast<std::size_t>(r % 2)][static_cast<std::size_t>(c)]);
    Kokkos::deep_copy(X, hx);
    auto offsets = make_offsets(counts);
    RowMatrix<float> Y("Y", n, 3);
    RunnerOptions o;
    o.kind = RunnerKind::scalar;
    RunLedger const l = run(Kokkos::DefaultExecutionSpace(), o, w, X, offsets, Y);
    CHECK(l.matmul_flops == 0);
    CHECK(l.executed_rows == n);
    auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Y);
    for (index_t r = 0; r < n; ++r)
      for (int c = 0; c < 3; ++c) {
        float const s = scale[static_cast<std::size_t>(slots[static_cast<std::size_t>(r / 2)])];
        // Fixture values and scales are exact in bf16 and fp32.
        CHECK(hy(r, c) == s * hidden[static_cast<std::size_t>(r % 2)][static_cast<std::size_t>(c)]);
      }
    CHECK(worst_error(Y, reference_run(w, X, offsets), false) <= 0.0);
  }
}

TEST_CASE("scalar test experts can ride along SwiGLU weights", "[experts][scalar]") {
  ExpertWeights<float, Mem> w("w", {2, 0}, 4, 6);
  w.randomize(8);
  w.set_scalar_scales({10.0f, 20.0f, 30.0f});
  RowMatrix<float> X("X", 3, 4), Y("Y", 3, 4);
  Kokkos::deep_copy(X, 1.0f);
  auto offsets = make_offsets({1, 2});
  RunnerOptions o;
  o.kind = RunnerKind::scalar;
  run(Kokkos::DefaultExecutionSpace(), o, w, X, offsets, Y);
  auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), Y);
  CHECK(hy(0, 0) == 30.0f);
  CHECK(hy(1, 3) == 10.0f);
  CHECK(hy(2, 1) == 10.0f);
  CHECK_THROWS_WITH(w.set_scalar_scales({1.0f}), Catch::Matchers::Contains("stores expert 2 but only 1 expert scales"));
}

TEST_CASE("bad inputs are rejected before any kernel runs", "[experts][errors]") {
  ExpertWeights<float, Mem> w("w", iota_experts(3), 5, 7);
  w.randomize(2);
  RowMatrix<float> X("X", 6, 5), Y("Y", 6, 5), Ywide("Y", 6, 6);
  auto good = make_offsets({2, 4, 0});
  RunnerOptions o;
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), o, w, X, make_offsets({2, 4}), Y),
                    Catch::Matchers::Contains("offsets has 3 entries, expected L + 1 = 4"));
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), o, w, X, make_offsets({2, 3, 0}), Y),
                    Catch::Matchers::Contains("offsets[L = 3] = 5 but there are 6 rows"));
  Kokkos::View<index_t*, Mem> bad("bad", 4);
  auto hb = Kokkos::create_mirror_view(bad);
  hb(0) = 0;
  hb(1) = 4;
  hb(2) = 3;
  hb(3) = 6;
  Kokkos::deep_copy(bad, hb);
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), o, w, X, bad, Y),
                    Catch::Matchers::Contains("offsets decrease at slot 1: offsets[1] = 4, offsets[2] = 3"));
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), o, w, X, good, Ywide),
                    Catch::Matchers::Contains("Y is 6x6, the experts have d = 5"));
  RunnerOptions padded;
  padded.kind = RunnerKind::padded;
  padded.capacity = 3;
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), padded, w, X, good, Y),
                    Catch::Matchers::Contains("slot 1 has 4 rows, above the capacity C = 3"));
  RunnerOptions zero_align = padded;
  zero_align.alignment = 0;
  CHECK_THROWS_WITH(Runner<>(zero_align), Catch::Matchers::Contains("padded alignment 0 must be >= 1"));
  RunnerOptions scalar;
  scalar.kind = RunnerKind::scalar;
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), scalar, w, X, good, Y),
                    Catch::Matchers::Contains("runner 'scalar' needs scalar test-expert scales"));
  auto sw = ExpertWeights<float, Mem>::scalar("s", {0, 1, 2}, 5, {1, 2, 3});
  CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), o, sw, X, good, Y),
                    Catch::Matchers::Contains("runner 'grouped' needs SwiGLU weights"));
  CHECK_THROWS_WITH(from_string<RunnerKind>("megablocks"), Catch::Matchers::Contains("unknown runner 'megablocks'"));
  CHECK(from_string<RunnerKind>("block") == RunnerKind::block);
  RunnerOptions isa;
  isa.host_isa = "sve512";
  if (Experts::Impl::is_host_exec<Kokkos::DefaultExecutionSpace>())
    CHECK_THROWS_WITH(run(Kokkos::DefaultExecutionSpace(), isa, w, X, good, Y),
                      Catch::Matchers::Contains("'sve512' is not available"));
  CHECK_THROWS_WITH(ExpertWeights<float>("w", {0}, 0, 4), Catch::Matchers::Contains("d = 0 and d_ff = 4 must both be >= 1"));
  CHECK_THROWS_WITH(ExpertWeights<float>("w", {0, -1}, 2, 4), Catch::Matchers::Contains("local slot 1 has logical expert -1"));
}

TEST_CASE("random initialisation depends only on (seed, logical expert)", "[experts][weights]") {
  ExpertWeights<bf16_t, Mem> a("a", {5, 2}, 9, 11), b("b", {2, 7, 5}, 9, 11), c("c", {5}, 9, 11);
  a.randomize(77, 4);
  b.randomize(77, 4);
  c.randomize(78, 4);
  CHECK(a.digest(0) == b.digest(2));  // expert 5
  CHECK(a.digest(1) == b.digest(0));  // expert 2
  CHECK(a.digest(0) != c.digest(0));  // another seed
  CHECK(a.digest(0) != a.digest(1));
  CHECK(a.version(1) == 4);
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a.down());
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b.down());
  bool same = true;
  for (int r = 0; r < 9; ++r)
    for (int k = 0; k < 11; ++k) same = same && ha(0, r, k).bits == hb(2, r, k).bits;
  CHECK(same);
  // The digest is the content digest of the stored bytes, recomputed on demand.
  std::uint64_t const before = a.digest(0);
  auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a.gate());
  hg(0, 3, 4) = to_bf16(to_float(hg(0, 3, 4)) + 1.0f);
  Kokkos::deep_copy(a.gate(), hg);
  a.refresh_digests();
  CHECK(a.digest(0) != before);
  CHECK(a.digest(1) == b.digest(0));
}

TEST_CASE("runner parity canary: a matching candidate serves", "[experts][canary]") {
  std::mt19937 rng(77);
  int const d = 48, d_ff = 96;
  std::vector<index_t> const counts{5, 0, 7, 1};
  ExpertWeights<float, Mem> w("canary", iota_experts(4), d, d_ff);
  w.randomize(21);
  auto const X = random_rows<float>(13, d, rng);
  auto const offsets = make_offsets(counts);
  RunnerOptions blas, grouped;
  blas.kind = RunnerKind::blas;
  RunnerGate<> gate(blas);
  CHECK(gate.reference_serves());
  auto const r = gate.admit(Kokkos::DefaultExecutionSpace(), grouped, w, X, offsets);
  INFO(r.summary());
  CHECK(r.passed);
  CHECK(r.violations == 0);
  CHECK(r.rows == 13);
  CHECK_FALSE(gate.reference_serves());
  CHECK(gate.serving().kind == RunnerKind::grouped);
  CHECK(gate.blocked().empty());
  // The gate now runs the candidate: the same bits as the candidate alone.
  RowMatrix<float> y("y", 13, d), want("want", 13, d);
  auto const ledger = gate.run(Kokkos::DefaultExecutionSpace(), w, X, offsets, y);
  CHECK(ledger.kind == RunnerKind::grouped);
  Runner<> alone(grouped);
  alone.run(w, X, offsets, want);
  CHECK(kmoe_test::same_bits(to_host(y), to_host(want)));
}

TEST_CASE("runner parity canary: a candidate beyond its tolerance is blocked, the reference keeps serving",
          "[experts][canary][fault]") {
  std::mt19937 rng(78);
  int const d = 64, d_ff = 160;
  std::vector<index_t> const counts{9, 3, 0, 12};
  ExpertWeights<float, Mem> w("canary", iota_experts(4), d, d_ff);
  w.randomize(22);
  auto const X = random_rows<float>(24, d, rng);
  auto const offsets = make_offsets(counts);
  RunnerOptions blas, grouped;
  blas.kind = RunnerKind::blas;
  RowMatrix<float> want("want", 24, d);
  Runner<>(blas).run(w, X, offsets, want);

  SECTION("outputs differ beyond a zero tolerance") {
    // Both runners accumulate in FP32 in different orders: on hosts (SIMD
    // kernels against the BLAS) their outputs differ in the last bits, which
    // a zero tolerance does not allow. A device's two GEMMs may agree bit for
    // bit; the gate must then admit the candidate.
    RowMatrix<float> alone("alone", 24, d);
    Runner<>(grouped).run(w, X, offsets, alone);
    bool const differ = !kmoe_test::same_bits(to_host(alone), to_host(want));
    if (Experts::Impl::is_host_exec<Kokkos::DefaultExecutionSpace>()) REQUIRE(differ);
    RunnerGate<> gate(blas, ParityTolerance{0.0, 0.0});
    auto const r = gate.admit(Kokkos::DefaultExecutionSpace(), grouped, w, X, offsets);
    INFO(r.summary());
    if (!differ) {
      CHECK(r.passed);
      return;
    }
    REQUIRE_FALSE(r.passed);
    CHECK(r.violations > 0);
    CHECK(r.max_abs_error > 0);
    CHECK(r.worst_row >= 0);
    CHECK_THAT(r.summary(), Catch::Matchers::Contains("differs from 'blas") && Catch::Matchers::Contains("canary rows; worst at row"));
    CHECK(gate.reference_serves());
    REQUIRE(gate.blocked().size() == 1);
    RowMatrix<float> y("y", 24, d);
    CHECK(gate.run(Kokkos::DefaultExecutionSpace(), w, X, offsets, y).kind == RunnerKind::blas);
    CHECK(kmoe_test::same_bits(to_host(y), to_host(want)));  // the reference serves
    // The blocked candidate is refused from now on.
    CHECK_THROWS_WITH(gate.admit(Kokkos::DefaultExecutionSpace(), grouped, w, X, offsets),
                      Catch::Matchers::Contains("RunnerGate: runner grouped(kernel=auto, isa=auto, column_groups=0) is blocked: runner"));
  }
  SECTION("a candidate that fails on the canary") {
    RunnerGate<> gate(blas);
    RunnerOptions small;
    small.kind = RunnerKind::padded;
    small.capacity = 4;  // segments of 9 and 12 rows do not fit
    auto const r = gate.admit(Kokkos::DefaultExecutionSpace(), small, w, X, offsets);
    CHECK_FALSE(r.passed);
    CHECK_THAT(r.error, Catch::Matchers::Contains("capacity"));
    CHECK_THAT(r.summary(), Catch::Matchers::Contains("failed on the canary batch (24x64 rows)"));
    CHECK(gate.reference_serves());
    RowMatrix<float> y("y", 24, d);
    gate.run(Kokkos::DefaultExecutionSpace(), w, X, offsets, y);
    CHECK(kmoe_test::same_bits(to_host(y), to_host(want)));
  }
}

TEST_CASE("runner parity: element comparison with NaN and infinities", "[experts][canary]") {
  ParityTolerance const tol{1e-3, 0.0};
  float const inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(compare_outputs({1.0f, nan, inf}, {1.0005f, nan, inf}, 1, 3, tol).passed);
  auto const r = compare_outputs({1.0f, 0.0f, -inf, 2.0f}, {1.0f, nan, inf, 2.01f}, 2, 2, tol);
  CHECK(r.violations == 3);
  CHECK(r.worst_row == 0);  // the first non-finite mismatch
  CHECK(r.worst_col == 1);
  CHECK(std::isinf(r.max_abs_error));
  CHECK_THROWS_WITH(compare_outputs({1.0f}, {1.0f, 2.0f}, 1, 2, tol), Catch::Matchers::Contains("compare_outputs: 1 and 2 values"));
}

TEST_CASE("vendor grouped GEMM: refused where unavailable, else agrees with the portable kernel", "[experts][vendor]") {
  using Exec = Kokkos::DefaultExecutionSpace;
  std::mt19937 rng(31);
  std::vector<index_t> const counts = {0, 5, 64, 1, 130, 0};
  index_t n = 0;
  for (index_t c : counts) n += c;
  auto offsets = make_offsets(counts);
  auto check = [&](auto tag) {
    using WT = decltype(tag);
    constexpr bool bf16 = std::is_same<WT, bf16_t>::value;
    ExpertWeights<WT, Mem> w("w", iota_experts(6), 96, 80);
    w.randomize(11);
    auto X = random_rows<WT>(n, 96, rng);
    RowMatrix<float> Yv("Yv", n, 96), Yp("Yp", n, 96);
    RunnerOptions v;
    v.grouped_kernel = GroupedKernel::vendor;
    INFO((bf16 ? "bf16" : "fp32") << " weights");
    if (!Experts::Impl::GroupedVendor<Exec, WT, WT, float>::available) {
      CHECK_THROWS_WITH(run(Exec(), v, w, X, offsets, Yv), Catch::Matchers::Contains("grouped kernel 'vendor' is not available"));
      return;
    }
    RunLedger const l = run(Exec(), v, w, X, offsets, Yv);
    CHECK(l.path == "grouped[cublas]");
    // Two grouped calls and the SwiGLU kernel; float outputs of bf16 weights
    // are widened by one more kernel (cuBLAS grouped GEMM writes C in the
    // operands' type).
    CHECK(l.kernel_launches == (bf16 ? 4 : 3));
    RunnerOptions p;
    p.grouped_kernel = GroupedKernel::portable;
    run(Exec(), p, w, X, offsets, Yp);
    // GU, H and Y are rounded to the weights' type on the vendor path.
    auto const a = to_host(Yv), b = to_host(Yp);
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
    }
    CHECK(worst <= (bf16 ? 2e-2 : 1e-4) * (1.0 + scale));
  };
  check(float{});
  check(bf16_t{});
}

TEST_CASE("host decode kernel: the same bits as the tiled kernel, every ISA", "[experts][decode]") {
  // The decode kernel (columns as SIMD lanes, weights read once along k) and
  // the tiled micro-kernels (rows as SIMD lanes) add each output's products
  // in the same order: a row gives the same bits whichever runs it, so the
  // choice by rows per tile never changes a layer's output.
  using Exec = Kokkos::DefaultExecutionSpace;
  if constexpr (!Experts::Impl::is_host_exec<Exec>()) {
    SUCCEED("host kernels only");
  } else {
    std::mt19937 rng(5);
    struct Shape {
      int d, dff;
      std::vector<index_t> counts;
    };
    // d or d_ff of 1024 take the skewed bf16 pair decode form (rows 2 KiB apart).
    for (Shape const& s : {Shape{37, 21, {1, 0, 2, 8, 5}}, Shape{64, 48, {3, 1, 7, 0, 4}}, Shape{33, 100, {8, 8, 1}},
                           Shape{16, 16, {2, 9, 1}}, Shape{1024, 40, {1, 3, 8, 0, 2}}, Shape{40, 1024, {8, 1, 4}}}) {
      for (std::string const& isa : Experts::Impl::host_kernel_isas()) {
        auto run_pair = [&](auto wtag, auto xtag) {
          using WT = decltype(wtag);
          using XT = decltype(xtag);
          ExpertWeights<WT, Mem> w("w", iota_experts(static_cast<int>(s.counts.size())), s.d, s.dff);
          w.randomize(21);
          index_t n = 0;
          for (index_t c : s.counts) n += c;
          auto X = random_rows<XT>(n, s.d, rng);
          auto offsets = make_offsets(s.counts);
          RowMatrix<float> Yd("Yd", n, s.d), Yt("Yt", n, s.d);
          RunnerOptions o;
          o.grouped_kernel = GroupedKernel::host_simd;
          o.host_isa = isa;
          o.decode_rows = 8;
          RunLedger const ld = run(Exec(), o, w, X, offsets, Yd);
          o.decode_rows = 0;
          RunLedger const lt = run(Exec(), o, w, X, offsets, Yt);
          index_t small = 0;
          for (index_t c : s.counts) small += c <= 8 ? c : 0;
          INFO("isa " << isa << " d=" << s.d << " dff=" << s.dff << " weights " << (std::is_same<WT, float>::value ? "fp32" : "bf16")
                      << " rows " << (std::is_same<XT, float>::value ? "fp32" : "bf16") << " path " << ld.path);
          CHECK(ld.decode_rows == small);
          CHECK(lt.decode_rows == 0);
          auto const a = to_host(Yd), b = to_host(Yt);
          CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
          std::vector<double> magnitude;
          auto const ref = reference_run(w, X, offsets, &magnitude);
          CHECK(worst_error(Yd, ref, false, ld.path.find("bf16dot") != std::string::npos ? &magnitude : nullptr) <= 0.0);
        };
        run_pair(float{}, float{});
        run_pair(bf16_t{}, float{});
        run_pair(bf16_t{}, bf16_t{});
      }
    }
    RunnerOptions bad;
    bad.decode_rows = 9;
    CHECK_THROWS_WITH(Runner<>(bad), Catch::Matchers::Contains("decode_rows 9 must be in [-1, 8]"));
  }
}
