#ifndef KOKKOSMOE_EXCHANGE_HIERARCHICAL_HPP
#define KOKKOSMOE_EXCHANGE_HIERARCHICAL_HPP

/// \file KokkosMoE_Exchange_Hierarchical.hpp
/// \brief Hierarchical relay exchange. Rows for the own node go directly over
/// the node-local communicator; rows for other nodes go (1) source -> own
/// node's relay of the source's rail (node-local communicator, together with
/// the direct rows), (2) relay -> the destination node's relay of the same
/// rail (relay communicator), (3) relay -> final rank (node-local
/// communicator). Metadata carries the final destination and the origin.
/// The final rank restores the flat arrival order (by origin EP peer slot,
/// then the origin's send order), so everything after the exchange sees the
/// same rows in the same order as with the flat exchange. Combine reverses
/// the three stages exactly. Works with one relay per node and with rail
/// relays (relays_per_node > 1).

#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <impl/KokkosMoE_CountingSort.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

#include <tuple>

namespace KokkosMoE {
namespace Exchange {

template <class Transport = Mpi, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class HierarchicalExchange {
 public:
  using memory_space = MemorySpace;
  static constexpr char const* name = "hierarchical";

  explicit HierarchicalExchange(Topology::CommunicatorSet const& comms, TransportOptions options = {},
                                PlacementRegistry const* registry = nullptr)
      : comms_(&comms), options_(options), registry_(registry), transport_(comms) {
    auto const& topo = comms.topology();
    int const N = topo.size();
    int const me = comms.global_rank();
    std::vector<int> node(static_cast<std::size_t>(N)), node_slot(static_cast<std::size_t>(N)), ep_slot(static_cast<std::size_t>(N));
    for (int r = 0; r < N; ++r) {
      node[r] = topo.node_of(r);
      node_slot[r] = comms.node_local().slot_of(r);
      ep_slot[r] = comms.ep().slot_of(r);
    }
    node_of_ = Impl::device_vector<MemorySpace>(node, "KokkosMoE::HierarchicalExchange::node_of");
    node_slot_ = Impl::device_vector<MemorySpace>(node_slot, "KokkosMoE::HierarchicalExchange::node_slot");
    ep_slot_ = Impl::device_vector<MemorySpace>(ep_slot, "KokkosMoE::HierarchicalExchange::ep_slot");
    my_node_ = topo.node_of(me);
    my_relay_ = Topology::relay_for(topo, comms.layout(), me, my_node_);
  }

  template <class Exec>
  DispatchHandle<MemorySpace> dispatch(Exec const& exec, Placement const& placement, DispatchPlan<MemorySpace> const& plan,
                                       PayloadBuffer<MemorySpace> const& send, Kokkos::View<RowMeta*, MemorySpace> const& meta,
                                       GenerationHandle ref = {}) {
    auto const& comms = *comms_;
    auto const& node = comms.node_local();
    int const me = comms.global_rank();
    auto const nor = Impl::node_of_rank(comms);
    Impl::Lap<Exec> lap(exec);
    DispatchHandle<MemorySpace> h;
    h.algorithm = name;
    h.generation = placement.generation();
    h.epoch = comms.epoch();
    h.generation_ref = std::move(ref);
    h.plan = plan;
    h.ledger = Impl::new_ledger(name, send, 1);
    // One watched agreement over all ranks first: a local problem fails
    // every rank before any stage starts.
    agree_or_throw(comms.ep(), Impl::problem_of([&] {
                     KOKKOSMOE_REQUIRE(plan.peer_order == comms.ep().peer_order(),
                                       "hierarchical dispatch: the dispatch plan was built for another peer order");
                     KOKKOSMOE_REQUIRE(send.rows() == plan.rows() && static_cast<index_t>(meta.extent(0)) == plan.rows(),
                                       "hierarchical dispatch: " << send.rows() << " packed rows and " << meta.extent(0)
                                                                 << " metadata records for " << plan.rows() << " planned rows");
                   }),
                   "hierarchical dispatch", options_);
    auto node_of = node_of_;
    auto node_slot = node_slot_;
    int const my_node = my_node_;
    int const relay_slot = node.slot_of(my_relay_);
    int const Pn = node.size();

    // Stage 1: direct rows to their node-local destination, transit rows to
    // this rank's relay; one node-local all-to-all.
    index_t const n0 = send.rows();
    Kokkos::View<int*, MemorySpace> key1(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::key1"), n0);
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalExchange::stage1_keys", Kokkos::RangePolicy<Exec>(exec, 0, n0), KOKKOS_LAMBDA(index_t p) {
          int const d = meta(p).dest_rank;
          key1(p) = node_of(d) == my_node ? node_slot(d) : relay_slot;
        });
    auto s1 = sort_stage(exec, key1, Pn, "gather to relay + node-local direct");
    s1.comm = 1;
    s1.input_rows = n0;
    auto [s1_recv, s1_recv_meta] = move_rows(exec, node, s1, send, meta, n0, "s1", "hierarchical dispatch stage 1");
    index_t const r1 = s1_recv.rows();
    {
      StageLedger st{s1.name, node.name()};
      add_sends(st, s1.send_counts, node.peer_order(), me, nor, send.row_bytes(), sizeof(RowMeta));
      // Transit rows sent to a relay other than this rank are relay traffic.
      std::int64_t transit = transit_rows(exec, meta, n0);
      if (my_relay_ != me) {
        st.relay_rows += transit;
        st.relay_bytes += transit * (send.row_bytes() + static_cast<std::int64_t>(sizeof(RowMeta)));
      }
      st.seconds = lap();
      h.ledger.dispatch.stages.push_back(st);
    }

    // Stage 2 (relays only): transit rows to the destination node's relay of
    // this rail; rows for this rank stay (extra bucket).
    int const nodes = comms.topology().num_nodes();
    Kokkos::View<int*, MemorySpace> key2(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::key2"), r1);
    index_t misrouted = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::stage2_keys", Kokkos::RangePolicy<Exec>(exec, 0, r1),
        KOKKOS_LAMBDA(index_t p, index_t & bad) {
          int const d = s1_recv_meta(p).dest_rank;
          if (d == me) {
            key2(p) = nodes;
          } else {
            key2(p) = node_of(d);
            if (node_of(d) == my_node) ++bad;
          }
        },
        misrouted);
    Compat::fence(exec, "KokkosMoE::HierarchicalExchange: stage 2 keys");
    bool const relay = comms.is_relay();
    agree_or_throw(comms.ep(), Impl::problem_of([&] {
                     KOKKOSMOE_REQUIRE(misrouted == 0, misrouted << " rows for ranks of this node arrived at rank " << me << " as transit");
                   }),
                   "hierarchical relay check", options_);
    auto s2 = sort_stage(exec, key2, nodes + 1, "relay to relay");
    s2.comm = 2;
    s2.input_rows = r1;
    index_t const kept = s2.send_counts.back();
    s2.send_counts.pop_back();
    index_t const transit_out = r1 - kept;
    agree_or_throw(comms.ep(), Impl::problem_of([&] {
                     KOKKOSMOE_REQUIRE(relay || transit_out == 0,
                                       transit_out << " transit rows arrived at rank " << me << ", which is not a relay");
                   }),
                   "hierarchical relay check", options_);
    PayloadBuffer<MemorySpace> s2_recv;  // rows from other relays (relays only)
    s2_recv.type = send.type;
    s2_recv.width = send.width;
    Kokkos::View<RowMeta*, MemorySpace> s2_recv_meta;
    {
      StageLedger st{s2.name, relay ? comms.relay().name() : std::string("-")};
      if (relay) {
        auto const& rc = comms.relay();
        std::tie(s2_recv, s2_recv_meta) =
            move_rows(exec, rc, s2, s1_recv, s1_recv_meta, transit_out, "s2", "hierarchical dispatch stage 2");
        add_sends(st, s2.send_counts, rc.peer_order(), me, nor, send.row_bytes(), sizeof(RowMeta));
      }
      st.seconds = lap();
      h.ledger.dispatch.stages.push_back(st);
    }

    // Stage 3: relays scatter to the final ranks of their node.
    index_t const n3 = s2_recv.rows();
    Kokkos::View<int*, MemorySpace> key3(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::key3"), n3);
    index_t foreign = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::stage3_keys", Kokkos::RangePolicy<Exec>(exec, 0, n3),
        KOKKOS_LAMBDA(index_t p, index_t & bad) {
          int const d = s2_recv_meta(p).dest_rank;
          key3(p) = node_of(d) == my_node ? node_slot(d) : 0;
          if (node_of(d) != my_node) ++bad;
        },
        foreign);
    Compat::fence(exec, "KokkosMoE::HierarchicalExchange: stage 3 keys");
    agree_or_throw(comms.ep(), Impl::problem_of([&] {
                     KOKKOSMOE_REQUIRE(foreign == 0, foreign << " rows for other nodes reached relay " << me << " of node " << my_node);
                   }),
                   "hierarchical relay check", options_);
    auto s3 = sort_stage(exec, key3, Pn, "relay scatter");
    s3.comm = 1;
    s3.input_rows = n3;
    auto [s3_recv, s3_recv_meta] = move_rows(exec, node, s3, s2_recv, s2_recv_meta, n3, "s3", "hierarchical dispatch stage 3");
    index_t const r3 = s3_recv.rows();
    {
      StageLedger st{s3.name, node.name()};
      add_sends(st, s3.send_counts, node.peer_order(), me, nor, send.row_bytes(), sizeof(RowMeta));
      std::int64_t moved = 0;
      for (int p = 0; p < Pn; ++p)
        if (node.global_rank(p) != me) moved += s3.send_counts[p];
      st.relay_rows += moved;
      st.relay_bytes += moved * (send.row_bytes() + static_cast<std::int64_t>(sizeof(RowMeta)));
      h.ledger.dispatch.stages.push_back(st);
    }
    auto& scatter_stage = h.ledger.dispatch.stages.back();

    // Final rows: stage-1 rows kept here (send order of stage 2's last
    // bucket), then stage-3 arrivals; restore the flat arrival order by a
    // stable sort on the origin's EP peer slot.
    index_t const nf = kept + r3;
    auto fin = work_.payload(exec, "final", send.type, send.width, nf);
    auto fin_meta = work_.meta(exec, "final_meta", nf);
    {
      auto perm2 = s2.send_perm;
      auto from_kept = KOKKOS_LAMBDA(index_t p)->index_t { return perm2(transit_out + p); };
      PayloadBuffer<MemorySpace> kept_rows = prefix(fin, kept);
      gather_rows(exec, s1_recv, from_kept, kept_rows, "KokkosMoE::HierarchicalExchange::final_kept");
      Impl::gather_meta(exec, s1_recv_meta, from_kept, Kokkos::subview(fin_meta, std::pair<index_t, index_t>(0, kept)),
                        "KokkosMoE::HierarchicalExchange::final_kept_meta");
      copy_row_range(exec, fin.bytes, kept, s3_recv.bytes, 0, r3);
      copy_row_range(exec, as_rows(fin_meta), kept, as_rows(s3_recv_meta), 0, r3);
    }
    auto ep_slot = ep_slot_;
    int const P = comms.ep().size();
    Kokkos::View<int*, MemorySpace> keyc(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::keyc"), nf);
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalExchange::origin_keys", Kokkos::RangePolicy<Exec>(exec, 0, nf),
        KOKKOS_LAMBDA(index_t p) { keyc(p) = ep_slot(fin_meta(p).origin_rank); });
    h.canonical_from = Kokkos::View<index_t*, MemorySpace>(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::canonical_from"), nf);
    Kokkos::View<index_t*, MemorySpace> origin_offsets("KokkosMoE::Hier::origin_offsets", P + 1);
    KokkosMoE::Impl::stable_counting_sort(exec, keyc, P, h.canonical_from, origin_offsets, "KokkosMoE::HierarchicalExchange::canonical");
    h.arrived = work_.payload(exec, "hier_arrived", send.type, send.width, nf);
    h.arrived_meta = work_.meta(exec, "hier_arrived_meta", nf);
    auto cf = h.canonical_from;
    gather_rows(exec, fin, KOKKOS_LAMBDA(index_t p)->index_t { return cf(p); }, h.arrived, "KokkosMoE::HierarchicalExchange::canonical_rows");
    Impl::gather_meta(exec, fin_meta, KOKKOS_LAMBDA(index_t p)->index_t { return cf(p); }, h.arrived_meta,
                      "KokkosMoE::HierarchicalExchange::canonical_meta");
    auto ho = Impl::host_vector(origin_offsets);
    h.recv_offsets.assign(ho.begin(), ho.end());
    h.recv_counts.resize(static_cast<std::size_t>(P));
    for (int p = 0; p < P; ++p) h.recv_counts[p] = h.recv_offsets[p + 1] - h.recv_offsets[p];
    s2.input_rows = kept;  // rows kept at this rank come first in the final buffer
    h.stages = {s1, s2, s3};
    agree_or_throw(comms.ep(), Impl::problem_of([&] { h.repack = make_repack_plan(exec, h.arrived_meta, placement, me); }),
                   "hierarchical dispatch repack", options_);
    scatter_stage.seconds = lap();  // scatter plus restoring the flat arrival order
    h.ledger.dispatch.useful_rows = nf;
    last_generation_ = h.generation;
    return h;
  }

  /// \brief The exact reverse of the handle's three stages; see FlatExchange::combine.
  template <class Exec>
  PayloadBuffer<MemorySpace> combine(Exec const& exec, DispatchHandle<MemorySpace>& h, PayloadBuffer<MemorySpace> const& back,
                                     std::string const& local_problem = {}) {
    auto const& comms = *comms_;
    auto const& node = comms.node_local();
    int const me = comms.global_rank();
    auto const nor = Impl::node_of_rank(comms);
    Impl::Lap<Exec> lap(exec);
    agree_or_throw(comms.ep(),
                   local_problem.empty() ? Impl::handle_problem(comms, h, name, back.rows(), registry_, last_generation_) : local_problem,
                   "hierarchical combine", options_);
    auto const& s1 = h.stages[0];
    auto const& s2 = h.stages[1];
    auto const& s3 = h.stages[2];
    PayloadType const type = back.type;
    int const width = back.width;
    index_t const kept = s2.input_rows;
    index_t const nf = back.rows();
    index_t const r3 = nf - kept;
    h.ledger.combine_payload = to_string(type);
    h.ledger.combine_row_bytes = back.row_bytes();
    h.ledger.combine.stages.clear();

    // Undo the canonical order: final-buffer row cf(p) = back row p.
    auto fin = work_.payload(exec, "combine_final", type, width, nf);
    auto cf = h.canonical_from;
    Impl::scatter_rows(exec, back, KOKKOS_LAMBDA(index_t p)->index_t { return cf(p); }, fin, "KokkosMoE::HierarchicalExchange::uncanonical");

    // Reverse stage 3: final ranks return stage-3 rows to their relays.
    auto s3_back = work_.payload(exec, "s3_back", type, width, total(s3.send_counts));
    {
      auto agreed = agree_counts(node, s3.recv_counts, r3, &s3.send_counts, "hierarchical combine stage 3 counts", options_);
      (void)agreed;
      auto src = suffix(fin, kept);
      transport_.alltoallv(exec, node, {RowSet<MemorySpace>{src.bytes, s3_back.bytes}}, s3.recv_counts, s3.send_counts,
                     "hierarchical combine stage 3 rows", options_);
      StageLedger st{"relay gather (reverse of relay scatter)", node.name()};
      add_sends(st, s3.recv_counts, node.peer_order(), me, nor, back.row_bytes(), 0);
      st.seconds = lap();
      h.ledger.combine.stages.push_back(st);
    }
    // Undo stage 3's permutation: relay rows back in stage-2 arrival order.
    auto s2_in_back = work_.payload(exec, "s2_in_back", type, width, s3.input_rows);
    {
      auto perm3 = s3.send_perm;
      Impl::scatter_rows(exec, s3_back, KOKKOS_LAMBDA(index_t p)->index_t { return perm3(p); }, s2_in_back,
                         "KokkosMoE::HierarchicalExchange::unpermute3");
    }
    // Reverse stage 2 between relays.
    index_t const transit_out = s1.recv_counts.empty() ? 0 : total(s1.recv_counts) - kept;
    auto s2_back = work_.payload(exec, "s2_back", type, width, transit_out);
    {
      StageLedger st{"relay to relay (reverse)", comms.is_relay() ? comms.relay().name() : std::string("-")};
      if (comms.is_relay()) {
        auto const& rc = comms.relay();
        agree_counts(rc, s2.recv_counts, s2_in_back.rows(), &s2.send_counts, "hierarchical combine stage 2 counts", options_);
        transport_.alltoallv(exec, rc, {RowSet<MemorySpace>{s2_in_back.bytes, s2_back.bytes}}, s2.recv_counts, s2.send_counts,
                       "hierarchical combine stage 2 rows", options_);
        add_sends(st, s2.recv_counts, rc.peer_order(), me, nor, back.row_bytes(), 0);
      }
      st.seconds = lap();
      h.ledger.combine.stages.push_back(st);
    }
    // Rebuild stage-1 arrival order: transit rows from stage 2, kept rows from
    // the final buffer (stage 2's send order put transit first, kept last).
    index_t const r1 = total(s1.recv_counts);
    auto s1_recv_back = work_.payload(exec, "s1_recv_back", type, width, r1);
    {
      auto perm2 = s2.send_perm;
      Impl::scatter_rows(exec, s2_back, KOKKOS_LAMBDA(index_t p)->index_t { return perm2(p); }, s1_recv_back,
                         "KokkosMoE::HierarchicalExchange::unpermute2_transit");
      auto kept_rows = prefix(fin, kept);
      Impl::scatter_rows(exec, kept_rows, KOKKOS_LAMBDA(index_t p)->index_t { return perm2(transit_out + p); }, s1_recv_back,
                         "KokkosMoE::HierarchicalExchange::unpermute2_kept");
    }
    // Reverse stage 1: everything back to the origins, then undo the permutation.
    auto s1_back = work_.payload(exec, "s1_back", type, width, s1.input_rows);
    {
      agree_counts(node, s1.recv_counts, r1, &s1.send_counts, "hierarchical combine stage 1 counts", options_);
      transport_.alltoallv(exec, node, {RowSet<MemorySpace>{s1_recv_back.bytes, s1_back.bytes}}, s1.recv_counts, s1.send_counts,
                     "hierarchical combine stage 1 rows", options_);
      StageLedger st{"return from relay + node-local direct", node.name()};
      add_sends(st, s1.recv_counts, node.peer_order(), me, nor, back.row_bytes(), 0);
      h.ledger.combine.stages.push_back(st);
    }
    auto& return_stage = h.ledger.combine.stages.back();
    // The reverse stages move the same relay rows as their dispatch mirrors
    // (attributed to this rank's dispatch role; sums over ranks agree).
    auto const& d = h.ledger.dispatch.stages;
    auto& c = h.ledger.combine.stages;
    for (std::size_t i = 0; i < c.size() && i < d.size(); ++i) {
      c[i].relay_rows = d[d.size() - 1 - i].relay_rows;
      c[i].relay_bytes = c[i].relay_rows * back.row_bytes();
    }
    auto returned = work_.payload(exec, "hier_returned", type, width, s1.input_rows);
    auto perm1 = s1.send_perm;
    Impl::scatter_rows(exec, s1_back, KOKKOS_LAMBDA(index_t p)->index_t { return perm1(p); }, returned,
                       "KokkosMoE::HierarchicalExchange::unpermute1");
    return_stage.seconds = lap();
    h.ledger.combine.useful_rows = h.plan.rows();
    h.combined = true;
    return returned;
  }

  Topology::CommunicatorSet const& communicators() const { return *comms_; }

  // Implementation helpers. They are public only because CUDA forbids
  // extended device lambdas inside private member functions.
  static index_t total(std::vector<index_t> const& v) {
    index_t t = 0;
    for (auto x : v) t += x;
    return t;
  }

  /// Stable sort of a stage's rows by destination key; the record's send
  /// counts are the key buckets.
  template <class Exec>
  StageRecord<MemorySpace> sort_stage(Exec const& exec, Kokkos::View<int*, MemorySpace> const& keys, int num_keys,
                                      char const* stage_name) {
    StageRecord<MemorySpace> s;
    s.name = stage_name;
    s.send_perm = Kokkos::View<index_t*, MemorySpace>(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Hier::perm"),
                                                      keys.extent(0));
    Kokkos::View<index_t*, MemorySpace> off("KokkosMoE::Hier::offsets", num_keys + 1);
    KokkosMoE::Impl::stable_counting_sort(exec, keys, num_keys, s.send_perm, off, "KokkosMoE::HierarchicalExchange::sort");
    auto ho = Impl::host_vector(off);
    s.send_counts.resize(static_cast<std::size_t>(num_keys));
    for (int k = 0; k < num_keys; ++k) s.send_counts[k] = ho[k + 1] - ho[k];
    return s;
  }

  /// Rows and metadata gathered into send order (first `count` positions).
  template <class Exec>
  std::pair<PayloadBuffer<MemorySpace>, Kokkos::View<RowMeta*, MemorySpace>> permuted(
      Exec const& exec, PayloadBuffer<MemorySpace> const& rows, Kokkos::View<RowMeta*, MemorySpace> const& meta,
      Kokkos::View<index_t*, MemorySpace> const& perm, index_t count, std::string const& key) {
    auto out = work_.payload(exec, key, rows.type, rows.width, count);
    auto out_meta = work_.meta(exec, key + "_meta", count);
    gather_rows(exec, rows, KOKKOS_LAMBDA(index_t p)->index_t { return perm(p); }, out, "KokkosMoE::HierarchicalExchange::permute");
    Impl::gather_meta(exec, meta, KOKKOS_LAMBDA(index_t p)->index_t { return perm(p); }, out_meta,
                      "KokkosMoE::HierarchicalExchange::permute_meta");
    return {out, out_meta};
  }

  /// One dispatch stage's transport: the first `count` rows of the stage's
  /// sorted order (rows and metadata) go to their peers of comm after the
  /// counts are agreed; returns what arrived and records the receive counts.
  template <class Exec>
  std::pair<PayloadBuffer<MemorySpace>, Kokkos::View<RowMeta*, MemorySpace>> move_rows(
      Exec const& exec, Topology::Communicator const& comm, StageRecord<MemorySpace>& stage, PayloadBuffer<MemorySpace> const& rows,
      Kokkos::View<RowMeta*, MemorySpace> const& meta, index_t count, std::string const& key, std::string const& what) {
    auto [out, out_meta] = permuted(exec, rows, meta, stage.send_perm, count, key + "_send");
    stage.recv_counts = agree_counts(comm, stage.send_counts, count, nullptr, (what + " counts").c_str(), options_).recv;
    index_t const n = total(stage.recv_counts);
    auto recv = work_.payload(exec, key + "_recv", rows.type, rows.width, n);
    auto recv_meta = work_.meta(exec, key + "_recv_meta", n);
    transport_.alltoallv(exec, comm, {RowSet<MemorySpace>{out.bytes, recv.bytes}, RowSet<MemorySpace>{as_rows(out_meta), as_rows(recv_meta)}},
                         stage.send_counts, stage.recv_counts, (what + " rows").c_str(), options_);
    return {recv, recv_meta};
  }

  static PayloadBuffer<MemorySpace> prefix(PayloadBuffer<MemorySpace> const& b, index_t n) {
    PayloadBuffer<MemorySpace> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(0, n), Kokkos::ALL);
    return p;
  }
  static PayloadBuffer<MemorySpace> suffix(PayloadBuffer<MemorySpace> const& b, index_t from) {
    PayloadBuffer<MemorySpace> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(from, b.rows()), Kokkos::ALL);
    return p;
  }

  /// Transit rows (destination on another node) among the first n of meta.
  template <class Exec>
  std::int64_t transit_rows(Exec const& exec, Kokkos::View<RowMeta*, MemorySpace> const& meta, index_t n) const {
    auto node_of = node_of_;
    int const my_node = my_node_;
    std::int64_t t = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::count_transit", Kokkos::RangePolicy<Exec>(exec, 0, n),
        KOKKOS_LAMBDA(index_t p, std::int64_t & c) { c += node_of(meta(p).dest_rank) != my_node ? 1 : 0; }, t);
    Compat::fence(exec, "KokkosMoE::HierarchicalExchange: transit count");
    return t;
  }

 private:
  Topology::CommunicatorSet const* comms_;
  TransportOptions options_;
  PlacementRegistry const* registry_;
  std::uint64_t last_generation_ = 0;
  Kokkos::View<int*, MemorySpace> node_of_, node_slot_, ep_slot_;
  Impl::Workspace<MemorySpace> work_;
  TransportContext<Transport, MemorySpace> transport_;
  int my_node_ = -1;
  int my_relay_ = -1;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
