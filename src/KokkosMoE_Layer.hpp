#ifndef KOKKOSMOE_LAYER_HPP
#define KOKKOSMOE_LAYER_HPP

/// \file KokkosMoE_Layer.hpp
/// \brief The MoE layer end to end: router -> route plan -> dispatch ->
/// experts -> combine, plus the always-on shared experts, with a step record
/// (ledgers, drops, per-stage times) for every forward.
///
/// Header-only: it ties together the four KokkosMoE libraries, so a code that
/// uses it links KokkosMoE::kokkosmoe.

#include <KokkosMoE_Combine.hpp>
#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Exchange_Flat.hpp>
#include <KokkosMoE_Exchange_Hierarchical.hpp>
#include <KokkosMoE_Exchange_PooledWave.hpp>
#include <KokkosMoE_LoadStats.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Exchange algorithm of a layer.
enum class ExchangeAlgorithm { flat, hierarchical, pooled_wave };
std::string to_string(ExchangeAlgorithm a);
ExchangeAlgorithm exchange_algorithm_from_string(std::string const& name);

/// \brief Static configuration of a layer.
struct LayerConfig {
  int hidden = 0;                 ///< d
  RouterConfig router;            ///< E, k, scores, limits, gates, admission
  GemmPath router_gemm = GemmPath::automatic;
  PayloadType payload = PayloadType::bf16;         ///< dispatch rows on the wire
  PayloadType return_payload = PayloadType::bf16;  ///< combine rows on the wire
  Experts::RunnerOptions runner;  ///< routed experts
  Experts::RunnerOptions shared_runner;  ///< shared experts
  ExchangeAlgorithm algorithm = ExchangeAlgorithm::flat;
  Exchange::TransportOptions transport;
  int pooled_waves = 1;
  double pooled_sender_cf = 1.25;
  double pooled_receiver_cf = 1.5;
  index_t tokens_per_rank = 0;    ///< pooled-wave static shape (largest T of any rank)
  ReplicaPolicy replica_policy = ReplicaPolicy::locality;
};

/// \brief The pooled-wave exchange's static shape for a layer: its waves and
/// capacity factors, tokens per rank, top-k, and the most slots on any rank.
inline Exchange::PooledWaveConfig pooled_wave_config(LayerConfig const& config, Placement const& placement) {
  Exchange::PooledWaveConfig pc;
  pc.waves = config.pooled_waves;
  pc.sender_cf = config.pooled_sender_cf;
  pc.receiver_cf = config.pooled_receiver_cf;
  pc.tokens_per_rank = config.tokens_per_rank;
  pc.top_k = config.router.top_k;
  int most = 0;
  for (int r = 0; r < placement.num_ranks(); ++r) most = std::max(most, placement.num_slots_of_rank(r));
  pc.local_experts = std::max(1, most);
  return pc;
}

/// \brief What one forward did.
struct StepRecord {
  std::string algorithm;
  index_t tokens = 0;                  ///< this rank's tokens
  RouteCounts routes;                  ///< this rank's attempted/accepted/dropped routes
  Exchange::ByteLedger ledger;         ///< this rank's exchange ledger
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
    int const me = comms.global_rank();
    collective(comms.ep().comm(), "MoE layer setup", [&] {
      KOKKOSMOE_REQUIRE(config_.hidden >= 1, "MoE layer: hidden width must be >= 1 (got " << config_.hidden << ")");
      KOKKOSMOE_REQUIRE(placement_.num_experts() == config_.router.num_experts,
                        "MoE layer: placement has " << placement_.num_experts() << " experts, router "
                                                    << config_.router.num_experts);
      KOKKOSMOE_REQUIRE(placement_.num_ranks() == comms.size(),
                        "MoE layer: placement spans " << placement_.num_ranks() << " ranks, the EP group " << comms.size());
      KOKKOSMOE_REQUIRE(static_cast<int>(router_weight_.extent(0)) == config_.router.num_experts &&
                            static_cast<int>(router_weight_.extent(1)) == config_.hidden,
                        "MoE layer: router weight is " << router_weight_.extent(0) << "x" << router_weight_.extent(1)
                                                       << ", expected " << config_.router.num_experts << "x" << config_.hidden);
      auto const& mine = placement_.slots_of_rank(me);
      KOKKOSMOE_REQUIRE(routed_.num_slots() == static_cast<int>(mine.size()) && routed_.d() == config_.hidden,
                        "MoE layer: rank " << me << " holds " << mine.size() << " slots of width " << config_.hidden
                                           << ", its expert weights have " << routed_.num_slots() << " slots of width "
                                           << routed_.d());
      for (std::size_t q = 0; q < mine.size(); ++q)
        KOKKOSMOE_REQUIRE(routed_.slot_expert()[q] == placement_.slot(mine[q]).expert,
                          "MoE layer: local slot " << q << " of rank " << me << " is physical slot " << mine[q] << " of expert "
                                                   << placement_.slot(mine[q]).expert << ", the weights hold expert "
                                                   << routed_.slot_expert()[q]);
      if (shared_)
        KOKKOSMOE_REQUIRE(shared_->d() == config_.hidden, "MoE layer: shared experts have width " << shared_->d() << ", expected "
                                                                                                  << config_.hidden);
    });
    device_placement_ = make_device_placement<MemorySpace>(placement_);
    int const node = comms.topology().node_of(me);
    choice_ = make_replica_choice<MemorySpace>(placement_, me, node, config_.replica_policy);
  }

  LayerConfig const& config() const { return config_; }
  Placement const& placement() const { return placement_; }
  Router<MemorySpace>& router() { return router_; }
  Topology::CommunicatorSet const& communicators() const { return *comms_; }

  /// \brief Routes hidden [T, d] with the router and runs the layer:
  /// out [T, d] = routed experts (gate-weighted, k-slot order, FP32) + shared
  /// experts. Collective over the EP communicator.
  StepRecord forward(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& out,
                     std::optional<ExchangeAlgorithm> algorithm = {}) {
    StepRecord rec;
    Kokkos::Timer total;
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "router");
      RouteOptions<MemorySpace> opts;
      opts.gemm_path = config_.router_gemm;
      router_.route(exec, hidden, router_weight_, table_, opts);
    }
    forward_routes(exec, hidden, table_, out, rec, algorithm);
    rec.seconds["total"] = total.seconds();
    return rec;
  }

  /// \brief Runs the layer on given routes (explicit routes, or routes shared
  /// by several algorithms in a comparison); explicit_slot (optional, [T, k])
  /// fixes the physical slot of every route.
  StepRecord forward_routes(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                            RowMatrix<T, MemorySpace> const& out, std::optional<ExchangeAlgorithm> algorithm = {},
                            Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot = {}) {
    StepRecord rec;
    Kokkos::Timer total;
    forward_routes(exec, hidden, table, out, rec, algorithm, explicit_slot);
    rec.seconds["total"] = total.seconds();
    return rec;
  }

  /// \brief The last route table (from forward()).
  RouteTable<MemorySpace> const& routes() const { return table_; }

  // Implementation steps of forward(). They are public only because CUDA
  // forbids extended device lambdas inside private member functions; they are
  // not part of the interface.
  void forward_routes(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RouteTable<MemorySpace> const& table,
                      RowMatrix<T, MemorySpace> const& out, StepRecord& rec, std::optional<ExchangeAlgorithm> algorithm,
                      Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> const& explicit_slot = {}) {
    ExchangeAlgorithm const algo = algorithm.value_or(config_.algorithm);
    rec.algorithm = to_string(algo);
    rec.tokens = static_cast<index_t>(hidden.extent(0));
    rec.routes = table.counts;
    int const me = comms_->global_rank();
    int const d = config_.hidden;
    RoutePlan<MemorySpace> routes;
    DispatchPlan<MemorySpace> plan;
    // Local work first; its problems (bad shapes, bad routes) are agreed on
    // by every rank before anything moves, so a bad input on one rank fails
    // all ranks instead of leaving the others waiting.
    std::string const problem = Exchange::Impl::problem_of([&] {
      KOKKOSMOE_REQUIRE(static_cast<int>(hidden.extent(1)) == d && out.extent(0) == hidden.extent(0) &&
                            static_cast<int>(out.extent(1)) == d,
                        "MoE layer: hidden is " << hidden.extent(0) << "x" << hidden.extent(1) << ", out " << out.extent(0) << "x"
                                                << out.extent(1) << ", width " << d);
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "route_plan");
      routes = make_route_plan(exec, table, device_placement_, choice_, me, 0, explicit_slot);
      plan = make_dispatch_plan(exec, routes, placement_, comms_->ep().peer_order());
    });
    Exchange::agree_or_throw(comms_->ep(), problem, "MoE layer forward", config_.transport);
    PayloadBuffer<MemorySpace> returned;
    if (algo == ExchangeAlgorithm::pooled_wave) {
      auto& x = pooled();
      Exchange::WaveExpertFn<MemorySpace> experts = [&](PayloadBuffer<MemorySpace> const& x_em, std::vector<index_t> const&,
                                                        Kokkos::View<index_t*, MemorySpace> const& offsets) {
        Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "experts");
        return run_experts(exec, x_em, offsets, rec);
      };
      Kokkos::Timer wave_timer;
      double const experts_before = rec.seconds["experts"];
      {
        Compat::ScopedRegion region("KokkosMoE::Layer::pooled_wave");
        auto res = x.forward(exec, placement_, routes, plan, hidden, config_.payload, config_.return_payload, experts);
        returned = res.returned;
        rec.ledger = res.ledger;
        Compat::fence(exec, "KokkosMoE::Layer: pooled waves");
      }
      rec.seconds["exchange"] += wave_timer.seconds() - (rec.seconds["experts"] - experts_before);
    } else {
      PayloadBuffer<MemorySpace> send;
      Kokkos::View<RowMeta*, MemorySpace> meta;
      {
        Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "pack");
        send = work_.payload(exec, "layer_send", config_.payload, d, plan.rows());
        meta = work_.meta(exec, "layer_meta", plan.rows());
        pack(exec, routes, plan, hidden, send, meta);
      }
      auto run = [&](auto& xchg) {
        Exchange::DispatchHandle<MemorySpace> h;
        {
          Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "dispatch");
          h = xchg.dispatch(exec, placement_, plan, send, meta);
        }
        PayloadBuffer<MemorySpace> back;
        std::string problem;
        {
          Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "experts");
          // A failure here is handed to the combine, which fails every rank.
          problem = Exchange::Impl::problem_of([&] {
            RowMatrix<T, MemorySpace> x = typed_work(exec, "layer_x", h.repack.rows());
            repack(exec, h.repack, h.arrived, x);
            RowMatrix<T, MemorySpace> y = typed_work(exec, "layer_y", h.repack.rows());
            rec.experts = runner_.run(exec, routed_, x, h.repack.offsets, y);
            back = work_.payload(exec, "layer_back", config_.return_payload, d, h.repack.rows());
            unrepack(exec, h.repack, y, back);
          });
        }
        {
          Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine_exchange");
          returned = xchg.combine(exec, h, back, problem);
        }
        rec.ledger = h.ledger;
      };
      if (algo == ExchangeAlgorithm::flat)
        run(flat());
      else
        run(hierarchical());
    }
    {
      Impl::StageTimer<ExecutionSpace> t(exec, rec.seconds, "combine");
      combine(exec, routes, plan, returned, out);
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

  /// Decodes wire rows into typed expert inputs, runs the routed experts and
  /// encodes their outputs for the return.
  PayloadBuffer<MemorySpace> run_experts(ExecutionSpace const& exec, PayloadBuffer<MemorySpace> const& x_em,
                                         Kokkos::View<index_t*, MemorySpace> const& offsets, StepRecord& rec) {
    index_t const n = x_em.rows();
    RowMatrix<T, MemorySpace> x = typed_work(exec, "layer_x", n);
    decode_scatter(exec, x_em, KOKKOS_LAMBDA(index_t i)->index_t { return i; }, x, "KokkosMoE::Layer::decode");
    RowMatrix<T, MemorySpace> y = typed_work(exec, "layer_y", n);
    rec.experts = runner_.run(exec, routed_, x, offsets, y);
    auto out = work_.payload(exec, "layer_wave_out", config_.return_payload, config_.hidden, n);
    gather_encode(exec, y, KOKKOS_LAMBDA(index_t i)->index_t { return i; }, out, "KokkosMoE::Layer::encode");
    return out;
  }

  /// out += sum over shared experts of SwiGLU(hidden) (FP32, expert order).
  void add_shared(ExecutionSpace const& exec, RowMatrix<T, MemorySpace> const& hidden, RowMatrix<T, MemorySpace> const& out) {
    int const S = shared_->num_slots();
    index_t const n = static_cast<index_t>(hidden.extent(0));
    int const d = config_.hidden;
    // Each shared expert sees every token: segment s of the batch is a copy of hidden.
    RowMatrix<T, MemorySpace> x = S == 1 ? hidden : typed_work(exec, "shared_x", n * S);
    if (S > 1)
      for (int s = 0; s < S; ++s)
        copy_row_range(exec, x, s * n, hidden, 0, n);
    if (shared_offsets_.extent(0) != static_cast<std::size_t>(S + 1) || shared_n_ != n) {
      shared_offsets_ = Kokkos::View<index_t*, MemorySpace>("KokkosMoE::Layer::shared_offsets", S + 1);
      auto h = Kokkos::create_mirror_view(shared_offsets_);
      for (int s = 0; s <= S; ++s) h(s) = s * n;
      Kokkos::deep_copy(shared_offsets_, h);
      shared_n_ = n;
    }
    RowMatrix<float, MemorySpace> y = work_matrix<float>(exec, float_, "shared_y", n * S);
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

  /// Reused [rows, hidden] buffers (grow-only; re-allocated when still referenced).
  template <class V>
  RowMatrix<V, MemorySpace> work_matrix(ExecutionSpace const& exec, std::map<std::string, RowMatrix<V, MemorySpace>>& pool,
                                        std::string const& key, index_t rows) {
    auto& v = pool[key];
    if (static_cast<index_t>(v.extent(0)) < rows || static_cast<int>(v.extent(1)) != config_.hidden || v.use_count() > 1) {
      v = RowMatrix<V, MemorySpace>();
      v = RowMatrix<V, MemorySpace>(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::Layer::" + key), rows,
                                    config_.hidden);
    }
    return Kokkos::subview(v, std::pair<index_t, index_t>(0, rows), Kokkos::ALL);
  }
  RowMatrix<T, MemorySpace> typed_work(ExecutionSpace const& exec, std::string const& key, index_t rows) {
    return work_matrix<T>(exec, typed_, key, rows);
  }

  Exchange::FlatExchange<Exchange::Mpi, MemorySpace>& flat() {
    if (!flat_) flat_ = std::make_unique<Exchange::FlatExchange<Exchange::Mpi, MemorySpace>>(*comms_, config_.transport);
    return *flat_;
  }
  Exchange::HierarchicalExchange<Exchange::Mpi, MemorySpace>& hierarchical() {
    if (!hier_) hier_ = std::make_unique<Exchange::HierarchicalExchange<Exchange::Mpi, MemorySpace>>(*comms_, config_.transport);
    return *hier_;
  }
  Exchange::PooledWaveExchange<Exchange::Mpi, MemorySpace>& pooled() {
    if (!pooled_) {
      pooled_ = std::make_unique<Exchange::PooledWaveExchange<Exchange::Mpi, MemorySpace>>(
          *comms_, pooled_wave_config(config_, placement_), config_.transport);
    }
    return *pooled_;
  }

 private:
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
  std::unique_ptr<Exchange::FlatExchange<Exchange::Mpi, MemorySpace>> flat_;
  std::unique_ptr<Exchange::HierarchicalExchange<Exchange::Mpi, MemorySpace>> hier_;
  std::unique_ptr<Exchange::PooledWaveExchange<Exchange::Mpi, MemorySpace>> pooled_;
  Exchange::Impl::Workspace<MemorySpace> work_;
  std::map<std::string, RowMatrix<T, MemorySpace>> typed_;
  std::map<std::string, RowMatrix<float, MemorySpace>> float_;
  Kokkos::View<index_t*, MemorySpace> shared_offsets_;
  index_t shared_n_ = -1;
};

inline std::string to_string(ExchangeAlgorithm a) {
  switch (a) {
    case ExchangeAlgorithm::flat: return "flat";
    case ExchangeAlgorithm::hierarchical: return "hierarchical";
    case ExchangeAlgorithm::pooled_wave: return "pooled_wave";
  }
  return "unknown";
}

inline ExchangeAlgorithm exchange_algorithm_from_string(std::string const& name) {
  for (auto a : {ExchangeAlgorithm::flat, ExchangeAlgorithm::hierarchical, ExchangeAlgorithm::pooled_wave})
    if (to_string(a) == name) return a;
  KOKKOSMOE_THROW("unknown exchange algorithm '" << name << "' (expected flat, hierarchical or pooled_wave)");
}

}  // namespace KokkosMoE

#endif
