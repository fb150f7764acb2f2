// kmoe-bench calibrate: measures the exchange cost model's parameters on this
// machine (KokkosMoE_Exchange_CostModel.hpp), on the deck's topology and,
// when the deck has one, under its emulated fabric; writes them to a JSON
// file that kmoe-exchange --cost-model reads.
//
//   mpiexec -n 4 kmoe-bench calibrate --deck inputs/fabric_2x2.toml --out cost_model.json
//
// Every message goes through the library's MPI transport (so an emulated
// fabric delays it exactly as it delays an exchange's). Per link class, the
// one-way time of a ping-pong at sizes from 8 B to --max-bytes, fitted with
// alpha + beta * bytes:
//   same_rank   a local copy of that size (all ranks at once, up to --copy-bytes)
//   intra_node  rank pairs of one node, all pairs at once (the machine's own cost)
//   inter_node  rank pairs across nodes, all pairs at once, fabric off (the
//               transport's own cost; on one host it moves like intra-node)
//   nic         one pair across nodes alone, under the fabric (its NIC's
//               exclusive time per message; only with a fabric), or, nodes
//               on real hosts (hwloc layout, host names differ), every
//               rank of a host with its partner across the hosts' network,
//               both ways at once (as an exchange loads the link), per byte
//               of all their traffic; inter_node is then the same (a rank
//               alone on the link sees the link)
// plus the fixed cost of a stage's agreements. One BENCH line per link class:
//   BENCH name=calibrate_<link> alpha_us=... beta_gbps=... ratio=<fitted time of a 1 MiB message / baseline>
// where the baseline is a same-run memcpy of 1 MiB (same_rank, intra_node,
// inter_node) or the fabric's own model cost of a 1 MiB message (nic: 1 means
// the emulation adds only what it states). The buffers are host memory: on a
// GPU build the fitted costs describe host transfers, not device-memory ones
// (CUDA-aware or staged), so a model for GPU exchanges needs its own fit.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Exchange_CostModel.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Report.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unistd.h>

namespace {

using namespace KokkosMoE;
using Exchange::TransportOptions;

struct CalibrateOptions {
  std::string deck = "inputs/fabric_2x2.toml";
  std::string out = "cost_model.json";
  double max_bytes = 32 << 20;
  double copy_bytes = 256 << 20;
  int reps = 5;
};

/// One-way seconds of a ping-pong of `bytes` with `partner` (global rank in
/// comm; -1: this rank idles), the median of reps, the slowest pair's.
double pingpong(Topology::Communicator const& comm, int partner, std::size_t bytes, int reps, TransportOptions const& o,
                double watchdog) {
  std::vector<unsigned char> buf(std::max<std::size_t>(bytes, 1), 1);
  std::vector<double> t;
  if (partner >= 0) {
    int const me = comm.global_rank(comm.my_slot());
    int const peer = comm.slot_of(partner);
    bool const first = me < partner;
    auto move = [&](bool receive) {
      std::vector<Exchange::Impl::Pending> p;
      Exchange::Impl::post(comm, receive, buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 6990, p, o);
      Exchange::Impl::wait_all(comm, p, "calibrate ping-pong", o);
    };
    for (int i = 0; i < reps + 1; ++i) {
      Kokkos::Timer timer;
      move(!first);
      move(first);
      if (i > 0) t.push_back(timer.seconds() / 2);
    }
    std::sort(t.begin(), t.end());
  }
  double mine = t.empty() ? 0.0 : t[t.size() / 2], slowest = 0;
  allreduce_watched(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm.comm(), "calibrate", watchdog);
  return slowest;
}

/// Seconds of `bytes` sent to every rank of `partners` while as many arrive
/// from each (both directions at once, every pair at once, as an exchange
/// stage loads a link), the median of reps, the slowest rank's; a rank with
/// no partners idles.
double both_ways(Topology::Communicator const& comm, std::vector<int> const& partners, std::size_t bytes, int reps,
                 TransportOptions const& o, double watchdog) {
  std::size_t const n = std::max<std::size_t>(bytes, 1);
  std::vector<unsigned char> out(n * std::max<std::size_t>(partners.size(), 1), 1), in(out.size(), 0);
  std::vector<double> t;
  if (!partners.empty()) {
    for (int i = 0; i < reps + 1; ++i) {
      Kokkos::Timer timer;
      std::vector<Exchange::Impl::Pending> p;
      for (std::size_t q = 0; q < partners.size(); ++q)
        Exchange::Impl::post(comm, true, in.data() + q * n, static_cast<int>(bytes), MPI_BYTE, comm.slot_of(partners[q]), 6991, p, o);
      for (std::size_t q = 0; q < partners.size(); ++q)
        Exchange::Impl::post(comm, false, out.data() + q * n, static_cast<int>(bytes), MPI_BYTE, comm.slot_of(partners[q]), 6991, p, o);
      Exchange::Impl::wait_all(comm, p, "calibrate both ways", o);
      if (i > 0) t.push_back(timer.seconds());
    }
    std::sort(t.begin(), t.end());
  }
  double mine = t.empty() ? 0.0 : t[t.size() / 2], slowest = 0;
  allreduce_watched(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm.comm(), "calibrate", watchdog);
  return slowest;
}

std::vector<std::size_t> sizes_up_to(double max_bytes) {
  std::vector<std::size_t> s;
  for (std::size_t b = 8; static_cast<double>(b) <= max_bytes; b *= 8) s.push_back(b);
  if (s.empty() || static_cast<double>(s.back()) < max_bytes) s.push_back(static_cast<std::size_t>(max_bytes));
  return s;
}

int run(int argc, char** argv) {
  CLI::App app{"calibrate: the exchange cost model's parameters on this machine (and the deck's emulated fabric)"};
  CalibrateOptions o;
  app.add_option("--deck", o.deck, "TOML deck whose topology (and [topology.fabric]) to calibrate on")->capture_default_str();
  app.add_option("--out", o.out, "cost model file (JSON) to write")->capture_default_str();
  app.add_option("--max-bytes", o.max_bytes, "largest message")->check(CLI::Range(64.0, 1e9))->capture_default_str();
  app.add_option("--copy-bytes", o.copy_bytes, "largest local copy (large enough that ranks sharing cores contend, as in an exchange)")
      ->check(CLI::Range(64.0, 1e10))
      ->capture_default_str();
  app.add_option("--reps", o.reps, "repetitions per size (median)")->check(CLI::PositiveNumber)->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  auto const deck = read_layer_deck(world, o.deck);
  collective(world, "calibrate", [&] { KOKKOSMOE_REQUIRE(size >= 2, "calibrate needs at least 2 ranks (mpiexec -n 4 ...)"); });
  auto setup = Setup::make_run(deck, world);
  auto const& topo = setup.topology;
  auto const& ep = setup.comms->ep();
  double const watchdog = deck.exchange.watchdog_seconds;
  TransportOptions with_fabric = setup.config.exchange.transport_options();
  TransportOptions plain = with_fabric;
  plain.fabric.reset();
  auto const sizes = sizes_up_to(o.max_bytes);

  Exchange::CostModel model;
  model.fabric = deck.topology.fabric;
  model.nics_per_node = deck.topology.fabric.nics_per_node;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  model.evidence = deck.topology.fabric.enabled() ? "emulated" : "measured";
  model.origin = std::string("kmoe-bench calibrate on ") + host + ", " + std::to_string(size) + " ranks, " + std::to_string(topo.num_nodes()) +
                 " nodes (" + to_string(deck.topology.layout) + ")" +
                 (deck.topology.fabric.enabled() ? ", " + deck.topology.fabric.describe() : std::string(", no fabric"));
  auto fit = [&](std::string const& link, std::vector<std::pair<double, double>> const& pts) {
    for (auto const& [b, s] : pts) model.samples.push_back({link, b, s});
    return Exchange::fit_alpha_beta(pts);
  };

  // same_rank: local copies, every rank at once, up to sizes that take long
  // enough for ranks sharing a core to see each other.
  std::vector<std::pair<double, double>> pts;
  for (auto b : sizes_up_to(o.copy_bytes)) {
    std::vector<unsigned char> a(b, 1), c(b, 0);
    double mine = kmoe_bench::median_seconds(1, o.reps, [&] {
      std::memcpy(c.data(), a.data(), b);
      asm volatile("" : : "r"(c.data()) : "memory");
    });
    double slowest = 0;
    allreduce_watched(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, world, "calibrate", watchdog);
    pts.push_back({static_cast<double>(b), slowest});
  }
  model.same_rank = fit("same_rank", pts);
  double const memcpy_mib = model.same_rank.seconds(1, 1 << 20);
  // Pack and unpack: the deck's rows (fp32, width d) encoded into its
  // payload and decoded back by the exchange's row kernels, every rank at
  // once; per payload byte of one pass.
  {
    using MS = Kokkos::DefaultExecutionSpace::memory_space;
    using Exec = Kokkos::DefaultExecutionSpace;
    int const d = deck.model.hidden;
    auto const t = deck.model.payload;
    std::int64_t const rb = payload_row_bytes(t, d);
    index_t const n = std::max<index_t>(1, static_cast<index_t>(o.copy_bytes / 4 / static_cast<double>(rb)));
    RowMatrix<float, MS> x("calibrate::x", n, d), y("calibrate::y", n, d);
    Kokkos::deep_copy(x, 0.5f);
    PayloadBuffer<MS> buf("calibrate::payload", t, d, n);
    Exec exec;
    // The exchange's own row kernels in the exchange's access patterns.
    // Pack: each of n / top_k token rows feeds top_k payload rows, read in a
    // scattered order (a token's rows leave in destination order). Repack:
    // arrived rows land in their expert rows in runs (a source's rows for
    // one expert arrive together), the runs scattered. Return encode: the
    // expert outputs leave for the return payload in the same runs.
    index_t const tokens = std::max<index_t>(1, n / std::max(1, deck.model.top_k));
    // Rows of one source for one expert: the deck's tokens per rank, top_k
    // and experts (at least one row).
    index_t const run = std::max<index_t>(
        1, std::min<index_t>(n, static_cast<index_t>(Setup::tokens_per_rank(deck)) * deck.model.top_k / std::max(1, deck.model.experts)));
    index_t const runs = n / run;  // the last partial run stays in place
    Kokkos::View<index_t*, MS> jump("calibrate::jump", n), in_runs("calibrate::in_runs", n);
    // p * 2654435761 mod m permutes [0, m): the multiplier is a prime above m.
    Kokkos::parallel_for(
        "calibrate::jump", Kokkos::RangePolicy<Exec>(exec, 0, n), KOKKOS_LAMBDA(index_t p) {
          jump(p) = static_cast<index_t>((static_cast<std::uint64_t>(p) * 2654435761ULL) % static_cast<std::uint64_t>(n));
          index_t const r = p / run;
          in_runs(p) = r < runs ? static_cast<index_t>((static_cast<std::uint64_t>(r) * 2654435761ULL) % static_cast<std::uint64_t>(runs)) * run + p % run
                                : p;
        });
    double const enc = kmoe_bench::median_seconds(1, o.reps, [&] {
      gather_rows(exec, x, KOKKOS_LAMBDA(index_t p)->index_t { return jump(p) % tokens; }, buf, "calibrate::pack");
      exec.fence();
    });
    double const dec = kmoe_bench::median_seconds(1, o.reps, [&] {
      scatter_rows(exec, buf, KOKKOS_LAMBDA(index_t p)->index_t { return in_runs(p); }, y, "calibrate::repack");
      exec.fence();
    });
    double const ret = kmoe_bench::median_seconds(1, o.reps, [&] {
      gather_rows(exec, y, KOKKOS_LAMBDA(index_t p)->index_t { return in_runs(p); }, buf, "calibrate::unrepack");
      exec.fence();
    });
    double mine[3] = {enc, dec, ret}, slowest[3] = {0, 0, 0};
    allreduce_watched(mine, slowest, 3, MPI_DOUBLE, MPI_MAX, world, "calibrate", watchdog);
    double const bytes = static_cast<double>(n) * static_cast<double>(rb);
    model.encode_s_per_byte = slowest[0] / bytes;
    model.decode_s_per_byte = slowest[1] / bytes;
    model.return_encode_s_per_byte = slowest[2] / bytes;
    model.samples.push_back({"encode", bytes, slowest[0]});
    model.samples.push_back({"decode", bytes, slowest[1]});
    model.samples.push_back({"return_encode", bytes, slowest[2]});
  }

  // Partners: local rank pairs (0,1), (2,3)... of a node; equal local ranks of nodes (0,1), (2,3)...
  int const node = topo.node_of(rank), local = topo.local_rank_of(rank);
  auto const& mine_node = topo.ranks_of_node(node);
  int intra = -1, inter = -1;
  if ((local ^ 1) < static_cast<int>(mine_node.size())) intra = mine_node[static_cast<std::size_t>(local ^ 1)];
  if ((node ^ 1) < topo.num_nodes() && local < static_cast<int>(topo.ranks_of_node(node ^ 1).size()))
    inter = topo.ranks_of_node(node ^ 1)[static_cast<std::size_t>(local)];
  auto measure = [&](std::string const& link, int partner, TransportOptions const& opts, bool any) {
    std::vector<std::pair<double, double>> p;
    if (!any) return Exchange::LinkCost{};
    for (auto b : sizes) p.push_back({static_cast<double>(b), pingpong(ep, partner, b, o.reps, opts, watchdog)});
    return fit(link, p);
  };
  int any_intra = intra >= 0, any_inter = inter >= 0, flags[2] = {0, 0};
  int const mine_flags[2] = {any_intra, any_inter};
  allreduce_watched(mine_flags, flags, 2, MPI_INT, MPI_MAX, world, "calibrate", watchdog);
  model.intra_node = measure("intra_node", intra, with_fabric, flags[0] != 0);
  model.inter_node = measure("inter_node", inter, plain, flags[1] != 0);
  if (flags[0] == 0) model.intra_node = model.inter_node;  // one rank per node: no intra-node pairs to measure
  if (flags[1] == 0) model.inter_node = model.intra_node;  // one node
  double nic_stated_mib = 0;
  // Nodes on different hosts share their host's network link, loaded both
  // ways at once by an exchange (data out, the acknowledgements of the data
  // in). Its time per byte one way of all the traffic (and per message of
  // one rank's) is measured twice, as an exchange stage may load it: every
  // rank of the first two nodes with its partner across (one connection
  // pair per rank: nic_one_pair), and with every rank across at once (all
  // pairs: nic_all_pairs). The faster link is the nic cost: one TCP
  // connection alone may not fill a fast link, and many may collide in a
  // slow one's queue. It is also the inter_node cost of a rank alone on the
  // link (a relay).
  bool const real_hosts = !deck.topology.fabric.enabled() && topo.kind() == Topology::LayoutKind::hwloc && topo.num_nodes() >= 2 &&
                          topo.rank(topo.ranks_of_node(0).front()).host != topo.rank(topo.ranks_of_node(1).front()).host;
  if ((deck.topology.fabric.enabled() || real_hosts) && topo.num_nodes() >= 2) {
    int const a = topo.ranks_of_node(0).front(), b = topo.ranks_of_node(1).front();
    int const partner = rank == a ? b : rank == b ? a : -1;
    if (real_hosts) {
      auto const& n0 = topo.ranks_of_node(0);
      auto const& n1 = topo.ranks_of_node(1);
      std::vector<int> across, one;
      if (node == 0) across = n1;
      if (node == 1) across = n0;
      if (inter >= 0 && node < 2) one = {inter};
      auto link_of = [&](char const* name, std::vector<int> const& partners, double pairs, double messages) {
        std::vector<std::pair<double, double>> p;
        for (auto bytes : sizes) p.push_back({pairs * static_cast<double>(bytes), both_ways(ep, partners, bytes, o.reps, plain, watchdog)});
        auto l = fit(name, p);
        l.alpha_s /= messages;
        return l;
      };
      auto const one_pair = link_of("nic_one_pair", one, static_cast<double>(std::min(n0.size(), n1.size())), 1.0);
      auto const all_pairs = link_of("nic_all_pairs", across, static_cast<double>(n0.size() * n1.size()), static_cast<double>(n1.size()));
      model.nic = all_pairs.beta_s_per_byte < one_pair.beta_s_per_byte ? all_pairs : one_pair;
      model.inter_node = model.nic;
      model.inter_node.alpha_s = model.nic.alpha_s * (all_pairs.beta_s_per_byte < one_pair.beta_s_per_byte ? static_cast<double>(n1.size()) : 1.0);
      model.nics_per_node = 1;
      if (rank == 0)
        std::printf("# calibrate: host link %.4g GB/s with one connection pair per rank, %.4g GB/s with all pairs; the model takes %s\n",
                    one_pair.beta_s_per_byte > 0 ? 1e-9 / one_pair.beta_s_per_byte : 0.0,
                    all_pairs.beta_s_per_byte > 0 ? 1e-9 / all_pairs.beta_s_per_byte : 0.0,
                    all_pairs.beta_s_per_byte < one_pair.beta_s_per_byte ? "all pairs" : "one pair");
    } else {
      model.nic = measure("nic", partner, with_fabric, true);
      nic_stated_mib = 1e-9 * static_cast<double>(deck.topology.fabric.cost_ns(true, 1 << 20));
    }
  }
  // A stage's fixed cost, per algorithm: an exchange of one token per rank
  // (its rows cost next to nothing), fabric off; the slowest rank's time per
  // stage. Without layer decks' token sources (explicit, trace): the count
  // and result agreements of a stage alone.
  std::vector<index_t> zeros(static_cast<std::size_t>(ep.size()), 0);
  double mine_stage = kmoe_bench::median_seconds(2, o.reps, [&] {
    Exchange::agree_counts(ep, zeros, 0, nullptr, "calibrate stage", plain);
    agree(ep.comm(), std::string(), "calibrate stage", watchdog);
  });
  allreduce_watched(&mine_stage, &model.stage_s, 1, MPI_DOUBLE, MPI_MAX, world, "calibrate", watchdog);
  if (deck.tokens.source != "explicit" && deck.tokens.source != "trace") {
    using MS = Kokkos::DefaultExecutionSpace::memory_space;
    using Exec = Kokkos::DefaultExecutionSpace;
    Exec exec;
    LayerDeck tiny = deck;
    tiny.tokens.per_rank = 1;
    if (tiny.tokens.source == "router") tiny.tokens.source = "uniform";
    tiny.topology.fabric = Exchange::FabricSpec{};
    auto run = Setup::make_run(tiny, world);
    std::vector<int> slot_expert;
    for (int s : run.placement.slots_of_rank(rank)) slot_expert.push_back(run.placement.slot(s).expert);
    auto experts = Experts::ExpertWeights<float, MS>::scalar("calibrate::experts", slot_expert, tiny.model.hidden,
                                                            std::vector<float>(static_cast<std::size_t>(tiny.model.experts), 1.0f));
    LayerConfig config = run.config;
    config.runner.kind = Experts::RunnerKind::scalar;
    RowMatrix<float, MS> router_weight("calibrate::router_weight", tiny.model.experts, tiny.model.hidden);
    MoELayer<float, Exec, MS> layer(config, *run.comms, run.placement, router_weight, experts);
    Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
    auto const table = Setup::sampled_routes<MS>(exec, tiny, config, 0, Setup::first_token(tiny, rank), 1, rank, explicit_slot);
    auto const hidden = Setup::hidden_rows<float, MS>(tiny, 0, Setup::first_token(tiny, rank), 1, rank);
    RowMatrix<float, MS> out("calibrate::out", 1, tiny.model.hidden);
    for (auto const& name : enum_names<Exchange::Algorithm>()) {
      auto const algo = from_string<Exchange::Algorithm>(name);
      std::size_t stages = 1;
      double const t = kmoe_bench::median_seconds(1, o.reps, [&] {
        auto rec = layer.forward_routes(exec, hidden, table, out, algo, explicit_slot);
        stages = std::max<std::size_t>(1, rec.ledger.dispatch.stages.size() + rec.ledger.combine.stages.size());
      });
      double const per_stage = t / static_cast<double>(stages);
      double slowest = 0;
      allreduce_watched(&per_stage, &slowest, 1, MPI_DOUBLE, MPI_MAX, world, "calibrate", watchdog);
      model.stage_s_of[name] = slowest;
    }
  }

  auto line = [&](std::string const& link, Exchange::LinkCost const& l, double baseline) {
    kmoe_bench::print_bench("calibrate_" + link,
                            {{"ranks", std::to_string(size)},
                             {"nodes", std::to_string(topo.num_nodes())},
                             {"evidence", link == "nic" && !real_hosts ? "emulated" : "measured"},
                             {"alpha_us", kmoe_bench::fmt(l.alpha_s * 1e6)},
                             {"beta_gbps", kmoe_bench::fmt(l.beta_s_per_byte > 0 ? 1e-9 / l.beta_s_per_byte : 0.0)},
                             {"mib_us", kmoe_bench::fmt(l.seconds(1, 1 << 20) * 1e6)},
                             {"baseline_mib_us", kmoe_bench::fmt(baseline * 1e6)}},
                            baseline > 0 ? l.seconds(1, 1 << 20) / baseline : 0.0);
  };
  line("same_rank", model.same_rank, memcpy_mib);
  line("intra_node", model.intra_node, memcpy_mib);
  line("inter_node", model.inter_node, memcpy_mib);
  if (nic_stated_mib > 0) line("nic", model.nic, nic_stated_mib);
  if (real_hosts) line("nic", model.nic, memcpy_mib);
  collective(world, "writing the cost model", [&] {
    if (rank != 0) return;
    write_text_file(o.out, model.to_json(2) + "\n");
    auto gbps = [](double s_per_byte) { return s_per_byte > 0 ? 1e-9 / s_per_byte : 0.0; };
    std::printf("cost model (%s): %s\n  stage (agreements) %.1f us, pack %.2f GB/s, unpack %.2f GB/s and return pack %.2f GB/s of payload\n",
                model.evidence.c_str(), o.out.c_str(), model.stage_s * 1e6, gbps(model.encode_s_per_byte), gbps(model.decode_s_per_byte),
                gbps(model.return_encode_s_per_byte));
    for (auto const& [a, v] : model.stage_s_of) std::printf("  stage of %s: %.1f us\n", a.c_str(), v * 1e6);
  });
  return 0;
}

kmoe_bench::Register reg("calibrate", "exchange cost model parameters (alpha-beta per link class, NIC of an emulated fabric) to a file", run);

}  // namespace
