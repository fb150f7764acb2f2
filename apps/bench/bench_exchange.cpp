// kmoe-bench exchange: one step of every exchange algorithm through the
// exchange contract (dispatch from the hidden rows, pack and repack
// included, identity experts, combine into the return buffer) next to a raw
// MPI_Alltoallv moving the same bytes in the same run (per-peer byte counts
// identical to the flat exchange: rows plus metadata out, rows back), from
// buffers in the exchange's memory space (device memory without a CUDA-aware
// MPI goes through host copies, as the exchange's does). Times are the
// slowest rank's, medians of reps that alternate each algorithm with the
// baseline. The hierarchical exchange runs with one relay per node (the
// default layout) and, where nodes have more than one rank, as rails: every
// rank the relay of its own rail (relays_per_node = ranks per node, DeepEP's
// layout), case exchange_hierarchical_rails_np<N>.
//
// --hosts: the ranks' nodes are the real hosts (hwloc layout: host names and
// MPI's shared-memory split, e.g. across scripts/netns-cluster), every
// algorithm is timed alternately with the flat exchange and its ratio is its
// time over flat's in the same run (flat's own line keeps the MPI_Alltoallv
// baseline). --cost-model FILE (kmoe-bench calibrate on the same hosts)
// prints the model's prediction of each algorithm's time beside the measured
// one (model_s, and model_err = measured / predicted - 1), from the
// planner's ledgers of every rank's routes.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Exchange.hpp>
#include <KokkosMoE_Exchange_CostModel.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_PlacementIO.hpp>

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <numeric>
#include <random>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

double slowest(double s) {
  double m = 0;
  MPI_Allreduce(&s, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

/// One fenced call of f, timed as the slowest rank sees it.
template <class F>
double once(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  Kokkos::Timer t;
  f();
  return slowest(t.seconds());
}

/// Medians of ours and of the baseline, alternated rep by rep after one
/// warmup each, so that drift in the machine's load hits both alike.
template <class F, class G>
std::pair<double, double> timed_pair(int reps, F&& ours, G&& baseline) {
  once(ours);
  once(baseline);
  std::vector<double> a, b;
  for (int r = 0; r < reps; ++r) {
    a.push_back(once(ours));
    b.push_back(once(baseline));
  }
  return {kmoe_bench::median(a), kmoe_bench::median(b)};
}

int run(int argc, char** argv) {
  CLI::App app{"exchange algorithms next to MPI_Alltoallv"};
  int tokens = 4096, top_k = 8, width = 2048, experts = 64, reps = 7, waves = 4;
  double sender_cf = 1.25, receiver_cf = 1.5;
  std::string transport = "mpi";
  std::vector<std::string> algorithms{"flat", "hierarchical", "hierarchical_dedup", "pooled_wave"};
  bool hosts = false, into_experts = true;
  std::string cost_model;
  app.add_option("--tokens", tokens, "tokens per rank")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", top_k, "routes per token")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "hidden width d")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts, "logical experts (round-robin over ranks)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--waves", waves, "pooled-wave waves")->check(CLI::PositiveNumber);
  app.add_option("--sender-cf", sender_cf, "pooled-wave sender capacity factor");
  app.add_option("--receiver-cf", receiver_cf, "pooled-wave receiver capacity factor");
  app.add_option("--transport", transport, "how rows move: mpi, or nccl (CUDA builds with NCCL)")
      ->check(CLI::IsMember({"mpi", "nccl"}));
  app.add_option("--algorithms", algorithms, "exchange algorithms to time (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember(enum_names<Exchange::Algorithm>()));
  app.add_flag("--hosts", hosts, "nodes are the real hosts (hwloc layout); ratios are times over the flat exchange's in the same run");
  app.add_option("--receive-into-experts", into_experts, "rows straight to and from their expert-major places ([exchange] receive_into_experts)");
  app.add_option("--cost-model", cost_model, "cost model file (kmoe-bench calibrate): its predicted time beside each measured one");
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  int const size = comm_size(MPI_COMM_WORLD);
  int const rank = comm_rank(MPI_COMM_WORLD);
  KOKKOSMOE_REQUIRE(top_k <= experts, "--top-k " << top_k << " exceeds --experts " << experts);
  Exec exec;
  // Two virtual nodes when the rank count allows (so relays do something),
  // or the real hosts.
  Topology::LayoutSpec layout;
  if (hosts) {
    layout.kind = Topology::LayoutKind::hwloc;
  } else {
    layout.kind = Topology::LayoutKind::virtual_nodes;
    layout.ranks_per_node = size % 2 == 0 ? size / 2 : size;
  }
  std::optional<Exchange::CostModel> model;
  if (!cost_model.empty()) {
    auto const text = read_text_file(MPI_COMM_WORLD, cost_model, "cost model");
    collective(MPI_COMM_WORLD, "cost model", [&] { model = Exchange::CostModel::from_json(text, cost_model); });
  }
  auto topo = Topology::Topology::discover(MPI_COMM_WORLD, layout);
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  // Rails: one relay per rank of the smallest node (same EP peer order).
  int const rails = topo.min_ranks_per_node();
  std::unique_ptr<Topology::CommunicatorSet> rail_comms;
  if (rails > 1) {
    Topology::CommSpec spec;
    spec.relays_per_node = rails;
    rail_comms = std::make_unique<Topology::CommunicatorSet>(MPI_COMM_WORLD, topo, spec);
  }
  std::vector<int> node_of(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) node_of[r] = topo.node_of(r);
  Placement placement = Placement::round_robin(experts, size, node_of);

  RouteTable<MS> table("bench::table", tokens, top_k, experts);
  kmoe_bench::fill_uniform_routes(table, 7u + static_cast<unsigned>(rank));
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, rank, node_of[rank]);
  auto routes = make_route_plan(exec, table, dp, choice, rank);
  auto plan = make_dispatch_plan(exec, routes, placement, comms.ep().peer_order());
  RowMatrix<bf16_t, MS> hidden("bench::hidden", tokens, width);
  Kokkos::deep_copy(hidden, bf16_t{0x3F80});
  exec.fence();
  std::int64_t const rb = payload_row_bytes(PayloadType::bf16, width);

  // Raw MPI_Alltoallv with the flat exchange's per-peer bytes.
  std::vector<std::int64_t> recv_rows(static_cast<std::size_t>(size));
  MPI_Alltoall(plan.counts.data(), 1, MPI_INT64_T, recv_rows.data(), 1, MPI_INT64_T, comms.ep().comm());
  auto bytes_for = [&](std::vector<std::int64_t> const& rows, std::int64_t per_row, std::vector<int>& counts, std::vector<int>& displs) {
    counts.resize(rows.size());
    displs.resize(rows.size());
    std::int64_t at = 0;
    for (std::size_t p = 0; p < rows.size(); ++p) {
      counts[p] = static_cast<int>(rows[p] * per_row);
      displs[p] = static_cast<int>(at);
      at += rows[p] * per_row;
    }
    return at;
  };
  std::vector<int> sc_d, sd_d, rc_d, rd_d, sc_c, sd_c, rc_c, rd_c;
  auto const out_d = bytes_for(plan.counts, rb + static_cast<std::int64_t>(sizeof(RowMeta)), sc_d, sd_d);
  auto const in_d = bytes_for(recv_rows, rb + static_cast<std::int64_t>(sizeof(RowMeta)), rc_d, rd_d);
  bytes_for(recv_rows, rb, sc_c, sd_c);
  bytes_for(plan.counts, rb, rc_c, rd_c);
  using bytes_view = Kokkos::View<unsigned char*, MS>;
  bytes_view a_out("bench::alltoallv_out", static_cast<std::size_t>(out_d)), a_in("bench::alltoallv_in", static_cast<std::size_t>(in_d));
  Kokkos::deep_copy(a_out, static_cast<unsigned char>(1));
  bool const direct = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible || Exchange::mpi_is_cuda_aware();
  typename bytes_view::HostMirror h_out, h_in;  // host copies when MPI cannot read MS
  if (!direct) {
    h_out = Kokkos::create_mirror(a_out);
    h_in = Kokkos::create_mirror(a_in);
  }
  // Raw MPI_Alltoallv moving the same bytes: rows + metadata out, rows back.
  auto alltoallv = [&] {
    MPI_Comm const ep = comms.ep().comm();
    if (direct) {
      MPI_Alltoallv(a_out.data(), sc_d.data(), sd_d.data(), MPI_BYTE, a_in.data(), rc_d.data(), rd_d.data(), MPI_BYTE, ep);
      MPI_Alltoallv(a_in.data(), sc_c.data(), sd_c.data(), MPI_BYTE, a_out.data(), rc_c.data(), rd_c.data(), MPI_BYTE, ep);
      return;
    }
    Kokkos::deep_copy(h_out, a_out);
    MPI_Alltoallv(h_out.data(), sc_d.data(), sd_d.data(), MPI_BYTE, h_in.data(), rc_d.data(), rd_d.data(), MPI_BYTE, ep);
    Kokkos::deep_copy(a_in, h_in);
    Kokkos::deep_copy(h_in, a_in);
    MPI_Alltoallv(h_in.data(), sc_c.data(), sd_c.data(), MPI_BYTE, h_out.data(), rc_c.data(), rd_c.data(), MPI_BYTE, ep);
    Kokkos::deep_copy(a_out, h_out);
  };

  std::string const shape = "T" + std::to_string(tokens) + "_k" + std::to_string(top_k) + "_d" + std::to_string(width) + "_E" +
                            std::to_string(experts);
  // The planner's ledgers of every rank's routes: what the cost model prices.
  auto const all_routes = model ? Exchange::allgather_routes(MPI_COMM_WORLD, routes) : Exchange::RankRoutePlans{};
  auto report = [&](std::string const& algo, int relays, std::pair<double, double> times, char const* baseline,
                    Exchange::ByteLedger const& ledger, double predicted) {
    double const s = times.first, base_s = times.second;
    auto const total = ledger.reduced(MPI_COMM_WORLD);
    std::vector<std::pair<std::string, std::string>> fields{
        {"s", kmoe_bench::fmt(s)}, {std::string(baseline) + "_s", kmoe_bench::fmt(base_s)}, {"baseline", baseline},
        {"dtype", "bf16"}, {"transport", transport}, {"memory", MS::name()}, {"baseline_mpi", direct ? "direct" : "host_staged"},
        {"shape", shape}, {"layout", hosts ? "hosts" : "virtual"}, {"nodes", std::to_string(topo.num_nodes())},
        {"relays_per_node", relays > 0 ? std::to_string(relays) : "none"},
        {"inter_node_bytes", std::to_string(total.dispatch.inter_node_payload_bytes())},
        {"dedup_saved_bytes", std::to_string(total.dispatch.by_class(Exchange::LinkClass::inter_node).dedup_saved_bytes)},
        {"relay_rows", std::to_string(total.dispatch.relay_rows())},
        {"drops", std::to_string(total.dispatch.sender_drops + total.dispatch.receiver_drops)}};
    if (predicted > 0) {
      fields.push_back({"model_s", kmoe_bench::fmt(predicted)});
      fields.push_back({"model_err", kmoe_bench::fmt(s / predicted - 1.0, 3)});
    }
    kmoe_bench::print_bench(std::string("exchange_") + algo + (transport == "mpi" ? "" : "_" + transport) + (hosts ? "_hosts" : "") +
                                "_np" + std::to_string(size),
                            fields, s / base_s);
  };
  Exchange::ExchangeConfig config;
  config.payload = PayloadType::bf16;
  config.return_payload = PayloadType::bf16;
  config.waves = waves;
  config.sender_cf = sender_cf;
  config.receiver_cf = receiver_cf;
  config.tokens_per_rank = tokens;
  config.transport = from_string<Exchange::TransportKind>(transport);
  config.top_k = top_k;
  config.receive_into_experts = into_experts;
  PayloadBuffer<MS> returned(exec, "bench::returned", PayloadType::bf16, width, plan.rows());
  // One step of an exchange: every wave dispatched and combined (identity experts).
  auto step = [&](Exchange::AnyExchange<bf16_t, Exec, MS>& x, Exchange::ByteLedger& ledger) {
    ledger = Exchange::ByteLedger();
    for (int w = 0; w < x.waves(); ++w) {
      auto h = x.dispatch(exec, routes, plan, hidden, w);
      x.combine(exec, h, h.expert_rows, returned, {});
      ledger.append(h.ledger);
    }
  };
  config.algorithm = Exchange::Algorithm::flat;
  auto flat = Exchange::make_exchange<bf16_t, Exec, MS>(comms, placement, config);
  Exchange::ByteLedger flat_ledger;
  auto time_one = [&](Exchange::Algorithm algorithm, Topology::CommunicatorSet const& over, std::string const& label) {
    config.algorithm = algorithm;
    auto x = Exchange::make_exchange<bf16_t, Exec, MS>(over, placement, config);
    Exchange::ByteLedger ledger;
    bool const against_flat = hosts && algorithm != Exchange::Algorithm::flat;
    auto const times = against_flat ? timed_pair(reps, [&] { step(*x, ledger); }, [&] { step(*flat, flat_ledger); })
                                    : timed_pair(reps, [&] { step(*x, ledger); }, alltoallv);
    double predicted = 0;
    if (model) {
      auto const planned = Exchange::plan_ledgers(Exchange::PlanInput{topo, over.layout(), all_routes, placement, config, width, PayloadType::bf16});
      predicted = Exchange::total_seconds(Exchange::predict(model->for_fabric(Exchange::FabricSpec{}), topo, over.layout(), planned));
    }
    bool const relayed = algorithm == Exchange::Algorithm::hierarchical || algorithm == Exchange::Algorithm::hierarchical_dedup;
    report(label, relayed ? over.layout().relays_per_node : 0, times, against_flat ? "flat" : "alltoallv", ledger, predicted);
  };
  for (auto const& name : algorithms) {
    auto const algorithm = from_string<Exchange::Algorithm>(name);
    time_one(algorithm, comms, to_string(algorithm));
    if (algorithm == Exchange::Algorithm::hierarchical && rail_comms) time_one(algorithm, *rail_comms, "hierarchical_rails");
  }
  return 0;
}

kmoe_bench::Register reg("exchange", "flat / hierarchical / hierarchical_dedup / pooled-wave dispatch+combine vs MPI_Alltoallv (T=4096/rank, k=8, d=2048, bf16); --hosts: vs flat across real hosts",
                         run);

}  // namespace
