// kmoe-layer: runs steps of one MoE layer from a TOML deck on every rank.
//
//   mpiexec -n 4 kmoe-layer inputs/quickstart.toml [--steps N] [--report file.json]
//
// Rank 0 echoes the build and the deck (with --verbose the Kokkos
// configuration and the resolved deck, which the report always holds),
// prints a progress line on long runs, a per-stage summary (and, with
// [run] compare = [...], the algorithms side by side on the same routes with
// an output check), writes the JSON report and the HDF5 time series, and ends
// with one greppable line: PERFORMANCE key=value ...
//
// A run is: setup -> for every step { routes_of_step -> forward of every
// algorithm -> compare_outputs -> expert_load (and the bias update) } ->
// print_outputs -> summary (report, time series, PERFORMANCE line).
//
// With [run] mode = "train" the layer trains instead (kmoe_layer_train.cpp):
// every step a forward, the mean squared error against a teacher layer of
// the same shape (experts from [train] teacher_seed; its router the
// student's initial one unless teacher_router = "own"), the backward and an
// optimizer step; the report's "train" object holds the loss, gradient norm
// and balance loss per step and the backward's stage seconds, and the run
// ends with: TRAIN steps=N loss_first=... loss_last=... loss_ratio=...
//
// With [run] mode = "serve" the deck's [[serve.step]] sequence runs on a
// decode bucket (kmoe_layer_serve.cpp), ending with SERVE steps=N ...
//
// With an EPLB placement and [placement] rebalance_every = N (or
// --rebalance-every N), every N steps the routes those steps observed on all
// ranks rebuild the placement (KokkosMoE_Rebalance.hpp): the next generation's
// slots get their experts' weights by migration and the layer continues on
// it. Each switch prints a "rebalance:" line; the report's "rebalance" object
// holds the switches and, per measured step, the ideal max/mean rank load of
// the first placement and of the live one.

#include <KokkosMoE_BiasController.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Rebalance.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"
#include "kmoe_layer_output.hpp"
#include "kmoe_layer_serve.hpp"
#include "kmoe_layer_train.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>

namespace {

using namespace KokkosMoE;
using kmoe_layer::Exec;
using kmoe_layer::json;
using kmoe_layer::MS;

struct Options {
  std::string deck;
  int steps = -1;
  int warmup = -1;
  std::string report;
  std::string hdf5;
  std::string record_routes;
  std::string algorithm;
  int rebalance_every = -1;
  bool print_output = false;
  bool verbose = false;
};

/// One live rebalancing of the routed experts.
struct Switch {
  int after_step = 0;
  RebalanceRecord record;
  double seconds = 0;  // slowest rank
};

/// Per-algorithm accumulation over the measured steps.
struct Totals {
  std::map<std::string, double> seconds;  // sum over steps of the slowest rank's stage time
  int steps = 0;
  Exchange::ByteLedger ledger;            // last step, summed over ranks
  std::string transport;
  std::int64_t dropped = 0, attempted = 0, accepted = 0;
  bool identical = true;                  // compare mode: equal to the first algorithm
  double max_abs_diff = 0;
  double max_abs_reference = 0;           // compare mode: the largest |output| of the first algorithm
  std::string output_digest;              // last step's output rows of every rank, in rank order
  std::string schedule;                   // schedule/chunks of the steps
  std::vector<TaskRecord> tasks;          // last step's task graph (names, streams)
  std::vector<double> task_times;         // [rank][task][start, end] of the last step
};

/// Every rank's [start, end) of each task of its step, in rank order (the
/// same task graph runs on every rank).
std::vector<double> gather_task_times(std::vector<TaskRecord> const& tasks, MPI_Comm comm, double watchdog) {
  int const P = comm_size(comm), me = comm_rank(comm);
  int n = static_cast<int>(tasks.size()), nmax = 0;
  allreduce_watched(&n, &nmax, 1, MPI_INT, MPI_MAX, comm, "task time reduction", watchdog);
  KOKKOSMOE_REQUIRE(n == nmax, "ranks ran step graphs of different sizes (" << n << " vs " << nmax << " tasks)");
  std::vector<double> mine(static_cast<std::size_t>(P) * n * 2, 0.0), all(mine.size(), 0.0);
  for (int i = 0; i < n; ++i) {
    mine[(static_cast<std::size_t>(me) * n + i) * 2] = tasks[static_cast<std::size_t>(i)].start;
    mine[(static_cast<std::size_t>(me) * n + i) * 2 + 1] = tasks[static_cast<std::size_t>(i)].end;
  }
  allreduce_watched(mine.data(), all.data(), static_cast<int>(all.size()), MPI_DOUBLE, MPI_SUM, comm, "task time reduction", watchdog);
  return all;
}

std::string fmt(double v, int p = 4) {
  std::ostringstream os;
  os.precision(p);
  os << v;
  return os.str();
}

/// Content digest of every rank's rows, in rank order (the same on every rank).
template <class T>
std::string output_digest(RowMatrix<T, MS> const& out, MPI_Comm comm, double watchdog) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  return ranks_digest(comm, h.data(), h.size() * sizeof(T), watchdog);
}

/// The run: its setup, the layer and what the steps accumulate.
template <class T>
class LayerRun {
 public:
  LayerRun(LayerDeck const& deck, Options const& opt)
      : deck_(deck),
        opt_(opt),
        world_(MPI_COMM_WORLD),
        rank_(comm_rank(world_)),
        size_(comm_size(world_)),
        setup_(Setup::make_run(deck, world_)),
        router_weight_(Setup::router_weight<T, MS>(deck)),
        layer_(std::make_unique<MoELayer<T, Exec, MS>>(setup_.config, *setup_.comms, setup_.placement, router_weight_,
                                                        Setup::routed_weights<T, MS>(exec_, deck, setup_, rank_, world_),
                                                        Setup::shared_weights<T, MS>(exec_, deck))) {
    Setup::load_correction_bias(exec_, deck, layer_->router());
    algorithms_ = deck.run.compare;
    if (algorithms_.empty())
      algorithms_.push_back(opt.algorithm.empty() ? deck.exchange.algorithm : from_string<Exchange::Algorithm>(opt.algorithm));
    watchdog_ = deck.exchange.watchdog_seconds;
    warmup_ = opt.warmup >= 0 ? opt.warmup : deck.run.warmup;
    steps_ = opt.steps >= 0 ? opt.steps : deck.run.steps;
    tokens_ = Setup::tokens_per_rank(deck);
    first_ = Setup::first_token(deck, rank_);
    if (deck.bias_update != "none")
      bias_ = std::make_unique<BiasController>(from_string<BiasUpdateRule>(deck.bias_update), BiasSchedule::constant(deck.bias_gamma));
    outs_.resize(algorithms_.size());
    if (deck.tokens.source == "trace") {
      trace_ = Setup::load_trace(deck, world_);
      replay_ = trace_replay(*trace_, deck.tokens.replay, Setup::trace_where(deck));
    }
    record_path_ = opt.record_routes.empty() ? deck.run.record_routes : opt.record_routes;
    record_logits_ = deck.run.record_logits;
    collective(world_, "recording logits", [&] {
      KOKKOSMOE_REQUIRE(!record_logits_ || !trace_ || replay_ == TraceReplay::logits,
                        deck.path << ": run.record_logits: the trace '" << deck.tokens.trace
                                  << "' replays routes, which have no logits (tokens.replay = \"logits\" replays a trace's logits)");
    }, watchdog_);
    rebalance_every_ = opt.rebalance_every >= 0 ? opt.rebalance_every : deck.placement.rebalance_every;
    collective(world_, "rebalancing setup", [&] {
      KOKKOSMOE_REQUIRE(rebalance_every_ == 0 || is_eplb(deck.placement.policy),
                        "--rebalance-every " << rebalance_every_ << " needs an EPLB placement policy (" << deck.path
                                             << ": placement.policy = \"" << to_string(deck.placement.policy) << "\")");
    }, watchdog_);
    window_.assign(static_cast<std::size_t>(deck.model.experts), 0.0);
  }

  int run() {
    if (rank_ == 0) print_setup();
    int const every = deck_.run.progress_every > 0 ? deck_.run.progress_every : std::max(1, steps_ / 10);
    RowMatrix<T, MS> hidden;  // one matrix for every step's rows
    for (int step = 0; step < warmup_ + steps_; ++step) {
      kmoe_app::fault_point(rank_, step);
      bool const measured = step >= warmup_;
      if (step == 0)
        hidden = Setup::hidden_rows<T, MS>(deck_, step, first_, tokens_, rank_);
      else
        Setup::hidden_rows_into(deck_, step, first_, hidden, rank_);
      step_routes(step, hidden);
      std::vector<std::vector<float>> host_out(algorithms_.size());
      for (std::size_t a = 0; a < algorithms_.size(); ++a) forward(a, hidden, measured, host_out[a]);
      if (!record_path_.empty())
        record_routes(world_, table_, recorded_, watchdog_, record_logits_ ? step_logits() : RowMatrix<float, MS>());
      if (measured && algorithms_.size() > 1) compare_outputs(host_out);
      expert_load(measured);
      if (rebalance_every_ > 0 && (step + 1) % rebalance_every_ == 0 && step + 1 < warmup_ + steps_) rebalance(step);
      if (rank_ == 0 && measured && ((step - warmup_ + 1) % every == 0 || step + 1 == warmup_ + steps_) && steps_ >= 20) {
        std::printf("progress: step %d/%d (%.1f s elapsed)\n", step - warmup_ + 1, steps_, timer_.seconds());
        std::fflush(stdout);
      }
    }
    for (std::size_t a = 0; a < algorithms_.size(); ++a) totals_[name(a)].output_digest = output_digest(outs_[a], world_, watchdog_);
    if (!record_path_.empty())
      collective(world_, "writing the route trace", [&] {
        if (rank_ != 0) return;
        write_route_trace(record_path_, recorded_, deck_.model.experts);
        std::printf("routes: %s (%d steps x %d ranks x %lld tokens x top-%d%s)\n", record_path_.c_str(), recorded_.steps,
                    recorded_.ranks, static_cast<long long>(recorded_.tokens), recorded_.top_k,
                    recorded_.has_logits() ? (", logits of " + std::to_string(recorded_.num_experts) + " experts").c_str() : "");
      });
    if (opt_.print_output) print_outputs();
    summary();
    return 0;
  }

 private:
  std::string name(std::size_t a) const { return to_string(algorithms_[a]); }

  void print_setup() const {
    std::cout << "topology: " << setup_.topology.num_nodes() << " node(s), " << size_ << " rank(s), relays/node "
              << setup_.comms->layout().relays_per_node << "\n"
              << setup_.comms->table() << "placement: " << setup_.placement.num_slots() << " slots for "
              << setup_.placement.num_experts() << " experts (" << to_string(deck_.placement.policy) << "), exchange transport "
              << to_string(deck_.exchange.transport) << ", schedule " << to_string(deck_.run.schedule)
              << (deck_.run.chunks > 1 ? " (" + std::to_string(deck_.run.chunks) + " chunks)" : std::string()) << "\n";
    if (deck_.topology.fabric.enabled())
      std::cout << "times: emulated (" << deck_.topology.fabric.describe() << ")\n";
    if (trace_)
      std::cout << "tokens: trace " << deck_.tokens.trace << " (" << trace_->steps << " steps), replaying its "
                << (replay_ == TraceReplay::logits ? "logits through the router" : "routes") << "\n";
  }

  std::string evidence() const { return deck_.topology.fabric.enabled() ? "emulated" : "measured"; }

  /// The step's routes: drawn from the deck's distribution, or (router
  /// decks) left to the layer's router; with several algorithms the router
  /// runs once and every algorithm gets its routes.
  void step_routes(int step, RowMatrix<T, MS> const& hidden) {
    router_seconds_ = 0;
    explicit_slot_ = {};
    replayed_logits_ = {};
    if (trace_ && replay_ == TraceReplay::logits) {
      // Recorded logits through this layer's router (its score function,
      // correction bias, limits and admission), as route() does after its GEMM.
      Kokkos::Timer t;
      replayed_logits_ = trace_logits<MS>(*trace_, step, rank_);
      layer_->router().route_logits(exec_, replayed_logits_, table_);
      router_seconds_ = t.seconds();
    } else if (trace_) {
      table_ = trace_routes<MS>(*trace_, step, rank_, deck_.model.experts);
    } else if (deck_.tokens.source != "router") {
      table_ = Setup::sampled_routes<MS>(exec_, deck_, setup_.config, step, first_, tokens_, rank_, explicit_slot_);
    } else if (algorithms_.size() > 1) {
      Kokkos::Timer t;
      RouteOptions<MS> ro;
      ro.gemm_path = setup_.config.router_gemm;
      layer_->router().route(exec_, hidden, router_weight_, table_, ro);
      router_seconds_ = t.seconds();
    }
  }

  /// One algorithm's forward of the step, its times, ledger and routes.
  void forward(std::size_t a, RowMatrix<T, MS> const& hidden, bool measured, std::vector<float>& host_out) {
    auto& out = outs_[a];
    if (out.extent(0) != hidden.extent(0) || out.extent(1) != hidden.extent(1))
      out = RowMatrix<T, MS>("kmoe-layer::out", hidden.extent(0), hidden.extent(1));
    StepRecord rec;
    if (deck_.tokens.source == "router" && algorithms_.size() == 1) {
      rec = layer_->forward(exec_, hidden, out, algorithms_[a]);
      table_ = layer_->routes();
    } else {
      rec = layer_->forward_routes(exec_, hidden, table_, out, algorithms_[a], explicit_slot_);
      if (deck_.tokens.source == "router" || replay_ == TraceReplay::logits) {
        rec.seconds["router"] += router_seconds_;
        rec.seconds["total"] += router_seconds_;
      }
    }
    rec.seconds["other"] = std::max(0.0, rec.unaccounted_seconds());
    auto const sl = kmoe_app::slowest(rec.seconds, world_, watchdog_);
    auto const ledger = rec.ledger.reduced(world_, watchdog_);
    auto const rc = reduce_route_counts(rec.routes, world_, watchdog_);
    auto task_times = gather_task_times(rec.tasks, world_, watchdog_);
    if (algorithms_.size() > 1) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
      host_out.resize(h.size());
      for (std::size_t i = 0; i < h.size(); ++i) host_out[i] = to_float(h.data()[i]);
    }
    counts_ = rec.expert_counts;
    if (!measured) return;
    auto& tot = totals_[name(a)];
    for (auto const& kv : sl) tot.seconds[kv.first] += kv.second;
    ++tot.steps;
    tot.ledger = ledger;
    tot.transport = rec.transport;
    tot.schedule = rec.schedule;
    tot.tasks = rec.tasks;
    tot.task_times = std::move(task_times);
    tot.attempted += rc.attempted;
    tot.accepted += rc.accepted;
    tot.dropped += rc.dropped;
    std::string const pre = algorithms_.size() > 1 ? name(a) + "/" : std::string();
    for (auto const& kv : sl) series_.add(pre + "seconds_" + kv.first, kv.second);
    series_.add(pre + "dropped_routes", static_cast<double>(rc.dropped + ledger.dispatch.sender_drops + ledger.dispatch.receiver_drops));
    series_.add(pre + "inter_node_payload_bytes", static_cast<double>(ledger.dispatch.inter_node_payload_bytes()));
    series_.add(pre + "intra_node_payload_bytes", static_cast<double>(ledger.dispatch.by_class(Exchange::LinkClass::intra_node).payload_bytes));
    series_.add(pre + "same_rank_rows", static_cast<double>(ledger.dispatch.by_class(Exchange::LinkClass::same_rank).rows));
    series_.add(pre + "relay_rows", static_cast<double>(ledger.dispatch.relay_rows()));
    series_.add(pre + "sender_drops", static_cast<double>(ledger.dispatch.sender_drops));
    series_.add(pre + "receiver_drops", static_cast<double>(ledger.dispatch.receiver_drops));
  }

  /// Compare mode: algorithm a reproduced the first one's output: bit for
  /// bit, or, for a node-deduplicating exchange (whose partial sums change
  /// the summation tree and round once more through the return payload),
  /// within 2^-7 of the largest output.
  bool agrees(std::size_t a) {
    auto const& tot = totals_[name(a)];
    if (tot.identical) return true;
    bool const dedup = algorithms_[a] == Exchange::Algorithm::hierarchical_dedup || algorithms_[0] == Exchange::Algorithm::hierarchical_dedup;
    return dedup && tot.max_abs_diff <= std::ldexp(1.0, -7) * tot.max_abs_reference;
  }

  /// Compare mode: every algorithm must reproduce the first one's output.
  void compare_outputs(std::vector<std::vector<float>> const& host_out) {
    for (std::size_t a = 1; a < algorithms_.size(); ++a) {
      double diff[2] = {0, 0};  // max |difference|, max |reference|
      int same = host_out[a].size() == host_out[0].size() ? 1 : 0;
      if (same && !host_out[0].empty()) {
        same = std::memcmp(host_out[a].data(), host_out[0].data(), host_out[0].size() * sizeof(float)) == 0;
        for (std::size_t i = 0; i < host_out[0].size(); ++i) {
          diff[0] = std::max(diff[0], static_cast<double>(std::fabs(host_out[a][i] - host_out[0][i])));
          diff[1] = std::max(diff[1], static_cast<double>(std::fabs(host_out[0][i])));
        }
      }
      int all_same = 0;
      double max_diff[2] = {0, 0};
      allreduce_watched(&same, &all_same, 1, MPI_INT, MPI_MIN, world_, "output comparison", watchdog_);
      allreduce_watched(diff, max_diff, 2, MPI_DOUBLE, MPI_MAX, world_, "output comparison", watchdog_);
      auto& tot = totals_[name(a)];
      tot.identical = tot.identical && all_same == 1;
      tot.max_abs_diff = std::max(tot.max_abs_diff, max_diff[0]);
      tot.max_abs_reference = std::max(tot.max_abs_reference, max_diff[1]);
    }
  }

  /// Global load per expert, balance of the step, bias update for the next one.
  void expert_load(bool measured) {
    std::vector<index_t> global(counts_.size());
    allreduce_watched(counts_.data(), global.data(), static_cast<int>(counts_.size()), MPI_INT64_T, MPI_SUM, world_, "expert load reduction",
                      watchdog_);
    std::vector<double> row(global.begin(), global.end());
    for (std::size_t e = 0; e < row.size(); ++e) window_[e] += row[e];
    if (measured) {
      series_.add_row("expert_load", row);
      if (rebalance_every_ > 0) {
        // Ideal rank loads (an expert's routes split evenly over its copies).
        first_mm_.push_back(rank_load_summary(setup_.placement, row).max_over_mean);
        live_mm_.push_back(rank_load_summary(layer_->placement(), row).max_over_mean);
        series_.add("rank_load_max_over_mean_first_placement", first_mm_.back());
        series_.add("rank_load_max_over_mean", live_mm_.back());
        series_.add("placement_generation", static_cast<double>(layer_->placement().generation()));
      }
      double mx = 0, mean = 0;
      for (double x : row) {
        mx = std::max(mx, x);
        mean += x;
      }
      mean /= std::max<std::size_t>(1, row.size());
      series_.add("expert_load_max_over_mean", mean > 0 ? mx / mean : 0.0);
    }
    if (bias_) {
      Kokkos::View<index_t*, MS> gc("kmoe-layer::global_counts", global.size());
      auto hg = Kokkos::create_mirror_view(gc);
      for (std::size_t e = 0; e < global.size(); ++e) hg(e) = global[e];
      Kokkos::deep_copy(gc, hg);
      bias_->update(exec_, gc, layer_->router().correction_bias());
    }
  }

  /// EPLB on the window's routes, the weights migrated, the layer rebuilt on
  /// the new generation (router weight, correction bias and shared experts
  /// carried over).
  void rebalance(int step) {
    PlacementSpec spec;
    spec.policy = deck_.placement.policy;
    spec.physical_slots = deck_.placement.physical_slots;
    spec.groups = deck_.placement.groups;
    auto r = rebalance_experts(world_, layer_->placement(), setup_.node_of_rank, layer_->routed_weights(), window_, spec);
    std::optional<Experts::ExpertWeights<T, MS>> shared;
    if (layer_->shared_weights()) shared = *layer_->shared_weights();
    auto const bias = layer_->router().correction_bias();
    auto next = std::make_unique<MoELayer<T, Exec, MS>>(Setup::layer_config(deck_, setup_, r.placement), *setup_.comms, r.placement,
                                                        router_weight_, std::move(r.weights), std::move(shared));
    Kokkos::deep_copy(exec_, next->router().correction_bias(), bias);
    Compat::fence(exec_, "kmoe-layer: correction bias carried over");
    layer_ = std::move(next);
    Switch sw;
    sw.after_step = step;
    sw.record = std::move(r.record);
    allreduce_watched(&sw.record.seconds, &sw.seconds, 1, MPI_DOUBLE, MPI_MAX, world_, "rebalancing time", watchdog_);
    std::fill(window_.begin(), window_.end(), 0.0);
    if (rank_ == 0) {
      auto const& t = sw.record.ledger.sent_total;
      std::printf("rebalance: after step %d -> generation %llu, window max/mean rank load %.4g -> %.4g, moved %.4g MB "
                  "(same node %.4g, cross node %.4g) in %.3g s\n",
                  step, static_cast<unsigned long long>(sw.record.generation), sw.record.before.max_over_mean,
                  sw.record.after.max_over_mean,
                  1e-6 * static_cast<double>(t.bytes_of(MigrationAction::same_node_copy) + t.bytes_of(MigrationAction::cross_node_copy)),
                  1e-6 * static_cast<double>(t.bytes_of(MigrationAction::same_node_copy)),
                  1e-6 * static_cast<double>(t.bytes_of(MigrationAction::cross_node_copy)), sw.seconds);
      std::fflush(stdout);
    }
    switches_.push_back(std::move(sw));
  }

  /// The report's "rebalance" object.
  static double mean_of(std::vector<double> const& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  }

  json rebalance_report() const {
    json sw = json::array();
    for (auto const& s : switches_) {
      auto const& t = s.record.ledger.sent_total;
      sw.push_back({{"after_step", s.after_step},
                    {"generation", s.record.generation},
                    {"window_max_over_mean_before", s.record.before.max_over_mean},
                    {"window_max_over_mean_after", s.record.after.max_over_mean},
                    {"same_rank_duplicate_bytes", t.bytes_of(MigrationAction::same_rank_duplicate)},
                    {"same_node_bytes", t.bytes_of(MigrationAction::same_node_copy)},
                    {"cross_node_bytes", t.bytes_of(MigrationAction::cross_node_copy)},
                    {"seconds", s.seconds}});
    }
    return {{"every", rebalance_every_},
            {"generations", switches_.size()},
            {"switches", sw},
            {"max_over_mean_first_placement", first_mm_},
            {"max_over_mean_live", live_mm_},
            {"mean_max_over_mean_first_placement", mean_of(first_mm_)},
            {"mean_max_over_mean_live", mean_of(live_mm_)}};
  }

  /// Every rank's output rows after the last step, gathered to rank 0 so the
  /// lines come out in rank order.
  void print_outputs() const {
    std::ostringstream mine;
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), outs_[0]);
    for (std::size_t t = 0; t < h.extent(0); ++t) {
      mine << "output rank " << rank_ << " token " << t << ":";
      for (std::size_t c = 0; c < h.extent(1); ++c) mine << " " << std::setprecision(6) << static_cast<double>(to_float(h(t, c)));
      mine << "\n";
    }
    auto const all = allgather_strings(world_, mine.str(), watchdog_);
    if (rank_ == 0)
      for (auto const& text : all) std::cout << text;
    std::cout << std::flush;
  }

  /// Summary table, JSON report, HDF5 time series and the PERFORMANCE line.
  void summary() {
    json report;
    report["build"] = build_summary();
    report["deck"] = deck_.path;
    report["resolved_deck"] = deck_.resolved();
    report["ranks"] = size_;
    report["nodes"] = setup_.topology.num_nodes();
    report["tokens_per_rank"] = tokens_;
    report["evidence"] = evidence();
    if (deck_.topology.fabric.enabled()) report["fabric"] = deck_.topology.fabric.describe();
    report["steps"] = steps_;
    report["warmup"] = warmup_;
    report["topology"] = json::parse(setup_.comms->to_json(0));
    if (rebalance_every_ > 0) report["rebalance"] = rebalance_report();
    std::vector<std::string> const stage_order = {"router", "route_plan", "dispatch", "experts", "combine_exchange", "combine",
                                                  "shared_experts", "statistics"};
    std::ostringstream table;
    table << "\n" << std::left << std::setw(14) << "algorithm" << std::right << std::setw(11) << "step_s" << std::setw(13) << "tokens/s/rk";
    for (auto const& s : stage_order) table << std::setw(11) << s.substr(0, 10);
    table << std::setw(8) << "other%" << std::setw(12) << "inter_B" << std::setw(12) << "intra_B" << std::setw(9) << "drops"
          << (algorithms_.size() > 1 ? "  identical" : "") << "\n";
    std::string perf;
    for (std::size_t a = 0; a < algorithms_.size(); ++a) {
      auto const& tot = totals_[name(a)];
      int const n = std::max(1, tot.steps);
      double const step_s = tot.seconds.count("total") ? tot.seconds.at("total") / n : 0.0;
      // Time outside the measured stages (the slowest rank's, per step).
      double const other = step_s > 0 && tot.seconds.count("other") ? tot.seconds.at("other") / n / step_s : 0.0;
      double const tps = step_s > 0 ? static_cast<double>(tokens_) / step_s : 0.0;
      std::int64_t const drops = tot.dropped + tot.ledger.dispatch.sender_drops + tot.ledger.dispatch.receiver_drops;
      table << std::left << std::setw(14) << name(a) << std::right << std::setw(11) << fmt(step_s) << std::setw(13) << fmt(tps);
      for (auto const& s : stage_order) table << std::setw(11) << (tot.seconds.count(s) ? fmt(tot.seconds.at(s) / n, 3) : "-");
      table << std::setw(8) << fmt(100 * other, 3) << std::setw(12) << tot.ledger.dispatch.inter_node_payload_bytes() << std::setw(12)
            << tot.ledger.dispatch.by_class(Exchange::LinkClass::intra_node).payload_bytes << std::setw(9) << drops;
      if (algorithms_.size() > 1)
        table << (a == 0             ? "  (reference)"
                  : tot.identical    ? "  yes"
                  : agrees(a)        ? "  within rounding (max |diff| " + fmt(tot.max_abs_diff) + ", node partial sums)"
                                     : "  NO (max |diff| " + fmt(tot.max_abs_diff) + ")");
      table << "\n";
      json j;
      j["steps"] = tot.steps;
      j["transport"] = tot.transport;
      j["step_seconds"] = step_s;
      j["tokens_per_second_per_rank"] = tps;
      json st;
      for (auto const& kv : tot.seconds) st[kv.first] = kv.second / n;
      j["stage_seconds"] = st;
      j["unaccounted_fraction"] = other;
      j["routes"] = {{"attempted", tot.attempted}, {"accepted", tot.accepted}, {"dropped", tot.dropped}};
      j["ledger_last_step"] = json::parse(tot.ledger.to_json(0));
      j["output_digest"] = tot.output_digest;
      j["schedule"] = tot.schedule;
      {
        // The last step's task graph as it ran: per rank, each task's
        // [start, end) in seconds from the start of the step's graph.
        json tasks = json::array();
        std::size_t const nt = tot.tasks.size();
        for (std::size_t i = 0; i < nt; ++i) {
          json t = {{"name", tot.tasks[i].name}, {"stream", tot.tasks[i].stream}};
          json start = json::array(), end = json::array();
          for (int r = 0; r < size_; ++r) {
            start.push_back(tot.task_times[(static_cast<std::size_t>(r) * nt + i) * 2]);
            end.push_back(tot.task_times[(static_cast<std::size_t>(r) * nt + i) * 2 + 1]);
          }
          t["start_by_rank"] = start;
          t["end_by_rank"] = end;
          tasks.push_back(t);
        }
        j["tasks_last_step"] = tasks;
      }
      if (algorithms_.size() > 1) j["identical_to_" + name(0)] = tot.identical, j["max_abs_diff"] = tot.max_abs_diff;
      report["algorithms"][name(a)] = j;
      if (a == 0) perf = performance_line(tot, step_s, tps, other, drops, stage_order);
    }
    if (rank_ == 0) std::cout << table.str();
    std::vector<std::string> names;
    for (std::size_t a = 0; a < algorithms_.size(); ++a) names.push_back(name(a));
    kmoe_layer::write_outputs(world_, watchdog_, deck_.path, report, opt_.report.empty() ? deck_.run.report : opt_.report, &series_,
                              opt_.hdf5.empty() ? deck_.run.hdf5 : opt_.hdf5, {{"algorithms", json(names).dump()}});
    if (rank_ == 0) std::cout << perf << std::endl;
  }

  std::string performance_line(Totals const& tot, double step_s, double tps, double other, std::int64_t drops,
                               std::vector<std::string> const& stage_order) {
    int const n = std::max(1, tot.steps);
    std::ostringstream p;
    p << "PERFORMANCE algorithm=" << name(0) << " transport=" << tot.transport << " ranks=" << size_
      << " nodes=" << setup_.topology.num_nodes() << " tokens_per_rank=" << tokens_ << " steps=" << tot.steps << " step_s=" << fmt(step_s)
      << " tokens_per_s_per_rank=" << fmt(tps) << " evidence=" << evidence();
    for (auto const& s : stage_order)
      if (tot.seconds.count(s)) p << " " << s << "_s=" << fmt(tot.seconds.at(s) / n);
    p << " other_pct=" << fmt(100 * other, 3) << " inter_node_bytes=" << tot.ledger.dispatch.inter_node_payload_bytes()
      << " relay_rows=" << tot.ledger.dispatch.relay_rows() << " drops=" << drops << " output_digest=" << tot.output_digest;
    if (algorithms_.size() > 1) {
      bool all = true;
      for (std::size_t a = 0; a < algorithms_.size(); ++a) all = all && agrees(a);
      p << " compare_identical=" << (all ? "yes" : "no");
    }
    if (rebalance_every_ > 0) {
      p << " rebalance_every=" << rebalance_every_ << " generations=" << switches_.size()
        << " mean_max_over_mean_first_placement=" << fmt(mean_of(first_mm_)) << " mean_max_over_mean_live=" << fmt(mean_of(live_mm_));
    }
    return p.str();
  }

  LayerDeck const& deck_;
  Options const& opt_;
  MPI_Comm world_;
  int rank_, size_;
  Exec exec_;
  Setup::Run setup_;
  RowMatrix<T, MS> router_weight_;
  std::unique_ptr<MoELayer<T, Exec, MS>> layer_;
  std::vector<Exchange::Algorithm> algorithms_;
  double watchdog_ = 0;
  int warmup_ = 0, steps_ = 0;
  index_t tokens_ = 0, first_ = 0;
  std::unique_ptr<BiasController> bias_;
  std::vector<RowMatrix<T, MS>> outs_;
  RouteTable<MS> table_;
  /// The logits of the step's routes: replayed ones, or the router's.
  RowMatrix<float, MS> step_logits() const {
    return replay_ == TraceReplay::logits ? replayed_logits_ : layer_->router().logits();
  }

  std::optional<RouteTrace> trace_;  // tokens.source = "trace"
  TraceReplay replay_ = TraceReplay::routes;
  RowMatrix<float, MS> replayed_logits_;  // the step's logits of a logit replay
  bool record_logits_ = false;
  RouteTrace recorded_;              // run.record_routes
  std::string record_path_;
  Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot_;
  double router_seconds_ = 0;
  std::vector<index_t> counts_;
  int rebalance_every_ = 0;
  std::vector<double> window_;             // routes per expert since the last rebalancing (all ranks)
  std::vector<double> first_mm_, live_mm_;  // per measured step: ideal max/mean rank load
  std::vector<Switch> switches_;
  std::map<std::string, Totals> totals_;
  StepSeries series_;
  Kokkos::Timer timer_;
};

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
    app.add_option("--record-routes", opt.record_routes, "write every step's routes as a trace (overrides [run] record_routes)");
    app.add_option("--algorithm", opt.algorithm, "exchange algorithm (overrides [exchange] algorithm)")
        ->check(CLI::IsMember(enum_names<Exchange::Algorithm>()));
    std::string transport, experts_kernel, experts_gemm;
    app.add_option("--transport", transport, "how rows move (overrides [exchange] transport)")
        ->check(CLI::IsMember(enum_names<Exchange::TransportKind>()));
    app.add_option("--experts-kernel", experts_kernel, "grouped and block runners' kernel (overrides [experts] kernel)")
        ->check(CLI::IsMember(enum_names<Experts::GroupedKernel>()));
    app.add_option("--experts-gemm", experts_gemm, "experts' GEMM path, forward and backward (overrides [experts] gemm)")
        ->check(CLI::IsMember(enum_names<GemmPath>()));
    app.add_option("--rebalance-every", opt.rebalance_every,
                   "rebalance the EPLB placement every N steps, 0 never (overrides [placement] rebalance_every)")
        ->check(CLI::NonNegativeNumber);
    app.add_flag("--print-output", opt.print_output, "print every rank's output rows after the last step");
    app.add_flag("--verbose", opt.verbose, "print Kokkos's configuration and the resolved deck first");
    if (int const rc = kmoe_app::parse(app, argc, argv, rank); rc >= 0) return rc;
    auto deck = read_layer_deck(MPI_COMM_WORLD, opt.deck);
    if (!transport.empty()) {
      deck.exchange.transport = from_string<Exchange::TransportKind>(transport);
      KOKKOSMOE_REQUIRE(Exchange::transport_available(deck.exchange.transport),
                        "--transport " << transport << ": " << Exchange::transport_unavailable_reason(deck.exchange.transport));
    }
    if (!experts_kernel.empty()) deck.experts.kernel = from_string<Experts::GroupedKernel>(experts_kernel);
    if (!experts_gemm.empty()) deck.experts.gemm = from_string<GemmPath>(experts_gemm);
    if (rank == 0) {
      std::cout << build_summary() << "\n";
      if (opt.verbose) {
        print_kokkos_configuration(std::cout);
        std::cout << deck.resolved() << std::flush;
      } else {
        std::cout << "deck: " << deck.path << " (resolved in the report; --verbose prints it)\n" << std::flush;
      }
    }
    KOKKOSMOE_REQUIRE(deck.run.mode != "train" || opt.rebalance_every <= 0,
                      "--rebalance-every is not read with run.mode = \"train\" (" << deck.path << ")");
    if (deck.run.mode == "train") return kmoe_layer::train(deck, {opt.steps, opt.report, opt.hdf5});
    if (deck.run.mode == "serve") {
      KOKKOSMOE_REQUIRE(opt.steps < 0 && opt.warmup < 0 && opt.rebalance_every < 0 && opt.hdf5.empty() && opt.record_routes.empty(),
                        "--steps, --warmup, --rebalance-every, --hdf5 and --record-routes are not read with run.mode = \"serve\" ("
                            << deck.path << "; the steps are [[serve.step]])");
      return kmoe_layer::serve(deck, opt.report.empty() ? deck.run.report : opt.report);
    }
    if (deck.model.dtype == "bf16") return LayerRun<bf16_t>(deck, opt).run();
    return LayerRun<float>(deck, opt).run();
  });
}
