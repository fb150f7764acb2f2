// Routing traces: written and read back in both layouts (NumPy directory,
// HDF5 file) with the same routes; int64/float64 NumPy arrays read too; a
// step's routes become a route table (dropped routes not accepted, expert
// counts from the accepted ones); router logits round trip with or without
// routes, a step's logits routed by a router give the routes it gave when
// they were recorded; files and traces that do not fit are refused naming
// the file, the array or the deck key, on every rank.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_RouteTrace.hpp>
#include <KokkosMoE_Router.hpp>

#include <cstring>
#include <fstream>
#include <limits>
#include <string>

using namespace KokkosMoE;
using MS = Kokkos::DefaultExecutionSpace::memory_space;

namespace {

RouteTrace sample_trace() {
  RouteTrace t;
  t.steps = 3;
  t.ranks = 2;
  t.tokens = 5;
  t.top_k = 2;
  for (int s = 0; s < t.steps; ++s)
    for (int r = 0; r < t.ranks; ++r)
      for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 2; ++j) {
          int const e = (s * 7 + r * 3 + i * 2 + j) % 6;
          t.experts.push_back(i == 4 && j == 1 ? -1 : e);  // one dropped route per rank and step
          t.gates.push_back(0.25f * static_cast<float>(j + 1) + 0.01f * static_cast<float>(i));
        }
  return t;
}

/// sample_trace() with logits of 6 experts per token (and, `routes` false,
/// without its routes).
RouteTrace sample_logit_trace(bool routes) {
  RouteTrace t = sample_trace();
  t.num_experts = 6;
  for (std::size_t i = 0; i < static_cast<std::size_t>(t.steps * t.ranks * t.tokens * 6); ++i)
    t.logits.push_back(0.125f * static_cast<float>((i * 37) % 23) - 1.0f);
  if (!routes) {
    t.top_k = 0;
    t.experts.clear();
    t.gates.clear();
  }
  return t;
}

/// A directory path unique to this test run, shared by the ranks.
std::string scratch(std::string const& name) {
  std::string dir = std::string("route_trace_test_") + name;
  int size = comm_size(MPI_COMM_WORLD);
  return dir + "_np" + std::to_string(size);
}

/// A .npy file of int64 or float64 values, written by hand.
void write_npy64(std::string const& file, char const* descr, std::vector<std::size_t> const& shape, void const* data, std::size_t n) {
  std::string h = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (auto x : shape) h += std::to_string(x) + ", ";
  h += "), }";
  h.append((64 - (10 + h.size() + 1) % 64) % 64, ' ');
  h.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(h.size() & 0xff));
  out.push_back(static_cast<char>(h.size() >> 8));
  out += h;
  out.append(static_cast<char const*>(data), n * 8);
  write_text_file(file, out);
}

}  // namespace

TEST_CASE("route traces: both layouts round trip, every rank reads the same", "[trace][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  auto const t = sample_trace();
  for (std::string path : {scratch("npy"), scratch("h5") + ".h5"}) {
    INFO(path);
    collective(world, "write", [&] {
      if (comm_rank(world) == 0) write_route_trace(path, t, 6);
    });
    auto const back = read_route_trace(world, path);
    CHECK(back.steps == 3);
    CHECK(back.ranks == 2);
    CHECK(back.tokens == 5);
    CHECK(back.top_k == 2);
    CHECK(back.experts == t.experts);
    CHECK(back.gates == t.gates);
    CHECK(back.max_expert() == 5);
    auto const load = back.step_load(1, 6);
    double total = 0;
    for (double x : load) total += x;
    CHECK(total == 2 * (5 * 2 - 1));  // every route of both ranks but the dropped ones
  }
}

TEST_CASE("route traces: logits round trip with and without routes", "[trace][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  for (bool routes : {true, false}) {
    auto const t = sample_logit_trace(routes);
    for (std::string path : {scratch(routes ? "logits_routes" : "logits"), scratch(routes ? "logits_routes" : "logits") + ".h5"}) {
      INFO(path);
      collective(world, "write", [&] {
        if (comm_rank(world) == 0) write_route_trace(path, t, 6);
      });
      auto const back = read_route_trace(world, path);
      CHECK(back.has_routes() == routes);
      CHECK(back.has_logits());
      CHECK(back.steps == 3);
      CHECK(back.ranks == 2);
      CHECK(back.tokens == 5);
      CHECK(back.top_k == (routes ? 2 : 0));
      CHECK(back.num_experts == 6);
      CHECK(back.experts == t.experts);
      CHECK(back.gates == t.gates);
      CHECK(back.logits == t.logits);
      CHECK(trace_replay(back, TraceReplay::automatic, "w") == (routes ? TraceReplay::routes : TraceReplay::logits));
      CHECK(trace_replay(back, TraceReplay::logits, "w") == TraceReplay::logits);
      // Step 4 of a replay reads trace step 1.
      auto const z = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), trace_logits<MS>(back, 4, 1));
      REQUIRE(z.extent(0) == 5);
      REQUIRE(z.extent(1) == 6);
      for (int i = 0; i < 5; ++i)
        for (int e = 0; e < 6; ++e) CHECK(z(i, e) == t.logits[t.logit_offset(1, 1) + static_cast<std::size_t>(i * 6 + e)]);
    }
  }
  // What a replay needs, named.
  auto const logits_only = sample_logit_trace(false);
  CHECK_THROWS_WITH(trace_replay(logits_only, TraceReplay::routes, "d.toml: tokens.trace 'x'"),
                    Catch::Matchers::Contains("d.toml: tokens.trace 'x': replaying routes, but the trace holds logits only"));
  CHECK_THROWS_WITH(trace_replay(sample_trace(), TraceReplay::logits, "w"),
                    Catch::Matchers::Contains("w: replaying logits, but the trace holds no logits"));
  CHECK_THROWS_WITH(check_route_trace(logits_only, "w", 2, 4, 8, 5, TraceReplay::logits),
                    Catch::Matchers::Contains("w: the trace holds logits of 6 experts; the deck has 8 experts"));
  CHECK_NOTHROW(check_route_trace(logits_only, "w", 2, 4, 6, 5, TraceReplay::automatic));  // any top_k: the router picks
  CHECK_THROWS_WITH(trace_routes<MS>(logits_only, 0, 0, 6), Catch::Matchers::Contains("the trace holds logits only"));
}

TEST_CASE("route traces: recorded logits routed again give the recorded routes", "[trace][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  using Exec = Kokkos::DefaultExecutionSpace;
  Exec exec;
  RouterConfig rc;
  rc.num_experts = 8;
  rc.top_k = 3;
  rc.score = ScoreFunction::sigmoid;
  rc.num_groups = 4;
  rc.topk_groups = 2;
  rc.group_score = SetScore::top_m_sum;
  rc.group_top_m = 2;
  rc.admission.policy = AdmissionPolicy::expert_capacity;
  rc.admission.capacity_factor = 1.0;
  Router<MS> router(rc);
  index_t const T = 16;
  Kokkos::View<float**, Kokkos::LayoutRight, MS> hidden("hidden", T, 4), weight("weight", 8, 4);
  auto hh = Kokkos::create_mirror_view(hidden);
  auto hw = Kokkos::create_mirror_view(weight);
  for (index_t t = 0; t < T; ++t)
    for (int c = 0; c < 4; ++c) hh(t, c) = static_cast<float>(((t + 3 * rank) * 7 + c * 5) % 11) * 0.1f - 0.5f;
  for (int e = 0; e < 8; ++e)
    for (int c = 0; c < 4; ++c) hw(e, c) = static_cast<float>((e * 3 + c * 7) % 9) * 0.2f - 0.8f;
  Kokkos::deep_copy(hidden, hh);
  Kokkos::deep_copy(weight, hw);
  RouteTable<MS> recorded;
  router.route(exec, hidden, weight, recorded);
  RouteTrace trace;
  record_routes(world, recorded, trace, 60.0, router.logits());
  std::string const path = scratch("recorded_logits") + ".h5";
  collective(world, "write", [&] {
    if (rank == 0) write_route_trace(path, trace, 8);
  });
  auto const back = read_route_trace(world, path);
  REQUIRE(back.ranks == size);
  REQUIRE(back.num_experts == 8);
  RouteTable<MS> replayed;
  Router<MS> again(rc);
  again.route_logits(exec, trace_logits<MS>(back, 0, rank), replayed);
  auto e0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recorded.expert);
  auto e1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), replayed.expert);
  auto g0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recorded.gate);
  auto g1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), replayed.gate);
  auto a0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recorded.accepted);
  auto a1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), replayed.accepted);
  int dropped = 0;
  for (index_t t = 0; t < T; ++t)
    for (int j = 0; j < 3; ++j) {
      CHECK(e1(t, j) == e0(t, j));
      CHECK(std::memcmp(&g1(t, j), &g0(t, j), sizeof(float)) == 0);
      CHECK(a1(t, j) == a0(t, j));
      dropped += a0(t, j) ? 0 : 1;
    }
  CHECK(replayed.counts.dropped == dropped);
  CHECK(replayed.counts.dropped == recorded.counts.dropped);
}

TEST_CASE("route traces: a step's routes as a route table", "[trace]") {
  auto const t = sample_trace();
  auto const table = trace_routes<MS>(t, 4, 1, 6);  // step 4 replays trace step 1
  auto e = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.expert);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.gate);
  auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.accepted);
  auto c = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.expert_counts);
  std::size_t const at = t.offset(1, 1);
  index_t counted = 0;
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 2; ++j) {
      int const x = t.experts[at + static_cast<std::size_t>(i * 2 + j)];
      CHECK(static_cast<int>(a(i, j)) == (x >= 0 ? 1 : 0));
      if (x >= 0) CHECK(e(i, j) == x);
      CHECK(g(i, j) == t.gates[at + static_cast<std::size_t>(i * 2 + j)]);
    }
  for (int x = 0; x < 6; ++x) counted += c(x);
  CHECK(counted == 9);
  CHECK(table.counts.attempted == 10);
  CHECK(table.counts.accepted == 9);
  CHECK(table.counts.dropped == 1);
}

TEST_CASE("route traces: int64 and float64 NumPy arrays are read", "[trace][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  std::string const dir = scratch("npy64");
  std::vector<std::int64_t> ex = {0, 3, 2, -1};
  std::vector<double> ga = {0.5, 0.5, 1.0, 0.0};
  collective(world, "write", [&] {
    if (comm_rank(world) != 0) return;
    write_npy64(dir + "/experts.npy", "<i8", {1, 1, 2, 2}, ex.data(), ex.size());
    write_npy64(dir + "/gates.npy", "<f8", {1, 1, 2, 2}, ga.data(), ga.size());
  });
  auto const t = read_route_trace(world, dir);
  CHECK(t.experts == std::vector<std::int32_t>{0, 3, 2, -1});
  CHECK(t.gates == std::vector<float>{0.5f, 0.5f, 1.0f, 0.0f});
}

TEST_CASE("route traces: bad files and traces that do not fit are refused", "[trace][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  std::string const dir = scratch("bad");
  auto const t = sample_trace();
  auto refused = [&](std::string const& path, std::string const& message) {
    INFO(path);
    CHECK_THROWS_WITH(read_route_trace(world, path), Catch::Matchers::Contains(message));
  };
  refused(dir + "/absent", "absent/experts.npy: cannot open");
  refused(dir + "/absent.h5", "absent.h5: cannot open as HDF5");
  collective(world, "write", [&] {
    if (comm_rank(world) != 0) return;
    write_text_file(dir + "/text/experts.npy", "not numpy");
    write_route_trace(dir + "/shapes", t, 6);
    RouteTrace other = t;
    other.tokens = 1;
    other.steps = 15;  // same element count, other shape
    write_route_trace(dir + "/other", other, 6);
    std::ifstream in(dir + "/other/gates.npy", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    write_text_file(dir + "/shapes/gates.npy", bytes);
    std::vector<double> wrong = {1, 2};
    write_npy64(dir + "/float_ids/experts.npy", "<f8", {1, 1, 1, 2}, wrong.data(), wrong.size());
  });
  refused(dir + "/text", "text/experts.npy: not a NumPy .npy file");
  refused(dir + "/shapes", "gates and experts have different shapes");
  refused(dir + "/float_ids", "float_ids/experts.npy: dtype '<f8' (expected one of <i4, <i8)");
  CHECK_THROWS_WITH(check_route_trace(t, "d.toml: tokens.trace 'x'", 4, 2, 6, 5),
                    Catch::Matchers::Contains("d.toml: tokens.trace 'x': the trace holds 2 ranks' routes; this run has 4 ranks"));
  CHECK_THROWS_WITH(check_route_trace(t, "w", 2, 3, 6, 5), Catch::Matchers::Contains("the trace has top_k 2; the deck's model.top_k is 3"));
  CHECK_THROWS_WITH(check_route_trace(t, "w", 2, 2, 4, 5), Catch::Matchers::Contains("routes to expert 5; the deck has 4 experts"));
  CHECK_THROWS_WITH(check_route_trace(t, "w", 2, 2, 6, 8), Catch::Matchers::Contains("5 tokens per rank; the deck's tokens.per_rank is 8"));
  CHECK_NOTHROW(check_route_trace(t, "w", 2, 2, 6, 5));
  // Logits that disagree with the routes, or are not finite.
  collective(world, "write", [&] {
    if (comm_rank(world) != 0) return;
    auto z = sample_logit_trace(true);
    write_route_trace(dir + "/logit_steps", z, 6);
    RouteTrace fewer = z;
    fewer.steps = 1;
    fewer.experts.resize(fewer.offset(1, 0));
    fewer.gates.resize(fewer.offset(1, 0));
    fewer.logits.resize(fewer.logit_offset(1, 0));
    write_route_trace(dir + "/logit_steps_one", fewer, 6);
    std::ifstream in(dir + "/logit_steps_one/logits.npy", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    write_text_file(dir + "/logit_steps/logits.npy", bytes);
    z.logits[7] = std::numeric_limits<float>::infinity();
    write_route_trace(dir + "/logit_inf", z, 6);
    write_text_file(dir + "/gates_only/gates.npy", bytes);
    write_text_file(dir + "/gates_only/logits.npy", bytes);
  });
  refused(dir + "/logit_steps", "logit_steps: logits are for 1 steps x 2 ranks x 5 tokens, the routes for 3 x 2 x 5");
  refused(dir + "/logit_inf", "logit_inf: logits element 7 = inf is not finite");
  refused(dir + "/gates_only", "gates_only: gates without experts");
}
