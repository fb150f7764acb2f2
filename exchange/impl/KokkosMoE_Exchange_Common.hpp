#ifndef KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP
#define KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP

/// \file impl/KokkosMoE_Exchange_Common.hpp
/// \brief What every exchange algorithm shares: the communicator set, its
/// placement generation, the configuration, the transport chosen by it, a
/// workspace, handle creation and the local checks of dispatch and combine.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Exchange_Nccl.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <memory>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Algorithm class of an enum value: each algorithm header specializes
/// it (template <class Exec, class MS> using type = TheExchange<Exec, MS>),
/// which is all the factory (KokkosMoE_Exchange.hpp) needs to know of it.
template <Algorithm A>
struct AlgorithmClass;

namespace Impl {

/// Stage stopwatch: lap() fences the instance and returns the seconds since
/// the previous lap (or construction).
template <class Exec>
class Lap {
 public:
  explicit Lap(Exec const& exec) : exec_(exec) {}
  double operator()() {
    Compat::fence(exec_, "KokkosMoE::Exchange: stage end");
    double const t = timer_.seconds();
    timer_.reset();
    return t;
  }

 private:
  Exec exec_;
  Kokkos::Timer timer_;
};

inline std::vector<index_t> offsets_of(std::vector<index_t> const& counts) {
  std::vector<index_t> off(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

/// Segment of row p given segment offsets off[0..n] (n segments): the last
/// s with off(s) <= p (empty segments are skipped over).
template <class Off>
KOKKOS_INLINE_FUNCTION int segment_of(Off const& off, int n, index_t p) {
  int lo = 0, hi = n;  // off(lo) <= p < off(hi)
  while (hi - lo > 1) {
    int const mid = (lo + hi) / 2;
    if (off(mid) <= p)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

inline index_t total(std::vector<index_t> const& v) {
  index_t t = 0;
  for (auto x : v) t += x;
  return t;
}

inline std::vector<int> node_of_rank(Topology::CommunicatorSet const& comms) {
  std::vector<int> n(static_cast<std::size_t>(comms.topology().size()));
  for (int r = 0; r < comms.topology().size(); ++r) n[static_cast<std::size_t>(r)] = comms.topology().node_of(r);
  return n;
}

/// Host copy of a device vector.
template <class V>
std::vector<typename V::non_const_value_type> host_vector(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.extent(0));
}

/// Device copy of a host vector.
template <class MS, class T>
Kokkos::View<T*, MS> device_vector(std::vector<T> const& v, char const* label) {
  Kokkos::View<T*, MS> d(std::string(label), v.size());
  auto h = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < v.size(); ++i) h(i) = v[i];
  Kokkos::deep_copy(d, h);
  return d;
}

/// The base of every exchange algorithm (shared state and checks; not a
/// polymorphic interface: see AnyExchange for that).
template <class Exec, class MemorySpace>
class ExchangeBase {
 public:
  using execution_space = Exec;
  using memory_space = MemorySpace;

  Topology::CommunicatorSet const& communicators() const { return *comms_; }
  Placement const& placement() const { return placement_; }
  ExchangeConfig const& config() const { return config_; }
  TransportKind transport() const { return transport_->kind(); }
  TransportOptions options() const { return config_.transport_options(); }

 protected:
  /// Keeps a reference to comms (which must outlive the exchange) and a copy
  /// of the placement generation it moves rows for. With a registry, every
  /// dispatch takes a reference to the registry's active generation (which
  /// must be this placement's) and combine validates it.
  ExchangeBase(Algorithm algorithm, Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config,
               PlacementRegistry const* registry)
      : comms_(&comms),
        placement_(std::move(placement)),
        config_(config),
        registry_(registry),
        work_("KokkosMoE::Exchange::" + to_string(algorithm)),
        algorithm_(algorithm) {
    config_.algorithm = algorithm;
    // The transport is a configuration choice; every rank makes the same one,
    // so an unavailable transport fails every rank alike.
    transport_ = make_transport<Exec, MemorySpace>(config_.transport);
    node_of_rank_ = node_of_rank(comms);
    me_ = comms.global_rank();
    KOKKOSMOE_REQUIRE(placement_.num_ranks() == comms.size(), to_string(algorithm) << " exchange: the placement spans "
                                                                                  << placement_.num_ranks() << " ranks, the EP group "
                                                                                  << comms.size());
  }

  /// A handle for routes/plan with the exchange's identity.
  template <class T>
  DispatchHandle<T, MemorySpace> new_handle(RoutePlan<MemorySpace> const& routes, DispatchPlan<MemorySpace> const& plan,
                                            int wave) const {
    DispatchHandle<T, MemorySpace> h;
    h.algorithm = algorithm_;
    h.wave = wave;
    h.generation = placement_.generation();
    h.epoch = comms_->epoch();
    h.routes = routes;
    h.plan = plan;
    return h;
  }

  /// Local checks of a dispatch's inputs (the caller agrees on the result):
  /// the plans belong to this rank, this placement and the EP peer order, and
  /// hidden holds the routes' tokens in the configured width.
  template <class T>
  void check_dispatch(DispatchHandle<T, MemorySpace>& h, RowMatrix<T, MemorySpace> const& hidden, int waves) const {
    auto const& ep = comms_->ep();
    std::string const name = to_string(algorithm_);
    KOKKOSMOE_REQUIRE(h.wave >= 0 && h.wave < waves, name << " dispatch: wave " << h.wave << " of " << waves);
    KOKKOSMOE_REQUIRE(h.plan.peer_order == ep.peer_order(), name << " dispatch: the dispatch plan was built for another peer order");
    KOKKOSMOE_REQUIRE(h.routes.origin_rank == me_, name << " dispatch: rank " << me_ << " got the route plan of rank " << h.routes.origin_rank);
    KOKKOSMOE_REQUIRE(h.routes.generation == placement_.generation(),
                      name << " dispatch: routes of placement generation " << h.routes.generation << " given to the exchange of generation "
                           << placement_.generation());
    KOKKOSMOE_REQUIRE(h.plan.rows() == h.routes.size(), name << " dispatch: the dispatch plan has " << h.plan.rows()
                                                             << " rows for " << h.routes.size() << " routes");
    KOKKOSMOE_REQUIRE(static_cast<index_t>(hidden.extent(0)) == h.routes.num_tokens,
                      name << " dispatch: hidden has " << hidden.extent(0) << " rows for " << h.routes.num_tokens << " tokens");
    if (registry_) {
      h.generation_ref = registry_->acquire();
      KOKKOSMOE_REQUIRE(h.generation_ref.generation() == placement_.generation(),
                        name << " dispatch: the registry's active placement generation is " << h.generation_ref.generation()
                             << ", this exchange moves rows for generation " << placement_.generation());
    }
  }

  /// Local checks of a handle before its combine: this algorithm, this
  /// communicator epoch, a live placement generation, one output row per
  /// expert row, a return buffer of one row per dispatched route, not
  /// combined before. Returns the problem ("" when fine).
  template <class T>
  std::string combine_problem(DispatchHandle<T, MemorySpace> const& h, RowMatrix<T, MemorySpace> const& expert_out,
                              PayloadBuffer<MemorySpace> const& returned) const {
    return problem_of([&] {
      std::string const name = to_string(algorithm_);
      KOKKOSMOE_REQUIRE(h.algorithm == algorithm_, "a " << to_string(h.algorithm) << " dispatch handle was given to the " << name << " combine");
      comms_->check_epoch(h.epoch, "dispatch handle");
      if (registry_) {
        registry_->check_handle(h.generation_ref, h.generation);
      } else {
        KOKKOSMOE_REQUIRE(h.generation == placement_.generation(), "dispatch handle of placement generation "
                                                                       << h.generation << " does not match the generation "
                                                                       << placement_.generation() << " this exchange moves rows for");
      }
      KOKKOSMOE_REQUIRE(h.delivered, "the combine got a dispatch handle whose dispatch has not finished (dispatch_finish "
                                     "delivers the rows the experts read)");
      KOKKOSMOE_REQUIRE(!h.combined && !h.combine_started, "the dispatch handle was already combined");
      KOKKOSMOE_REQUIRE(static_cast<index_t>(expert_out.extent(0)) == h.rows() && expert_out.extent(1) == h.expert_rows.extent(1),
                        name << " combine got " << expert_out.extent(0) << "x" << expert_out.extent(1) << " expert outputs for "
                             << h.rows() << "x" << h.expert_rows.extent(1) << " dispatched rows");
      KOKKOSMOE_REQUIRE(returned.rows() == h.plan.rows() && returned.type == config_.return_payload &&
                            returned.width == static_cast<int>(h.expert_rows.extent(1)),
                        name << " combine: the return buffer holds " << returned.rows() << " rows of " << to_string(returned.type)
                             << "/" << returned.width << ", expected " << h.plan.rows() << " rows of "
                             << to_string(config_.return_payload) << "/" << h.expert_rows.extent(1));
    });
  }

  /// The expert-major receive side of a handle from per-slot counts.
  template <class T, class Exec2>
  void set_expert_rows(Exec2 const& exec, DispatchHandle<T, MemorySpace>& h, std::vector<index_t> counts, int width) {
    h.expert_counts = std::move(counts);
    h.expert_offsets = offsets_of(h.expert_counts);
    h.expert_offsets_d = work_.template vector<index_t>(exec, "expert_offsets", static_cast<index_t>(h.expert_offsets.size()));
    {
      auto hv = Kokkos::create_mirror_view(h.expert_offsets_d);
      for (std::size_t i = 0; i < h.expert_offsets.size(); ++i) hv(i) = h.expert_offsets[i];
      Kokkos::deep_copy(exec, h.expert_offsets_d, hv);
    }
    h.expert_rows = work_.template matrix<T>(exec, "expert_rows", h.expert_offsets.back(), static_cast<std::size_t>(width));
  }

  /// Ledger header of one call.
  ByteLedger new_ledger(int width) const {
    ByteLedger l;
    l.algorithm = to_string(algorithm_);
    l.payload = to_string(config_.payload);
    l.width = width;
    l.row_bytes = payload_row_bytes(config_.payload, width);
    l.meta_row_bytes = sizeof(RowMeta);
    l.ranks = 1;
    return l;
  }

  void set_combine_format(ByteLedger& l, int width) const {
    l.combine_payload = to_string(config_.return_payload);
    l.combine_row_bytes = payload_row_bytes(config_.return_payload, width);
  }

  Topology::CommunicatorSet const* comms_;
  Placement placement_;
  ExchangeConfig config_;
  PlacementRegistry const* registry_;
  std::unique_ptr<Transport<Exec, MemorySpace>> transport_;
  Workspace<MemorySpace> work_;
  std::vector<int> node_of_rank_;
  int me_ = -1;
  Algorithm algorithm_;
};

}  // namespace Impl
}  // namespace Exchange
}  // namespace KokkosMoE

#endif
