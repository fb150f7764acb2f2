// kmoe-layer: runs steps of one MoE layer from a TOML deck on every rank.
//
//   mpiexec -n 4 kmoe-layer inputs/quickstart.toml [--steps N] [--report file.json]
//
// Rank 0 echoes the build, the Kokkos configuration and the resolved deck,
// prints a progress line on long runs, a per-stage summary (and, with
// [run] compare = [...], the algorithms side by side on the same routes with
// an output check), writes the JSON report and the HDF5 time series, and ends
// with one greppable line: PERFORMANCE key=value ...

#include <KokkosMoE_BiasController.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using json = nlohmann::json;

struct Options {
  std::string deck;
  int steps = -1;
  int warmup = -1;
  std::string report;
  std::string hdf5;
  std::string algorithm;
  bool print_output = false;
};

/// Per-algorithm accumulation over the measured steps.
struct Totals {
  std::map<std::string, double> seconds;  // sum over steps of the slowest rank's stage time
  int steps = 0;
  Exchange::ByteLedger ledger;            // last step, summed over ranks
  std::int64_t dropped = 0, attempted = 0, accepted = 0;
  bool identical = true;                  // compare mode: equal to the first algorithm
  double max_abs_diff = 0;
};

std::string fmt(double v, int p = 4) {
  std::ostringstream os;
  os.precision(p);
  os << v;
  return os.str();
}

/// Slowest rank's time of every stage (same key set on every rank).
std::map<std::string, double> slowest(std::map<std::string, double> const& local, MPI_Comm comm) {
  std::vector<std::string> keys;
  for (auto const& kv : local) keys.push_back(kv.first);
  // Union of keys across ranks: every rank sends its key list to rank 0 ... all
  // ranks run the same stages, so agree on the count and take the local order.
  std::vector<double> v, out;
  for (auto const& k : keys) v.push_back(local.at(k));
  int n = static_cast<int>(v.size()), nmax = 0;
  MPI_Allreduce(&n, &nmax, 1, MPI_INT, MPI_MAX, comm);
  KOKKOSMOE_REQUIRE(n == nmax, "ranks timed different stages (" << n << " vs " << nmax << ")");
  out.resize(v.size());
  MPI_Allreduce(v.data(), out.data(), n, MPI_DOUBLE, MPI_MAX, comm);
  std::map<std::string, double> r;
  for (std::size_t i = 0; i < keys.size(); ++i) r[keys[i]] = out[i];
  return r;
}

template <class T>
int run_typed(LayerDeck const& deck, Options const& opt) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world);
  int const size = comm_size(world);
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  auto const& topo = setup.topology;
  auto const& comms = *setup.comms;
  auto const& placement = setup.placement;
  auto const& config = setup.config;
  auto router_weight = Setup::router_weight<T, MS>(deck);
  auto routed = Setup::routed_weights<T, MS>(exec, deck, placement, rank, world);
  auto shared = Setup::shared_weights<T, MS>(exec, deck);
  MoELayer<T, Exec, MS> layer(config, comms, placement, router_weight, routed, shared);

  if (rank == 0) {
    std::cout << "topology: " << topo.num_nodes() << " node(s), " << size << " rank(s), relays/node "
              << comms.layout().relays_per_node << "\n"
              << comms.table() << "placement: " << placement.num_slots() << " slots for " << placement.num_experts()
              << " experts (" << deck.placement.policy << ")\n";
  }

  std::unique_ptr<BiasController> bias;
  if (deck.bias_update != "none")
    bias = std::make_unique<BiasController>(bias_update_rule_from_string(deck.bias_update), BiasSchedule::constant(deck.bias_gamma));

  std::vector<std::string> algorithms = deck.run.compare;
  if (algorithms.empty()) algorithms.push_back(opt.algorithm.empty() ? deck.exchange.algorithm : opt.algorithm);
  int const warmup = opt.warmup >= 0 ? opt.warmup : deck.run.warmup;
  int const steps = opt.steps >= 0 ? opt.steps : deck.run.steps;
  int const every = deck.run.progress_every > 0 ? deck.run.progress_every : std::max(1, steps / 10);
  index_t const tokens = Setup::tokens_per_rank(deck);
  index_t const first = Setup::first_token(deck, rank);
  std::map<std::string, Totals> totals;
  StepSeries series;
  Kokkos::Timer run_timer;
  std::vector<RowMatrix<T, MS>> outs;

  for (int step = 0; step < warmup + steps; ++step) {
    bool const measured = step >= warmup;
    auto hidden = Setup::hidden_rows<T, MS>(deck, step, first, tokens, rank);
    RouteTable<MS> table;
    Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
    double router_s = 0;
    bool const routed_by_router = deck.tokens.source == "router";
    if (!routed_by_router) table = Setup::sampled_routes<MS>(exec, deck, config, step, first, tokens, rank, explicit_slot);
    outs.resize(algorithms.size());
    std::vector<std::vector<float>> host_out(algorithms.size());
    std::vector<index_t> counts;
    for (std::size_t a = 0; a < algorithms.size(); ++a) {
      auto const algo = exchange_algorithm_from_string(algorithms[a]);
      if (outs[a].extent(0) != hidden.extent(0) || outs[a].extent(1) != hidden.extent(1))
        outs[a] = RowMatrix<T, MS>("kmoe-layer::out", hidden.extent(0), hidden.extent(1));
      StepRecord rec;
      if (routed_by_router && a == 0 && algorithms.size() == 1) {
        rec = layer.forward(exec, hidden, outs[a], algo);
        table = layer.routes();
      } else {
        if (routed_by_router && a == 0) {
          Kokkos::Timer t;
          RouteOptions<MS> ro;
          ro.gemm_path = config.router_gemm;
          layer.router().route(exec, hidden, router_weight, table, ro);
          router_s = t.seconds();
        }
        rec = layer.forward_routes(exec, hidden, table, outs[a], algo, explicit_slot);
        if (routed_by_router) {
          rec.seconds["router"] += router_s;
          rec.seconds["total"] += router_s;
        }
      }
      rec.seconds["other"] = std::max(0.0, rec.unaccounted_seconds());
      auto const sl = slowest(rec.seconds, world);
      auto const ledger = rec.ledger.reduced(world);
      auto const rc = reduce_route_counts(rec.routes, world);
      if (algorithms.size() > 1) {
        auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), outs[a]);
        host_out[a].resize(h.size());
        for (std::size_t i = 0; i < h.size(); ++i) host_out[a][i] = to_float(h.data()[i]);
      }
      counts = rec.expert_counts;
      if (measured) {
        auto& tot = totals[algorithms[a]];
        for (auto const& kv : sl) tot.seconds[kv.first] += kv.second;
        ++tot.steps;
        tot.ledger = ledger;
        tot.attempted += rc.attempted;
        tot.accepted += rc.accepted;
        tot.dropped += rc.dropped;
        std::string const pre = algorithms.size() > 1 ? algorithms[a] + "/" : std::string();
        for (auto const& kv : sl) series.add(pre + "seconds_" + kv.first, kv.second);
        series.add(pre + "dropped_routes", static_cast<double>(rc.dropped + ledger.dispatch.sender_drops + ledger.dispatch.receiver_drops));
        series.add(pre + "inter_node_payload_bytes", static_cast<double>(ledger.dispatch.inter_node_payload_bytes()));
        series.add(pre + "intra_node_payload_bytes", static_cast<double>(ledger.dispatch.by_class(Exchange::LinkClass::intra_node).payload_bytes));
        series.add(pre + "same_rank_rows", static_cast<double>(ledger.dispatch.by_class(Exchange::LinkClass::same_rank).rows));
        series.add(pre + "relay_rows", static_cast<double>(ledger.dispatch.relay_rows()));
        series.add(pre + "sender_drops", static_cast<double>(ledger.dispatch.sender_drops));
        series.add(pre + "receiver_drops", static_cast<double>(ledger.dispatch.receiver_drops));
      }
    }
    // Compare mode: every algorithm must reproduce the first one's output.
    if (algorithms.size() > 1 && measured) {
      for (std::size_t a = 1; a < algorithms.size(); ++a) {
        double diff = 0;
        int same = host_out[a].size() == host_out[0].size() ? 1 : 0;
        if (same) {
          same = std::memcmp(host_out[a].data(), host_out[0].data(), host_out[0].size() * sizeof(float)) == 0;
          for (std::size_t i = 0; i < host_out[0].size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(host_out[a][i] - host_out[0][i])));
        }
        int all_same = 0;
        double max_diff = 0;
        MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, world);
        MPI_Allreduce(&diff, &max_diff, 1, MPI_DOUBLE, MPI_MAX, world);
        auto& tot = totals[algorithms[a]];
        tot.identical = tot.identical && all_same == 1;
        tot.max_abs_diff = std::max(tot.max_abs_diff, max_diff);
      }
    }
    // Global load per expert, balance of the step, bias update for the next one.
    std::vector<index_t> global(counts.size());
    MPI_Allreduce(counts.data(), global.data(), static_cast<int>(counts.size()), MPI_INT64_T, MPI_SUM, world);
    if (measured) {
      std::vector<double> row(global.begin(), global.end());
      series.add_row("expert_load", row);
      double mx = 0, mean = 0;
      for (double x : row) {
        mx = std::max(mx, x);
        mean += x;
      }
      mean /= std::max<std::size_t>(1, row.size());
      series.add("expert_load_max_over_mean", mean > 0 ? mx / mean : 0.0);
    }
    if (bias) {
      Kokkos::View<index_t*, MS> gc("kmoe-layer::global_counts", global.size());
      auto hg = Kokkos::create_mirror_view(gc);
      for (std::size_t e = 0; e < global.size(); ++e) hg(e) = global[e];
      Kokkos::deep_copy(gc, hg);
      bias->update(exec, gc, layer.router().correction_bias());
    }
    if (rank == 0 && measured && ((step - warmup + 1) % every == 0 || step + 1 == warmup + steps) && steps >= 20) {
      std::printf("progress: step %d/%d (%.1f s elapsed)\n", step - warmup + 1, steps, run_timer.seconds());
      std::fflush(stdout);
    }
  }

  if (opt.print_output) {
    // Gathered to rank 0 so the lines come out in rank order.
    std::ostringstream mine;
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), outs[0]);
    for (std::size_t t = 0; t < h.extent(0); ++t) {
      mine << "output rank " << rank << " token " << t << ":";
      for (std::size_t c = 0; c < h.extent(1); ++c) mine << " " << std::setprecision(6) << static_cast<double>(to_float(h(t, c)));
      mine << "\n";
    }
    auto const all = allgather_strings(world, mine.str());
    if (rank == 0)
      for (auto const& text : all) std::cout << text;
    std::cout << std::flush;
  }

  // Summary, report, PERFORMANCE line (rank 0).
  json report;
  report["build"] = build_summary();
  report["deck"] = deck.path;
  report["resolved_deck"] = deck.resolved();
  report["ranks"] = size;
  report["nodes"] = topo.num_nodes();
  report["tokens_per_rank"] = tokens;
  report["steps"] = steps;
  report["warmup"] = warmup;
  report["topology"] = json::parse(comms.to_json(0));
  std::string perf;
  std::ostringstream summary;
  summary << "\n" << std::left << std::setw(14) << "algorithm" << std::right << std::setw(11) << "step_s" << std::setw(13)
          << "tokens/s/rk";
  std::vector<std::string> const stage_order = {"router", "route_plan", "pack", "dispatch", "experts", "combine_exchange",
                                                "exchange", "combine", "shared_experts", "statistics"};
  for (auto const& s : stage_order) summary << std::setw(11) << s.substr(0, 10);
  summary << std::setw(8) << "other%" << std::setw(12) << "inter_B" << std::setw(12) << "intra_B" << std::setw(9) << "drops"
          << (algorithms.size() > 1 ? "  identical" : "") << "\n";
  for (auto const& algo : algorithms) {
    auto const& tot = totals[algo];
    int const n = std::max(1, tot.steps);
    double const step_s = tot.seconds.count("total") ? tot.seconds.at("total") / n : 0.0;
    // Time outside the measured stages (the slowest rank's, per step).
    double const other = step_s > 0 && tot.seconds.count("other") ? tot.seconds.at("other") / n / step_s : 0.0;
    double const tps = step_s > 0 ? static_cast<double>(tokens) / step_s : 0.0;
    std::int64_t const drops = tot.dropped + tot.ledger.dispatch.sender_drops + tot.ledger.dispatch.receiver_drops;
    summary << std::left << std::setw(14) << algo << std::right << std::setw(11) << fmt(step_s) << std::setw(13) << fmt(tps);
    for (auto const& s : stage_order) summary << std::setw(11) << (tot.seconds.count(s) ? fmt(tot.seconds.at(s) / n, 3) : "-");
    summary << std::setw(8) << fmt(100 * other, 3) << std::setw(12) << tot.ledger.dispatch.inter_node_payload_bytes()
            << std::setw(12) << tot.ledger.dispatch.by_class(Exchange::LinkClass::intra_node).payload_bytes << std::setw(9)
            << drops;
    if (algorithms.size() > 1)
      summary << (algo == algorithms[0] ? "  (reference)" : tot.identical ? "  yes" : "  NO (max |diff| " + fmt(tot.max_abs_diff) + ")");
    summary << "\n";
    json a;
    a["steps"] = tot.steps;
    a["step_seconds"] = step_s;
    a["tokens_per_second_per_rank"] = tps;
    json st;
    for (auto const& kv : tot.seconds) st[kv.first] = kv.second / n;
    a["stage_seconds"] = st;
    a["unaccounted_fraction"] = other;
    a["routes"] = {{"attempted", tot.attempted}, {"accepted", tot.accepted}, {"dropped", tot.dropped}};
    a["ledger_last_step"] = json::parse(tot.ledger.to_json(0));
    if (algorithms.size() > 1) a["identical_to_" + algorithms[0]] = tot.identical, a["max_abs_diff"] = tot.max_abs_diff;
    report["algorithms"][algo] = a;
    if (perf.empty()) {
      std::ostringstream p;
      p << "PERFORMANCE algorithm=" << algo << " ranks=" << size << " nodes=" << topo.num_nodes() << " tokens_per_rank=" << tokens
        << " steps=" << tot.steps << " step_s=" << fmt(step_s) << " tokens_per_s_per_rank=" << fmt(tps);
      for (auto const& s : stage_order)
        if (tot.seconds.count(s)) p << " " << s << "_s=" << fmt(tot.seconds.at(s) / n);
      p << " other_pct=" << fmt(100 * other, 3) << " inter_node_bytes=" << tot.ledger.dispatch.inter_node_payload_bytes()
        << " relay_rows=" << tot.ledger.dispatch.relay_rows() << " drops=" << drops;
      if (algorithms.size() > 1) {
        bool all = true;
        for (auto const& x : algorithms) all = all && totals[x].identical;
        p << " compare_identical=" << (all ? "yes" : "no");
      }
      perf = p.str();
    }
  }
  if (rank == 0) std::cout << summary.str();
  // Rank 0 writes; a failure is reported by every rank.
  collective(world, "writing the report", [&] {
    if (rank != 0) return;
    std::string const report_path = opt.report.empty() ? deck.run.report : opt.report;
    std::string const h5_path = opt.hdf5.empty() ? deck.run.hdf5 : opt.hdf5;
    if (!report_path.empty()) {
      write_text_file(report_path, report.dump(2) + "\n");
      std::cout << "report: " << report_path << "\n";
    }
    if (!h5_path.empty()) {
      write_series_hdf5(h5_path, series, {{"deck", deck.path}, {"build", build_summary()}, {"algorithms", json(algorithms).dump()}});
      std::cout << "time series: " << h5_path << "\n";
    }
  });
  if (rank == 0) std::cout << perf << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  Options opt;
  return kmoe_app::run(argc, argv, "kmoe-layer", [&](int rank) {
    CLI::App app{"kmoe-layer: steps of an MoE layer from a TOML deck"};
    app.add_option("deck", opt.deck, "TOML input deck (see inputs/README.md)")->required();
    app.add_option("--steps", opt.steps, "measured steps (overrides [run] steps)")->check(CLI::NonNegativeNumber);
    app.add_option("--warmup", opt.warmup, "warmup steps (overrides [run] warmup)")->check(CLI::NonNegativeNumber);
    app.add_option("--report", opt.report, "JSON report path (overrides [run] report)");
    app.add_option("--hdf5", opt.hdf5, "HDF5 time series path (overrides [run] hdf5)");
    app.add_option("--algorithm", opt.algorithm, "exchange algorithm (overrides [exchange] algorithm)")
        ->check(CLI::IsMember({"flat", "hierarchical", "pooled_wave"}));
    app.add_flag("--print-output", opt.print_output, "print every rank's output rows after the last step");
    if (int const rc = kmoe_app::parse(app, argc, argv, rank); rc >= 0) return rc;
    auto const deck = read_layer_deck(MPI_COMM_WORLD, opt.deck);
    if (rank == 0) {
      std::cout << build_summary() << "\n";
      print_kokkos_configuration(std::cout);
      std::cout << deck.resolved() << std::flush;
    }
    return deck.model.dtype == "bf16" ? run_typed<bf16_t>(deck, opt) : run_typed<float>(deck, opt);
  });
}
