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
///
/// Where the payloads are another type than the rows (converted on the
/// way), or receive_into_experts is off: dispatch = gather_to_relay (pack
/// straight into stage-1 order) ->
/// relay_to_relay -> relay_scatter -> restore_flat_order (arrival metadata,
/// repack, expert rows gathered straight from the final buffer).
/// combine = uncanonical -> reverse_scatter -> reverse_relay -> reverse_gather.
///
/// Relays copy no transit row: every source orders the rows it sends its
/// relay by (destination node, destination's node-local slot), so at the
/// relay each source's rows for one node form one run and, at the
/// destination relay, each origin's rows for one final rank; stages 2 and 3
/// send those runs in place (RowRuns: one contiguous message per run, the
/// receivers told the run lengths with the counts, in one round), and the
/// reverse stages receive into them in place. No rank copies rows to
/// itself either: its stage-1 rows for itself are packed straight among
/// its stage-1 arrivals, and the rows that stay (kept stage-1 rows, a
/// relay's own stage-3 rows) are read where they are by the final gather
/// and written there by the combine's first scatter (State::final_pieces),
/// except the kept rows a rank sent itself, which that scatter writes
/// straight into the caller's return buffer (State::combine_pieces). The
/// one self copy left is a relay's own transit rows, which come back
/// through the reverse of stage 2 into the stage-1 layout.
///
/// Where both payloads are the rows' own type (ExchangeConfig::
/// receive_into_experts), no rank copies a row into its expert rows at all:
/// one count round over EP first tells every rank each source's rows per
/// local slot (DeepEP's notify round), so the own node's rows go straight
/// from the plan's order into their expert rows (one run per slot), transit
/// rows go to the relay in runs of the plan's order (per node, that node's
/// relay of the rail first), stage 2 hands each receiving relay its own rows
/// straight into its expert rows, and stage 3 sends its metadata first,
/// after which relay and final rank cut the same runs at every slot change
/// and the rows land in their expert rows. The combine sends the results
/// back from those places: no repack copy either way. A rank's own rows
/// (a relay's own transit rows too) are packed straight where they arrive;
/// the one copy left is a relay's own transit results on the way back.
///
/// The start forms post the relay-to-relay stage (the inter-node one) and
/// return: dispatch_start runs stage 1 and posts stage 2, dispatch_finish
/// waits for it, runs stage 3 and restores the flat order; combine_start
/// runs the reverse of stage 3 and posts the reverse of stage 2,
/// combine_finish waits for it and runs the reverse of stage 1. In a chunked
/// layer step the relay stages stream: stage 2 of chunk i is in flight while
/// stage 1 of chunk i+1 and stage 3 of chunk i-1 run.

#include <KokkosMoE_CountingSort.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

#include <functional>
#include <memory>
#include <numeric>
#include <tuple>

namespace KokkosMoE {
namespace Exchange {

template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class HierarchicalExchange : public Impl::ExchangeBase<ExecutionSpace, MemorySpace> {
  using base = Impl::ExchangeBase<ExecutionSpace, MemorySpace>;
  using Exec = ExecutionSpace;
  using MS = MemorySpace;
  using meta_view = Kokkos::View<RowMeta*, MS>;
  using index_view = Kokkos::View<index_t*, MS>;

 public:
  static constexpr Algorithm algorithm = Algorithm::hierarchical;

  /// \brief Final-buffer positions [first, first + rows) whose rows are
  /// rows part_local_row(src).. of part row_part(src): 1 the stage-1
  /// arrivals, 2 the stage-2 arrivals (on the combine's way back: the
  /// buffers of the same layouts it returns through).
  struct FinalPiece {
    index_t first = 0;
    index_t rows = 0;
    index_t src = 0;
  };

  /// \brief The three stages of one dispatch, kept for their reverse.
  struct State {
    StageRecord<MS> s1, s2, s3;
    index_t kept = 0;           ///< stage-1 rows that stayed at this rank (relays)
    index_view canonical_from;  ///< arrival position -> position in the final buffer
    RowRuns s2_runs;            ///< stage-2 rows of each relay peer, as runs of the stage-1 arrivals
    RowRuns s2_recv_runs;       ///< where stage-2 rows arrived, run by run (consecutive)
    RowRuns s3_runs;            ///< stage-3 rows of each node peer, as runs of the stage-2 arrivals
    RowRuns s3_recv_runs;       ///< where stage-3 rows arrived after the kept rows, run by run (consecutive)
    std::vector<std::pair<index_t, index_t>> kept_runs;  ///< runs of the stage-1 arrivals kept here
    RowRuns s1_return_runs;     ///< where each node peer's returned rows go in the plan's send order (reverse of stage 1)
    RowRuns s1_back_runs;       ///< the same runs' lengths at the returning peers, over their stage-1 arrivals
    /// Final-buffer positions whose rows stay where an earlier stage put
    /// them (the kept stage-1 arrivals, the relay's own stage-3 rows), by
    /// first position; every other position is its own row of the final buffer.
    Kokkos::View<FinalPiece*, MS> final_pieces;
    /// The same positions on the combine's way back, where the kept rows
    /// this rank sent itself in stage 1 go straight to their places in the
    /// return buffer (part 3) instead of the stage-1 layout.
    Kokkos::View<FinalPiece*, MS> combine_pieces;
    /// A relay's own transit rows: stage-1 arrival runs (coming back through
    /// the reverse of stage 2) and their runs in the return buffer, the
    /// only rows the combine copies to the rank itself.
    std::vector<std::pair<index_t, index_t>> self_transit_runs, self_transit_return_runs;
    // Rows straight to and from their expert-major places (direct; see
    // dispatch_start_direct): s1 is then the transit rows alone.
    bool direct = false;
    typename base::DirectRuns expert;        ///< per EP origin and local slot: its expert rows
    std::vector<index_t> d1_send, d1_recv;   ///< rows for ranks of the own node, per node peer
    RowRuns d1_send_runs, d1_recv_runs;      ///< their slot runs: plan positions / expert rows
    RowRuns s3_fine_send_runs;               ///< stage 3 per (origin, slot): over the stage-2 arrivals
    RowRuns s3_fine_recv_runs;               ///< the same runs in the expert rows
    // Stage 2 of a direct dispatch also sends each receiving relay its own
    // rows straight into its expert rows (s2 is then the other rows).
    std::vector<index_t> s2_own_send, s2_own_recv;  ///< per relay peer
    RowRuns s2_own_runs;       ///< per (source, slot): over the stage-1 arrivals
    RowRuns s2_own_meta_runs;  ///< per source: the same rows' metadata
    RowRuns s2_own_recv_runs;  ///< per (origin, slot): in the expert rows
  };

  /// \brief What a dispatch in flight keeps until dispatch_finish.
  struct Flight {
    PayloadBuffer<MS> r1;
    meta_view r1_meta;
    PayloadBuffer<MS> r2;  ///< stage-2 arrivals (relays), written when the flight finishes
    meta_view r2_meta;
    std::shared_ptr<RowsInFlight> direct{};  ///< direct: the own node's rows on their way to the expert rows
    meta_view d1_meta{};                   ///< direct: their metadata, by source
    std::shared_ptr<RowsInFlight> own2{};  ///< direct: a relay's own rows from other relays (stage 2)
    meta_view own2_meta{};                 ///< direct: their metadata, by relay peer and origin
  };
  /// \brief What a combine in flight keeps until combine_finish.
  struct CombineFlight {
    PayloadBuffer<MS> fin;      ///< expert outputs in the final buffer's order
    PayloadBuffer<MS> s2_back;  ///< reverse stage-2 arrivals, written when the flight finishes
    std::shared_ptr<RowsInFlight> direct{};  ///< direct: the own node's results on their way back
    std::shared_ptr<RowsInFlight> own2{};  ///< direct: a relay's own results on their way to the other relays
  };

  HierarchicalExchange(Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config = {},
                       PlacementRegistry const* registry = nullptr)
      : base(algorithm, comms, std::move(placement), config, registry) {
    auto const& topo = comms.topology();
    int const N = topo.size();
    std::vector<int> node_slot(static_cast<std::size_t>(N)), ep_slot(static_cast<std::size_t>(N));
    for (int r = 0; r < N; ++r) {
      node_slot[r] = comms.node_local().slot_of(r);
      ep_slot[r] = comms.ep().slot_of(r);
    }
    // Every rank's slot in its own node's node-local peer order (the sub-key
    // that keeps rows for one destination together on their way).
    std::vector<int> group_slot(static_cast<std::size_t>(N), -1);
    for (auto const& g : comms.layout().node_groups) {
      max_node_ = std::max(max_node_, static_cast<int>(g.size()));
      for (std::size_t i = 0; i < g.size(); ++i) group_slot[static_cast<std::size_t>(g[i])] = static_cast<int>(i);
    }
    node_of_ = Impl::device_vector<MS>(this->node_of_rank_, "KokkosMoE::HierarchicalExchange::node_of");
    node_slot_ = Impl::device_vector<MS>(node_slot, "KokkosMoE::HierarchicalExchange::node_slot");
    group_slot_ = Impl::device_vector<MS>(group_slot, "KokkosMoE::HierarchicalExchange::group_slot");
    group_slot_h_ = group_slot;
    ep_slot_ = Impl::device_vector<MS>(ep_slot, "KokkosMoE::HierarchicalExchange::ep_slot");
    my_node_ = topo.node_of(this->me_);
    my_relay_ = Topology::relay_for(topo, comms.layout(), this->me_, my_node_);
    for (int n = 0; n < topo.num_nodes(); ++n) rail_relay_.push_back(Topology::relay_for(topo, comms.layout(), this->me_, n));
    rail_relay_d_ = Impl::device_vector<MS>(rail_relay_, "KokkosMoE::HierarchicalExchange::rail_relay");
    for (int r = 0; r < N; ++r) relay_of_.push_back(Topology::relay_for(topo, comms.layout(), r, topo.node_of(r)));
  }

  int waves() const { return 1; }

  /// \brief Collective over the EP communicator (see FlatExchange::dispatch;
  /// the handle is the same as the flat exchange's, rows included).
  template <class T>
  DispatchHandle<T, MS> dispatch(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                 RowMatrix<T, MS> const& hidden, int wave = 0) {
    auto h = dispatch_start(exec, routes, plan, hidden, wave);
    dispatch_finish(exec, h);
    return h;
  }

  /// \brief Stage 1, and stage 2 posted: the handle is in flight until
  /// dispatch_finish (the relay-to-relay rows still moving).
  template <class T>
  DispatchHandle<T, MS> dispatch_start(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                       RowMatrix<T, MS> const& hidden, int wave = 0) {
    if (this->template receives_into_experts<T>()) return dispatch_start_direct(exec, routes, plan, hidden, wave);
    auto const& comms = *this->comms_;
    Kokkos::Timer timer;
    Impl::Lap<Exec> lap(exec);
    auto h = this->template new_handle<T>(routes, plan, wave);
    int const d = static_cast<int>(hidden.extent(1));
    h.ledger = this->new_ledger(d);
    // One watched agreement over all ranks first: a local problem fails
    // every rank before any stage starts.
    meta_view meta;
    agree(comms.ep().comm(), problem_of([&] {
            this->check_dispatch(h, hidden, waves());
            meta = this->work_.template vector<RowMeta>(exec, "send_meta", plan.rows());
            pack_meta(exec, routes, plan, meta);
          }),
          "hierarchical dispatch", this->config_.watchdog_seconds);
    State st;
    auto [r1, r1_meta] = gather_to_relay(exec, st, routes, plan, hidden, meta, h.ledger, lap);
    Flight f{r1, r1_meta, {}, {}};
    std::tie(f.r2, f.r2_meta) = relay_to_relay(exec, st, r1, r1_meta, h.ledger, lap, &h.flight);
    h.state = std::move(st);
    h.pending = std::move(f);
    h.seconds = timer.seconds();
    return h;
  }

  /// \brief Waits for the relay-to-relay rows, runs the relay scatter and
  /// restores the flat arrival order; the handle is then delivered.
  template <class T>
  void dispatch_finish(Exec const& exec, DispatchHandle<T, MS>& h) {
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(!h.delivered && h.pending.has_value(), "hierarchical dispatch_finish: the handle is not a dispatch in flight");
    Impl::Lap<Exec> lap(exec);
    h.flight.finish();
    auto const f = std::any_cast<Flight>(h.pending);
    h.pending.reset();
    State& st = std::any_cast<State&>(h.state);
    h.ledger.dispatch.stages.back().seconds += lap();  // stage 2 completing
    if (st.direct) {
      finish_direct(exec, st, h, f);
      h.ledger.dispatch.stages.back().seconds = lap();
      h.seconds += timer.seconds();
      h.ledger.dispatch.useful_rows = h.repack.rows();
      h.delivered = true;
      return;
    }
    auto [r3, r3_meta] = relay_scatter(exec, st, f.r2, f.r2_meta, h.ledger);
    restore_flat_order(exec, st, h, f.r1, f.r1_meta, f.r2, r3, r3_meta);
    Compat::fence(exec, "KokkosMoE::HierarchicalExchange::dispatch");
    h.ledger.dispatch.stages.back().seconds = lap();  // scatter plus restoring the flat arrival order
    h.seconds += timer.seconds();
    h.ledger.dispatch.useful_rows = h.repack.rows();
    h.delivered = true;
  }

  /// \brief The exact reverse of the handle's three stages; see FlatExchange::combine.
  template <class T>
  void combine(Exec const& exec, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
               std::string const& local_problem = {}) {
    combine_start(exec, h, expert_out, returned, local_problem);
    combine_finish(exec, h);
  }

  /// \brief The reverse of stage 3, and the reverse of stage 2 posted;
  /// `returned` is written when combine_finish returns.
  template <class T>
  void combine_start(Exec const& exec, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
                     std::string const& local_problem = {}) {
    auto const& comms = *this->comms_;
    Kokkos::Timer timer;
    Impl::Lap<Exec> lap(exec);
    State const* st = std::any_cast<State>(&h.state);
    std::string problem = local_problem.empty() ? this->combine_problem(h, expert_out, returned) : local_problem;
    if (problem.empty() && !st) problem = "hierarchical combine: the handle carries no hierarchical stages";
    RowMatrix<T, MS> out = expert_out;
    if (problem.empty() && st->direct) problem = problem_of([&] { out = this->contiguous_rows(exec, expert_out); });
    agree(comms.ep().comm(), problem, "hierarchical combine", this->config_.watchdog_seconds);
    h.combine_started = true;
    int const d = static_cast<int>(h.expert_rows.extent(1));
    this->set_combine_format(h.ledger, d);
    h.ledger.combine.stages.clear();
    if (st->direct) {
      h.ledger.combine.rows_in_place = true;
      combine_start_direct(exec, *st, h, out, returned, lap);
      h.pending_returned = returned;
      h.ledger.combine.useful_rows = h.plan.rows();
      h.seconds = timer.seconds();
      return;
    }
    // The reverse stages' buffers first: the expert outputs go straight
    // into them where their rows stayed on the way in.
    auto const type = this->config_.return_payload;
    auto s1_back = payload_buffer(this->work_, exec, "s1_recv_back", type, d, Impl::total(st->s1.recv_counts));
    auto s2_in_back = payload_buffer(this->work_, exec, "s2_in_back", type, d, st->s3.input_rows);
    auto fin = uncanonical(exec, *st, h, expert_out, s1_back, s2_in_back, returned);
    reverse_scatter(exec, *st, fin, s2_in_back, h.ledger, lap);
    reverse_relay(exec, *st, s2_in_back, s1_back, h.ledger, lap, &h.flight);
    h.pending = CombineFlight{fin, s1_back};
    h.ledger.combine.useful_rows = h.plan.rows();
    h.pending_returned = returned;
    h.seconds = timer.seconds();
  }

  /// \brief Waits for the reverse of stage 2, runs the reverse of stage 1
  /// and puts the rows into the plan's send order in the return buffer.
  template <class T>
  void combine_finish(Exec const& exec, DispatchHandle<T, MS>& h) {
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(h.combine_started && !h.combined && h.pending.has_value(),
                      "hierarchical combine_finish: the handle is not a combine in flight");
    Impl::Lap<Exec> lap(exec);
    h.flight.finish();
    auto const f = std::any_cast<CombineFlight>(h.pending);
    h.pending.reset();
    State const& st = std::any_cast<State const&>(h.state);
    h.ledger.combine.stages.back().seconds += lap();  // reverse stage 2 completing
    if (st.direct)
      reverse_gather_direct(exec, st, f, h.pending_returned, h.ledger);
    else
      reverse_gather(exec, st, f.fin, f.s2_back, h.pending_returned, h.ledger);
    h.pending_returned = {};
    Compat::fence(exec, "KokkosMoE::HierarchicalExchange::combine");
    h.ledger.combine.stages.back().seconds = lap();
    h.seconds += timer.seconds();
    h.combined = true;
  }

  static std::vector<ByteLedger> plan(PlanInput const& in) { return plan_hierarchical(in); }

  // Stages. They are public only because CUDA forbids extended device
  // lambdas inside private member functions; they are not part of the
  // interface.

  /// Stage 1: direct rows to their node-local destination, transit rows to
  /// this rank's relay; one node-local all-to-all. The rows are packed from
  /// hidden straight into the stage's send order.
  template <class T>
  std::pair<PayloadBuffer<MS>, meta_view> gather_to_relay(Exec const& exec, State& st, RoutePlan<MS> const& routes,
                                                          DispatchPlan<MS> const& plan, RowMatrix<T, MS> const& hidden,
                                                          meta_view const& meta, ByteLedger& ledger, Impl::Lap<Exec>& lap) {
    auto const& node = this->comms_->node_local();
    index_t const n0 = plan.rows();
    int const d = static_cast<int>(hidden.extent(1));
    auto node_of = node_of_;
    auto node_slot = node_slot_;
    auto group_slot = group_slot_;
    int const my_node = my_node_;
    int const relay_slot = node.slot_of(my_relay_);
    // Key: the node-local peer, then (destination node, its node-local slot),
    // so that a relay finds each source's rows per node and per final rank
    // in runs.
    int const M = max_node_;
    int const sub = this->comms_->topology().num_nodes() * M;
    auto key1 = this->work_.template vector<int>(exec, "key1", n0);
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalExchange::stage1_keys", Kokkos::RangePolicy<Exec>(exec, 0, n0), KOKKOS_LAMBDA(index_t p) {
          int const dst = meta(p).dest_rank;
          int const peer = node_of(dst) == my_node ? node_slot(dst) : relay_slot;
          key1(p) = peer * sub + node_of(dst) * M + group_slot(dst);
        });
    st.s1 = sort_stage(exec, key1, node.size() * sub, "gather to relay + node-local direct");
    {
      std::vector<index_t> per_peer(static_cast<std::size_t>(node.size()), 0);
      for (std::size_t k = 0; k < st.s1.send_counts.size(); ++k) per_peer[k / static_cast<std::size_t>(sub)] += st.s1.send_counts[k];
      st.s1.send_counts = std::move(per_peer);
    }
    st.s1.comm = 1;
    st.s1.input_rows = n0;
    {
      // The combine's last stage receives each peer's rows straight into the
      // plan's send order: stage-1 position p returns to plan position
      // perm1(p), in runs of consecutive positions.
      auto const perm1 = Impl::host_vector(exec, st.s1.send_perm);
      st.s1_return_runs.assign(st.s1.send_counts.size(), {});
      index_t at = 0;
      for (std::size_t k = 0; k < st.s1.send_counts.size(); ++k) {
        auto& runs = st.s1_return_runs[k];
        for (index_t e = at + st.s1.send_counts[k]; at < e; ++at) {
          index_t const q = perm1[static_cast<std::size_t>(at)];
          if (!runs.empty() && runs.back().first + runs.back().second == q)
            ++runs.back().second;
          else
            runs.push_back({q, 1});
        }
      }
    }
    // Send rows: position p holds the route at plan position perm1(p). The
    // rows for this rank itself (its direct rows and, at a relay, its
    // transit rows) are packed straight into their place among the
    // arrivals once the counts are agreed: no self copy.
    auto send = payload_buffer(this->work_, exec, "s1_send", this->config_.payload, d, n0);
    auto send_meta = this->work_.template vector<RowMeta>(exec, "s1_send_meta", n0);
    int const self = node.my_slot();
    index_t self_first = 0;
    for (int k = 0; k < self; ++k) self_first += st.s1.send_counts[k];
    index_t const self_end = self_first + st.s1.send_counts[self];
    auto perm1 = st.s1.send_perm;
    auto perm = plan.perm;
    auto token = routes.token;
    gather_rows(
        exec, hidden,
        KOKKOS_LAMBDA(index_t p)->index_t { return p >= self_first && p < self_end ? index_t(-1) : token(perm(perm1(p))); },
        send, "KokkosMoE::HierarchicalExchange::pack");
    gather_records(exec, meta, perm1, send_meta, "KokkosMoE::HierarchicalExchange::pack_meta");
    auto pack_self = [&](PayloadBuffer<MS> const& arrivals) {
      index_t at = 0;
      for (int k = 0; k < self; ++k) at += st.s1.recv_counts[k];
      gather_rows(
          exec, hidden, KOKKOS_LAMBDA(index_t i)->index_t { return token(perm(perm1(self_first + i))); },
          rows_of(arrivals, at, self_end - self_first), "KokkosMoE::HierarchicalExchange::pack_self");
    };
    // With the counts, each peer learns the run lengths its returned rows
    // must have (the combine's last stage sends them in those runs): at
    // most one run per destination rank. The rows themselves go contiguous.
    auto out = exchange_stage(exec, node, st.s1, send, send_meta, n0, "s1", "hierarchical dispatch stage 1", nullptr, 0,
                              &st.s1_return_runs, &st.s1_back_runs, this->comms_->topology().size(), /*send_in_runs=*/false,
                              pack_self);
    StageLedger sl{st.s1.name, node.name()};
    sl.self_in_place = true;
    add_sends(sl, st.s1.send_counts, node.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), sizeof(RowMeta));
    // Transit rows sent to a relay other than this rank are relay traffic.
    if (my_relay_ != this->me_) {
      std::int64_t const transit = transit_rows(exec, meta, n0);
      sl.relay_rows += transit;
      sl.relay_bytes += transit * (send.row_bytes() + static_cast<std::int64_t>(sizeof(RowMeta)));
    }
    sl.seconds = lap();
    ledger.dispatch.stages.push_back(sl);
    return out;
  }

  /// Stage 2 (relays only): transit rows to the destination node's relay of
  /// this rail, sent in place as runs of the stage-1 arrivals (each source's
  /// rows for one node are one run); rows for this rank stay (kept runs).
  std::pair<PayloadBuffer<MS>, meta_view> relay_to_relay(Exec const& exec, State& st, PayloadBuffer<MS> const& r1,
                                                         meta_view const& r1_meta, ByteLedger& ledger, Impl::Lap<Exec>& lap,
                                                         RowsInFlight* flight = nullptr) {
    auto const& comms = *this->comms_;
    int const me = this->me_;
    int const nodes = comms.topology().num_nodes();
    int const my_node = my_node_;
    auto node_of = node_of_;
    index_t const n1 = r1.rows();
    int const S = comms.node_local().size();
    // Rows per (source, destination node); rows for this node other than
    // this rank's own are misrouted.
    std::vector<index_t> const seg = Impl::offsets_of(st.s1.recv_counts);
    auto seg_d = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalExchange::s1_segments", seg);
    auto const hist = zeroed_counts(exec, "KokkosMoE::HierarchicalExchange::s2_hist", static_cast<index_t>(S) * nodes);
    index_t misrouted = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::stage2_runs", Kokkos::RangePolicy<Exec>(exec, 0, n1),
        KOKKOS_LAMBDA(index_t p, index_t & bad) {
          int const src = Impl::segment_of(seg_d, S, p);
          int const dst = r1_meta(p).dest_rank;
          Kokkos::atomic_add(&hist(static_cast<std::size_t>(src) * nodes + node_of(dst)), index_t(1));
          if (node_of(dst) == my_node && dst != me) ++bad;
        },
        misrouted);
    auto const h = Impl::host_vector(exec, hist);
    st.s2 = StageRecord<MS>{};
    st.s2.name = "relay to relay";
    st.s2.comm = 2;
    st.s2.input_rows = n1;
    st.s2.send_counts.assign(static_cast<std::size_t>(nodes), 0);
    st.s2_runs.assign(static_cast<std::size_t>(nodes), {});
    st.kept_runs.clear();
    st.kept = 0;
    for (int src = 0; src < S; ++src) {
      index_t at = seg[static_cast<std::size_t>(src)];
      for (int n = 0; n < nodes; ++n) {
        index_t const c = h[static_cast<std::size_t>(src) * nodes + n];
        if (c > 0) {
          if (n == my_node) {
            st.kept_runs.push_back({at, c});
            st.kept += c;
          } else {
            st.s2_runs[static_cast<std::size_t>(n)].push_back({at, c});
            st.s2.send_counts[static_cast<std::size_t>(n)] += c;
          }
        }
        at += c;
      }
    }
    bool const relay = comms.is_relay();
    index_t const transit_out = n1 - st.kept;
    agree(comms.ep().comm(), problem_of([&] {
            KOKKOSMOE_REQUIRE(misrouted == 0, misrouted << " rows for ranks of this node arrived at rank " << me << " as transit");
            KOKKOSMOE_REQUIRE(relay || transit_out == 0, transit_out << " transit rows arrived at rank " << me << ", which is not a relay");
          }),
          "hierarchical relay check", this->config_.watchdog_seconds);
    // Rows from other relays (none where this rank is not a relay).
    std::pair<PayloadBuffer<MS>, meta_view> out{payload_buffer(this->work_, exec, "s2_none", r1.type, r1.width, 0), meta_view()};
    StageLedger sl{st.s2.name, relay ? comms.relay().name() : std::string("-")};
    if (relay) {
      auto const& rc = comms.relay();
      // At most one run per source of the node and destination node.
      out = exchange_stage(exec, rc, st.s2, r1, r1_meta, transit_out, "s2", "hierarchical dispatch stage 2", flight, 0,
                           &st.s2_runs, &st.s2_recv_runs, max_node_);
      auto const runs = runs_per_peer(st.s2_runs);
      add_sends(sl, st.s2.send_counts, rc.peer_order(), me, this->node_of_rank_, r1.row_bytes(), sizeof(RowMeta), &runs);
    }
    sl.seconds = lap();
    ledger.dispatch.stages.push_back(sl);
    return out;
  }

  /// Stage 3: relays scatter to the final ranks of their node, sending in
  /// place the runs of the stage-2 arrivals (each origin's rows for one
  /// final rank are one run).
  std::pair<PayloadBuffer<MS>, meta_view> relay_scatter(Exec const& exec, State& st, PayloadBuffer<MS> const& r2,
                                                        meta_view const& r2_meta, ByteLedger& ledger) {
    index_t const n2 = r2.rows();
    scatter_runs(exec, st, r2_meta, n2);
    auto const& node = this->comms_->node_local();
    int const me = this->me_;
    int const M = max_node_;
    // Arrivals land after room for the rows kept from stage 1, so the final
    // buffer is the receive buffer (restore_flat_order fills the front).
    // At most one run per (relay peer, origin slot): relay peers are one per node.
    // The relay's own rows stay in the stage-2 arrivals: the final gather
    // reads them there.
    auto out = exchange_stage(exec, node, st.s3, r2, r2_meta, n2, "s3", "hierarchical dispatch stage 3", nullptr, st.kept,
                              &st.s3_runs, &st.s3_recv_runs, this->comms_->topology().num_nodes() * M, true, leave_self);
    StageLedger sl{st.s3.name, node.name()};
    sl.self_in_place = true;
    auto const runs = runs_per_peer(st.s3_runs);
    add_sends(sl, st.s3.send_counts, node.peer_order(), me, this->node_of_rank_, r2.row_bytes(), sizeof(RowMeta), &runs);
    add_scatter_relay_rows(sl, st, r2.row_bytes());
    ledger.dispatch.stages.push_back(sl);
    return out;
  }

  /// Stage 3's runs at a relay: the stage-2 arrivals of each (source relay,
  /// origin, final rank) are one run (State::s3_runs, s3.send_counts);
  /// rows for another node fail every rank.
  void scatter_runs(Exec const& exec, State& st, meta_view const& r2_meta, index_t n2) {
    auto const& comms = *this->comms_;
    auto const& node = comms.node_local();
    int const me = this->me_;
    int const my_node = my_node_;
    auto node_of = node_of_;
    auto group_slot = group_slot_;
    int const S = node.size();
    int const M = max_node_;
    int const R = static_cast<int>(st.s2.recv_counts.size());  // relay peers (0 for ranks that are not relays)
    std::vector<index_t> const seg = Impl::offsets_of(st.s2.recv_counts);
    auto seg_d = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalExchange::s2_segments", seg.empty() ? std::vector<index_t>{0} : seg);
    // Rows per (source relay, origin's slot in its node, final rank's slot).
    auto const hist = zeroed_counts(exec, "KokkosMoE::HierarchicalExchange::s3_hist", static_cast<index_t>(std::max(R, 1)) * M * S);
    index_t foreign = 0;
    bool const direct = st.direct;  // a relay's own rows came in stage 2
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::stage3_runs", Kokkos::RangePolicy<Exec>(exec, 0, n2),
        KOKKOS_LAMBDA(index_t p, index_t & bad) {
          int const m = Impl::segment_of(seg_d, R, p);
          int const dst = r2_meta(p).dest_rank;
          if (node_of(dst) != my_node || (direct && dst == me)) {
            ++bad;
            return;
          }
          std::size_t const b = (static_cast<std::size_t>(m) * M + group_slot(r2_meta(p).origin_rank)) * S + group_slot(dst);
          Kokkos::atomic_add(&hist(b), index_t(1));
        },
        foreign);
    auto const h = Impl::host_vector(exec, hist);
    agree(comms.ep().comm(), problem_of([&] {
            KOKKOSMOE_REQUIRE(foreign == 0, foreign << " rows for other nodes reached relay " << me << " of node " << my_node);
          }),
          "hierarchical relay check", this->config_.watchdog_seconds);
    st.s3 = StageRecord<MS>{};
    st.s3.name = "relay scatter";
    st.s3.comm = 1;
    st.s3.input_rows = n2;
    st.s3.send_counts.assign(static_cast<std::size_t>(S), 0);
    st.s3_runs.assign(static_cast<std::size_t>(S), {});
    for (int m = 0; m < R; ++m) {
      index_t at = seg[static_cast<std::size_t>(m)];
      for (int o = 0; o < M; ++o)
        for (int j = 0; j < S; ++j) {
          index_t const c = h[(static_cast<std::size_t>(m) * M + o) * S + j];
          if (c > 0) {
            // Node-local slot j is the peer of the same slot (the node group is the node communicator's order).
            st.s3_runs[static_cast<std::size_t>(j)].push_back({at, c});
            st.s3.send_counts[static_cast<std::size_t>(j)] += c;
          }
          at += c;
        }
    }
  }

  /// Stage 3's rows to other ranks are relay traffic.
  void add_scatter_relay_rows(StageLedger& sl, State const& st, std::int64_t row_bytes) const {
    auto const& node = this->comms_->node_local();
    std::int64_t moved = 0;
    for (int p = 0; p < node.size(); ++p)
      if (node.global_rank(p) != this->me_) moved += st.s3.send_counts[p];
    sl.relay_rows += moved;
    sl.relay_bytes += moved * (row_bytes + static_cast<std::int64_t>(sizeof(RowMeta)));
  }

  /// Final rows: stage-1 rows kept here (stage 2's last bucket, in its send
  /// order), then stage-3 arrivals. Their metadata is gathered into one
  /// final buffer; their payload stays where it is (the kept rows among the
  /// stage-1 arrivals, the relay's own stage-3 rows among the stage-2
  /// arrivals, the rest in the stage-3 receive buffer; State::final_pieces
  /// says which). The flat arrival order is a stable sort on the origin's EP
  /// peer slot; the arrival metadata, the repack and the expert rows
  /// (gathered from wherever they are through both permutations, in one
  /// pass) follow from it.
  template <class T>
  void restore_flat_order(Exec const& exec, State& st, DispatchHandle<T, MS>& h, PayloadBuffer<MS> const& r1,
                          meta_view const& r1_meta, PayloadBuffer<MS> const& r2, PayloadBuffer<MS> const& r3,
                          meta_view const& r3_meta) {
    auto const& comms = *this->comms_;
    index_t const nf = r3.rows();  // the rows kept from stage 1 (front), then the stage-3 arrivals
    int const d = r1.width;
    meta_view const& fin_meta = r3_meta;
    {
      // The kept runs' metadata, in order, into the front of the final buffer.
      std::vector<std::pair<index_t, index_t>> const front{{0, st.kept}};
      Impl::copy_self_rows(exec, as_rows(fin_meta), front, as_rows(r1_meta), st.kept_runs);
    }
    sort_by_origin(exec, st, h, fin_meta, nf);
    auto cf = st.canonical_from;
    agree(comms.ep().comm(), problem_of([&] {
            set_final_pieces(exec, st);  // checks the own rows against their return runs: a failure fails every rank
            h.repack = make_repack_plan(exec, h.arrived_meta, this->placement_, this->me_, &this->work_);
            this->set_expert_rows(exec, h, h.repack.slot_counts, d);
            gather_expert_rows(exec, PayloadParts<MS>{r3, r1, r2, {}}, st.final_pieces, cf, h.repack.perm, h.expert_rows);
          }),
          "hierarchical dispatch repack", this->config_.watchdog_seconds);
  }

  /// The pieces of the final buffer that stay where earlier stages put
  /// them: the kept runs (front, from the stage-1 arrivals) and the relay's
  /// own stage-3 runs (from the stage-2 arrivals). On the way back, the
  /// kept rows of the rank's own stage-1 segment go to the return buffer
  /// (combine_pieces), and the rest of that segment (a relay's own transit
  /// rows) is copied there after the reverse of stage 2.
  void set_final_pieces(Exec const& exec, State& st) {
    std::vector<FinalPiece> pieces, back;
    int const self = this->comms_->node_local().my_slot();
    // The own segment of the stage-1 arrivals, run by run to the return
    // buffer's rows (the plan positions the rows were packed from).
    struct SelfRun {
      index_t arrival, returned, rows;
    };
    std::vector<SelfRun> self_runs;
    index_t self_lo = 0;
    for (int k = 0; k < self; ++k) self_lo += st.s1.recv_counts[static_cast<std::size_t>(k)];
    index_t const self_hi = self_lo + st.s1.recv_counts[static_cast<std::size_t>(self)];
    {
      index_t a = self_lo;
      for (auto const& [q, n] : st.s1_return_runs[static_cast<std::size_t>(self)]) {
        self_runs.push_back({a, q, n});
        a += n;
      }
      KOKKOSMOE_REQUIRE(a == self_hi, "hierarchical exchange: the own stage-1 rows (" << self_hi - self_lo
                                                                                      << ") and their return runs (" << a - self_lo
                                                                                      << " rows) disagree");
    }
    // Arrival rows [a, e) from final position f on: emit(f, row, n, in
    // the return buffer) per piece (part 1, or part 3 inside the own segment).
    auto split = [&](index_t f, index_t a, index_t e, auto&& emit) {
      std::size_t r = 0;
      while (a < e) {
        if (a < self_lo || a >= self_hi) {
          index_t const end = a < self_lo ? std::min(e, self_lo) : e;
          emit(f, a, end - a, false);
          f += end - a;
          a = end;
          continue;
        }
        while (self_runs[r].arrival + self_runs[r].rows <= a) ++r;
        SelfRun const& run = self_runs[r];
        index_t const n = std::min(e, run.arrival + run.rows) - a;
        emit(f, run.returned + (a - run.arrival), n, true);
        f += n;
        a += n;
      }
    };
    st.self_transit_runs.clear();
    st.self_transit_return_runs.clear();
    auto transit = [&](index_t a, index_t e) {  // own rows [a, e) that are not kept
      split(0, a, e, [&](index_t, index_t q, index_t n, bool) {
        st.self_transit_return_runs.push_back({q, n});
        st.self_transit_runs.push_back({a, n});
        a += n;
      });
    };
    index_t at = 0, own = self_lo;  // own: the first own arrival row not yet accounted for
    for (auto const& [first, n] : st.kept_runs) {
      if (n == 0) continue;
      pieces.push_back({at, n, part_row(1, first)});
      if (first < self_hi && first + n > self_lo) {
        transit(own, std::max(own, first));
        own = std::max(own, first + n);
      }
      split(at, first, first + n, [&](index_t f, index_t row, index_t len, bool to_return) {
        back.push_back({f, len, part_row(to_return ? 3 : 1, row)});
      });
      at += n;
    }
    transit(own, self_hi);
    if (self >= 0 && static_cast<std::size_t>(self) < st.s3_runs.size()) {
      // The own segment's runs in the stage-3 receive runs pair with the
      // own send runs over the stage-2 arrivals, in order.
      auto const& src = st.s3_runs[static_cast<std::size_t>(self)];
      auto const& dst = st.s3_recv_runs[static_cast<std::size_t>(self)];
      std::size_t i = 0, j = 0;
      index_t di = 0, sj = 0;
      while (i < dst.size() && j < src.size()) {
        index_t const n = std::min(dst[i].second - di, src[j].second - sj);
        if (n > 0) {
          pieces.push_back({st.kept + dst[i].first + di, n, part_row(2, src[j].first + sj)});
          back.push_back(pieces.back());
        }
        di += n;
        sj += n;
        if (di == dst[i].second) ++i, di = 0;
        if (sj == src[j].second) ++j, sj = 0;
      }
    }
    auto by_first = [](FinalPiece const& a, FinalPiece const& b) { return a.first < b.first; };
    std::sort(pieces.begin(), pieces.end(), by_first);
    std::sort(back.begin(), back.end(), by_first);
    if (pieces.empty()) pieces.push_back({0, 0, 0});  // never matches: every position is its own
    if (back.empty()) back.push_back({0, 0, 0});
    st.final_pieces = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalExchange::final_pieces", pieces);
    st.combine_pieces = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalExchange::combine_pieces", back);
  }

  /// Where final-buffer position f's row is (a PayloadParts row: part 0 the
  /// final buffer itself).
  KOKKOS_INLINE_FUNCTION static index_t final_row(Kokkos::View<FinalPiece*, MS> const& pieces, index_t f) {
    // The last piece starting at or before f.
    index_t lo = 0, hi = static_cast<index_t>(pieces.extent(0));
    while (hi - lo > 1) {
      index_t const mid = (lo + hi) / 2;
      if (pieces(mid).first <= f)
        lo = mid;
      else
        hi = mid;
    }
    FinalPiece const& p = pieces(lo);
    return f >= p.first && f < p.first + p.rows ? p.src + (f - p.first) : f;
  }

  /// expert_rows(q) = decode(final row cf(perm(q))): arrival order and
  /// repack in one pass, each row read where it is.
  template <class T>
  static void gather_expert_rows(Exec const& exec, PayloadParts<MS> const& parts, Kokkos::View<FinalPiece*, MS> const& pieces,
                                 index_view const& cf, index_view const& perm, RowMatrix<T, MS> const& expert_rows) {
    gather_rows(exec, parts, KOKKOS_LAMBDA(index_t q)->index_t { return final_row(pieces, cf(perm(q))); }, expert_rows,
                "KokkosMoE::HierarchicalExchange::expert_rows");
  }

  /// Expert outputs through the repack and the canonical order, in one
  /// pass, straight to where the combine's stages send them from: the
  /// final buffer (returned by stage 3's reverse), the stage-1 arrival
  /// layout (kept rows) and the stage-2 arrival layout (the relay's own
  /// stage-3 rows).
  template <class T>
  PayloadBuffer<MS> uncanonical(Exec const& exec, State const& st, DispatchHandle<T, MS> const& h, RowMatrix<T, MS> const& expert_out,
                                PayloadBuffer<MS> const& s1_back, PayloadBuffer<MS> const& s2_in_back, PayloadBuffer<MS> const& returned) {
    int const d = static_cast<int>(h.expert_rows.extent(1));
    auto fin = payload_buffer(this->work_, exec, "combine_final", this->config_.return_payload, d, h.rows());
    auto cf = st.canonical_from;
    auto perm = h.repack.perm;
    auto pieces = st.combine_pieces;
    scatter_rows(exec, expert_out, KOKKOS_LAMBDA(index_t q)->index_t { return final_row(pieces, cf(perm(q))); },
                 PayloadParts<MS>{fin, s1_back, s2_in_back, returned}, "KokkosMoE::HierarchicalExchange::uncanonical");
    return fin;
  }

  /// Reverse of stage 3: final ranks return stage-3 rows to their relays,
  /// which put them back in stage-2 arrival order (a relay's own rows are
  /// there already: uncanonical wrote them).
  void reverse_scatter(Exec const& exec, State const& st, PayloadBuffer<MS> const& fin, PayloadBuffer<MS> const& s2_in_back,
                       ByteLedger& ledger, Impl::Lap<Exec>& lap) {
    auto const& node = this->comms_->node_local();
    auto const& s3 = st.s3;
    index_t const r3 = fin.rows() - st.kept;
    // The rows come back into the places stage 3 sent them from (runs of
    // the stage-2 arrival order), in place.
    agree_counts(node, s3.recv_counts, r3, &s3.send_counts, "hierarchical combine stage 3 counts", this->options());
    auto src = suffix(fin, st.kept);
    this->transport_->alltoallv(exec, node, {RowSet<MS>{src.bytes, s2_in_back.bytes, st.s3_recv_runs, st.s3_runs, /*self_in_place=*/true}},
                                s3.recv_counts, s3.send_counts, "hierarchical combine stage 3 rows", this->options());
    StageLedger sl{"relay gather (reverse of relay scatter)", node.name()};
    sl.self_in_place = true;
    auto const runs = runs_per_peer(st.s3_recv_runs);
    add_sends(sl, s3.recv_counts, node.peer_order(), this->me_, this->node_of_rank_, fin.row_bytes(), 0, &runs);
    sl.seconds = lap();
    ledger.combine.stages.push_back(sl);
  }

  /// Reverse of stage 2 between relays: the stage-1 arrival order rebuilt
  /// in place in s2_back, transit rows coming back into the runs stage 2
  /// sent them from (uncanonical wrote the kept runs).
  void reverse_relay(Exec const& exec, State const& st, PayloadBuffer<MS> const& s2_in_back, PayloadBuffer<MS> const& s2_back,
                     ByteLedger& ledger, Impl::Lap<Exec>& lap, RowsInFlight* flight = nullptr) {
    auto const& comms = *this->comms_;
    auto const& s2 = st.s2;
    StageLedger sl{"relay to relay (reverse)", comms.is_relay() ? comms.relay().name() : std::string("-")};
    if (comms.is_relay()) {
      auto const& rc = comms.relay();
      agree_counts(rc, s2.recv_counts, s2_in_back.rows(), &s2.send_counts, "hierarchical combine stage 2 counts", this->options());
      std::vector<RowSet<MS>> const sets{RowSet<MS>{s2_in_back.bytes, s2_back.bytes, st.s2_recv_runs, st.s2_runs}};
      if (flight)
        *flight = this->transport_->start_alltoallv(exec, rc, sets, s2.recv_counts, s2.send_counts,
                                                    "hierarchical combine stage 2 rows", this->options());
      else
        this->transport_->alltoallv(exec, rc, sets, s2.recv_counts, s2.send_counts, "hierarchical combine stage 2 rows",
                                    this->options());
      auto const runs = runs_per_peer(st.s2_recv_runs);
      add_sends(sl, s2.recv_counts, rc.peer_order(), this->me_, this->node_of_rank_, s2_in_back.row_bytes(), 0, &runs);
    }
    sl.seconds = lap();
    ledger.combine.stages.push_back(sl);
  }

  /// Reverse of stage 1: stage-1 arrival order rebuilt (transit rows from
  /// stage 2, kept rows written there by uncanonical), back to the origins, which
  /// receive them straight into the plan's send order in the caller's
  /// return buffer.
  void reverse_gather(Exec const& exec, State const& st, PayloadBuffer<MS> const& fin, PayloadBuffer<MS> const& s2_back,
                      PayloadBuffer<MS> const& returned, ByteLedger& ledger) {
    auto const& node = this->comms_->node_local();
    auto const& s1 = st.s1;
    index_t const r1 = Impl::total(s1.recv_counts);
    PayloadBuffer<MS> const& s1_recv_back = s2_back;  // transit and kept rows already in place
    agree_counts(node, s1.recv_counts, r1, &s1.send_counts, "hierarchical combine stage 1 counts", this->options());
    // The own kept rows are in the return buffer already (uncanonical wrote
    // them there); a relay's own transit rows are copied over.
    Impl::copy_self_rows(exec, returned.bytes, st.self_transit_return_runs, s1_recv_back.bytes, st.self_transit_runs);
    this->transport_->alltoallv(exec, node,
                                {RowSet<MS>{s1_recv_back.bytes, returned.bytes, st.s1_back_runs, st.s1_return_runs, /*self_in_place=*/true}},
                                s1.recv_counts, s1.send_counts, "hierarchical combine stage 1 rows", this->options());
    StageLedger sl{"return from relay + node-local direct", node.name()};
    sl.self_in_place = st.self_transit_runs.empty();
    auto const runs = runs_per_peer(st.s1_back_runs);
    add_sends(sl, s1.recv_counts, node.peer_order(), this->me_, this->node_of_rank_, fin.row_bytes(), 0, &runs);
    ledger.combine.stages.push_back(sl);
    mirror_relay_rows(ledger, fin.row_bytes());
  }

  // Rows straight to and from their expert-major places (both payloads the
  // rows' own type; ExchangeConfig::receive_into_experts).

  /// \brief dispatch_start where every row lands in its expert-major place.
  /// One count round over EP comes first (every source's rows per rank and
  /// local slot, all ranks at once), so each rank knows where every row it
  /// will receive goes before any row moves. Stage 1 sends the own node's
  /// rows straight into their expert rows (one run per slot, as the flat
  /// exchange does) and the transit rows to the relay from the plan's order
  /// (one run per destination rank, by destination node, that node's relay
  /// of this rail first, then node-local slot: the order stages 2 and 3
  /// forward them in); stage 2 is posted. A rank's own rows, and a relay's
  /// own transit rows, are packed straight where they arrive.
  template <class T>
  DispatchHandle<T, MS> dispatch_start_direct(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                              RowMatrix<T, MS> const& hidden, int wave) {
    auto const& comms = *this->comms_;
    auto const& ep = comms.ep();
    auto const& node = comms.node_local();
    Kokkos::Timer timer;
    Impl::Lap<Exec> lap(exec);
    auto h = this->template new_handle<T>(routes, plan, wave);
    int const d = static_cast<int>(hidden.extent(1));
    h.ledger = this->new_ledger(d);
    h.ledger.dispatch.rows_in_place = true;
    PayloadBuffer<MS> send;
    meta_view meta;
    // Rows in the plan's order, but the rank's own rows (and, at a relay,
    // its own transit rows): those are packed straight where they arrive.
    bool const own_relay = my_relay_ == this->me_;
    std::string const problem = problem_of([&] {
      this->check_dispatch(h, hidden, waves(), /*slot_runs=*/true);
      send = payload_buffer(this->work_, exec, "send", this->config_.payload, d, plan.rows());
      meta = this->work_.template vector<RowMeta>(exec, "send_meta", plan.rows());
      pack_meta(exec, routes, plan, meta);
      auto perm = plan.perm;
      auto token = routes.token;
      auto dest = routes.dest_rank;
      auto node_of = node_of_;
      int const me = this->me_, my_node = my_node_;
      gather_rows(
          exec, hidden,
          KOKKOS_LAMBDA(index_t p)->index_t {
            int const r = dest(perm(p));
            return r == me || (own_relay && node_of(r) != my_node) ? index_t(-1) : index_t(token(perm(p)));
          },
          send, "KokkosMoE::HierarchicalExchange::pack");
    });
    int const L = this->placement_.num_slots_of_rank(this->me_);
    auto const agreed = agree_counts_and_every_run(ep, plan.counts, plan.rows(), plan.slot_runs, this->max_slots_per_rank(), L,
                                                   "hierarchical dispatch counts", this->options(), problem);
    h.recv_counts = agreed.recv;
    State st;
    st.direct = true;
    st.expert = this->direct_layout(exec, h, agreed.recv_run_lengths, d);
    int const S = node.size();
    auto const Su = static_cast<std::size_t>(S);
    // The own node's rows: per node peer, the plan's slot runs into the
    // peer's expert rows; their metadata one message per peer.
    st.d1_send.assign(Su, 0);
    st.d1_recv.assign(Su, 0);
    st.d1_send_runs.assign(Su, {});
    st.d1_recv_runs.assign(Su, {});
    RowRuns meta_send(Su);
    std::vector<std::vector<index_t>> meta_lengths(Su);
    for (int k = 0; k < S; ++k) {
      auto const e = static_cast<std::size_t>(ep.slot_of(node.global_rank(k)));
      st.d1_send[k] = plan.counts[e];
      st.d1_send_runs[k] = plan.slot_runs[e];
      st.d1_recv[k] = agreed.recv[e];
      st.d1_recv_runs[k] = st.expert.expert_runs[e];
      meta_send[k] = {{plan.offsets[e], plan.counts[e]}};
      meta_lengths[k] = {agreed.recv[e]};
    }
    // Transit rows: to the relay, one run per destination rank.
    int const relay = node.slot_of(my_relay_);
    st.s1 = StageRecord<MS>{};
    st.s1.name = "gather to relay + node-local direct";
    st.s1.comm = 1;
    st.s1.send_counts.assign(Su, 0);
    st.s1_return_runs.assign(Su, {});
    // By destination node, that node's relay of this rail first (stage 2
    // hands it its own rows straight), then by node-local slot.
    std::vector<std::pair<std::pair<int, int>, int>> far;  // ((destination node, order there), EP peer slot)
    for (int e = 0; e < ep.size(); ++e) {
      auto const g = static_cast<std::size_t>(ep.global_rank(e));
      int const n = this->node_of_rank_[g];
      if (n == my_node_ || plan.counts[e] == 0) continue;
      far.push_back({{n, rail_relay_[static_cast<std::size_t>(n)] == static_cast<int>(g) ? -1 : group_slot_h_[g]}, e});
    }
    std::sort(far.begin(), far.end());
    for (auto const& [key, e] : far) {
      st.s1_return_runs[static_cast<std::size_t>(relay)].push_back({plan.offsets[e], plan.counts[e]});
      st.s1.send_counts[static_cast<std::size_t>(relay)] += plan.counts[e];
    }
    index_t const nt = st.s1.send_counts[static_cast<std::size_t>(relay)];
    st.s1.input_rows = nt;
    auto const agreed1 = agree_counts_and_runs(node, st.s1.send_counts, nt, st.s1_return_runs, comms.topology().size(),
                                               "hierarchical dispatch stage 1 counts", this->options());
    st.s1.recv_counts = agreed1.recv;
    st.s1_back_runs = consecutive_runs(agreed1.recv_run_lengths);
    index_t const n1 = Impl::total(st.s1.recv_counts);
    Flight f;
    f.r1 = payload_buffer(this->work_, exec, "s1_recv", this->config_.payload, d, n1);
    f.r1_meta = this->work_.template vector<RowMeta>(exec, "s1_recv_meta", n1);
    f.d1_meta = this->work_.template vector<RowMeta>(exec, "d1_recv_meta", Impl::total(st.d1_recv));
    this->pack_straight(exec, routes, plan, hidden, st.d1_send_runs[static_cast<std::size_t>(node.my_slot())],
                  st.d1_recv_runs[static_cast<std::size_t>(node.my_slot())], this->row_bytes_of(h.expert_rows),
                  "KokkosMoE::HierarchicalExchange::pack_own");
    if (own_relay) {
      index_t at = 0;
      for (int k = 0; k < node.my_slot(); ++k) at += st.s1.recv_counts[static_cast<std::size_t>(k)];
      auto const& runs = st.s1_return_runs[static_cast<std::size_t>(node.my_slot())];
      std::vector<std::pair<index_t, index_t>> places;
      for (auto const& [first, n] : runs) {
        places.push_back({at, n});
        at += n;
      }
      this->pack_straight(exec, routes, plan, hidden, runs, places, f.r1.bytes, "KokkosMoE::HierarchicalExchange::pack_transit");
    }
    RowSet<MS> rows{send.bytes, this->row_bytes_of(h.expert_rows), st.d1_send_runs, st.d1_recv_runs, /*self_in_place=*/true};
    rows.owners = h.expert_rows;
    f.direct = std::make_shared<RowsInFlight>(this->transport_->start_alltoallv(
        exec, node, {rows, record_rows(meta, f.d1_meta, meta_send, consecutive_runs(meta_lengths))}, st.d1_send, st.d1_recv,
        "hierarchical dispatch stage 1 direct rows", this->options()));
    this->transport_->alltoallv(exec, node,
                                {RowSet<MS>{send.bytes, f.r1.bytes, st.s1_return_runs, st.s1_back_runs, /*self_in_place=*/true},
                                 record_rows(meta, f.r1_meta, st.s1_return_runs, st.s1_back_runs)},
                                st.s1.send_counts, st.s1.recv_counts, "hierarchical dispatch stage 1 rows", this->options());
    StageLedger sl{st.s1.name, node.name()};
    sl.self_in_place = true;
    sl.extra_count_rounds = {ep.name()};
    auto const druns = runs_per_peer(st.d1_send_runs);
    std::vector<std::int64_t> const one(Su, 1);
    add_sends(sl, st.d1_send, node.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), sizeof(RowMeta), &druns, &one);
    auto const truns = runs_per_peer(st.s1_return_runs);
    add_sends(sl, st.s1.send_counts, node.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), sizeof(RowMeta), &truns);
    if (my_relay_ != this->me_) {
      sl.relay_rows += nt;
      sl.relay_bytes += nt * (send.row_bytes() + static_cast<std::int64_t>(sizeof(RowMeta)));
    }
    sl.seconds = lap();
    h.ledger.dispatch.stages.push_back(sl);
    relay_to_relay_direct(exec, st, f, h.expert_rows, h.ledger, lap, &h.flight);
    h.state = std::move(st);
    h.pending = std::move(f);
    h.seconds = timer.seconds();
    return h;
  }

  /// Stage 2 of a direct dispatch (relays): as relay_to_relay, but each
  /// source's rows for a node start with those for that node's relay of
  /// this rail (the stage-1 order puts them first), which go straight into
  /// its expert rows, one run per (origin, slot); the other rows go to the
  /// relay's stage-2 arrivals as before. One count round announces, per
  /// source, both parts; the receiver checks its own part against the
  /// counts every origin announced over EP.
  template <class T>
  void relay_to_relay_direct(Exec const& exec, State& st, Flight& f, RowMatrix<T, MS> const& expert_rows, ByteLedger& ledger,
                             Impl::Lap<Exec>& lap, RowsInFlight* flight) {
    auto const& comms = *this->comms_;
    auto const& ep = comms.ep();
    int const me = this->me_;
    int const nodes = comms.topology().num_nodes();
    int const my_node = my_node_;
    auto node_of = node_of_;
    auto rail_relay = rail_relay_d_;
    index_t const n1 = f.r1.rows();
    int const S = comms.node_local().size();
    int const M = max_node_;
    std::vector<index_t> const seg = Impl::offsets_of(st.s1.recv_counts);
    auto seg_d = scratch_copy(&this->work_, exec, "KokkosMoE::HierarchicalExchange::s1_segments", seg);
    // Rows per (source, destination node, for that node's relay or not).
    auto const hist = zeroed_counts(exec, "KokkosMoE::HierarchicalExchange::s2_hist", static_cast<index_t>(S) * nodes * 2);
    auto r1_meta = f.r1_meta;
    index_t misrouted = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::HierarchicalExchange::stage2_runs", Kokkos::RangePolicy<Exec>(exec, 0, n1),
        KOKKOS_LAMBDA(index_t p, index_t & bad) {
          int const src = Impl::segment_of(seg_d, S, p);
          int const dst = r1_meta(p).dest_rank;
          int const n = node_of(dst);
          Kokkos::atomic_add(&hist((static_cast<std::size_t>(src) * nodes + n) * 2 + (dst == rail_relay(n) ? 0 : 1)), index_t(1));
          if (n == my_node) ++bad;
        },
        misrouted);
    auto const h = Impl::host_vector(exec, hist);
    bool const relay = comms.is_relay();
    st.s2 = StageRecord<MS>{};
    st.s2.name = "relay to relay";
    st.s2.comm = 2;
    st.s2.input_rows = n1;
    st.kept_runs.clear();
    st.kept = 0;
    auto const N2 = static_cast<std::size_t>(nodes);
    st.s2.send_counts.assign(N2, 0);
    st.s2_runs.assign(N2, {});
    st.s2_own_send.assign(N2, 0);
    st.s2_own_meta_runs.assign(N2, {});
    RowRuns announce(N2), own_pieces(N2);
    for (std::size_t n = 0; n < N2; ++n)
      for (int src = 0; src < M; ++src) {
        // Every source slot announced (empty ones too), own part then the rest.
        std::size_t const b = (static_cast<std::size_t>(src) * N2 + n) * 2;
        index_t const own = src < S ? h[b] : 0, rest = src < S ? h[b + 1] : 0;
        announce[n].push_back({0, own});
        announce[n].push_back({0, rest});
      }
    for (int src = 0; src < S; ++src) {
      index_t at = seg[static_cast<std::size_t>(src)];
      for (std::size_t n = 0; n < N2; ++n) {
        std::size_t const b = (static_cast<std::size_t>(src) * N2 + n) * 2;
        index_t const own = h[b], rest = h[b + 1];
        if (own > 0) {
          own_pieces[n].push_back({at, own});
          st.s2_own_meta_runs[n].push_back({at, own});
          st.s2_own_send[n] += own;
        }
        if (rest > 0) {
          st.s2_runs[n].push_back({at + own, rest});
          st.s2.send_counts[n] += rest;
        }
        at += own + rest;
      }
    }
    // The own parts cut where the origin or the slot changes: one run per
    // (origin, slot), as the receiver lays them out.
    st.s2_own_runs = split_at_slots(n1 > 0 ? Impl::host_vector(exec, f.r1_meta) : std::vector<RowMeta>{}, own_pieces);
    agree(ep.comm(), problem_of([&] {
            KOKKOSMOE_REQUIRE(misrouted == 0, misrouted << " rows for ranks of this node arrived at rank " << me << " as transit");
            KOKKOSMOE_REQUIRE(relay || n1 == 0, n1 << " transit rows arrived at rank " << me << ", which is not a relay");
          }),
          "hierarchical relay check", this->config_.watchdog_seconds);
    f.r2 = payload_buffer(this->work_, exec, "s2_none", f.r1.type, f.r1.width, 0);
    f.r2_meta = meta_view();
    StageLedger sl{st.s2.name, relay ? comms.relay().name() : std::string("-")};
    std::string problem;
    if (relay) {
      auto const& rc = comms.relay();
      std::vector<index_t> both(N2);
      for (std::size_t n = 0; n < N2; ++n) both[n] = st.s2.send_counts[n] + st.s2_own_send[n];
      // What arrives: per relay peer and source slot, own rows then the rest.
      // A failed count agreement among the relays rides on the agreement
      // over EP below, so every rank fails alike.
      int const R = rc.size();
      st.s2.recv_counts.assign(static_cast<std::size_t>(R), 0);
      st.s2_own_recv.assign(static_cast<std::size_t>(R), 0);
      st.s2_own_recv_runs.assign(static_cast<std::size_t>(R), {});
      std::vector<std::vector<index_t>> rest_lengths(static_cast<std::size_t>(R));
      RowRuns own_meta_recv(static_cast<std::size_t>(R));
      index_t own_at = 0;
      problem = problem_of([&] {
        auto const agreed = agree_counts_and_every_run(rc, both, n1, announce, 2 * M, 2 * M, "hierarchical dispatch stage 2 counts",
                                                       this->options());
        for (int m = 0; m < R; ++m) {
          int const peer = rc.global_rank(m);
          int const node = comms.topology().node_of(peer);
          auto const& group = comms.layout().node_groups[static_cast<std::size_t>(node)];
          auto const& lengths = agreed.recv_run_lengths[static_cast<std::size_t>(m)];
          for (int src = 0; src < M; ++src) {
            index_t const own = lengths[static_cast<std::size_t>(2 * src)], rest = lengths[static_cast<std::size_t>(2 * src + 1)];
            index_t expected = 0;
            if (node != my_node && src < static_cast<int>(group.size()) &&
                relay_of_[static_cast<std::size_t>(group[static_cast<std::size_t>(src)])] == peer) {
              int const o = group[static_cast<std::size_t>(src)];
              for (auto const& run : st.expert.expert_runs[static_cast<std::size_t>(ep.slot_of(o))])
                if (run.second > 0) {
                  st.s2_own_recv_runs[static_cast<std::size_t>(m)].push_back(run);
                  expected += run.second;
                }
            }
            KOKKOSMOE_REQUIRE(own == expected, "relay " << peer << " announced " << own << " rows of its source slot " << src
                                                        << " for relay " << me << " itself, whose origin announced " << expected);
            if (own > 0) own_meta_recv[static_cast<std::size_t>(m)].push_back({own_at, own});
            own_at += own;
            st.s2_own_recv[static_cast<std::size_t>(m)] += own;
            if (rest > 0) rest_lengths[static_cast<std::size_t>(m)].push_back(rest);
            st.s2.recv_counts[static_cast<std::size_t>(m)] += rest;
          }
        }
      });
      agree(ep.comm(), problem, "hierarchical dispatch stage 2 runs", this->config_.watchdog_seconds);
      st.s2_recv_runs = consecutive_runs(rest_lengths);
      // The own rows first (straight into the expert rows), then the rest.
      f.own2_meta = this->work_.template vector<RowMeta>(exec, "s2_own_meta", own_at);
      RowSet<MS> own_rows{f.r1.bytes, this->row_bytes_of(expert_rows), st.s2_own_runs, st.s2_own_recv_runs};
      own_rows.owners = expert_rows;
      f.own2 = std::make_shared<RowsInFlight>(this->transport_->start_alltoallv(
          exec, rc, {own_rows, record_rows(f.r1_meta, f.own2_meta, st.s2_own_meta_runs, own_meta_recv)}, st.s2_own_send,
          st.s2_own_recv, "hierarchical dispatch stage 2 own rows", this->options()));
      index_t const n2 = Impl::total(st.s2.recv_counts);
      f.r2 = payload_buffer(this->work_, exec, "s2_recv", f.r1.type, f.r1.width, n2);
      f.r2_meta = this->work_.template vector<RowMeta>(exec, "s2_recv_meta", n2);
      *flight = this->transport_->start_alltoallv(exec, rc,
                                                  {RowSet<MS>{f.r1.bytes, f.r2.bytes, st.s2_runs, st.s2_recv_runs},
                                                   record_rows(f.r1_meta, f.r2_meta, st.s2_runs, st.s2_recv_runs)},
                                                  st.s2.send_counts, st.s2.recv_counts, "hierarchical dispatch stage 2 rows", this->options());
      auto const runs = runs_per_peer(st.s2_runs);
      add_sends(sl, st.s2.send_counts, rc.peer_order(), me, this->node_of_rank_, f.r1.row_bytes(), sizeof(RowMeta), &runs);
      auto const own_runs = runs_per_peer(st.s2_own_runs), own_meta = runs_per_peer(st.s2_own_meta_runs);
      add_sends(sl, st.s2_own_send, rc.peer_order(), me, this->node_of_rank_, f.r1.row_bytes(), sizeof(RowMeta), &own_runs, &own_meta);
    } else {
      agree(ep.comm(), problem, "hierarchical dispatch stage 2 runs", this->config_.watchdog_seconds);
    }
    sl.seconds = lap();
    ledger.dispatch.stages.push_back(sl);
  }

  /// \brief The rest of a direct dispatch, stage 2 arrived: stage 3 sends
  /// the metadata first (one run per origin and final rank); both sides
  /// then split those runs where the slot changes (an origin's rows for one
  /// rank are in slot order), the relay over its stage-2 arrivals and the
  /// final rank over what arrived, so each piece is one origin's rows for
  /// one local slot and goes straight to its expert rows. The arrival
  /// metadata in the flat order, and the repack plan checked against the
  /// runs, follow.
  template <class T>
  void finish_direct(Exec const& exec, State& st, DispatchHandle<T, MS>& h, Flight const& f) {
    auto const& comms = *this->comms_;
    auto const& ep = comms.ep();
    auto const& node = comms.node_local();
    int const S = node.size();
    f.direct->finish();  // the own node's rows
    if (f.own2) f.own2->finish();  // a relay's own rows from other nodes
    index_t const n2 = f.r2.rows();
    scatter_runs(exec, st, f.r2_meta, n2);
    // Final metadata: the own node's rows, a relay's own rows from stage 2,
    // then the stage-3 arrivals. A failed count agreement of one node rides
    // on the agreement over EP below, so every rank fails alike.
    index_t const nd = Impl::total(st.d1_recv), no = Impl::total(st.s2_own_recv);
    index_t n3 = 0;
    meta_view fin_meta;
    std::string const problem = problem_of([&] {
      auto const agreed = agree_counts_and_runs(node, st.s3.send_counts, n2, st.s3_runs, comms.topology().num_nodes() * max_node_,
                                                "hierarchical dispatch stage 3 counts", this->options());
      st.s3.recv_counts = agreed.recv;
      st.s3_recv_runs = consecutive_runs(agreed.recv_run_lengths);
      n3 = Impl::total(st.s3.recv_counts);
      fin_meta = this->work_.template vector<RowMeta>(exec, "final_meta", nd + no + n3);
      meta_view const r3_meta = Kokkos::subview(fin_meta, std::pair<index_t, index_t>(nd + no, nd + no + n3));
      this->transport_->alltoallv(exec, node, {record_rows(f.r2_meta, r3_meta, st.s3_runs, st.s3_recv_runs)}, st.s3.send_counts,
                                  st.s3.recv_counts, "hierarchical dispatch stage 3 metadata", this->options());
      st.s3_fine_send_runs = split_at_slots(n2 > 0 ? Impl::host_vector(exec, f.r2_meta) : std::vector<RowMeta>{}, st.s3_runs);
      std::vector<RowMeta> const arrived = n3 > 0 ? Impl::host_vector(exec, r3_meta) : std::vector<RowMeta>{};
      RowRuns const pieces = split_at_slots(arrived, st.s3_recv_runs);
      auto const& placement = this->placement_;
      st.s3_fine_recv_runs.assign(static_cast<std::size_t>(S), {});
      for (int k = 0; k < S; ++k)
        for (auto const& [first, n] : pieces[static_cast<std::size_t>(k)]) {
          RowMeta const& m = arrived[static_cast<std::size_t>(first)];
          bool const mine = m.slot >= 0 && m.slot < placement.num_slots() && m.dest_rank == this->me_ &&
                            placement.slots()[static_cast<std::size_t>(m.slot)].rank == this->me_ && m.origin_rank >= 0 &&
                            m.origin_rank < comms.topology().size();
          KOKKOSMOE_REQUIRE(mine, "hierarchical dispatch: relay " << node.global_rank(k) << " forwarded to rank " << this->me_
                                                                  << " rows for slot " << m.slot << " of rank " << m.dest_rank);
          auto const& run = st.expert.expert_runs[static_cast<std::size_t>(ep.slot_of(m.origin_rank))]
                                                 [static_cast<std::size_t>(placement.local_index(m.slot))];
          KOKKOSMOE_REQUIRE(run.second == n, "hierarchical dispatch: " << n << " rows of rank " << m.origin_rank << " for slot "
                                                                       << m.slot << " arrived at rank " << this->me_
                                                                       << " together, it announced " << run.second);
          st.s3_fine_recv_runs[static_cast<std::size_t>(k)].push_back({run.first, n});
        }
    });
    agree(ep.comm(), problem, "hierarchical dispatch stage 3 runs", this->config_.watchdog_seconds);
    RowSet<MS> rows{f.r2.bytes, this->row_bytes_of(h.expert_rows), st.s3_fine_send_runs, st.s3_fine_recv_runs};
    rows.owners = h.expert_rows;
    this->transport_->alltoallv(exec, node, {rows}, st.s3.send_counts, st.s3.recv_counts, "hierarchical dispatch stage 3 rows",
                                this->options());
    StageLedger sl{st.s3.name, node.name()};
    auto const fine = runs_per_peer(st.s3_fine_send_runs);
    auto const coarse = runs_per_peer(st.s3_runs);
    add_sends(sl, st.s3.send_counts, node.peer_order(), this->me_, this->node_of_rank_, f.r2.row_bytes(), sizeof(RowMeta), &fine, &coarse);
    add_scatter_relay_rows(sl, st, f.r2.row_bytes());
    h.ledger.dispatch.stages.push_back(sl);
    // The own node's metadata in front of the stage-3 arrivals, then the flat order.
    if (nd > 0) Kokkos::deep_copy(exec, Kokkos::subview(fin_meta, std::pair<index_t, index_t>(0, nd)), f.d1_meta);
    if (no > 0) Kokkos::deep_copy(exec, Kokkos::subview(fin_meta, std::pair<index_t, index_t>(nd, nd + no)), f.own2_meta);
    sort_by_origin(exec, st, h, fin_meta, nd + no + n3);
    this->check_direct_repack(exec, h, st.expert);
  }

  /// Runs cut wherever the origin or the slot changes (meta: the rows'
  /// metadata on the host), per peer, in order.
  static RowRuns split_at_slots(std::vector<RowMeta> const& meta, RowRuns const& runs) {
    RowRuns out(runs.size());
    for (std::size_t k = 0; k < runs.size(); ++k)
      for (auto const& [first, n] : runs[k]) {
        index_t at = first;
        for (index_t i = first + 1; i <= first + n; ++i) {
          if (i < first + n) {
            RowMeta const& a = meta[static_cast<std::size_t>(i - 1)];
            RowMeta const& b = meta[static_cast<std::size_t>(i)];
            if (a.slot == b.slot && a.origin_rank == b.origin_rank) continue;
          }
          out[k].push_back({at, i - at});
          at = i;
        }
      }
    return out;
  }

  /// combine_start of a direct dispatch: the transit rows' results go from
  /// their expert rows back into the relays' stage-2 arrival layout
  /// (reverse of stage 3), the own node's results straight from their
  /// expert rows into the origins' return buffers (posted: they wait for
  /// nothing from other nodes), and the reverse of stage 2 is posted.
  template <class T>
  void combine_start_direct(Exec const& exec, State const& st, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& out,
                            PayloadBuffer<MS> const& returned, Impl::Lap<Exec>& lap) {
    auto const& node = this->comms_->node_local();
    int const d = static_cast<int>(out.extent(1));
    auto const type = this->config_.return_payload;
    auto const bytes = this->row_bytes_of(out);
    auto s2_in_back = payload_buffer(this->work_, exec, "s2_in_back", type, d, st.s3.input_rows);
    agree_counts(node, st.s3.recv_counts, Impl::total(st.s3.recv_counts), &st.s3.send_counts, "hierarchical combine stage 3 counts",
                 this->options());
    RowSet<MS> back3{bytes, s2_in_back.bytes, st.s3_fine_recv_runs, st.s3_fine_send_runs};
    back3.owners = out;
    this->transport_->alltoallv(exec, node, {back3}, st.s3.recv_counts, st.s3.send_counts, "hierarchical combine stage 3 rows",
                                this->options());
    StageLedger c3{"relay gather (reverse of relay scatter)", node.name()};
    auto const runs3 = runs_per_peer(st.s3_fine_recv_runs);
    add_sends(c3, st.s3.recv_counts, node.peer_order(), this->me_, this->node_of_rank_, s2_in_back.row_bytes(), 0, &runs3);
    c3.seconds = lap();
    h.ledger.combine.stages.push_back(c3);
    // The own node's results: their counts are the dispatch's, agreed over EP.
    RowSet<MS> back1{bytes, returned.bytes, st.d1_recv_runs, st.d1_send_runs};
    back1.owners = out;
    auto direct = std::make_shared<RowsInFlight>(this->transport_->start_alltoallv(
        exec, node, {back1}, st.d1_recv, st.d1_send, "hierarchical combine stage 1 direct rows", this->options()));
    auto s1_back = payload_buffer(this->work_, exec, "s1_recv_back", type, d, Impl::total(st.s1.recv_counts));
    std::shared_ptr<RowsInFlight> own2;
    if (this->comms_->is_relay()) {
      // A relay's own results, straight from their expert rows to the relays
      // their rows came from (into the runs stage 2 sent them from).
      auto const& rc = this->comms_->relay();
      RowSet<MS> own{bytes, s1_back.bytes, st.s2_own_recv_runs, st.s2_own_runs};
      own.owners = out;
      own2 = std::make_shared<RowsInFlight>(this->transport_->start_alltoallv(
          exec, rc, {own}, st.s2_own_recv, st.s2_own_send, "hierarchical combine stage 2 own rows", this->options()));
    }
    reverse_relay(exec, st, s2_in_back, s1_back, h.ledger, lap, &h.flight);
    if (own2) {
      auto const& rc = this->comms_->relay();
      auto const runs = runs_per_peer(st.s2_own_recv_runs);
      add_sends(h.ledger.combine.stages.back(), st.s2_own_recv, rc.peer_order(), this->me_, this->node_of_rank_, s1_back.row_bytes(), 0,
                &runs);
    }
    h.pending = CombineFlight{{}, s1_back, direct, own2};
  }

  /// Reverse of stage 1 of a direct dispatch: relays return the transit
  /// rows' results into the origins' return buffers (the plan's runs); the
  /// own node's results, posted by combine_start, complete.
  void reverse_gather_direct(Exec const& exec, State const& st, CombineFlight const& f, PayloadBuffer<MS> const& returned,
                             ByteLedger& ledger) {
    auto const& node = this->comms_->node_local();
    if (f.own2) f.own2->finish();
    agree_counts(node, st.s1.recv_counts, Impl::total(st.s1.recv_counts), &st.s1.send_counts, "hierarchical combine stage 1 counts",
                 this->options());
    this->transport_->alltoallv(exec, node, {RowSet<MS>{f.s2_back.bytes, returned.bytes, st.s1_back_runs, st.s1_return_runs}},
                                st.s1.recv_counts, st.s1.send_counts, "hierarchical combine stage 1 rows", this->options());
    f.direct->finish();
    StageLedger c1{"return from relay + node-local direct", node.name()};
    auto const druns = runs_per_peer(st.d1_recv_runs);
    add_sends(c1, st.d1_recv, node.peer_order(), this->me_, this->node_of_rank_, returned.row_bytes(), 0, &druns);
    auto const truns = runs_per_peer(st.s1_back_runs);
    add_sends(c1, st.s1.recv_counts, node.peer_order(), this->me_, this->node_of_rank_, returned.row_bytes(), 0, &truns);
    ledger.combine.stages.push_back(c1);
    mirror_relay_rows(ledger, returned.row_bytes());
  }

  /// The reverse stages move the same relay rows as their dispatch mirrors
  /// (attributed to this rank's dispatch role; sums over ranks agree).
  static void mirror_relay_rows(ByteLedger& ledger, std::int64_t row_bytes) {
    auto const& dl = ledger.dispatch.stages;
    auto& cl = ledger.combine.stages;
    for (std::size_t i = 0; i < cl.size() && i < dl.size(); ++i) {
      cl[i].relay_rows = dl[dl.size() - 1 - i].relay_rows;
      cl[i].relay_bytes = cl[i].relay_rows * row_bytes;
    }
  }

  /// The final buffer's metadata (nf rows) in the flat arrival order: a
  /// stable sort on the origin's EP peer slot (State::canonical_from),
  /// into h.arrived_meta, with the rows per origin.
  template <class T>
  void sort_by_origin(Exec const& exec, State& st, DispatchHandle<T, MS>& h, meta_view const& fin_meta, index_t nf) {
    auto ep_slot = ep_slot_;
    int const P = this->comms_->ep().size();
    auto keyc = this->work_.template vector<int>(exec, "keyc", nf);
    Kokkos::parallel_for(
        "KokkosMoE::HierarchicalExchange::origin_keys", Kokkos::RangePolicy<Exec>(exec, 0, nf),
        KOKKOS_LAMBDA(index_t p) { keyc(p) = ep_slot(fin_meta(p).origin_rank); });
    st.canonical_from = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalExchange::canonical_from", nf);
    auto const origin_offsets = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalExchange::origin_offsets", P + 1);
    stable_counting_sort(exec, keyc, P, st.canonical_from, origin_offsets, "KokkosMoE::HierarchicalExchange::canonical", &this->work_);
    h.arrived_meta = this->work_.template vector<RowMeta>(exec, "arrived_meta", nf);
    gather_records(exec, fin_meta, st.canonical_from, h.arrived_meta, "KokkosMoE::HierarchicalExchange::canonical_meta");
    auto const ho = Impl::host_vector(exec, origin_offsets);
    h.recv_counts.resize(static_cast<std::size_t>(P));
    for (int p = 0; p < P; ++p) h.recv_counts[p] = ho[p + 1] - ho[p];
  }

  /// n zeroed counters from the workspace.
  index_view zeroed_counts(Exec const& exec, char const* label, index_t n) {
    auto const v = scratch<index_view>(&this->work_, exec, label, n);
    Kokkos::deep_copy(exec, v, index_t(0));
    return v;
  }

  /// Stable sort of a stage's rows by destination key; the record's send
  /// counts are the key buckets.
  StageRecord<MS> sort_stage(Exec const& exec, Kokkos::View<int*, MS> const& keys, int num_keys, char const* stage_name) {
    StageRecord<MS> s;
    s.name = stage_name;
    s.send_perm = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalExchange::sort::perm", static_cast<index_t>(keys.extent(0)));
    auto const off = scratch<index_view>(&this->work_, exec, "KokkosMoE::HierarchicalExchange::sort::offsets", num_keys + 1);
    stable_counting_sort(exec, keys, num_keys, s.send_perm, off, "KokkosMoE::HierarchicalExchange::sort", &this->work_);
    auto const ho = Impl::host_vector(exec, off);
    s.send_counts.resize(static_cast<std::size_t>(num_keys));
    for (int k = 0; k < num_keys; ++k) s.send_counts[k] = ho[k + 1] - ho[k];
    return s;
  }

  /// One dispatch stage's transport: the rows and metadata in the stage's
  /// send order go to their peers of comm after the counts are agreed;
  /// returns what arrived (after `front` rows left for the caller) and
  /// records the receive counts. With runs (at most max_runs per peer),
  /// their lengths travel with the counts, one round, and recv_runs gets
  /// the peers' runs laid out one after the other; the rows travel in
  /// those runs unless send_in_runs is false (runs only announced).
  /// place_self: where the rank's own payload rows need no copy. Given a
  /// function, it is called with the arrivals (counts agreed) to write
  /// them there; given leave_self, they stay in the send buffer and
  /// the arrivals' own segment is left unwritten (metadata is copied).
  using PlaceSelf = std::function<void(PayloadBuffer<MS> const&)>;
  static void leave_self(PayloadBuffer<MS> const&) {}
  std::pair<PayloadBuffer<MS>, meta_view> exchange_stage(Exec const& exec, Topology::Communicator const& comm, StageRecord<MS>& stage,
                                                         PayloadBuffer<MS> const& send, meta_view const& send_meta, index_t count,
                                                         std::string const& key, std::string const& what,
                                                         RowsInFlight* flight = nullptr, index_t front = 0,
                                                         RowRuns const* runs = nullptr, RowRuns* recv_runs = nullptr,
                                                         int max_runs = 0, bool send_in_runs = true,
                                                         PlaceSelf const& place_self = {}) {
    if (runs) {
      // Counts and run lengths in one round (one latency on the relay link).
      auto agreed = agree_counts_and_runs(comm, stage.send_counts, count, *runs, max_runs, (what + " counts").c_str(), this->options());
      stage.recv_counts = std::move(agreed.recv);
      *recv_runs = consecutive_runs(agreed.recv_run_lengths);
    } else {
      stage.recv_counts = agree_counts(comm, stage.send_counts, count, nullptr, (what + " counts").c_str(), this->options()).recv;
    }
    index_t const n = Impl::total(stage.recv_counts);
    auto recv = payload_buffer(this->work_, exec, key + "_recv", send.type, send.width, front + n);
    auto recv_meta = this->work_.template vector<RowMeta>(exec, key + "_recv_meta", front + n);
    auto const arrivals = suffix(recv, front);
    meta_view const arrivals_meta = Kokkos::subview(recv_meta, std::pair<index_t, index_t>(front, front + n));
    RowRuns const none;
    RowRuns const& r = runs && send_in_runs ? *runs : none;
    RowRuns const& rr = runs && send_in_runs ? *recv_runs : none;
    if (place_self) place_self(arrivals);
    std::vector<RowSet<MS>> const sets{RowSet<MS>{send.bytes, arrivals.bytes, r, rr, static_cast<bool>(place_self)},
                                       record_rows(send_meta, arrivals_meta, r, rr)};
    if (flight)
      *flight = this->transport_->start_alltoallv(exec, comm, sets, stage.send_counts, stage.recv_counts, (what + " rows").c_str(),
                                                  this->options());
    else
      this->transport_->alltoallv(exec, comm, sets, stage.send_counts, stage.recv_counts, (what + " rows").c_str(), this->options());
    return {recv, recv_meta};
  }

  static PayloadBuffer<MS> prefix(PayloadBuffer<MS> const& b, index_t n) {
    PayloadBuffer<MS> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(0, n), Kokkos::ALL);
    return p;
  }
  static PayloadBuffer<MS> rows_of(PayloadBuffer<MS> const& b, index_t first, index_t n) {
    PayloadBuffer<MS> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(first, first + n), Kokkos::ALL);
    return p;
  }
  static PayloadBuffer<MS> suffix(PayloadBuffer<MS> const& b, index_t from) {
    PayloadBuffer<MS> p = b;
    p.bytes = Kokkos::subview(b.bytes, std::pair<index_t, index_t>(from, b.rows()), Kokkos::ALL);
    return p;
  }

  /// Transit rows (destination on another node) among the first n of meta.
  std::int64_t transit_rows(Exec const& exec, meta_view const& meta, index_t n) const {
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
  Kokkos::View<int*, MS> node_of_, node_slot_, ep_slot_, group_slot_;
  std::vector<int> group_slot_h_;
  std::vector<int> rail_relay_;             ///< per node: the relay of this rank's rail there
  Kokkos::View<int*, MS> rail_relay_d_;
  std::vector<int> relay_of_;               ///< per rank: its stage-1 relay
  int max_node_ = 1;  ///< ranks of the largest node
  int my_node_ = -1;
  int my_relay_ = -1;
};

template <>
struct AlgorithmClass<Algorithm::hierarchical> {
  template <class Exec, class MS>
  using type = HierarchicalExchange<Exec, MS>;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
