#ifndef KOKKOSMOE_EXCHANGE_FLAT_HPP
#define KOKKOSMOE_EXCHANGE_FLAT_HPP

/// \file KokkosMoE_Exchange_Flat.hpp
/// \brief Flat exchange: one variable all-to-all of rows plus metadata over
/// the full EP communicator in its peer order; combine is the exact reverse
/// through the dispatch handle.

#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

namespace KokkosMoE {
namespace Exchange {

/// \brief Flat exchange over a communicator set's EP communicator.
template <class Transport = Mpi, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class FlatExchange {
 public:
  using memory_space = MemorySpace;
  static constexpr char const* name = "flat";

  /// \brief The exchange keeps a reference to comms (which must outlive it).
  /// With a registry, combine validates handles through it; without one a
  /// handle must carry the generation of the exchange's latest dispatch.
  explicit FlatExchange(Topology::CommunicatorSet const& comms, TransportOptions options = {},
                        PlacementRegistry const* registry = nullptr)
      : comms_(&comms), options_(options), registry_(registry), transport_(comms) {
  }

  /// \brief Collective over the EP communicator: agrees counts, moves the
  /// packed rows (send order of plan, EP peer order) and their metadata, and
  /// builds the repack of the arrived rows. `ref` is the registry reference
  /// of the placement generation (may be empty without a registry).
  template <class Exec>
  DispatchHandle<MemorySpace> dispatch(Exec const& exec, Placement const& placement, DispatchPlan<MemorySpace> const& plan,
                                       PayloadBuffer<MemorySpace> const& send, Kokkos::View<RowMeta*, MemorySpace> const& meta,
                                       GenerationHandle ref = {}) {
    auto const& ep = comms_->ep();
    Kokkos::Timer timer;
    DispatchHandle<MemorySpace> h;
    h.algorithm = name;
    h.generation = placement.generation();
    h.epoch = comms_->epoch();
    h.generation_ref = std::move(ref);
    h.plan = plan;
    // Local checks ride on the count agreement: the first synchronisation is
    // point to point under the watchdog, and a problem fails every rank.
    std::string const problem = Impl::problem_of([&] {
      KOKKOSMOE_REQUIRE(plan.peer_order == ep.peer_order(), "flat dispatch: the dispatch plan was built for another peer order");
      KOKKOSMOE_REQUIRE(send.rows() == plan.rows() && static_cast<index_t>(meta.extent(0)) == plan.rows(),
                        "flat dispatch: " << send.rows() << " packed rows and " << meta.extent(0) << " metadata records for "
                                          << plan.rows() << " planned rows");
    });
    auto agreed = agree_counts(ep, plan.counts, send.rows(), nullptr, "flat dispatch counts", options_, problem);
    h.recv_counts = agreed.recv;
    h.recv_offsets = Impl::offsets_of(agreed.recv);
    index_t const n = h.recv_offsets.back();
    h.arrived = work_.payload(exec, "flat_arrived", send.type, send.width, n);
    h.arrived_meta = work_.meta(exec, "flat_arrived_meta", n);
    transport_.alltoallv(exec, ep, {RowSet<MemorySpace>{send.bytes, h.arrived.bytes}, RowSet<MemorySpace>{as_rows(meta), as_rows(h.arrived_meta)}},
                   plan.counts, agreed.recv, "flat dispatch rows", options_);
    agree_or_throw(ep, Impl::problem_of([&] { h.repack = make_repack_plan(exec, h.arrived_meta, placement, comms_->global_rank()); }),
                   "flat dispatch repack", options_);
    h.ledger = Impl::new_ledger(name, send, 1);
    StageLedger stage{"all-to-all", ep.name()};
    add_sends(stage, plan.counts, ep.peer_order(), comms_->global_rank(), Impl::node_of_rank(*comms_), send.row_bytes(),
              sizeof(RowMeta));
    Compat::fence(exec, "KokkosMoE::FlatExchange::dispatch");
    stage.seconds = timer.seconds();
    h.ledger.dispatch.stages.push_back(stage);
    h.ledger.dispatch.useful_rows = n;
    last_generation_ = h.generation;
    return h;
  }

  /// \brief Collective: the exact reverse of the handle's dispatch. `back`
  /// holds one row per arrived row, in arrival order (e.g. unrepack of the
  /// expert outputs). Returns the rows in the source's send order, ready for
  /// combine(). Rejects (on every rank) a handle from another communicator
  /// epoch or a generation that is not live, and counts that disagree.
  /// `local_problem` (non-empty: this rank could not produce `back`, e.g. its
  /// experts failed) fails the combine on every rank with that message.
  template <class Exec>
  PayloadBuffer<MemorySpace> combine(Exec const& exec, DispatchHandle<MemorySpace>& h, PayloadBuffer<MemorySpace> const& back,
                                     std::string const& local_problem = {}) {
    auto const& ep = comms_->ep();
    Kokkos::Timer timer;
    std::string const problem =
        local_problem.empty() ? Impl::handle_problem(*comms_, h, name, back.rows(), registry_, last_generation_) : local_problem;
    auto agreed = agree_counts(ep, h.recv_counts, back.rows(), &h.plan.counts, "flat combine counts", options_, problem);
    auto returned = work_.payload(exec, "flat_returned", back.type, back.width, h.plan.rows());
    transport_.alltoallv(exec, ep, {RowSet<MemorySpace>{back.bytes, returned.bytes}}, h.recv_counts, agreed.recv,
                   "flat combine rows", options_);
    StageLedger stage{"all-to-all (reverse)", ep.name()};
    add_sends(stage, h.recv_counts, ep.peer_order(), comms_->global_rank(), Impl::node_of_rank(*comms_), back.row_bytes(), 0);
    Compat::fence(exec, "KokkosMoE::FlatExchange::combine");
    stage.seconds = timer.seconds();
    h.ledger.combine.stages = {stage};
    h.ledger.combine.useful_rows = h.plan.rows();
    h.ledger.combine_payload = to_string(back.type);
    h.ledger.combine_row_bytes = back.row_bytes();
    h.combined = true;
    return returned;
  }

  Topology::CommunicatorSet const& communicators() const { return *comms_; }
  TransportOptions const& options() const { return options_; }

 private:
  Topology::CommunicatorSet const* comms_;
  TransportOptions options_;
  PlacementRegistry const* registry_;
  std::uint64_t last_generation_ = 0;
  Impl::Workspace<MemorySpace> work_;
  TransportContext<Transport, MemorySpace> transport_;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
