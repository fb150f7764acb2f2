#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Schedule.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

namespace KokkosMoE {

int TaskGraph::add(TaskSpec spec) {
  KOKKOSMOE_REQUIRE(!spec.name.empty(), "schedule '" << name_ << "': a task without a name");
  KOKKOSMOE_REQUIRE(find(spec.name) < 0, "schedule '" << name_ << "': task '" << spec.name << "' added twice");
  KOKKOSMOE_REQUIRE(!spec.stream.empty(), "schedule '" << name_ << "': task '" << spec.name << "' has no stream");
  KOKKOSMOE_REQUIRE(spec.duration >= 0, "schedule '" << name_ << "': task '" << spec.name << "' has duration " << spec.duration);
  int const me = size();
  std::vector<int> deps;
  for (auto const& a : spec.after) {
    int const d = find(a);
    KOKKOSMOE_REQUIRE(d >= 0, "schedule '" << name_ << "': task '" << spec.name << "' waits for '" << a
                                           << "', which is not a task added before it");
    if (std::find(deps.begin(), deps.end(), d) == deps.end()) deps.push_back(d);
  }
  int prev = -1;
  for (int i = me - 1; i >= 0; --i)
    if (tasks_[static_cast<std::size_t>(i)].stream == spec.stream) {
      prev = i;
      break;
    }
  std::vector<bool> reach(static_cast<std::size_t>(me) + 1, false);
  auto join = [&](int p) {
    reach[static_cast<std::size_t>(p)] = true;
    auto const& r = reach_[static_cast<std::size_t>(p)];
    for (std::size_t a = 0; a < r.size(); ++a)
      if (r[a]) reach[a] = true;
  };
  for (int d : deps) join(d);
  if (prev >= 0) join(prev);
  tasks_.push_back(std::move(spec));
  deps_.push_back(std::move(deps));
  stream_prev_.push_back(prev);
  reach_.push_back(std::move(reach));
  return me;
}

int TaskGraph::find(std::string const& name) const {
  for (int i = 0; i < size(); ++i)
    if (tasks_[static_cast<std::size_t>(i)].name == name) return i;
  return -1;
}

std::vector<std::string> TaskGraph::streams() const {
  std::vector<std::string> s;
  for (auto const& t : tasks_)
    if (std::find(s.begin(), s.end(), t.stream) == s.end()) s.push_back(t.stream);
  return s;
}

bool TaskGraph::ordered_before(int a, int b) const {
  KOKKOSMOE_REQUIRE(a >= 0 && a < size() && b >= 0 && b < size(), "schedule '" << name_ << "': no tasks " << a << " and " << b);
  auto const& r = reach_[static_cast<std::size_t>(b)];
  return static_cast<std::size_t>(a) < r.size() && r[static_cast<std::size_t>(a)];
}

void TaskGraph::validate() const {
  // Per buffer, the tasks touching it in order, and whether each writes.
  std::map<std::string, std::vector<std::pair<int, bool>>> users;
  for (int i = 0; i < size(); ++i) {
    auto const& t = tasks_[static_cast<std::size_t>(i)];
    std::set<std::string> w(t.writes.begin(), t.writes.end());
    for (auto const& b : t.writes) users[b].push_back({i, true});
    for (auto const& b : t.reads)
      if (!w.count(b)) users[b].push_back({i, false});
  }
  for (auto const& [buffer, list] : users) {
    for (std::size_t y = 0; y < list.size(); ++y)
      for (std::size_t x = 0; x < y; ++x) {
        auto const [a, a_writes] = list[x];
        auto const [b, b_writes] = list[y];
        if (!a_writes && !b_writes) continue;
        if (a == b || ordered_before(a, b)) continue;
        auto const& ta = tasks_[static_cast<std::size_t>(a)];
        auto const& tb = tasks_[static_cast<std::size_t>(b)];
        char const* what = a_writes && b_writes ? "writes" : (b_writes ? "overwrites" : "reads");
        KOKKOSMOE_THROW("schedule '" << name_ << "': task '" << tb.name << "' (stream " << tb.stream << ") " << what << " '"
                                     << buffer << "' that task '" << ta.name << "' (stream " << ta.stream << ") "
                                     << (a_writes ? "writes" : "reads")
                                     << " without waiting for it: no dependency or stream order leads from '" << ta.name
                                     << "' to '" << tb.name << "'");
      }
  }
}

std::vector<int> TaskGraph::waits_for(int i) const {
  std::vector<int> w = deps_[static_cast<std::size_t>(i)];
  int const p = stream_prev_[static_cast<std::size_t>(i)];
  if (p >= 0 && std::find(w.begin(), w.end(), p) == w.end()) w.push_back(p);
  return w;
}

std::vector<TaskTime> TaskGraph::serialized() const {
  std::vector<TaskTime> t(tasks_.size());
  double now = 0;
  for (std::size_t i = 0; i < tasks_.size(); ++i) {
    t[i] = {now, now + tasks_[i].duration};
    now = t[i].end;
  }
  return t;
}

std::vector<TaskTime> TaskGraph::overlapped() const {
  std::vector<TaskTime> t(tasks_.size());
  for (int i = 0; i < size(); ++i) {
    double start = 0;
    for (int w : waits_for(i)) start = std::max(start, t[static_cast<std::size_t>(w)].end);
    t[static_cast<std::size_t>(i)] = {start, start + tasks_[static_cast<std::size_t>(i)].duration};
  }
  return t;
}

double TaskGraph::makespan(std::vector<TaskTime> const& times) {
  double m = 0;
  for (auto const& t : times) m = std::max(m, t.end);
  return m;
}

std::vector<TaskTime> TaskGraph::execute(std::vector<TaskBody> const& bodies, bool check) const {
  KOKKOSMOE_REQUIRE(static_cast<int>(bodies.size()) == size(),
                    "schedule '" << name_ << "': " << bodies.size() << " task bodies for " << size() << " tasks");
  for (int i = 0; i < size(); ++i)
    KOKKOSMOE_REQUIRE(bodies[static_cast<std::size_t>(i)].issue, "schedule '" << name_ << "': task '" << task(i).name << "' has no body");
  if (check) validate();
  using clock = std::chrono::steady_clock;
  auto const t0 = clock::now();
  auto since = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  std::vector<TaskTime> times(tasks_.size());
  enum class State { waiting, in_flight, done };
  std::vector<State> state(tasks_.size(), State::waiting);
  auto complete = [&](int j) {
    auto& s = state[static_cast<std::size_t>(j)];
    if (s != State::in_flight) return;
    s = State::done;  // a failing completion is not retried
    bodies[static_cast<std::size_t>(j)].complete();
    times[static_cast<std::size_t>(j)].end = since();
  };
  try {
    for (int i = 0; i < size(); ++i) {
      for (int w : waits_for(i)) complete(w);
      auto const& b = bodies[static_cast<std::size_t>(i)];
      times[static_cast<std::size_t>(i)].start = since();
      b.issue();
      state[static_cast<std::size_t>(i)] = State::in_flight;
      if (!b.complete) {
        state[static_cast<std::size_t>(i)] = State::done;
        times[static_cast<std::size_t>(i)].end = since();
      }
      for (int j = 0; j < i; ++j)
        if (state[static_cast<std::size_t>(j)] == State::in_flight && bodies[static_cast<std::size_t>(j)].progress)
          bodies[static_cast<std::size_t>(j)].progress();
    }
    for (int i = 0; i < size(); ++i) complete(i);
  } catch (...) {
    // Leave nothing in flight; the first failure is the one reported.
    for (int i = 0; i < size(); ++i) {
      if (state[static_cast<std::size_t>(i)] != State::in_flight || !bodies[static_cast<std::size_t>(i)].complete) continue;
      state[static_cast<std::size_t>(i)] = State::done;
      try {
        bodies[static_cast<std::size_t>(i)].complete();
      } catch (...) {
      }
    }
    throw;
  }
  return times;
}

std::string part_name(int chunk, int wave, int waves) {
  return waves > 1 ? std::to_string(chunk) + "." + std::to_string(wave) : std::to_string(chunk);
}

TaskGraph layer_step_graph(ScheduleConfig const& schedule, int waves, bool shared) {
  int const C = schedule.step_chunks();
  KOKKOSMOE_REQUIRE(C >= 1, "layer schedule '" << to_string(schedule.kind) << "': chunks must be >= 1 (got " << C << ")");
  KOKKOSMOE_REQUIRE(waves >= 1, "layer schedule: waves must be >= 1 (got " << waves << ")");
  bool const serial = schedule.kind == ScheduleKind::serial;
  // Serial: one stream, so each task ends before the next starts. Otherwise
  // dispatches and combines move on their own streams and compute on one.
  std::string const control = serial ? "host" : "control";
  std::string const dispatch = serial ? "host" : "dispatch";
  std::string const combine = serial ? "host" : "combine";
  std::string const compute = serial ? "host" : "compute";
  TaskGraph g(to_string(schedule.kind) + " step (" + std::to_string(C) + " chunk" + (C > 1 ? "s" : "") + ", " +
              std::to_string(waves) + " wave" + (waves > 1 ? "s" : "") + ")");
  bool omitted = schedule.omit_task.empty();
  auto deps = [&](std::string const& task, std::vector<std::string> after) {
    if (task != schedule.omit_task) return after;
    std::vector<std::string> kept;
    for (auto& a : after) {
      if (a == schedule.omit_after)
        omitted = true;
      else
        kept.push_back(a);
    }
    return kept;
  };
  auto add = [&](std::string name, std::string const& stream, std::vector<std::string> after, std::vector<std::string> reads,
                 std::vector<std::string> writes) {
    auto a = deps(name, std::move(after));
    g.add({std::move(name), stream, std::move(a), std::move(reads), std::move(writes), 0});
  };
  add("route plan", control, {}, {}, {"plans"});
  // Parts in chunk-major, wave-minor order (the order of a serial step).
  std::vector<std::pair<int, int>> parts;
  for (int c = 0; c < C; ++c)
    for (int w = 0; w < waves; ++w) parts.push_back({c, w});
  auto P = [&](std::size_t i) { return part_name(parts[i].first, parts[i].second, waves); };
  auto add_dispatch = [&](std::size_t i) { add("dispatch " + P(i), dispatch, {"route plan"}, {"plans", "hidden"}, {"rows " + P(i)}); };
  auto add_expert = [&](std::size_t i) { add("expert " + P(i), compute, {"dispatch " + P(i)}, {"rows " + P(i)}, {"out " + P(i)}); };
  auto add_combine = [&](std::size_t i) {
    add("combine " + P(i), combine, {"expert " + P(i)}, {"out " + P(i)}, {"returned " + std::to_string(parts[i].first)});
  };
  auto add_shared = [&] { add("shared experts", compute, {"route plan"}, {"hidden"}, {"shared out"}); };
  if (serial) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      add_dispatch(i);
      add_expert(i);
      add_combine(i);
    }
    if (shared) add_shared();
  } else {
    // Issue order: dispatch 0 (then the shared experts, which need no rows),
    // then per part i: dispatch i+1, expert i, combine i. Expert i runs while
    // dispatch i+1 and combine i-1 are in flight.
    add_dispatch(0);
    if (shared && schedule.shared_overlap()) add_shared();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (i + 1 < parts.size()) add_dispatch(i + 1);
      add_expert(i);
      add_combine(i);
    }
    if (shared && !schedule.shared_overlap()) add_shared();
  }
  std::vector<std::string> after, reads;
  for (std::size_t i = 0; i < parts.size(); ++i) after.push_back("combine " + P(i));
  for (int c = 0; c < C; ++c) reads.push_back("returned " + std::to_string(c));
  if (shared) {
    after.push_back("shared experts");
    reads.push_back("shared out");
  }
  add("reduce", compute, after, reads, {"output"});
  KOKKOSMOE_REQUIRE(omitted, "layer schedule test hook: task '" << schedule.omit_task << "' has no dependency on '"
                                                                << schedule.omit_after << "' in the " << g.name());
  return g;
}

}  // namespace KokkosMoE
