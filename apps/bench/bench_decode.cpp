// kmoe-bench decode: decode steps of one MoE layer from a deck (default:
// inputs/decode.toml) on a decode bucket next to the ordinary variable path,
// in the same run, on the same rows, for T = 1, 2, 4, ... up to --max-tokens
// valid tokens per rank:
//
//   BENCH name=decode_T<T>_np<P> tokens=... bucket_s=... ordinary_s=... tokens_per_s=... admitted=yes
//         identical=yes executed_tokens=... useful_tokens=... ratio=<bucket step / ordinary step>
//
// The bucket's token capacity is --max-tokens per rank and its route
// capacity every route of a full bucket (P Ct k per slot), so every step is
// admitted; admitted=no reports a refusal. Times are the slowest rank's,
// medians over --reps steps in which the two paths take turns.
// tokens_per_s: valid tokens of all ranks per second of bucket step.
// identical: the two paths' outputs are the same bits on every rank (they
// are with a generic router GEMM and a row-independent runner; a BLAS
// router GEMM may round rows of the bucket's fixed shape differently).

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Serve.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

struct DecodeOptions {
  std::string deck = "inputs/decode.toml";
  index_t max_tokens = 64;
  int reps = 9;
  int warmup = 2;
};

template <class T>
int bench(LayerDeck const& deck, DecodeOptions const& o) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  double const watchdog = deck.exchange.watchdog_seconds;
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  MoELayer<T, Exec, MS> layer(setup.config, *setup.comms, setup.placement, Setup::router_weight<T, MS>(deck),
                              Setup::routed_weights<T, MS>(exec, deck, setup, rank, world), Setup::shared_weights<T, MS>(exec, deck));
  layer.set_checkpoint(deck.model.checkpoint.empty() ? "seed:" + std::to_string(deck.run.seed) : deck.model.checkpoint);
  DecodeBucket<T, Exec, MS> bucket(layer, BucketConfig{o.max_tokens, static_cast<index_t>(size) * o.max_tokens * deck.model.top_k});
  auto const all_rows = Setup::hidden_rows<T, MS>(deck, 0, rank * o.max_tokens, o.max_tokens, rank);
  int all_identical = 1;
  for (index_t t = 1; t <= o.max_tokens; t *= 2) {
    RowMatrix<T, MS> const x = Kokkos::subview(all_rows, std::make_pair(index_t(0), t), Kokkos::ALL);
    RowMatrix<T, MS> out_b("decode_bench::bucket_out", t, deck.model.hidden), out_o("decode_bench::ordinary_out", t, deck.model.hidden);
    std::vector<double> b, r;
    ServeRecord last;
    int admitted = 1;
    for (int i = 0; i < o.warmup + o.reps; ++i) {
      MPI_Barrier(world);
      Kokkos::Timer timer;
      last = bucket.step(exec, layer, x, out_b, Phase::decode);
      double const sb = kmoe_bench::slowest_rank(timer.seconds(), world, watchdog, "decode bench: bucket step");
      admitted &= last.replayed ? 1 : 0;
      MPI_Barrier(world);
      timer.reset();
      layer.forward(exec, x, out_o);
      double const so = kmoe_bench::slowest_rank(timer.seconds(), world, watchdog, "decode bench: ordinary step");
      if (i >= o.warmup) {
        b.push_back(sb);
        r.push_back(so);
      }
    }
    auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out_b);
    auto ho = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out_o);
    bool const identical = kmoe_bench::on_every_rank(
        digest_bytes(hb.data(), hb.size() * sizeof(T)) == digest_bytes(ho.data(), ho.size() * sizeof(T)), world, watchdog,
        "decode bench: outputs");
    all_identical &= identical ? 1 : 0;
    double const bs = kmoe_bench::median(b), os = kmoe_bench::median(r);
    kmoe_bench::print_bench("decode_T" + std::to_string(t) + "_np" + std::to_string(size),
                            {{"tokens", std::to_string(t)},
                             {"capacity", std::to_string(o.max_tokens)},
                             {"experts", std::to_string(deck.model.experts)},
                             {"top_k", std::to_string(deck.model.top_k)},
                             {"d", std::to_string(deck.model.hidden)},
                             {"dtype", deck.model.dtype},
                             {"bucket_s", kmoe_bench::fmt(bs)},
                             {"ordinary_s", kmoe_bench::fmt(os)},
                             {"tokens_per_s", kmoe_bench::fmt(bs > 0 ? static_cast<double>(t) * size / bs : 0.0)},
                             {"admitted", admitted ? "yes" : "no(" + to_string(last.refusal) + ")"},
                             {"identical", identical ? "yes" : "no"},
                             {"executed_tokens", std::to_string(last.counts.executed_tokens)},
                             {"useful_tokens", std::to_string(last.counts.useful_tokens)}},
                            os > 0 ? bs / os : 0.0);
  }
  return all_identical ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"decode: decode steps on a bucket next to the ordinary path"};
  DecodeOptions o;
  app.add_option("--deck", o.deck, "TOML input deck")->capture_default_str();
  app.add_option("--max-tokens", o.max_tokens, "bucket token capacity per rank; T doubles from 1 up to it")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "measured steps per path and T")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", o.warmup, "warm-up steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  auto const deck = read_layer_deck(MPI_COMM_WORLD, o.deck);
  if (deck.model.dtype == "bf16") return bench<bf16_t>(deck, o);
  return bench<float>(deck, o);
}

kmoe_bench::Register reg("decode", "decode steps (T = 1..64 per rank) on a decode bucket next to the ordinary path", run);

}  // namespace
