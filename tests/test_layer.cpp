// The MoE layer end to end: a distributed forward over the EP group equals a
// single-rank evaluation of the same global tokens (fp32 rows bitwise, bf16
// rows within rounding) for every exchange algorithm without drops; the layer
// rejects bad inputs on every rank.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_LayerSetup.hpp>

#include <cmath>
#include <cstring>
#include <sstream>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

namespace {

std::string deck_text(std::string const& dtype, std::string const& payload, std::string const& algorithm, int size) {
  std::ostringstream os;
  os << "[run]\nseed = 77\n"
     << "[model]\nhidden = 16\nexperts = 12\ntop_k = 3\nffn = 24\nshared_experts = 1\nshared_ffn = 20\n"
     << "dtype = \"" << dtype << "\"\npayload = \"" << payload << "\"\nreturn_payload = \"" << (payload == "fp32" ? "fp32" : "bf16") << "\"\n"
     << "[router]\nscore = \"sigmoid\"\ngroups = 4\ntopk_groups = 2\ngroup_score = \"top2_sum\"\nroute_scale = 2.5\n"
     << "gemm = \"generic\"\n"
     << "[tokens]\nper_rank = 9\nsource = \"router\"\n"
     << "[topology]\nlayout = \"virtual\"\nnodes = 2\n"
     << "[exchange]\nalgorithm = \"" << algorithm << "\"\nwaves = 2\nsender_cf = " << 3 * size << "\nreceiver_cf = " << 12 * size << "\n"
     << "[experts]\nrunner = \"grouped\"\n";
  // Bitwise equality needs GEMMs that round a row independently of the row
  // count: the host kernels do; a device's vendor GEMM may pick its kernel by
  // the rows (M), so device builds run the portable kernel here.
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) os << "kernel = \"portable\"\n";
  return os.str();
}

/// Runs one forward of the deck's layer over comm for `count` tokens from
/// global token `first`; returns the output rows as float.
template <class T>
std::vector<float> forward_once(LayerDeck const& deck, MPI_Comm comm, index_t first, index_t count, index_t static_tokens) {
  Exec exec;
  int const rank = comm_rank(comm);
  auto setup = Setup::make_run(deck, comm);
  auto const& comms = *setup.comms;
  auto const& placement = setup.placement;
  auto config = setup.config;
  config.exchange.tokens_per_rank = static_tokens;
  auto rw = Setup::router_weight<T, MS>(deck);
  auto routed = Setup::routed_weights<T, MS>(exec, deck, setup, rank, comm);
  auto shared = Setup::shared_weights<T, MS>(exec, deck);
  MoELayer<T, Exec, MS> layer(config, comms, placement, rw, routed, shared);
  auto hidden = Setup::hidden_rows<T, MS>(deck, 0, first, count, rank);
  RowMatrix<T, MS> out("out", count, deck.model.hidden);
  auto rec = layer.forward(exec, hidden, out);
  CHECK(rec.routes.dropped == 0);
  CHECK(rec.ledger.dispatch.sender_drops == 0);
  CHECK(rec.ledger.dispatch.receiver_drops == 0);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  std::vector<float> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = to_float(h.data()[i]);
  return v;
}

/// A fp32 layer's ingredients from the test deck on MPI_COMM_WORLD.
struct LayerParts {
  LayerDeck deck;
  Setup::Run setup;
  RowMatrix<float, MS> router_weight;
  Experts::ExpertWeights<float, MS> routed;
  LayerParts(std::string const& algorithm, int size, int rank)
      : deck(parse_layer_deck("layer-test", deck_text("fp32", "fp32", algorithm, size), size)),
        setup(Setup::make_run(deck, MPI_COMM_WORLD)),
        router_weight(Setup::router_weight<float, MS>(deck)),
        routed(Setup::routed_weights<float, MS>(Exec(), deck, setup, rank, MPI_COMM_WORLD)) {}
};

}  // namespace

TEST_CASE("distributed layer equals a single-rank evaluation of the same global tokens", "[layer]") {
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    for (std::string const dtype : {"fp32", "bf16"}) {
      std::string const payload = dtype == "fp32" ? "fp32" : "bf16";
      INFO(algorithm << " " << dtype << " at " << size << " ranks");
      auto const text = deck_text(dtype, payload, algorithm, size);
      auto const deck = parse_layer_deck("layer-test", text, size);
      index_t const T = deck.tokens.per_rank;
      std::vector<float> dist, single;
      // The single-rank reference: the same deck on one rank (flat exchange).
      auto const deck1 = parse_layer_deck("layer-test", deck_text(dtype, payload, "flat", 1), 1);
      if (dtype == "fp32") {
        dist = forward_once<float>(deck, MPI_COMM_WORLD, rank * T, T, T);
        single = forward_once<float>(deck1, MPI_COMM_SELF, 0, T * size, T * size);
      } else {
        dist = forward_once<bf16_t>(deck, MPI_COMM_WORLD, rank * T, T, T);
        single = forward_once<bf16_t>(deck1, MPI_COMM_SELF, 0, T * size, T * size);
      }
      int const d = deck.model.hidden;
      REQUIRE(dist.size() == static_cast<std::size_t>(T * d));
      std::vector<float> mine(single.begin() + rank * T * d, single.begin() + (rank + 1) * T * d);
      if (dtype == "fp32") {
        CHECK(kmoe_test::same_bits(dist, mine));
      } else {
        // bf16 rows: the same routes and kernels; differences stay within one
        // bf16 rounding of the output.
        double worst = 0;
        for (std::size_t i = 0; i < dist.size(); ++i)
          worst = std::max(worst, std::fabs(static_cast<double>(dist[i]) - mine[i]) / (std::fabs(static_cast<double>(mine[i])) + 1e-3));
        CHECK(worst <= 1.0 / 128);
      }
      double norm = 0;
      for (float x : dist) norm += std::fabs(x);
      CHECK(norm > 0);  // the layer produced something
    }
  }
}

TEST_CASE("the layer rejects bad inputs on every rank without a hang", "[layer][errors]") {
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  LayerParts parts("flat", size, rank);
  auto const& deck = parts.deck;
  Exec exec;
  auto const& comms = *parts.setup.comms;
  auto const& placement = parts.setup.placement;
  auto const& config = parts.setup.config;
  auto const& rw = parts.router_weight;
  auto const& routed = parts.routed;
  MoELayer<float, Exec, MS> layer(config, comms, placement, rw, routed);
  // Rank 0 passes rows of the wrong width: every rank fails.
  int const width = rank == 0 ? deck.model.hidden + 1 : deck.model.hidden;
  RowMatrix<float, MS> hidden("hidden", 4, width), out("out", 4, width);
  bool caught = false;
  try {
    RouteTable<MS> table("t", 4, deck.model.top_k, deck.model.experts);
    auto e = Kokkos::create_mirror_view(table.expert);
    auto a = Kokkos::create_mirror_view(table.accepted);
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < deck.model.top_k; ++j) {
        e(t, j) = (t + j) % deck.model.experts;
        a(t, j) = 1;
      }
    Kokkos::deep_copy(table.expert, e);
    Kokkos::deep_copy(table.accepted, a);
    layer.forward_routes(exec, hidden, table, out);
  } catch (CollectiveError const& err) {
    caught = true;
    CHECK(std::string(err.what()).find("MoE layer: hidden is 4x17") != std::string::npos);
  }
  CHECK(caught);
  // A layer built from weights of the wrong width is refused everywhere.
  auto bad = Experts::ExpertWeights<float, MS>("bad", routed.slot_expert(), deck.model.hidden + (rank == 0 ? 1 : 0), 8);
  CHECK_THROWS_AS((MoELayer<float, Exec, MS>(config, comms, placement, rw, bad)), CollectiveError);
}

TEST_CASE("the transport is chosen by configuration; one this build lacks fails on every rank", "[layer][transport]") {
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  LayerParts parts("hierarchical", size, rank);
  auto const& deck = parts.deck;
  auto const& setup = parts.setup;
  auto const& rw = parts.router_weight;
  auto const& routed = parts.routed;
  Exec exec;
  auto config = setup.config;
  CHECK(config.exchange.transport == Exchange::TransportKind::mpi);
  {
    MoELayer<float, Exec, MS> layer(config, *setup.comms, setup.placement, rw, routed);
    CHECK(layer.exchange(Exchange::Algorithm::hierarchical).transport() == Exchange::TransportKind::mpi);
    auto hidden = Setup::hidden_rows<float, MS>(deck, 0, rank * 9, 9, rank);
    RowMatrix<float, MS> out("out", 9, deck.model.hidden);
    auto const rec = layer.forward(exec, hidden, out);
    CHECK(rec.transport == "mpi");
    CHECK(rec.algorithm == "hierarchical");
  }
  config.exchange.transport = Exchange::TransportKind::nccl;
  if (Exchange::transport_available(Exchange::TransportKind::nccl)) return;  // a CUDA + NCCL build runs it (device tests)
  bool caught = false;
  try {
    MoELayer<float, Exec, MS> layer(config, *setup.comms, setup.placement, rw, routed);
  } catch (CollectiveError const& e) {
    caught = true;
    std::string const what = e.what();
    CHECK(what.find("exchange transport 'nccl' is not available") != std::string::npos);
    CHECK(what.find("KokkosMoE_ENABLE_NCCL=ON") != std::string::npos);
  }
  CHECK(caught);
}

TEST_CASE("every schedule gives bitwise the output of the serial one", "[layer][schedule]") {
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    LayerParts parts(algorithm, size, rank);
    auto const& deck = parts.deck;
    Exec exec;
    auto shared = Setup::shared_weights<float, MS>(exec, deck);
    index_t const T = deck.tokens.per_rank;
    int const d = deck.model.hidden;
    auto hidden = Setup::hidden_rows<float, MS>(deck, 0, rank * T, T, rank);
    std::vector<float> serial;
    struct Case {
      ScheduleKind kind;
      int chunks;
    };
    for (Case const c : {Case{ScheduleKind::serial, 1}, Case{ScheduleKind::shared_overlap, 1}, Case{ScheduleKind::chunked, 2},
                         Case{ScheduleKind::chunked, 4}, Case{ScheduleKind::chunked_shared_overlap, 3}}) {
      INFO(algorithm << " " << to_string(c.kind) << " x" << c.chunks << " at " << size << " ranks");
      auto config = parts.setup.config;
      config.schedule.kind = c.kind;
      config.schedule.chunks = c.chunks;
      MoELayer<float, Exec, MS> layer(config, *parts.setup.comms, parts.setup.placement, parts.router_weight, parts.routed, shared);
      RowMatrix<float, MS> out("out", T, d);
      auto const rec = layer.forward(exec, hidden, out);
      CHECK(rec.routes.dropped == 0);
      CHECK(rec.ledger.dispatch.sender_drops + rec.ledger.dispatch.receiver_drops == 0);
      CHECK(rec.schedule == to_string(c.kind) + "/" + std::to_string(c.kind == ScheduleKind::chunked || c.kind == ScheduleKind::chunked_shared_overlap ? c.chunks : 1));
      // Every task ran once, ended after it started, and the reduce last.
      int const waves = layer.exchange(from_string<Exchange::Algorithm>(algorithm)).waves();
      int const C = config.schedule.step_chunks();
      REQUIRE(rec.tasks.size() == static_cast<std::size_t>(3 + 3 * C * waves));  // route plan, shared, reduce, 3 per part
      for (auto const& t : rec.tasks) CHECK(t.end >= t.start);
      CHECK(rec.tasks.back().name == "reduce");
      for (auto const& t : rec.tasks) CHECK(t.end <= rec.tasks.back().end);
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
      std::vector<float> v(h.data(), h.data() + h.size());
      if (c.kind == ScheduleKind::serial) {
        serial = v;
        double norm = 0;
        for (float x : v) norm += std::fabs(x);
        CHECK(norm > 0);
      } else {
        CHECK(kmoe_test::same_bits(v, serial));
      }
    }
  }
}

TEST_CASE("a step graph without a completion dependency is rejected before anything runs, or meets the run-time guards",
          "[layer][schedule][errors]") {
  // Checked (the default): the graph's hazard check rejects the graph before
  // anything runs, so the output is untouched. Unchecked (test hook): the
  // same faults executed anyway meet the run-time guards: the expert refuses
  // rows whose dispatch has not finished, the reduce a combine still in
  // flight. (A combine issued without waiting for its expert cannot happen
  // at run time: tasks are issued in graph order and an expert finishes when
  // it is issued.) Either way every rank fails with the message, nothing is
  // left in flight, and the next step (a serial layer on the same ranks) works.
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  LayerParts parts("flat", size, rank);
  auto const& deck = parts.deck;
  Exec exec;
  auto shared = Setup::shared_weights<float, MS>(exec, deck);
  index_t const T = deck.tokens.per_rank;
  auto hidden = Setup::hidden_rows<float, MS>(deck, 0, rank * T, T, rank);
  struct Fault {
    char const* task;
    char const* after;
    char const* message;
    bool unchecked;
  };
  for (Fault const f : {Fault{"expert 1", "dispatch 1", "task 'expert 1' (stream compute) reads 'rows 1' that task 'dispatch 1'", false},
                        Fault{"reduce", "combine 1", "task 'reduce' (stream compute) reads 'returned 1' that task 'combine 1'", false},
                        Fault{"combine 0", "expert 0", "task 'combine 0' (stream combine) reads 'out 0' that task 'expert 0'", false},
                        Fault{"expert 1", "dispatch 1", "the experts would read the rows of a dispatch that has not finished", true},
                        Fault{"reduce", "combine 1", "MoE layer reduce: the combine of part 1 has not finished", true}}) {
    INFO(f.task << " without " << f.after << (f.unchecked ? ", executed unchecked" : ""));
    auto config = parts.setup.config;
    config.schedule.kind = ScheduleKind::chunked_shared_overlap;
    config.schedule.chunks = 2;
    config.schedule.omit_task = f.task;
    config.schedule.omit_after = f.after;
    config.schedule.unchecked = f.unchecked;
    MoELayer<float, Exec, MS> layer(config, *parts.setup.comms, parts.setup.placement, parts.router_weight, parts.routed, shared);
    RowMatrix<float, MS> out("out", T, deck.model.hidden);
    Kokkos::deep_copy(out, 7.0f);
    CHECK_THROWS_WITH(layer.forward(exec, hidden, out), Catch::Matchers::Contains(f.message));
    if (!f.unchecked) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
      CHECK(h(0, 0) == 7.0f);  // nothing ran
    }
  }
  MoELayer<float, Exec, MS> ok(parts.setup.config, *parts.setup.comms, parts.setup.placement, parts.router_weight, parts.routed, shared);
  RowMatrix<float, MS> out("out", T, deck.model.hidden);
  CHECK_NOTHROW(ok.forward(exec, hidden, out));
}
