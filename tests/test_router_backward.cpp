// Router gradients: the gate gradient to logits (softmax and sigmoid scores,
// with and without normalization, route scale) against central finite
// differences of fp64 gates with the selection held fixed; the balance loss
// (Switch/GShard, DeepSeek sequence-wise and device-level) with the
// reference numbers (T = 8, E = 4, top-1, counts [4,2,1,1], mean
// probabilities [0.4,0.3,0.2,0.1]: 1.25, balanced 1.0), a zero gradient for
// a uniform load, finite differences with the hard statistic stopped, and
// the scope: per rank, or pooled over the ranks of a communicator.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_RouterBackward.hpp>

#include <cmath>
#include <random>
#include <vector>

using namespace KokkosMoE;

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using Mat = Kokkos::View<float**, Kokkos::LayoutRight, MS>;
using CMat = Kokkos::View<const float**, Kokkos::LayoutRight, MS>;

Mat device_matrix(std::vector<double> const& v, index_t rows, int cols) {
  Mat m("m", rows, cols);
  auto h = Kokkos::create_mirror_view(m);
  for (index_t r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) h(r, c) = static_cast<float>(v[static_cast<std::size_t>(r * cols + c)]);
  Kokkos::deep_copy(m, h);
  return m;
}

std::vector<double> host_vector(Mat const& m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  return std::vector<double>(h.data(), h.data() + h.size());
}

/// Logits as the floats the library sees, widened back to double.
std::vector<double> random_logits(index_t T, int E, std::mt19937& rng, double spread) {
  std::uniform_real_distribution<float> u(static_cast<float>(-spread), static_cast<float>(spread));
  std::vector<double> z(static_cast<std::size_t>(T * E));
  for (auto& x : z) x = static_cast<double>(u(rng));
  return z;
}

std::vector<double> scores64(std::vector<double> const& z, index_t t, int E, bool softmax, bool normalized) {
  std::vector<double> p(static_cast<std::size_t>(E));
  double sum = 0;
  if (softmax) {
    double m = z[static_cast<std::size_t>(t * E)];
    for (int e = 0; e < E; ++e) m = std::max(m, z[static_cast<std::size_t>(t * E + e)]);
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(z[static_cast<std::size_t>(t * E + e)] - m));
    for (auto& x : p) x /= sum;
  } else {
    for (int e = 0; e < E; ++e) sum += (p[e] = 1.0 / (1.0 + std::exp(-z[static_cast<std::size_t>(t * E + e)])));
    if (normalized)
      for (auto& x : p) x /= sum;
  }
  return p;
}

/// sum_{t,j} dg[t,j] * gate[t,j](z) in fp64 with the experts fixed.
double gate_objective(std::vector<double> const& z, std::vector<int> const& experts, std::vector<double> const& dg, index_t T, int E,
                      int k, RouterConfig const& c) {
  double total = 0;
  for (index_t t = 0; t < T; ++t) {
    auto const p = scores64(z, t, E, c.score == ScoreFunction::softmax, false);
    double S = 0;
    for (int j = 0; j < k; ++j) S += p[static_cast<std::size_t>(experts[static_cast<std::size_t>(t * k + j)])];
    double const denom = c.normalize ? S : 1.0;
    for (int j = 0; j < k; ++j)
      total += dg[static_cast<std::size_t>(t * k + j)] * p[static_cast<std::size_t>(experts[static_cast<std::size_t>(t * k + j)])] /
               denom * c.route_scale;
  }
  return total;
}

template <class F>
std::vector<double> central_differences(std::vector<double> z, F const& f) {
  std::vector<double> g(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    double const keep = z[i], h = 1e-6;
    z[i] = keep + h;
    double const plus = f(z);
    z[i] = keep - h;
    double const minus = f(z);
    z[i] = keep;
    g[i] = (plus - minus) / (2 * h);
  }
  return g;
}

double worst_abs(std::vector<double> const& a, std::vector<double> const& b) {
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(a[i] - b[i]));
  return w;
}

RouterConfig router_config(int E, int k, ScoreFunction score, bool normalize = false) {
  RouterConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.score = score;
  c.normalize = normalize;
  return c;
}

RouteTable<MS> route(RouterConfig const& c, Mat const& logits) {
  Router<MS> router(c);
  RouteTable<MS> table;
  router.route_logits(Exec(), CMat(logits), table);
  return table;
}

std::vector<int> experts_of(RouteTable<MS> const& table) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.expert);
  return std::vector<int>(h.data(), h.data() + h.size());
}

/// fp64 balance loss with q given (stopped): sum over groups of
/// sum_e q[g][e] * mean_t p_{t,e}, averaged over groups.
double balance_objective(std::vector<double> const& z, index_t T, int E, bool softmax, index_t S, std::vector<std::vector<double>> const& q) {
  double total = 0;
  index_t const G = T / S;
  for (index_t g = 0; g < G; ++g)
    for (index_t t = g * S; t < (g + 1) * S; ++t) {
      auto const p = scores64(z, t, E, softmax, true);
      for (int e = 0; e < E; ++e) total += q[static_cast<std::size_t>(g)][static_cast<std::size_t>(e)] * p[static_cast<std::size_t>(e)] / static_cast<double>(S);
    }
  return total / static_cast<double>(G);
}

}  // namespace

TEST_CASE("gate gradients to logits equal finite differences with the selection fixed", "[router][backward]") {
  std::mt19937 rng(5);
  index_t const T = 7;
  int const E = 6, k = 2;
  for (ScoreFunction score : {ScoreFunction::softmax, ScoreFunction::sigmoid})
    for (bool normalize : {false, true}) {
      RouterConfig c = router_config(E, k, score, normalize);
      c.route_scale = 2.5f;
      auto const z = random_logits(T, E, rng, 2.0);
      Mat logits = device_matrix(z, T, E);
      RouteTable<MS> table = route(c, logits);
      std::vector<double> dg(static_cast<std::size_t>(T * k));
      std::uniform_real_distribution<double> u(-1, 1);
      for (auto& x : dg) x = static_cast<double>(static_cast<float>(u(rng)));
      Mat dgate = device_matrix(dg, T, k), dlogits("dlogits", T, E);
      router_backward(Exec(), c, CMat(logits), table, CMat(dgate), dlogits);
      auto const experts = experts_of(table);
      auto const want = central_differences(z, [&](std::vector<double> const& zz) { return gate_objective(zz, experts, dg, T, E, k, c); });
      INFO((score == ScoreFunction::softmax ? "softmax" : "sigmoid") << (normalize ? ", normalized" : ""));
      CHECK(worst_abs(host_vector(dlogits), want) <= 2e-5);
      // accumulate adds a second copy.
      router_backward(Exec(), c, CMat(logits), table, CMat(dgate), dlogits, true);
      auto twice = host_vector(dlogits);
      for (auto& x : twice) x /= 2;
      CHECK(worst_abs(twice, want) <= 2e-5);
    }
}

TEST_CASE("router gradients for many experts (E = 1536): no per-token limit", "[router][backward]") {
  // The kernels recompute scores from the logits on each vector lane; a
  // token's E is bounded by nothing but memory.
  std::mt19937 rng(23);
  index_t const T = 3;
  int const E = 1536, k = 4;
  for (ScoreFunction score : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    RouterConfig const c = router_config(E, k, score, true);
    auto const z = random_logits(T, E, rng, 3.0);
    Mat logits = device_matrix(z, T, E);
    RouteTable<MS> table = route(c, logits);
    auto const experts = experts_of(table);
    std::vector<double> dg(static_cast<std::size_t>(T * k));
    std::uniform_real_distribution<double> u(-1, 1);
    for (auto& x : dg) x = static_cast<double>(static_cast<float>(u(rng)));
    bool const softmax = score == ScoreFunction::softmax;
    INFO((softmax ? "softmax" : "sigmoid"));
    Mat dgate = device_matrix(dg, T, k), dlogits("dlogits", T, E);
    router_backward(Exec(), c, CMat(logits), table, CMat(dgate), dlogits);
    auto const want = central_differences(z, [&](std::vector<double> const& zz) { return gate_objective(zz, experts, dg, T, E, k, c); });
    CHECK(worst_abs(host_vector(dlogits), want) <= 2e-5);
    // The Switch balance loss and its gradient (q stopped).
    BalanceLossConfig bl;
    Mat d("d", T, E);
    BalanceLossResult const r = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_SELF, d);
    std::vector<std::vector<double>> q(1, std::vector<double>(static_cast<std::size_t>(E), 0.0));
    for (int e : experts) q[0][static_cast<std::size_t>(e)] += static_cast<double>(E) / (T * k);
    CHECK(r.loss == Approx(balance_objective(z, T, E, softmax, T, q)).epsilon(1e-5));
    auto const wantb = central_differences(z, [&](std::vector<double> const& zz) { return balance_objective(zz, T, E, softmax, T, q); });
    double largest = 0;
    for (double g : wantb) largest = std::max(largest, std::abs(g));
    REQUIRE(largest > 0);
    CHECK(worst_abs(host_vector(d), wantb) <= 1e-4 * largest);
  }
}

TEST_CASE("Switch balance loss: the reference numbers, a zero gradient when balanced, the exact gradient", "[router][backward][balance]") {
  // T = 8, E = 4, top-1: tokens 0-3 pick expert 0, 4-5 expert 1, 6 expert 2,
  // 7 expert 3 (counts [4,2,1,1]); the rows' mean is [0.4, 0.3, 0.2, 0.1].
  std::vector<std::vector<double>> const rows = {{0.55, 0.25, 0.175, 0.025}, {0.55, 0.25, 0.175, 0.025}, {0.55, 0.25, 0.175, 0.025},
                                                 {0.55, 0.25, 0.175, 0.025}, {0.3, 0.5, 0.1, 0.1},       {0.3, 0.5, 0.1, 0.1},
                                                 {0.2, 0.2, 0.5, 0.1},       {0.2, 0.2, 0.2, 0.4}};
  std::vector<double> z;
  for (auto const& r : rows)
    for (double p : r) z.push_back(std::log(p));
  RouterConfig c;
  c.num_experts = 4;
  c.top_k = 1;
  Mat logits = device_matrix(z, 8, 4), dlogits("dlogits", 8, 4);
  RouteTable<MS> table = route(c, logits);
  CHECK(experts_of(table) == std::vector<int>{0, 0, 0, 0, 1, 1, 2, 3});
  BalanceLossConfig bl;
  BalanceLossResult const r = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_SELF, dlogits);
  CHECK(r.loss == Approx(1.25).epsilon(1e-6));
  CHECK(r.balanced == 1.0);
  CHECK(r.f == std::vector<double>{0.5, 0.25, 0.125, 0.125});
  for (int e = 0; e < 4; ++e) CHECK(r.P[static_cast<std::size_t>(e)] == Approx(0.4 - 0.1 * e).epsilon(1e-6));
  // The gradient with q stopped: dL/dz_{t,j} = p_{t,j}/T (q_j - sum_e p_{t,e} q_e).
  std::vector<std::vector<double>> q = {r.q};
  auto const want = central_differences(z, [&](std::vector<double> const& zz) { return balance_objective(zz, 8, 4, true, 8, q); });
  auto const got = host_vector(dlogits);
  CHECK(worst_abs(got, want) <= 1e-6);
  // A gradient that went through q with P stopped (q is piecewise constant)
  // would be zero; this one is not.
  double norm = 0;
  for (double g : got) norm += g * g;
  CHECK(norm > 1e-4);

  SECTION("a uniform hard load has zero gradient and the balanced loss") {
    std::vector<double> zu;
    for (int t = 0; t < 8; ++t)
      for (int e = 0; e < 4; ++e) zu.push_back(e == t % 4 ? 1.5 : 0.25 * e);
    Mat lu = device_matrix(zu, 8, 4), du("du", 8, 4);
    RouteTable<MS> tu = route(c, lu);
    BalanceLossResult const ru = balance_loss(Exec(), c, bl, CMat(lu), tu, MPI_COMM_SELF, du);
    CHECK(ru.loss == Approx(1.0).epsilon(1e-6));
    for (double g : host_vector(du)) CHECK(std::abs(g) <= 1e-7);
  }
}

TEST_CASE("sequence-wise and device-level balance losses and their gradients", "[router][backward][balance]") {
  std::mt19937 rng(17);
  index_t const T = 12;
  int const E = 6, k = 2;
  for (ScoreFunction score : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    RouterConfig const c = router_config(E, k, score);
    auto const z = random_logits(T, E, rng, 1.5);
    Mat logits = device_matrix(z, T, E);
    RouteTable<MS> table = route(c, logits);
    auto const experts = experts_of(table);
    bool const softmax = score == ScoreFunction::softmax;
    INFO((softmax ? "softmax" : "sigmoid"));
    {
      // Sequences of 4 tokens: q per sequence = alpha E count / (S k).
      BalanceLossConfig bl;
      bl.form = BalanceLossForm::sequence;
      bl.alpha = 0.3;
      bl.sequence_length = 4;
      Mat d("d", T, E);
      BalanceLossResult const r = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_SELF, d, 2.0f);
      std::vector<std::vector<double>> q(3, std::vector<double>(static_cast<std::size_t>(E), 0.0));
      for (index_t t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) q[static_cast<std::size_t>(t / 4)][static_cast<std::size_t>(experts[static_cast<std::size_t>(t * k + j)])] += 0.3 * E / (4.0 * k);
      CHECK(r.loss == Approx(balance_objective(z, T, E, softmax, 4, q)).epsilon(1e-5));
      auto want = central_differences(z, [&](std::vector<double> const& zz) { return balance_objective(zz, T, E, softmax, 4, q); });
      for (auto& x : want) x *= 2.0;  // the weight
      CHECK(worst_abs(host_vector(d), want) <= 1e-6);
    }
    {
      // Devices of experts {0,1,2} and {3,4,5}: q_e = alpha * mean over the device of E f.
      BalanceLossConfig bl;
      bl.form = BalanceLossForm::device;
      bl.expert_device = {0, 0, 0, 1, 1, 1};
      Mat d("d", T, E);
      BalanceLossResult const r = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_SELF, d);
      std::vector<double> counts(static_cast<std::size_t>(E), 0.0);
      for (int e : experts) counts[static_cast<std::size_t>(e)] += 1;
      std::vector<std::vector<double>> q(1, std::vector<double>(static_cast<std::size_t>(E)));
      for (int e = 0; e < E; ++e) {
        int const base = e < 3 ? 0 : 3;
        double fsum = 0;
        for (int i = base; i < base + 3; ++i) fsum += E * counts[static_cast<std::size_t>(i)] / (T * k);
        q[0][static_cast<std::size_t>(e)] = fsum / 3;
      }
      CHECK(r.loss == Approx(balance_objective(z, T, E, softmax, T, q)).epsilon(1e-5));
      auto const want = central_differences(z, [&](std::vector<double> const& zz) { return balance_objective(zz, T, E, softmax, T, q); });
      CHECK(worst_abs(host_vector(d), want) <= 1e-6);
    }
  }
}

TEST_CASE("balance loss scope: pooled over the ranks of a communicator, or per rank", "[router][backward][balance][mpi]") {
  int const rank = kmoe_test::world_rank(), size = kmoe_test::world_size();
  int const E = 8, k = 2;
  index_t const T = 5 + rank;  // ranks hold different token counts
  RouterConfig c;
  c.num_experts = E;
  c.top_k = k;
  // Every rank knows every rank's logits (same generator), so it can pool them itself.
  std::vector<std::vector<double>> all;
  for (int r = 0; r < size; ++r) {
    std::mt19937 rng(100 + static_cast<unsigned>(r));
    all.push_back(random_logits(5 + r, E, rng, 2.0));
  }
  Mat logits = device_matrix(all[static_cast<std::size_t>(rank)], T, E);
  RouteTable<MS> table = route(c, logits);
  BalanceLossConfig bl;
  Mat d("d", T, E);
  BalanceLossResult const pooled = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_WORLD, d);
  // The reference: every rank's tokens as one batch on this rank.
  std::vector<double> z_all;
  for (auto const& z : all) z_all.insert(z_all.end(), z.begin(), z.end());
  index_t const N = static_cast<index_t>(z_all.size()) / E;
  Mat la = device_matrix(z_all, N, E), da("da", N, E);
  RouteTable<MS> ta = route(c, la);
  BalanceLossResult const one = balance_loss(Exec(), c, bl, CMat(la), ta, MPI_COMM_SELF, da);
  CHECK(pooled.tokens == N);
  CHECK(pooled.loss == Approx(one.loss).epsilon(1e-9));
  CHECK(pooled.f == one.f);
  // This rank's rows of the pooled gradient.
  index_t first = 0;
  for (int r = 0; r < rank; ++r) first += 5 + r;
  auto const mine = host_vector(d), whole = host_vector(da);
  double worst = 0;
  for (index_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      worst = std::max(worst, std::abs(mine[static_cast<std::size_t>(t * E + e)] - whole[static_cast<std::size_t>((first + t) * E + e)]));
  CHECK(worst <= 1e-7);
  // Per rank: this rank's tokens alone.
  BalanceLossResult const local = balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_SELF);
  CHECK(local.tokens == T);
}

TEST_CASE("balance loss settings are checked on every rank", "[router][backward][balance][mpi]") {
  int const rank = kmoe_test::world_rank();
  RouterConfig c;
  c.num_experts = 4;
  c.top_k = 1;
  std::mt19937 rng(1);
  Mat logits = device_matrix(random_logits(6, 4, rng, 1.0), 6, 4);
  RouteTable<MS> table = route(c, logits);
  BalanceLossConfig bl;
  bl.form = BalanceLossForm::sequence;
  bl.sequence_length = rank == 0 ? 4 : 3;  // 4 does not divide 6 on rank 0
  CHECK_THROWS_WITH(balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_WORLD),
                    Catch::Matchers::Contains("sequence_length = 4 must be > 0 and divide this rank's 6 tokens"));
  bl.form = BalanceLossForm::device;
  bl.expert_device = {0, 1};
  CHECK_THROWS_WITH(balance_loss(Exec(), c, bl, CMat(logits), table, MPI_COMM_WORLD),
                    Catch::Matchers::Contains("expert_device has 2 entries for 4 experts"));
}
