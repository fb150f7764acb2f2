// reproducible_atb_sum: the sum over all ranks' rows of A^T B has the same
// bits as one rank holding every row (any split in whole blocks), is within
// FP32 rounding of the fp64 sum, and a NaN term makes its element NaN on
// every rank.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_ReproducibleSum.hpp>

#include <cmath>
#include <random>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using Mat = Kokkos::View<float**, Kokkos::LayoutRight, MS>;

namespace {

/// Row t of a matrix with `cols` columns and values over many magnitudes.
std::vector<float> rows_of(index_t first, index_t n, int cols, unsigned seed) {
  std::vector<float> v;
  for (index_t t = first; t < first + n; ++t) {
    std::mt19937 rng(seed + static_cast<unsigned>(t) * 7919u);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> ex(-12, 12);
    for (int c = 0; c < cols; ++c) v.push_back(std::ldexp(u(rng), ex(rng)));
  }
  return v;
}

Mat device(std::vector<float> const& v, index_t n, int cols) {
  Mat m("m", n, cols);
  auto h = Kokkos::create_mirror_view(m);
  std::copy(v.begin(), v.end(), h.data());
  Kokkos::deep_copy(m, h);
  return m;
}

std::vector<float> host(Mat const& m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  return std::vector<float>(h.data(), h.data() + h.size());
}

}  // namespace

TEST_CASE("reproducible A^T B sums: the same bits for every split of the rows", "[core][reproducible]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  int const m = 7, k = 13, block = 4;
  index_t const T = 12, N = T * size;  // 3 blocks per rank
  Exec exec;
  auto const a = rows_of(rank * T, T, m, 1), b = rows_of(rank * T, T, k, 2);
  Mat C("C", m, k), C1("C1", m, k);
  reproducible_atb_sum(exec, device(a, T, m), device(b, T, k), C, block, MPI_COMM_WORLD, 60.0);
  auto const a1 = rows_of(0, N, m, 1), b1 = rows_of(0, N, k, 2);
  reproducible_atb_sum(exec, device(a1, N, m), device(b1, N, k), C1, block, MPI_COMM_SELF, 60.0);
  auto const got = host(C), want = host(C1);
  CHECK(kmoe_test::same_bits(got, want));
  // Against the fp64 sum: within FP32 rounding of the result.
  double worst = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j) {
      double s = 0, mag = 0;
      for (index_t t = 0; t < N; ++t) {
        double const p = static_cast<double>(a1[static_cast<std::size_t>(t * m + i)]) * b1[static_cast<std::size_t>(t * k + j)];
        s += p;
        mag += std::fabs(p);
      }
      worst = std::max(worst, std::fabs(got[static_cast<std::size_t>(i * k + j)] - s) / (mag + 1e-30));
    }
  INFO("largest error relative to sum |a b|: " << worst);
  CHECK(worst < 1e-6);
  // A NaN on the last rank: its column is NaN everywhere, the rest unchanged.
  auto bad = b;
  if (rank == size - 1) bad[0] = std::numeric_limits<float>::quiet_NaN();
  Mat C2("C2", m, k);
  reproducible_atb_sum(exec, device(a, T, m), device(bad, T, k), C2, block, MPI_COMM_WORLD, 60.0);
  auto const with_nan = host(C2);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j) {
      float const v = with_nan[static_cast<std::size_t>(i * k + j)];
      if (j == 0)
        CHECK(std::isnan(v));
      else
        CHECK(v == got[static_cast<std::size_t>(i * k + j)]);
    }
}
