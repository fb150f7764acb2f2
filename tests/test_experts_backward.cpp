// Expert backward: dX and the gate, up and down weight gradients of the
// SwiGLU experts against central finite differences of an fp64 evaluation
// of the same function (fp32 and bf16 weights and rows, empty and 1-row
// segments), saved activations against recomputed ones, accumulation, and
// shapes refused before any kernel runs.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Experts_Backward.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace KokkosMoE;
using namespace KokkosMoE::Experts;

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

/// The experts' function in fp64 on plain arrays: X [n*d], gate/up
/// [L*dff*d], down [L*d*dff]; returns sum over rows and columns of R * Y.
struct Fp64Experts {
  int L, d, dff;
  std::vector<index_t> offs;
  std::vector<double> X, gate, up, down, R;

  double loss() const {
    double total = 0;
    std::vector<double> h(static_cast<std::size_t>(dff));
    for (int q = 0; q < L; ++q)
      for (index_t r = offs[q]; r < offs[q + 1]; ++r) {
        for (int j = 0; j < dff; ++j) {
          double g = 0, u = 0;
          for (int k = 0; k < d; ++k) {
            double const x = X[static_cast<std::size_t>(r) * d + k];
            g += x * gate[(static_cast<std::size_t>(q) * dff + j) * d + k];
            u += x * up[(static_cast<std::size_t>(q) * dff + j) * d + k];
          }
          h[j] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int c = 0; c < d; ++c) {
          double y = 0;
          for (int j = 0; j < dff; ++j) y += h[j] * down[(static_cast<std::size_t>(q) * d + c) * dff + j];
          total += R[static_cast<std::size_t>(r) * d + c] * y;
        }
      }
    return total;
  }

  /// Central difference of loss() in parameter p.
  double fd(std::vector<double>& p, std::size_t i) {
    double const keep = p[i], h = 1e-5 * std::max(1.0, std::abs(keep));
    p[i] = keep + h;
    double const plus = loss();
    p[i] = keep - h;
    double const minus = loss();
    p[i] = keep;
    return (plus - minus) / (2 * h);
  }
};

template <class V>
std::vector<double> host_doubles(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<double> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<double>(to_float(h.data()[i]));
  return out;
}

template <class T>
RowMatrix<T> random_rows(index_t n, int d, std::mt19937& rng, float scale) {
  RowMatrix<T> X("X", n, d);
  auto h = Kokkos::create_mirror_view(X);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (index_t i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) h(i, j) = from_float<T>(u(rng));
  Kokkos::deep_copy(X, h);
  return X;
}

/// Segment offsets [0, c0, c0 + c1, ...] of the counts, on the device.
Kokkos::View<index_t*, Mem> offsets_of(std::vector<index_t> const& counts) {
  Kokkos::View<index_t*, Mem> offsets("offsets", counts.size() + 1);
  auto h = Kokkos::create_mirror_view(offsets);
  h(0) = 0;
  for (std::size_t q = 0; q < counts.size(); ++q) h(q + 1) = h(q) + counts[q];
  Kokkos::deep_copy(offsets, h);
  return offsets;
}

/// Three fp32 experts of width d and d_ff with random weights, rows in
/// segments of the counts, random X and dY, and Y, dX1, dX2 for results.
struct ThreeExperts {
  ExpertWeights<float, Mem> w;
  Kokkos::View<index_t*, Mem> offsets;
  RowMatrix<float> X, dY, Y, dX1, dX2;
  ThreeExperts(int d, int dff, std::vector<index_t> const& counts, unsigned rows_seed, std::uint64_t weights_seed)
      : w("w", {0, 1, 2}, d, dff), offsets(offsets_of(counts)) {
    w.randomize(Exec(), weights_seed);
    std::mt19937 rng(rows_seed);
    index_t const n = counts[0] + counts[1] + counts[2];
    X = random_rows<float>(n, d, rng, 1.0f);
    dY = random_rows<float>(n, d, rng, 1.0f);
    Y = RowMatrix<float>("Y", n, d), dX1 = RowMatrix<float>("dX1", n, d), dX2 = RowMatrix<float>("dX2", n, d);
  }
};

/// Largest |ours - fd| / (|fd| + floor) over all entries.
double worst_relative(std::vector<double> const& ours, Fp64Experts& f, std::vector<double>& p, double floor) {
  double worst = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    double const want = f.fd(p, i);
    worst = std::max(worst, std::abs(ours[i] - want) / (std::abs(want) + floor));
  }
  return worst;
}

template <class WT, class XT>
void check_gradients(std::vector<index_t> const& counts, int d, int dff, bool keep) {
  std::mt19937 rng(11);
  int const L = static_cast<int>(counts.size());
  std::vector<int> experts;
  for (int q = 0; q < L; ++q) experts.push_back(2 * q + 1);
  ExpertWeights<WT, Mem> w("w", experts, d, dff);
  w.randomize(Exec(), 5);
  std::vector<index_t> offs(1, 0);
  for (index_t c : counts) offs.push_back(offs.back() + c);
  index_t const n = offs.back();
  auto const offsets = offsets_of(counts);
  auto X = random_rows<XT>(n, d, rng, 1.0f);
  auto dY = random_rows<XT>(n, d, rng, 1.0f);
  RowMatrix<XT> Y("Y", n, d), dX("dX", n, d);
  ExpertGradients<Mem> grads(w);
  Backward<Exec, Mem> bw;
  SavedActivations<Mem> saved;
  if (keep) bw.forward_keep(Exec(), w, X, offsets, Y, saved);
  BackwardLedger const l = bw.backward(Exec(), w, X, offsets, dY, dX, grads, saved);
  INFO("L = " << L << " d = " << d << " dff = " << dff << " path " << l.path);
  CHECK(l.recomputed == !keep);
  CHECK(l.rows == n);
  CHECK(l.matmul_flops == (keep ? 12 : 16) * n * d * dff);

  Fp64Experts f{L, d, dff, offs, host_doubles(X), host_doubles(w.gate()), host_doubles(w.up()), host_doubles(w.down()),
                host_doubles(dY)};
  // bf16 rows and gradients are rounded to 8 bits of mantissa; fp32 ones are not.
  bool const coarse = std::is_same<XT, bf16_t>::value;
  double const tol = coarse ? 2e-2 : 2e-4;
  CHECK(worst_relative(host_doubles(dX), f, f.X, 1.0) <= tol);
  CHECK(worst_relative(host_doubles(grads.gate), f, f.gate, 1.0) <= 2e-4);
  CHECK(worst_relative(host_doubles(grads.up), f, f.up, 1.0) <= 2e-4);
  CHECK(worst_relative(host_doubles(grads.down), f, f.down, 1.0) <= 2e-4);
  if (keep) {
    // The kept forward is the experts' function (fp32 rows: to fp32 rounding).
    RowMatrix<XT> Yr("Yr", n, d);
    run(Exec(), RunnerOptions{}, w, X, offsets, Yr);
    auto a = host_doubles(Y), b = host_doubles(Yr);
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1.0));
    CHECK(worst <= (coarse ? 1e-2 : 1e-5));
  }
}

}  // namespace

TEST_CASE("expert backward equals finite differences of the fp64 experts", "[experts][backward]") {
  SECTION("fp32, recomputed activations") { check_gradients<float, float>({3, 0, 1, 5}, 6, 10, false); }
  SECTION("fp32, saved activations") { check_gradients<float, float>({4, 2, 0}, 7, 9, true); }
  SECTION("bf16 weights, fp32 rows") { check_gradients<bf16_t, float>({2, 3}, 8, 12, false); }
  SECTION("bf16 weights and rows") { check_gradients<bf16_t, bf16_t>({1, 4}, 8, 12, true); }
  SECTION("no rows") { check_gradients<float, float>({0, 0}, 4, 6, false); }
}

TEST_CASE("saved and recomputed activations give the same bits; accumulation adds", "[experts][backward]") {
  int const dff = 24;
  ThreeExperts e(16, dff, {7, 0, 13}, 3, 9);
  auto const& [w, offsets, X, dY, Y, dX1, dX2] = e;
  Backward<Exec, Mem> bw;
  SavedActivations<Mem> saved;
  bw.forward_keep(Exec(), w, X, offsets, Y, saved);
  ExpertGradients<Mem> g1(w), g2(w);
  auto const l1 = bw.backward(Exec(), w, X, offsets, dY, dX1, g1);
  auto const l2 = bw.backward(Exec(), w, X, offsets, dY, dX2, g2, saved);
  CHECK(l1.path.find("recompute") != std::string::npos);
  CHECK(l2.path.find("saved") != std::string::npos);
  CHECK(l2.saved_bytes == 2 * 4 * 20 * dff);
  CHECK(host_doubles(dX1) == host_doubles(dX2));
  CHECK(host_doubles(g1.gate) == host_doubles(g2.gate));
  CHECK(host_doubles(g1.down) == host_doubles(g2.down));
  // A second backward with accumulate adds the same gradients again.
  BackwardOptions acc;
  acc.accumulate = true;
  Backward<Exec, Mem> bw2(acc);
  bw2.backward(Exec(), w, X, offsets, dY, dX2, g2, saved);
  auto once = host_doubles(g1.up), twice = host_doubles(g2.up);
  double worst = 0;
  for (std::size_t i = 0; i < once.size(); ++i) worst = std::max(worst, std::abs(twice[i] - 2 * once[i]) / (std::abs(once[i]) + 1e-3));
  CHECK(worst <= 1e-5);
  // Without accumulate every gradient is overwritten, the empty slot's too:
  // stale NaN gradients leave no trace and give the same bits as fresh ones.
  ExpertGradients<Mem> g3(w);
  float const nan = std::numeric_limits<float>::quiet_NaN();
  Kokkos::deep_copy(g3.gate, nan);
  Kokkos::deep_copy(g3.up, nan);
  Kokkos::deep_copy(g3.down, nan);
  bw.backward(Exec(), w, X, offsets, dY, dX2, g3, saved);
  CHECK(host_doubles(g3.gate) == host_doubles(g1.gate));
  CHECK(host_doubles(g3.up) == host_doubles(g1.up));
  CHECK(host_doubles(g3.down) == host_doubles(g1.down));
}

TEST_CASE("expert backward refuses mismatched shapes before running", "[experts][backward]") {
  ExpertWeights<float, Mem> w("w", {0, 1}, 8, 12);
  w.randomize(Exec(), 1);
  Kokkos::View<index_t*, Mem> offsets("offsets", 3);
  RowMatrix<float> X("X", 0, 8), dY("dY", 0, 8), dX("dX", 0, 8), bad("bad", 0, 7);
  Backward<Exec, Mem> bw;
  ExpertGradients<Mem> wrong("g", 3, 8, 12);
  CHECK_THROWS_WITH(bw.backward(Exec(), w, X, offsets, dY, dX, wrong), Catch::Matchers::Contains("gradients for 3 slots of 8x12"));
  ExpertGradients<Mem> g(w);
  CHECK_THROWS_WITH(bw.backward(Exec(), w, X, offsets, bad, dX, g), Catch::Matchers::Contains("dY is 0x7"));
  CHECK_THROWS_WITH(bw.backward(Exec(), w, X, Kokkos::View<index_t*, Mem>("o", 2), dY, dX, g),
                    Catch::Matchers::Contains("offsets has 2 entries, expected L + 1 = 3"));
  SavedActivations<Mem> saved{RowMatrix<float, Mem>("g", 5, 12), RowMatrix<float, Mem>("u", 5, 12)};
  CHECK_THROWS_WITH(bw.backward(Exec(), w, X, offsets, dY, dX, g, saved), Catch::Matchers::Contains("saved activations are 5x12"));
}

TEST_CASE("host micro-kernel GEMMs: NN, NT and TN against fp64, K in blocks, rows independent of the call", "[experts][backward]") {
  using HExec = Kokkos::DefaultHostExecutionSpace;
  using M = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](M const& m) {
    for (std::size_t i = 0; i < m.extent(0); ++i)
      for (std::size_t j = 0; j < m.extent(1); ++j) m(i, j) = u(rng);
  };
  // op(A)(i, k) and op(B)(k, j) of row-major A and B.
  auto at = [](M const& a, char t, int i, int k) { return static_cast<double>(t == 'N' ? a(i, k) : a(k, i)); };
  for (auto const& isa : Experts::Impl::host_kernel_isas()) {
    auto const& table = Experts::Impl::host_kernel_table(isa);
    // Odd extents: partial row steps, partial column tiles; K = 2100 runs
    // the reduction in two blocks.
    for (int K : {1, 37, 2100})
      for (auto [ta, tb] : {std::pair<char, char>{'N', 'N'}, {'N', 'T'}, {'T', 'N'}}) {
        int const Mr = 29, N = 71;
        M A("A", ta == 'N' ? Mr : K, ta == 'N' ? K : Mr), B("B", tb == 'N' ? K : N, tb == 'N' ? N : K), C("C", Mr, N), C0("C0", Mr, N);
        fill(A);
        fill(B);
        fill(C0);
        std::vector<float> scratch(static_cast<std::size_t>(Mr) * K);
        INFO(isa << " " << ta << tb << " K = " << K);
        for (float beta : {0.0f, 1.0f}) {
          Kokkos::deep_copy(C, C0);
          Experts::Impl::host_gemm(HExec(), table, ta, tb, A, B, beta, C, scratch.data());
          double worst = 0;
          for (int i = 0; i < Mr; ++i)
            for (int j = 0; j < N; ++j) {
              double want = beta * C0(i, j);
              for (int k = 0; k < K; ++k) want += at(A, ta, i, k) * at(B, tb == 'N' ? 'N' : 'T', k, j);
              worst = std::max(worst, std::abs(C(i, j) - want) / (std::sqrt(static_cast<double>(K)) + std::abs(want)));
            }
          CHECK(worst <= 5e-6);  // sequential FP32 sums of up to 2100 products
        }
        // Rows 3..9 alone: the same bits as in the whole product.
        if (ta == 'N') {
          auto rows = std::make_pair(3, 10);
          M Cpart("Cpart", 7, N);
          Experts::Impl::host_gemm(HExec(), table, ta, tb, Kokkos::subview(A, rows, Kokkos::ALL), B, 0.0f, Cpart, nullptr);
          Experts::Impl::host_gemm(HExec(), table, ta, tb, A, B, 0.0f, C, scratch.data());
          bool same = true;
          for (int i = 0; i < 7; ++i)
            for (int j = 0; j < N; ++j) same = same && std::memcmp(&Cpart(i, j), &C(i + 3, j), sizeof(float)) == 0;
          CHECK(same);
        }
      }
  }
  // TT is not a product the backward needs: refused, as is a beta other than 0 or 1.
  M A("A", 4, 4), C("C", 4, 4);
  auto const& table = Experts::Impl::host_kernel_table();
  CHECK_THROWS_WITH(Experts::Impl::host_gemm(HExec(), table, 'T', 'T', A, A, 0.0f, C, nullptr), Catch::Matchers::Contains("not supported"));
  CHECK_THROWS_WITH(Experts::Impl::host_gemm(HExec(), table, 'N', 'N', A, A, 0.5f, C, nullptr), Catch::Matchers::Contains("beta 0.5"));
}

TEST_CASE("expert backward on the host micro-kernels equals the BLAS path", "[experts][backward]") {
  if (!Experts::Impl::is_host_exec<Exec>()) return;
  ThreeExperts e(96, 80, {70, 0, 63}, 8, 4);
  auto const& [w, offsets, X, dY, Y, dX1, dX2] = e;
  BackwardOptions blas;
  blas.gemm_path = GemmPath::generic;
  Backward<Exec, Mem> host_bw, blas_bw(blas);
  SavedActivations<Mem> saved;
  host_bw.forward_keep(Exec(), w, X, offsets, Y, saved);
  ExpertGradients<Mem> g1(w), g2(w);
  auto const l1 = host_bw.backward(Exec(), w, X, offsets, dY, dX1, g1, saved);
  auto const l2 = blas_bw.backward(Exec(), w, X, offsets, dY, dX2, g2, saved);
  bool const vector_isa = std::string(Experts::Impl::host_kernel_table().isa) != "generic";
  CHECK(l1.path == (vector_isa ? "swiglu[host:" + std::string(Experts::Impl::host_kernel_table().isa) + ",saved]" : "swiglu[KokkosKernels,saved]"));
  CHECK(l2.path == "swiglu[generic,saved]");
  auto close = [](std::vector<double> const& a, std::vector<double> const& b) {
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1.0));
    return worst;
  };
  CHECK(close(host_doubles(dX1), host_doubles(dX2)) <= 1e-5);
  CHECK(close(host_doubles(g1.gate), host_doubles(g2.gate)) <= 1e-5);
  CHECK(close(host_doubles(g1.up), host_doubles(g2.up)) <= 1e-5);
  CHECK(close(host_doubles(g1.down), host_doubles(g2.down)) <= 1e-5);
}
