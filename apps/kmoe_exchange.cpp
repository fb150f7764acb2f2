// kmoe-exchange: topology experiments without real experts.
//
//   mpiexec -n 8 kmoe-exchange deck.toml [--algorithms flat,hierarchical,pooled_wave]
//   kmoe-exchange deck.toml --simulate        (the deck's [simulate] ranks)
//
// With MPI ranks, it moves the deck's routes through each exchange algorithm
// with scalar experts ([experts] scales, default 1), prints the byte ledgers
// side by side with per-stage times (the slowest rank's), checks that the
// planner predicts every rank's ledger, and writes a JSON report.
// --simulate plans a cluster of [simulate] ranks inside one
// process from the deck's routing distribution: the same ledgers plus
// per-node and per-relay maxima, for one relay per node and for rail relays.
// No time is reported for simulated runs.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cstdio>
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
  std::vector<std::string> algorithms;
  bool simulate = false;
  std::string report;
  int reps = -1;
};

/// Rank 0 writes the report ("" writes none).
void write_report(std::string const& path, json const& report) {
  if (path.empty()) return;
  write_text_file(path, report.dump(2) + "\n");
  std::cout << "report: " << path << "\n";
}

/// Side-by-side ledger table: one column per variant.
std::string side_by_side(std::vector<std::pair<std::string, Exchange::ByteLedger>> const& cols, bool with_time) {
  std::ostringstream os;
  int const w = 18;
  os << std::left << std::setw(34) << "";
  for (auto const& c : cols) os << std::right << std::setw(w) << c.first;
  os << "\n";
  auto row = [&](std::string const& label, auto&& value) {
    os << std::left << std::setw(34) << label;
    for (auto const& c : cols) os << std::right << std::setw(w) << value(c.second);
    os << "\n";
  };
  using Exchange::LinkClass;
  for (char const* dir : {"dispatch", "combine"}) {
    auto get = [dir](Exchange::ByteLedger const& l) -> Exchange::DirectionLedger const& {
      return std::string(dir) == "dispatch" ? l.dispatch : l.combine;
    };
    row(std::string(dir) + " rows (useful)", [&](auto const& l) { return std::to_string(get(l).useful_rows); });
    for (auto c : {LinkClass::same_rank, LinkClass::intra_node, LinkClass::inter_node}) {
      std::string const cls = to_string(c);
      row(std::string(dir) + " " + cls + " rows", [&](auto const& l) { return std::to_string(get(l).by_class(c).rows); });
      row(std::string(dir) + " " + cls + " payload B", [&](auto const& l) { return std::to_string(get(l).by_class(c).payload_bytes); });
      row(std::string(dir) + " " + cls + " meta B", [&](auto const& l) { return std::to_string(get(l).by_class(c).meta_bytes); });
      row(std::string(dir) + " " + cls + " messages", [&](auto const& l) { return std::to_string(get(l).by_class(c).messages); });
    }
    row(std::string(dir) + " relay rows", [&](auto const& l) { return std::to_string(get(l).relay_rows()); });
    row(std::string(dir) + " relay bytes", [&](auto const& l) { return std::to_string(get(l).relay_bytes()); });
    row(std::string(dir) + " padding rows", [&](auto const& l) { return std::to_string(get(l).padding_rows()); });
    if (std::string(dir) == "dispatch") {
      row("dispatch sender drops", [&](auto const& l) { return std::to_string(l.dispatch.sender_drops); });
      row("dispatch receiver drops", [&](auto const& l) { return std::to_string(l.dispatch.receiver_drops); });
    }
    if (with_time) {
      row(std::string(dir) + " seconds (slowest rank)", [&](auto const& l) {
        double t = 0;
        for (auto const& s : get(l).stages) t += s.seconds;
        std::ostringstream v;
        v.precision(4);
        v << t;
        return v.str();
      });
    }
  }
  return os.str();
}

/// Per-stage lines (name, communicator, rows, bytes, seconds) of one ledger.
std::string stages(Exchange::ByteLedger const& l, bool with_time) {
  std::ostringstream os;
  for (auto const* d : {&l.dispatch, &l.combine})
    for (auto const& s : d->stages) {
      auto const t = s.total();
      os << "  " << l.algorithm << " | " << (d == &l.dispatch ? "dispatch" : "combine ") << " | " << std::left << std::setw(40)
         << s.name << std::setw(14) << s.communicator << std::right << " rows " << std::setw(10) << t.rows << "  payload B "
         << std::setw(12) << t.payload_bytes << "  messages " << std::setw(6) << t.messages;
      if (with_time) os << "  seconds " << s.seconds;
      os << "\n";
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

int simulate(LayerDeck const& deck, Options const& opt) {
  int const rank = comm_rank(MPI_COMM_WORLD);
  int const N = deck.simulate.ranks;
  KOKKOSMOE_REQUIRE(N > 0, "--simulate needs [simulate] ranks in the deck");
  KOKKOSMOE_REQUIRE(deck.tokens.source != "router",
                    "--simulate draws routes from a distribution: set [tokens] source to uniform, zipf, hot or explicit");
  // Every rank plans the same cluster; rank 0 prints.
  LayerDeck const& d = deck;
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
  std::vector<std::pair<std::string, Exchange::ByteLedger>> cols;
  std::vector<std::pair<std::string, Exchange::LedgerMaxima>> maxima;
  auto spec = Setup::comm_spec(d);
  auto const layout = Topology::make_comm_layout(topo, spec);
  auto const plan = [&](Exchange::Algorithm algorithm, Topology::CommLayout const& l) {
    auto c = config.exchange;
    c.algorithm = algorithm;
    return Exchange::plan_ledgers(Exchange::PlanInput{topo, l, routes, placement, c, d.model.hidden});
  };
  auto const flat = plan(Exchange::Algorithm::flat, layout);
  cols.emplace_back("flat", Exchange::sum_ledgers(flat));
  maxima.emplace_back("flat", Exchange::ledger_maxima(topo, flat));
  std::vector<int> relay_variants = {spec.relays_per_node};
  if (topo.min_ranks_per_node() > 1 && spec.relays_per_node != topo.min_ranks_per_node()) relay_variants.push_back(topo.min_ranks_per_node());
  if (spec.relays_per_node != 1) relay_variants.insert(relay_variants.begin(), 1);
  for (int R : relay_variants) {
    auto s2 = spec;
    s2.relays_per_node = R;
    auto const l2 = Topology::make_comm_layout(topo, s2);
    auto const h = plan(Exchange::Algorithm::hierarchical, l2);
    std::string const name = "hier R=" + std::to_string(R);
    cols.emplace_back(name, Exchange::sum_ledgers(h));
    maxima.emplace_back(name, Exchange::ledger_maxima(topo, h));
    Exchange::check_inter_node_equal(cols.front().second, cols.back().second);
  }
  auto const pooled = plan(Exchange::Algorithm::pooled_wave, layout);
  cols.emplace_back("pooled_wave", Exchange::sum_ledgers(pooled));
  maxima.emplace_back("pooled_wave", Exchange::ledger_maxima(topo, pooled));
  // Rank 0 prints and writes; a failure (the report's file) reaches every rank.
  collective(MPI_COMM_WORLD, "writing the report", [&] {
    if (rank != 0) return;
    std::cout << "simulated cluster: " << N << " ranks on " << topo.num_nodes() << " nodes (" << topo.min_ranks_per_node()
              << "+ ranks per node), " << T << " tokens per rank, top-" << d.model.top_k << ", " << d.model.experts
              << " experts in " << placement.num_slots() << " slots, " << to_string(d.model.payload) << " rows of "
              << payload_row_bytes(d.model.payload, d.model.hidden) << " B (planned ledgers; no time is reported)\n\n"
              << side_by_side(cols, false) << "\nmaxima (dispatch)            ";
    for (auto const& m : maxima) std::cout << std::setw(18) << m.first;
    std::cout << "\nnode inter-node payload B    ";
    for (auto const& m : maxima) std::cout << std::setw(18) << m.second.node_inter_bytes;
    std::cout << "\nnode inter-node messages     ";
    for (auto const& m : maxima) std::cout << std::setw(18) << m.second.node_inter_messages;
    std::cout << "\nrelay inter-node payload B   ";
    for (auto const& m : maxima) std::cout << std::setw(18) << m.second.relay_inter_bytes;
    std::cout << "\nrelay rows                   ";
    for (auto const& m : maxima) std::cout << std::setw(18) << m.second.relay_rows;
    std::cout << "\n";
    json report;
    report["mode"] = "simulate";
    report["ranks"] = N;
    report["nodes"] = topo.num_nodes();
    report["resolved_deck"] = d.resolved();
    for (std::size_t i = 0; i < cols.size(); ++i) {
      report["ledgers"][cols[i].first] = json::parse(cols[i].second.to_json(0));
      auto const& m = maxima[i].second;
      report["maxima"][maxima[i].first] = {{"node_inter_bytes", m.node_inter_bytes},     {"node", m.node_inter_bytes_node},
                                          {"node_inter_messages", m.node_inter_messages}, {"relay_inter_bytes", m.relay_inter_bytes},
                                          {"relay_rows", m.relay_rows},                   {"relay_rows_rank", m.relay_rows_rank}};
    }
    write_report(opt.report.empty() ? d.run.report : opt.report, report);
    std::cout << "PERFORMANCE mode=simulate ranks=" << N << " nodes=" << topo.num_nodes()
              << " flat_inter_node_bytes=" << cols.front().second.dispatch.inter_node_payload_bytes()
              << " flat_inter_node_messages=" << cols.front().second.dispatch.by_class(Exchange::LinkClass::inter_node).messages
              << " hier_inter_node_messages=" << cols[1].second.dispatch.by_class(Exchange::LinkClass::inter_node).messages
              << " pooled_drops=" << cols.back().second.dispatch.sender_drops + cols.back().second.dispatch.receiver_drops << std::endl;
  });
  return 0;
}

int run(LayerDeck const& deck, Options const& opt) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world);
  int const size = comm_size(world);
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  auto const& topo = setup.topology;
  auto const& comms = *setup.comms;
  auto const& nodes = setup.node_of_rank;
  auto const& placement = setup.placement;
  auto const& config = setup.config;
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
  } else {
    table = Setup::sampled_routes<MS>(exec, deck, config, 0, first, T, rank, explicit_slot);
  }
  std::vector<float> scales = deck.experts.scales;
  if (scales.empty()) scales.assign(static_cast<std::size_t>(deck.model.experts), 1.0f);
  std::vector<int> slot_expert;
  for (int s : placement.slots_of_rank(rank)) slot_expert.push_back(placement.slot(s).expert);
  auto experts = Experts::ExpertWeights<float, MS>::scalar("kmoe-exchange::experts", slot_expert, deck.model.hidden, scales);
  LayerConfig scalar_config = config;  // the deck's algorithm, transport, payloads and watchdog
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
  int const reps = std::max(1, opt.reps >= 0 ? opt.reps : deck.run.steps);
  std::vector<std::pair<std::string, Exchange::ByteLedger>> cols;
  std::string stage_lines;
  bool planned_ok = true;
  // This rank's own rows (explicit decks give ranks different token counts).
  RowMatrix<float, MS> out("kmoe-exchange::out", hidden.extent(0), deck.model.hidden);
  for (auto const& name : algorithms) {
    auto const algo = from_string<Exchange::Algorithm>(name);
    Exchange::ByteLedger best;
    double best_s = -1;
    for (int rep = 0; rep < reps; ++rep) {
      auto rec = layer.forward_routes(exec, hidden, table, out, algo, explicit_slot);
      auto const reduced = rec.ledger.reduced(world, deck.exchange.watchdog_seconds);
      double t = 0;
      for (auto const* d : {&reduced.dispatch, &reduced.combine})
        for (auto const& s : d->stages) t += s.seconds;
      if (best_s < 0 || t < best_s) {
        best_s = t;
        best = reduced;
      }
      if (rep == 0) {
        // The planner must predict this rank's ledger exactly.
        auto c = config.exchange;
        c.algorithm = algo;
        auto const planned = Exchange::plan_ledgers(Exchange::PlanInput{topo, comms.layout(), routes, placement, c, deck.model.hidden});
        auto measured = rec.ledger;
        for (auto* d : {&measured.dispatch, &measured.combine})
          for (auto& s : d->stages) s.seconds = 0;
        int ok = measured.to_json(0) == planned[static_cast<std::size_t>(rank)].to_json(0) ? 1 : 0, all_ok = 0;
        allreduce_watched(&ok, &all_ok, 1, MPI_INT, MPI_MIN, world, "planner check", deck.exchange.watchdog_seconds);
        planned_ok = planned_ok && all_ok == 1;
      }
    }
    cols.emplace_back(name, best);
    stage_lines += stages(best, true);
  }
  // Rank 0 prints and writes; a failure (the report's file) reaches every rank.
  collective(MPI_COMM_WORLD, "writing the report", [&] {
    if (rank != 0) return;
    std::cout << "exchange experiment: " << size << " ranks on " << topo.num_nodes() << " nodes over " << to_string(deck.exchange.transport)
              << ", " << T << " tokens per rank, top-"
              << deck.model.top_k << ", " << to_string(deck.model.payload) << " rows of "
              << payload_row_bytes(deck.model.payload, deck.model.hidden) << " B, best of " << reps << " runs\n\n"
              << side_by_side(cols, true) << "\nper stage:\n"
              << stage_lines << "planner check: " << (planned_ok ? "every rank's ledger predicted exactly" : "MISMATCH") << "\n";
    json report;
    report["mode"] = "mpi";
    report["transport"] = to_string(deck.exchange.transport);
    report["ranks"] = size;
    report["nodes"] = topo.num_nodes();
    report["resolved_deck"] = deck.resolved();
    report["planner_check"] = planned_ok;
    for (auto const& c : cols) report["ledgers"][c.first] = json::parse(c.second.to_json(0));
    write_report(opt.report.empty() ? deck.run.report : opt.report, report);
    std::ostringstream p;
    p << "PERFORMANCE mode=mpi transport=" << to_string(deck.exchange.transport) << " ranks=" << size << " nodes=" << topo.num_nodes();
    for (auto const& c : cols) {
      double t = 0;
      for (auto const* d : {&c.second.dispatch, &c.second.combine})
        for (auto const& s : d->stages) t += s.seconds;
      p << " " << c.first << "_s=" << t << " " << c.first << "_inter_node_bytes=" << c.second.dispatch.inter_node_payload_bytes();
    }
    p << " planner_check=" << (planned_ok ? "ok" : "mismatch");
    std::cout << p.str() << std::endl;
  });
  return planned_ok ? 0 : 3;
}

}  // namespace

int main(int argc, char* argv[]) {
  Options opt;
  return kmoe_app::run(argc, argv, "kmoe-exchange", [&](int rank) {
    CLI::App app{"kmoe-exchange: exchange ledgers of a topology and routing from a TOML deck"};
    app.add_option("deck", opt.deck, "TOML input deck (see inputs/README.md)")->required();
    app.add_option("--algorithms", opt.algorithms, "algorithms to run (default: all three)")
        ->delimiter(',')
        ->check(CLI::IsMember(enum_names<Exchange::Algorithm>()));
    app.add_flag("--simulate", opt.simulate, "plan a cluster of [simulate] ranks in this process (no data moves, no time)");
    app.add_option("--reps", opt.reps, "runs per algorithm, best reported (default [run] steps)")->check(CLI::NonNegativeNumber);
    app.add_option("--report", opt.report, "JSON report path (overrides [run] report)");
    if (int const rc = kmoe_app::parse(app, argc, argv, rank); rc >= 0) return rc;
    auto const deck = read_layer_deck(MPI_COMM_WORLD, opt.deck);
    collective(MPI_COMM_WORLD, "deck", [&] {
      KOKKOSMOE_REQUIRE(!opt.simulate || deck.simulate.ranks > 0, opt.deck << ": --simulate needs [simulate] ranks in the deck");
      KOKKOSMOE_REQUIRE(opt.simulate || deck.simulate.ranks == 0, opt.deck << ": [simulate] ranks is only read with --simulate");
    });
    if (rank == 0) std::cout << build_summary() << "\n" << deck.resolved() << std::flush;
    return opt.simulate ? simulate(deck, opt) : run(deck, opt);
  });
}
