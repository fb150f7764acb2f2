// kmoe-layer, [run] mode = "serve": every [[serve.step]] (decode rows per
// rank, and prefill rows before them for a mixed batch) runs on one decode
// bucket of serve.rank_tokens tokens per rank and serve.slot_routes routes
// per physical slot, repeated serve.repeat times. A step with prefill rows
// is split by phase (the prefill unit runs the ordinary path); a decode
// step that does not fit is refused and runs the ordinary path. With
// serve.check, every step also runs the ordinary path on the same rows and
// must give the same bits. Rows are drawn like the forward run's (seed, step,
// global token index: rank r's rows of a step follow those of ranks < r).
// Prints one line per distinct step of the sequence and a SERVE summary:
//
//   SERVE steps=... admitted=... refused=... useful_tokens=... executed_tokens=... tokens_per_s=... identical=yes

#include "kmoe_layer_serve.hpp"

#include "kmoe_app.hpp"
#include "kmoe_layer_output.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_HostHeap.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Serve.hpp>
#include <KokkosMoE_Version.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <map>

namespace kmoe_layer {
namespace {

using namespace KokkosMoE;

json counts_json(UnitCounts const& c) {
  return {{"useful_tokens", c.useful_tokens}, {"executed_tokens", c.executed_tokens}, {"padding_tokens", c.padding_tokens},
          {"routes", c.routes},               {"useful_rows", c.useful_rows},         {"executed_rows", c.executed_rows}};
}

json unit_json(ServeRecord const& u) {
  return {{"phase", to_string(u.phase)},
          {"replayed", u.replayed},
          {"refusal", to_string(u.refusal)},
          {"why", u.why},
          {"capture", u.capture},
          {"rank_tokens", u.rank_tokens},
          {"rank_offsets", u.rank_offsets},
          {"counts", counts_json(u.counts)}};
}

std::string list(std::vector<index_t> const& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

template <class T>
int serve_run(LayerDeck const& deck, std::string const& report_path) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  double const watchdog = deck.exchange.watchdog_seconds;
  std::string const heap = stable_host_heap();  // a long serving run keeps its resident set
  Exec exec;
  auto setup = Setup::make_run(deck, world);
  MoELayer<T, Exec, MS> layer(setup.config, *setup.comms, setup.placement, Setup::router_weight<T, MS>(deck),
                              Setup::routed_weights<T, MS>(exec, deck, setup, rank, world), Setup::shared_weights<T, MS>(exec, deck));
  Setup::load_correction_bias(exec, deck, layer.router());
  layer.set_checkpoint(deck.model.checkpoint.empty() ? "seed:" + std::to_string(deck.run.seed) : deck.model.checkpoint);
  auto const& sv = deck.serve;
  DecodeBucket<T, Exec, MS> bucket(layer, BucketConfig{sv.rank_tokens, sv.slot_routes});
  int const d = deck.model.hidden;
  MPI_Comm const ep = setup.comms->ep().comm();  // the layer's ranks: a missing one is named there

  // One input and two output matrices, as large as the largest step.
  index_t max_rows = 0;
  for (auto const& st : sv.steps) max_rows = std::max(max_rows, st.decode[static_cast<std::size_t>(rank)] + st.prefill[static_cast<std::size_t>(rank)]);
  RowMatrix<T, MS> hidden_all("kmoe-layer::serve_hidden", std::max<index_t>(max_rows, 1), d);
  RowMatrix<T, MS> out_all("kmoe-layer::serve_out", std::max<index_t>(max_rows, 1), d);
  RowMatrix<T, MS> ref_all("kmoe-layer::serve_reference", sv.check ? std::max<index_t>(max_rows, 1) : 1, d);
  auto rows = [](RowMatrix<T, MS> const& m, index_t n) { return RowMatrix<T, MS>(Kokkos::subview(m, std::make_pair(index_t(0), n), Kokkos::ALL)); };

  if (rank == 0) {
    std::printf("serve: %d rank(s), bucket of %lld tokens per rank and %lld routes per slot, %zu step(s) x %d, reserved %lld bytes per rank, "
                "host heap %s\n",
                size, static_cast<long long>(sv.rank_tokens), static_cast<long long>(sv.slot_routes), sv.steps.size(), sv.repeat,
                static_cast<long long>(bucket.reserved_bytes()), heap.c_str());
    std::fflush(stdout);
  }
  json steps = json::array();
  UnitCounts total;
  std::map<std::string, int> refused_by;
  int admitted = 0, refused = 0, all_identical = 1, step_id = 0;
  double seconds = 0;
  for (int rep = 0; rep < sv.repeat; ++rep)
    for (std::size_t i = 0; i < sv.steps.size(); ++i, ++step_id) {
      kmoe_app::fault_point(rank, step_id);
      auto const& st = sv.steps[i];
      index_t first = 0, any_prefill = 0;
      for (int p = 0; p < size; ++p) {
        if (p < rank) first += st.decode[static_cast<std::size_t>(p)] + st.prefill[static_cast<std::size_t>(p)];
        any_prefill += st.prefill[static_cast<std::size_t>(p)];
      }
      index_t const pre = st.prefill[static_cast<std::size_t>(rank)], n = pre + st.decode[static_cast<std::size_t>(rank)];
      auto const x = rows(hidden_all, n), y = rows(out_all, n);
      Setup::hidden_rows_into(deck, step_id, first, x, rank);
      // Ranks start the step together (a watched reduction, so that a
      // missing rank ends the run within the watchdog).
      double const start_flag = 0.0;
      double started = 0.0;
      allreduce_watched(&start_flag, &started, 1, MPI_DOUBLE, MPI_MAX, ep, "serve: step start", watchdog);
      Kokkos::Timer timer;
      MixedRecord m;
      if (any_prefill > 0) {
        std::vector<Phase> phase(static_cast<std::size_t>(n), Phase::decode);
        std::fill(phase.begin(), phase.begin() + pre, Phase::prefill);
        m = bucket.serve(exec, layer, x, y, phase);
      } else {
        m.units.push_back(bucket.step(exec, layer, x, y, Phase::decode));
        m.total = m.units.back().counts;
      }
      Kokkos::fence();
      double const my_s = timer.seconds();
      double step_s = 0.0;
      allreduce_watched(&my_s, &step_s, 1, MPI_DOUBLE, MPI_MAX, ep, "serve: step time", watchdog);
      seconds += step_s;
      bool identical = true;
      if (sv.check) {
        auto const r = rows(ref_all, n);
        layer.forward(exec, x, r);
        auto const hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
        auto const hr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r);
        identical = ranks_digest(world, hy.data(), hy.size() * sizeof(T), watchdog) ==
                    ranks_digest(world, hr.data(), hr.size() * sizeof(T), watchdog);
        all_identical &= identical ? 1 : 0;
      }
      auto const& unit = m.units.back();  // the decode unit
      if (unit.replayed)
        ++admitted;
      else
        ++refused, ++refused_by[to_string(unit.refusal)];
      total += m.total;
      json units = json::array();
      for (auto const& u : m.units) units.push_back(unit_json(u));
      auto const y_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
      steps.push_back({{"step", step_id},
                       {"decode", st.decode},
                       {"prefill", st.prefill},
                       {"seconds", step_s},
                       {"units", units},
                       {"total", counts_json(m.total)},
                       {"output_digest", ranks_digest(world, y_host.data(), y_host.size() * sizeof(T), watchdog)},
                       {"identical", sv.check ? json(identical) : json(nullptr)}});
      if (rank == 0 && rep == 0) {
        std::printf("serve: step %d decode %s prefill %s: %s%s, %lld useful / %lld executed token slots, %lld routes, %.3g s%s\n", step_id,
                    list(st.decode).c_str(), list(st.prefill).c_str(), unit.replayed ? "replayed" : "refused ",
                    unit.replayed ? "" : (to_string(unit.refusal) + " (" + unit.why + ")").c_str(),
                    static_cast<long long>(m.total.useful_tokens), static_cast<long long>(m.total.executed_tokens),
                    static_cast<long long>(m.total.routes), step_s, sv.check ? (identical ? ", same bits" : ", DIFFERS") : "");
        std::fflush(stdout);
      }
    }
  json ledger = json::array();
  for (auto const& b : bucket.ledger()) ledger.push_back({{"name", b.name}, {"bytes", b.bytes}});
  json held = json::array();  // the layer's reused buffers, after the whole sequence
  for (auto const& b : bucket.step_ledger(layer)) held.push_back({{"name", b.name}, {"bytes", b.bytes}});
  double const tokens_per_s = seconds > 0 ? static_cast<double>(total.useful_tokens) / seconds : 0.0;
  json report;
  report["build"] = build_summary();
  report["deck"] = deck.path;
  report["resolved_deck"] = deck.resolved();
  report["mode"] = "serve";
  report["ranks"] = size;
  report["serve"] = {{"rank_tokens", sv.rank_tokens},
                     {"slot_routes", sv.slot_routes},
                     {"host_heap", heap},
                     {"graph_key", bucket.key().digest()},
                     {"reserved", ledger},
                     {"reserved_bytes", bucket.reserved_bytes()},
                     {"step_ledger", held},
                     {"steps", steps},
                     {"admitted", admitted},
                     {"refused", refused},
                     {"refused_by", refused_by},
                     {"total", counts_json(total)},
                     {"seconds", seconds},
                     {"tokens_per_s", tokens_per_s},
                     {"identical", sv.check ? json(all_identical == 1) : json(nullptr)}};
  write_outputs(world, watchdog, deck.path, report, report_path);
  if (rank == 0) {
    std::string by;
    for (auto const& [k, v] : refused_by) by += (by.empty() ? "" : ",") + k + ":" + std::to_string(v);
    std::printf("SERVE steps=%d ranks=%d admitted=%d refused=%d refused_by=%s useful_tokens=%lld executed_tokens=%lld padding_tokens=%lld "
                "tokens_per_s=%.4g identical=%s\n",
                step_id, size, admitted, refused, by.empty() ? "none" : by.c_str(), static_cast<long long>(total.useful_tokens),
                static_cast<long long>(total.executed_tokens), static_cast<long long>(total.padding_tokens), tokens_per_s,
                sv.check ? (all_identical ? "yes" : "no") : "unchecked");
    std::fflush(stdout);
  }
  return all_identical ? 0 : 1;
}

}  // namespace

int serve(LayerDeck const& deck, std::string const& report_path) {
  if (deck.model.dtype == "bf16") return serve_run<bf16_t>(deck, report_path);
  return serve_run<float>(deck, report_path);
}

}  // namespace kmoe_layer
