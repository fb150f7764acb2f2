// The layer's backward end to end: directional finite differences of the
// fp32 layer (input rows, a routed expert's weights, the router weight, the
// shared expert) on one rank; the distributed gradients (flat and
// hierarchical and pooled-wave exchanges) equal a single-rank backward of
// the same global tokens; the balance loss joins the router gradient; bad
// shapes are refused on every rank.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_AllocationLog.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_LayerSetup.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

namespace {

std::string deck_text(std::string const& algorithm, int nodes, std::string const& schedule = "serial") {
  std::ostringstream os;
  os << "[run]\nseed = 21\nschedule = \"" << schedule << "\"\nchunks = " << (schedule.rfind("chunked", 0) == 0 ? 3 : 1) << "\n"
     << "[model]\nhidden = 16\nexperts = 8\ntop_k = 2\nffn = 24\nshared_experts = 1\nshared_ffn = 12\n"
     << "dtype = \"fp32\"\npayload = \"fp32\"\nreturn_payload = \"fp32\"\n"
     << "[router]\nscore = \"softmax\"\nnormalize = true\nroute_scale = 1.5\ngemm = \"generic\"\n"
     << "[tokens]\nper_rank = 10\nsource = \"router\"\n"
     << "[topology]\nlayout = \"virtual\"\nnodes = " << nodes << "\n"
     << "[exchange]\nalgorithm = \"" << algorithm << "\"\nwaves = 2\nsender_cf = 16\nreceiver_cf = 64\n"
     << "[experts]\nrunner = \"grouped\"\ngemm = \"generic\"\n";
  // The forward too: a device's vendor grouped GEMM may pick its kernel by
  // the rows (M), so device builds run the portable kernel here.
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) os << "kernel = \"portable\"\n";
  return os.str();
}

using Layer = MoELayer<float, Exec, MS>;

/// A deck's layer on comm with its weights (views shared with the layer).
struct Built {
  LayerDeck deck;
  Setup::Run run;
  RowMatrix<float, MS> router_weight;
  std::unique_ptr<Layer> layer;
  Built(std::string const& text, MPI_Comm comm) : deck(parse_layer_deck("backward-test", text, comm_size(comm))), run(Setup::make_run(deck, comm)) {
    Exec exec;
    int const rank = comm_rank(comm);
    router_weight = Setup::router_weight<float, MS>(deck);
    layer = std::make_unique<Layer>(run.config, *run.comms, run.placement, router_weight,
                                    Setup::routed_weights<float, MS>(exec, deck, run, rank, comm), Setup::shared_weights<float, MS>(exec, deck));
  }
};

RowMatrix<float, MS> rows_of(std::vector<float> const& v, index_t n, int d) {
  RowMatrix<float, MS> m("rows", n, d);
  auto h = Kokkos::create_mirror_view(m);
  std::copy(v.begin(), v.end(), h.data());
  Kokkos::deep_copy(m, h);
  return m;
}

template <class V>
std::vector<float> host(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

/// Upstream gradient of global token g, column c (deterministic).
float upstream(index_t g, int c) { return static_cast<float>(((g * 13 + c * 7) % 19) - 9) / 16.0f; }

/// The upstream gradients of T tokens from global token `first`, row-major.
std::vector<float> upstream_rows(index_t first, index_t T, int d) {
  std::vector<float> v(static_cast<std::size_t>(T * d));
  for (index_t t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) v[static_cast<std::size_t>(t * d + c)] = upstream(first + t, c);
  return v;
}

/// This rank's rows of a built deck's first step: hidden rows, upstream
/// gradients (upstream_rows), outputs and input gradients.
struct RankRows {
  int d;
  index_t T;
  RowMatrix<float, MS> hidden, dOut, out, dX;
  RankRows(Built const& b, int rank)
      : d(b.deck.model.hidden),
        T(b.deck.tokens.per_rank),
        hidden(Setup::hidden_rows<float, MS>(b.deck, 0, rank * T, T, rank)),
        dOut(rows_of(upstream_rows(rank * T, T, d), T, d)),
        out("out", T, d),
        dX("dX", T, d) {}
};

double dot(std::vector<float> const& a, std::vector<float> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

/// <dOut, forward(hidden)> and the route table's experts.
std::pair<double, std::vector<int>> objective(Layer& layer, RowMatrix<float, MS> const& hidden, std::vector<float> const& dout) {
  RowMatrix<float, MS> out("out", hidden.extent(0), hidden.extent(1));
  layer.forward(Exec(), hidden, out);
  auto e = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.routes().expert);
  return {dot(host(out), dout), std::vector<int>(e.data(), e.data() + e.size())};
}

/// Central difference of the objective along `dir` applied by `shift(h)`
/// (which adds h * dir to a parameter); checks that the selection did not
/// change between the two sides.
template <class Shift>
double directional(Layer& layer, RowMatrix<float, MS> const& hidden, std::vector<float> const& dout, double h, Shift const& shift) {
  shift(h);
  auto const plus = objective(layer, hidden, dout);
  shift(-2 * h);
  auto const minus = objective(layer, hidden, dout);
  shift(h);
  REQUIRE(plus.second == minus.second);  // the same experts on both sides
  return (plus.first - minus.first) / (2 * h);
}

/// Adds s * dir to a device array of floats.
template <class V>
void add_direction(V const& v, std::vector<float> const& dir, double s) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  for (std::size_t i = 0; i < dir.size(); ++i) h.data()[i] += static_cast<float>(s * dir[i]);
  Kokkos::deep_copy(v, h);
}

std::vector<float> random_direction(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace

TEST_CASE("layer backward equals directional finite differences", "[layer][backward]") {
  Built b(deck_text("flat", 1), MPI_COMM_SELF);
  Exec exec;
  int const d = b.deck.model.hidden;
  index_t const T = b.deck.tokens.per_rank;
  auto hidden = Setup::hidden_rows<float, MS>(b.deck, 0, 0, T, 0);
  auto const dout = upstream_rows(0, T, d);
  auto dOut = rows_of(dout, T, d);
  RowMatrix<float, MS> out("out", T, d), dX("dX", T, d);
  b.layer->forward(exec, hidden, out);
  LayerGradients<MS> g;
  BackwardRecord const rec = b.layer->backward(exec, hidden, dOut, dX, g);
  CHECK(rec.experts.recomputed == false);  // the recompute keeps the activations for the experts' backward
  CHECK(rec.experts.path == "swiglu[generic,saved]");  // the deck's [experts] gemm, in the backward too
  CHECK(rec.seconds.count("total") == 1);
  double const h = 2e-3;
  auto close = [](double got, double want) { return std::abs(got - want) <= 2e-3 * (std::abs(want) + 0.05); };

  auto const v = random_direction(static_cast<std::size_t>(T * d), 1);
  double const fd_x = directional(*b.layer, hidden, dout, h, [&](double s) { add_direction(hidden, v, s); });
  INFO("input rows: analytic " << dot(host(dX), v) << ", finite difference " << fd_x);
  CHECK(close(dot(host(dX), v), fd_x));

  auto& routed = b.layer->routed_weights();
  auto const vg = random_direction(routed.gate().size(), 2);
  double const fd_g = directional(*b.layer, hidden, dout, h, [&](double s) { add_direction(routed.gate(), vg, s); });
  INFO("routed gate weights: analytic " << dot(host(g.routed.gate), vg) << ", finite difference " << fd_g);
  CHECK(close(dot(host(g.routed.gate), vg), fd_g));
  auto const vd = random_direction(routed.down().size(), 3);
  double const fd_d = directional(*b.layer, hidden, dout, h, [&](double s) { add_direction(routed.down(), vd, s); });
  CHECK(close(dot(host(g.routed.down), vd), fd_d));
  auto* shared = b.layer->shared_weights();
  REQUIRE(shared != nullptr);
  auto const vs = random_direction(shared->up().size(), 5);
  double const fd_s = directional(*b.layer, hidden, dout, h, [&](double s) { add_direction(shared->up(), vs, s); });
  INFO("shared up weights: analytic " << dot(host(g.shared.up), vs) << ", finite difference " << fd_s);
  CHECK(close(dot(host(g.shared.up), vs), fd_s));

  auto const vr = random_direction(b.router_weight.size(), 4);
  double const fd_r = directional(*b.layer, hidden, dout, h, [&](double s) { add_direction(b.router_weight, vr, s); });
  INFO("router weight: analytic " << dot(host(g.router), vr) << ", finite difference " << fd_r);
  CHECK(close(dot(host(g.router), vr), fd_r));
  CHECK(std::abs(fd_r) > 1e-4);  // the gates carry a gradient
}

TEST_CASE("distributed layer backward equals a single-rank backward of the same global tokens", "[layer][backward][mpi]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    INFO(algorithm << " at " << size << " ranks");
    Built dist(deck_text(algorithm, size % 2 == 0 ? 2 : 1), MPI_COMM_WORLD);
    Built one(deck_text("flat", 1), MPI_COMM_SELF);
    Exec exec;
    int const d = dist.deck.model.hidden;
    index_t const T = dist.deck.tokens.per_rank, N = T * size;
    auto hidden = Setup::hidden_rows<float, MS>(dist.deck, 0, rank * T, T, rank);
    auto hidden1 = Setup::hidden_rows<float, MS>(one.deck, 0, 0, N, 0);
    auto const dout = upstream_rows(rank * T, T, d), dout1 = upstream_rows(0, N, d);
    RowMatrix<float, MS> out("out", T, d), dX("dX", T, d), out1("out1", N, d), dX1("dX1", N, d);
    StepRecord const fwd = dist.layer->forward(exec, hidden, out);
    CHECK(fwd.routes.dropped + fwd.ledger.dispatch.sender_drops + fwd.ledger.dispatch.receiver_drops == 0);
    one.layer->forward(exec, hidden1, out1);
    LayerGradients<MS> g, g1;
    LayerBackwardOptions bo;
    bo.gradient_block = 5;  // divides every rank's 10 tokens: the same blocks as the single rank's
    bo.reproducible_shared = algorithm != "flat";  // flat: the shared experts' floating-point sums
    dist.layer->backward(exec, hidden, rows_of(dout, T, d), dX, g, bo);
    one.layer->backward(exec, hidden1, rows_of(dout1, N, d), dX1, g1, bo);
    auto const all = host(dX1);
    std::vector<float> mine(all.begin() + rank * T * d, all.begin() + (rank + 1) * T * d);
    {
      auto const got = host(dX);
      double wx = 0;
      for (std::size_t i = 0; i < got.size(); ++i) wx = std::max(wx, std::abs(static_cast<double>(got[i]) - mine[i]) / (std::abs(mine[i]) + 1e-3));
      INFO("dX: largest relative difference " << wx);
      CHECK(wx <= 1e-5);
    }
    // This rank's expert slots against the single rank's slot of the same expert.
    auto const& slots = dist.run.placement.slots_of_rank(rank);
    auto const gd = host(g.routed.down), gd1 = host(g1.routed.down), gg = host(g.routed.gate), gg1 = host(g1.routed.gate);
    std::size_t const per = static_cast<std::size_t>(d) * 24;
    double worst = 0;
    for (std::size_t q = 0; q < slots.size(); ++q) {
      int const e = dist.run.placement.slot(slots[q]).expert;
      std::size_t const q1 = static_cast<std::size_t>(one.run.placement.log2phy()[static_cast<std::size_t>(e)][0]);
      for (std::size_t i = 0; i < per; ++i) {
        worst = std::max(worst, std::abs(static_cast<double>(gd[q * per + i]) - gd1[q1 * per + i]) / (std::abs(gd1[q1 * per + i]) + 1e-3));
        worst = std::max(worst, std::abs(static_cast<double>(gg[q * per + i]) - gg1[q1 * per + i]) / (std::abs(gg1[q1 * per + i]) + 1e-3));
      }
    }
    CHECK(worst <= 1e-4);
    // The router weight's gradient is summed reproducibly: the same bits;
    // the shared experts' too when asked, else within rounding.
    auto const gr = host(g.router), gr1 = host(g1.router), gs = host(g.shared.up), gs1 = host(g1.shared.up);
    double wr = 0, ws = 0;
    for (std::size_t i = 0; i < gr.size(); ++i) wr = std::max(wr, std::abs(static_cast<double>(gr[i]) - gr1[i]) / (std::abs(gr1[i]) + 1e-3));
    for (std::size_t i = 0; i < gs.size(); ++i) ws = std::max(ws, std::abs(static_cast<double>(gs[i]) - gs1[i]) / (std::abs(gs1[i]) + 1e-3));
    CHECK(kmoe_test::same_bits(gr, gr1));
    CHECK(wr <= 1e-4);
    CHECK(ws <= 1e-4);
    if (bo.reproducible_shared) {
      CHECK(kmoe_test::same_bits(gs, gs1));
      CHECK(kmoe_test::same_bits(host(g.shared.gate), host(g1.shared.gate)));
      CHECK(kmoe_test::same_bits(host(g.shared.down), host(g1.shared.down)));
    }
    // Flat and hierarchical deliver every expert's rows in the single rank's
    // order (by origin rank, then token), pooled-wave's backward merges its
    // waves' rows into that order: dX and the routed experts' gradients are
    // the same bits (the deck's portable GEMM rounds a row the same way
    // whatever the number of rows in the call; a BLAS need not).
    {
      auto const got = host(dX);
      CHECK(kmoe_test::same_bits(got, mine));
      for (std::size_t q = 0; q < slots.size(); ++q) {
        int const e = dist.run.placement.slot(slots[q]).expert;
        std::size_t const q1 = static_cast<std::size_t>(one.run.placement.log2phy()[static_cast<std::size_t>(e)][0]);
        CHECK(std::memcmp(&gd[q * per], &gd1[q1 * per], per * sizeof(float)) == 0);
        CHECK(std::memcmp(&gg[q * per], &gg1[q1 * per], per * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("backward after an overlapped or chunked forward equals the serial one, bit for bit", "[layer][backward][mpi]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical"}) {
    std::vector<std::vector<float>> results;
    for (std::string const schedule : {"serial", "shared_overlap", "chunked", "chunked_shared_overlap"}) {
      INFO(algorithm << " " << schedule << " at " << size << " ranks");
      Built b(deck_text(algorithm, size % 2 == 0 ? 2 : 1, schedule), MPI_COMM_WORLD);
      Exec exec;
      RankRows r(b, rank);
      b.layer->forward(exec, r.hidden, r.out);
      LayerGradients<MS> g;
      b.layer->backward(exec, r.hidden, r.dOut, r.dX, g);
      std::vector<float> all = host(r.out);
      for (auto const& part : {host(r.dX), host(g.routed.up), host(g.routed.gate), host(g.routed.down), host(g.router), host(g.shared.up)})
        all.insert(all.end(), part.begin(), part.end());
      results.push_back(all);
      REQUIRE(results.back().size() == results.front().size());
      CHECK(std::memcmp(results.back().data(), results.front().data(), all.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("sends and receives paired as NCCL pairs them: the same forward and backward bits", "[layer][backward][mpi]") {
  // [exchange] pair_runs: every run its own message of exactly its rows and
  // no receive up to a count, so the exchanges take the layouts they take
  // over NCCL (pooled-wave moves whole pools and repacks); a run cut
  // differently by its sender and its receiver would land rows in the wrong
  // places here, as it would over NCCL.
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    for (std::string const schedule : {"serial", "chunked"}) {
      INFO(algorithm << " " << schedule << " at " << size << " ranks");
      std::vector<std::vector<float>> results;
      for (bool const paired : {false, true}) {
        INFO((paired ? "paired" : "gathered"));
        std::string text = deck_text(algorithm, size % 2 == 0 ? 2 : 1, schedule);
        if (paired) text.replace(text.find("[exchange]\n"), 11, "[exchange]\npair_runs = true\n");
        Built b(text, MPI_COMM_WORLD);
        REQUIRE(b.deck.exchange.pair_runs == paired);
        Exec exec;
        RankRows r(b, rank);
        StepRecord const rec = b.layer->forward(exec, r.hidden, r.out);
        // Pooled-wave lands rows in the expert rows only over a transport
        // that gathers a peer's runs into one message; paired, it repacks.
        if (algorithm == "pooled_wave") CHECK(rec.ledger.dispatch.rows_in_place == !paired);
        LayerGradients<MS> g;
        b.layer->backward(exec, r.hidden, r.dOut, r.dX, g);
        std::vector<float> all = host(r.out);
        for (auto const& part : {host(r.dX), host(g.routed.up), host(g.routed.gate), host(g.routed.down), host(g.router)})
          all.insert(all.end(), part.begin(), part.end());
        results.push_back(all);
      }
      REQUIRE(results[1].size() == results[0].size());
      CHECK(std::memcmp(results[1].data(), results[0].data(), results[0].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("repeated steps allocate nothing: forward under every schedule, and forward + backward", "[layer][backward][memory][mpi]") {
  // Plans, sorts, stage tables and saved activations come from the layer's
  // and the exchanges' workspaces, host-staged rows from the transport's;
  // host tables are copied without mirrors.
  // On a GPU every allocation is a cudaMalloc and every release a device
  // synchronisation, so a step that allocates cannot overlap anything.
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    for (std::string const schedule : {"serial", "shared_overlap", "chunked", "chunked_shared_overlap", "capacity", "staged"}) {
      bool const train = schedule == "serial" || schedule == "chunked" || schedule == "capacity" || schedule == "staged";
      bool const variant = schedule == "capacity" || schedule == "staged";
      INFO(algorithm << " " << schedule << (train ? " forward + backward" : " forward") << " at " << size << " ranks");
      std::string text = deck_text(algorithm, size % 2 == 0 ? 2 : 1, variant ? "serial" : schedule);
      if (schedule == "capacity")  // the router drops routes over an expert's capacity
        text.replace(text.find("[router]\n"), 9, "[router]\nadmission = \"expert_capacity\"\ncapacity_factor = 0.5\n");
      if (schedule == "staged")  // rows through host copies, as MPI without device support moves them
        text.replace(text.find("[exchange]\n"), 11, "[exchange]\nstage_through_host = true\n");
      Built b(text, MPI_COMM_WORLD);
      Exec exec;
      RankRows r(b, rank);
      LayerGradients<MS> g;
      LayerBackwardOptions bo;
      bo.reproducible_shared = true;
      bo.gradient_block = 4;  // blocks of 4, 4 and 2 of the 10 tokens: two batch sizes per step
      bo.balance = BalanceLossConfig{};
      StepRecord last;
      auto step = [&] {
        last = b.layer->forward(exec, r.hidden, r.out);
        if (train) b.layer->backward(exec, r.hidden, r.dOut, r.dX, g, bo);
        exec.fence();
      };
      // The workspaces and the gradients reach their sizes (a step may still
      // hold the last one's buffers while it takes its own).
      step();
      step();
      std::vector<float> const first = host(train ? r.dX : r.out);
      std::string allocated;
      {
        AllocationLog log;
        step();
        allocated = log.text();
      }
      INFO("allocations in the repeated step:\n" << allocated);
      CHECK(allocated.empty());
      if (schedule == "capacity") CHECK(last.routes.dropped > 0);
      // The reused buffers give the first step's result.
      CHECK(kmoe_test::same_bits(host(train ? r.dX : r.out), first));
    }
  }
}

TEST_CASE("balance loss joins the router gradient; bad shapes are refused on every rank", "[layer][backward][mpi]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Built b(deck_text("flat", 1), MPI_COMM_WORLD);
  Exec exec;
  int const d = b.deck.model.hidden;
  index_t const T = b.deck.tokens.per_rank;
  auto hidden = Setup::hidden_rows<float, MS>(b.deck, 0, rank * T, T, rank);
  RowMatrix<float, MS> out("out", T, d), dX("dX", T, d), zero("zero", T, d);
  b.layer->forward(exec, hidden, out);
  LayerGradients<MS> g;
  LayerBackwardOptions opts;
  opts.balance = BalanceLossConfig{};
  opts.balance->alpha = 0.01;
  BackwardRecord const rec = b.layer->backward(exec, hidden, zero, dX, g, opts);
  CHECK(rec.balance_loss > 0.0);
  double norm = 0;
  for (float x : host(g.router)) norm += static_cast<double>(x) * x;
  CHECK(norm > 0.0);  // only the balance loss drives it (dOut = 0)
  RowMatrix<float, MS> bad("bad", T + (rank == size - 1 ? 1 : 0), d);
  CHECK_THROWS_WITH(b.layer->backward(exec, hidden, bad, dX, g), Catch::Matchers::Contains("MoE layer backward"));
}
