#ifndef KOKKOSMOE_EXCHANGE_HIERARCHICALDEDUP_HPP
#define KOKKOSMOE_EXCHANGE_HIERARCHICALDEDUP_HPP

/// \file KokkosMoE_Exchange_HierarchicalDedup.hpp
/// \brief Hierarchical relay exchange with node deduplication
/// (Algorithm::hierarchical_dedup): a token selected by several experts of
/// one remote node crosses the inter-node link once, and that node's relay
/// returns one gated partial sum per token.
///
/// Dispatch. Rows for ranks of the own node go straight to them, one row
/// per route (stage 1, node-local communicator). For every token and every
/// other node its routes reach, the origin builds one unit: the token's row
/// once, plus a record of those routes (destination rank, physical slot,
/// route id, gate: UnitMeta), in (node, token) order, and sends it to its
/// node's relay of its rail (stage 1; a rank that is its own relay keeps
/// its units in place). The relay forwards each unit to the destination
/// node's relay of the same rail (stage 2, relay communicator; one message
/// per relay pair), which expands it into one row per route for the ranks
/// of its node (stage 3, node-local; the relay's own rows are written where
/// they arrive). Every rank then restores the flat exchange's arrival
/// order (by origin, then the origin's send order) and repacks into its
/// expert rows: the handle delivers exactly the flat exchange's expert rows.
///
/// Combine. Results of own-node routes return one row per route. At a
/// destination relay, the results of a unit's routes come back from the
/// ranks of its node (reverse of stage 3), and the relay sums them, in the
/// unit's route order (the token's k-slot order), gate times result in
/// FP32 from zero, into one row per unit (encoded in the return payload);
/// that row goes back through both relays (reverse of stages 2 and 1) to
/// the origin, which writes it into the return buffer's row of the unit's
/// first route. The handle's combine_route_index and combine_gate tell
/// combine() to add that row once with weight 1 and to skip the unit's
/// other routes; routes of the own node keep their gates. So a token's
/// output is, in k-slot order, gate * result for every own-node route and
/// the node's partial sum at the k-slot of each remote node's first route.
///
/// Bits. With one node no unit exists and the output is the flat
/// exchange's, bit for bit. Across nodes the summation tree differs from
/// the flat combine's (a node's routes are summed first, and the partial
/// is rounded to the return payload once more), so outputs agree with the
/// flat exchange's within rounding; they are deterministic: the same bits
/// on every run and every rank count with the same node layout and routes.
///
/// Every count round carries the counts of one stage (stage 1 announces
/// direct and unit rows together); every transfer moves one contiguous
/// message of rows and one of metadata per peer, over the MPI or the NCCL
/// transport. The relays copy units once (stage 2 orders them by
/// destination node) and expand them (stage 3). The backward of a layer
/// moves one row per route (HierarchicalExchange).

#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_CountingSort.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

#include <memory>
#include <utility>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class HierarchicalDedupExchange : public Impl::ExchangeBase<ExecutionSpace, MemorySpace> {
  using base = Impl::ExchangeBase<ExecutionSpace, MemorySpace>;
  using Exec = ExecutionSpace;
  using MS = MemorySpace;
  using meta_view = Kokkos::View<RowMeta*, MS>;
  using index_view = Kokkos::View<index_t*, MS>;
  using unit_view = Kokkos::View<std::int32_t**, Kokkos::LayoutRight, MS>;
  using bytes_view = typename RowSet<MS>::rows_view;

 public:
  static constexpr Algorithm algorithm = Algorithm::hierarchical_dedup;

  /// \brief What a dispatch keeps for its combine (the handle's state).
  struct State {
    int k = 1;
    // Origin: own-node rows (one per route) and units.
    std::vector<index_t> d1_send, d1_recv;     ///< per node peer
    index_t d1_self_send = 0, d1_self_recv = 0;  ///< first row of the own segment on each side
    std::vector<std::pair<index_t, index_t>> d1_plan_runs;  ///< per node peer: its plan positions (first, rows)
    index_view unit_rep;                        ///< per unit of this origin: the plan position of its first route
    std::vector<index_t> u1_send, u1_recv;      ///< units per node peer
    std::vector<std::int64_t> u1_send_routes, u1_recv_routes;
    index_t u1_self_recv = 0;                   ///< first own unit among the stage-1 unit arrivals
    // Relay, stage 2: units by destination node.
    std::vector<index_t> s2_send, s2_recv;      ///< per relay peer
    std::vector<std::int64_t> s2_send_routes, s2_recv_routes;
    index_view s2_perm;                         ///< stage-2 send position -> stage-1 unit arrival
    // Relay, stage 3: the units of other nodes expanded into routes.
    std::vector<index_t> s3_send, s3_recv;      ///< per node peer
    index_t s3_self_send = 0, s3_self_recv = 0;
    Kokkos::View<index_t**, Kokkos::LayoutRight, MS> unit_exp;  ///< [stage-2 unit, route]: stage-3 send position (-1 none)
    Kokkos::View<float**, Kokkos::LayoutRight, MS> unit_gate;   ///< [stage-2 unit, route]: its gate
    // Final rank: arrivals = own-node rows, then stage-3 rows.
    index_t n_d1 = 0;
    index_view canonical_from;                 ///< flat arrival position -> arrival (own-node rows first)
  };

  /// \brief What a dispatch in flight keeps until dispatch_finish.
  struct Flight {
    PayloadBuffer<MS> d1;   ///< own-node rows that arrived
    meta_view d1_meta;
    std::shared_ptr<RowsInFlight> direct{};
    PayloadBuffer<MS> s2;   ///< relay: units from other nodes (written when the flight finishes)
    unit_view s2_meta;
  };

  /// \brief What a combine in flight keeps until combine_finish.
  struct CombineFlight {
    PayloadBuffer<MS> d1_back;  ///< results of own-node rows, to their origins
    PayloadBuffer<MS> s2_ret;   ///< relay: partial sums back from other nodes' relays
  };

  HierarchicalDedupExchange(Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config = {},
                            PlacementRegistry const* registry = nullptr)
      : base(algorithm, comms, std::move(placement), config, registry) {
    auto const& topo = comms.topology();
    int const N = topo.size();
    std::vector<int> group_slot(static_cast<std::size_t>(N), -1), ep_slot(static_cast<std::size_t>(N));
    for (auto const& g : comms.layout().node_groups)
      for (std::size_t i = 0; i < g.size(); ++i) group_slot[static_cast<std::size_t>(g[i])] = static_cast<int>(i);
    for (int r = 0; r < N; ++r) ep_slot[static_cast<std::size_t>(r)] = comms.ep().slot_of(r);
    node_of_ = Impl::device_vector<MS>(this->node_of_rank_, "KokkosMoE::HierarchicalDedupExchange::node_of");
    group_slot_ = Impl::device_vector<MS>(group_slot, "KokkosMoE::HierarchicalDedupExchange::group_slot");
    ep_slot_ = Impl::device_vector<MS>(ep_slot, "KokkosMoE::HierarchicalDedupExchange::ep_slot");
    my_node_ = topo.node_of(this->me_);
    my_relay_ = Topology::relay_for(topo, comms.layout(), this->me_, my_node_);
    // A relay's stage-2 peer for every node: that node's relay of its rail.
    std::vector<int> relay_peer(static_cast<std::size_t>(topo.num_nodes()), -1);
    if (comms.is_relay())
      for (int n = 0; n < topo.num_nodes(); ++n)
        relay_peer[static_cast<std::size_t>(n)] =
            comms.relay().slot_of(comms.layout().relays[static_cast<std::size_t>(n)][static_cast<std::size_t>(comms.relay_rail())]);
    relay_peer_ = Impl::device_vector<MS>(relay_peer, "KokkosMoE::HierarchicalDedupExchange::relay_peer");
    // This rank's local index of every physical slot (-1: another rank's).
    std::vector<int> local(static_cast<std::size_t>(this->placement_.num_slots()), -1);
    auto const& mine = this->placement_.slots_of_rank(this->me_);
    for (std::size_t q = 0; q < mine.size(); ++q) local[static_cast<std::size_t>(mine[q])] = static_cast<int>(q);
    local_slot_ = Impl::device_vector<MS>(local, "KokkosMoE::HierarchicalDedupExchange::local_slot");
  }

  int waves() const { return 1; }

  /// \brief Collective over the EP communicator; the handle delivers the
  /// flat exchange's expert rows (see the file's description).
  template <class T>
  DispatchHandle<T, MS> dispatch(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                 RowMatrix<T, MS> const& hidden, int wave = 0) {
    auto h = dispatch_start(exec, routes, plan, hidden, wave);
    dispatch_finish(exec, h);
    return h;
  }

  /// \brief Stage 1, and stage 2 posted: the handle is in flight until
  /// dispatch_finish (the units still crossing between relays).
  template <class T>
  DispatchHandle<T, MS> dispatch_start(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                       RowMatrix<T, MS> const& hidden, int wave = 0) {
    Kokkos::Timer timer;
    Impl::Lap<Exec> lap(exec);
    auto h = this->template new_handle<T>(routes, plan, wave);
    int const d = static_cast<int>(hidden.extent(1));
    h.ledger = this->new_ledger(d);
    State st;
    st.k = std::max(1, routes.top_k);
    Flight f;
    stage1(exec, st, f, h, routes, plan, hidden);
    h.ledger.dispatch.stages.back().seconds = lap();
    stage2(exec, st, f, h);
    h.ledger.dispatch.stages.back().seconds = lap();
    h.state = std::move(st);
    h.pending = std::move(f);
    h.seconds = timer.seconds();
    return h;
  }

  /// \brief Waits for the units, expands them (stage 3), restores the flat
  /// arrival order and fills the expert rows; the handle is then delivered.
  template <class T>
  void dispatch_finish(Exec const& exec, DispatchHandle<T, MS>& h) {
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(!h.delivered && h.pending.has_value(), "hierarchical_dedup dispatch_finish: the handle is not a dispatch in flight");
    Impl::Lap<Exec> lap(exec);
    h.flight.finish();
    auto f = std::any_cast<Flight>(h.pending);
    h.pending.reset();
    State& st = std::any_cast<State&>(h.state);
    h.ledger.dispatch.stages.back().seconds += lap();  // stage 2 completing
    stage3(exec, st, f, h);
    h.ledger.dispatch.stages.back().seconds = lap();
    h.seconds += timer.seconds();
    h.ledger.dispatch.useful_rows = h.repack.rows();
    h.delivered = true;
  }

  /// \brief The reverse of the dispatch, with the relays' partial sums;
  /// see FlatExchange::combine for the contract. The return buffer holds
  /// one row per own-node route and one per unit (at its first route):
  /// read it through combine_routes(routes, h).
  template <class T>
  void combine(Exec const& exec, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
               std::string const& local_problem = {}) {
    combine_start(exec, h, expert_out, returned, local_problem);
    combine_finish(exec, h);
  }

  /// \brief Results back to their relays and own-node origins, the relays'
  /// partial sums, and the reverse of stage 2 posted.
  template <class T>
  void combine_start(Exec const& exec, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
                     std::string const& local_problem = {}) {
    auto const& comms = *this->comms_;
    Kokkos::Timer timer;
    Impl::Lap<Exec> lap(exec);
    State const* st = std::any_cast<State>(&h.state);
    std::string problem = local_problem.empty() ? this->combine_problem(h, expert_out, returned) : local_problem;
    if (problem.empty() && !st) problem = "hierarchical_dedup combine: the handle carries no dedup stages";
    agree(comms.ep().comm(), problem, "hierarchical_dedup combine", this->config_.watchdog_seconds);
    h.combine_started = true;
    int const d = static_cast<int>(h.expert_rows.extent(1));
    this->set_combine_format(h.ledger, d);
    h.ledger.combine.stages.clear();
    CombineFlight f;
    reverse_stage3(exec, *st, h, expert_out, returned, f, lap);
    h.pending = std::move(f);
    h.pending_returned = returned;
    h.ledger.combine.useful_rows = h.plan.rows();
    h.seconds = timer.seconds();
  }

  /// \brief Waits for the partial sums, returns them and the own-node
  /// results to their origins (reverse of stage 1) into the return buffer.
  template <class T>
  void combine_finish(Exec const& exec, DispatchHandle<T, MS>& h) {
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(h.combine_started && !h.combined && h.pending.has_value(),
                      "hierarchical_dedup combine_finish: the handle is not a combine in flight");
    Impl::Lap<Exec> lap(exec);
    h.flight.finish();
    auto const f = std::any_cast<CombineFlight>(h.pending);
    h.pending.reset();
    State const& st = std::any_cast<State const&>(h.state);
    h.ledger.combine.stages.back().seconds += lap();  // reverse stage 2 completing
    reverse_stage1(exec, st, f, h.pending_returned, h.ledger);
    h.pending_returned = {};
    Compat::fence(exec, "KokkosMoE::HierarchicalDedupExchange::combine");
    h.ledger.combine.stages.back().seconds = lap();
    h.seconds += timer.seconds();
    h.combined = true;
  }

  static std::vector<ByteLedger> plan(PlanInput const& in) { return plan_hierarchical_dedup(in); }

  // Stages. They are public only because CUDA forbids extended device
  // lambdas inside private member functions; they are not part of the
  // interface.

  /// Stage 1: own-node rows to their ranks and units to the relay, after
  /// one count round over the node-local communicator (both counts per
  /// peer) and one agreement over EP (a local problem fails every rank).
  template <class T>
  void stage1(Exec const& exec, State& st, Flight& f, DispatchHandle<T, MS>& h, RoutePlan<MS> const& routes,
              DispatchPlan<MS> const& plan, RowMatrix<T, MS> const& hidden) {
    auto const& comms = *this->comms_;
    auto const& ep = comms.ep();
    auto const& node = comms.node_local();
    int const S = node.size();
    auto const Su = static_cast<std::size_t>(S);
    int const me_slot = node.my_slot();
    int const relay_slot = node.slot_of(my_relay_);
    int const d = static_cast<int>(hidden.extent(1));
    int const k = st.k;
    int const W = UnitMeta::ints(k);
    auto const type = this->config_.payload;
    // Own-node rows: per node peer, its segment of the plan (EP order).
    st.d1_send.assign(Su, 0);
    st.d1_plan_runs.assign(Su, {0, 0});
    std::vector<index_t> seg_first(Su + 1, 0), seg_plan(Su, 0);
    std::string problem = problem_of([&] {
      this->check_dispatch(h, hidden, waves());
      KOKKOSMOE_REQUIRE(routes.top_k >= 1 || routes.size() == 0, "hierarchical_dedup dispatch: top_k " << routes.top_k);
    });
    for (int x = 0; x < S && problem.empty(); ++x) {
      auto const e = static_cast<std::size_t>(ep.slot_of(node.global_rank(x)));
      st.d1_send[static_cast<std::size_t>(x)] = plan.counts[e];
      st.d1_plan_runs[static_cast<std::size_t>(x)] = {plan.offsets[e], plan.counts[e]};
      seg_plan[static_cast<std::size_t>(x)] = plan.offsets[e];
      seg_first[static_cast<std::size_t>(x) + 1] = seg_first[static_cast<std::size_t>(x)] + plan.counts[e];
    }
    index_t const n_direct = seg_first[Su];
    st.d1_self_send = seg_first[static_cast<std::size_t>(me_slot)];
    // Units, in (node, token) order.
    index_t const Tn = routes.num_tokens;
    int const nodes = comms.topology().num_nodes();
    index_t const U_max = Tn * std::min(k, std::max(0, nodes - 1));
    auto unit_token = this->work_.template vector<int>(exec, "unit_token", U_max);
    auto unit_node = this->work_.template vector<int>(exec, "unit_node", U_max);
    index_t U = 0;
    if (problem.empty()) problem = problem_of([&] { U = find_units(exec, routes, unit_token, unit_node); });
    // One count round: per peer its own-node rows and its units.
    st.u1_send.assign(Su, 0);
    if (U > 0 && relay_slot >= 0) st.u1_send[static_cast<std::size_t>(relay_slot)] = U;
    std::vector<index_t> split(Su);
    RowRuns announce(Su);
    for (std::size_t x = 0; x < Su; ++x) {
      split[x] = st.d1_send[x] + st.u1_send[x];
      announce[x] = {{0, st.d1_send[x]}, {0, st.u1_send[x]}};
    }
    AgreedCounts agreed1;
    problem = problem_of([&] {
      agreed1 = agree_counts_and_every_run(node, split, n_direct + U, announce, 2, 2, "hierarchical_dedup dispatch stage 1 counts",
                                           this->options(), problem);
    });
    agree(ep.comm(), problem, "hierarchical_dedup dispatch", this->config_.watchdog_seconds);
    st.d1_recv.assign(Su, 0);
    st.u1_recv.assign(Su, 0);
    for (std::size_t x = 0; x < Su; ++x) {
      st.d1_recv[x] = agreed1.recv_run_lengths[x][0];
      st.u1_recv[x] = agreed1.recv_run_lengths[x][1];
    }
    st.d1_self_recv = 0;
    st.u1_self_recv = 0;
    for (int x = 0; x < me_slot; ++x) {
      st.d1_self_recv += st.d1_recv[static_cast<std::size_t>(x)];
      st.u1_self_recv += st.u1_recv[static_cast<std::size_t>(x)];
    }
    index_t const n_d1 = Impl::total(st.d1_recv), n_u1 = Impl::total(st.u1_recv);
    // Own-node rows: packed from hidden in node-peer order, the own ones
    // straight among the arrivals; their metadata alike.
    auto d1_send = payload_buffer(this->work_, exec, "d1_send", type, d, n_direct);
    auto d1_send_meta = this->work_.template vector<RowMeta>(exec, "d1_send_meta", n_direct);
    f.d1 = payload_buffer(this->work_, exec, "d1_recv", type, d, n_d1);
    f.d1_meta = this->work_.template vector<RowMeta>(exec, "d1_recv_meta", n_d1);
    {
      auto seg_first_d = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::d1_segments", seg_first);
      auto seg_plan_d = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::d1_plan", seg_plan);
      auto perm = plan.perm;
      auto token = routes.token;
      auto slot = routes.slot;
      auto dest = routes.dest_rank;
      auto kslot = routes.kslot;
      int const origin = this->me_;
      index_t const self_lo = st.d1_self_send, self_hi = self_lo + st.d1_send[static_cast<std::size_t>(me_slot)];
      index_t const self_at = st.d1_self_recv;
      auto route_of = [=] KOKKOS_FUNCTION(index_t i) {
        int const x = Impl::segment_of(seg_first_d, S, i);
        return perm(seg_plan_d(x) + (i - seg_first_d(x)));
      };
      auto d1_meta = f.d1_meta;
      Kokkos::parallel_for(
          "KokkosMoE::HierarchicalDedupExchange::d1_meta", Kokkos::RangePolicy<Exec>(exec, 0, n_direct), KOKKOS_LAMBDA(index_t i) {
            index_t const a = route_of(i);
            RowMeta const m{slot(a), dest(a), origin, static_cast<std::int32_t>(token(a) * k + kslot(a))};
            if (i >= self_lo && i < self_hi)
              d1_meta(self_at + (i - self_lo)) = m;
            else
              d1_send_meta(i) = m;
          });
      gather_rows(
          exec, hidden, KOKKOS_LAMBDA(index_t i)->index_t { return i >= self_lo && i < self_hi ? index_t(-1) : index_t(token(route_of(i))); },
          d1_send, "KokkosMoE::HierarchicalDedupExchange::pack");
      gather_rows(
          exec, hidden, KOKKOS_LAMBDA(index_t i)->index_t { return token(route_of(self_lo + i)); },
          rows_of(f.d1, self_at, self_hi - self_lo), "KokkosMoE::HierarchicalDedupExchange::pack_own");
    }
    f.direct = std::make_shared<RowsInFlight>(this->transport_->start_alltoallv(
        exec, node,
        {RowSet<MS>{d1_send.bytes, f.d1.bytes, {}, {}, /*self_in_place=*/true},
         in_place(record_rows(d1_send_meta, f.d1_meta))},
        st.d1_send, st.d1_recv, "hierarchical_dedup dispatch stage 1 own-node rows", this->options()));
    // Units: to the relay, or (a rank that is its own relay) straight
    // among the unit arrivals.
    bool const own_relay = my_relay_ == this->me_;
    auto u1_send = payload_buffer(this->work_, exec, "u1_send", type, d, own_relay ? 0 : U);
    auto u1_send_meta = this->work_.template matrix<std::int32_t>(exec, "u1_send_meta", own_relay ? 0 : U, static_cast<std::size_t>(W));
    f.s2 = payload_buffer(this->work_, exec, "u1_recv", type, d, n_u1);  // stage-1 unit arrivals (relays), forwarded in stage 2
    f.s2_meta = this->work_.template matrix<std::int32_t>(exec, "u1_recv_meta", n_u1, static_cast<std::size_t>(W));
    auto const place = own_relay ? rows_of(f.s2, st.u1_self_recv, U) : u1_send;
    unit_view const place_meta = own_relay ? unit_view(Kokkos::subview(f.s2_meta, std::make_pair(st.u1_self_recv, st.u1_self_recv + U),
                                                                       Kokkos::ALL))
                                           : u1_send_meta;
    st.unit_rep = this->work_.template vector<index_t>(exec, "unit_rep", U);
    fill_units(exec, routes, plan, unit_token, unit_node, U, place_meta, st.unit_rep);
    gather_rows(
        exec, hidden, KOKKOS_LAMBDA(index_t u)->index_t { return unit_token(u); }, place, "KokkosMoE::HierarchicalDedupExchange::pack_units");
    combine_routes_of(exec, routes, h);
    std::int64_t const unit_routes = U > 0 ? sum_routes(exec, place_meta, U) : 0;
    st.u1_send_routes.assign(Su, 0);
    if (relay_slot >= 0) st.u1_send_routes[static_cast<std::size_t>(relay_slot)] = unit_routes;
    // A rank that is its own relay sends nothing: its units are in place
    // (the arrivals stand in for the send rows the transport never reads).
    this->transport_->alltoallv(exec, node,
                                {RowSet<MS>{own_relay ? f.s2.bytes : u1_send.bytes, f.s2.bytes, {}, {}, /*self_in_place=*/true},
                                 in_place(unit_rows(own_relay ? f.s2_meta : u1_send_meta, f.s2_meta))},
                                st.u1_send, st.u1_recv, "hierarchical_dedup dispatch stage 1 units", this->options());
    st.u1_recv_routes = routes_per_segment(exec, f.s2_meta, st.u1_recv);
    StageLedger sl{"gather to relay + node-local direct", node.name()};
    sl.self_in_place = true;
    add_sends(sl, st.d1_send, node.peer_order(), this->me_, this->node_of_rank_, d1_send.row_bytes(), sizeof(RowMeta));
    add_sends(sl, st.u1_send, node.peer_order(), this->me_, this->node_of_rank_, d1_send.row_bytes(), UnitMeta::bytes(k), nullptr,
              nullptr, &st.u1_send_routes);
    if (!own_relay) {
      sl.relay_rows += U;
      sl.relay_bytes += U * (d1_send.row_bytes() + UnitMeta::bytes(k));
    }
    h.ledger.dispatch.stages.push_back(sl);
  }

  /// Stage 2 (relays): the units of the node's origins to the relays of
  /// their destination nodes, ordered by destination node (one copy),
  /// posted; units at a rank that is not a relay, or for the own node,
  /// fail every rank.
  template <class T>
  void stage2(Exec const& exec, State& st, Flight& f, DispatchHandle<T, MS>& h) {
    auto const& comms = *this->comms_;
    int const k = st.k;
    int const W = UnitMeta::ints(k);
    index_t const n1 = f.s2.rows();
    bool const relay = comms.is_relay();
    int const R = relay ? comms.relay().size() : 0;
    auto u1 = f.s2;
    auto u1_meta = f.s2_meta;
    auto keys = this->work_.template vector<int>(exec, "s2_keys", n1);
    index_t misrouted = 0;
    {
      auto node_of = node_of_;
      auto relay_peer = relay_peer_;
      int const my_node = my_node_;
      Kokkos::parallel_reduce(
          "KokkosMoE::HierarchicalDedupExchange::stage2_keys", Kokkos::RangePolicy<Exec>(exec, 0, n1),
          KOKKOS_LAMBDA(index_t i, index_t & bad) {
            int const dst = u1_meta(i, UnitMeta::header + 1);
            int const n = dst >= 0 ? node_of(dst) : my_node;
            int const peer = n == my_node ? -1 : relay_peer(n);
            if (peer < 0) ++bad;
            keys(i) = peer < 0 ? 0 : peer;
          },
          misrouted);
    }
    agree(comms.ep().comm(), problem_of([&] {
            KOKKOSMOE_REQUIRE(relay || n1 == 0, n1 << " units arrived at rank " << this->me_ << ", which is not a relay");
            KOKKOSMOE_REQUIRE(misrouted == 0, misrouted << " units at relay " << this->me_ << " are for its own node or no node");
          }),
          "hierarchical_dedup relay check", this->config_.watchdog_seconds);
    StageLedger sl{"relay to relay", relay ? comms.relay().name() : std::string("-")};
    st.s2_send.assign(static_cast<std::size_t>(R), 0);
    st.s2_recv.assign(static_cast<std::size_t>(R), 0);
    f.s2 = payload_buffer(this->work_, exec, "s2_none", u1.type, u1.width, 0);
    f.s2_meta = unit_view();
    if (relay) {
      auto const& rc = comms.relay();
      st.s2_perm = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::s2_perm", n1);
      auto const off = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::s2_offsets", R + 1);
      stable_counting_sort(exec, keys, R, st.s2_perm, off, "KokkosMoE::HierarchicalDedupExchange::s2_sort", &this->work_);
      auto const ho = Impl::host_vector(exec, off);
      for (int p = 0; p < R; ++p) st.s2_send[static_cast<std::size_t>(p)] = ho[static_cast<std::size_t>(p) + 1] - ho[static_cast<std::size_t>(p)];
      auto send = payload_buffer(this->work_, exec, "s2_send", u1.type, u1.width, n1);
      auto send_meta = this->work_.template matrix<std::int32_t>(exec, "s2_send_meta", n1, static_cast<std::size_t>(W));
      auto perm = st.s2_perm;
      gather_rows(exec, u1, KOKKOS_LAMBDA(index_t p)->index_t { return perm(p); }, send, "KokkosMoE::HierarchicalDedupExchange::s2_pack");
      Kokkos::parallel_for(
          "KokkosMoE::HierarchicalDedupExchange::s2_pack_meta", Kokkos::RangePolicy<Exec>(exec, 0, n1), KOKKOS_LAMBDA(index_t p) {
            for (int c = 0; c < W; ++c) send_meta(p, c) = u1_meta(perm(p), c);
          });
      st.s2_send_routes = routes_per_segment(exec, send_meta, st.s2_send);
      st.s2_recv = agree_counts(rc, st.s2_send, n1, nullptr, "hierarchical_dedup dispatch stage 2 counts", this->options()).recv;
      index_t const n2 = Impl::total(st.s2_recv);
      f.s2 = payload_buffer(this->work_, exec, "s2_recv", u1.type, u1.width, n2);
      f.s2_meta = this->work_.template matrix<std::int32_t>(exec, "s2_recv_meta", n2, static_cast<std::size_t>(W));
      h.flight = this->transport_->start_alltoallv(exec, rc, {RowSet<MS>{send.bytes, f.s2.bytes}, unit_rows(send_meta, f.s2_meta)},
                                                   st.s2_send, st.s2_recv, "hierarchical_dedup dispatch stage 2 units", this->options());
      add_sends(sl, st.s2_send, rc.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), UnitMeta::bytes(k), nullptr, nullptr,
                &st.s2_send_routes);
    }
    h.ledger.dispatch.stages.push_back(sl);
  }

  /// Stage 3: relays expand the units of other nodes into one row per
  /// route for the ranks of their node; then every rank restores the flat
  /// arrival order and fills its expert rows.
  template <class T>
  void stage3(Exec const& exec, State& st, Flight& f, DispatchHandle<T, MS>& h) {
    auto const& comms = *this->comms_;
    auto const& node = comms.node_local();
    int const S = node.size();
    auto const Su = static_cast<std::size_t>(S);
    int const k = st.k;
    int const me_slot = node.my_slot();
    index_t const n2 = f.s2.rows();
    if (comms.is_relay()) st.s2_recv_routes = routes_per_segment(exec, f.s2_meta, st.s2_recv);
    // Expanded rows: route i of unit u at e = first(u) + i.
    auto const first = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::unit_first", n2 + 1);
    auto s2_meta = f.s2_meta;
    index_t n3 = 0;
    Kokkos::parallel_scan(
        "KokkosMoE::HierarchicalDedupExchange::expand_offsets", Kokkos::RangePolicy<Exec>(exec, 0, n2 + 1),
        KOKKOS_LAMBDA(index_t u, index_t & run, bool final) {
          if (final) first(u) = run;
          if (u < n2) run += s2_meta(u, 1);
        },
        n3);
    Compat::fence(exec, "KokkosMoE::HierarchicalDedupExchange: expanded rows");
    auto keys = this->work_.template vector<int>(exec, "s3_keys", n3);
    index_t foreign = 0;
    {
      auto node_of = node_of_;
      auto group_slot = group_slot_;
      int const my_node = my_node_;
      Kokkos::parallel_reduce(
          "KokkosMoE::HierarchicalDedupExchange::stage3_keys", Kokkos::RangePolicy<Exec>(exec, 0, n2),
          KOKKOS_LAMBDA(index_t u, index_t & bad) {
            int const n = s2_meta(u, 1);
            if (n < 1 || n > k) ++bad;
            for (int i = 0; i < n && i < k; ++i) {
              int const dst = s2_meta(u, UnitMeta::header + UnitMeta::per_route * i + 1);
              bool const ok = dst >= 0 && node_of(dst) == my_node;
              if (!ok) ++bad;
              keys(first(u) + i) = ok ? group_slot(dst) : 0;
            }
          },
          foreign);
    }
    // Send order: by final rank, then arrival order (stable).
    auto const perm = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::s3_perm", n3);
    auto const off = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::s3_offsets", S + 1);
    std::string problem = problem_of([&] {
      KOKKOSMOE_REQUIRE(foreign == 0, foreign << " routes of units at relay " << this->me_ << " of node " << my_node_
                                              << " are for other nodes or malformed");
      stable_counting_sort(exec, keys, S, perm, off, "KokkosMoE::HierarchicalDedupExchange::s3_sort", &this->work_);
    });
    st.s3_send.assign(Su, 0);
    if (problem.empty()) {
      auto const ho = Impl::host_vector(exec, off);
      for (int x = 0; x < S; ++x) st.s3_send[static_cast<std::size_t>(x)] = ho[static_cast<std::size_t>(x) + 1] - ho[static_cast<std::size_t>(x)];
    }
    st.s3_self_send = 0;
    for (int x = 0; x < me_slot; ++x) st.s3_self_send += st.s3_send[static_cast<std::size_t>(x)];
    AgreedCounts agreed;
    problem = problem_of([&] {
      agreed = agree_counts(node, st.s3_send, n3, nullptr, "hierarchical_dedup dispatch stage 3 counts", this->options(), problem);
    });
    // The own-node rows must have come in before the final order is set.
    if (problem.empty()) problem = problem_of([&] { f.direct->finish(); });
    agree(comms.ep().comm(), problem, "hierarchical_dedup dispatch stage 3", this->config_.watchdog_seconds);
    st.s3_recv = agreed.recv;
    st.s3_self_recv = 0;
    for (int x = 0; x < me_slot; ++x) st.s3_self_recv += st.s3_recv[static_cast<std::size_t>(x)];
    index_t const r3 = Impl::total(st.s3_recv);
    // Which unit and route every send position is; its gate and result place for the combine.
    st.unit_exp = this->work_.template get<Kokkos::View<index_t**, Kokkos::LayoutRight, MS>>(exec, "unit_exp", n2, static_cast<std::size_t>(k));
    st.unit_gate = this->work_.template matrix<float>(exec, "unit_gate", n2, static_cast<std::size_t>(k));
    auto unit_exp = st.unit_exp;
    auto unit_gate = st.unit_gate;
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::unit_routes", Kokkos::RangePolicy<Exec>(exec, 0, n2), KOKKOS_LAMBDA(index_t u) {
          int const n = s2_meta(u, 1);
          for (int i = 0; i < k; ++i) {
            unit_exp(u, i) = -1;
            unit_gate(u, i) = 0.0f;
            if (i < n) {
              std::int32_t const bits = s2_meta(u, UnitMeta::header + UnitMeta::per_route * i + 3);
              float g;
              memcpy(&g, &bits, sizeof g);
              unit_gate(u, i) = g;
            }
          }
        });
    auto unit_of = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::s3_unit", n3);
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::s3_positions", Kokkos::RangePolicy<Exec>(exec, 0, n3), KOKKOS_LAMBDA(index_t p) {
          index_t const e = perm(p);
          int const u = Impl::segment_of(first, static_cast<int>(n2), e);
          unit_of(p) = u;
          unit_exp(u, static_cast<int>(e - first(u))) = p;
        });
    // Rows and metadata in send order; the relay's own straight among its arrivals.
    auto const type = f.s2.type;
    int const d = f.s2.width;
    auto s3_send = payload_buffer(this->work_, exec, "s3_send", type, d, n3);
    auto s3_send_meta = this->work_.template vector<RowMeta>(exec, "s3_send_meta", n3);
    auto s3 = payload_buffer(this->work_, exec, "s3_recv", type, d, r3);
    auto fin_meta = this->work_.template vector<RowMeta>(exec, "fin_meta", f.d1.rows() + r3);
    meta_view const s3_meta = Kokkos::subview(fin_meta, std::make_pair(f.d1.rows(), f.d1.rows() + r3));
    index_t const self_lo = st.s3_self_send, self_hi = self_lo + st.s3_send[static_cast<std::size_t>(me_slot)];
    index_t const self_at = st.s3_self_recv;
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::s3_meta", Kokkos::RangePolicy<Exec>(exec, 0, n3), KOKKOS_LAMBDA(index_t p) {
          index_t const u = unit_of(p);
          int const i = static_cast<int>(perm(p) - first(u));
          int const* r = &s2_meta(u, UnitMeta::header + UnitMeta::per_route * i);
          RowMeta const m{r[0], r[1], s2_meta(u, 0), r[2]};
          if (p >= self_lo && p < self_hi)
            s3_meta(self_at + (p - self_lo)) = m;
          else
            s3_send_meta(p) = m;
        });
    gather_rows(
        exec, f.s2, KOKKOS_LAMBDA(index_t p)->index_t { return p >= self_lo && p < self_hi ? index_t(-1) : unit_of(p); }, s3_send,
        "KokkosMoE::HierarchicalDedupExchange::expand");
    gather_rows(
        exec, f.s2, KOKKOS_LAMBDA(index_t i)->index_t { return unit_of(self_lo + i); }, rows_of(s3, self_at, self_hi - self_lo),
        "KokkosMoE::HierarchicalDedupExchange::expand_own");
    this->transport_->alltoallv(exec, node,
                                {RowSet<MS>{s3_send.bytes, s3.bytes, {}, {}, /*self_in_place=*/true},
                                 in_place(record_rows(s3_send_meta, s3_meta))},
                                st.s3_send, st.s3_recv, "hierarchical_dedup dispatch stage 3 rows", this->options());
    StageLedger sl{"relay expand", node.name()};
    sl.self_in_place = true;
    add_sends(sl, st.s3_send, node.peer_order(), this->me_, this->node_of_rank_, s3_send.row_bytes(), sizeof(RowMeta));
    for (int x = 0; x < S; ++x)
      if (node.global_rank(x) != this->me_) sl.relay_rows += st.s3_send[static_cast<std::size_t>(x)];
    sl.relay_bytes = sl.relay_rows * (s3_send.row_bytes() + static_cast<std::int64_t>(sizeof(RowMeta)));
    h.ledger.dispatch.stages.push_back(sl);
    // The flat arrival order: by origin's EP slot, then its send order
    // (by local slot, then route), stable over own-node rows then stage-3 rows.
    st.n_d1 = f.d1.rows();
    if (st.n_d1 > 0) Kokkos::deep_copy(exec, Kokkos::subview(fin_meta, std::make_pair(index_t(0), st.n_d1)), f.d1_meta);
    restore_flat_order(exec, st, h, fin_meta, PayloadParts<MS>{f.d1, s3, {}, {}});
  }

  /// The final metadata (own-node arrivals, then stage-3 arrivals) in the
  /// flat exchange's arrival order, the repack and the expert rows gathered
  /// from where the rows arrived. Collective over EP (a row for another
  /// rank's slot fails every rank).
  template <class T>
  void restore_flat_order(Exec const& exec, State& st, DispatchHandle<T, MS>& h, meta_view const& fin_meta,
                          PayloadParts<MS> const& parts) {
    auto const& comms = *this->comms_;
    int const P = comms.ep().size();
    int const L = std::max(1, this->placement_.num_slots_of_rank(this->me_));
    index_t const nf = static_cast<index_t>(fin_meta.extent(0));
    auto keyc = this->work_.template vector<int>(exec, "keyc", nf);
    auto ep_slot = ep_slot_;
    auto local_slot = local_slot_;
    int const S = static_cast<int>(local_slot.extent(0));
    int const N = static_cast<int>(ep_slot.extent(0));
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::origin_keys", Kokkos::RangePolicy<Exec>(exec, 0, nf), KOKKOS_LAMBDA(index_t p) {
          RowMeta const m = fin_meta(p);
          int const o = m.origin_rank >= 0 && m.origin_rank < N ? ep_slot(m.origin_rank) : 0;
          int const l = m.slot >= 0 && m.slot < S ? local_slot(m.slot) : -1;
          keyc(p) = o * L + (l < 0 ? 0 : l);  // a foreign slot fails in the repack below
        });
    st.canonical_from = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::canonical_from", nf);
    auto const off = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalDedupExchange::origin_offsets", P * L + 1);
    int const d = parts.part0.width;
    index_t const n_d1 = st.n_d1;
    agree(comms.ep().comm(), problem_of([&] {
            stable_counting_sort(exec, keyc, P * L, st.canonical_from, off, "KokkosMoE::HierarchicalDedupExchange::canonical",
                                 &this->work_);
            h.arrived_meta = this->work_.template vector<RowMeta>(exec, "arrived_meta", nf);
            gather_records(exec, fin_meta, st.canonical_from, h.arrived_meta, "KokkosMoE::HierarchicalDedupExchange::canonical_meta");
            auto const ho = Impl::host_vector(exec, off);
            h.recv_counts.assign(static_cast<std::size_t>(P), 0);
            for (int p = 0; p < P; ++p)
              h.recv_counts[static_cast<std::size_t>(p)] = ho[static_cast<std::size_t>(p + 1) * L] - ho[static_cast<std::size_t>(p) * L];
            h.repack = make_repack_plan(exec, h.arrived_meta, this->placement_, this->me_, &this->work_);
            this->set_expert_rows(exec, h, h.repack.slot_counts, d);
            auto cf = st.canonical_from;
            auto rp = h.repack.perm;
            gather_rows(
                exec, parts,
                KOKKOS_LAMBDA(index_t q)->index_t {
                  index_t const a = cf(rp(q));
                  return a < n_d1 ? part_row(0, a) : part_row(1, a - n_d1);
                },
                h.expert_rows, "KokkosMoE::HierarchicalDedupExchange::expert_rows");
          }),
          "hierarchical_dedup dispatch repack", this->config_.watchdog_seconds);
  }

  /// combine_start's work: every result to where its row came from (the
  /// own origin's return buffer, an own-node origin, the relay that
  /// expanded it), the relays' partial sums per unit, and the reverse of
  /// stage 2 posted.
  template <class T>
  void reverse_stage3(Exec const& exec, State const& st, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out,
                      PayloadBuffer<MS> const& returned, CombineFlight& f, Impl::Lap<Exec>& lap) {
    auto const& comms = *this->comms_;
    auto const& node = comms.node_local();
    int const me_slot = node.my_slot();
    int const d = static_cast<int>(expert_out.extent(1));
    auto const type = this->config_.return_payload;
    index_t const n_d1 = st.n_d1;
    index_t const n3_send = Impl::total(st.s3_send);
    f.d1_back = payload_buffer(this->work_, exec, "d1_back", type, d, n_d1);
    auto s3_back = payload_buffer(this->work_, exec, "s3_back", type, d, Impl::total(st.s3_recv));
    auto s3_ret = payload_buffer(this->work_, exec, "s3_ret", type, d, n3_send);
    // Expert row q -> arrival a = cf(perm(q)): own-node rows (the own ones
    // straight to the plan positions in the return buffer), stage-3 rows
    // (the relay's own straight to their place among the relay's results).
    {
      auto cf = st.canonical_from;
      auto rp = h.repack.perm;
      index_t const d1_lo = st.d1_self_recv, d1_hi = d1_lo + st.d1_recv[static_cast<std::size_t>(me_slot)];
      index_t const plan_at = st.d1_plan_runs[static_cast<std::size_t>(me_slot)].first;
      index_t const s3_lo = st.s3_self_recv, s3_hi = s3_lo + st.s3_recv[static_cast<std::size_t>(me_slot)];
      index_t const s3_at = st.s3_self_send;
      scatter_rows(
          exec, expert_out,
          KOKKOS_LAMBDA(index_t q)->index_t {
            index_t const a = cf(rp(q));
            if (a < n_d1) return a >= d1_lo && a < d1_hi ? part_row(2, plan_at + (a - d1_lo)) : part_row(0, a);
            index_t const b = a - n_d1;
            return b >= s3_lo && b < s3_hi ? part_row(3, s3_at + (b - s3_lo)) : part_row(1, b);
          },
          PayloadParts<MS>{f.d1_back, s3_back, returned, s3_ret}, "KokkosMoE::HierarchicalDedupExchange::results");
    }
    agree_counts(node, st.s3_recv, Impl::total(st.s3_recv), &st.s3_send, "hierarchical_dedup combine stage 3 counts", this->options());
    this->transport_->alltoallv(exec, node, {RowSet<MS>{s3_back.bytes, s3_ret.bytes, {}, {}, /*self_in_place=*/true}}, st.s3_recv,
                                st.s3_send, "hierarchical_dedup combine stage 3 rows", this->options());
    StageLedger c3{"relay gather (reverse of relay expand)", node.name()};
    c3.self_in_place = true;
    add_sends(c3, st.s3_recv, node.peer_order(), this->me_, this->node_of_rank_, s3_back.row_bytes(), 0);
    c3.relay_rows = h.ledger.dispatch.stages.back().relay_rows;
    c3.relay_bytes = c3.relay_rows * s3_back.row_bytes();
    // The relay's partial sum of every unit, in its route order.
    index_t const n2 = static_cast<index_t>(st.unit_exp.extent(0));
    auto s2_back = payload_buffer(this->work_, exec, "s2_back", type, d, n2);
    partial_sums(exec, st, s3_ret, s2_back);
    c3.seconds = lap();
    h.ledger.combine.stages.push_back(c3);
    StageLedger c2{"relay to relay (reverse)", comms.is_relay() ? comms.relay().name() : std::string("-")};
    f.s2_ret = payload_buffer(this->work_, exec, "s2_ret", type, d, Impl::total(st.s2_send));
    if (comms.is_relay()) {
      auto const& rc = comms.relay();
      agree_counts(rc, st.s2_recv, n2, &st.s2_send, "hierarchical_dedup combine stage 2 counts", this->options());
      h.flight = this->transport_->start_alltoallv(exec, rc, {RowSet<MS>{s2_back.bytes, f.s2_ret.bytes}}, st.s2_recv, st.s2_send,
                                                   "hierarchical_dedup combine stage 2 partial sums", this->options());
      add_sends(c2, st.s2_recv, rc.peer_order(), this->me_, this->node_of_rank_, s2_back.row_bytes(), 0, nullptr, nullptr,
                &st.s2_recv_routes);
    }
    c2.seconds = lap();
    h.ledger.combine.stages.push_back(c2);
  }

  /// out row u = sum over the routes i of unit u (its route order) of
  /// gate * result, FP32 from zero, encoded in out's payload.
  void partial_sums(Exec const& exec, State const& st, PayloadBuffer<MS> const& results, PayloadBuffer<MS> const& out) {
    index_t const n2 = out.rows();
    if (n2 == 0) return;
    int const k = st.k;
    int const d = out.width;
    auto unit_exp = st.unit_exp;
    auto unit_gate = st.unit_gate;
    auto rows = results.bytes;
    auto obytes = out.bytes;
    PayloadType const in_type = results.type, out_type = out.type;
    using policy_t = Kokkos::TeamPolicy<Exec>;
    using scratch_t = Kokkos::View<float*, typename Exec::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    std::size_t const bytes = scratch_t::shmem_size(static_cast<std::size_t>(d));
    int const level = bytes > 32768 ? 1 : 0;
    auto policy = KokkosMoE::Impl::row_policy(exec, n2);
    policy.set_scratch_size(level, Kokkos::PerTeam(bytes));
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::partial_sums", policy, KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
          index_t const u = team.league_rank();
          // (in_type read here, not first in the branches below: CUDA's
          // extended lambdas may not first-capture in a constexpr-if.)
          PayloadType const in = in_type;
          scratch_t acc(team.team_scratch(level), d);
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int c) { acc(c) = 0.0f; });
          for (int i = 0; i < k; ++i) {
            index_t const p = unit_exp(u, i);
            if (p < 0) continue;
            float const g = unit_gate(u, i);
            unsigned char const* row = &rows(p, 0);
            if constexpr (KokkosMoE::Impl::runs_on_host<Exec>()) {
              KokkosMoE::Impl::axpy_row(acc.data(), row, in, g, d);  // the combine's row loop (bf16/fp32 vectorised)
            } else {
              Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d),
                                   [&](int c) { acc(c) += Compat::mul_rn(g, KokkosMoE::Impl::payload_load(in, row, d, c)); });
            }
          }
          KokkosMoE::Impl::encode_row(team, out_type, d, [&](int c) { return acc(c); }, &obytes(u, 0));
        });
  }

  /// combine_finish's work: the partial sums back to the stage-1 unit
  /// layout, then one count round and the results of own-node rows and
  /// units back to their origins, straight into the return buffer (own-node
  /// rows) or the origin's unit rows, which go to their first route's row.
  void reverse_stage1(Exec const& exec, State const& st, CombineFlight const& f, PayloadBuffer<MS> const& returned, ByteLedger& ledger) {
    auto const& node = this->comms_->node_local();
    int const S = node.size();
    auto const Su = static_cast<std::size_t>(S);
    int const me_slot = node.my_slot();
    auto const type = this->config_.return_payload;
    int const d = returned.width;
    index_t const n_u1 = Impl::total(st.u1_recv);
    index_t const U = static_cast<index_t>(st.unit_rep.extent(0));
    auto u1_back = payload_buffer(this->work_, exec, "u1_back", type, d, n_u1);
    auto unit_ret = payload_buffer(this->work_, exec, "unit_ret", type, d, U);
    if (n_u1 > 0) {
      // Stage-2 send position p held stage-1 unit arrival s2_perm(p); the
      // relay's own units go straight to its unit rows.
      auto perm = st.s2_perm;
      index_t const lo = st.u1_self_recv, hi = lo + st.u1_recv[static_cast<std::size_t>(me_slot)];
      scatter_rows(
          exec, f.s2_ret,
          KOKKOS_LAMBDA(index_t p)->index_t {
            index_t const i = perm(p);
            return i >= lo && i < hi ? part_row(1, i - lo) : part_row(0, i);
          },
          PayloadParts<MS>{u1_back, unit_ret, {}, {}}, "KokkosMoE::HierarchicalDedupExchange::partials_back");
    }
    std::vector<index_t> split(Su);
    RowRuns announce(Su), d1_recv_runs(Su);
    for (std::size_t x = 0; x < Su; ++x) {
      split[x] = st.d1_recv[x] + st.u1_recv[x];
      announce[x] = {{0, st.d1_recv[x]}, {0, st.u1_recv[x]}};
      d1_recv_runs[x] = {st.d1_plan_runs[x]};
    }
    auto const agreed = agree_counts_and_every_run(node, split, Impl::total(split), announce, 2, 2,
                                                   "hierarchical_dedup combine stage 1 counts", this->options());
    for (std::size_t x = 0; x < Su; ++x)
      KOKKOSMOE_REQUIRE(agreed.recv_run_lengths[x][0] == st.d1_send[x] && agreed.recv_run_lengths[x][1] == st.u1_send[x],
                        "hierarchical_dedup combine: node peer " << x << " returns " << agreed.recv_run_lengths[x][0] << " rows and "
                                                                 << agreed.recv_run_lengths[x][1] << " units for " << st.d1_send[x]
                                                                 << " and " << st.u1_send[x] << " sent");
    this->transport_->alltoallv(exec, node,
                                {RowSet<MS>{f.d1_back.bytes, returned.bytes, {}, d1_recv_runs, /*self_in_place=*/true}},
                                st.d1_recv, st.d1_send, "hierarchical_dedup combine stage 1 own-node rows", this->options());
    this->transport_->alltoallv(exec, node, {RowSet<MS>{u1_back.bytes, unit_ret.bytes, {}, {}, /*self_in_place=*/true}}, st.u1_recv,
                                st.u1_send, "hierarchical_dedup combine stage 1 partial sums", this->options());
    auto rep = st.unit_rep;
    scatter_rows(exec, unit_ret, KOKKOS_LAMBDA(index_t u)->index_t { return rep(u); }, returned,
                 "KokkosMoE::HierarchicalDedupExchange::partials_to_routes");
    StageLedger c1{"return from relay + node-local direct", node.name()};
    c1.self_in_place = true;
    add_sends(c1, st.d1_recv, node.peer_order(), this->me_, this->node_of_rank_, returned.row_bytes(), 0);
    add_sends(c1, st.u1_recv, node.peer_order(), this->me_, this->node_of_rank_, returned.row_bytes(), 0, nullptr, nullptr,
              &st.u1_recv_routes);
    c1.relay_rows = ledger.dispatch.stages.front().relay_rows;
    c1.relay_bytes = c1.relay_rows * returned.row_bytes();
    ledger.combine.stages.push_back(c1);
  }

  /// The units of a route plan: one per (node, token) with a route to
  /// that node, other nodes than this rank's, in (node, token) order;
  /// returns their number and writes each unit's token and node.
  index_t find_units(Exec const& exec, RoutePlan<MS> const& routes, Kokkos::View<int*, MS> const& unit_token,
                     Kokkos::View<int*, MS> const& unit_node) const {
    index_t const T = routes.num_tokens;
    int const nodes = this->comms_->topology().num_nodes();
    int const k = routes.top_k;
    int const my_node = my_node_;
    auto ri = routes.route_index;
    auto dest = routes.dest_rank;
    auto node_of = node_of_;
    index_t const cap = static_cast<index_t>(unit_token.extent(0));
    index_t U = 0;
    if (T == 0 || nodes < 2) return 0;
    Kokkos::parallel_scan(
        "KokkosMoE::HierarchicalDedupExchange::units", Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(nodes) * T),
        KOKKOS_LAMBDA(index_t x, index_t & run, bool final) {
          int const b = static_cast<int>(x / T);
          index_t const t = x % T;
          if (b == my_node) return;
          bool hit = false;
          for (int j = 0; j < k && !hit; ++j) {
            index_t const a = ri(t, j);
            hit = a >= 0 && dest(a) >= 0 && node_of(dest(a)) == b;
          }
          if (!hit) return;
          if (final && run < cap) {
            unit_token(run) = static_cast<int>(t);
            unit_node(run) = b;
          }
          ++run;
        },
        U);
    Compat::fence(exec, "KokkosMoE::HierarchicalDedupExchange: units");
    KOKKOSMOE_REQUIRE(U <= cap, "hierarchical_dedup: " << U << " units for a bound of " << cap);
    return U;
  }

  /// Unit records and, per unit, the plan position of its first route.
  void fill_units(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan, Kokkos::View<int*, MS> const& unit_token,
                  Kokkos::View<int*, MS> const& unit_node, index_t U, unit_view const& meta, index_view const& rep) const {
    int const k = routes.top_k;
    int const W = UnitMeta::ints(k);
    int const origin = this->me_;
    auto ri = routes.route_index;
    auto dest = routes.dest_rank;
    auto slot = routes.slot;
    auto gate = routes.gate;
    auto inv = plan.inv;
    auto node_of = node_of_;
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::unit_records", Kokkos::RangePolicy<Exec>(exec, 0, U), KOKKOS_LAMBDA(index_t u) {
          index_t const t = unit_token(u);
          int const b = unit_node(u);
          for (int c = 0; c < W; ++c) meta(u, c) = 0;
          int n = 0;
          for (int j = 0; j < k; ++j) {
            index_t const a = ri(t, j);
            if (a < 0 || dest(a) < 0 || node_of(dest(a)) != b) continue;
            if (n == 0) rep(u) = inv(a);
            int* r = &meta(u, UnitMeta::header + UnitMeta::per_route * n);
            r[0] = slot(a);
            r[1] = dest(a);
            r[2] = static_cast<std::int32_t>(t * k + j);
            float const g = gate(a);
            memcpy(&r[3], &g, sizeof g);
            ++n;
          }
          meta(u, 0) = origin;
          meta(u, 1) = n;
        });
  }

  /// The handle's combine routes: own-node routes with their gates, the
  /// first route of every unit with weight 1 (its row is the node's partial
  /// sum), the unit's other routes skipped.
  template <class T>
  void combine_routes_of(Exec const& exec, RoutePlan<MS> const& routes, DispatchHandle<T, MS>& h) {
    index_t const Tn = routes.num_tokens;
    int const k = routes.top_k;
    h.combine_route_index = this->work_.template get<Kokkos::View<index_t**, Kokkos::LayoutRight, MS>>(
        exec, "combine_route_index", Tn, static_cast<std::size_t>(std::max(k, 0)));
    h.combine_gate = this->work_.template vector<float>(exec, "combine_gate", routes.size());
    auto cri = h.combine_route_index;
    auto cg = h.combine_gate;
    auto ri = routes.route_index;
    auto dest = routes.dest_rank;
    auto gate = routes.gate;
    auto node_of = node_of_;
    int const my_node = my_node_;
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalDedupExchange::combine_routes", Kokkos::RangePolicy<Exec>(exec, 0, Tn), KOKKOS_LAMBDA(index_t t) {
          for (int j = 0; j < k; ++j) {
            index_t const a = ri(t, j);
            cri(t, j) = a;
            if (a < 0) continue;
            int const b = dest(a) >= 0 ? node_of(dest(a)) : my_node;
            if (b == my_node) {
              cg(a) = gate(a);
              continue;
            }
            bool first = true;
            for (int i = 0; i < j && first; ++i) {
              index_t const e = ri(t, i);
              first = !(e >= 0 && dest(e) >= 0 && node_of(dest(e)) == b);
            }
            cg(a) = 1.0f;
            if (!first) cri(t, j) = -1;
          }
        });
  }

  /// Routes the first n unit records stand for.
  static std::int64_t sum_routes(Exec const& exec, unit_view const& meta, index_t n) {
    std::int64_t s = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalDedupExchange::routes", Kokkos::RangePolicy<Exec>(exec, 0, n),
        KOKKOS_LAMBDA(index_t u, std::int64_t & acc) { acc += meta(u, 1); }, s);
    return s;
  }

  /// Routes of the unit records of each segment (counts in order).
  static std::vector<std::int64_t> routes_per_segment(Exec const& exec, unit_view const& meta, std::vector<index_t> const& counts) {
    std::vector<std::int64_t> out(counts.size(), 0);
    index_t at = 0;
    for (std::size_t p = 0; p < counts.size(); ++p) {
      if (counts[p] > 0)
        out[p] = sum_routes(exec, Kokkos::subview(meta, std::make_pair(at, at + counts[p]), Kokkos::ALL), counts[p]);
      at += counts[p];
    }
    return out;
  }

  /// Unit records as transport rows (the set keeps both views).
  static RowSet<MS> unit_rows(unit_view const& send, unit_view const& recv) {
    auto bytes = [](unit_view const& v) {
      return bytes_view(reinterpret_cast<unsigned char*>(v.data()), v.extent(0), v.extent(1) * sizeof(std::int32_t));
    };
    RowSet<MS> s(bytes(send), bytes(recv));
    s.owners = std::make_pair(send, recv);
    return s;
  }

  /// A set whose own rows were written where they arrive.
  static RowSet<MS> in_place(RowSet<MS> s) {
    s.self_in_place = true;
    return s;
  }

  static PayloadBuffer<MS> rows_of(PayloadBuffer<MS> const& b, index_t first, index_t n) {
    PayloadBuffer<MS> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(first, first + n), Kokkos::ALL);
    return p;
  }

 private:
  Kokkos::View<int*, MS> node_of_, group_slot_, ep_slot_, relay_peer_, local_slot_;
  int my_node_ = -1;
  int my_relay_ = -1;
};

template <>
struct AlgorithmClass<Algorithm::hierarchical_dedup> {
  template <class Exec, class MS>
  using type = HierarchicalDedupExchange<Exec, MS>;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
