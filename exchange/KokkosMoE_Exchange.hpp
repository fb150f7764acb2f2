#ifndef KOKKOSMOE_EXCHANGE_HPP
#define KOKKOSMOE_EXCHANGE_HPP

/// \file KokkosMoE_Exchange.hpp
/// \brief The one exchange contract, and the run-time choice of an
/// algorithm by configuration.
///
/// Every algorithm (FlatExchange, HierarchicalExchange, PooledWaveExchange)
/// offers the same verbs on an execution space instance:
///
///     int waves()                                                  1, or the pooled waves W
///     DispatchHandle<T> dispatch(exec, routes, plan, hidden, wave) receive side expert-major:
///                                                                  counts, offsets, expert_rows
///     void combine(exec, handle, expert_out, returned[, problem])  expert outputs back into
///                                                                  `returned` in the sender's order
///
/// and their start/finish forms (dispatch_start -> handle in flight,
/// dispatch_finish(exec, handle) -> delivered; combine_start,
/// combine_finish), so that a schedule computes while rows move. Between a
/// combine_start and its combine_finish the exchange may still read
/// expert_out (the flat exchange sends the rows from where they are): the
/// rows must not change meanwhile; a managed view may be dropped (the
/// transfer keeps its allocation), an unmanaged one's memory must live on. An
/// algorithm without its own start forms moves the rows in start and its
/// finish only completes the handle; the MPI transport overlaps where MPI
/// reads device buffers directly (host memory, CUDA-aware MPI), the NCCL
/// transport always (its own stream, ordered by events).
///
/// A step is the caller's loop: for each wave, dispatch, run the experts on
/// handle.expert_rows (segments handle.expert_offsets), combine; then the
/// gate-weighted combine() of KokkosMoE_Combine.hpp reduces `returned` per
/// token. The exchange owns pack and repack (both directions), its transport
/// (TransportKind: MPI or NCCL, chosen by configuration) and its buffers; the
/// handle owns what it delivered until it is destroyed, pins the placement
/// generation and the communicator epoch, and carries the ledger of both
/// directions. Every verb is collective over the EP communicator and fails
/// on every rank alike.
///
/// Adding an algorithm: one header in exchange/ with the class and its
/// AlgorithmClass<Algorithm::name> specialization (found by the build and
/// included below), one Algorithm enum value and its deck name
/// (KokkosMoE_Exchange_Config.hpp). make_exchange() and plan_ledgers() find
/// it through AlgorithmClass.

#include <KokkosMoE_Exchange_Algorithms.hpp>  // every algorithm header (generated)
#include <impl/KokkosMoE_Exchange_Common.hpp>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace KokkosMoE {
namespace Exchange {

/// \brief Any exchange algorithm behind the contract, for fixed row type T,
/// execution space and memory space (what a layer holds).
template <class T, class Exec, class MemorySpace = typename Exec::memory_space>
class AnyExchange {
 public:
  virtual ~AnyExchange() = default;
  virtual Algorithm algorithm() const = 0;
  virtual TransportKind transport() const = 0;
  virtual int waves() const = 0;
  virtual DispatchHandle<T, MemorySpace> dispatch(Exec const& exec, RoutePlan<MemorySpace> const& routes,
                                                  DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                                                  int wave) = 0;
  virtual void combine(Exec const& exec, DispatchHandle<T, MemorySpace>& handle, RowMatrix<T, MemorySpace> const& expert_out,
                       PayloadBuffer<MemorySpace> const& returned, std::string const& local_problem) = 0;
  virtual DispatchHandle<T, MemorySpace> dispatch_start(Exec const& exec, RoutePlan<MemorySpace> const& routes,
                                                        DispatchPlan<MemorySpace> const& plan,
                                                        RowMatrix<T, MemorySpace> const& hidden, int wave) = 0;
  virtual void dispatch_finish(Exec const& exec, DispatchHandle<T, MemorySpace>& handle) = 0;
  virtual void combine_start(Exec const& exec, DispatchHandle<T, MemorySpace>& handle, RowMatrix<T, MemorySpace> const& expert_out,
                             PayloadBuffer<MemorySpace> const& returned, std::string const& local_problem) = 0;
  virtual void combine_finish(Exec const& exec, DispatchHandle<T, MemorySpace>& handle) = 0;
  /// True when dispatch_start returns before the rows have moved.
  virtual bool overlaps() const = 0;
  /// Bytes of the buffers the exchange keeps between steps.
  virtual std::int64_t held_bytes() const = 0;
  virtual ExchangeConfig const& config() const = 0;
  virtual Topology::CommunicatorSet const& communicators() const = 0;
};

namespace Impl {

template <class X, class T, class Exec, class MS, class = void>
struct has_start_forms : std::false_type {};
template <class X, class T, class Exec, class MS>
struct has_start_forms<X, T, Exec, MS,
                       std::void_t<decltype(std::declval<X&>().template dispatch_start<T>(
                                       std::declval<Exec const&>(), std::declval<RoutePlan<MS> const&>(),
                                       std::declval<DispatchPlan<MS> const&>(), std::declval<RowMatrix<T, MS> const&>(), 0))>>
    : std::true_type {};

template <class X, class T, class Exec, class MS>
class ExchangeModel final : public AnyExchange<T, Exec, MS> {
 public:
  template <class... Args>
  explicit ExchangeModel(Args&&... args) : x_(std::forward<Args>(args)...) {}
  Algorithm algorithm() const override { return X::algorithm; }
  TransportKind transport() const override { return x_.transport(); }
  int waves() const override { return x_.waves(); }
  DispatchHandle<T, MS> dispatch(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                 RowMatrix<T, MS> const& hidden, int wave) override {
    return x_.dispatch(exec, routes, plan, hidden, wave);
  }
  void combine(Exec const& exec, DispatchHandle<T, MS>& handle, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
               std::string const& local_problem) override {
    x_.combine(exec, handle, expert_out, returned, local_problem);
  }
  DispatchHandle<T, MS> dispatch_start(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                       RowMatrix<T, MS> const& hidden, int wave) override {
    if constexpr (starts) {
      return x_.dispatch_start(exec, routes, plan, hidden, wave);
    } else {
      Kokkos::Timer timer;
      auto h = x_.dispatch(exec, routes, plan, hidden, wave);
      h.seconds = timer.seconds();
      return h;
    }
  }
  void dispatch_finish(Exec const& exec, DispatchHandle<T, MS>& handle) override {
    if constexpr (starts) {
      x_.dispatch_finish(exec, handle);
    } else {
      (void)exec;
      KOKKOSMOE_REQUIRE(handle.delivered, to_string(X::algorithm) << " dispatch_finish: the handle was not dispatched");
    }
  }
  void combine_start(Exec const& exec, DispatchHandle<T, MS>& handle, RowMatrix<T, MS> const& expert_out,
                     PayloadBuffer<MS> const& returned, std::string const& local_problem) override {
    if constexpr (starts) {
      x_.combine_start(exec, handle, expert_out, returned, local_problem);
    } else {
      Kokkos::Timer timer;
      x_.combine(exec, handle, expert_out, returned, local_problem);
      handle.seconds = timer.seconds();
    }
  }
  void combine_finish(Exec const& exec, DispatchHandle<T, MS>& handle) override {
    if constexpr (starts) {
      x_.combine_finish(exec, handle);
    } else {
      (void)exec;
      KOKKOSMOE_REQUIRE(handle.combined, to_string(X::algorithm) << " combine_finish: the handle was not combined");
    }
  }
  bool overlaps() const override { return starts; }
  std::int64_t held_bytes() const override { return x_.held_bytes(); }
  ExchangeConfig const& config() const override { return x_.config(); }
  Topology::CommunicatorSet const& communicators() const override { return x_.communicators(); }

 private:
  static constexpr bool starts = has_start_forms<X, T, Exec, MS>::value;
  X x_;
};

template <Algorithm A, class = void>
struct has_algorithm_class : std::false_type {};
template <Algorithm A>
struct has_algorithm_class<A, std::void_t<decltype(sizeof(AlgorithmClass<A>))>> : std::true_type {};

/// Calls f(std::integral_constant<Algorithm, A>) for the enum value A equal
/// to `a` among the values with an AlgorithmClass; returns false when none.
template <class F, int... I>
bool visit_algorithm(Algorithm a, F&& f, std::integer_sequence<int, I...>) {
  bool found = false;
  auto one = [&](auto tag) {
    constexpr Algorithm A = decltype(tag)::value;
    if constexpr (has_algorithm_class<A>::value) {
      if (!found && a == A) {
        found = true;
        f(tag);
      }
    }
  };
  (one(std::integral_constant<Algorithm, static_cast<Algorithm>(I)>{}), ...);
  return found;
}

template <class F>
void for_algorithm(Algorithm a, F&& f) {
  bool const found = visit_algorithm(a, std::forward<F>(f), std::make_integer_sequence<int, 32>{});
  KOKKOSMOE_REQUIRE(found, "exchange algorithm '" << to_string(a) << "' has no implementation in this build");
}

}  // namespace Impl

/// \brief The exchange of config.algorithm over config.transport on comms
/// (which must outlive it) for placement. Collective over the EP
/// communicator; an algorithm or transport this build cannot run fails on
/// every rank with the same message.
template <class T, class Exec, class MemorySpace = typename Exec::memory_space>
std::unique_ptr<AnyExchange<T, Exec, MemorySpace>> make_exchange(Topology::CommunicatorSet const& comms, Placement const& placement,
                                                                 ExchangeConfig const& config,
                                                                 PlacementRegistry const* registry = nullptr) {
  std::unique_ptr<AnyExchange<T, Exec, MemorySpace>> x;
  collective(comms.ep().comm(), "exchange setup", [&] {
    Impl::for_algorithm(config.algorithm, [&](auto tag) {
      using X = typename AlgorithmClass<decltype(tag)::value>::template type<Exec, MemorySpace>;
      x = std::make_unique<Impl::ExchangeModel<X, T, Exec, MemorySpace>>(comms, placement, config, registry);
    });
  }, config.watchdog_seconds);
  return x;
}

/// \brief The per-rank ledgers config.algorithm would report for these
/// routes (no data moves): the planner of that algorithm.
inline std::vector<ByteLedger> plan_ledgers(PlanInput const& in) {
  std::vector<ByteLedger> out;
  Impl::for_algorithm(in.config.algorithm, [&](auto tag) {
    using X = typename AlgorithmClass<decltype(tag)::value>::template type<Kokkos::DefaultHostExecutionSpace, Kokkos::HostSpace>;
    out = X::plan(in);
  });
  return out;
}

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
