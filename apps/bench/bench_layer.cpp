// kmoe-bench layer: one MoE layer step from a deck (default: the
// DeepSeek-V3-like layer of inputs/layer_bench.toml, T = 2048 per rank,
// E = 64, k = 8, d = 2048, f = 1408, one shared expert) under every step
// schedule next to the serial one, in the same run and on the same batch:
//
//   BENCH name=layer_<schedule>_np<P> algorithm=... chunks=... step_s=... serial_step_s=... identical=yes
//         allocations_per_step=0 ratio=<step / serial step>
//
// Step times are the slowest rank's, medians over --reps repetitions in
// which the schedules take turns (so drift hits them alike). Every
// schedule's output must equal the serial one bitwise (identical=yes); the
// exit code is 1 otherwise. allocations_per_step: the Kokkos allocations of
// a measured step (the most on any rank; each is a cudaMalloc on a GPU and
// its release a device synchronisation).

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_AllocationLog.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_LayerSetup.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

struct LayerOptions {
  std::string deck = "inputs/layer_bench.toml";
  std::string algorithm;  // "" the deck's
  int chunks = 2;
  int reps = 3;
  int warmup = 1;
  index_t tokens = 0;  // 0: the deck's
};

template <class T>
int bench(LayerDeck deck, LayerOptions const& o) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  if (o.tokens > 0) deck.tokens.per_rank = o.tokens;
  if (!o.algorithm.empty()) deck.exchange.algorithm = from_string<Exchange::Algorithm>(o.algorithm);
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  double const watchdog = deck.exchange.watchdog_seconds;
  index_t const tokens = Setup::tokens_per_rank(deck);
  auto const router_weight = Setup::router_weight<T, MS>(deck);
  auto const routed = Setup::routed_weights<T, MS>(exec, deck, setup, rank, world);
  auto const shared = Setup::shared_weights<T, MS>(exec, deck);
  auto const hidden = Setup::hidden_rows<T, MS>(deck, 0, Setup::first_token(deck, rank), tokens, rank);

  struct Case {
    ScheduleKind kind;
    int chunks;
    std::unique_ptr<MoELayer<T, Exec, MS>> layer;
    RowMatrix<T, MS> out;
    std::vector<double> seconds;
    std::uint64_t digest = 0;
    long allocations = 0;  // in the measured steps
  };
  std::vector<Case> cases;
  for (auto kind : {ScheduleKind::serial, ScheduleKind::shared_overlap, ScheduleKind::chunked, ScheduleKind::chunked_shared_overlap}) {
    Case c;
    c.kind = kind;
    LayerConfig config = setup.config;
    config.schedule.kind = kind;
    config.schedule.chunks = config.schedule.chunked() ? o.chunks : 1;
    c.chunks = config.schedule.step_chunks();
    c.layer = std::make_unique<MoELayer<T, Exec, MS>>(config, *setup.comms, setup.placement, router_weight, routed, shared);
    c.out = RowMatrix<T, MS>("layer_bench::out", tokens, deck.model.hidden);
    cases.push_back(std::move(c));
  }
  for (int r = 0; r < o.warmup + o.reps; ++r) {
    for (auto& c : cases) {
      MPI_Barrier(world);
      StepRecord rec;
      {
        AllocationLog log;
        rec = c.layer->forward(exec, hidden, c.out);
        if (r >= o.warmup) c.allocations += static_cast<long>(log.count());
      }
      double const slowest = kmoe_bench::slowest_rank(rec.seconds.at("total"), world, watchdog, "layer bench: step time");
      if (r >= o.warmup) c.seconds.push_back(slowest);
    }
  }
  // Every rank's output digest, equal or not across ranks' schedules.
  int all_identical = 1;
  for (auto& c : cases) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), c.out);
    c.digest = digest_bytes(h.data(), h.size() * sizeof(T));
  }
  double const serial_s = kmoe_bench::median(cases.front().seconds);
  for (auto& c : cases) {
    bool const identical = kmoe_bench::on_every_rank(c.digest == cases.front().digest, world, watchdog, "layer bench: outputs");
    all_identical &= identical ? 1 : 0;
    double const s = kmoe_bench::median(c.seconds);
    long allocations = 0;
    allreduce_watched(&c.allocations, &allocations, 1, MPI_LONG, MPI_MAX, world, "layer bench: allocations", watchdog);
    kmoe_bench::print_bench("layer_" + to_string(c.kind) + "_np" + std::to_string(size),
                            {{"algorithm", to_string(deck.exchange.algorithm)},
                             {"chunks", std::to_string(c.chunks)},
                             {"tokens", std::to_string(tokens)},
                             {"experts", std::to_string(deck.model.experts)},
                             {"top_k", std::to_string(deck.model.top_k)},
                             {"d", std::to_string(deck.model.hidden)},
                             {"f", std::to_string(deck.model.ffn)},
                             {"shared", std::to_string(deck.model.shared_experts)},
                             {"dtype", deck.model.dtype},
                             {"step_s", kmoe_bench::fmt(s)},
                             {"serial_step_s", kmoe_bench::fmt(serial_s)},
                             {"identical", identical ? "yes" : "no"},
                             {"allocations_per_step", kmoe_bench::fmt(static_cast<double>(allocations) / std::max(1, o.reps))}},
                            serial_s > 0 ? s / serial_s : 0.0);
  }
  return all_identical ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"layer: one MoE layer step under every schedule next to the serial one"};
  LayerOptions o;
  app.add_option("--deck", o.deck, "TOML input deck")->capture_default_str();
  app.add_option("--algorithm", o.algorithm, "exchange algorithm (default: the deck's)")
      ->check(CLI::IsMember(enum_names<Exchange::Algorithm>()));
  app.add_option("--chunks", o.chunks, "chunks of the chunked schedules")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--reps", o.reps, "measured repetitions")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", o.warmup, "warm-up repetitions")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--tokens", o.tokens, "tokens per rank (default: the deck's)")->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  auto const deck = read_layer_deck(MPI_COMM_WORLD, o.deck);
  KOKKOSMOE_REQUIRE(deck.tokens.source != "explicit" || o.tokens == 0,
                    "layer bench: deck '" << deck.path << "' has explicit tokens; --tokens does not apply");
  if (deck.model.dtype == "bf16") return bench<bf16_t>(deck, o);
  return bench<float>(deck, o);
}

kmoe_bench::Register reg("layer", "one MoE layer step (DeepSeek-V3-like deck) under every schedule next to the serial one", run);

}  // namespace
