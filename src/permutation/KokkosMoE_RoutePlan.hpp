#ifndef KOKKOSMOE_ROUTEPLAN_HPP
#define KOKKOSMOE_ROUTEPLAN_HPP

/// \file KokkosMoE_RoutePlan.hpp
/// \brief The accepted routes of one origin rank with their full identity:
/// (origin rank, origin token, k-slot) -> logical expert -> physical slot ->
/// destination rank, gate. This is where the semantic plan (token, expert,
/// gate) meets the physical plan (replica, rank); the route table is never
/// changed by it.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>

namespace KokkosMoE {

/// \brief Accepted routes of one origin rank, in route order (token-major,
/// then k-slot). Route index a in [0, size()) is the position in this list.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct RoutePlan {
  using memory_space = MemorySpace;
  int origin_rank = 0;
  index_t num_tokens = 0;
  int top_k = 0;
  /// Global route id of route (t, j) = id_base + t * top_k + j.
  index_t id_base = 0;
  std::uint64_t generation = 0;  ///< placement generation the slots belong to
  Kokkos::View<int*, MemorySpace> token;
  Kokkos::View<int*, MemorySpace> kslot;
  Kokkos::View<int*, MemorySpace> expert;     ///< logical expert
  Kokkos::View<int*, MemorySpace> slot;       ///< physical slot
  Kokkos::View<int*, MemorySpace> dest_rank;  ///< global rank holding the slot
  Kokkos::View<float*, MemorySpace> gate;
  /// [T, k]: route index of (t, j), or -1 when the route was dropped.
  Kokkos::View<index_t**, Kokkos::LayoutRight, MemorySpace> route_index;

  index_t size() const { return static_cast<index_t>(token.extent(0)); }
};

/// \brief A host copy of a route plan (the planner and reports read routes
/// on the host).
template <class MS>
RoutePlan<Kokkos::HostSpace> to_host(RoutePlan<MS> const& p) {
  RoutePlan<Kokkos::HostSpace> h;
  h.origin_rank = p.origin_rank;
  h.num_tokens = p.num_tokens;
  h.top_k = p.top_k;
  h.id_base = p.id_base;
  h.generation = p.generation;
  Kokkos::HostSpace const host;
  h.token = Kokkos::create_mirror_view_and_copy(host, p.token);
  h.kslot = Kokkos::create_mirror_view_and_copy(host, p.kslot);
  h.expert = Kokkos::create_mirror_view_and_copy(host, p.expert);
  h.slot = Kokkos::create_mirror_view_and_copy(host, p.slot);
  h.dest_rank = Kokkos::create_mirror_view_and_copy(host, p.dest_rank);
  h.gate = Kokkos::create_mirror_view_and_copy(host, p.gate);
  h.route_index = Kokkos::create_mirror_view_and_copy(host, p.route_index);
  return h;
}

/// \brief Builds the route plan of origin_rank from its route table.
/// The physical slot of each accepted route is explicit_slot(t, j) when that
/// view is non-empty and the entry is >= 0 (explicit routes, e.g. fixtures),
/// else choice.slot(expert, global route id). Every chosen slot must store the route's logical
/// expert; otherwise Error names how many routes are wrong and the first one.
/// With a workspace, the plan's arrays are drawn from it: they are reused
/// by a later plan once this one and its copies are gone.
template <class Exec, class MS>
RoutePlan<MS> make_route_plan(Exec const& exec, RouteTable<MS> const& table, DevicePlacement<MS> const& placement,
                              ReplicaChoice<MS> const& choice, int origin_rank, index_t id_base = 0,
                              Kokkos::View<int**, Kokkos::LayoutRight, MS> const& explicit_slot = {},
                              Workspace<MS>* ws = nullptr) {
  index_t const T = table.num_tokens();
  int const k = table.top_k();
  KOKKOSMOE_REQUIRE(explicit_slot.extent(0) == 0 ||
                        (static_cast<index_t>(explicit_slot.extent(0)) == T && static_cast<int>(explicit_slot.extent(1)) == k),
                    "explicit slots are " << explicit_slot.extent(0) << "x" << explicit_slot.extent(1)
                                          << ", the route table is " << T << "x" << k);
  KOKKOSMOE_REQUIRE(table.num_experts() == placement.num_experts,
                    "route table has " << table.num_experts() << " experts, placement " << placement.num_experts);
  RoutePlan<MS> plan;
  plan.origin_rank = origin_rank;
  plan.num_tokens = T;
  plan.top_k = k;
  plan.id_base = id_base;
  plan.generation = placement.generation;
  plan.route_index = scratch<Kokkos::View<index_t**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::RoutePlan::route_index", T,
                                                                               static_cast<std::size_t>(k));
  auto accepted = table.accepted;
  auto route_index = plan.route_index;
  index_t A = 0;
  Kokkos::parallel_scan(
      "KokkosMoE::RoutePlan::compact", Kokkos::RangePolicy<Exec>(exec, 0, T * k),
      KOKKOS_LAMBDA(index_t x, index_t & running, bool final) {
        index_t const t = x / k;
        int const j = static_cast<int>(x % k);
        bool const ok = accepted(t, j) != 0;
        if (final) route_index(t, j) = ok ? running : -1;
        if (ok) ++running;
      },
      A);
  Compat::fence(exec, "KokkosMoE::RoutePlan: accepted count");
  auto ints = [&](char const* name) { return scratch<Kokkos::View<int*, MS>>(ws, exec, std::string("KokkosMoE::RoutePlan::") + name, A); };
  plan.token = ints("token");
  plan.kslot = ints("kslot");
  plan.expert = ints("expert");
  plan.slot = ints("slot");
  plan.dest_rank = ints("dest_rank");
  plan.gate = scratch<Kokkos::View<float*, MS>>(ws, exec, "KokkosMoE::RoutePlan::gate", A);
  auto token = plan.token;
  auto kslot = plan.kslot;
  auto expert = plan.expert;
  auto slot = plan.slot;
  auto dest = plan.dest_rank;
  auto gate = plan.gate;
  auto t_expert = table.expert;
  auto t_gate = table.gate;
  auto phy2log = placement.phy2log;
  auto slot_rank = placement.slot_rank;
  int const S = placement.num_slots();
  int const E = placement.num_experts;
  bool const use_explicit = explicit_slot.extent(0) > 0;
  // First wrong route (as t * k + j), or T*k when every route is right.
  index_t first_bad = T * k;
  Kokkos::parallel_reduce(
      "KokkosMoE::RoutePlan::fill", Kokkos::RangePolicy<Exec>(exec, 0, T * k),
      KOKKOS_LAMBDA(index_t x, index_t & bad) {
        index_t const t = x / k;
        int const j = static_cast<int>(x % k);
        index_t const a = route_index(t, j);
        if (a < 0) return;
        int const e = t_expert(t, j);
        int s = -1;
        if (e >= 0 && e < E) {
          int const given = use_explicit ? explicit_slot(t, j) : -1;
          s = given >= 0 ? given : choice.slot(e, id_base + x);
        }
        bool const ok = e >= 0 && e < E && s >= 0 && s < S && phy2log(s) == e;
        if (!ok && x < bad) bad = x;
        token(a) = static_cast<int>(t);
        kslot(a) = j;
        expert(a) = e;
        slot(a) = ok ? s : -1;
        dest(a) = ok ? slot_rank(s) : -1;
        gate(a) = t_gate(t, j);
      },
      Kokkos::Min<index_t>(first_bad));
  Compat::fence(exec, "KokkosMoE::RoutePlan: fill");
  if (first_bad < T * k) {
    int e = -1, s = -1;
    Kokkos::deep_copy(e, Kokkos::subview(t_expert, first_bad / k, first_bad % k));
    if (use_explicit) Kokkos::deep_copy(s, Kokkos::subview(explicit_slot, first_bad / k, first_bad % k));
    KOKKOSMOE_THROW("route (rank " << origin_rank << ", token " << first_bad / k << ", k-slot " << first_bad % k
                                   << ") to expert " << e << " has no valid physical slot"
                                   << (use_explicit ? " (explicit slot " + std::to_string(s) + ")" : std::string())
                                   << " in placement generation " << placement.generation << " (" << S
                                   << " slots, " << E << " experts)");
  }
  return plan;
}

}  // namespace KokkosMoE

#endif
