#ifndef KOKKOSMOE_SCHEDULE_HPP
#define KOKKOSMOE_SCHEDULE_HPP

/// \file KokkosMoE_Schedule.hpp
/// \brief A layer step as a small task graph: tasks on in-order streams with
/// explicit dependencies and declared buffer accesses, checked for hazards
/// before anything runs, simulated with model durations (serialized and
/// overlapped makespans) and executed by the same graph.
///
/// Semantics. A stream executes its tasks in the order they were added (like
/// an execution space instance or a CUDA stream); a task starts when its
/// stream is free and every task it waits for has ended. The order tasks are
/// added in must be a topological order (a task waits only for tasks added
/// before it), and it is the serialized order: one task at a time.
///
/// Hazards. Two tasks that touch the same buffer, at least one of them
/// writing it, must be ordered: one reaches the other through dependencies
/// and stream order. An expert reading rows its dispatch has not finished
/// delivering, a send buffer refilled while a dispatch still reads it, or a
/// reduce that does not wait for every combine is a graph that validate()
/// rejects, naming both tasks and the buffer.
///
/// Execution. execute() issues the tasks in the order they were added. A
/// task has an issue function and, for asynchronous work (a posted exchange),
/// a complete function; before a task is issued every task it waits for
/// (dependencies and its stream predecessor) is completed, and in-flight
/// tasks get a progress call between issues. The measured start of a task is
/// when its issue began, its end when it completed.

#include <KokkosMoE_EnumNames.hpp>

#include <functional>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief How a layer step is scheduled (deck `[run] schedule`). Every
/// schedule gives bitwise the output of `serial`: the per-token combine order
/// never changes.
///   serial                 one stream, today's order
///   shared_overlap         the shared experts compute while the routed rows move
///   chunked                routes split into `chunks` token ranges; expert work
///                          on chunk i overlaps the dispatch of chunk i+1 and the
///                          combine of chunk i-1
///   chunked_shared_overlap both
enum class ScheduleKind { serial, shared_overlap, chunked, chunked_shared_overlap };

inline EnumTable<ScheduleKind> const& names_of(ScheduleKind) {
  static EnumTable<ScheduleKind> const t{"layer schedule",
                                         {{ScheduleKind::serial, "serial"},
                                          {ScheduleKind::shared_overlap, "shared_overlap"},
                                          {ScheduleKind::chunked, "chunked"},
                                          {ScheduleKind::chunked_shared_overlap, "chunked_shared_overlap"}}};
  return t;
}

/// \brief A layer's schedule choice.
struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::serial;
  int chunks = 1;  ///< token ranges of a step (chunked schedules; 1 otherwise)
  /// Test hook: build the step graph without the dependency of task
  /// `omit_task` on `omit_after` (a missing completion dependency), which the
  /// graph's hazard check must reject before anything runs.
  std::string omit_task, omit_after;
  /// Test hook: execute the step graph without its hazard check, so that a
  /// fault the check would reject meets the run-time guards instead (an
  /// expert refuses rows whose dispatch has not finished, the combine a
  /// missing expert output, the reduce a combine still in flight).
  bool unchecked = false;

  bool chunked() const { return kind == ScheduleKind::chunked || kind == ScheduleKind::chunked_shared_overlap; }
  bool shared_overlap() const { return kind == ScheduleKind::shared_overlap || kind == ScheduleKind::chunked_shared_overlap; }
  /// Chunks a step runs: `chunks` for chunked schedules, else 1.
  int step_chunks() const { return chunked() ? chunks : 1; }
};

/// \brief One task of a schedule.
struct TaskSpec {
  std::string name;                 ///< unique within the graph
  std::string stream;               ///< in-order stream it runs on
  std::vector<std::string> after;   ///< tasks it waits for (added before it)
  std::vector<std::string> reads;   ///< buffers it reads
  std::vector<std::string> writes;  ///< buffers it writes
  double duration = 0;              ///< model duration (simulation only)
};

/// \brief [start, end) of a task, model units or seconds.
struct TaskTime {
  double start = 0;
  double end = 0;
};

/// \brief What execute() runs for one task: issue (required) and, for work
/// that finishes later, complete and an optional progress poll.
struct TaskBody {
  std::function<void()> issue;
  std::function<void()> complete;  ///< empty: the task is done when issue returns
  std::function<void()> progress;  ///< called between other tasks' issues while in flight
};

/// \brief A schedule: tasks, streams, dependencies, buffer accesses.
class TaskGraph {
 public:
  explicit TaskGraph(std::string name = "schedule") : name_(std::move(name)) {}

  /// \brief Adds a task; returns its index. Throws on an empty or repeated
  /// name, an empty stream, or a dependency not added before.
  int add(TaskSpec spec);

  std::string const& name() const { return name_; }
  int size() const { return static_cast<int>(tasks_.size()); }
  TaskSpec const& task(int i) const { return tasks_.at(static_cast<std::size_t>(i)); }
  /// \brief Index of a task by name, -1 when there is none.
  int find(std::string const& name) const;
  /// \brief Streams in order of first use.
  std::vector<std::string> streams() const;

  /// \brief True when a ends before b starts in every execution: a path of
  /// dependencies and stream order leads from a to b.
  bool ordered_before(int a, int b) const;
  /// \brief Throws Error naming the first hazard (see the file comment).
  void validate() const;

  /// \brief Model times with one task at a time in the order added.
  std::vector<TaskTime> serialized() const;
  /// \brief Model times with in-order streams running concurrently.
  std::vector<TaskTime> overlapped() const;
  static double makespan(std::vector<TaskTime> const& times);

  /// \brief Validates (unless `check` is false: a test hook), then runs
  /// bodies[i] for task i as described in the file comment; returns measured
  /// [start, end) seconds from the start of the call. An exception from a
  /// body propagates after every task already issued has been completed (so
  /// nothing is left in flight).
  std::vector<TaskTime> execute(std::vector<TaskBody> const& bodies, bool check = true) const;

 private:
  std::vector<int> waits_for(int i) const;  ///< dependencies plus the stream predecessor
  std::string name_;
  std::vector<TaskSpec> tasks_;
  std::vector<std::vector<int>> deps_;
  std::vector<int> stream_prev_;
  std::vector<std::vector<bool>> reach_;  ///< reach_[b][a]: a ordered before b
};

/// \brief Task names of the layer step graph: "route plan", "dispatch P",
/// "expert P", "combine P", "shared experts", "reduce", where P is the part
/// "<chunk>" (one wave) or "<chunk>.<wave>".
std::string part_name(int chunk, int wave, int waves);

/// \brief The task graph of one layer step with `waves` exchange waves per
/// chunk and shared experts or not, in the issue order of the schedule.
/// Buffers: route plan writes "plans"; dispatch P reads "plans" and
/// "hidden" and writes "rows P"; expert P reads "rows P", writes "out P";
/// combine P reads "out P", writes "returned <chunk>"; shared experts read
/// "hidden" and write "shared out"; reduce reads every "returned" and
/// "shared out" and writes "output". Durations are zero (execution only).
/// Throws for chunks < 1, waves < 1 or a hook naming a dependency that does
/// not exist.
TaskGraph layer_step_graph(ScheduleConfig const& schedule, int waves, bool shared);

}  // namespace KokkosMoE

#endif
