// GEMM wrapper: Kokkos Kernels and the portable kernel agree with an fp64
// host reference on Kokkos Kernels' own test shapes, every transpose, and
// bf16 operands; bad extents are rejected with every extent named.

#include "kmoe_catch.hpp"

#include <KokkosMoE_Gemm.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace KokkosMoE;

namespace {

template <class T>
RowMatrix<T> random_matrix(int r, int c, std::mt19937& rng) {
  RowMatrix<T> M("M", r, c);
  auto h = Kokkos::create_mirror_view(M);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) h(i, j) = from_float<T>(u(rng));
  Kokkos::deep_copy(M, h);
  return M;
}

template <class T>
double at(typename RowMatrix<T>::HostMirror const& h, bool t, int i, int j) {
  return static_cast<double>(to_float(t ? h(j, i) : h(i, j)));
}

template <class TA, class TC>
void check_case(int m, int n, int k, char ta, char tb, GemmPath path, std::mt19937& rng) {
  bool const a_t = ta == 'T', b_t = tb == 'T';
  auto A = random_matrix<TA>(a_t ? k : m, a_t ? m : k, rng);
  auto B = random_matrix<TA>(b_t ? n : k, b_t ? k : n, rng);
  auto C = random_matrix<TC>(m, n, rng);
  auto hA = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), A);
  auto hB = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), B);
  // A real copy (a mirror *view* would alias C on host backends).
  auto hC0 = Kokkos::create_mirror(C);
  Kokkos::deep_copy(hC0, C);
  float const alpha = 1.5f, beta = 0.5f;
  gemm(Kokkos::DefaultExecutionSpace(), ta, tb, alpha, A, B, beta, C, path);
  auto hC = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
  double worst = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = 0;
      for (int p = 0; p < k; ++p) ref += at<TA>(hA, a_t, i, p) * at<TA>(hB, b_t, p, j);
      ref = alpha * ref + beta * static_cast<double>(to_float(hC0(i, j)));
      double const tol = 1e-5 * (k + 1) + (std::is_same<TC, bf16_t>::value ? 8e-3 * std::fabs(ref) + 1e-3 : 0.0);
      worst = std::max(worst, std::fabs(static_cast<double>(to_float(hC(i, j))) - ref) - tol);
    }
  INFO("m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb);
  CHECK(worst <= 0.0);
}

}  // namespace

TEST_CASE("gemm agrees with an fp64 reference on odd shapes", "[gemm]") {
  std::mt19937 rng(7);
  struct Shape {
    int m, n, k;
  };
  for (Shape s : {Shape{0, 0, 0}, Shape{50, 1, 40}, Shape{13, 15, 17}, Shape{12, 3071, 517}, Shape{5, 7, 0}, Shape{1, 1, 1},
                  Shape{65, 33, 129}}) {
    for (char ta : {'N', 'T'})
      for (char tb : {'N', 'T'}) {
        check_case<float, float>(s.m, s.n, s.k, ta, tb, GemmPath::generic, rng);
        check_case<float, float>(s.m, s.n, s.k, ta, tb, GemmPath::automatic, rng);
      }
  }
}

TEST_CASE("gemm with bf16 operands accumulates in FP32", "[gemm][bf16]") {
  std::mt19937 rng(11);
  check_case<bf16_t, float>(37, 29, 300, 'N', 'T', GemmPath::automatic, rng);
  check_case<bf16_t, bf16_t>(16, 40, 64, 'N', 'T', GemmPath::generic, rng);
  // k = 0: C = beta * C on every path.
  for (GemmPath path : {GemmPath::automatic, GemmPath::generic}) {
    check_case<bf16_t, float>(5, 7, 0, 'N', 'N', path, rng);
    check_case<bf16_t, bf16_t>(6, 3, 0, 'T', 'T', path, rng);
  }
}

TEST_CASE("gemm rejects mismatched extents and unavailable paths", "[gemm]") {
  RowMatrix<float> A("A", 4, 5), B("B", 6, 5), C("C", 4, 7);
  Kokkos::DefaultExecutionSpace exec;
  CHECK_THROWS_WITH(gemm(exec, 'N', 'T', 1.0f, A, B, 0.0f, C),
                    Catch::Matchers::Contains("op(A) is 4x5, op(B) is 5x6, C is 4x7"));
  CHECK_THROWS_WITH(gemm(exec, 'X', 'T', 1.0f, A, B, 0.0f, C), Catch::Matchers::Contains("must be 'N' or 'T'"));
  RowMatrix<bf16_t> Ab("Ab", 4, 5);
  RowMatrix<float> C6("C6", 4, 6);
  CHECK_THROWS_AS(gemm(exec, 'N', 'T', 1.0f, Ab, B, 0.0f, C6, GemmPath::kokkos_kernels), KokkosMoE::Error);
  RowMatrix<bf16_t> Bb("Bb", 6, 5);
  if (!KokkosMoE::Impl::GemmVendor<Kokkos::DefaultExecutionSpace, RowMatrix<bf16_t>, RowMatrix<bf16_t>, RowMatrix<float>>::available)
    CHECK_THROWS_WITH(gemm(exec, 'N', 'T', 1.0f, Ab, Bb, 0.0f, C6, GemmPath::vendor),
                      Catch::Matchers::Contains("the vendor path was requested but this build has no vendor GEMM"));
}

TEST_CASE("vendor gemm (cuBLAS in CUDA builds) agrees with the fp64 reference", "[gemm][vendor]") {
  using Exec = Kokkos::DefaultExecutionSpace;
  if (!KokkosMoE::Impl::GemmVendor<Exec, RowMatrix<bf16_t>, RowMatrix<bf16_t>, RowMatrix<float>>::available) {
    SUCCEED("no vendor GEMM in this build");
    return;
  }
  std::mt19937 rng(13);
  for (char ta : {'N', 'T'})
    for (char tb : {'N', 'T'}) {
      check_case<bf16_t, float>(37, 29, 300, ta, tb, GemmPath::vendor, rng);
      check_case<bf16_t, bf16_t>(65, 33, 129, ta, tb, GemmPath::vendor, rng);
      check_case<float, float>(13, 15, 17, ta, tb, GemmPath::vendor, rng);
      check_case<bf16_t, float>(5, 7, 0, ta, tb, GemmPath::vendor, rng);
      check_case<float, float>(6, 3, 0, ta, tb, GemmPath::vendor, rng);
    }
}
