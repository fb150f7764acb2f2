#ifndef KOKKOSMOE_EXCHANGE_FLAT_HPP
#define KOKKOSMOE_EXCHANGE_FLAT_HPP

/// \file KokkosMoE_Exchange_Flat.hpp
/// \brief Flat exchange: one variable all-to-all of rows plus metadata over
/// the full EP communicator in its peer order; combine is the exact reverse
/// through the dispatch handle.
///
/// dispatch: pack (rows in the plan's send order, encoded to the dispatch
/// payload) -> count agreement -> all-to-all -> repack plan -> expert rows.
/// combine: expert outputs to arrival order (encoded to the return payload)
/// -> count agreement against the dispatch -> reverse all-to-all, straight
/// into the caller's return buffer (send order).
///
/// Where both payloads are the rows' own type (ExchangeConfig::
/// receive_into_experts), neither repack copies anything: a source's rows
/// for one rank are in that rank's local slot order already (the plan sorts
/// by destination, then slot), so each (source, slot) run goes straight to
/// its place in the expert-major rows (expert rows of a slot are by source,
/// then send position: the repack's order), and the combine sends the expert
/// outputs back from those places into the return buffer's runs. The count
/// agreement announces every run (empty ones too), so a receiver knows each
/// run's slot before any row moves; the metadata arrives in arrival order
/// (one message per peer), and the repack plan built from it is checked
/// against the runs, row by row. On host memory over MPI the rows are not
/// packed either: each peer's rows go as one message straight from the
/// hidden rows (an indexed datatype naming each route's token row), so
/// every row is copied once, by MPI, as a raw MPI_Alltoallv of packed rows
/// copies its bytes (ExchangeBase::sends_from_hidden).

#include <KokkosMoE_Exchange_Planner.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

namespace KokkosMoE {
namespace Exchange {

template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class FlatExchange : public Impl::ExchangeBase<ExecutionSpace, MemorySpace> {
  using base = Impl::ExchangeBase<ExecutionSpace, MemorySpace>;

 public:
  static constexpr Algorithm algorithm = Algorithm::flat;

  /// \brief See Impl::ExchangeBase: comms must outlive the exchange.
  FlatExchange(Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config = {},
               PlacementRegistry const* registry = nullptr)
      : base(algorithm, comms, std::move(placement), config, registry) {}

  /// \brief One wave per step.
  int waves() const { return 1; }

  /// \brief The runs of a dispatch whose rows went straight to their
  /// expert-major places (the handle's state), for its combine.
  using Direct = typename base::DirectRuns;

  /// \brief Collective over the EP communicator: the routes of `routes`
  /// (send order of `plan`) to the ranks holding their slots; returns the
  /// handle whose expert rows are this rank's expert-major inputs.
  template <class T>
  DispatchHandle<T, MemorySpace> dispatch(ExecutionSpace const& exec, RoutePlan<MemorySpace> const& routes,
                                          DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                                          int wave = 0) {
    auto h = dispatch_start(exec, routes, plan, hidden, wave);
    dispatch_finish(exec, h);
    return h;
  }

  /// \brief The first half of dispatch: pack, count agreement, rows posted.
  /// The returned handle is in flight (its send and receive buffers are its
  /// own) until dispatch_finish; the caller may compute meanwhile.
  template <class T>
  DispatchHandle<T, MemorySpace> dispatch_start(ExecutionSpace const& exec, RoutePlan<MemorySpace> const& routes,
                                                DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                                                int wave = 0) {
    if (this->template receives_into_experts<T>()) return dispatch_start_direct(exec, routes, plan, hidden, wave);
    auto const& ep = this->comms_->ep();
    int const d = static_cast<int>(hidden.extent(1));
    Kokkos::Timer timer;
    auto h = this->template new_handle<T>(routes, plan, wave);
    PayloadBuffer<MemorySpace> send;
    Kokkos::View<RowMeta*, MemorySpace> meta;
    std::string const problem = this->pack_local(exec, h, routes, plan, hidden, waves(), false, send, meta);
    auto const agreed = agree_counts(ep, plan.counts, plan.rows(), nullptr, "flat dispatch counts", this->options(), problem);
    h.recv_counts = agreed.recv;
    index_t const n = Impl::total(agreed.recv);
    auto arrived = payload_buffer(this->work_, exec, "arrived", this->config_.payload, d, n);
    h.arrived_meta = this->work_.template vector<RowMeta>(exec, "arrived_meta", n);
    h.flight = this->transport_->start_alltoallv(
        exec, ep, {RowSet<MemorySpace>{send.bytes, arrived.bytes}, record_rows(meta, h.arrived_meta)},
        plan.counts, agreed.recv, "flat dispatch rows", this->options());
    h.ledger = this->new_ledger(d);
    StageLedger stage{"all-to-all", ep.name()};
    add_sends(stage, plan.counts, ep.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), sizeof(RowMeta));
    h.ledger.dispatch.stages.push_back(stage);
    h.ledger.dispatch.useful_rows = n;
    h.pending = arrived;
    h.seconds = timer.seconds();
    return h;
  }

  /// \brief The second half of dispatch: waits for the rows (under the
  /// watchdog) and repacks them expert-major; the handle is then delivered.
  template <class T>
  void dispatch_finish(ExecutionSpace const& exec, DispatchHandle<T, MemorySpace>& h) {
    auto const& ep = this->comms_->ep();
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(!h.delivered && h.pending.has_value(), "flat dispatch_finish: the handle is not a dispatch in flight");
    h.flight.finish();
    if (Direct const* direct = std::any_cast<Direct>(&h.state)) {
      // The rows are in place; the repack plan (what the handle's users
      // read) follows from the metadata and must put every row where its
      // run put it.
      h.pending.reset();
      this->check_direct_repack(exec, h, *direct);
      Compat::fence(exec, "KokkosMoE::FlatExchange::dispatch");
      h.seconds += timer.seconds();
      h.ledger.dispatch.stages.back().seconds = h.seconds;
      h.delivered = true;
      return;
    }
    auto const arrived = std::any_cast<PayloadBuffer<MemorySpace>>(h.pending);
    h.pending.reset();
    int const d = arrived.width;
    agree(ep.comm(), problem_of([&] {
            h.repack = make_repack_plan(exec, h.arrived_meta, this->placement_, this->me_, &this->work_);
            this->set_expert_rows(exec, h, h.repack.slot_counts, d);
            repack(exec, h.repack, arrived, h.expert_rows);
          }),
          "flat dispatch repack", this->config_.watchdog_seconds);
    Compat::fence(exec, "KokkosMoE::FlatExchange::dispatch");
    h.seconds += timer.seconds();
    h.ledger.dispatch.stages.back().seconds = h.seconds;
    h.delivered = true;
  }

  /// \brief Collective: the exact reverse of the handle's dispatch.
  /// expert_out holds one output row per expert row (expert-major); returned
  /// (one row per dispatched route, the return payload) receives them in the
  /// plan's send order, ready for combine(). Rejects, on every rank, a handle
  /// of another algorithm, communicator epoch or placement generation, one
  /// whose dispatch has not finished, a second combine, counts that
  /// disagree, and a non-empty local_problem (this rank could not produce
  /// expert_out, e.g. its experts failed).
  template <class T>
  void combine(ExecutionSpace const& exec, DispatchHandle<T, MemorySpace>& h, RowMatrix<T, MemorySpace> const& expert_out,
               PayloadBuffer<MemorySpace> const& returned, std::string const& local_problem = {}) {
    combine_start(exec, h, expert_out, returned, local_problem);
    combine_finish(exec, h);
  }

  /// \brief The first half of combine: checks, unrepack, count agreement,
  /// rows posted; `returned` is written when combine_finish returns.
  template <class T>
  void combine_start(ExecutionSpace const& exec, DispatchHandle<T, MemorySpace>& h, RowMatrix<T, MemorySpace> const& expert_out,
                     PayloadBuffer<MemorySpace> const& returned, std::string const& local_problem = {}) {
    auto const& ep = this->comms_->ep();
    int const d = static_cast<int>(h.expert_rows.extent(1));
    if (Direct const* direct = std::any_cast<Direct>(&h.state)) return combine_start_direct(exec, h, *direct, expert_out, returned, local_problem);
    Kokkos::Timer timer;
    PayloadBuffer<MemorySpace> back;
    std::string problem = local_problem.empty() ? this->combine_problem(h, expert_out, returned) : local_problem;
    if (problem.empty()) problem = problem_of([&] {
      back = payload_buffer(this->work_, exec, "back", this->config_.return_payload, d, h.repack.rows());
      unrepack(exec, h.repack, expert_out, back);
    });
    auto const agreed = agree_counts(ep, h.recv_counts, h.repack.rows(), &h.plan.counts, "flat combine counts", this->options(), problem);
    h.combine_started = true;
    h.flight = this->transport_->start_alltoallv(exec, ep, {RowSet<MemorySpace>{back.bytes, returned.bytes}}, h.recv_counts, agreed.recv,
                                                 "flat combine rows", this->options());
    this->set_combine_format(h.ledger, d);
    StageLedger stage{"all-to-all (reverse)", ep.name()};
    add_sends(stage, h.recv_counts, ep.peer_order(), this->me_, this->node_of_rank_, back.row_bytes(), 0);
    h.ledger.combine.stages = {stage};
    h.ledger.combine.useful_rows = h.plan.rows();
    h.seconds = timer.seconds();
  }

  /// \brief The second half of combine: returns with `returned` written.
  template <class T>
  void combine_finish(ExecutionSpace const& exec, DispatchHandle<T, MemorySpace>& h) {
    Kokkos::Timer timer;
    KOKKOSMOE_REQUIRE(h.combine_started && !h.combined, "flat combine_finish: the handle is not a combine in flight");
    h.flight.finish();
    Compat::fence(exec, "KokkosMoE::FlatExchange::combine");
    h.seconds += timer.seconds();
    h.ledger.combine.stages.back().seconds = h.seconds;
    h.combined = true;
  }

  /// \brief The per-rank ledgers this algorithm would report (planner).
  static std::vector<ByteLedger> plan(PlanInput const& in) { return plan_flat(in); }

  /// \brief dispatch_start where rows land in their expert-major places
  /// (see the file's description).
  template <class T>
  DispatchHandle<T, MemorySpace> dispatch_start_direct(ExecutionSpace const& exec, RoutePlan<MemorySpace> const& routes,
                                                       DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                                                       int wave) {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    int const d = static_cast<int>(hidden.extent(1));
    Kokkos::Timer timer;
    auto h = this->template new_handle<T>(routes, plan, wave);
    PayloadBuffer<MemorySpace> send;
    Kokkos::View<RowMeta*, MemorySpace> meta;
    // The own rows are not packed: they go straight into their expert rows.
    // The peers' rows are packed, or go from the hidden rows themselves.
    bool const gathered = this->sends_from_hidden();
    typename RowSet<MemorySpace>::rows_view source;
    std::shared_ptr<std::vector<int> const> source_rows;
    std::string const problem = gathered ? this->gather_local(exec, h, routes, plan, hidden, waves(), source, meta, source_rows)
                                         : this->pack_local(exec, h, routes, plan, hidden, waves(), true, send, meta, /*skip_own=*/true);
    if (gathered) {
      send.type = this->config_.payload;
      send.width = d;
    }
    int const L = this->placement_.num_slots_of_rank(this->me_);
    auto const agreed = agree_counts_and_every_run(ep, plan.counts, plan.rows(), plan.slot_runs, this->max_slots_per_rank(), L,
                                                   "flat dispatch counts", this->options(), problem);
    h.recv_counts = agreed.recv;
    Direct direct = this->direct_layout(exec, h, agreed.recv_run_lengths, d);
    index_t const n = Impl::total(agreed.recv);
    h.arrived_meta = this->work_.template vector<RowMeta>(exec, "arrived_meta", n);
    int const me = ep.my_slot();
    this->pack_straight(exec, routes, plan, hidden, plan.slot_runs[static_cast<std::size_t>(me)],
                        direct.expert_runs[static_cast<std::size_t>(me)], this->row_bytes_of(h.expert_rows),
                        "KokkosMoE::FlatExchange::pack_own");
    RowSet<MemorySpace> rows{send.bytes, this->row_bytes_of(h.expert_rows), plan.slot_runs, direct.expert_runs, /*self_in_place=*/true};
    if (gathered) {
      rows.send = source;
      rows.send_runs.clear();
      rows.send_rows = source_rows;
    }
    rows.owners = std::make_pair(h.expert_rows, source);
    // Metadata in arrival order (by source, then send position): one
    // message per peer.
    h.flight = this->transport_->start_alltoallv(exec, ep, {rows, record_rows(meta, h.arrived_meta)}, plan.counts, agreed.recv,
                                                 "flat dispatch rows", this->options());
    h.ledger = this->new_ledger(d);
    StageLedger stage{"all-to-all", ep.name()};
    stage.self_in_place = true;  // the own rows were packed straight into their expert rows
    auto const runs = runs_per_peer(plan.slot_runs);
    std::vector<std::int64_t> const one(static_cast<std::size_t>(P), 1);
    add_sends(stage, plan.counts, ep.peer_order(), this->me_, this->node_of_rank_, send.row_bytes(), sizeof(RowMeta),
              gathered ? &one : &runs, &one);  // gathered: one message per peer
    h.ledger.dispatch.stages.push_back(stage);
    h.ledger.dispatch.useful_rows = n;
    h.ledger.dispatch.rows_in_place = true;
    h.state = std::move(direct);
    h.pending = true;
    h.seconds = timer.seconds();
    return h;
  }

  /// \brief combine_start of a direct dispatch: the expert outputs go back
  /// from the runs their rows arrived in, into the return buffer's slot runs.
  template <class T>
  void combine_start_direct(ExecutionSpace const& exec, DispatchHandle<T, MemorySpace>& h, Direct const& direct,
                            RowMatrix<T, MemorySpace> const& expert_out, PayloadBuffer<MemorySpace> const& returned,
                            std::string const& local_problem) {
    auto const& ep = this->comms_->ep();
    int const d = static_cast<int>(h.expert_rows.extent(1));
    Kokkos::Timer timer;
    RowMatrix<T, MemorySpace> out = expert_out;
    std::string problem = local_problem.empty() ? this->combine_problem(h, expert_out, returned) : local_problem;
    if (problem.empty()) problem = problem_of([&] { out = this->contiguous_rows(exec, expert_out); });
    auto const agreed = agree_counts(ep, h.recv_counts, h.repack.rows(), &h.plan.counts, "flat combine counts", this->options(), problem);
    h.combine_started = true;
    RowSet<MemorySpace> rows{this->row_bytes_of(out), returned.bytes, direct.expert_runs, h.plan.slot_runs};
    rows.owners = out;
    h.flight = this->transport_->start_alltoallv(exec, ep, {rows}, h.recv_counts, agreed.recv, "flat combine rows", this->options());
    this->set_combine_format(h.ledger, d);
    StageLedger stage{"all-to-all (reverse)", ep.name()};
    auto const runs = runs_per_peer(direct.expert_runs);
    add_sends(stage, h.recv_counts, ep.peer_order(), this->me_, this->node_of_rank_, returned.row_bytes(), 0, &runs);
    h.ledger.combine.stages = {stage};
    h.ledger.combine.rows_in_place = true;
    h.ledger.combine.useful_rows = h.plan.rows();
    h.seconds = timer.seconds();
  }

};

template <>
struct AlgorithmClass<Algorithm::flat> {
  template <class Exec, class MS>
  using type = FlatExchange<Exec, MS>;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
