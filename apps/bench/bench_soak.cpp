// kmoe-bench soak: a long run of one MoE layer from a deck (default: the
// DeepSeek-V3-like deck) that alternates every exchange algorithm step by
// step and switches placement generations every --rebalance-every steps
// (even generations: the deck's placement; odd ones: EPLB with replicas from
// the expert loads measured since the last switch; a new layer, new weights
// and new exchanges each time, the old ones released). Step s runs batch
// s % --batches, then (unless --decode-tokens 0) a decode step of its first
// 1 + s % --decode-tokens rows on a decode bucket kept across generations
// (rebound to each new layer); every output must have the digest it had on
// the reference (the deck's placement, flat exchange, ordinary path) before
// the soak started, and every decode step must be admitted. The host heap
// runs with a fixed mmap threshold (KokkosMoE::stable_host_heap; --host-heap
// glibc keeps glibc's sliding one, which grows the resident set by the heap
// pieces left between generations: see KokkosMoE_HostHeap.hpp). Prints resident memory after the warm-up (the first
// generation switch and one step of every algorithm on it) and at the end,
// the slowest rank's growth of the resident set and of the heap bytes in use
// (and, on CUDA builds, the growth of the memory
// in use on the GPU, which host RSS does not see), and the steps whose
// output differed:
//
//   BENCH name=soak_np4 steps=2000 ... rss_growth_mb=... digest_mismatches=0 ratio=<late/early step time>
//
// The ratio compares the mean step time of the last rebalance window with
// the first one after the warm-up (1: no slowdown over the run). Expert
// capacity factors of the pooled-wave exchange are raised so that it drops
// no route (drops would change outputs); the deck's bias update is not run
// (routes stay a function of the batch). Exit code 1 when any step's output
// differed.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_DeviceRuntime.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_HostHeap.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Serve.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

struct SoakOptions {
  std::string deck = "inputs/deepseek_v3.toml";
  int steps = 2000;
  int rebalance_every = 100;
  int batches = 4;
  int slots = 0;  // EPLB generations: physical slots (0: experts + experts / 8, rounded up to the rank count)
  index_t decode_tokens = 4;  // decode bucket capacity per rank (0: no decode steps)
  std::string host_heap = "stable";
};

template <class T>
int soak(LayerDeck const& deck, SoakOptions const& o, std::string const& heap_policy) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  auto const& comms = *setup.comms;
  double const watchdog = deck.exchange.watchdog_seconds;
  index_t const tokens = Setup::tokens_per_rank(deck);
  index_t const first = Setup::first_token(deck, rank);
  int const E = deck.model.experts;
  int slots = o.slots;
  if (slots == 0) slots = ((E + (E + 7) / 8 + size - 1) / size) * size;
  KOKKOSMOE_REQUIRE(slots >= E && slots % size == 0,
                    "soak: --slots " << slots << " must be a multiple of the " << size << " ranks and at least the " << E << " experts");

  auto const router_weight = Setup::router_weight<T, MS>(deck);
  auto const shared = Setup::shared_weights<T, MS>(exec, deck);
  std::vector<RowMatrix<T, MS>> batches;
  for (int b = 0; b < o.batches; ++b) batches.push_back(Setup::hidden_rows<T, MS>(deck, b, first, tokens, rank));
  RowMatrix<T, MS> out("soak::out", tokens, deck.model.hidden);
  index_t const Ct = std::min(o.decode_tokens, tokens);
  RowMatrix<T, MS> decode_out("soak::decode_out", std::max<index_t>(Ct, 1), deck.model.hidden);
  auto decode_rows = [&](int b, index_t t) {
    return RowMatrix<T, MS>(Kokkos::subview(batches[static_cast<std::size_t>(b)], std::make_pair(index_t(0), t), Kokkos::ALL));
  };
  auto decode_view = [&](index_t t) {
    return RowMatrix<T, MS>(Kokkos::subview(decode_out, std::make_pair(index_t(0), t), Kokkos::ALL));
  };

  auto make_layer = [&](Placement const& placement) {
    LayerConfig config = Setup::layer_config(deck, placement);
    double const cf = std::max(8.0, 2.0 * size);
    config.exchange.sender_cf = std::max(config.exchange.sender_cf, cf);
    config.exchange.receiver_cf = std::max(config.exchange.receiver_cf, cf);
    return std::make_unique<MoELayer<T, Exec, MS>>(config, comms, placement, router_weight,
                                                   Setup::routed_weights<T, MS>(exec, deck, placement, comms.epoch(), rank, world),
                                                   shared);
  };
  auto local_digest = [&](RowMatrix<T, MS> const& v) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    return digest_bytes(h.data(), h.size() * sizeof(T));
  };

  // The reference: every batch (and every decode size of it) through the
  // deck's placement, flat exchange, ordinary path.
  auto layer = make_layer(setup.placement);
  std::vector<std::uint64_t> reference, decode_reference;
  for (int b = 0; b < o.batches; ++b) {
    layer->forward(exec, batches[static_cast<std::size_t>(b)], out, Exchange::Algorithm::flat);
    reference.push_back(local_digest(out));
    for (index_t t = 1; t <= Ct; ++t) {
      layer->forward(exec, decode_rows(b, t), decode_view(t), Exchange::Algorithm::flat);
      decode_reference.push_back(local_digest(decode_view(t)));
    }
  }
  // The decode bucket: a step's routes of all ranks onto one slot at most,
  // so that the route capacity never refuses.
  std::unique_ptr<DecodeBucket<T, Exec, MS>> bucket;
  if (Ct > 0) bucket = std::make_unique<DecodeBucket<T, Exec, MS>>(*layer, BucketConfig{Ct, static_cast<index_t>(size) * Ct * deck.model.top_k});
  int refused = 0;

  std::vector<Exchange::Algorithm> const algorithms = {Exchange::Algorithm::flat, Exchange::Algorithm::hierarchical,
                                                       Exchange::Algorithm::pooled_wave};
  std::vector<double> window_load(static_cast<std::size_t>(E), 0.0);
  std::uint64_t generation = 0;
  int mismatches = 0, generations = 1;
  std::int64_t drops = 0;
  int const warm_step = (o.steps > o.rebalance_every + 3 ? o.rebalance_every : 0) + 3;
  HostHeapStats heap_start;
  double device_start = -1, early_s = 0, late_s = 0;
  int early_n = 0, late_n = 0;
  int const late_from = std::max(warm_step, o.steps - o.rebalance_every);
  for (int s = 0; s < o.steps; ++s) {
    if (s > 0 && s % o.rebalance_every == 0) {
      // A new placement generation: release the old layer first.
      ++generation;
      ++generations;
      std::vector<double> global(static_cast<std::size_t>(E));
      allreduce_watched(window_load.data(), global.data(), E, MPI_DOUBLE, MPI_SUM, world, "soak: expert loads", watchdog);
      std::fill(window_load.begin(), window_load.end(), 0.0);
      Placement next;
      if (generation % 2 == 0) {
        next = setup.placement.with_generation(generation);
      } else {
        PlacementSpec spec;
        spec.policy = PlacementPolicy::eplb;
        spec.physical_slots = slots;
        spec.nodes = setup.topology.num_nodes();
        spec.ranks = size;
        spec.generation = generation;
        for (double& x : global) x += 1.0;  // every expert keeps a share
        next = eplb_layer(global, spec).placement.with_nodes(setup.node_of_rank);
      }
      layer.reset();
      layer = make_layer(next);
      if (bucket) bucket->rebind(*layer);
    }
    int const b = s % o.batches;
    auto const rec = layer->forward(exec, batches[static_cast<std::size_t>(b)], out, algorithms[static_cast<std::size_t>(s) % algorithms.size()]);
    for (int e = 0; e < E; ++e) window_load[static_cast<std::size_t>(e)] += static_cast<double>(rec.expert_counts[static_cast<std::size_t>(e)]);
    int differs = local_digest(out) != reference[static_cast<std::size_t>(b)] ? 1 : 0;
    std::int64_t local_drops = rec.routes.dropped + rec.ledger.dispatch.sender_drops + rec.ledger.dispatch.receiver_drops;
    if (bucket) {
      index_t const t = 1 + static_cast<index_t>(s) % Ct;
      auto const served = bucket->step(exec, *layer, decode_rows(b, t), decode_view(t), Phase::decode);
      refused += served.replayed ? 0 : 1;  // the same on every rank
      if (local_digest(decode_view(t)) != decode_reference[static_cast<std::size_t>(b * Ct + t - 1)]) differs = 1;
      local_drops += served.step.routes.dropped;
    }
    double const local[2] = {static_cast<double>(differs), static_cast<double>(local_drops)};
    double reduced[2] = {0, 0};
    allreduce_watched(local, reduced, 2, MPI_DOUBLE, MPI_MAX, world, "soak: step check", watchdog);
    mismatches += reduced[0] > 0 ? 1 : 0;
    drops += static_cast<std::int64_t>(reduced[1]);
    double step_s = 0;
    double const mine = rec.seconds.at("total");
    allreduce_watched(&mine, &step_s, 1, MPI_DOUBLE, MPI_MAX, world, "soak: step time", watchdog);
    if (s + 1 == warm_step) {
      heap_start = host_heap_stats();
      device_start = gpu_memory_used_mb();  // host RSS does not see device views
    }
    if (s >= warm_step && s < warm_step + o.rebalance_every) early_s += step_s, ++early_n;
    if (s >= late_from) late_s += step_s, ++late_n;
    if (rank == 0 && (s + 1) % std::max(1, o.steps / 10) == 0) {
      std::printf("# soak: step %d/%d, generation %llu, rank 0 resident %.1f MiB, %d mismatching step(s)\n", s + 1, o.steps,
                  static_cast<unsigned long long>(generation), host_heap_stats().resident_mb, mismatches);
      std::fflush(stdout);
    }
  }
  HostHeapStats const heap_end = host_heap_stats();
  double const device_end = gpu_memory_used_mb();
  auto growth_of = [](double a, double b) { return a >= 0 && b >= 0 ? b - a : 0.0; };
  auto private_mb = [](HostHeapStats const& h) { return h.resident_mb >= 0 && h.shared_mb >= 0 ? h.resident_mb - h.shared_mb : -1.0; };
  double r[6] = {growth_of(heap_start.resident_mb, heap_end.resident_mb), heap_start.resident_mb, heap_end.resident_mb,
                 growth_of(device_start, device_end), growth_of(heap_start.in_use_mb, heap_end.in_use_mb),
                 growth_of(private_mb(heap_start), private_mb(heap_end))};
  double rmax[6] = {0, 0, 0, 0, 0, 0};
  allreduce_watched(r, rmax, 6, MPI_DOUBLE, MPI_MAX, world, "soak: resident memory", watchdog);
  double const early = early_n ? early_s / early_n : 0.0, late = late_n ? late_s / late_n : 0.0;
  kmoe_bench::print_bench("soak_np" + std::to_string(size),
                          {{"steps", std::to_string(o.steps)},
                           {"generations", std::to_string(generations)},
                           {"algorithms", "flat,hierarchical,pooled_wave"},
                           {"batches", std::to_string(o.batches)},
                           {"deck", deck.path},
                           {"rss_start_mb", kmoe_bench::fmt(rmax[1])},
                           {"rss_end_mb", kmoe_bench::fmt(rmax[2])},
                           {"rss_growth_mb", kmoe_bench::fmt(rmax[0])},
                           {"rss_private_growth_mb", kmoe_bench::fmt(rmax[5])},
                           {"heap_in_use_growth_mb", heap_end.in_use_mb >= 0 ? kmoe_bench::fmt(rmax[4]) : std::string("none")},
                           {"host_heap", heap_policy},
                           {"decode_tokens", std::to_string(Ct)},
                           {"decode_refused", std::to_string(refused)},
                           {"device_growth_mb", device_end >= 0 ? kmoe_bench::fmt(rmax[3]) : std::string("none")},
                           {"digest_mismatches", std::to_string(mismatches)},
                           {"drops", std::to_string(drops)},
                           {"early_step_s", kmoe_bench::fmt(early)},
                           {"late_step_s", kmoe_bench::fmt(late)}},
                          early > 0 ? late / early : 0.0);
  return mismatches == 0 && refused == 0 ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"soak: a long run alternating algorithms and placement generations"};
  SoakOptions o;
  app.add_option("--deck", o.deck, "TOML input deck")->capture_default_str();
  app.add_option("--steps", o.steps, "steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--rebalance-every", o.rebalance_every, "steps per placement generation")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batches", o.batches, "distinct input batches, cycled")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--slots", o.slots, "physical slots of the EPLB generations (0: experts + experts/8, rounded up)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--decode-tokens", o.decode_tokens, "decode bucket capacity per rank; each step adds a decode step of 1..it rows (0: none)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--host-heap", o.host_heap, "stable: a fixed mmap threshold (KokkosMoE::stable_host_heap); glibc: the allocator's sliding one")
      ->check(CLI::IsMember({"stable", "glibc"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  auto const deck = read_layer_deck(MPI_COMM_WORLD, o.deck);
  KOKKOSMOE_REQUIRE(deck.tokens.source != "explicit", "soak: deck '" << deck.path << "' has explicit tokens; the soak draws its batches");
  std::string const heap_policy = o.host_heap == "stable" ? stable_host_heap() : std::string("glibc");
  if (deck.model.dtype == "bf16") return soak<bf16_t>(deck, o, heap_policy);
  return soak<float>(deck, o, heap_policy);
}

kmoe_bench::Register reg("soak", "long run alternating exchange algorithms and placement generations (DeepSeek-V3-like deck): "
                                 "resident memory growth and output digest mismatches",
                         run);

}  // namespace
