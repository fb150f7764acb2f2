// kmoe-eplb: expert placement solver.
//
//   mpiexec -n 1 kmoe-eplb --load 4,2,1,1 --slots 8 --groups 2 --nodes 2 --ranks 4
//   kmoe-eplb --load-file loads.json --slots 288 --groups 8 --nodes 4 --ranks 32
//   kmoe-eplb --load-file loads.h5 ... --current current.json --write-placement new.json
//   kmoe-eplb --load-file loads.json ... --write-loads loads.h5   (converts the loads)
//
// Loads: --load-file (JSON {"layers": [{"load": [...]}, ...]} or {"load": [...]},
// or HDF5 with dataset "/load" of shape [L, E] or [E]; see
// KokkosMoE_PlacementIO.hpp), or --load given once per layer as a
// comma-separated list. For every layer rank 0 prints the placement per rank
// (experts, replica ranks, ideal load), logcnt, the ideal max/mean rank load
// before (contiguous placement, no replicas) and after, and the migration
// plan from the current placement (contiguous, or --current FILE in the slot
// list format that --write-placement writes). Ranks are node-major (node n
// holds ranks [n R/N, (n+1) R/N)). The run ends with one line
// "PERFORMANCE layers=... max_over_mean_before=... max_over_mean_after=...".
//
//   kmoe-eplb --trace routes/ --rebalance-every 20 --slots 72 --nodes 2 --ranks 8 [--write-series s.csv]
//
// drives the placement by a routing trace (KokkosMoE_RouteTrace.hpp; e.g.
// from scripts/make_trace.py or kmoe-layer's record_routes): the load of
// every step is its accepted routes per expert; every --rebalance-every
// steps EPLB places the experts again from the loads of the window that just
// ended (the first window runs on the contiguous placement), with the
// migration that switch needs. Per step it reports the max/mean rank load
// of the static contiguous placement (before rebalancing) and of the placement
// in force (after); the run ends with "PERFORMANCE mode=trace ...".

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Migration.hpp>
#include <KokkosMoE_PlacementIO.hpp>
#include <KokkosMoE_RouteTrace.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace KokkosMoE;

std::vector<double> parse_load_list(std::string const& text, int layer) {
  std::vector<double> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    double v = 0;
    bool ok = true;
    try {
      v = std::stod(item, &used);
    } catch (std::exception const&) {
      ok = false;
    }
    while (ok && used < item.size() && (item[used] == ' ' || item[used] == '\t')) ++used;
    KOKKOSMOE_REQUIRE(ok && used == item.size(),
                      "--load (layer " << layer << "): '" << item << "' is not a number in '" << text << "'");
    out.push_back(v);
  }
  KOKKOSMOE_REQUIRE(!out.empty(), "--load (layer " << layer << ") is empty");
  return out;
}

std::string join(std::vector<int> const& v) {
  std::ostringstream os;
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? " " : "") << v[i];
  return os.str();
}

std::string ratio_text(RankLoadSummary const& s) {
  std::string const t = s.max_over_mean_text();
  std::ostringstream os;
  os.precision(15);
  os << t;
  if (t.find('/') != std::string::npos) os << " = " << s.max_over_mean;
  return os.str();
}

struct Options {
  std::string load_file;
  std::vector<std::string> load_lists;
  int slots = 0;
  int groups = 1;
  int nodes = 1;
  int ranks = 0;
  std::string policy = "eplb";
  std::string explicit_file;
  std::string current_file;
  std::string write_file;
  std::string write_loads;
  std::int64_t bytes_per_expert = 1;
  std::uint64_t version = 0;
  std::uint64_t generation = 1;
  bool brief = false;
  std::string trace;
  int rebalance_every = 10;
  int experts = 0;
  std::string write_series;
};

/// Placement driven by a routing trace (see the file comment).
int run_trace(Options const& o, MPI_Comm comm) {
  int const me = comm_rank(comm);
  auto const trace = read_route_trace(comm, o.trace);
  KOKKOSMOE_REQUIRE(trace.has_routes(), o.trace << ": the trace holds router logits only; --trace reads routes (kmoe-layer replays "
                                                           "the logits through a router and records its routes with run.record_routes)");
  int const E = o.experts > 0 ? o.experts : trace.max_expert() + 1;
  KOKKOSMOE_REQUIRE(E > 0 && trace.max_expert() < E,
                    o.trace << ": routes to expert " << trace.max_expert() << " but --experts is " << E);
  PlacementSpec spec;
  spec.policy = from_string<PlacementPolicy>(o.policy);
  KOKKOSMOE_REQUIRE(spec.policy != PlacementPolicy::explicit_slots, "--trace rebalances by EPLB policies, not an explicit placement");
  spec.ranks = o.ranks > 0 ? o.ranks : trace.ranks;
  spec.nodes = o.nodes;
  spec.groups = o.groups;
  spec.physical_slots = o.slots > 0 ? o.slots : E;
  KOKKOSMOE_REQUIRE(spec.nodes > 0 && spec.ranks % spec.nodes == 0,
                    "--ranks (" << spec.ranks << ") must be a positive multiple of --nodes (" << spec.nodes << ")");
  std::vector<int> node_of_rank(static_cast<std::size_t>(spec.ranks));
  for (int r = 0; r < spec.ranks; ++r) node_of_rank[static_cast<std::size_t>(r)] = r / (spec.ranks / spec.nodes);
  Placement const fixed = Placement::contiguous(E, spec.ranks, node_of_rank);
  Placement current = fixed;
  std::vector<double> window(static_cast<std::size_t>(E), 0.0);
  std::ostringstream out, csv;
  out << "kmoe-eplb: trace " << o.trace << " (" << trace.steps << " steps x " << trace.ranks << " ranks x " << trace.tokens
      << " tokens x top-" << trace.top_k << "), " << E << " experts on " << spec.ranks << " ranks / " << spec.nodes << " nodes, "
      << spec.physical_slots << " slots, policy " << o.policy << ", rebalance every " << o.rebalance_every << " steps\n"
      << "step  generation  max/mean before (contiguous)  max/mean after (rebalanced)\n";
  csv << "step,generation,max_over_mean_before,max_over_mean_after,migrated_bytes\n";
  double sum_before = 0, sum_after = 0, worst_before = 0, worst_after = 0;
  int generation = 0;
  std::int64_t migrated = 0, switch_bytes = 0;
  for (int s = 0; s < trace.steps; ++s) {
    auto const load = trace.step_load(s, E);
    double const before = rank_load_summary(fixed, load).max_over_mean;
    double const after = rank_load_summary(current, load).max_over_mean;
    sum_before += before;
    sum_after += after;
    worst_before = std::max(worst_before, before);
    worst_after = std::max(worst_after, after);
    out << std::setw(4) << s << std::setw(12) << generation << std::setw(30) << before << std::setw(29) << after << "\n";
    csv << s << "," << generation << "," << before << "," << after << "," << switch_bytes << "\n";
    switch_bytes = 0;
    for (int e = 0; e < E; ++e) window[static_cast<std::size_t>(e)] += load[static_cast<std::size_t>(e)];
    if ((s + 1) % o.rebalance_every == 0 && s + 1 < trace.steps) {
      spec.generation = static_cast<std::uint64_t>(++generation);
      auto const next = build_placements({window}, spec).front().placement;
      auto const plan = plan_migration(current, next, o.bytes_per_expert);
      for (auto act : {MigrationAction::same_node_copy, MigrationAction::cross_node_copy}) switch_bytes += plan.totals.bytes_of(act);
      migrated += switch_bytes;
      current = next;
      std::fill(window.begin(), window.end(), 0.0);
    }
  }
  double const n = static_cast<double>(trace.steps);
  out << "PERFORMANCE mode=trace steps=" << trace.steps << " rebalance_every=" << o.rebalance_every << " generations=" << generation + 1
      << " mean_max_over_mean_before=" << sum_before / n << " mean_max_over_mean_after=" << sum_after / n
      << " max_max_over_mean_before=" << worst_before << " max_max_over_mean_after=" << worst_after << " migrated_bytes=" << migrated << "\n";
  collective(comm, "writing the series", [&] {
    if (me != 0) return;
    if (!o.write_series.empty()) {
      std::ofstream f(o.write_series);
      f << csv.str();
      KOKKOSMOE_REQUIRE(f.good(), "cannot write series file '" << o.write_series << "'");
      out << "wrote " << o.write_series << "\n";
    }
    std::cout << out.str();
    std::cout.flush();
  });
  return 0;
}

int run(Options const& o, MPI_Comm comm) {
  if (!o.trace.empty()) {
    KOKKOSMOE_REQUIRE(o.load_file.empty() && o.load_lists.empty(), "give either --trace or loads (--load-file / --load), not both");
    return run_trace(o, comm);
  }
  int const me = comm_rank(comm);
  // Loads: every rank reads the same matrix (collectively) or parses the same options.
  std::vector<std::vector<double>> load;
  std::string source;
  if (!o.load_file.empty()) {
    KOKKOSMOE_REQUIRE(o.load_lists.empty(), "give either --load-file or --load, not both");
    load = read_load_matrix(comm, o.load_file);
    source = o.load_file;
  } else {
    KOKKOSMOE_REQUIRE(!o.load_lists.empty(), "no loads: give --load-file FILE or --load l0,l1,... (once per layer)");
    for (std::size_t l = 0; l < o.load_lists.size(); ++l) load.push_back(parse_load_list(o.load_lists[l], static_cast<int>(l)));
    source = "command line";
  }
  int const L = static_cast<int>(load.size());
  int const E = static_cast<int>(load.front().size());
  for (int l = 0; l < L; ++l)
    KOKKOSMOE_REQUIRE(static_cast<int>(load[l].size()) == E,
                      "layer " << l << " has " << load[l].size() << " loads, layer 0 has " << E);

  PlacementSpec spec;
  spec.policy = from_string<PlacementPolicy>(o.policy);
  spec.ranks = o.ranks > 0 ? o.ranks : comm_size(comm);
  spec.nodes = o.nodes;
  spec.groups = o.groups;
  spec.physical_slots = o.slots > 0 ? o.slots : E;
  spec.version = o.version;
  spec.generation = o.generation;
  KOKKOSMOE_REQUIRE(spec.nodes > 0 && spec.ranks % spec.nodes == 0,
                    "--ranks (" << spec.ranks << ") must be a positive multiple of --nodes (" << spec.nodes << ")");
  std::vector<int> node_of_rank(static_cast<std::size_t>(spec.ranks));
  for (int r = 0; r < spec.ranks; ++r) node_of_rank[r] = r / (spec.ranks / spec.nodes);
  // A placement file must match the experts and ranks, and takes the node-major nodes.
  auto read_placements = [&](std::string const& file) {
    auto ps = placements_from_json(read_text_file(comm, file, "placement file"), file);
    KOKKOSMOE_REQUIRE(ps.size() == 1 || static_cast<int>(ps.size()) == L,
                      "placement file '" << file << "' has " << ps.size() << " layers for " << L << " layers of loads");
    for (auto& p : ps) {
      KOKKOSMOE_REQUIRE(p.num_experts() == E && p.num_ranks() == spec.ranks,
                        "placement file '" << file << "' places " << p.num_experts() << " experts on " << p.num_ranks()
                                           << " ranks; the loads have " << E << " experts and --ranks is " << spec.ranks);
      p = p.with_nodes(node_of_rank);
    }
    return ps;
  };
  if (spec.policy == PlacementPolicy::explicit_slots) {
    KOKKOSMOE_REQUIRE(!o.explicit_file.empty(), "--policy explicit needs --placement FILE");
    for (auto const& p : read_placements(o.explicit_file)) spec.explicit_slots.push_back(p.slots());
  }
  auto const layers = build_placements(load, spec);

  std::vector<Placement> current;
  std::string current_name = "contiguous";
  if (!o.current_file.empty()) {
    current = read_placements(o.current_file);
    current_name = o.current_file;
  }

  std::ostringstream out;
  out << "kmoe-eplb: " << L << " layer" << (L == 1 ? "" : "s") << " x " << E << " experts from " << source
      << "; policy " << o.policy << ", slots " << layers.front().placement.num_slots() << ", groups " << spec.groups << ", nodes "
      << spec.nodes << ", ranks " << spec.ranks << "\n";
  double worst_before = 0, worst_after = 0;
  std::string worst_before_text = "1", worst_after_text = "1";
  for (int l = 0; l < L; ++l) {
    auto const& lp = layers[static_cast<std::size_t>(l)];
    auto const& p = lp.placement;
    auto const before = rank_load_summary(Placement::contiguous(E, spec.ranks, node_of_rank), load[l]);
    out << "layer " << l << ": " << to_string(lp.policy) << "\n";
    for (int r = 0; r < p.num_ranks(); ++r)
      out << "  rank " << r << " (node " << node_of_rank[r] << "): experts [" << join(lp.phy2log_by_rank[r])
          << "] replicas [" << join(lp.replica_rank_by_rank[r]) << "] load " << lp.load.rank_load_text(r) << "\n";
    out << "  logcnt [" << join(lp.logcnt) << "]\n";
    out << "layer " << l << " max/mean: before " << ratio_text(before) << " (contiguous, no replicas), after "
        << ratio_text(lp.load) << "\n";
    if (before.max_over_mean > worst_before) {
      worst_before = before.max_over_mean;
      worst_before_text = before.max_over_mean_text();
    }
    if (lp.load.max_over_mean > worst_after) {
      worst_after = lp.load.max_over_mean;
      worst_after_text = lp.load.max_over_mean_text();
    }

    Placement const cur = current.empty() ? Placement::contiguous(E, spec.ranks, node_of_rank)
                                          : current[current.size() == 1 ? 0 : static_cast<std::size_t>(l)];
    auto const plan = plan_migration(cur, p, o.bytes_per_expert);
    out << "  migration from " << current_name << " (" << cur.num_slots() << " -> " << p.num_slots() << " slots, "
        << o.bytes_per_expert << " bytes per expert):";
    for (int c = 0; c < kNumMigrationActions; ++c) {
      auto const act = static_cast<MigrationAction>(c);
      out << " " << to_string(act) << " " << plan.totals.count_of(act) << " (" << plan.totals.bytes_of(act) << " B)"
          << (c + 1 < kNumMigrationActions ? "," : "");
    }
    out << "\n  peak resident bytes during the switch: max " << plan.peak_resident_bytes_max << " per rank, total "
        << plan.peak_resident_bytes_total << " (per rank: source slots + non-retained target slots)\n";
    if (!o.brief)
      for (auto const& st : plan.steps)
        out << "    slot " << st.target_slot << " (rank " << st.target_rank << ") expert " << st.expert << ": "
            << to_string(st.action) << " <- slot " << st.source_slot << " (rank " << st.source_rank << ")\n";
  }
  out << "PERFORMANCE layers=" << L << " experts=" << E << " slots=" << layers.front().placement.num_slots()
      << " ranks=" << spec.ranks << " max_over_mean_before=" << worst_before_text
      << " max_over_mean_after=" << worst_after_text << "\n";

  if (!o.write_file.empty()) {
    std::vector<Placement> ps;
    for (auto const& lp : layers) ps.push_back(lp.placement);
    std::string const text = placements_to_json(ps);
    int ok = 1;
    if (me == 0) {
      std::ofstream f(o.write_file);
      f << text << "\n";
      ok = f.good() ? 1 : 0;
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, comm);
    KOKKOSMOE_REQUIRE(ok, "cannot write placement file '" << o.write_file << "'");
    out << "wrote " << o.write_file << "\n";
  }
  if (!o.write_loads.empty()) {
    auto const ends_with = [&](char const* suffix) {
      std::string const sfx(suffix);
      return o.write_loads.size() >= sfx.size() &&
             o.write_loads.compare(o.write_loads.size() - sfx.size(), sfx.size(), sfx) == 0;
    };
    if (ends_with(".h5") || ends_with(".hdf5")) {
      write_load_matrix_hdf5(comm, o.write_loads, load);
    } else {
      std::ostringstream j;
      j << "{\"layers\": [";
      j.precision(17);
      for (int l = 0; l < L; ++l) {
        j << (l ? ", " : "") << "{\"load\": [";
        for (int e = 0; e < E; ++e) j << (e ? ", " : "") << load[l][e];
        j << "]}";
      }
      j << "]}\n";
      int ok = 1;
      if (me == 0) {
        std::ofstream f(o.write_loads);
        f << j.str();
        ok = f.good() ? 1 : 0;
      }
      MPI_Bcast(&ok, 1, MPI_INT, 0, comm);
      KOKKOSMOE_REQUIRE(ok, "cannot write load file '" << o.write_loads << "'");
    }
    out << "wrote " << o.write_loads << "\n";
  }
  if (me == 0) {
    std::cout << out.str();
    std::cout.flush();
  }
  return 0;
}

}  // namespace

int main(int argc, char* argv[]) {
  if (!kmoe_app::start_mpi(argc, argv, "kmoe-eplb")) return 1;
  int rc = 0;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    int const rank = KokkosMoE::comm_rank(MPI_COMM_WORLD);
    CLI::App app{"kmoe-eplb: expert placement (EPLB) for per-layer expert loads"};
    Options o;
    app.add_option("--load-file", o.load_file, "loads: JSON {\"layers\": [{\"load\": [...]}]} / {\"load\": [...]} or HDF5 \"/load\" [L, E] or [E]");
    app.add_option("--load", o.load_lists, "loads of one layer, comma-separated (repeat per layer)")
        ->allow_extra_args(false)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    app.add_option("--slots", o.slots, "physical slots per layer (default: number of experts)")->check(CLI::PositiveNumber);
    app.add_option("--groups", o.groups, "expert groups (hierarchical EPLB)")->check(CLI::PositiveNumber);
    app.add_option("--nodes", o.nodes, "nodes")->check(CLI::PositiveNumber);
    app.add_option("--ranks", o.ranks, "ranks (GPUs) of the EP communicator (default: MPI size)")->check(CLI::PositiveNumber);
    app.add_option("--policy", o.policy, "eplb | eplb_hierarchical | eplb_global | contiguous | round_robin | explicit");
    app.add_option("--placement", o.explicit_file, "slot list file for --policy explicit");
    app.add_option("--current", o.current_file, "current placement (slot list file; default contiguous)");
    app.add_option("--write-placement", o.write_file, "write the new placement as a slot list file");
    app.add_option("--bytes-per-expert", o.bytes_per_expert, "parameter bytes of one expert (migration plan)")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--version", o.version, "checkpoint version written into the slots");
    app.add_option("--generation", o.generation, "generation id of the new placement");
    app.add_option("--write-loads", o.write_loads, "write the loads read (.h5/.hdf5: HDF5 \"/load\" [L, E]; else JSON)");
    app.add_flag("--brief", o.brief, "omit the per-slot migration steps");
    app.add_option("--trace", o.trace, "routing trace (.h5, or a directory of experts.npy/gates.npy): rebalance as its load drifts");
    app.add_option("--rebalance-every", o.rebalance_every, "--trace: steps per placement generation")->check(CLI::PositiveNumber);
    app.add_option("--experts", o.experts, "--trace: number of experts (default: largest id in the trace + 1)")->check(CLI::PositiveNumber);
    app.add_option("--write-series", o.write_series, "--trace: per-step CSV (step, generation, max/mean before and after, migrated bytes)");
    app.allow_extras();  // --kokkos-* arguments pass through
    bool stop = false;
    try {
      app.parse(argc, argv);
      for (auto const& extra : app.remaining())
        if (extra.rfind("--kokkos", 0) != 0) throw CLI::ExtrasError({extra});
    } catch (CLI::ParseError const& e) {
      rc = rank == 0 ? app.exit(e) : e.get_exit_code();
      stop = true;
    }
    if (!stop) {
      try {
        rc = run(o, MPI_COMM_WORLD);
      } catch (std::exception const& e) {
        if (rank == 0) std::fprintf(stderr, "kmoe-eplb: error: %s\n", e.what());
        rc = 1;
      }
    }
  }
  MPI_Finalize();
  return rc;
}
