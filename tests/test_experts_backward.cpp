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

/// The same offsets on the host.
std::vector<index_t> prefix_of(std::vector<index_t> const& counts) {
  std::vector<index_t> offs(1, 0);
  for (index_t c : counts) offs.push_back(offs.back() + c);
  return offs;
}

/// v rounded to bf16 (nearest even), as a double.
double round16(double v) { return static_cast<double>(to_float(to_bf16(static_cast<float>(v)))); }

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
  std::vector<index_t> const offs = prefix_of(counts);
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

TEST_CASE("host micro-kernel GEMMs with bf16 rows on the pair kernels: NN, NT and TN against fp64", "[experts][backward]") {
  using HExec = Kokkos::DefaultHostExecutionSpace;
  using M = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;
  using M16 = Kokkos::View<bf16_t**, Kokkos::LayoutRight, Kokkos::HostSpace>;
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // A in bf16; B in FP32 with values off the bf16 grid (rounded to nearest
  // even as they are staged) or in bf16.
  bool any = false;
  for (auto const& isa : Experts::Impl::host_kernel_isas()) {
    auto const& table = Experts::Impl::host_kernel_table(isa);
    if (table.dp[1] == nullptr) {
      // Without the pair kernels bf16 rows are refused with the reason.
      M16 A("A", 4, 4);
      M B("B", 4, 4), C("C", 4, 4);
      CHECK_THROWS_WITH(Experts::Impl::host_gemm(HExec(), table, 'N', 'N', A, B, 0.0f, C, nullptr),
                        Catch::Matchers::Contains("pair dot-product kernels"));
      continue;
    }
    any = true;
    // Odd K: a last half pair; K = 2100: two blocks, the second of 52.
    for (int K : {1, 37, 2100})
      for (auto [ta, tb] : {std::pair<char, char>{'N', 'N'}, {'N', 'T'}, {'T', 'N'}})
        for (bool b16 : {false, true}) {
          int const Mr = 29, N = 71;
          M16 A("A", ta == 'N' ? Mr : K, ta == 'N' ? K : Mr);
          M B("B", tb == 'N' ? K : N, tb == 'N' ? N : K), C("C", Mr, N), C0("C0", Mr, N);
          M16 B16("B16", B.extent(0), B.extent(1));
          for (std::size_t i = 0; i < A.extent(0); ++i)
            for (std::size_t j = 0; j < A.extent(1); ++j) A(i, j) = to_bf16(u(rng));
          for (std::size_t i = 0; i < B.extent(0); ++i)
            for (std::size_t j = 0; j < B.extent(1); ++j) B16(i, j) = to_bf16(B(i, j) = u(rng));
          for (int i = 0; i < Mr; ++i)
            for (int j = 0; j < N; ++j) C0(i, j) = u(rng);
          std::vector<bf16_t> scratch(static_cast<std::size_t>(Mr) * K);
          INFO(isa << " " << ta << tb << " K = " << K << (b16 ? " bf16 B" : " FP32 B"));
          for (float beta : {0.0f, 1.0f}) {
            Kokkos::deep_copy(C, C0);
            if (b16)
              Experts::Impl::host_gemm(HExec(), table, ta, tb, A, B16, beta, C, scratch.data());
            else
              Experts::Impl::host_gemm(HExec(), table, ta, tb, A, B, beta, C, scratch.data());
            double worst = 0;
            for (int i = 0; i < Mr; ++i)
              for (int j = 0; j < N; ++j) {
                double want = beta * C0(i, j);
                for (int k = 0; k < K; ++k) {
                  double const a = to_float(ta == 'N' ? A(i, k) : A(k, i));
                  want += a * round16(tb == 'N' ? B(k, j) : B(j, k));
                }
                worst = std::max(worst, std::abs(C(i, j) - want) / (std::sqrt(static_cast<double>(K)) + std::abs(want)));
              }
            CHECK(worst <= 5e-6);  // exact bf16 products, FP32 sums
          }
          if (ta == 'N') {
            // Rows 3..9 alone: the same bits as in the whole product.
            auto rows = std::make_pair(3, 10);
            M Cpart("Cpart", 7, N);
            Experts::Impl::host_gemm(HExec(), table, ta, tb, Kokkos::subview(A, rows, Kokkos::ALL), B, 0.0f, Cpart, nullptr);
            Experts::Impl::host_gemm(HExec(), table, ta, tb, A, B, 0.0f, C, nullptr);
            bool same = true;
            for (int i = 0; i < 7; ++i)
              for (int j = 0; j < N; ++j) same = same && std::memcmp(&Cpart(i, j), &C(i + 3, j), sizeof(float)) == 0;
            CHECK(same);
          }
        }
  }
  if (!any) WARN("no CPU kernels with bf16 pair dot products here: only the refusal was checked");
}

namespace {

/// The backward with bf16 products in fp64: X, dY and the weights on the
/// bf16 grid, H, dG and dU rounded to bf16 where the products read them,
/// everything else exact. Returns dX, dW1, dW2, dW3 flattened.
struct Bf16Emulation {
  std::vector<double> dX, gate, up, down;
};
Bf16Emulation emulate_bf16_backward(int L, int d, int dff, std::vector<index_t> const& offs, std::vector<double> const& X,
                                    std::vector<double> const& dY, std::vector<double> const& W1, std::vector<double> const& W3,
                                    std::vector<double> const& W2) {
  index_t const n = offs.back();
  Bf16Emulation e;
  e.dX.assign(static_cast<std::size_t>(n) * d, 0.0);
  e.gate.assign(static_cast<std::size_t>(L) * dff * d, 0.0);
  e.up.assign(e.gate.size(), 0.0);
  e.down.assign(static_cast<std::size_t>(L) * d * dff, 0.0);
  for (int q = 0; q < L; ++q)
    for (index_t r = offs[q]; r < offs[q + 1]; ++r) {
      double const* x = &X[static_cast<std::size_t>(r) * d];
      double const* dy = &dY[static_cast<std::size_t>(r) * d];
      for (int j = 0; j < dff; ++j) {
        double g = 0, uu = 0, dh = 0;
        std::size_t const wj = (static_cast<std::size_t>(q) * dff + j) * d;
        for (int k = 0; k < d; ++k) {
          g += x[k] * W1[wj + k];
          uu += x[k] * W3[wj + k];
          dh += dy[k] * W2[(static_cast<std::size_t>(q) * d + k) * dff + j];
        }
        double const s = 1.0 / (1.0 + std::exp(-g));
        double const h16 = round16(g * s * uu);
        double const dg16 = round16(dh * uu * s * (1.0 + g * (1.0 - s))), du16 = round16(dh * g * s);
        for (int k = 0; k < d; ++k) {
          e.dX[static_cast<std::size_t>(r) * d + k] += dg16 * W1[wj + k] + du16 * W3[wj + k];
          e.gate[wj + k] += dg16 * x[k];
          e.up[wj + k] += du16 * x[k];
          e.down[(static_cast<std::size_t>(q) * d + k) * dff + j] += dy[k] * h16;
        }
      }
    }
  return e;
}

/// Largest |a - b| over the rms of b.
double scaled_error(std::vector<double> const& a, std::vector<double> const& b) {
  double rms = 0, worst = 0;
  for (double v : b) rms += v * v;
  rms = std::sqrt(rms / static_cast<double>(std::max<std::size_t>(1, b.size())));
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst / std::max(rms, 1e-30);
}

/// Whether bf16 products run on this build with `path`: the host pair
/// kernels (automatic path on a CPU that has them), a vendor GEMM with bf16
/// operands (cuBLAS, automatic path on a device), or the portable GEMM
/// (generic path).
bool bf16_products_run(GemmPath path) {
  if (path == GemmPath::generic) return true;
  if (path != GemmPath::automatic) return false;
  if constexpr (Experts::Impl::is_host_exec<Exec>())
    return std::string(Experts::Impl::host_kernel_table().isa) != "generic" && Experts::Impl::host_kernel_table().dp[1] != nullptr;
  else
    return have_vendor_gemm<Exec, bf16_t, float>();
}

}  // namespace

TEST_CASE("expert backward with bf16 products: the bf16 numerics, FP32 accumulation", "[experts][backward]") {
  // Odd d (a half pair at the end of every dY and X row), an empty and a
  // one-row segment; bf16 weights and rows, so that X, dY and W are exact.
  int const d = 37, dff = 50;
  std::vector<index_t> const counts{5, 0, 17, 1};
  int const L = static_cast<int>(counts.size());
  ExpertWeights<bf16_t, Mem> w("w", {0, 1, 2, 3}, d, dff);
  w.randomize(Exec(), 13);
  std::vector<index_t> const offs = prefix_of(counts);
  index_t const n = offs.back();
  auto const offsets = offsets_of(counts);
  std::mt19937 rng(29);
  auto X = random_rows<bf16_t>(n, d, rng, 1.0f);
  auto dY = random_rows<bf16_t>(n, d, rng, 1.0f);
  auto const want = emulate_bf16_backward(L, d, dff, offs, host_doubles(X), host_doubles(dY), host_doubles(w.gate()),
                                          host_doubles(w.up()), host_doubles(w.down()));
  // The host micro-kernels (automatic path), and the portable GEMM with
  // bf16 operands segment by segment (generic path: the form a vendor GEMM
  // with bf16 operands takes on a GPU).
  for (auto [keep, path] : {std::pair<bool, GemmPath>{false, GemmPath::automatic}, {true, GemmPath::automatic}, {false, GemmPath::generic},
                            {true, GemmPath::generic}}) {
    BackwardOptions o, o32;
    o.products = BackwardProducts::bf16;
    o.gemm_path = o32.gemm_path = path;
    bool const pairs = bf16_products_run(path);
    Backward<Exec, Mem> bw16(o), bw32(o32);
    RowMatrix<float> dX16("dX16", n, d), dX32("dX32", n, d), Y("Y", n, d);
    ExpertGradients<Mem> g16(w), g32(w);
    SavedActivations<Mem> saved16, saved32;
    if (keep) {
      bw16.forward_keep(Exec(), w, X, offsets, Y, saved16);
      bw32.forward_keep(Exec(), w, X, offsets, Y, saved32);
    }
    auto const l16 = bw16.backward(Exec(), w, X, offsets, dY, dX16, g16, saved16);
    auto const l32 = bw32.backward(Exec(), w, X, offsets, dY, dX32, g32, saved32);
    INFO("keep " << keep << " gemm " << to_string(path) << " paths " << l16.path << " / " << l32.path);
    CHECK((l16.path.size() > 6 && l16.path.substr(l16.path.size() - 6) == ",bf16]") == pairs);
    CHECK(l32.path.find("bf16") == std::string::npos);
    double const e16[] = {scaled_error(host_doubles(dX16), want.dX), scaled_error(host_doubles(g16.gate), want.gate),
                          scaled_error(host_doubles(g16.up), want.up), scaled_error(host_doubles(g16.down), want.down)};
    double const e32[] = {scaled_error(host_doubles(dX32), want.dX), scaled_error(host_doubles(g32.gate), want.gate),
                          scaled_error(host_doubles(g32.up), want.up), scaled_error(host_doubles(g32.down), want.down)};
    for (int t = 0; t < 4; ++t) {
      INFO("gradient " << t << ": bf16 products " << e16[t] << ", FP32 products " << e32[t]);
      if (pairs) {
        // The bf16 products follow the emulation to FP32 rounding (and the odd
        // bf16 rounding of H, dG or dU that FP32 sums put on the other side);
        // the products' sums run in another order on each path.
        CHECK(e16[t] <= 2e-3);
      } else {
        CHECK(e16[t] == e32[t]);
      }
    }
    if (pairs) {
      // FP32 products do not round H, dG and dU: further from the emulation.
      for (int t = 0; t < 4; ++t) CHECK(e32[t] > 4 * e16[t]);
    }
  }
}

TEST_CASE("the kept forward with bf16 products: X and H rounded to bf16, FP32 sums, on every route", "[experts][backward]") {
  // FP32 rows (rounded as the products read them), FP32 or bf16 weights, an
  // odd d, an empty and a one-row segment.
  int const d = 37, dff = 50;
  std::vector<index_t> const counts{5, 0, 17, 1};
  int const L = static_cast<int>(counts.size());
  std::vector<index_t> const offs = prefix_of(counts);
  index_t const n = offs.back();
  auto const offsets = offsets_of(counts);
  std::mt19937 rng(31);
  auto X = random_rows<float>(n, d, rng, 1.0f);
  auto rounded = [&](std::vector<double> v) {
    for (double& x : v) x = round16(x);
    return v;
  };
  auto check = [&](auto const& w, char const* weights) {
    // fp64 of the bf16 operands: G, U and Y = round16(silu(G) U) W2^T.
    auto const x = rounded(host_doubles(X)), w1 = rounded(host_doubles(w.gate())), w3 = rounded(host_doubles(w.up())),
               w2 = rounded(host_doubles(w.down()));
    std::vector<double> G(static_cast<std::size_t>(n) * dff), U(G.size()), Y(static_cast<std::size_t>(n) * d, 0.0);
    for (int q = 0; q < L; ++q)
      for (index_t r = offs[q]; r < offs[q + 1]; ++r)
        for (int j = 0; j < dff; ++j) {
          double g = 0, u = 0;
          std::size_t const wj = (static_cast<std::size_t>(q) * dff + j) * d;
          for (int k = 0; k < d; ++k) {
            g += x[static_cast<std::size_t>(r) * d + k] * w1[wj + k];
            u += x[static_cast<std::size_t>(r) * d + k] * w3[wj + k];
          }
          G[static_cast<std::size_t>(r) * dff + j] = g, U[static_cast<std::size_t>(r) * dff + j] = u;
          double const h = round16(g / (1.0 + std::exp(-g)) * u);
          for (int c = 0; c < d; ++c) Y[static_cast<std::size_t>(r) * d + c] += h * w2[(static_cast<std::size_t>(q) * d + c) * dff + j];
        }
    for (GemmPath path : {GemmPath::automatic, GemmPath::generic}) {
      BackwardOptions o16, o32;
      o16.products = BackwardProducts::bf16;
      o16.gemm_path = o32.gemm_path = path;
      Backward<Exec, Mem> bw16(o16), bw32(o32);
      RowMatrix<float> Y16("Y16", n, d), Y32("Y32", n, d);
      SavedActivations<Mem> s16, s32;
      bw16.forward_keep(Exec(), w, X, offsets, Y16, s16);
      bw32.forward_keep(Exec(), w, X, offsets, Y32, s32);
      double const e16[] = {scaled_error(host_doubles(s16.gate), G), scaled_error(host_doubles(s16.up), U),
                            scaled_error(host_doubles(Y16), Y)};
      double const e32[] = {scaled_error(host_doubles(s32.gate), G), scaled_error(host_doubles(s32.up), U),
                            scaled_error(host_doubles(Y32), Y)};
      for (int t = 0; t < 3; ++t) {
        INFO("gemm " << to_string(path) << ", " << weights << " weights, output " << t << " (G, U, Y): bf16 products " << e16[t] << ", FP32 products " << e32[t]);
        if (bf16_products_run(path)) {
          // Exact bf16 products summed in FP32 (G, U); Y also meets the odd
          // bf16 rounding of H that FP32 sums put on the other side.
          CHECK(e16[t] <= (t < 2 ? 1e-5 : 2e-3));
          // FP32 products read X unrounded: further from the emulation.
          CHECK(e32[t] > 4 * e16[t]);
        } else {
          CHECK(e16[t] == e32[t]);
        }
      }
    }
  };
  ExpertWeights<float, Mem> w32("w32", {0, 1, 2, 3}, d, dff);
  w32.randomize(Exec(), 17);
  check(w32, "fp32");
  ExpertWeights<bf16_t, Mem> w16("w16", {0, 1, 2, 3}, d, dff);
  w16.randomize(Exec(), 19);
  check(w16, "bf16");
}

TEST_CASE("host element-wise SwiGLU backward: fp64 values over the whole range, bf16 outputs rounded, dG over dH", "[experts][backward]") {
  // Arguments across the range (saturating sigmoid at both ends included).
  std::vector<float> g, u, dh;
  for (int i = -4000; i <= 4000; ++i) {
    g.push_back(static_cast<float>(i) * 0.0237f);  // -94.8 .. 94.8
    u.push_back(0.75f - static_cast<float>(i % 7) * 0.31f);
    dh.push_back(static_cast<float>(i % 11) * 0.17f - 0.8f);
  }
  std::size_t const n = g.size();
  bool any = false;
  for (auto const& isa : Experts::Impl::host_kernel_isas()) {
    auto const& table = Experts::Impl::host_kernel_table(isa);
    if (table.swiglu_backward_f32 == nullptr) continue;
    any = true;
    INFO(isa);
    std::vector<float> h(n), dg(n), du(n);
    table.swiglu_backward_f32(n, g.data(), u.data(), dh.data(), h.data(), dg.data(), du.data());
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double const x = g[i], s = 1.0 / (1.0 + std::exp(-x)), silu = x * s, dsilu = s * (1.0 + x * (1.0 - s));
      double const want[3] = {silu * u[i], dh[i] * u[i] * dsilu, dh[i] * silu};
      // silu'(g) = s + g s (1 - s) cancels near g = -1.28: relative to its terms.
      double const scale[3] = {std::abs(want[0]), std::abs(dh[i] * u[i]) * (s + std::abs(x) * s * (1.0 - s)), std::abs(want[2])};
      double const got[3] = {h[i], dg[i], du[i]};
      for (int k = 0; k < 3; ++k) worst = std::max(worst, std::abs(got[k] - want[k]) / (scale[k] + 1e-30));
    }
    CHECK(worst <= 1e-5);  // a few FP32 roundings of each term (3.6e-6 measured)
    // bf16 outputs: the FP32 values rounded to nearest even.
    std::vector<std::uint16_t> h16(n), dg16(n), du16(n);
    table.swiglu_backward_bf16(n, g.data(), u.data(), dh.data(), h16.data(), dg16.data(), du16.data());
    bool rounded = true;
    for (std::size_t i = 0; i < n; ++i)
      rounded = rounded && h16[i] == to_bf16(h[i]).bits && dg16[i] == to_bf16(dg[i]).bits && du16[i] == to_bf16(du[i]).bits;
    CHECK(rounded);
    // dG written over dH: the same values.
    std::vector<float> inplace = dh;
    table.swiglu_backward_f32(n, g.data(), u.data(), inplace.data(), h.data(), inplace.data(), du.data());
    CHECK(std::memcmp(inplace.data(), dg.data(), n * sizeof(float)) == 0);
  }
  CHECK(any);
}

TEST_CASE("row-major grouped products map onto column-major problems (the cuBLAS grouped calls)", "[experts][backward]") {
  // A column-major BLAS executed on the host: C(i, j) = c[i + j ldc].
  auto column_gemm = [](Experts::Impl::ColumnProblem const& p) {
    auto const* a = static_cast<float const*>(p.a);
    auto const* b = static_cast<float const*>(p.b);
    auto* c = static_cast<float*>(p.c);
    for (int j = 0; j < p.n; ++j)
      for (int i = 0; i < p.m; ++i) {
        double sum = 0;
        for (int k = 0; k < p.k; ++k) {
          double const av = p.opa == 'N' ? a[i + static_cast<long>(k) * p.lda] : a[k + static_cast<long>(i) * p.lda];
          double const bv = p.opb == 'N' ? b[k + static_cast<long>(j) * p.ldb] : b[j + static_cast<long>(k) * p.ldb];
          sum += av * bv;
        }
        float& out = c[i + static_cast<long>(j) * p.ldc];
        out = static_cast<float>(sum + p.beta * out);
      }
  };
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto [ta, tb] : {std::pair<char, char>{'N', 'N'}, {'N', 'T'}, {'T', 'N'}})
    for (float beta : {0.0f, 1.0f}) {
      int const M = 7, N = 11, K = 5, pad = 3;  // row strides wider than the rows
      int const ar = ta == 'N' ? M : K, ac = ta == 'N' ? K : M, br = tb == 'N' ? K : N, bc = tb == 'N' ? N : K;
      std::vector<float> A(static_cast<std::size_t>(ar) * (ac + pad)), B(static_cast<std::size_t>(br) * (bc + pad)),
          C(static_cast<std::size_t>(M) * (N + pad));
      for (auto* v : {&A, &B, &C})
        for (auto& x : *v) x = u(rng);
      std::vector<float> const C0 = C;
      Experts::Impl::RowProduct p;
      p.ta = ta, p.tb = tb, p.M = M, p.N = N, p.K = K;
      p.A = A.data(), p.lda = ac + pad, p.B = B.data(), p.ldb = bc + pad, p.C = C.data(), p.ldc = N + pad, p.beta = beta;
      column_gemm(Experts::Impl::column_major(p));
      double worst = 0;
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
          double want = beta * C0[static_cast<std::size_t>(i) * p.ldc + j];
          for (int k = 0; k < K; ++k) {
            double const a = ta == 'N' ? A[static_cast<std::size_t>(i) * p.lda + k] : A[static_cast<std::size_t>(k) * p.lda + i];
            double const b = tb == 'N' ? B[static_cast<std::size_t>(k) * p.ldb + j] : B[static_cast<std::size_t>(j) * p.ldb + k];
            want += a * b;
          }
          worst = std::max(worst, std::abs(C[static_cast<std::size_t>(i) * p.ldc + j] - want));
        }
      INFO(ta << tb << " beta " << beta);
      CHECK(worst <= 1e-5);
      // The padding columns of C are untouched.
      bool pad_kept = true;
      for (int i = 0; i < M; ++i)
        for (int j = N; j < N + pad; ++j) pad_kept = pad_kept && C[static_cast<std::size_t>(i) * p.ldc + j] == C0[static_cast<std::size_t>(i) * p.ldc + j];
      CHECK(pad_kept);
    }
}

TEST_CASE("grouped vendor operands: the alignment the device-side pointer arrays promise", "[experts][backward]") {
  using Experts::Impl::grouped_operand_aligned;
  CHECK(grouped_operand_aligned(0x1000));
  CHECK(grouped_operand_aligned(0x1010));
  CHECK_FALSE(grouped_operand_aligned(0x1008));
  CHECK_FALSE(grouped_operand_aligned(0x1002));
  // The forward's phase 1 with bf16 d = 24, f = 20: the up half of row b of
  // [G | U] starts 2 (2 b f + f) bytes in, 8 mod 16 for every b (those
  // problems go one cublasGemmEx each), while the gate half and the rows of
  // X keep 16 bytes.
  constexpr std::uintptr_t bf16 = 2, gu = 0x10000, x = 0x20000;
  constexpr std::uintptr_t d = 24, f = 20;
  bool up_aligned = false, gate_aligned = true, x_aligned = true;
  for (std::uintptr_t b = 0; b < 8; ++b) {
    up_aligned = up_aligned || grouped_operand_aligned(gu + (2 * b * f + f) * bf16);
    gate_aligned = gate_aligned && grouped_operand_aligned(gu + 2 * b * f * bf16);
    x_aligned = x_aligned && grouped_operand_aligned(x + b * d * bf16);
  }
  CHECK_FALSE(up_aligned);
  CHECK(gate_aligned);
  CHECK(x_aligned);
}
