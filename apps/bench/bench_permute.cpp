// kmoe-bench permute: pack (gather hidden rows into send order) and combine
// (gate-weighted k-slot reduction of returned rows) effective bandwidth,
// bytes read + bytes written per second, next to a memcpy moving the same
// number of bytes in the same run.

#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>

#include <CLI/CLI.hpp>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

int run(int argc, char** argv) {
  CLI::App app{"pack and combine bandwidth next to memcpy"};
  int tokens = 8192, top_k = 8, width = 4096, experts = 64, peers = 8, reps = 5;
  std::string dtype = "bf16";
  app.add_option("--tokens", tokens, "tokens on this rank")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", top_k, "routes per token")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "hidden width d")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts, "logical experts")->check(CLI::PositiveNumber);
  app.add_option("--peers", peers, "destination peers (experts spread round-robin)")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype, "payload and hidden type: bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return app.exit(e);
  }
  KOKKOSMOE_REQUIRE(top_k <= experts, "--top-k " << top_k << " exceeds --experts " << experts);
  Exec exec;
  // Uniform routing: k distinct experts per token from a seeded generator.
  RouteTable<MS> table("bench::table", tokens, top_k, experts);
  kmoe_bench::fill_uniform_routes(table, 42u);
  Placement placement = Placement::round_robin(experts, peers);
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, 0, -1);
  std::vector<int> order(static_cast<std::size_t>(peers));
  std::iota(order.begin(), order.end(), 0);
  auto routes = make_route_plan(exec, table, dp, choice, 0);
  auto plan = make_dispatch_plan(exec, routes, placement, order);
  index_t const A = plan.rows();
  PayloadType const type = dtype == "bf16" ? PayloadType::bf16 : PayloadType::fp32;
  std::int64_t const row_bytes = payload_row_bytes(type, width);
  PayloadBuffer<MS> send(exec, "bench::send", type, width, A);
  Kokkos::View<RowMeta*, MS> meta("bench::meta", A);

  double pack_s = 0, combine_s = 0;
  std::int64_t pack_bytes = 0, combine_bytes = 0;
  auto measure = [&](auto one) {
    using T = decltype(one);
    RowMatrix<T, MS> hidden("bench::hidden", tokens, width), out("bench::out", tokens, width);
    Kokkos::deep_copy(hidden, one);
    pack_s = kmoe_bench::median_seconds(1, reps, [&] {
      pack(exec, routes, plan, hidden, send, meta);
      exec.fence();
    });
    combine_s = kmoe_bench::median_seconds(1, reps, [&] {
      combine(exec, routes, plan, send, out);
      exec.fence();
    });
    pack_bytes = 2 * A * row_bytes + A * static_cast<std::int64_t>(sizeof(RowMeta));
    combine_bytes = A * row_bytes + static_cast<std::int64_t>(tokens) * width * static_cast<std::int64_t>(sizeof(T));
  };
  if (type == PayloadType::bf16) measure(bf16_t{0x3F80});
  else measure(1.0f);

  // memcpy moving the same bytes (half read, half written) in the same run.
  auto memcpy_gbps = [&](std::int64_t traffic) {
    std::size_t const n = static_cast<std::size_t>(traffic / 2);
    Kokkos::View<unsigned char*, MS> a(Kokkos::view_alloc(Kokkos::WithoutInitializing, "bench::memcpy_a"), n);
    Kokkos::View<unsigned char*, MS> b(Kokkos::view_alloc(Kokkos::WithoutInitializing, "bench::memcpy_b"), n);
    Kokkos::deep_copy(a, 1);
    Kokkos::deep_copy(b, 0);
    double const s = kmoe_bench::median_seconds(1, reps, [&] {
      Kokkos::deep_copy(exec, b, a);
      exec.fence();
    });
    return 2.0 * static_cast<double>(n) / s / 1e9;
  };
  double const pack_gbps = static_cast<double>(pack_bytes) / pack_s / 1e9;
  double const combine_gbps = static_cast<double>(combine_bytes) / combine_s / 1e9;
  double const m1 = memcpy_gbps(pack_bytes);
  double const m2 = memcpy_gbps(combine_bytes);
  std::string const shape = "T" + std::to_string(tokens) + "_k" + std::to_string(top_k) + "_d" + std::to_string(width) +
                            "_E" + std::to_string(experts) + "_P" + std::to_string(peers);
  kmoe_bench::print_bench("permute_pack",
                          {{"gbps", kmoe_bench::fmt(pack_gbps)}, {"memcpy_gbps", kmoe_bench::fmt(m1)},
                           {"s", kmoe_bench::fmt(pack_s)}, {"bytes", std::to_string(pack_bytes)}, {"dtype", dtype},
                           {"shape", shape}, {"threads", std::to_string(kmoe_bench::host_threads())}},
                          pack_gbps / m1);
  kmoe_bench::print_bench("permute_combine",
                          {{"gbps", kmoe_bench::fmt(combine_gbps)}, {"memcpy_gbps", kmoe_bench::fmt(m2)},
                           {"s", kmoe_bench::fmt(combine_s)}, {"bytes", std::to_string(combine_bytes)}, {"dtype", dtype},
                           {"shape", shape}, {"threads", std::to_string(kmoe_bench::host_threads())}},
                          combine_gbps / m2);
  return 0;
}

kmoe_bench::Register reg("permute", "pack and combine bandwidth vs memcpy (T=8192, k=8, d=4096, bf16, E=64, 8 peers)", run);

}  // namespace
