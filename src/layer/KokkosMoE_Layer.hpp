#ifndef KOKKOSMOE_LAYER_HPP
#define KOKKOSMOE_LAYER_HPP

/// \file KokkosMoE_Layer.hpp
/// \brief The MoE layer end to end, as the pipeline reads:
///
///     router -> plan_routes -> { dispatch -> experts -> combine_exchange } per wave
///            -> combine -> shared_experts -> statistics
///
/// with a step record (ledgers, drops, per-stage times) for every forward.
/// The exchange is any algorithm of the exchange contract over the transport
/// the configuration names (LayerConfig::exchange); the layer never moves or
/// reorders rows itself.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Exchange.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_LoadStats.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Static configuration of a layer.
struct LayerConfig {
  int hidden = 0;                 ///< d
  RouterConfig router;            ///< E, k, scores, limits, gates, admission
  GemmPath router_gemm = GemmPath::automatic;
  Experts::RunnerOptions runner;         ///< routed experts
  Experts::RunnerOptions shared_runner;  ///< shared experts
  /// Algorithm, transport, wire payloads, watchdog and pooled-wave shape
  /// (its top_k is the router's; tokens_per_rank the largest T of any rank).
  Exchange::ExchangeConfig exchange;
  ReplicaPolicy replica_policy = ReplicaPolicy::locality;
};

/// \brief What one forward did.
struct StepRecord {
  std::string algorithm;
  std::string transport;
  index_t tokens = 0;                  ///< this rank's tokens
  RouteCounts routes;                  ///< this rank's attempted/accepted/dropped routes
  Exchange::ByteLedger ledger;         ///< this rank's exchange ledger (every wave)
  Experts::RunLedger experts;          ///< routed experts (last wave for pooled-wave)
  std::vector<index_t> expert_counts;  ///< accepted routes per logical expert (this rank's)
  std::map<std::string, double> seconds;  ///< per stage, fenced; "total" is the whole forward
  double unaccounted_seconds() const {
    double s = 0;
    for (auto const& kv : seconds)
      if (kv.first != "total" && kv.first != "other") s += kv.second;
    auto it = seconds.find("total");
    return it == seconds.end() ? 0.0 : it->second - s;
  }
};

namespace Impl {

/// Times one stage inside a Kokkos profiling region; fences exec at the end.
template <class Exec>
class StageTimer {
 public:
  StageTimer(Exec const& exec, std::map<std::string, double>& into, std::string name)
      : exec_(exec), into_(into), name_(std::move(name)), region_("KokkosMoE::Layer::" + name_) {}
  ~StageTimer() {
    Compat::fence(exec_, "KokkosMoE::Layer: stage end");
    into_[name_] += timer_.seconds();
  }

 private:
  Exec exec_;
  std::map<std::string, double>& into_;
  std::string name_;
  Compat::ScopedRegion region_;
  Kokkos::Timer timer_;
};

}  // namespace Impl

/// \brief One MoE layer on one rank of an expert-parallel group.
///
/// \tparam T hidden-row and weight storage type (float or bf16_t)
///
/// Built collectively from the communicator set, a placement generation, the
/// router weight [E, d] and this rank's routed expert weights (its local
/// slots, in the placement's local slot order) and shared expert weights.
/// forward() is collective over the EP communicator.
template <class T = float, class ExecutionSpace = Kokkos::DefaultExecutionSpace,
          class MemorySpace = typename ExecutionSpace::memory_space>
class MoELayer {
 public:
  using exec_space = ExecutionSpace;
  using memory_space = MemorySpace;
  using weights_type = Experts::ExpertWeights<T, MemorySpace>;
  using exchange_type = Exchange::AnyExchange<T, ExecutionSpace, MemorySpace>;

  /// \brief The route and dispatch plans of one step.
  struct Plans {
    RoutePlan<MemorySpace> routes;
    DispatchPlan<MemorySpace> dispatch;
  };

  MoELayer(LayerConfig config, Topology::CommunicatorSet const& comms, Placement placement,
           RowMatrix<T, MemorySpace> router_weight, weights_type routed, std::optional<weights_type> shared = {})
      : config_(std::move(config)),
        comms_(&comms),
        placement_(std::move(placement)),
        router_weight_(router_weight),
        routed_(std::move(routed)),
        shared_(std::move(shared)),
        router_(config_.router),
        runner_(config_.runner),
        shared_runner_(config_.shared_runner) {
    config_.exchange.top_k = config_.router.top_k;
    collective(comms.ep().comm(), "MoE layer setup", [&] { check_setup(); }, config_.exchange.watchdog_seconds);
    device_placement_ = make_device_placement<MemorySpace>(placement_);
    int const me = comms.global_rank();
    choice_ = make_replica_choice<MemorySpace>(placement_, me, comms.topology().node_of(me), config_.replica_policy);
    exchange(config_.exchange.algorithm);  // the configured exchange (and its transport) exist from the start
  }

  LayerConfig const& config() const { return config_; }
  Placement const& placement() const { return placement_; }
  Router<MemorySpace>& router() { return router_; }
  Topology::CommunicatorSet const& communicators() const { return *comms_; }

  /// \brief Routes hidden [T, d] with the router and runs the layer:
  /// out [T, d] = routed experts (gate-weighted, k-slot order, FP32) + shared
  /// experts. Collective over the EP communicator. `algorithm` runs another
  /// exchange algorithm than the configured one (same transport).
  StepRecord forward(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& out,
                     std::optional<Exchange::Algorithm> algorithm = {}) {
    StepRecord rec;
    Kokkos::Timer total;
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "router");
      RouteOptions<MemorySpace> opts;
      opts.gemm_path = config_.router_gemm;
      router_.route(exec, hidden, router_weight_, table_, opts);
    }
    run_step(exec, hidden, table_, out, rec, algorithm.value_or(config_.exchange.algorithm));
    rec.seconds["total"] = total.seconds();
    return rec;
  }

  /// \brief Runs the layer on given routes (explicit routes, or routes shared
  /// by several algorithms in a comparison); explicit_slot (optional, [T, k])
  /// fixes the physical slot of every route.
  StepRecord forward_routes(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                            RowMatrix<T, MemorySpace> const& out, std::optional<Exchange::Algorithm> algorithm = {},
                            Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot = {}) {
    StepRecord rec;
    Kokkos::Timer total;
    run_step(exec, hidden, table, out, rec, algorithm.value_or(config_.exchange.algorithm), explicit_slot);
    rec.seconds["total"] = total.seconds();
    return rec;
  }

  /// \brief The last route table (from forward()).
  RouteTable<MemorySpace> const& routes() const { return table_; }

  /// \brief The exchange of an algorithm (created on first use, collectively).
  exchange_type& exchange(Exchange::Algorithm algorithm) {
    auto& x = exchanges_[algorithm];
    if (!x) {
      Exchange::ExchangeConfig c = config_.exchange;
      c.algorithm = algorithm;
      x = Exchange::make_exchange<T, ExecutionSpace, MemorySpace>(*comms_, placement_, c);
    }
    return *x;
  }

  // The stages of a step, in pipeline order. They are public only because
  // CUDA forbids extended device lambdas inside private member functions;
  // they are not part of the interface.

  /// A step on given routes: every stage below, timed.
  void run_step(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                RowMatrix<T, MemorySpace> const& out, StepRecord& rec, Exchange::Algorithm algorithm,
                Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot = {}) {
    auto& x = exchange(algorithm);
    rec.algorithm = to_string(algorithm);
    rec.transport = to_string(x.transport());
    rec.tokens = static_cast<index_t>(hidden.extent(0));
    rec.routes = table.counts;
    Plans const plans = plan_routes(exec, hidden, table, out, explicit_slot, rec);
    auto const returned = exchange_and_experts(exec, x, plans, hidden, rec);
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine");
      combine(exec, plans.routes, plans.dispatch, returned, out);
    }
    if (shared_ && shared_->num_slots() > 0) {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "shared_experts");
      add_shared(exec, hidden, out);
    }
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "statistics");
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.expert_counts);
      rec.expert_counts.assign(h.data(), h.data() + h.extent(0));
    }
  }

  /// route_plan: accepted routes with their physical slots and destinations,
  /// and their send plan. Local work; its problems (bad shapes, bad routes)
  /// are agreed on by every rank before anything moves, so a bad input on one
  /// rank fails all ranks instead of leaving the others waiting.
  Plans plan_routes(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                    RowMatrix<T, MemorySpace> const& out, Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot,
                    StepRecord& rec) {
    int const d = config_.hidden;
    Plans p;
    std::string const problem = problem_of([&] {
      KOKKOSMOE_REQUIRE(static_cast<int>(hidden.extent(1)) == d && out.extent(0) == hidden.extent(0) &&
                            static_cast<int>(out.extent(1)) == d,
                        "MoE layer: hidden is " << hidden.extent(0) << "x" << hidden.extent(1) << ", out " << out.extent(0) << "x"
                                                << out.extent(1) << ", width " << d);
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "route_plan");
      p.routes = make_route_plan(exec, table, device_placement_, choice_, comms_->global_rank(), 0, explicit_slot);
      p.dispatch = make_dispatch_plan(exec, p.routes, placement_, comms_->ep().peer_order());
    });
    agree(comms_->ep().comm(), problem, "MoE layer forward", config_.exchange.watchdog_seconds);
    return p;
  }

  /// dispatch -> experts -> combine_exchange for every wave of the exchange;
  /// returns one expert output row per dispatched route in send order.
  PayloadBuffer<MemorySpace> exchange_and_experts(ExecutionSpace const& exec, exchange_type& x, Plans const& plans,
                                                  RowMatrix<T, MemorySpace> const& hidden, StepRecord& rec) {
    auto const returned = payload_buffer(work_, exec, "returned", config_.exchange.return_payload, config_.hidden, plans.dispatch.rows());
    for (int w = 0; w < x.waves(); ++w) {
      Exchange::DispatchHandle<T, MemorySpace> h;
      {
        Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "dispatch");
        h = x.dispatch(exec, plans.routes, plans.dispatch, hidden, w);
      }
      RowMatrix<T, MemorySpace> y;
      std::string problem;
      {
        Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "experts");
        // A failure here is handed to the combine, which fails every rank.
        problem = problem_of([&] { y = run_experts(exec, h, rec); });
      }
      {
        Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine_exchange");
        x.combine(exec, h, y, returned, problem);
      }
      rec.ledger.append(h.ledger);
    }
    return returned;
  }

  /// experts: the routed experts on the handle's expert-major rows.
  RowMatrix<T, MemorySpace> run_experts(ExecutionSpace const& exec, Exchange::DispatchHandle<T, MemorySpace> const& h, StepRecord& rec) {
    auto y = work_.template matrix<T>(exec, "expert_out", h.rows(), static_cast<std::size_t>(config_.hidden));
    rec.experts = runner_.run(exec, routed_, h.expert_rows, h.expert_offsets_d, y);
    return y;
  }

  /// shared_experts: out += sum over shared experts of SwiGLU(hidden) (FP32,
  /// expert order).
  void add_shared(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& out) {
    int const S = shared_->num_slots();
    index_t const n = static_cast<index_t>(hidden.extent(0));
    int const d = config_.hidden;
    // Each shared expert sees every token: segment s of the batch is a copy of hidden.
    RowMatrix<T, MemorySpace> x = S == 1 ? hidden : work_.template matrix<T>(exec, "shared_x", n * S, static_cast<std::size_t>(d));
    if (S > 1)
      for (int s = 0; s < S; ++s) copy_row_range(exec, x, s * n, hidden, 0, n);
    if (shared_offsets_.extent(0) != static_cast<std::size_t>(S + 1) || shared_n_ != n) {
      shared_offsets_ = Kokkos::View<index_t*, MemorySpace>("KokkosMoE::Layer::shared_offsets", S + 1);
      auto h = Kokkos::create_mirror_view(shared_offsets_);
      for (int s = 0; s <= S; ++s) h(s) = s * n;
      Kokkos::deep_copy(shared_offsets_, h);
      shared_n_ = n;
    }
    auto y = work_.template matrix<float>(exec, "shared_y", n * S, static_cast<std::size_t>(d));
    shared_runner_.run(exec, *shared_, x, shared_offsets_, y);
    Kokkos::parallel_for(
        "KokkosMoE::Layer::add_shared", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, n), KOKKOS_LAMBDA(index_t t) {
          for (int c = 0; c < d; ++c) {
            float acc = to_float(out(t, c));
            for (int s = 0; s < S; ++s) acc += y(s * n + t, c);
            out(t, c) = from_float<T>(acc);
          }
        });
  }

 private:
  void check_setup() const {
    int const me = comms_->global_rank();
    KOKKOSMOE_REQUIRE(config_.hidden >= 1, "MoE layer: hidden width must be >= 1 (got " << config_.hidden << ")");
    KOKKOSMOE_REQUIRE(placement_.num_experts() == config_.router.num_experts,
                      "MoE layer: placement has " << placement_.num_experts() << " experts, router " << config_.router.num_experts);
    KOKKOSMOE_REQUIRE(placement_.num_ranks() == comms_->size(),
                      "MoE layer: placement spans " << placement_.num_ranks() << " ranks, the EP group " << comms_->size());
    KOKKOSMOE_REQUIRE(static_cast<int>(router_weight_.extent(0)) == config_.router.num_experts &&
                          static_cast<int>(router_weight_.extent(1)) == config_.hidden,
                      "MoE layer: router weight is " << router_weight_.extent(0) << "x" << router_weight_.extent(1) << ", expected "
                                                     << config_.router.num_experts << "x" << config_.hidden);
    auto const& mine = placement_.slots_of_rank(me);
    KOKKOSMOE_REQUIRE(routed_.num_slots() == static_cast<int>(mine.size()) && routed_.d() == config_.hidden,
                      "MoE layer: rank " << me << " holds " << mine.size() << " slots of width " << config_.hidden
                                         << ", its expert weights have " << routed_.num_slots() << " slots of width " << routed_.d());
    for (std::size_t q = 0; q < mine.size(); ++q)
      KOKKOSMOE_REQUIRE(routed_.slot_expert()[q] == placement_.slot(mine[q]).expert,
                        "MoE layer: local slot " << q << " of rank " << me << " is physical slot " << mine[q] << " of expert "
                                                 << placement_.slot(mine[q]).expert << ", the weights hold expert "
                                                 << routed_.slot_expert()[q]);
    if (shared_)
      KOKKOSMOE_REQUIRE(shared_->d() == config_.hidden, "MoE layer: shared experts have width " << shared_->d() << ", expected "
                                                                                                << config_.hidden);
  }

  LayerConfig config_;
  Topology::CommunicatorSet const* comms_;
  Placement placement_;
  RowMatrix<T, MemorySpace> router_weight_;
  weights_type routed_;
  std::optional<weights_type> shared_;
  Router<MemorySpace> router_;
  Experts::Runner<ExecutionSpace, MemorySpace> runner_;
  Experts::Runner<ExecutionSpace, MemorySpace> shared_runner_;
  DevicePlacement<MemorySpace> device_placement_;
  ReplicaChoice<MemorySpace> choice_;
  RouteTable<MemorySpace> table_;
  std::map<Exchange::Algorithm, std::unique_ptr<exchange_type>> exchanges_;
  Workspace<MemorySpace> work_{"KokkosMoE::Layer"};
  Kokkos::View<index_t*, MemorySpace> shared_offsets_;
  index_t shared_n_ = -1;
};

}  // namespace KokkosMoE

#endif
