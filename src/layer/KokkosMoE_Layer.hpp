#ifndef KOKKOSMOE_LAYER_HPP
#define KOKKOSMOE_LAYER_HPP

/// \file KokkosMoE_Layer.hpp
/// \brief The MoE layer end to end, as the pipeline reads:
///
///     router -> route plan -> { dispatch -> expert -> combine } per chunk and wave
///            -> reduce (gate-weighted combine + shared experts) -> statistics
///
/// with a step record (ledgers, drops, per-stage times, per-task start/end)
/// for every forward. A step is a task graph (KokkosMoE_Schedule.hpp) whose
/// schedule the configuration chooses (LayerConfig::schedule); every
/// schedule gives bitwise the output of the serial one. The exchange is any
/// algorithm of the exchange contract over the transport the configuration
/// names (LayerConfig::exchange); the layer never moves or reorders rows
/// itself.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Exchange.hpp>
#include <KokkosMoE_Experts_Backward.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_LoadStats.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_ReproducibleSum.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_RouterBackward.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Schedule.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <impl/KokkosMoE_WaveMerge.hpp>

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
  ScheduleConfig schedule;        ///< serial, shared_overlap, chunked, both; chunks
  /// Operands of the experts' training GEMMs (forward_keep and backward).
  Experts::BackwardProducts backward_products = Experts::BackwardProducts::fp32;
};

/// \brief One task of a step as it ran on this rank: seconds from the start
/// of the step's task graph.
struct TaskRecord {
  std::string name;
  std::string stream;
  double start = 0;
  double end = 0;
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
  std::string schedule;                ///< schedule name and chunks, e.g. "chunked/2"
  std::map<std::string, double> seconds;  ///< per stage, fenced; "total" is the whole forward
  std::vector<TaskRecord> tasks;       ///< the step graph's tasks, measured
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

/// \brief Gradients of a layer's parameters (FP32): this rank's routed
/// expert slots; the shared experts and the router weight [E, d], which every
/// rank holds, summed over the ranks of the EP group (the same bits on every
/// rank).
template <class MemorySpace>
struct LayerGradients {
  Experts::ExpertGradients<MemorySpace> routed, shared;
  Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> router;
};

/// \brief Options of MoELayer::backward.
struct LayerBackwardOptions {
  /// The load balance loss added to the objective (its logit gradient joins
  /// the gates'); none when empty. Pooled over the EP group.
  std::optional<BalanceLossConfig> balance;
  /// Rows per block of the router weight's gradient, summed over the EP
  /// group reproducibly (KokkosMoE_ReproducibleSum.hpp): the same bits for
  /// any split of the tokens over ranks in multiples of it.
  int gradient_block = 64;
  /// Sum the shared experts' weight gradients over the EP group reproducibly
  /// too, in blocks of gradient_block tokens (the same bits for any split of
  /// the tokens in whole blocks). It runs the shared experts' backward twice
  /// (the first pass finds each element's scale) and adds every block's
  /// gradients as fixed-point integers in the layer's memory space; off, they
  /// are summed in floating point (equal within rounding).
  bool reproducible_shared = false;
};

/// \brief What a backward did: the balance loss, and seconds per stage
/// (recompute: the forward's dispatch, experts and combine again, for the
/// expert inputs and the per-route outputs the gate gradients need).
struct BackwardRecord {
  double balance_loss = 0.0;
  std::map<std::string, double> seconds;
  Experts::BackwardLedger experts;
};

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
  using value_type = T;
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
        shared_runner_(config_.shared_runner),
        backward_(backward_options(config_)) {
    config_.exchange.top_k = config_.router.top_k;
    collective(comms.ep().comm(), "MoE layer setup", [&] { check_setup(); }, config_.exchange.watchdog_seconds);
    device_placement_ = make_device_placement<MemorySpace>(placement_);
    int const me = comms.global_rank();
    choice_ = make_replica_choice<MemorySpace>(placement_, me, comms.topology().node_of(me), config_.replica_policy);
    exchange(config_.exchange.algorithm);  // the configured exchange (and its transport) exist from the start
  }

  LayerConfig const& config() const { return config_; }
  Placement const& placement() const { return placement_; }
  /// \brief This rank's routed expert weights (load a checkpoint into them
  /// between forwards).
  weights_type& routed_weights() { return routed_; }
  weights_type const& routed_weights() const { return routed_; }
  /// \brief The shared experts' weights (nullptr without shared experts).
  weights_type* shared_weights() { return shared_ ? &*shared_ : nullptr; }
  weights_type const* shared_weights() const { return shared_ ? &*shared_ : nullptr; }
  /// \brief The router weight [E, d] (this rank's copy; every rank holds the
  /// same; write it between forwards, the same on every rank).
  RowMatrix<T, MemorySpace> const& router_weight() const { return router_weight_; }
  Router<MemorySpace>& router() { return router_; }
  /// \brief What the weights came from (a checkpoint path, or the seed that
  /// drew them): part of a decode bucket's graph key. "" until set.
  std::string const& checkpoint() const { return checkpoint_; }
  void set_checkpoint(std::string identity) { checkpoint_ = std::move(identity); }

  /// \brief Bytes of the buffers this rank's layer keeps between steps, by
  /// owner: its workspace, the router's, the routed and shared runners', the
  /// backward's, and each exchange's ("exchange_<algorithm>": workspace and
  /// transport staging). They grow to the largest step seen and are reused.
  std::vector<std::pair<std::string, std::int64_t>> held_buffers() const {
    std::vector<std::pair<std::string, std::int64_t>> v{{"layer", work_.held_bytes()},
                                                        {"router", router_.held_bytes()},
                                                        {"routed_runner", runner_.held_bytes()},
                                                        {"shared_runner", shared_runner_.held_bytes()},
                                                        {"backward", backward_.held_bytes()}};
    for (auto const& [a, x] : exchanges_) v.emplace_back("exchange_" + to_string(a), x->held_bytes());
    for (auto const& [a, x] : gradient_exchanges_) v.emplace_back("gradient_exchange_" + to_string(a), x->held_bytes());
    return v;
  }
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

  /// \brief Backward of the last forward() on hidden: given dOut [T, d]
  /// (the gradient of the layer's output), writes dX [T, d] and the
  /// parameter gradients (grads' tensors are allocated when empty, otherwise
  /// overwritten). Collective over the EP communicator.
  ///
  /// Gradients travel the reverse way of the forward: the combine's backward
  /// gives the gate gradients and the per-route output gradients (gate *
  /// dOut); those rows cross the dispatch's exchange to the experts (each
  /// route as its own row, in the forward's send order, so they arrive in
  /// the forward's expert-major order), the experts' backward runs there, and
  /// the input gradients come back through the combine's exchange and are
  /// summed per token. The gate gradients go through the router to the
  /// logits (with the balance loss when asked), to dX and the router weight.
  /// The forward's expert inputs and outputs are recomputed (one more
  /// dispatch, experts and combine), not kept. Every exchange algorithm;
  /// pooled-wave's waves are all dispatched and their rows merged into the
  /// flat exchange's order for one expert backward (its drops carry no
  /// gradient), so that without drops every algorithm gives the flat
  /// exchange's bits. The serial schedule's single chunk. A layer whose
  /// exchange is hierarchical_dedup runs its backward over the
  /// hierarchical exchange (one row per route: the gate gradients need
  /// every route's output).
  BackwardRecord backward(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& dOut,
                          RowMatrix<T, MemorySpace> const& dX, LayerGradients<MemorySpace>& grads,
                          LayerBackwardOptions const& options = {}) {
    BackwardRecord rec;
    Kokkos::Timer total;
    int const d = config_.hidden, E = config_.router.num_experts;
    index_t const n = static_cast<index_t>(hidden.extent(0));
    // The backward moves one row per route: a deduplicating exchange's
    // per-route counterpart recomputes the forward's per-route outputs.
    Exchange::Algorithm const per_route_algorithm = config_.exchange.algorithm == Exchange::Algorithm::hierarchical_dedup
                                                        ? Exchange::Algorithm::hierarchical
                                                        : config_.exchange.algorithm;
    auto& x = exchange(per_route_algorithm);
    MPI_Comm ep = comms_->ep().comm();
    double const watchdog = config_.exchange.watchdog_seconds;
    auto logits = router_.logits();
    collective(ep, "MoE layer backward", [&] {
      KOKKOSMOE_REQUIRE(static_cast<int>(hidden.extent(1)) == d && dOut.extent(0) == hidden.extent(0) &&
                            static_cast<int>(dOut.extent(1)) == d && dX.extent(0) == hidden.extent(0) && static_cast<int>(dX.extent(1)) == d,
                        "MoE layer backward: hidden " << hidden.extent(0) << "x" << hidden.extent(1) << ", dOut " << dOut.extent(0) << "x"
                                                      << dOut.extent(1) << ", dX " << dX.extent(0) << "x" << dX.extent(1) << ", width " << d);
      KOKKOSMOE_REQUIRE(table_.num_tokens() == n && static_cast<index_t>(logits.extent(0)) == n,
                        "MoE layer backward: the last forward routed " << table_.num_tokens() << " tokens, hidden has " << n
                                                                       << " rows (call forward on the same rows first)");
    }, watchdog);
    if (grads.routed.num_slots() != routed_.num_slots() || grads.routed.d() != d) grads.routed = Experts::ExpertGradients<MemorySpace>(routed_);
    if (shared_ && (grads.shared.num_slots() != shared_->num_slots() || grads.shared.d() != d))
      grads.shared = Experts::ExpertGradients<MemorySpace>(*shared_);
    if (static_cast<int>(grads.router.extent(0)) != E || static_cast<int>(grads.router.extent(1)) != d)
      grads.router = Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace>("KokkosMoE::Layer::router_grad", E, d);

    // Plans of the forward (the serial schedule's one chunk).
    RoutePlan<MemorySpace> routes;
    DispatchPlan<MemorySpace> plan;
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "route_plan");
      routes = make_route_plan(exec, table_, device_placement_, choice_, comms_->global_rank(), 0, {}, &work_);
      plan = make_dispatch_plan(exec, routes, placement_, comms_->ep().peer_order(), &work_);
    }
    index_t const R = routes.size();
    // Recompute: every wave dispatched (its handle kept until the end), the
    // experts run once on the waves' rows merged into the flat exchange's
    // order (one wave: its rows as they are), keeping their activations, and
    // every wave's outputs combined into the per-route outputs.
    int const W = x.waves();
    bool const merged = W > 1;
    Experts::SavedActivations<MemorySpace> saved;
    std::vector<Exchange::DispatchHandle<T, MemorySpace>> h1(static_cast<std::size_t>(W));
    Impl::WaveMerge<MemorySpace> merge;
    RowMatrix<T, MemorySpace> expert_in;  // the experts' input rows (merged)
    Kokkos::View<index_t*, MemorySpace> expert_offsets;
    // The waves' expert rows as one matrix in the merged order (one wave:
    // its own rows), and the reverse: rows in that order combined back,
    // wave by wave, through handles' exchange into `out`.
    auto merged_rows = [&](std::vector<Exchange::DispatchHandle<T, MemorySpace>> const& handles,
                           char const* label) -> RowMatrix<T, MemorySpace> {
      if (!merged) return handles[0].expert_rows;
      auto m = work_.template matrix<T>(exec, label, merge.rows(), static_cast<std::size_t>(d));
      for (int w = 0; w < W; ++w)
        scatter_rows(exec, handles[static_cast<std::size_t>(w)].expert_rows, merge.merged_of[static_cast<std::size_t>(w)], m,
                     "KokkosMoE::Layer::backward[merge waves]");
      return m;
    };
    auto combine_waves = [&](exchange_type& ex, std::vector<Exchange::DispatchHandle<T, MemorySpace>>& handles,
                             RowMatrix<T, MemorySpace> const& rows, PayloadBuffer<MemorySpace> const& out) {
      for (int w = 0; w < W; ++w) {
        auto& h = handles[static_cast<std::size_t>(w)];
        if (merged) {
          auto part = work_.template matrix<T>(exec, "bwd_wave_rows", h.rows(), static_cast<std::size_t>(d));
          gather_rows(exec, rows, merge.merged_of[static_cast<std::size_t>(w)], part, "KokkosMoE::Layer::backward[split waves]");
          ex.combine(exec, h, part, out, "");
        } else {
          ex.combine(exec, h, rows, out, "");
        }
      }
    };
    auto returned = payload_buffer(work_, exec, "bwd_returned", config_.exchange.return_payload, d, plan.rows());
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "recompute");
      for (int w = 0; w < W; ++w) h1[static_cast<std::size_t>(w)] = x.dispatch(exec, routes, plan, hidden, w);
      if (merged) collective(ep, "MoE layer backward: wave merge", [&] { merge = Impl::merge_waves(exec, h1, &work_); }, watchdog);
      expert_in = merged_rows(h1, "bwd_expert_in");
      expert_offsets = merged ? merge.offsets_d : h1[0].expert_offsets_d;
      auto z = work_.template matrix<T>(exec, "bwd_z", static_cast<index_t>(expert_in.extent(0)), static_cast<std::size_t>(d));
      backward_.forward_keep(exec, routed_, expert_in, expert_offsets, z, saved);
      combine_waves(x, h1, z, returned);
    }
    // Combine backward: gate gradients and the per-route output gradients,
    // laid out by route (row a of route a) for the gradient dispatch.
    auto const dgate = work_.template matrix<float>(exec, "bwd_dgate", n, static_cast<std::size_t>(config_.router.top_k));
    Kokkos::deep_copy(exec, dgate, 0.0f);  // dropped routes have none
    RowMatrix<T, MemorySpace> route_grad;
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine");
      auto d_out = payload_buffer(work_, exec, "bwd_dout", PayloadType::fp32, d, plan.rows());
      combine_backward(exec, routes, plan, dOut, returned, d_out, dgate);
      route_grad = work_.template matrix<T>(exec, "bwd_route_grad", R, static_cast<std::size_t>(d));
      auto token = routes.token;
      auto gate = routes.gate;
      for_each_row_element(exec, "KokkosMoE::Layer::backward[route rows]", R, d, KOKKOS_LAMBDA(index_t a, int c) {
        route_grad(a, c) = from_float<T>(gate(a) * to_float(dOut(token(a), c)));
      });
    }
    // The gradient rows cross the dispatch exchange: every route is its own
    // "token" (same slots, destinations and send order; pooled-wave through
    // an exchange of one route per token and the same assignments per rank,
    // hence the same pools and waves).
    RoutePlan<MemorySpace> per_route = routes;
    per_route.num_tokens = R;
    per_route.top_k = 1;
    per_route.token = work_.template vector<int>(exec, "bwd_route_token", R);
    per_route.kslot = work_.template vector<int>(exec, "bwd_route_kslot", R);
    Kokkos::deep_copy(exec, per_route.kslot, 0);
    per_route.route_index = work_.template get<Kokkos::View<index_t**, Kokkos::LayoutRight, MemorySpace>>(exec, "bwd_route_index", R, 1);
    {
      auto tk = per_route.token;
      auto ri = per_route.route_index;
      Kokkos::parallel_for(
          "KokkosMoE::Layer::backward[route ids]", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, R), KOKKOS_LAMBDA(index_t a) {
            tk(a) = static_cast<int>(a);
            ri(a, 0) = a;
          });
    }
    exchange_type& xr = gradient_exchange(per_route_algorithm);
    auto returned_grad = payload_buffer(work_, exec, "bwd_returned_grad", config_.exchange.return_payload, d, plan.rows());
    // Every wave's gradient rows dispatched (in the forward's layout: same
    // slots, offsets and arrival order), merged like the forward's rows; one
    // expert backward; every wave's input gradients combined back.
    std::vector<Exchange::DispatchHandle<T, MemorySpace>> h2(static_cast<std::size_t>(W));
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "dispatch");
      for (int w = 0; w < W; ++w) h2[static_cast<std::size_t>(w)] = xr.dispatch(exec, per_route, plan, route_grad, w);
    }
    std::string problem;
    for (int w = 0; w < W && problem.empty(); ++w) {
      auto const& a = h1[static_cast<std::size_t>(w)];
      auto const& b = h2[static_cast<std::size_t>(w)];
      bool same = a.expert_offsets == b.expert_offsets && a.arrival_key.extent(0) == b.arrival_key.extent(0);
      if (same && merged) same = copy_to_host(exec, a.arrival_key) == copy_to_host(exec, b.arrival_key);
      if (!same) problem = "wave " + std::to_string(w) + ": the gradient rows arrived in another expert-major order than the forward's";
    }
    agree(ep, problem, "MoE layer backward", watchdog);
    auto const dy = merged_rows(h2, "bwd_expert_dy");
    auto dxe = work_.template matrix<T>(exec, "bwd_dxe", static_cast<index_t>(expert_in.extent(0)), static_cast<std::size_t>(d));
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "experts");
      rec.experts = backward_.backward(exec, routed_, expert_in, expert_offsets, dy, dxe, grads.routed, saved);
    }
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine_exchange");
      combine_waves(xr, h2, dxe, returned_grad);
      h1.clear();
    }
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "dispatch_backward");
      dispatch_backward(exec, routes, plan, returned_grad, dX);
    }
    // Router: gate (and balance loss) gradients to the logits, then to dX and
    // the router weight (summed over the EP group).
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "router");
      using CMat = Kokkos::View<const float**, Kokkos::LayoutRight, MemorySpace>;
      auto dlogits = work_.template matrix<float>(exec, "bwd_dlogits", n, static_cast<std::size_t>(E));
      router_backward(exec, config_.router, CMat(logits), table_, CMat(dgate), dlogits);
      if (options.balance)
        rec.balance_loss = balance_loss(exec, config_.router, *options.balance, CMat(logits), table_, ep, dlogits, 1.0f, watchdog, &work_).loss;
      auto dxf = work_.template matrix<float>(exec, "bwd_dx_router", n, static_cast<std::size_t>(d));
      gemm(exec, 'N', 'N', 1.0f, dlogits, router_weight_, 0.0f, dxf, config_.router_gemm);
      add_rows(exec, dxf, dX);
      reproducible_atb_sum(exec, dlogits, hidden, grads.router, options.gradient_block, ep, watchdog, config_.router_gemm, &work_);
    }
    if (shared_ && shared_->num_slots() > 0) {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "shared_experts");
      if (options.reproducible_shared) {
        backward_shared_reproducible(exec, hidden, dOut, dX, grads.shared, options.gradient_block, ep, watchdog);
      } else {
        backward_shared(exec, hidden, dOut, dX, grads.shared);
        // Every rank holds the shared experts: their gradient is the EP group's sum.
        sum_over_ranks(exec, grads.shared.gate, ep, watchdog);
        sum_over_ranks(exec, grads.shared.up, ep, watchdog);
        sum_over_ranks(exec, grads.shared.down, ep, watchdog);
      }
    }
    Compat::fence(exec, "KokkosMoE::Layer::backward");
    rec.seconds["total"] = total.seconds();
    return rec;
  }

  /// dX += the router's share (FP32 rows).
  void add_rows(ExecutionSpace const& exec, RowMatrix<float, MemorySpace> const& add, RowMatrix<T, MemorySpace> const& dX) {
    index_t const n = static_cast<index_t>(dX.extent(0));
    int const d = config_.hidden;
    for_each_row_element(exec, "KokkosMoE::Layer::backward[add]", n, d, KOKKOS_LAMBDA(index_t t, int c) {
      dX(t, c) = from_float<T>(to_float(dX(t, c)) + add(t, c));
    });
  }

  /// g = the sum of every rank's g, reduced to rank 0 in a fixed order and
  /// broadcast (the same bits everywhere).
  template <class V>
  static void sum_over_ranks(ExecutionSpace const& exec, V const& g, MPI_Comm comm, double watchdog) {
    std::vector<float> h = copy_to_host(exec, g), sum(h.size());
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    (void)watchdog;
    MPI_Reduce(h.data(), rank == 0 ? sum.data() : nullptr, static_cast<int>(h.size()), MPI_FLOAT, MPI_SUM, 0, comm);
    if (rank == 0) h.swap(sum);
    MPI_Bcast(h.data(), static_cast<int>(h.size()), MPI_FLOAT, 0, comm);
    copy_from_host(exec, h, g);
  }

  /// Shared experts: each sees every token; dX += the sum of their input gradients.
  void backward_shared(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& dOut,
                       RowMatrix<T, MemorySpace> const& dX, Experts::ExpertGradients<MemorySpace>& g) {
    int const S = shared_->num_slots(), d = config_.hidden;
    index_t const n = static_cast<index_t>(hidden.extent(0));
    auto x = shared_batch(exec, hidden, "bwd_shared_x");
    auto dy = shared_batch(exec, dOut, "bwd_shared_dy");
    auto dxs = work_.template matrix<float>(exec, "bwd_shared_dx", n * S, static_cast<std::size_t>(d));
    backward_.backward(exec, *shared_, x, shared_offsets(exec, n), dy, dxs, g);
    add_shared(exec, dxs, dX);
  }

  /// Shared experts block by block of `block` tokens: dX as backward_shared,
  /// the weight gradients summed over comm by FixedPointSum (a first pass
  /// over the blocks finds every element's scale, the second adds).
  void backward_shared_reproducible(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden,
                                    RowMatrix<T, MemorySpace> const& dOut, RowMatrix<T, MemorySpace> const& dX,
                                    Experts::ExpertGradients<MemorySpace>& g, int block, MPI_Comm comm, double watchdog) {
    KOKKOSMOE_REQUIRE(block > 0, "MoE layer backward: gradient_block " << block << " must be positive");
    int const S = shared_->num_slots(), d = config_.hidden;
    index_t const n = static_cast<index_t>(hidden.extent(0));
    // One block's gradients (kept by the layer: no allocation per step),
    // observed and added on the device.
    auto& gb = shared_block_grads_;
    if (gb.num_slots() != shared_->num_slots() || gb.d() != d || gb.d_ff() != shared_->d_ff())
      gb = Experts::ExpertGradients<MemorySpace>(*shared_);
    std::size_t const ng = gb.gate.size(), nu = gb.up.size(), nd = gb.down.size();
    FixedPointSum<MemorySpace> sum(exec, ng + nu + nd, &work_, "bwd_shared_sum");
    auto block_gradients = [&](index_t b0, index_t b1, bool input_gradient) {
      std::pair<index_t, index_t> const rows(b0, b1);
      RowMatrix<T, MemorySpace> const hid = Kokkos::subview(hidden, rows, Kokkos::ALL);
      RowMatrix<T, MemorySpace> const dout = Kokkos::subview(dOut, rows, Kokkos::ALL);
      auto x = shared_batch(exec, hid, "bwd_shared_x");
      auto dy = shared_batch(exec, dout, "bwd_shared_dy");
      auto dxs = work_.template matrix<float>(exec, "bwd_shared_dx", (b1 - b0) * S, static_cast<std::size_t>(d));
      backward_.backward(exec, *shared_, x, shared_offsets(exec, b1 - b0), dy, dxs, gb);
      if (input_gradient) add_shared(exec, dxs, RowMatrix<T, MemorySpace>(Kokkos::subview(dX, rows, Kokkos::ALL)));
    };
    for (index_t b0 = 0; b0 < n; b0 += block) {
      block_gradients(b0, std::min<index_t>(n, b0 + block), true);
      sum.observe(exec, gb.gate, 0);
      sum.observe(exec, gb.up, ng);
      sum.observe(exec, gb.down, ng + nu);
    }
    sum.agree_scale(exec, comm, (n + block - 1) / block, watchdog);
    for (index_t b0 = 0; b0 < n; b0 += block) {
      block_gradients(b0, std::min<index_t>(n, b0 + block), false);
      sum.add(exec, gb.gate, 0);
      sum.add(exec, gb.up, ng);
      sum.add(exec, gb.down, ng + nu);
    }
    auto const total = sum.result(exec, comm, watchdog);
    if (g.num_slots() != gb.num_slots() || g.d() != gb.d()) g = Experts::ExpertGradients<MemorySpace>(*shared_);
    using range = std::pair<std::size_t, std::size_t>;
    Kokkos::deep_copy(exec, Impl::flat_elements(g.gate), Kokkos::subview(total, range(0, ng)));
    Kokkos::deep_copy(exec, Impl::flat_elements(g.up), Kokkos::subview(total, range(ng, ng + nu)));
    Kokkos::deep_copy(exec, Impl::flat_elements(g.down), Kokkos::subview(total, range(ng + nu, ng + nu + nd)));
  }

  /// rows [n, d] once per shared expert ([S n, d]; rows itself for one).
  RowMatrix<T, MemorySpace> shared_batch(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& rows, std::string const& label) {
    int const S = shared_->num_slots();
    index_t const n = static_cast<index_t>(rows.extent(0));
    if (S == 1) return rows;
    auto x = work_.template matrix<T>(exec, label, n * S, static_cast<std::size_t>(config_.hidden));
    for (int s = 0; s < S; ++s) copy_row_range(exec, x, s * n, rows, 0, n);
    return x;
  }

  /// Segment offsets of a shared batch of n tokens per expert (s n for
  /// s = 0..S), written on exec into the layer's workspace: batches of
  /// different sizes in one step (a backward's last, shorter block) allocate
  /// nothing and no host mirror.
  Kokkos::View<index_t*, MemorySpace> shared_offsets(ExecutionSpace const& exec, index_t n) {
    int const S = shared_->num_slots();
    auto o = work_.template vector<index_t>(exec, "shared_offsets", S + 1);
    Kokkos::parallel_for(
        "KokkosMoE::Layer::shared_offsets", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, S + 1),
        KOKKOS_LAMBDA(int s) { o(s) = static_cast<index_t>(s) * n; });
    return o;
  }

  /// The experts' backward computes with the GEMM the deck chose for the
  /// forward runner (`[experts] gemm`), on the configured operands.
  static Experts::BackwardOptions backward_options(LayerConfig const& config) {
    Experts::BackwardOptions o;
    o.gemm_path = config.runner.gemm_path;
    o.products = config.backward_products;
    return o;
  }

  /// \brief Routes per physical slot that the accepted routes of `table`
  /// take from this rank (the replicas a step on it would pick), [S].
  std::vector<index_t> slot_route_counts(ExecutionSpace const& exec, RouteTable<MemorySpace> const& table) {
    auto const plan = make_route_plan(exec, table, device_placement_, choice_, comms_->global_rank(), 0, {}, &work_);
    std::vector<index_t> counts(static_cast<std::size_t>(placement_.num_slots()), 0);
    for (int s : copy_to_host(exec, plan.slot)) ++counts[static_cast<std::size_t>(s)];
    return counts;
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

  /// \brief The exchange the backward's per-route gradient rows cross: the
  /// algorithm's own, except pooled-wave, whose static shape is per token:
  /// one of top_k 1 and tokens_per_rank * top_k tokens (the same assignments,
  /// pools and waves).
  exchange_type& gradient_exchange(Exchange::Algorithm algorithm) {
    if (algorithm != Exchange::Algorithm::pooled_wave) return exchange(algorithm);
    auto& x = gradient_exchanges_[algorithm];
    if (!x) {
      Exchange::ExchangeConfig c = config_.exchange;
      c.algorithm = algorithm;
      c.tokens_per_rank = config_.exchange.tokens_per_rank * config_.router.top_k;
      c.top_k = 1;
      x = Exchange::make_exchange<T, ExecutionSpace, MemorySpace>(*comms_, placement_, c);
    }
    return *x;
  }

  // The stages of a step, in pipeline order. They are public only because
  // CUDA forbids extended device lambdas inside private member functions;
  // they are not part of the interface.

  /// \brief One token range of a step: its rows, routes and plans, and the
  /// buffer its combines return rows into.
  struct Chunk {
    index_t first = 0;
    RowMatrix<T, MemorySpace> hidden, out;
    RouteTable<MemorySpace> table;
    Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> explicit_slot;
    Plans plans;
    PayloadBuffer<MemorySpace> returned;
    /// How the combine reads `returned` (the routes, or a deduplicating
    /// exchange's partial sums: Exchange::combine_routes).
    RoutePlan<MemorySpace> combine_routes;
  };

  /// \brief One dispatch -> expert -> combine of a chunk and wave.
  struct Part {
    int chunk = 0;
    int wave = 0;
    Exchange::DispatchHandle<T, MemorySpace> handle;
    RowMatrix<T, MemorySpace> expert_out;
    std::string problem;  ///< this rank's expert failure, handed to the combine
    bool combined = false;  ///< its rows are back in the chunk's return buffer
  };

  /// A step on given routes: the schedule's task graph, every task timed.
  void run_step(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                RowMatrix<T, MemorySpace> const& out, StepRecord& rec, Exchange::Algorithm algorithm,
                Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot = {}) {
    auto& x = exchange(algorithm);
    rec.algorithm = to_string(algorithm);
    rec.transport = to_string(x.transport());
    rec.tokens = static_cast<index_t>(hidden.extent(0));
    rec.routes = table.counts;
    ScheduleConfig const& sc = config_.schedule;
    int const C = sc.step_chunks();
    int const W = x.waves();
    bool const has_shared = shared_ && shared_->num_slots() > 0;
    rec.schedule = to_string(sc.kind) + "/" + std::to_string(C);
    TaskGraph const graph = layer_step_graph(sc, W, has_shared);

    std::vector<Chunk> chunks(static_cast<std::size_t>(C));
    std::vector<Part> parts;
    for (int c = 0; c < C; ++c)
      for (int w = 0; w < W; ++w) {
        parts.emplace_back();
        parts.back().chunk = c;
        parts.back().wave = w;
      }
    RowMatrix<float, MemorySpace> shared_y;
    auto part_of = [&](std::string const& name, std::size_t prefix) -> Part& {
      std::string const p = name.substr(prefix);
      for (auto& q : parts)
        if (part_name(q.chunk, q.wave, W) == p) return q;
      KOKKOSMOE_THROW("MoE layer: no part '" << p << "' in the step");
    };
    auto begins = [](std::string const& s, char const* head) { return s.rfind(head, 0) == 0; };

    std::vector<TaskBody> bodies(static_cast<std::size_t>(graph.size()));
    for (int i = 0; i < graph.size(); ++i) {
      std::string const& name = graph.task(i).name;
      TaskBody& b = bodies[static_cast<std::size_t>(i)];
      if (name == "route plan") {
        b.issue = [&, C] { plan_chunks(exec, hidden, table, out, explicit_slot, C, chunks, rec); };
      } else if (begins(name, "dispatch ")) {
        Part* q = &part_of(name, 9);
        b.issue = [&, q] {
          Chunk& c = chunks[static_cast<std::size_t>(q->chunk)];
          q->handle = x.dispatch_start(exec, c.plans.routes, c.plans.dispatch, c.hidden, q->wave);
        };
        b.complete = [&, q] {
          x.dispatch_finish(exec, q->handle);
          rec.seconds["dispatch"] += q->handle.seconds;
        };
        b.progress = [q] { q->handle.flight.progress(); };
      } else if (begins(name, "expert ")) {
        Part* q = &part_of(name, 7);
        b.issue = [&, q] {
          Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "experts");
          // A failure here is handed to the combine, which fails every rank.
          q->problem = problem_of([&] { q->expert_out = run_experts(exec, q->handle, rec); });
        };
      } else if (begins(name, "combine ")) {
        Part* q = &part_of(name, 8);
        b.issue = [&, q] {
          x.combine_start(exec, q->handle, q->expert_out, chunks[static_cast<std::size_t>(q->chunk)].returned, q->problem);
          q->expert_out = {};  // the combine keeps what it still reads until combine_finish
        };
        b.complete = [&, q] {
          x.combine_finish(exec, q->handle);
          rec.seconds["combine_exchange"] += q->handle.seconds;
          rec.ledger.append(q->handle.ledger);
          Chunk& c = chunks[static_cast<std::size_t>(q->chunk)];
          c.combine_routes = Exchange::combine_routes(c.plans.routes, q->handle);
          q->combined = true;
          q->handle = {};  // its buffers go back to the exchange's workspace
        };
        b.progress = [q] { q->handle.flight.progress(); };
      } else if (name == "shared experts") {
        b.issue = [&] {
          Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "shared_experts");
          shared_y = compute_shared(exec, hidden);
        };
      } else if (name == "reduce") {
        b.issue = [&] {
          for (auto const& q : parts)
            KOKKOSMOE_REQUIRE(q.combined, "MoE layer reduce: the combine of part " << part_name(q.chunk, q.wave, W) << " has not finished");
          {
            Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine");
            for (auto const& c : chunks) combine(exec, c.combine_routes, c.plans.dispatch, c.returned, c.out);
          }
          if (has_shared) {
            Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "shared_experts");
            add_shared(exec, shared_y, out);
          }
        };
      } else {
        KOKKOSMOE_THROW("MoE layer: no body for task '" << name << "' of the " << graph.name());
      }
    }
    auto const times = graph.execute(bodies, !sc.unchecked);
    rec.tasks.clear();
    for (int i = 0; i < graph.size(); ++i)
      rec.tasks.push_back({graph.task(i).name, graph.task(i).stream, times[static_cast<std::size_t>(i)].start,
                           times[static_cast<std::size_t>(i)].end});
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "statistics");
      copy_to_host(exec, table.expert_counts, rec.expert_counts);
    }
  }

  /// route plan: per chunk (token range [T c / C, T (c + 1) / C)) the
  /// accepted routes with their physical slots and destinations, their send
  /// plan and their return buffer. Local work; its problems (bad shapes, bad
  /// routes) are agreed on by every rank before anything moves, so a bad
  /// input on one rank fails all ranks instead of leaving the others waiting.
  void plan_chunks(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                   RowMatrix<T, MemorySpace> const& out, Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot,
                   int C, std::vector<Chunk>& chunks, StepRecord& rec) {
    int const d = config_.hidden;
    std::string const problem = problem_of([&] {
      KOKKOSMOE_REQUIRE(static_cast<int>(hidden.extent(1)) == d && out.extent(0) == hidden.extent(0) &&
                            static_cast<int>(out.extent(1)) == d,
                        "MoE layer: hidden is " << hidden.extent(0) << "x" << hidden.extent(1) << ", out " << out.extent(0) << "x"
                                                << out.extent(1) << ", width " << d);
      KOKKOSMOE_REQUIRE(table.num_tokens() == static_cast<index_t>(hidden.extent(0)),
                        "MoE layer: the route table has " << table.num_tokens() << " tokens, hidden " << hidden.extent(0) << " rows");
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "route_plan");
      index_t const n = static_cast<index_t>(hidden.extent(0));
      using range = std::pair<index_t, index_t>;
      for (int c = 0; c < C; ++c) {
        Chunk& ch = chunks[static_cast<std::size_t>(c)];
        index_t const t0 = n * c / C, t1 = n * (c + 1) / C;
        ch.first = t0;
        ch.hidden = Kokkos::subview(hidden, range(t0, t1), Kokkos::ALL);
        ch.out = Kokkos::subview(out, range(t0, t1), Kokkos::ALL);
        ch.table = C == 1 ? table : chunk_table(table, t0, t1);
        if (explicit_slot.extent(0) > 0) ch.explicit_slot = Kokkos::subview(explicit_slot, range(t0, t1), Kokkos::ALL);
        // The route id of (token, k-slot) is the step's, so a chunk picks the
        // replicas the whole step would.
        ch.plans.routes = make_route_plan(exec, ch.table, device_placement_, choice_, comms_->global_rank(),
                                          t0 * ch.table.top_k(), ch.explicit_slot, &work_);
        ch.plans.dispatch = make_dispatch_plan(exec, ch.plans.routes, placement_, comms_->ep().peer_order(), &work_);
        ch.returned = payload_buffer(work_, exec, "returned_" + std::to_string(c), config_.exchange.return_payload, d,
                                     ch.plans.dispatch.rows());
      }
    });
    agree(comms_->ep().comm(), problem, "MoE layer forward", config_.exchange.watchdog_seconds);
  }

  /// The routes of tokens [t0, t1) of a table (views into it).
  static RouteTable<MemorySpace> chunk_table(RouteTable<MemorySpace> const& table, index_t t0, index_t t1) {
    using range = std::pair<index_t, index_t>;
    RouteTable<MemorySpace> c;
    c.expert = Kokkos::subview(table.expert, range(t0, t1), Kokkos::ALL);
    c.gate = Kokkos::subview(table.gate, range(t0, t1), Kokkos::ALL);
    c.accepted = Kokkos::subview(table.accepted, range(t0, t1), Kokkos::ALL);
    c.expert_counts = table.expert_counts;
    c.counts = table.counts;
    return c;
  }

  /// experts: the routed experts on the handle's expert-major rows, which
  /// must have been delivered (dispatch finished).
  RowMatrix<T, MemorySpace> run_experts(ExecutionSpace const& exec, Exchange::DispatchHandle<T, MemorySpace> const& h, StepRecord& rec) {
    KOKKOSMOE_REQUIRE(h.delivered, "MoE layer: the experts would read the rows of a dispatch that has not finished");
    auto y = work_.template matrix<T>(exec, "expert_out", h.rows(), static_cast<std::size_t>(config_.hidden));
    rec.experts = runner_.run(exec, routed_, h.expert_rows, h.expert_offsets_d, y);
    return y;
  }

  /// shared experts: y [S n, d] = SwiGLU of every shared expert on hidden
  /// (FP32), segment s for shared expert s.
  RowMatrix<float, MemorySpace> compute_shared(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden) {
    int const S = shared_->num_slots();
    index_t const n = static_cast<index_t>(hidden.extent(0));
    int const d = config_.hidden;
    // Each shared expert sees every token: segment s of the batch is a copy of hidden.
    auto x = shared_batch(exec, hidden, "shared_x");
    auto y = work_.template matrix<float>(exec, "shared_y", n * S, static_cast<std::size_t>(d));
    shared_runner_.run(exec, *shared_, x, shared_offsets(exec, n), y);
    return y;
  }

  /// out += sum over shared experts of their outputs y (FP32, expert order).
  void add_shared(ExecutionSpace const& exec, RowMatrix<float, MemorySpace> const& y, RowMatrix<T, MemorySpace> const& out) {
    int const S = shared_->num_slots();
    index_t const n = static_cast<index_t>(out.extent(0));
    int const d = config_.hidden;
    KOKKOSMOE_REQUIRE(static_cast<index_t>(y.extent(0)) == n * S, "MoE layer: shared expert outputs have " << y.extent(0)
                                                                  << " rows for " << n << " tokens and " << S << " experts");
    for_each_row_element(exec, "KokkosMoE::Layer::add_shared", n, d, KOKKOS_LAMBDA(index_t t, int c) {
      float acc = to_float(out(t, c));
      for (int s = 0; s < S; ++s) acc += y(s * n + t, c);
      out(t, c) = from_float<T>(acc);
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
  std::string checkpoint_;
  Topology::CommunicatorSet const* comms_;
  Placement placement_;
  RowMatrix<T, MemorySpace> router_weight_;
  weights_type routed_;
  std::optional<weights_type> shared_;
  Router<MemorySpace> router_;
  Experts::Runner<ExecutionSpace, MemorySpace> runner_;
  Experts::Runner<ExecutionSpace, MemorySpace> shared_runner_;
  Experts::Backward<ExecutionSpace, MemorySpace> backward_;
  std::map<Exchange::Algorithm, std::unique_ptr<exchange_type>> gradient_exchanges_;
  DevicePlacement<MemorySpace> device_placement_;
  ReplicaChoice<MemorySpace> choice_;
  RouteTable<MemorySpace> table_;
  std::map<Exchange::Algorithm, std::unique_ptr<exchange_type>> exchanges_;
  Workspace<MemorySpace> work_{"KokkosMoE::Layer"};
  Experts::ExpertGradients<MemorySpace> shared_block_grads_;  ///< one block's, for the reproducible shared-expert sum
};

}  // namespace KokkosMoE

#endif
