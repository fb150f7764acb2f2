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

namespace {

/// Term j of rank r: n elements over many magnitudes, with ties at the
/// scale (element 1), subnormal floats (element 2), zeros (element 3).
std::vector<float> term_of(int r, int j, std::size_t n, int terms) {
  std::mt19937 rng(1000u + static_cast<unsigned>(r) * 31u + static_cast<unsigned>(j));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-30, 30);
  std::vector<float> v(n);
  for (auto& x : v) x = std::ldexp(u(rng), ex(rng));
  // Element 1: bound 1 from rank 0's terms 0 (+1) and 1 (-1), which cancel;
  // the rest odd multiples of half the scale's unit, so that every one is a
  // tie, rounded to even (1.5 -> 2, 2.5 -> 2), and the rounding shows in
  // the sum.
  int const scale = 61 - static_cast<int>(std::ceil(std::log2(static_cast<double>(terms)))) - 2;
  if (r == 0 && j < 2)
    v[1] = j == 0 ? 1.0f : -1.0f;
  else
    v[1] = static_cast<float>(std::ldexp(2.0 * (1 + (r * 7 + j) % 4) + 1.0, -(scale + 1)));
  v[2] = std::ldexp(1.0f + static_cast<float>(j), -140 - r);
  v[3] = 0.0f;
  return v;
}

}  // namespace

TEST_CASE("fixed-point sums: the accumulation in the views' memory follows the scale rule bit for bit", "[core][reproducible]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  std::size_t const n = 257;
  int const per_rank = 3, terms = per_rank * size;
  Exec exec;
  Workspace<MS> ws;
  // The rule on the host, from every rank's terms: bound = the largest finite
  // magnitude; scale 2^e with e = 61 - ceil(log2 terms) - x where 2 bound <
  // 2^x (std::frexp); each term rounded to nearest at the scale (std::ldexp,
  // std::nearbyint); the integer sums converted back once.
  std::vector<double> bound(n, 0.0);
  for (int r = 0; r < size; ++r)
    for (int j = 0; j < per_rank; ++j) {
      auto const t = term_of(r, j, n, terms);
      for (std::size_t e = 0; e < n; ++e)
        if (std::isfinite(t[e])) bound[e] = std::max(bound[e], std::fabs(static_cast<double>(t[e])));
    }
  int const headroom = 61 - static_cast<int>(std::ceil(std::log2(static_cast<double>(terms))));
  std::vector<int> expo(n, 0);
  for (std::size_t e = 0; e < n; ++e)
    if (bound[e] > 0) {
      int x = 0;
      std::frexp(2.0 * bound[e], &x);
      expo[e] = headroom - x;
    }
  std::vector<std::int64_t> acc(n, 0);
  for (int r = 0; r < size; ++r)
    for (int j = 0; j < per_rank; ++j) {
      auto const t = term_of(r, j, n, terms);
      for (std::size_t e = 0; e < n; ++e) acc[e] += static_cast<std::int64_t>(std::nearbyint(std::ldexp(static_cast<double>(t[e]), expo[e])));
    }
  std::vector<float> want(n);
  for (std::size_t e = 0; e < n; ++e) want[e] = static_cast<float>(std::ldexp(static_cast<double>(acc[e]), -expo[e]));

  // Twice on one workspace: the second sum starts from zero again.
  for (int pass = 0; pass < 2; ++pass) {
    FixedPointSum<MS> sum(exec, n, &ws, "test_sum");
    std::vector<Kokkos::View<float*, MS>> mine;
    for (int j = 0; j < per_rank; ++j) {
      auto const t = term_of(rank, j, n, terms);
      // Two pieces at their element offsets, as a gradient's parts are added.
      Kokkos::View<float*, MS> v("term", n);
      copy_from_host(exec, t, v);
      mine.push_back(v);
      sum.observe(exec, Kokkos::subview(v, std::make_pair(std::size_t(0), std::size_t(100))), 0);
      sum.observe(exec, Kokkos::subview(v, std::make_pair(std::size_t(100), n)), 100);
    }
    sum.agree_scale(exec, MPI_COMM_WORLD, per_rank, 60.0);
    for (auto const& v : mine) sum.add(exec, v);
    auto const got = copy_to_host(exec, sum.result(exec, MPI_COMM_WORLD, 60.0));
    INFO("pass " << pass);
    CHECK(kmoe_test::same_bits(got, want));
    CHECK(got[3] == 0.0f);
    // A NaN term on the last rank: that element only, on every rank.
    FixedPointSum<MS> with_nan(exec, n, &ws, "test_sum");
    for (auto const& v : mine) with_nan.observe(exec, v);
    with_nan.agree_scale(exec, MPI_COMM_WORLD, per_rank, 60.0);
    if (rank == size - 1) {
      auto t = copy_to_host(exec, mine[0]);
      t[5] = std::numeric_limits<float>::infinity();
      copy_from_host(exec, t, mine[0]);
    }
    for (auto const& v : mine) with_nan.add(exec, v);
    auto const nan_got = copy_to_host(exec, with_nan.result(exec, MPI_COMM_WORLD, 60.0));
    CHECK(std::isnan(nan_got[5]));
    CHECK(nan_got[4] == got[4]);
  }
  // Misplaced terms are refused, naming the offset.
  FixedPointSum<MS> small(exec, 4, &ws, "test_small");
  Kokkos::View<float*, MS> five("five", 5);
  CHECK_THROWS_WITH(small.observe(exec, five), Catch::Matchers::Contains("5 terms at element 0 of 4"));
  CHECK_THROWS_WITH(small.add(exec, five), Catch::Matchers::Contains("add() before agree_scale()"));
  Kokkos::View<float**, Kokkos::LayoutRight, MS> wide("wide", 4, 3);
  CHECK_THROWS_WITH(small.observe(exec, Kokkos::subview(wide, Kokkos::ALL, 1)), Catch::Matchers::Contains("not contiguous (stride 3)"));
}
