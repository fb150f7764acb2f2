// Placement generations (publish with digest verification, DRAINING,
// retirement refused while handles live, rollback, combine-time handle
// checks, handle reference counting) and load estimates with provenance.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_LoadEstimate.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

using namespace KokkosMoE;

namespace {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (Error const& e) {
    return e.what();
  }
  return "";
}

#define CHECK_ERROR(expr, text)                      \
  do {                                               \
    std::string const msg_ = error_of([&] { expr; }); \
    INFO(msg_);                                      \
    CHECK_FALSE(msg_.empty());                       \
    CHECK(msg_.find(text) != std::string::npos);     \
  } while (0)

// A placement of generation g whose every copy of expert e has digest digest_of(e).
std::uint64_t digest_of(int e) {
  std::vector<unsigned char> bytes(64, static_cast<unsigned char>(e * 7 + 1));
  return digest_bytes(bytes.data(), bytes.size());
}

Placement generation(std::uint64_t g, std::vector<double> const& load) {
  PlacementSpec spec = kmoe_test::eplb_spec(8, 2, 2, 4);
  spec.generation = g;
  auto const lp = eplb_layer(load, spec);
  std::vector<std::uint64_t> d;
  for (int e = 0; e < 4; ++e) d.push_back(digest_of(e));
  return lp.placement.with_expert_digests(d, 1);
}

std::vector<std::uint64_t> loaded_digests(Placement const& p) {
  std::vector<std::uint64_t> d;
  for (auto const& s : p.slots()) d.push_back(digest_of(s.expert));
  return d;
}

}  // namespace

TEST_CASE("Registry: publish verifies digests, previous generation drains", "[placement][registry]") {
  PlacementRegistry reg;
  CHECK_FALSE(reg.has_active());
  CHECK_ERROR(reg.acquire(), "no placement generation has been published");
  auto const g1 = generation(1, {4, 2, 1, 1});
  auto bad = loaded_digests(g1);
  bad[3] ^= 1;
  CHECK_ERROR(reg.publish(g1, bad), "cannot publish placement generation 1: 1 of 8 slot digests do not verify: slot 3");
  CHECK_FALSE(reg.has_active());
  CHECK_ERROR(reg.publish(g1, {1, 2}), "2 actual digests for 8 slots");
  reg.publish(g1, loaded_digests(g1));
  CHECK(reg.active_generation() == 1);
  CHECK(reg.state(1) == GenerationState::active);

  auto const g2 = generation(2, {1, 1, 2, 4});
  reg.publish(g2, loaded_digests(g2));
  CHECK(reg.active_generation() == 2);
  CHECK(reg.state(1) == GenerationState::draining);
  CHECK(reg.state(2) == GenerationState::active);
  CHECK(to_string(reg.state(1)) == "DRAINING");
  // Generation ids must increase.
  CHECK_ERROR(reg.publish(generation(2, {1, 1, 1, 1}), loaded_digests(g2)), "generation ids must increase");
  CHECK(reg.generations() == std::vector<std::uint64_t>{1, 2});
}

TEST_CASE("Registry: handles count references; retire refused while they live", "[placement][registry]") {
  PlacementRegistry reg;
  auto const g1 = generation(1, {4, 2, 1, 1});
  reg.publish(g1, loaded_digests(g1));
  {
    auto h = reg.acquire();
    CHECK(h.holds_reference());
    CHECK(h.generation() == 1);
    CHECK(reg.references(1) == 1);
    auto copy = h;  // copy adds a reference
    CHECK(reg.references(1) == 2);
    auto moved = std::move(copy);  // move transfers it
    CHECK(reg.references(1) == 2);
    CHECK_FALSE(copy.holds_reference());
    GenerationHandle assigned;
    assigned = moved;  // copy assignment
    CHECK(reg.references(1) == 3);
    assigned = std::move(moved);  // move assignment releases the old reference
    CHECK(reg.references(1) == 2);
    GenerationHandle& alias = assigned;
    assigned = alias;  // self assignment keeps the count
    CHECK(reg.references(1) == 2);
    CHECK(h.placement().num_slots() == 8);

    auto const g2 = generation(2, {1, 1, 2, 4});
    reg.publish(g2, loaded_digests(g2));
    CHECK(reg.state(1) == GenerationState::draining);
    CHECK_ERROR(reg.retire(1), "cannot retire placement generation 1: 2 live references");
    CHECK_ERROR(reg.retire(2), "cannot retire placement generation 2: it is the ACTIVE generation");
    assigned.release();
    CHECK(reg.references(1) == 1);
    CHECK_ERROR(reg.retire(1), "cannot retire placement generation 1: 1 live reference ");
    // The handle still sees its own placement while generation 2 is active.
    CHECK(h.placement().generation() == 1);
  }
  CHECK(reg.references(1) == 0);
  reg.retire(1);
  CHECK(reg.state(1) == GenerationState::retired);
  CHECK_ERROR(reg.retire(1), "already RETIRED");
  CHECK_ERROR(reg.retire(7), "placement generation 7 is not in the registry");
}

TEST_CASE("Registry: combine rejects handles of other or retired generations", "[placement][registry]") {
  PlacementRegistry reg;
  auto const g1 = generation(1, {4, 2, 1, 1});
  reg.publish(g1, loaded_digests(g1));
  auto h1 = reg.acquire();  // a dispatch pins generation 1
  CHECK_NOTHROW(reg.check_handle(h1, 1));

  auto const g2 = generation(2, {1, 1, 2, 4});
  reg.publish(g2, loaded_digests(g2));
  // Dispatches in flight on generation 1 still combine.
  CHECK_NOTHROW(reg.check_handle(h1, 1));
  auto h2 = reg.acquire();
  CHECK(h2.generation() == 2);
  // A handle of another generation than the dispatch pinned.
  CHECK_ERROR(reg.check_handle(h2, 1), "handle of placement generation 2 (ACTIVE) but the dispatch pinned generation 1");
  CHECK_ERROR(reg.check_handle(h1, 2), "handle of placement generation 1 (DRAINING) but the dispatch pinned generation 2");
  // A handle from another registry.
  PlacementRegistry other;
  other.publish(g1, loaded_digests(g1));
  auto foreign = other.acquire();
  CHECK_ERROR(reg.check_handle(foreign, 1), "comes from another registry");
  // An empty handle.
  CHECK_ERROR(reg.check_handle(GenerationHandle(), 1), "holds no reference");
  // Generation 1 drains, is retired; its released handle is rejected.
  h1.release();
  reg.retire(1);
  CHECK_ERROR(reg.check_handle(h1, 1), "placement generation 1 (RETIRED) holds no reference");
  CHECK_ERROR(reg.check_generation(1), "placement generation 1 is RETIRED");
  CHECK_NOTHROW(reg.check_generation(2));
  CHECK_ERROR(h1.placement(), "empty generation handle (generation 1");
}

TEST_CASE("Registry: rollback serves the previous generation while old handles drain", "[placement][registry]") {
  PlacementRegistry reg;
  CHECK_ERROR(reg.rollback(), "cannot roll back");
  auto const g1 = generation(1, {4, 2, 1, 1});
  auto const g2 = generation(2, {1, 1, 2, 4});
  auto const g3 = generation(3, {1, 4, 1, 2});
  reg.publish(g1, loaded_digests(g1));
  CHECK_ERROR(reg.rollback(), "no generation was active before 1");
  reg.publish(g2, loaded_digests(g2));
  auto old = reg.acquire();  // on generation 2
  reg.rollback();
  CHECK(reg.active_generation() == 1);
  CHECK(reg.state(2) == GenerationState::draining);
  CHECK(reg.state(1) == GenerationState::active);
  auto fresh = reg.acquire();
  CHECK(fresh.generation() == 1);
  CHECK(fresh.placement().phy2log() == g1.phy2log());
  // The old handle drains on generation 2, then 2 can retire.
  CHECK_NOTHROW(reg.check_handle(old, 2));
  CHECK_ERROR(reg.retire(2), "1 live reference");
  old = GenerationHandle();
  reg.retire(2);
  // Publishing again after a rollback continues the history.
  reg.publish(g3, loaded_digests(g3));
  CHECK(reg.state(1) == GenerationState::draining);
  reg.rollback();
  CHECK(reg.active_generation() == 1);
  // 1 is the first generation: nothing earlier.
  CHECK_ERROR(reg.rollback(), "cannot roll back");

  // Rolling back onto a retired generation is refused.
  PlacementRegistry r2;
  r2.publish(g1, loaded_digests(g1));
  r2.publish(g2, loaded_digests(g2));
  r2.retire(1);
  CHECK_ERROR(r2.rollback(), "cannot roll back from generation 2 to generation 1: it is RETIRED");
  CHECK(r2.active_generation() == 2);
}

TEST_CASE("Registry: handles outlive the registry", "[placement][registry]") {
  GenerationHandle h;
  {
    PlacementRegistry reg;
    auto const g1 = generation(1, {4, 2, 1, 1});
    reg.publish(g1, loaded_digests(g1));
    h = reg.acquire();
  }
  CHECK(h.holds_reference());
  CHECK(h.placement().generation() == 1);
  h.release();
  CHECK_FALSE(h.holds_reference());
}

TEST_CASE("Load estimates: cumulative and moving average with provenance", "[placement][load]") {
  auto cum = LoadEstimate::cumulative(2, 3, "prefill", 4);
  cum.observe(10, 0, {1, 2, 3});
  cum.observe(10, 1, {0, 0, 5});
  cum.observe(11, {{3, 0, 1}, {1, 1, 1}});
  CHECK(cum.load(0) == std::vector<double>{4, 2, 4});
  CHECK(cum.load(1) == std::vector<double>{1, 1, 6});
  CHECK(cum.observations(0) == 2);
  auto const& pv = cum.provenance();
  CHECK(pv.phase == "prefill");
  CHECK(pv.generation == 4);
  CHECK(pv.first_step == 10);
  CHECK(pv.last_step == 11);
  CHECK(pv.steps == 2);
  CHECK_FALSE(pv.moving_average);

  auto ema = LoadEstimate::moving_average(1, 2, 0.75, "decode", 2);
  ema.observe(0, 0, {8, 0});
  CHECK(ema.load(0) == std::vector<double>{8, 0});
  ema.observe(1, 0, {0, 4});
  CHECK(ema.load(0) == std::vector<double>{6, 1});
  ema.observe(5, 0, {2, 1});
  CHECK(ema.load(0) == std::vector<double>{5, 1});
  CHECK(ema.provenance().steps == 3);
  CHECK(ema.provenance().beta == 0.75);

  // Errors: size, negative count, older step, same layer twice, beta.
  CHECK_ERROR(ema.observe(6, 0, {1}), "has 1 counts for 2 experts");
  CHECK_ERROR(ema.observe(6, 0, {1, -1}), "expert 1 has count -1");
  CHECK_ERROR(ema.observe(4, 0, {1, 1}), "step 4 is older than the last observed step 5");
  CHECK_ERROR(ema.observe(5, 0, {1, 1}), "layer 0 was already observed at step 5");
  CHECK_ERROR(ema.observe(6, 1, {1, 1}), "layer 1 outside [0, 1)");
  CHECK_ERROR(LoadEstimate::moving_average(1, 2, 1.0, "decode", 0), "beta 1 outside [0, 1)");

  // JSON in the kmoe-eplb load format, with the provenance.
  auto const j = nlohmann::json::parse(cum.to_json());
  CHECK(j.at("layers").size() == 2);
  CHECK(j.at("layers")[0].at("load").get<std::vector<double>>() == std::vector<double>{4, 2, 4});
  CHECK(j.at("provenance").at("phase") == "prefill");
  CHECK(j.at("provenance").at("window").get<std::vector<std::int64_t>>() == std::vector<std::int64_t>{10, 11});

  // Router output (RouteTable expert counts) feeds the estimate.
  RouteTable<Kokkos::HostSpace> routes("test::routes", 4, 2, 3);
  routes.expert_counts(0) = 5;
  routes.expert_counts(2) = 3;
  auto est = LoadEstimate::cumulative(1, 3, "decode", 0);
  est.observe(0, 0, routes);
  CHECK(est.load(0) == std::vector<double>{5, 0, 3});
  // The estimate drives the solver.
  PlacementSpec spec;
  spec.physical_slots = 6;
  spec.ranks = 3;
  auto const lp = build_placements(est.loads(), spec);
  CHECK(lp.front().logcnt == std::vector<int>{3, 1, 2});
}

TEST_CASE("Registry: a faulted candidate is rolled back in order, no step early", "[placement][registry][fault]") {
  PlacementRegistry reg;
  auto const g1 = generation(1, {4, 2, 1, 1});
  auto const g2 = generation(2, {1, 1, 2, 4});
  reg.publish(g1, loaded_digests(g1));
  reg.publish(g2, loaded_digests(g2));
  // Dispatches in flight on the candidate (generation 2) when it faults.
  std::vector<GenerationHandle> in_flight;
  for (int i = 0; i < 3; ++i) in_flight.push_back(reg.acquire());
  std::vector<std::string> order;
  RollbackSteps steps;
  steps.stop_dispatch = [&](std::uint64_t c) {
    CHECK(c == 2);
    CHECK(order.empty());
    CHECK(reg.state(2) == GenerationState::draining);
    CHECK_FALSE(reg.has_active());
    CHECK_ERROR(reg.acquire(), "new dispatch is stopped while candidate generation 2 is rolled back");
    order.push_back("stop");
  };
  steps.activate_prior = [&](std::uint64_t p) {
    CHECK(p == 1);
    CHECK(order == std::vector<std::string>{"stop"});
    CHECK(reg.active_generation() == 1);
    CHECK(reg.acquire().generation() == 1);  // new work goes to the prior generation
    CHECK(reg.references(2) == 3);          // nothing drained yet
    order.push_back("activate");
  };
  steps.drain = [&](std::uint64_t c, std::int64_t live) {
    CHECK(c == 2);
    CHECK(live == reg.references(2));
    CHECK(live == static_cast<std::int64_t>(in_flight.size()));
    CHECK((order.back() == "activate" || order.back() == "drain"));
    CHECK(reg.state(2) == GenerationState::draining);
    CHECK_NOTHROW(reg.check_handle(in_flight.back(), 2));  // a draining handle still combines
    in_flight.pop_back();  // one dispatch completes
    order.push_back("drain");
  };
  steps.release = [&](std::uint64_t c) {
    CHECK(c == 2);
    CHECK(reg.references(2) == 0);
    CHECK(reg.state(2) == GenerationState::draining);  // not retired before its resources go
    order.push_back("release");
  };
  CHECK(reg.roll_back_candidate(steps) == 1);
  CHECK(order == std::vector<std::string>{"stop", "activate", "drain", "drain", "drain", "release"});
  CHECK(reg.state(2) == GenerationState::retired);
  CHECK(reg.active_generation() == 1);
  CHECK(reg.state(1) == GenerationState::active);
  CHECK_ERROR(reg.roll_back_candidate(steps), "no generation was active before 1");
}

TEST_CASE("Registry: a candidate whose handles never drain keeps its resources", "[placement][registry][fault]") {
  PlacementRegistry reg;
  auto const g1 = generation(1, {4, 2, 1, 1});
  auto const g2 = generation(2, {1, 1, 2, 4});
  reg.publish(g1, loaded_digests(g1));
  reg.publish(g2, loaded_digests(g2));
  auto stuck = reg.acquire();
  int drains = 0;
  bool released = false;
  RollbackSteps steps;
  steps.drain = [&](std::uint64_t, std::int64_t) { ++drains; };  // the dispatch never completes
  steps.release = [&](std::uint64_t) { released = true; };
  CHECK_ERROR(reg.roll_back_candidate(steps, 5),
              "cannot finish rolling back candidate generation 2: 1 handle still reference it after 5 drain calls without "
              "progress; generation 1 serves, 2 stays DRAINING with its resources");
  CHECK(drains == 5);
  CHECK_FALSE(released);
  CHECK(reg.state(2) == GenerationState::draining);
  CHECK(reg.active_generation() == 1);
  CHECK(reg.acquire().generation() == 1);
  // Once the dispatch completes, the candidate retires.
  stuck = GenerationHandle();
  reg.retire(2);
  CHECK(reg.state(2) == GenerationState::retired);

  // No prior generation to fall back to, or a retired one: nothing happens.
  PlacementRegistry single;
  single.publish(g1, loaded_digests(g1));
  bool called = false;
  RollbackSteps any;
  any.stop_dispatch = [&](std::uint64_t) { called = true; };
  CHECK_ERROR(single.roll_back_candidate(any), "no generation was active before 1");
  PlacementRegistry gone;
  gone.publish(g1, loaded_digests(g1));
  gone.publish(g2, loaded_digests(g2));
  gone.retire(1);
  CHECK_ERROR(gone.roll_back_candidate(any), "cannot roll back candidate generation 2 to generation 1: it is RETIRED");
  CHECK_FALSE(called);
  CHECK(gone.active_generation() == 2);
  CHECK(gone.state(2) == GenerationState::active);
}
