#ifndef KOKKOSMOE_PLACEMENTREGISTRY_HPP
#define KOKKOSMOE_PLACEMENTREGISTRY_HPP

/// \file KokkosMoE_PlacementRegistry.hpp
/// \brief Versioned placement generations: ACTIVE, DRAINING, RETIRED, with
/// reference-holding handles for dispatches in flight.
///
/// Life cycle: publish(g) verifies every slot digest of g against the digests
/// of the weights actually loaded, makes g ACTIVE and the previous ACTIVE
/// generation DRAINING. A DRAINING generation keeps its weights resident
/// while handles reference it; retire(g) is refused while any handle holds a
/// reference. rollback() re-activates the generation that was ACTIVE before
/// the current one; the current one drains. acquire() hands out a handle to
/// the ACTIVE generation; combine validates the handle it got back with
/// check_handle(). A candidate that faults after activation is taken back
/// by roll_back_candidate(), one ordered step at a time (RollbackSteps).
/// Host-side bookkeeping; not thread-safe.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Placement.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace KokkosMoE {

enum class GenerationState { active, draining, retired };
/// \brief "ACTIVE", "DRAINING", "RETIRED".
inline EnumTable<GenerationState> const& names_of(GenerationState) {
  static EnumTable<GenerationState> const t{"generation state",
                                            {{GenerationState::active, "ACTIVE"},
                                             {GenerationState::draining, "DRAINING"},
                                             {GenerationState::retired, "RETIRED"}}};
  return t;
}

namespace Impl {
struct RegistryState;
}  // namespace Impl

/// \brief A counted reference to one placement generation. Copying adds a
/// reference, moving transfers it, destruction or release() drops it. The
/// placement stays valid for the handle's lifetime, even after retirement of
/// other generations or destruction of the registry.
class GenerationHandle {
 public:
  GenerationHandle() = default;
  GenerationHandle(GenerationHandle const& other);
  GenerationHandle(GenerationHandle&& other) noexcept;
  GenerationHandle& operator=(GenerationHandle const& other);
  GenerationHandle& operator=(GenerationHandle&& other) noexcept;
  ~GenerationHandle();

  /// \brief True when the handle holds a reference.
  bool holds_reference() const { return holds_; }
  /// \brief Generation id the handle was acquired for (kept after release()).
  std::uint64_t generation() const { return generation_; }
  /// \brief The generation's placement; throws Error for an empty handle.
  Placement const& placement() const;
  /// \brief Drops the reference; generation() keeps the id for diagnostics.
  void release();

 private:
  friend class PlacementRegistry;
  GenerationHandle(std::shared_ptr<Impl::RegistryState> state, std::uint64_t generation);
  void add_reference();
  std::shared_ptr<Impl::RegistryState> state_;
  std::shared_ptr<Placement const> placement_;
  std::uint64_t generation_ = 0;
  bool holds_ = false;
};

/// \brief The caller's part of taking back a candidate generation that
/// faulted after activation (PlacementRegistry::roll_back_candidate). The
/// registry calls them in this order, each after the previous one returned
/// and after its own bookkeeping for that step; a missing function is a step
/// with nothing to do on the caller's side.
struct RollbackSteps {
  /// 1. New dispatch on the candidate stops: from here until step 2 the
  ///    registry hands out no handle (acquire() throws).
  std::function<void(std::uint64_t candidate)> stop_dispatch;
  /// 2. The prior generation is ACTIVE again: acquire() hands out its handles.
  std::function<void(std::uint64_t prior)> activate_prior;
  /// 3. Called while `references` handles still reference the candidate:
  ///    complete (or abandon) its dispatches in flight so that their handles
  ///    are dropped. Called again until none is left.
  std::function<void(std::uint64_t candidate, std::int64_t references)> drain;
  /// 4. The candidate's weights and buffers are released; no handle is left.
  std::function<void(std::uint64_t candidate)> release;
  // 5. (the registry) The candidate is RETIRED: it can never serve again.
};

/// \brief Registry of placement generations of one layer (or of one model
/// when all layers switch together). Generation ids are the placements'
/// generation() values and must increase with every publish.
class PlacementRegistry {
 public:
  PlacementRegistry();

  /// \brief Verifies actual_digests ([S], digests of the weights actually
  /// loaded, slot order) against every slot's digest, then makes the
  /// placement ACTIVE and the previously ACTIVE generation DRAINING. Throws
  /// Error (nothing changes) naming the generation and every mismatching slot
  /// with its expected and actual digest, or for a generation id that is not
  /// larger than every published one.
  void publish(Placement placement, std::vector<std::uint64_t> const& actual_digests);

  /// \brief Re-activates the generation that was ACTIVE before the current
  /// one; the current one becomes DRAINING (its handles drain). Throws Error
  /// when there is no earlier generation or it was retired.
  void rollback();

  /// \brief Takes back the ACTIVE generation (a candidate that faulted after
  /// activation), in this order: (1) stop new dispatch on it, (2) activate the
  /// prior generation for new work, (3) drain the candidate's handles to zero,
  /// (4) release its resources, (5) retire it; steps calls the caller's part
  /// of each (see RollbackSteps). Nothing happens, and Error is thrown, when
  /// there is no prior generation or it was RETIRED. When `max_idle_drains`
  /// drain calls in a row drop no handle, throws Error naming the candidate
  /// and its live references: the prior generation serves, the candidate
  /// stays DRAINING with its resources (release and retire never ran), and a
  /// later retire() finishes the job. An exception from a step stops the
  /// rollback after that step, the same way.
  /// \return the prior generation, now ACTIVE.
  std::uint64_t roll_back_candidate(RollbackSteps const& steps, int max_idle_drains = 1000);

  /// \brief RETIRES a DRAINING generation. Throws Error naming the generation
  /// and its reference count when handles still reference it, and for the
  /// ACTIVE generation or an unknown id.
  void retire(std::uint64_t generation);

  /// \brief A reference-holding handle to the ACTIVE generation.
  GenerationHandle acquire() const;

  /// \brief Validation at combine time: the handle must hold a reference from
  /// this registry to `generation` (the generation the dispatch pinned), and
  /// that generation must not be RETIRED. Throws Error otherwise, naming both
  /// generations and the state.
  void check_handle(GenerationHandle const& handle, std::uint64_t generation) const;
  /// \brief Throws Error unless `generation` is known and not RETIRED.
  void check_generation(std::uint64_t generation) const;

  bool has_active() const;
  std::uint64_t active_generation() const;
  GenerationState state(std::uint64_t generation) const;
  /// \brief Live handles referencing the generation.
  std::int64_t references(std::uint64_t generation) const;
  Placement const& placement(std::uint64_t generation) const;
  /// \brief Every published generation id, ascending.
  std::vector<std::uint64_t> generations() const;

 private:
  std::shared_ptr<Impl::RegistryState> state_;
};

}  // namespace KokkosMoE

#endif
