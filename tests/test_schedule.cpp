// The schedule task graph: the 11-task overlap example (serialized makespan
// 25, overlapped 15, every task's [start, end) exact), its hazard check (an
// expert that does not wait for its dispatch, a send buffer refilled while a
// dispatch reads it, a reduce that does not wait for both combines), and an
// execution that completes asynchronous tasks before their consumers.

#include "kmoe_catch.hpp"

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Schedule.hpp>

#include <string>
#include <vector>

using namespace KokkosMoE;

namespace {

struct Omit {
  std::string task;   // drop one dependency of this task ...
  std::string after;  // ... on this one
};

// The example: durations; stream; waits for. Buffers: pack_j writes send_j,
// dispatch_j reads send_j and writes rows_j, expert_j reads rows_j and writes
// out_j, combine_j reads out_j and writes back_j, shared writes shared_out,
// reduce reads back_0, back_1 and shared_out; `omit` drops one dependency.
TaskGraph example(Omit const& omit = {}) {
  TaskGraph g("overlap example");
  auto after = [&](std::string const& task, std::vector<std::string> deps) {
    std::vector<std::string> out;
    for (auto& d : deps)
      if (!(task == omit.task && d == omit.after)) out.push_back(d);
    return out;
  };
  auto send = [](int j) { return "send_" + std::to_string(j); };
  g.add({"route plan", "control", {}, {}, {"plan"}, 1});
  for (int j = 0; j < 2; ++j) {
    g.add({"pack " + std::to_string(j), "pack", after("pack " + std::to_string(j), {"route plan"}), {"plan"}, {send(j)}, 1});
  }
  for (int j = 0; j < 2; ++j)
    g.add({"dispatch " + std::to_string(j), "communication", after("dispatch " + std::to_string(j), {"pack " + std::to_string(j)}),
           {send(j)}, {"rows_" + std::to_string(j)}, 3});
  g.add({"shared path", "compute", after("shared path", {"route plan"}), {"plan"}, {"shared_out"}, 5});
  int const expert_d[2] = {4, 2};
  for (int j = 0; j < 2; ++j)
    g.add({"expert " + std::to_string(j), "compute", after("expert " + std::to_string(j), {"dispatch " + std::to_string(j)}),
           {"rows_" + std::to_string(j)}, {"out_" + std::to_string(j)}, static_cast<double>(expert_d[j])});
  for (int j = 0; j < 2; ++j)
    g.add({"combine " + std::to_string(j), "communication", after("combine " + std::to_string(j), {"expert " + std::to_string(j)}),
           {"out_" + std::to_string(j)}, {"back_" + std::to_string(j)}, 2});
  g.add({"reduce", "compute", after("reduce", {"combine 0", "combine 1", "shared path"}), {"back_0", "back_1", "shared_out"}, {"output"}, 1});
  return g;
}

void check_times(TaskGraph const& g, std::vector<TaskTime> const& t, std::vector<std::pair<double, double>> const& want) {
  REQUIRE(t.size() == want.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    INFO(g.task(static_cast<int>(i)).name);
    CHECK(t[i].start == want[i].first);
    CHECK(t[i].end == want[i].second);
  }
}

}  // namespace

TEST_CASE("the 11-task example: serialized 25, overlapped 15, every task exact", "[schedule]") {
  auto const g = example();
  REQUIRE(g.size() == 11);
  REQUIRE_NOTHROW(g.validate());
  CHECK(g.streams() == std::vector<std::string>{"control", "pack", "communication", "compute"});
  auto const s = g.serialized();
  CHECK(TaskGraph::makespan(s) == 25);
  // plan, pack0, pack1, disp0, disp1, shared, exp0, exp1, comb0, comb1, reduce
  check_times(g, s, {{0, 1}, {1, 2}, {2, 3}, {3, 6}, {6, 9}, {9, 14}, {14, 18}, {18, 20}, {20, 22}, {22, 24}, {24, 25}});
  auto const o = g.overlapped();
  CHECK(TaskGraph::makespan(o) == 15);
  check_times(g, o, {{0, 1}, {1, 2}, {2, 3}, {2, 5}, {5, 8}, {1, 6}, {6, 10}, {10, 12}, {10, 12}, {12, 14}, {14, 15}});
  // Stream order counts as order: combine 0 waits for dispatch 1 (same stream).
  CHECK(g.ordered_before(g.find("dispatch 1"), g.find("combine 0")));
  CHECK_FALSE(g.ordered_before(g.find("shared path"), g.find("dispatch 0")));
  CHECK_FALSE(g.ordered_before(g.find("expert 0"), g.find("dispatch 1")));
}

TEST_CASE("schedule hazards are rejected, naming both tasks and the buffer", "[schedule]") {
  SECTION("an expert that does not wait for its dispatch") {
    auto const g = example({"expert 0", "dispatch 0"});
    REQUIRE_THROWS_WITH(g.validate(), Catch::Matchers::Contains("task 'expert 0' (stream compute) reads 'rows_0'") &&
                                          Catch::Matchers::Contains("task 'dispatch 0' (stream communication) writes"));
  }
  SECTION("a send buffer refilled before the dispatch reading it completed") {
    auto two_packs = [](bool wait) {
      TaskGraph g("one send buffer");
      g.add({"route plan", "control", {}, {}, {"plan"}, 1});
      g.add({"pack 0", "pack", {"route plan"}, {"plan"}, {"send"}, 1});
      g.add({"dispatch 0", "communication", {"pack 0"}, {"send"}, {"rows_0"}, 3});
      g.add({"pack 1", "pack", wait ? std::vector<std::string>{"dispatch 0"} : std::vector<std::string>{}, {"plan"}, {"send"}, 1});
      g.add({"dispatch 1", "communication", {"pack 1"}, {"send"}, {"rows_1"}, 3});
      return g;
    };
    REQUIRE_THROWS_WITH(two_packs(false).validate(),
                        Catch::Matchers::Contains("task 'pack 1' (stream pack) overwrites 'send' that task 'dispatch 0' "
                                                           "(stream communication) reads without waiting for it"));
    // The same reuse after dispatch 0 completed is safe.
    REQUIRE_NOTHROW(two_packs(true).validate());
  }
  SECTION("a reduce that does not wait for both combines") {
    // Nothing else orders combine 1 (the last task of its stream) before reduce.
    auto const g = example({"reduce", "combine 1"});
    REQUIRE_THROWS_WITH(g.validate(), Catch::Matchers::Contains("task 'reduce' (stream compute) reads 'back_1'"));
    // Without combine 0 the reduce still waits for it through combine 1 (same stream).
    REQUIRE_NOTHROW(example({"reduce", "combine 0"}).validate());
  }
  SECTION("malformed graphs") {
    TaskGraph g("bad");
    g.add({"a", "s", {}, {}, {}, 1});
    REQUIRE_THROWS_WITH(g.add({"a", "s", {}, {}, {}, 1}), Catch::Matchers::Contains("task 'a' added twice"));
    REQUIRE_THROWS_WITH(g.add({"b", "s", {"c"}, {}, {}, 1}), Catch::Matchers::Contains("waits for 'c', which is not a task added before it"));
    REQUIRE_THROWS_WITH(g.add({"b", "", {}, {}, {}, 1}), Catch::Matchers::Contains("task 'b' has no stream"));
    REQUIRE_THROWS_WITH(g.add({"b", "s", {}, {}, {}, -1}), Catch::Matchers::Contains("duration -1"));
  }
}

TEST_CASE("execution completes asynchronous tasks before their consumers", "[schedule]") {
  auto const g = example();
  std::vector<std::string> log;
  std::vector<TaskBody> bodies(static_cast<std::size_t>(g.size()));
  int progress_calls = 0;
  for (int i = 0; i < g.size(); ++i) {
    std::string const n = g.task(i).name;
    bodies[static_cast<std::size_t>(i)].issue = [&log, n] { log.push_back("issue " + n); };
    if (n.rfind("dispatch", 0) == 0 || n.rfind("combine", 0) == 0) {
      bodies[static_cast<std::size_t>(i)].complete = [&log, n] { log.push_back("complete " + n); };
      bodies[static_cast<std::size_t>(i)].progress = [&progress_calls] { ++progress_calls; };
    }
  }
  auto const t = g.execute(bodies);
  std::vector<std::string> const want{
      "issue route plan", "issue pack 0",        "issue pack 1",       "issue dispatch 0", "complete dispatch 0",
      "issue dispatch 1", "issue shared path",   "issue expert 0",     "complete dispatch 1", "issue expert 1",
      "issue combine 0",  "complete combine 0",  "issue combine 1",    "complete combine 1",  "issue reduce"};
  CHECK(log == want);
  CHECK(progress_calls > 0);
  for (int i = 0; i < g.size(); ++i) {
    INFO(g.task(i).name);
    CHECK(t[static_cast<std::size_t>(i)].start <= t[static_cast<std::size_t>(i)].end);
  }
  // A hazardous graph never runs a body.
  auto const bad = example({"expert 1", "dispatch 1"});
  log.clear();
  REQUIRE_THROWS(bad.execute(bodies));
  CHECK(log.empty());
}

TEST_CASE("a failing task leaves nothing in flight", "[schedule]") {
  auto const g = example();
  std::vector<std::string> log;
  std::vector<TaskBody> bodies(static_cast<std::size_t>(g.size()));
  for (int i = 0; i < g.size(); ++i) {
    std::string const n = g.task(i).name;
    bodies[static_cast<std::size_t>(i)].issue = [&log, n] {
      if (n == "expert 0") throw Error("expert failed");
      log.push_back("issue " + n);
    };
    if (n.rfind("dispatch", 0) == 0) bodies[static_cast<std::size_t>(i)].complete = [&log, n] { log.push_back("complete " + n); };
  }
  REQUIRE_THROWS_WITH(g.execute(bodies), Catch::Matchers::Contains("expert failed"));
  // dispatch 1 was in flight when expert 0 failed: it was completed.
  REQUIRE(!log.empty());
  CHECK(log.back() == "complete dispatch 1");
}
