// kmoe-exchange: topology experiments without real experts.
//
//   mpiexec -n 8 kmoe-exchange deck.toml [--algorithms flat,hierarchical,pooled_wave]
//   kmoe-exchange deck.toml --simulate        (the deck's [simulate] ranks)
//   ... --cost-model cost_model.json          (kmoe-bench calibrate's file)
//   ... --sweep inter_latency_us=5,20,50,100 [--sweep-out sweep]
//
// With MPI ranks, it moves the deck's routes through each exchange algorithm
// with scalar experts ([experts] scales, default 1), prints the byte ledgers
// side by side with per-stage times (the slowest rank's), checks that the
// planner predicts every rank's ledger, and writes a JSON report. Times are
// "measured", or "emulated" when the deck has an emulated fabric
// ([topology.fabric]); with a cost model (a calibration file, and/or the
// deck's fabric as stated NIC parameters) every stage time is printed next
// to the model's prediction ("model").
// --simulate plans a cluster of [simulate] ranks inside one
// process from the deck's routing distribution: the same ledgers plus
// per-node and per-relay maxima, for one relay per node and for rail relays,
// and, with a cost model, the model's stage times (no time is measured).
// --sweep runs the deck once per value of one key and writes one table
// (<sweep-out>.csv and .json): per value and algorithm, the measured (or
// emulated) and predicted dispatch + combine seconds; plot it with
// scripts/plot_report.py.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Exchange_CostModel.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_PlacementIO.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using json = nlohmann::json;

struct Options {
  std::string deck;
  std::vector<std::string> algorithms;
  bool simulate = false;
  std::string report;
  int reps = -1;
  int warmup = -1;
  std::string cost_model;  ///< calibration file ("" none)
  std::string sweep;       ///< key=v1,v2,... ("" none)
  std::string sweep_out = "sweep";
  std::vector<std::string> sets;  ///< key=value applied to the deck first (sweep keys)
};

/// What a run (or a simulation) found for one algorithm.
struct AlgoResult {
  std::string name;
  Exchange::ByteLedger ledger;     ///< summed over ranks; stage seconds: the slowest rank's (0 when simulated)
  Exchange::ByteLedger predicted;  ///< the same with the model's stage seconds
  bool has_prediction = false;
  /// Per direction, the slowest rank's own time (the sum of its stages): the
  /// exchange's time. The sum of per-stage maxima counts twice a rank that
  /// waits in one stage for another still busy in the previous one.
  double dispatch_s = 0;
  double combine_s = 0;
  std::vector<double> runs_s;  ///< every run's total (the slowest rank's), in run order
  double seconds() const { return dispatch_s + combine_s; }
};

/// The evidence class of a run's times.
std::string evidence_of(LayerDeck const& d, bool simulated) {
  if (simulated) return "model";
  return d.topology.fabric.enabled() ? "emulated" : "measured";
}

/// The cost model of a deck: the calibration file's, with the deck's fabric
/// (stated) where it differs from the calibration's; the deck's fabric alone
/// without a file; none without both.
std::optional<Exchange::CostModel> model_for(LayerDeck const& d, std::optional<Exchange::CostModel> const& file) {
  if (file) return file->for_fabric(d.topology.fabric);
  if (d.topology.fabric.enabled()) {
    auto m = Exchange::CostModel::stated(d.topology.fabric);
    m.fabric = d.topology.fabric;
    return m;
  }
  return std::nullopt;
}

/// Rank 0 writes the report ("" writes none).
void write_report(std::string const& path, json const& report) {
  if (path.empty()) return;
  write_text_file(path, report.dump(2) + "\n");
  std::cout << "report: " << path << "\n";
}

/// Side-by-side ledger table: one column per variant.
std::string seconds_text(double t) {
  std::ostringstream v;
  v.precision(4);
  v << t;
  return v.str();
}

double direction_seconds(Exchange::DirectionLedger const& d) {
  double t = 0;
  for (auto const& s : d.stages) t += s.seconds;
  return t;
}

/// Side-by-side ledger table: one column per algorithm; with a time label
/// ("measured", "emulated"), the slowest rank's seconds per direction; with
/// predictions, the model's seconds per direction.
std::string side_by_side(std::vector<AlgoResult> const& cols, std::string const& time_label) {
  std::ostringstream os;
  int const w = 20;
  os << std::left << std::setw(40) << "";
  for (auto const& c : cols) os << std::right << std::setw(w) << c.name;
  os << "\n";
  auto row = [&](std::string const& label, auto&& value) {
    os << std::left << std::setw(40) << label;
    for (auto const& c : cols) os << std::right << std::setw(w) << value(c);
    os << "\n";
  };
  bool const predicted = std::any_of(cols.begin(), cols.end(), [](AlgoResult const& c) { return c.has_prediction; });
  using Exchange::LinkClass;
  for (char const* dir : {"dispatch", "combine"}) {
    bool const disp = std::string(dir) == "dispatch";
    auto get = [disp](Exchange::ByteLedger const& l) -> Exchange::DirectionLedger const& { return disp ? l.dispatch : l.combine; };
    row(std::string(dir) + " rows (useful)", [&](auto const& c) { return std::to_string(get(c.ledger).useful_rows); });
    for (auto cls : {LinkClass::same_rank, LinkClass::intra_node, LinkClass::inter_node}) {
      std::string const n = to_string(cls);
      row(std::string(dir) + " " + n + " rows", [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).rows); });
      row(std::string(dir) + " " + n + " payload B", [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).payload_bytes); });
      row(std::string(dir) + " " + n + " meta B", [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).meta_bytes); });
      row(std::string(dir) + " " + n + " messages", [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).messages); });
      row(std::string(dir) + " " + n + " pairs", [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).pairs); });
      if (cls != LinkClass::same_rank)
        row(std::string(dir) + " " + n + " dedup saved rows",
            [&](auto const& c) { return std::to_string(get(c.ledger).by_class(cls).dedup_saved_rows); });
    }
    row(std::string(dir) + " relay rows", [&](auto const& c) { return std::to_string(get(c.ledger).relay_rows()); });
    row(std::string(dir) + " relay bytes", [&](auto const& c) { return std::to_string(get(c.ledger).relay_bytes()); });
    row(std::string(dir) + " padding rows", [&](auto const& c) { return std::to_string(get(c.ledger).padding_rows()); });
    if (disp) {
      row("dispatch sender drops", [&](auto const& c) { return std::to_string(c.ledger.dispatch.sender_drops); });
      row("dispatch receiver drops", [&](auto const& c) { return std::to_string(c.ledger.dispatch.receiver_drops); });
    }
    if (!time_label.empty())
      row(std::string(dir) + " seconds (" + time_label + ")", [&](auto const& c) { return seconds_text(disp ? c.dispatch_s : c.combine_s); });
    if (predicted)
      row(std::string(dir) + " seconds (model)", [&](auto const& c) {
        return c.has_prediction ? seconds_text(direction_seconds(get(c.predicted))) : std::string("-");
      });
  }
  return os.str();
}

/// Per-stage lines (name, communicator, rows, bytes, seconds of the time
/// label's class and of the model) of one algorithm.
std::string stages(AlgoResult const& r, std::string const& time_label) {
  std::ostringstream os;
  for (int dir = 0; dir < 2; ++dir) {
    auto const& d = dir == 0 ? r.ledger.dispatch : r.ledger.combine;
    auto const& p = dir == 0 ? r.predicted.dispatch : r.predicted.combine;
    for (std::size_t i = 0; i < d.stages.size(); ++i) {
      auto const& s = d.stages[i];
      auto const t = s.total();
      os << "  " << r.name << " | " << (dir == 0 ? "dispatch" : "combine ") << " | " << std::left << std::setw(40) << s.name
         << std::setw(14) << s.communicator << std::right << " rows " << std::setw(10) << t.rows << "  payload B " << std::setw(12)
         << t.payload_bytes << "  messages " << std::setw(6) << t.messages;
      if (!time_label.empty()) os << "  " << time_label << " s " << seconds_text(s.seconds);
      if (r.has_prediction && i < p.stages.size()) os << "  model s " << seconds_text(p.stages[i].seconds);
      os << "\n";
    }
  }
  return os.str();
}

/// The route plan of one (real or simulated) rank in host memory, made by
/// the same make_route_plan as the layer's.
RoutePlan<Kokkos::HostSpace> host_route_plan(LayerConfig const& config, Placement const& placement,
                                             DevicePlacement<Kokkos::HostSpace> const& device_placement, int rank, int node,
                                             RouteTable<Kokkos::HostSpace> const& table,
                                             Kokkos::View<int**, Kokkos::LayoutRight, Kokkos::HostSpace> const& explicit_slot) {
  auto choice = make_replica_choice<Kokkos::HostSpace>(placement, rank, node, config.replica_policy);
  return make_route_plan(Kokkos::DefaultHostExecutionSpace(), table, device_placement, choice, rank, 0, explicit_slot);
}

/// Results of one run or simulation of a deck.
struct Outcome {
  std::vector<AlgoResult> algos;
  std::vector<Exchange::LedgerMaxima> maxima;  ///< simulated: per column
  int ranks = 0;
  int nodes = 0;
  int min_ranks_per_node = 0;
  index_t tokens_per_rank = 0;
  int slots = 0;
  int reps = 0;
  bool planned_ok = true;
  std::string evidence;
};

Outcome simulate_cluster(LayerDeck const& d, std::optional<Exchange::CostModel> const& file_model) {
  int const N = d.simulate.ranks;
  KOKKOSMOE_REQUIRE(N > 0, "--simulate needs [simulate] ranks in the deck");
  KOKKOSMOE_REQUIRE(d.tokens.source != "router",
                    "--simulate draws routes from a distribution: set [tokens] source to uniform, zipf, hot or explicit");
  auto const model = model_for(d, file_model);
  // Every rank plans the same cluster.
  auto const topo = Topology::Topology::simulated(N, Setup::layout_spec(d));
  std::vector<int> nodes(static_cast<std::size_t>(N));
  for (int r = 0; r < N; ++r) nodes[static_cast<std::size_t>(r)] = topo.node_of(r);
  auto const placement = Setup::make_placement(d, nodes, MPI_COMM_SELF);
  auto const config = Setup::layer_config(d, placement);
  Kokkos::DefaultHostExecutionSpace host;
  auto const device_placement = make_device_placement<Kokkos::HostSpace>(placement);
  Exchange::RankRoutePlans routes(static_cast<std::size_t>(N));
  index_t const T = Setup::tokens_per_rank(d);
  for (int r = 0; r < N; ++r) {
    Kokkos::View<int**, Kokkos::LayoutRight, Kokkos::HostSpace> es;
    auto table = Setup::sampled_routes<Kokkos::HostSpace>(host, d, config, 0, static_cast<index_t>(r) * T, T, r, es);
    routes[static_cast<std::size_t>(r)] = host_route_plan(config, placement, device_placement, r, nodes[static_cast<std::size_t>(r)], table, es);
  }
  Outcome out;
  out.ranks = N;
  out.nodes = topo.num_nodes();
  out.min_ranks_per_node = topo.min_ranks_per_node();
  out.tokens_per_rank = T;
  out.slots = placement.num_slots();
  out.evidence = "model";
  auto spec = Setup::comm_spec(d);
  auto add = [&](std::string const& name, Exchange::Algorithm algorithm, Topology::CommLayout const& l) {
    auto c = config.exchange;
    c.algorithm = algorithm;
    // Rows of fp32 (kmoe-exchange's layer), as the measured runs move them.
    auto const per_rank = Exchange::plan_ledgers(Exchange::PlanInput{topo, l, routes, placement, c, d.model.hidden, PayloadType::fp32});
    AlgoResult r;
    r.name = name;
    r.ledger = Exchange::sum_ledgers(per_rank);
    if (model) {
      r.predicted = Exchange::predict(*model, topo, l, per_rank);
      r.has_prediction = true;
    }
    out.algos.push_back(std::move(r));
    out.maxima.push_back(Exchange::ledger_maxima(topo, per_rank));
  };
  auto const layout = Topology::make_comm_layout(topo, spec);
  add("flat", Exchange::Algorithm::flat, layout);
  std::vector<int> relay_variants = {spec.relays_per_node};
  if (topo.min_ranks_per_node() > 1 && spec.relays_per_node != topo.min_ranks_per_node()) relay_variants.push_back(topo.min_ranks_per_node());
  if (spec.relays_per_node != 1) relay_variants.insert(relay_variants.begin(), 1);
  for (int R : relay_variants) {
    auto s2 = spec;
    s2.relays_per_node = R;
    add(R == spec.relays_per_node ? std::string("hierarchical") : "hier R=" + std::to_string(R), Exchange::Algorithm::hierarchical,
        Topology::make_comm_layout(topo, s2));
    Exchange::check_inter_node_equal(out.algos.front().ledger, out.algos.back().ledger);
  }
  add("hierarchical_dedup", Exchange::Algorithm::hierarchical_dedup, layout);
  add("pooled_wave", Exchange::Algorithm::pooled_wave, layout);
  return out;
}

void print_simulation(LayerDeck const& d, Outcome const& o, std::optional<Exchange::CostModel> const& model, Options const& opt) {
  std::cout << "simulated cluster: " << o.ranks << " ranks on " << o.nodes << " nodes (" << o.min_ranks_per_node
            << "+ ranks per node), " << o.tokens_per_rank << " tokens per rank, top-" << d.model.top_k << ", " << d.model.experts
            << " experts in " << o.slots << " slots, " << to_string(d.model.payload) << " rows of "
            << payload_row_bytes(d.model.payload, d.model.hidden) << " B (planned ledgers; "
            << (model ? "times from the cost model: " + model->origin : std::string("no time without a cost model")) << ")\n\n"
            << side_by_side(o.algos, "") << "\nmaxima (dispatch)                       ";
  for (auto const& a : o.algos) std::cout << std::setw(20) << a.name;
  auto line = [&](char const* label, auto&& f) {
    std::cout << "\n" << std::left << std::setw(40) << label << std::right;
    for (auto const& m : o.maxima) std::cout << std::setw(20) << f(m);
  };
  line("node inter-node payload B", [](auto const& m) { return m.node_inter_bytes; });
  line("node inter-node messages", [](auto const& m) { return m.node_inter_messages; });
  line("relay inter-node payload B", [](auto const& m) { return m.relay_inter_bytes; });
  line("relay rows", [](auto const& m) { return m.relay_rows; });
  std::cout << "\n";
  if (model) {
    std::cout << "\nper stage (model):\n";
    for (auto const& a : o.algos) std::cout << stages(a, "");
  }
  json report;
  report["mode"] = "simulate";
  report["ranks"] = o.ranks;
  report["nodes"] = o.nodes;
  report["evidence"] = "model";
  report["resolved_deck"] = d.resolved();
  if (model) report["cost_model"] = json::parse(model->to_json(0));
  for (std::size_t i = 0; i < o.algos.size(); ++i) {
    report["ledgers"][o.algos[i].name] = json::parse(o.algos[i].ledger.to_json(0));
    if (o.algos[i].has_prediction) report["predicted"][o.algos[i].name] = json::parse(o.algos[i].predicted.to_json(0));
    auto const& m = o.maxima[i];
    report["maxima"][o.algos[i].name] = {{"node_inter_bytes", m.node_inter_bytes},     {"node", m.node_inter_bytes_node},
                                        {"node_inter_messages", m.node_inter_messages}, {"relay_inter_bytes", m.relay_inter_bytes},
                                        {"relay_rows", m.relay_rows},                   {"relay_rows_rank", m.relay_rows_rank}};
  }
  write_report(opt.report.empty() ? d.run.report : opt.report, report);
  std::ostringstream p;
  p << "PERFORMANCE mode=simulate ranks=" << o.ranks << " nodes=" << o.nodes
    << " flat_inter_node_bytes=" << o.algos.front().ledger.dispatch.inter_node_payload_bytes()
    << " flat_inter_node_messages=" << o.algos.front().ledger.dispatch.by_class(Exchange::LinkClass::inter_node).messages
    << " hier_inter_node_messages=" << o.algos[1].ledger.dispatch.by_class(Exchange::LinkClass::inter_node).messages
    << " dedup_inter_node_bytes=" << o.algos[o.algos.size() - 2].ledger.dispatch.inter_node_payload_bytes()
    << " pooled_drops=" << o.algos.back().ledger.dispatch.sender_drops + o.algos.back().ledger.dispatch.receiver_drops;
  if (model)
    for (auto const& a : o.algos)
      if (a.name.find(' ') == std::string::npos) p << " " << a.name << "_model_s=" << Exchange::total_seconds(a.predicted);
  std::cout << p.str() << std::endl;
}

Outcome run_cluster(LayerDeck const& deck, Options const& opt, std::optional<Exchange::CostModel> const& file_model) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world);
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  auto const& topo = setup.topology;
  auto const& comms = *setup.comms;
  auto const& nodes = setup.node_of_rank;
  auto const& placement = setup.placement;
  auto const& config = setup.config;
  auto const model = model_for(deck, file_model);
  index_t const T = Setup::tokens_per_rank(deck);
  index_t const first = Setup::first_token(deck, rank);
  // Routes: the deck's distribution, or its router on seeded hidden rows.
  RouteTable<MS> table;
  Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
  auto hidden = Setup::hidden_rows<float, MS>(deck, 0, first, T, rank);
  if (deck.tokens.source == "router") {
    Router<MS> router(config.router);
    RouteOptions<MS> ro;
    ro.gemm_path = config.router_gemm;
    router.route(exec, hidden, Setup::router_weight<float, MS>(deck), table, ro);
  } else if (deck.tokens.source == "trace") {
    auto const trace = Setup::load_trace(deck, world);  // its first step: routes, or logits through the deck's router
    if (trace_replay(trace, deck.tokens.replay, Setup::trace_where(deck)) == TraceReplay::logits) {
      Router<MS> router(config.router);
      router.route_logits(exec, trace_logits<MS>(trace, 0, rank), table);
    } else {
      table = trace_routes<MS>(trace, 0, rank, deck.model.experts);
    }
  } else {
    table = Setup::sampled_routes<MS>(exec, deck, config, 0, first, T, rank, explicit_slot);
  }
  std::vector<float> scales = deck.experts.scales;
  if (scales.empty()) scales.assign(static_cast<std::size_t>(deck.model.experts), 1.0f);
  std::vector<int> slot_expert;
  for (int s : placement.slots_of_rank(rank)) slot_expert.push_back(placement.slot(s).expert);
  auto experts = Experts::ExpertWeights<float, MS>::scalar("kmoe-exchange::experts", slot_expert, deck.model.hidden, scales);
  LayerConfig scalar_config = config;  // the deck's algorithm, transport, payloads, watchdog and fabric
  scalar_config.runner.kind = Experts::RunnerKind::scalar;
  RowMatrix<float, MS> router_weight("kmoe-exchange::router_weight", deck.model.experts, deck.model.hidden);
  MoELayer<float, Exec, MS> layer(scalar_config, comms, placement, router_weight, experts);

  // The planner's view of every rank's routes: the route plan the layer makes.
  auto const mine = make_route_plan(exec, table, make_device_placement<MS>(placement),
                                    make_replica_choice<MS>(placement, rank, nodes[static_cast<std::size_t>(rank)], config.replica_policy),
                                    rank, 0, explicit_slot);
  auto const routes = Exchange::allgather_routes(world, mine);

  std::vector<std::string> algorithms = opt.algorithms;
  if (algorithms.empty()) algorithms = enum_names<Exchange::Algorithm>();
  Outcome out;
  out.ranks = comm_size(world);
  out.nodes = topo.num_nodes();
  out.tokens_per_rank = T;
  out.reps = std::max(1, opt.reps >= 0 ? opt.reps : deck.run.steps);
  out.evidence = evidence_of(deck, false);
  // This rank's own rows (explicit decks give ranks different token counts).
  RowMatrix<float, MS> rows_out("kmoe-exchange::out", hidden.extent(0), deck.model.hidden);
  // Every run's times; the run of median total time is reported (the
  // calibration's figures are medians too). The algorithms take turns run
  // by run, so that a slow spell of the machine falls on all of them alike.
  struct Run {
    double total, dispatch, combine;
    Exchange::ByteLedger ledger;
  };
  std::size_t const A = algorithms.size();
  std::vector<AlgoResult> results(A);
  std::vector<std::vector<Run>> runs(A);
  std::vector<Exchange::Algorithm> algos;
  for (std::size_t a = 0; a < A; ++a) {
    algos.push_back(from_string<Exchange::Algorithm>(algorithms[a]));
    results[a].name = algorithms[a];
  }
  // Warm-up runs first (buffers allocated and touched, not timed).
  for (int w = 0; w < (opt.warmup >= 0 ? opt.warmup : deck.run.warmup); ++w)
    for (auto const algo : algos) layer.forward_routes(exec, hidden, table, rows_out, algo, explicit_slot);
  for (int rep = 0; rep < out.reps; ++rep)
    for (std::size_t a = 0; a < A; ++a) {
      auto rec = layer.forward_routes(exec, hidden, table, rows_out, algos[a], explicit_slot);
      double const mine[2] = {direction_seconds(rec.ledger.dispatch), direction_seconds(rec.ledger.combine)};
      double slowest[2] = {0, 0};
      allreduce_watched(mine, slowest, 2, MPI_DOUBLE, MPI_MAX, world, "exchange times", deck.exchange.watchdog_seconds);
      runs[a].push_back({slowest[0] + slowest[1], slowest[0], slowest[1], rec.ledger.reduced(world, deck.exchange.watchdog_seconds)});
      if (rep == 0) {
        // The planner must predict this rank's ledger exactly.
        auto c = config.exchange;
        c.algorithm = algos[a];
        auto const planned =
            Exchange::plan_ledgers(Exchange::PlanInput{topo, comms.layout(), routes, placement, c, deck.model.hidden, PayloadType::fp32});
        auto measured = rec.ledger;
        for (auto* d : {&measured.dispatch, &measured.combine})
          for (auto& s : d->stages) s.seconds = 0;
        int ok = measured.to_json(0) == planned[static_cast<std::size_t>(rank)].to_json(0) ? 1 : 0, all_ok = 0;
        allreduce_watched(&ok, &all_ok, 1, MPI_INT, MPI_MIN, world, "planner check", deck.exchange.watchdog_seconds);
        out.planned_ok = out.planned_ok && all_ok == 1;
        if (model) {
          results[a].predicted = Exchange::predict(*model, topo, comms.layout(), planned);
          results[a].has_prediction = true;
        }
      }
    }
  for (std::size_t a = 0; a < A; ++a) {
    auto& res = results[a];
    auto& list = runs[a];
    for (auto const& r : list) res.runs_s.push_back(r.total);
    std::sort(list.begin(), list.end(), [](Run const& x, Run const& y) { return x.total < y.total; });
    auto& median = list[list.size() / 2];
    res.ledger = std::move(median.ledger);
    res.dispatch_s = median.dispatch;
    res.combine_s = median.combine;
    out.algos.push_back(std::move(res));
  }
  return out;
}

void print_run(LayerDeck const& deck, Outcome const& o, std::optional<Exchange::CostModel> const& model, Options const& opt) {
  std::string stage_lines;
  for (auto const& a : o.algos) stage_lines += stages(a, o.evidence);
  std::cout << "exchange experiment: " << o.ranks << " ranks on " << o.nodes << " nodes over " << to_string(deck.exchange.transport)
            << ", " << o.tokens_per_rank << " tokens per rank, top-" << deck.model.top_k << ", " << to_string(deck.model.payload)
            << " rows of " << payload_row_bytes(deck.model.payload, deck.model.hidden) << " B, the median of " << o.reps << " runs\n"
            << "times: " << o.evidence
            << (deck.topology.fabric.enabled() ? " (" + deck.topology.fabric.describe() + ")" : std::string(" on this machine"))
            << (model ? "; model: " + model->origin + " [" + model->evidence + "]" : std::string()) << "\n\n"
            << side_by_side(o.algos, o.evidence + ", slowest rank") << "\nper stage (" << o.evidence
            << " seconds: the slowest rank's in that stage):\n"
            << stage_lines << "planner check: " << (o.planned_ok ? "every rank's ledger predicted exactly" : "MISMATCH") << "\n";
  json report;
  report["mode"] = "mpi";
  report["transport"] = to_string(deck.exchange.transport);
  report["ranks"] = o.ranks;
  report["nodes"] = o.nodes;
  report["evidence"] = o.evidence;
  if (deck.topology.fabric.enabled()) report["fabric"] = deck.topology.fabric.describe();
  report["resolved_deck"] = deck.resolved();
  report["planner_check"] = o.planned_ok;
  if (model) report["cost_model"] = json::parse(model->to_json(0));
  for (auto const& c : o.algos) {
    report["ledgers"][c.name] = json::parse(c.ledger.to_json(0));
    report["seconds"][c.name] = {{"dispatch", c.dispatch_s}, {"combine", c.combine_s}, {"evidence", o.evidence}, {"runs", c.runs_s}};
    if (c.has_prediction) report["predicted"][c.name] = json::parse(c.predicted.to_json(0));
  }
  write_report(opt.report.empty() ? deck.run.report : opt.report, report);
  std::ostringstream p;
  p << "PERFORMANCE mode=mpi transport=" << to_string(deck.exchange.transport) << " ranks=" << o.ranks << " nodes=" << o.nodes
    << " evidence=" << o.evidence;
  for (auto const& c : o.algos) {
    p << " " << c.name << "_s=" << c.seconds();
    if (c.has_prediction) p << " " << c.name << "_model_s=" << Exchange::total_seconds(c.predicted);
    p << " " << c.name << "_inter_node_bytes=" << c.ledger.dispatch.inter_node_payload_bytes();
  }
  p << " planner_check=" << (o.planned_ok ? "ok" : "mismatch");
  std::cout << p.str() << std::endl;
}

/// The keys --sweep understands, and what each changes in the deck.
std::vector<std::string> const& sweep_keys() {
  static std::vector<std::string> const k = {"tokens_per_rank",      "top_k",         "inter_latency_us", "inter_bandwidth_gbps",
                                             "nics_per_node",        "relays_per_node", "ranks_per_node",  "nodes",
                                             "node_limit",           "algorithm"};
  return k;
}

/// A copy of the deck with key = value (throws Error naming the key and value).
LayerDeck with_value(LayerDeck d, std::string const& key, std::string const& value, int ranks) {
  auto number = [&]() {
    std::size_t used = 0;
    double v = 0;
    try {
      v = std::stod(value, &used);
    } catch (...) {
      used = 0;
    }
    KOKKOSMOE_REQUIRE(used == value.size() && std::isfinite(v), "--sweep " << key << ": '" << value << "' is not a number");
    return v;
  };
  auto integer = [&](int lo) {
    double const v = number();
    KOKKOSMOE_REQUIRE(v == std::floor(v) && v >= lo && v <= 1e9, "--sweep " << key << ": '" << value << "' is not an integer >= " << lo);
    return static_cast<int>(v);
  };
  auto need_fabric = [&] {
    KOKKOSMOE_REQUIRE(d.topology.fabric.enabled(), "--sweep " << key << " needs [topology.fabric] in the deck " << d.path);
  };
  if (key == "tokens_per_rank") {
    KOKKOSMOE_REQUIRE(d.tokens.source != "explicit", "--sweep tokens_per_rank: the deck's tokens are explicit");
    d.tokens.per_rank = integer(1);
  } else if (key == "top_k") {
    int const k = integer(1);
    KOKKOSMOE_REQUIRE(k <= d.model.experts, "--sweep top_k = " << k << " exceeds the deck's " << d.model.experts << " experts");
    d.model.top_k = d.router.top_k = k;
  } else if (key == "inter_latency_us") {
    need_fabric();
    d.topology.fabric.inter_latency_us = number();
    d.topology.fabric.validate("--sweep inter_latency_us");
  } else if (key == "inter_bandwidth_gbps") {
    need_fabric();
    d.topology.fabric.inter_bandwidth_gbps = number();
    d.topology.fabric.validate("--sweep inter_bandwidth_gbps");
  } else if (key == "nics_per_node") {
    need_fabric();
    d.topology.fabric.nics_per_node = integer(1);
  } else if (key == "relays_per_node") {
    d.topology.relays_per_node = integer(1);
  } else if (key == "ranks_per_node" || key == "nodes") {
    KOKKOSMOE_REQUIRE(d.topology.layout != Topology::LayoutKind::hwloc, "--sweep " << key << " needs a virtual or synthetic layout");
    int const v = integer(1);
    d.topology.node_of_rank.clear();
    d.topology.ranks_per_node = 0;
    d.topology.nodes = 0;
    if (key == "ranks_per_node") {
      KOKKOSMOE_REQUIRE(ranks % v == 0, "--sweep ranks_per_node = " << v << " does not divide the " << ranks << " ranks");
      d.topology.ranks_per_node = v;
    } else {
      KOKKOSMOE_REQUIRE(v <= ranks, "--sweep nodes = " << v << " exceeds the " << ranks << " ranks");
      d.topology.nodes = v;
      for (int q = 0; q < ranks; ++q) d.topology.node_of_rank.push_back(static_cast<int>(static_cast<std::int64_t>(q) * v / ranks));
    }
  } else if (key == "node_limit") {
    KOKKOSMOE_REQUIRE(d.tokens.source == "router", "--sweep node_limit limits the router's choices: the deck needs tokens.source = \"router\"");
    int const v = integer(0);
    d.domain_limit = v == 0 ? "none" : "node";
    d.router.max_domains = v;
  } else if (key == "algorithm") {
    d.exchange.algorithm = from_string<Exchange::Algorithm>(value);
  } else {
    std::ostringstream os;
    for (auto const& k : sweep_keys()) os << (os.tellp() > 0 ? ", " : "") << k;
    KOKKOSMOE_THROW("--sweep: unknown key '" << key << "' (one of " << os.str() << ")");
  }
  return d;
}

int sweep(LayerDeck const& deck, Options const& opt, std::optional<Exchange::CostModel> const& file_model) {
  int const rank = comm_rank(MPI_COMM_WORLD);
  int const ranks = opt.simulate ? deck.simulate.ranks : comm_size(MPI_COMM_WORLD);
  std::string key;
  std::vector<std::string> values;
  collective(MPI_COMM_WORLD, "--sweep", [&] {
    auto const eq = opt.sweep.find('=');
    KOKKOSMOE_REQUIRE(eq != std::string::npos && eq > 0 && eq + 1 < opt.sweep.size(),
                      "--sweep '" << opt.sweep << "': expected key=v1,v2,... (e.g. inter_latency_us=5,20,50)");
    key = opt.sweep.substr(0, eq);
    std::stringstream ss(opt.sweep.substr(eq + 1));
    for (std::string v; std::getline(ss, v, ',');) values.push_back(v);
    for (auto const& v : values) with_value(deck, key, v, ranks);  // every value checked before anything runs
    KOKKOSMOE_REQUIRE(key != "algorithm" || opt.algorithms.empty(), "--sweep algorithm and --algorithms both choose algorithms");
  });
  json rows = json::array();
  std::ostringstream csv;
  csv << "key,value,algorithm,evidence,dispatch_s,combine_s,total_s,model_dispatch_s,model_combine_s,model_total_s,"
         "inter_node_bytes,inter_node_messages,planner_check\n";
  for (auto const& v : values) {
    auto const d = with_value(deck, key, v, ranks);
    Options o = opt;
    if (key == "algorithm") o.algorithms = {v};
    auto const outcome = opt.simulate ? simulate_cluster(d, file_model) : run_cluster(d, o, file_model);
    for (auto const& a : outcome.algos) {
      if (a.name.find(' ') != std::string::npos) continue;  // simulated relay variants: one hierarchical column
      bool const timed = outcome.evidence != "model";
      auto opt_num = [](bool have, double x) { return have ? json(x) : json(nullptr); };
      json row{{"key", key},
               {"value", v},
               {"algorithm", a.name},
               {"evidence", outcome.evidence},
               {"dispatch_s", opt_num(timed, a.dispatch_s)},
               {"combine_s", opt_num(timed, a.combine_s)},
               {"total_s", opt_num(timed, a.seconds())},
               {"model_dispatch_s", opt_num(a.has_prediction, direction_seconds(a.predicted.dispatch))},
               {"model_combine_s", opt_num(a.has_prediction, direction_seconds(a.predicted.combine))},
               {"model_total_s", opt_num(a.has_prediction, Exchange::total_seconds(a.predicted))},
               {"inter_node_bytes", a.ledger.dispatch.inter_node_payload_bytes() + a.ledger.combine.inter_node_payload_bytes()},
               {"inter_node_messages", a.ledger.dispatch.by_class(Exchange::LinkClass::inter_node).messages +
                                           a.ledger.combine.by_class(Exchange::LinkClass::inter_node).messages},
               {"planner_check", outcome.planned_ok},
               {"runs_s", a.runs_s}};
      auto cell = [](json const& x) {
        if (x.is_null()) return std::string();
        if (x.is_string()) return x.get<std::string>();
        return x.dump();
      };
      csv << key << "," << v << "," << a.name << "," << outcome.evidence;
      for (char const* f : {"dispatch_s", "combine_s", "total_s", "model_dispatch_s", "model_combine_s", "model_total_s",
                            "inter_node_bytes", "inter_node_messages", "planner_check"})
        csv << "," << cell(row[f]);
      csv << "\n";
      rows.push_back(row);
    }
  }
  collective(MPI_COMM_WORLD, "writing the sweep", [&] {
    if (rank != 0) return;
    json j;
    j["format"] = "kokkosmoe-sweep";
    j["deck"] = deck.path;
    j["key"] = key;
    j["ranks"] = ranks;
    j["evidence"] = opt.simulate ? "model" : evidence_of(deck, false);
    if (file_model) j["cost_model"] = file_model->origin;
    j["rows"] = rows;
    write_text_file(opt.sweep_out + ".csv", csv.str());
    write_text_file(opt.sweep_out + ".json", j.dump(2) + "\n");
    std::cout << "\nsweep of " << key << " (" << values.size() << " values):\n" << csv.str() << "sweep: " << opt.sweep_out << ".csv, "
              << opt.sweep_out << ".json\n";
  });
  bool ok = true;
  for (auto const& r : rows) ok = ok && r["planner_check"].get<bool>();
  return ok ? 0 : 3;
}

}  // namespace

int main(int argc, char* argv[]) {
  Options opt;
  return kmoe_app::run(argc, argv, "kmoe-exchange", [&](int rank) {
    CLI::App app{"kmoe-exchange: exchange ledgers of a topology and routing from a TOML deck"};
    app.add_option("deck", opt.deck, "TOML input deck (see inputs/README.md)")->required();
    app.add_option("--algorithms", opt.algorithms, "algorithms to run (default: all four)")
        ->delimiter(',')
        ->check(CLI::IsMember(enum_names<Exchange::Algorithm>()));
    app.add_flag("--simulate", opt.simulate, "plan a cluster of [simulate] ranks in this process (no data moves; times only from a cost model)");
    app.add_option("--warmup", opt.warmup, "untimed runs per algorithm first (default [run] warmup)")->check(CLI::NonNegativeNumber);
    app.add_option("--reps", opt.reps, "runs per algorithm, the median reported (default [run] steps)")->check(CLI::NonNegativeNumber);
    app.add_option("--report", opt.report, "JSON report path (overrides [run] report)");
    app.add_option("--cost-model", opt.cost_model, "cost model file (kmoe-bench calibrate): predicted stage times next to measured ones");
    app.add_option("--sweep", opt.sweep, "key=v1,v2,...: run the deck once per value (keys: tokens_per_rank, top_k, inter_latency_us, "
                                         "inter_bandwidth_gbps, nics_per_node, relays_per_node, ranks_per_node, nodes, node_limit, algorithm)");
    app.add_option("--sweep-out", opt.sweep_out, "sweep table path prefix (.csv and .json)")->capture_default_str();
    app.add_option("--set", opt.sets, "key=value: change the deck first (the keys of --sweep), e.g. --set tokens_per_rank=64")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    if (int const rc = kmoe_app::parse(app, argc, argv, rank); rc >= 0) return rc;
    auto deck = read_layer_deck(MPI_COMM_WORLD, opt.deck);
    collective(MPI_COMM_WORLD, "--set", [&] {
      for (auto const& kv : opt.sets) {
        auto const eq = kv.find('=');
        KOKKOSMOE_REQUIRE(eq != std::string::npos && eq > 0, "--set '" << kv << "': expected key=value");
        KOKKOSMOE_REQUIRE(kv.substr(0, eq) != "algorithm", "--set algorithm: choose algorithms with --algorithms");
        deck = with_value(deck, kv.substr(0, eq), kv.substr(eq + 1), opt.simulate ? deck.simulate.ranks : comm_size(MPI_COMM_WORLD));
      }
    });
    collective(MPI_COMM_WORLD, "deck", [&] {
      KOKKOSMOE_REQUIRE(!opt.simulate || deck.simulate.ranks > 0, opt.deck << ": --simulate needs [simulate] ranks in the deck");
      KOKKOSMOE_REQUIRE(opt.simulate || deck.simulate.ranks == 0, opt.deck << ": [simulate] ranks is only read with --simulate");
    });
    std::optional<Exchange::CostModel> model;
    if (!opt.cost_model.empty()) {
      auto const text = read_text_file(MPI_COMM_WORLD, opt.cost_model, "cost model");
      collective(MPI_COMM_WORLD, "cost model", [&] { model = Exchange::CostModel::from_json(text, opt.cost_model); });
    }
    if (rank == 0) std::cout << build_summary() << "\n" << deck.resolved() << std::flush;
    if (!opt.sweep.empty()) return sweep(deck, opt, model);
    Outcome const o = opt.simulate ? simulate_cluster(deck, model) : run_cluster(deck, opt, model);
    collective(MPI_COMM_WORLD, "writing the report", [&] {
      if (rank != 0) return;
      if (opt.simulate)
        print_simulation(deck, o, model_for(deck, model), opt);
      else
        print_run(deck, o, model_for(deck, model), opt);
    });
    return o.planned_ok ? 0 : 3;
  });
}
