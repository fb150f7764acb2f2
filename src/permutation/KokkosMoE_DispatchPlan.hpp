#ifndef KOKKOSMOE_DISPATCHPLAN_HPP
#define KOKKOSMOE_DISPATCHPLAN_HPP

/// \file KokkosMoE_DispatchPlan.hpp
/// \brief Send side: counts per destination peer slot (zero-count peers
/// included), offsets with the sentinel, the stable permutation by
/// (destination peer slot, physical slot, route id) and its inverse, and the
/// pack kernel. Receive side: the repack of arrived rows into expert-major
/// segments, ordered by (local physical slot, source peer, send position).

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_CountingSort.hpp>

#include <algorithm>
#include <numeric>
#include <vector>

namespace KokkosMoE {

/// \brief The send plan of one source rank against one communicator's peer
/// order. Send position p holds route perm(p); route a is sent at inv(a).
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct DispatchPlan {
  using memory_space = MemorySpace;
  std::vector<int> peer_order;       ///< global rank of each peer slot
  int my_peer_slot = -1;             ///< the source rank's own peer slot
  std::vector<index_t> counts;       ///< [P] rows per destination peer slot
  std::vector<index_t> offsets;      ///< [P + 1] exclusive prefix, offsets[P] = rows
  Kokkos::View<index_t*, MemorySpace> perm;  ///< send position -> route index
  Kokkos::View<index_t*, MemorySpace> inv;   ///< route index -> send position
  /// [P] per peer slot, its segment as one run (first send position, rows)
  /// per physical slot of the peer's rank, in the rank's local slot order
  /// (ascending slot id), empty runs included: what a receiver needs to put
  /// each slot's rows straight into its expert-major place.
  std::vector<std::vector<std::pair<index_t, index_t>>> slot_runs;

  int num_peers() const { return static_cast<int>(peer_order.size()); }
  index_t rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

/// \brief Peer slot of every global rank in a peer order (-1 when absent).
std::vector<int> peer_slot_of_rank(std::vector<int> const& peer_order, int num_ranks);

/// \brief Builds the send plan of a route plan against peer_order (global
/// ranks by peer slot). Every destination rank must appear in peer_order.
/// With a workspace, the plan's arrays and the scratch are drawn from it.
template <class Exec, class MS>
DispatchPlan<MS> make_dispatch_plan(Exec const& exec, RoutePlan<MS> const& routes, Placement const& placement,
                                    std::vector<int> const& peer_order, Workspace<MS>* ws = nullptr) {
  int const P = static_cast<int>(peer_order.size());
  int const S = placement.num_slots();
  auto const slot_of = peer_slot_of_rank(peer_order, placement.num_ranks());
  // Key of a physical slot: its position when slots are ordered by (peer slot
  // of the slot's rank, slot id). Sorting routes stably by this key orders
  // them by (destination peer slot, physical slot, route id).
  std::vector<int> order(static_cast<std::size_t>(S));
  std::iota(order.begin(), order.end(), 0);
  std::vector<int> peer_of_slot(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) peer_of_slot[s] = slot_of[static_cast<std::size_t>(placement.slot(s).rank)];
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return peer_of_slot[a] < peer_of_slot[b]; });
  std::vector<int> h_key(static_cast<std::size_t>(S));
  std::vector<int> first_key(static_cast<std::size_t>(P) + 1, S);
  for (int pos = S - 1; pos >= 0; --pos) {
    int const s = order[pos];
    h_key[static_cast<std::size_t>(s)] = pos;
    if (peer_of_slot[s] >= 0) first_key[static_cast<std::size_t>(peer_of_slot[s])] = pos;
  }
  for (int p = P - 1; p >= 0; --p) first_key[p] = std::min(first_key[p], first_key[p + 1]);
  auto const slot_key = scratch_copy(ws, exec, "KokkosMoE::DispatchPlan::slot_key", h_key);

  index_t const A = routes.size();
  auto const keys = scratch<Kokkos::View<int*, MS>>(ws, exec, "KokkosMoE::DispatchPlan::keys", A);
  auto route_slot = routes.slot;
  auto const peer_of_slot_d = scratch_copy(ws, exec, "KokkosMoE::DispatchPlan::peer_of_slot", peer_of_slot);
  index_t missing = 0;
  Kokkos::parallel_reduce(
      "KokkosMoE::DispatchPlan::keys", Kokkos::RangePolicy<Exec>(exec, 0, A),
      KOKKOS_LAMBDA(index_t a, index_t & m) {
        int const s = route_slot(a);
        keys(a) = s >= 0 ? slot_key(s) : -1;
        if (s < 0 || peer_of_slot_d(s) < 0) ++m;
      },
      missing);
  Compat::fence(exec, "KokkosMoE::DispatchPlan: keys");
  KOKKOSMOE_REQUIRE(missing == 0, missing << " routes of rank " << routes.origin_rank
                                          << " go to ranks outside the communicator's peer order (" << P << " peers)");

  DispatchPlan<MS> plan;
  plan.peer_order = peer_order;
  plan.my_peer_slot = routes.origin_rank >= 0 && routes.origin_rank < static_cast<int>(slot_of.size())
                          ? slot_of[static_cast<std::size_t>(routes.origin_rank)]
                          : -1;
  plan.perm = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::DispatchPlan::perm", A);
  plan.inv = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::DispatchPlan::inv", A);
  auto const key_offsets = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::DispatchPlan::key_offsets", S + 1);
  stable_counting_sort(exec, keys, S, plan.perm, key_offsets, "KokkosMoE::DispatchPlan::sort", ws);
  invert_permutation(exec, plan.perm, plan.inv, "KokkosMoE::DispatchPlan::invert");
  auto const h_off = copy_to_host(exec, key_offsets);
  plan.counts.assign(static_cast<std::size_t>(P), 0);
  plan.offsets.assign(static_cast<std::size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) {
    plan.offsets[p] = h_off[first_key[p]];
    plan.counts[p] = h_off[first_key[p + 1]] - h_off[first_key[p]];
  }
  plan.offsets[P] = A;
  plan.slot_runs.assign(static_cast<std::size_t>(P), {});
  for (int p = 0; p < P; ++p)
    for (int key = first_key[p]; key < first_key[p + 1]; ++key)
      plan.slot_runs[static_cast<std::size_t>(p)].push_back({h_off[key], h_off[key + 1] - h_off[key]});
  return plan;
}

/// \brief The wire metadata of every send position of plan: meta(p) =
/// {slot, destination rank, origin rank, token * top_k + k-slot} of route
/// perm(p). meta must have plan.rows() records.
template <class Exec, class MS>
void pack_meta(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan, Kokkos::View<RowMeta*, MS> const& meta) {
  KOKKOSMOE_REQUIRE(static_cast<index_t>(meta.extent(0)) == plan.rows(),
                    "pack: " << meta.extent(0) << " metadata records for " << plan.rows() << " dispatched routes");
  auto perm = plan.perm;
  auto token = routes.token;
  auto slot = routes.slot;
  auto dest = routes.dest_rank;
  auto kslot = routes.kslot;
  int const k = routes.top_k;
  int const origin = routes.origin_rank;
  Kokkos::parallel_for(
      "KokkosMoE::pack::meta", Kokkos::RangePolicy<Exec>(exec, 0, plan.rows()), KOKKOS_LAMBDA(index_t p) {
        index_t const a = perm(p);
        meta(p) = RowMeta{slot(a), dest(a), origin, static_cast<std::int32_t>(token(a) * k + kslot(a))};
      });
}

/// \brief Gathers the hidden rows of every dispatched route into send (in
/// send order, encoded to send.type) and writes each row's metadata.
/// send must have plan.rows() rows of hidden's width; meta plan.rows() records.
template <class Exec, class T, class MS>
void pack(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan, RowMatrix<T, MS> const& hidden,
          PayloadBuffer<MS> const& send, Kokkos::View<RowMeta*, MS> const& meta, index_t skip_first = 0, index_t skip_rows = 0) {
  KOKKOSMOE_REQUIRE(send.rows() == plan.rows(), "pack: send buffer has " << send.rows() << " rows for " << plan.rows()
                                                                         << " dispatched routes");
  KOKKOSMOE_REQUIRE(static_cast<index_t>(hidden.extent(0)) == routes.num_tokens,
                    "pack: hidden has " << hidden.extent(0) << " rows for " << routes.num_tokens << " tokens");
  auto perm = plan.perm;
  auto token = routes.token;
  index_t const skip_end = skip_first + skip_rows;  // rows the caller places itself (its own, say)
  gather_rows(
      exec, hidden, KOKKOS_LAMBDA(index_t p)->index_t { return p >= skip_first && p < skip_end ? index_t(-1) : index_t(token(perm(p))); },
      send, "KokkosMoE::pack::rows");
  pack_meta(exec, routes, plan, meta);
}

/// \brief Receive side: arrived rows (concatenated by source peer slot, each
/// source's rows in its send order) regrouped expert-major by (local slot,
/// source peer, send position). Empty local slots keep their position.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct RepackPlan {
  using memory_space = MemorySpace;
  std::vector<index_t> slot_counts;    ///< [L] rows per local slot (local slot order)
  std::vector<index_t> slot_offsets;   ///< [L + 1]
  Kokkos::View<index_t*, MemorySpace> offsets;  ///< device copy of slot_offsets
  Kokkos::View<index_t*, MemorySpace> perm;     ///< expert-major position -> arrival position
  Kokkos::View<index_t*, MemorySpace> inv;      ///< arrival position -> expert-major position

  int num_local_slots() const { return static_cast<int>(slot_counts.size()); }
  index_t rows() const { return slot_offsets.empty() ? 0 : slot_offsets.back(); }
};

/// \brief Builds the repack of rows that arrived at `rank`; every row's slot
/// must be one of rank's slots in placement (else Error names the row).
/// With a workspace, the plan's arrays and the scratch are drawn from it.
template <class Exec, class MS>
RepackPlan<MS> make_repack_plan(Exec const& exec, Kokkos::View<RowMeta*, MS> const& meta, Placement const& placement,
                                int rank, Workspace<MS>* ws = nullptr) {
  int const L = static_cast<int>(placement.slots_of_rank(rank).size());
  int const S = placement.num_slots();
  index_t const n = static_cast<index_t>(meta.extent(0));
  std::vector<int> h_local(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s) h_local[static_cast<std::size_t>(s)] = placement.slot(s).rank == rank ? placement.local_index(s) : -1;
  auto const local_of_slot = scratch_copy(ws, exec, "KokkosMoE::RepackPlan::local_of_slot", h_local);
  auto const keys = scratch<Kokkos::View<int*, MS>>(ws, exec, "KokkosMoE::RepackPlan::keys", n);
  index_t first_bad = n;
  Kokkos::parallel_reduce(
      "KokkosMoE::RepackPlan::keys", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(index_t i, index_t & bad) {
        int const s = meta(i).slot;
        int const q = (s >= 0 && s < S) ? local_of_slot(s) : -1;
        keys(i) = q;
        if (q < 0 && i < bad) bad = i;
      },
      Kokkos::Min<index_t>(first_bad));
  Compat::fence(exec, "KokkosMoE::RepackPlan: keys");
  if (first_bad < n) {
    RowMeta m;
    Kokkos::deep_copy(m, Kokkos::subview(meta, first_bad));
    KOKKOSMOE_THROW("row " << first_bad << " arrived at rank " << rank << " for physical slot " << m.slot
                           << " (origin rank " << m.origin_rank << ", route " << m.route
                           << "), which is not one of this rank's " << L << " slots");
  }
  RepackPlan<MS> plan;
  plan.perm = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::RepackPlan::perm", n);
  plan.inv = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::RepackPlan::inv", n);
  plan.offsets = scratch<Kokkos::View<index_t*, MS>>(ws, exec, "KokkosMoE::RepackPlan::offsets", L + 1);
  stable_counting_sort(exec, keys, L, plan.perm, plan.offsets, "KokkosMoE::RepackPlan::sort", ws);
  invert_permutation(exec, plan.perm, plan.inv, "KokkosMoE::RepackPlan::invert");
  copy_to_host(exec, plan.offsets, plan.slot_offsets);
  plan.slot_counts.resize(static_cast<std::size_t>(L));
  for (int q = 0; q < L; ++q) plan.slot_counts[q] = plan.slot_offsets[q + 1] - plan.slot_offsets[q];
  return plan;
}

/// \brief Expert input rows: x_em row q = decode(arrived row perm(q)).
template <class Exec, class MS, class T>
void repack(Exec const& exec, RepackPlan<MS> const& plan, PayloadBuffer<MS> const& arrived, RowMatrix<T, MS> const& x_em) {
  KOKKOSMOE_REQUIRE(arrived.rows() == plan.rows() && static_cast<index_t>(x_em.extent(0)) == plan.rows(),
                    "repack: " << arrived.rows() << " arrived rows, " << x_em.extent(0) << " expert rows, plan "
                               << plan.rows());
  auto inv = plan.inv;
  scatter_rows(exec, arrived, KOKKOS_LAMBDA(index_t p)->index_t { return inv(p); }, x_em, "KokkosMoE::repack");
}

/// \brief The inverse of repack for expert outputs: returned row p (arrival
/// order) = encode(y_em row inv(p)), ready for the return transport.
template <class Exec, class MS, class T>
void unrepack(Exec const& exec, RepackPlan<MS> const& plan, RowMatrix<T, MS> const& y_em, PayloadBuffer<MS> const& back) {
  KOKKOSMOE_REQUIRE(back.rows() == plan.rows() && static_cast<index_t>(y_em.extent(0)) == plan.rows(),
                    "unrepack: " << y_em.extent(0) << " expert rows, " << back.rows() << " return rows, plan "
                                 << plan.rows());
  auto inv = plan.inv;
  gather_rows(exec, y_em, KOKKOS_LAMBDA(index_t p)->index_t { return inv(p); }, back, "KokkosMoE::unrepack");
}

}  // namespace KokkosMoE

#endif
