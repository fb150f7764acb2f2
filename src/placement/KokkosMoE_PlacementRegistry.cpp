#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>

#include <sstream>

namespace KokkosMoE {

namespace Impl {
struct GenerationEntry {
  std::shared_ptr<Placement const> placement;
  GenerationState state = GenerationState::active;
  std::int64_t references = 0;
};
struct RegistryState {
  std::map<std::uint64_t, GenerationEntry> entries;
  /// Activation history: the back is ACTIVE; rollback pops it.
  std::vector<std::uint64_t> history;
  /// Set between steps 1 and 2 of roll_back_candidate: no handle is handed out.
  bool dispatch_stopped = false;

  GenerationEntry& entry(std::uint64_t g) {
    auto it = entries.find(g);
    KOKKOSMOE_REQUIRE(it != entries.end(), "placement generation " << g << " is not in the registry");
    return it->second;
  }
};
}  // namespace Impl

// ---- GenerationHandle ---------------------------------------------------------

GenerationHandle::GenerationHandle(std::shared_ptr<Impl::RegistryState> state, std::uint64_t generation)
    : state_(std::move(state)), generation_(generation) {
  auto& e = state_->entry(generation_);
  placement_ = e.placement;
  add_reference();
}

void GenerationHandle::add_reference() {
  if (!state_) return;
  ++state_->entry(generation_).references;
  holds_ = true;
}

GenerationHandle::GenerationHandle(GenerationHandle const& other)
    : state_(other.holds_ ? other.state_ : nullptr),
      placement_(other.holds_ ? other.placement_ : nullptr),
      generation_(other.generation_) {
  add_reference();
}

GenerationHandle::GenerationHandle(GenerationHandle&& other) noexcept
    : state_(std::move(other.state_)),
      placement_(std::move(other.placement_)),
      generation_(other.generation_),
      holds_(other.holds_) {
  other.holds_ = false;
  other.state_.reset();
  other.placement_.reset();
}

GenerationHandle& GenerationHandle::operator=(GenerationHandle const& other) {
  if (this == &other) return *this;
  GenerationHandle copy(other);
  *this = std::move(copy);
  return *this;
}

GenerationHandle& GenerationHandle::operator=(GenerationHandle&& other) noexcept {
  if (this == &other) return *this;
  release();
  state_ = std::move(other.state_);
  placement_ = std::move(other.placement_);
  generation_ = other.generation_;
  holds_ = other.holds_;
  other.holds_ = false;
  other.state_.reset();
  other.placement_.reset();
  return *this;
}

GenerationHandle::~GenerationHandle() { release(); }

void GenerationHandle::release() {
  if (holds_ && state_) {
    auto it = state_->entries.find(generation_);
    if (it != state_->entries.end()) --it->second.references;
  }
  holds_ = false;
  state_.reset();
  placement_.reset();
}

Placement const& GenerationHandle::placement() const {
  KOKKOSMOE_REQUIRE(holds_ && placement_, "placement of an empty generation handle (generation " << generation_
                                                                                            << ", released or never acquired)");
  return *placement_;
}

// ---- PlacementRegistry --------------------------------------------------------

PlacementRegistry::PlacementRegistry() : state_(std::make_shared<Impl::RegistryState>()) {}

void PlacementRegistry::publish(Placement placement, std::vector<std::uint64_t> const& actual_digests) {
  std::uint64_t const g = placement.generation();
  KOKKOSMOE_REQUIRE(state_->entries.empty() || g > state_->entries.rbegin()->first,
                    "cannot publish placement generation " << g << ": generation ids must increase (latest published is "
                                                           << state_->entries.rbegin()->first << ")");
  KOKKOSMOE_REQUIRE(static_cast<int>(actual_digests.size()) == placement.num_slots(),
                    "cannot publish placement generation " << g << ": " << actual_digests.size()
                                                           << " actual digests for " << placement.num_slots() << " slots");
  std::ostringstream bad;
  int mismatches = 0;
  for (int s = 0; s < placement.num_slots(); ++s) {
    auto const& sl = placement.slot(s);
    if (sl.digest == actual_digests[static_cast<std::size_t>(s)]) continue;
    if (mismatches < 8)
      bad << (mismatches ? "; " : "") << "slot " << s << " (expert " << sl.expert << ", rank " << sl.rank
          << ") expects " << digest_hex(sl.digest) << ", loaded " << digest_hex(actual_digests[static_cast<std::size_t>(s)]);
    ++mismatches;
  }
  KOKKOSMOE_REQUIRE(mismatches == 0, "cannot publish placement generation " << g << ": " << mismatches << " of "
                                                                            << placement.num_slots()
                                                                            << " slot digests do not verify: " << bad.str()
                                                                            << (mismatches > 8 ? "; ..." : ""));
  if (!state_->history.empty()) state_->entry(state_->history.back()).state = GenerationState::draining;
  Impl::GenerationEntry e;
  e.placement = std::make_shared<Placement const>(std::move(placement));
  e.state = GenerationState::active;
  state_->entries.emplace(g, std::move(e));
  state_->history.push_back(g);
}

void PlacementRegistry::rollback() {
  auto& h = state_->history;
  KOKKOSMOE_REQUIRE(h.size() >= 2, "cannot roll back: no generation was active before "
                                       << (h.empty() ? std::string("(none active)") : std::to_string(h.back())));
  std::uint64_t const current = h.back(), previous = h[h.size() - 2];
  auto& prev = state_->entry(previous);
  KOKKOSMOE_REQUIRE(prev.state != GenerationState::retired, "cannot roll back from generation "
                                                                << current << " to generation " << previous
                                                                << ": it is RETIRED (its weights are gone)");
  state_->entry(current).state = GenerationState::draining;
  prev.state = GenerationState::active;
  h.pop_back();
}

std::uint64_t PlacementRegistry::roll_back_candidate(RollbackSteps const& steps, int max_idle_drains) {
  auto& h = state_->history;
  KOKKOSMOE_REQUIRE(h.size() >= 2, "cannot roll back the candidate: no generation was active before "
                                       << (h.empty() ? std::string("(none active)") : std::to_string(h.back())));
  std::uint64_t const candidate = h.back(), prior = h[h.size() - 2];
  KOKKOSMOE_REQUIRE(state_->entry(prior).state != GenerationState::retired,
                    "cannot roll back candidate generation " << candidate << " to generation " << prior
                                                             << ": it is RETIRED (its weights are gone)");
  KOKKOSMOE_REQUIRE(max_idle_drains >= 1, "roll_back_candidate: max_idle_drains is " << max_idle_drains << " (must be >= 1)");
  // 1. No new dispatch on the candidate.
  state_->dispatch_stopped = true;
  state_->entry(candidate).state = GenerationState::draining;
  if (steps.stop_dispatch) steps.stop_dispatch(candidate);
  // 2. The prior generation serves new work.
  h.pop_back();
  state_->entry(prior).state = GenerationState::active;
  state_->dispatch_stopped = false;
  if (steps.activate_prior) steps.activate_prior(prior);
  // 3. The candidate's handles drain to zero.
  int idle = 0;
  for (std::int64_t live = references(candidate); live > 0; live = references(candidate)) {
    KOKKOSMOE_REQUIRE(steps.drain, "cannot finish rolling back candidate generation "
                                       << candidate << ": " << live << " handle" << (live == 1 ? "" : "s")
                                       << " still reference it and no drain step was given; generation " << prior
                                       << " serves, " << candidate << " stays DRAINING with its resources");
    steps.drain(candidate, live);
    std::int64_t const now = references(candidate);
    idle = now < live ? 0 : idle + 1;
    KOKKOSMOE_REQUIRE(idle < max_idle_drains, "cannot finish rolling back candidate generation "
                                                  << candidate << ": " << now << " handle" << (now == 1 ? "" : "s")
                                                  << " still reference it after " << idle
                                                  << " drain calls without progress; generation " << prior << " serves, "
                                                  << candidate << " stays DRAINING with its resources");
  }
  // 4. Its resources go, 5. it retires.
  if (steps.release) steps.release(candidate);
  retire(candidate);
  return prior;
}

void PlacementRegistry::retire(std::uint64_t generation) {
  auto& e = state_->entry(generation);
  KOKKOSMOE_REQUIRE(e.state != GenerationState::active,
                    "cannot retire placement generation " << generation << ": it is the ACTIVE generation");
  KOKKOSMOE_REQUIRE(e.state != GenerationState::retired, "placement generation " << generation << " is already RETIRED");
  KOKKOSMOE_REQUIRE(e.references == 0, "cannot retire placement generation "
                                           << generation << ": " << e.references << " live reference"
                                           << (e.references == 1 ? "" : "s") << " (dispatches still in flight)");
  e.state = GenerationState::retired;
  // A retired generation can no longer be rolled back to.
}

GenerationHandle PlacementRegistry::acquire() const {
  KOKKOSMOE_REQUIRE(!state_->history.empty(), "acquire: no placement generation has been published");
  KOKKOSMOE_REQUIRE(!state_->dispatch_stopped, "acquire: new dispatch is stopped while candidate generation "
                                                   << state_->history.back() << " is rolled back");
  return GenerationHandle(state_, state_->history.back());
}

void PlacementRegistry::check_generation(std::uint64_t generation) const {
  auto it = state_->entries.find(generation);
  KOKKOSMOE_REQUIRE(it != state_->entries.end(), "placement generation " << generation << " is not in the registry");
  KOKKOSMOE_REQUIRE(it->second.state != GenerationState::retired,
                    "placement generation " << generation << " is RETIRED");
}

void PlacementRegistry::check_handle(GenerationHandle const& handle, std::uint64_t generation) const {
  auto it = state_->entries.find(handle.generation());
  std::string const handle_state =
      it == state_->entries.end() ? std::string("unknown") : to_string(it->second.state);
  KOKKOSMOE_REQUIRE(handle.holds_reference(), "combine rejected: the handle of placement generation "
                                                  << handle.generation() << " (" << handle_state
                                                  << ") holds no reference (released or never acquired); the dispatch "
                                                     "pinned generation "
                                                  << generation);
  KOKKOSMOE_REQUIRE(handle.state_ == state_, "combine rejected: the handle of placement generation "
                                                 << handle.generation() << " comes from another registry");
  KOKKOSMOE_REQUIRE(handle.generation() == generation, "combine rejected: handle of placement generation "
                                                           << handle.generation() << " (" << handle_state
                                                           << ") but the dispatch pinned generation " << generation);
  KOKKOSMOE_REQUIRE(it->second.state != GenerationState::retired,
                    "combine rejected: placement generation " << generation << " is RETIRED");
}

bool PlacementRegistry::has_active() const { return !state_->history.empty() && !state_->dispatch_stopped; }

std::uint64_t PlacementRegistry::active_generation() const {
  KOKKOSMOE_REQUIRE(has_active(), "no placement generation is ACTIVE"
                                      << (state_->dispatch_stopped ? " (a candidate generation is being rolled back)" : ""));
  return state_->history.back();
}

GenerationState PlacementRegistry::state(std::uint64_t generation) const { return state_->entry(generation).state; }

std::int64_t PlacementRegistry::references(std::uint64_t generation) const {
  return state_->entry(generation).references;
}

Placement const& PlacementRegistry::placement(std::uint64_t generation) const {
  return *state_->entry(generation).placement;
}

std::vector<std::uint64_t> PlacementRegistry::generations() const {
  std::vector<std::uint64_t> out;
  for (auto const& kv : state_->entries) out.push_back(kv.first);
  return out;
}

}  // namespace KokkosMoE
