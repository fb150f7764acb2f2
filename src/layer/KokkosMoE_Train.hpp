#ifndef KOKKOSMOE_TRAIN_HPP
#define KOKKOSMOE_TRAIN_HPP

/// \file KokkosMoE_Train.hpp
/// \brief Training a layer against a teacher: a fixed MoE layer of the same
/// shape (other weights) gives the targets, so the loss can go to zero.
///
/// A step: target = teacher(hidden); out = student(hidden); loss = mean
/// squared error over the EP group's rows, L = sum (out - target)^2 / (N d);
/// dOut = 2 (out - target) / (N d); the student's backward (with the balance
/// loss when configured); replicated experts' gradients summed over their
/// copies; then SGD or Adam on the routed experts, shared experts and the
/// router weight. Every rank applies the same update to what every rank
/// holds (router, shared experts: their gradients are the same bits
/// everywhere), so the replicas stay identical.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_ReplicaGradients.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Layer.hpp>
#include <KokkosMoE_RowKit.hpp>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Optimizer settings.
struct TrainConfig {
  std::string optimizer = "adam";  ///< "adam" or "sgd"
  double learning_rate = 1e-2;
  std::string schedule = "constant";  ///< "constant", or "cosine" (to 0 over total_steps)
  int total_steps = 0;                ///< cosine: the steps of the run
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;  ///< Adam
  std::optional<BalanceLossConfig> balance;             ///< balance loss added to the objective
  int gradient_block = 64;                              ///< LayerBackwardOptions::gradient_block
  bool reproducible_shared = false;                     ///< LayerBackwardOptions::reproducible_shared

  /// Throws Error naming the bad value.
  void validate() const {
    KOKKOSMOE_REQUIRE(optimizer == "adam" || optimizer == "sgd", "train.optimizer: '" << optimizer << "' (expected adam or sgd)");
    KOKKOSMOE_REQUIRE(learning_rate > 0 && std::isfinite(learning_rate), "train.learning_rate = " << learning_rate << " must be > 0");
    KOKKOSMOE_REQUIRE(schedule == "constant" || (schedule == "cosine" && total_steps > 0),
                      "train.schedule: '" << schedule << "' (expected constant, or cosine with the run's steps > 0)");
    KOKKOSMOE_REQUIRE(gradient_block > 0, "train.gradient_block = " << gradient_block << " must be > 0");
    KOKKOSMOE_REQUIRE(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && epsilon > 0,
                      "train: Adam needs 0 <= beta1, beta2 < 1 and epsilon > 0 (got " << beta1 << ", " << beta2 << ", " << epsilon << ")");
  }
};

/// \brief What a training step measured (the same on every rank).
struct TrainStepRecord {
  double loss = 0.0;          ///< mean squared error against the teacher
  double balance_loss = 0.0;  ///< the balance loss term (0 without one)
  double grad_norm = 0.0;     ///< L2 norm of all parameter gradients (each expert once)
  BackwardRecord backward;    ///< this rank's backward seconds per stage
  double forward_seconds = 0.0;
};

/// \brief SGD / Adam on flat FP32 parameter arrays; one state per parameter.
template <class ExecutionSpace, class MemorySpace>
class Optimizer {
 public:
  explicit Optimizer(TrainConfig config) : config_(std::move(config)) { config_.validate(); }

  /// \brief The learning rate of the next step (schedule applied).
  double learning_rate() const {
    if (config_.schedule != "cosine") return config_.learning_rate;
    double const x = std::min(1.0, static_cast<double>(steps_) / config_.total_steps);
    return config_.learning_rate * 0.5 * (1.0 + std::cos(3.141592653589793 * x));
  }
  /// \brief Ends a step: the schedule moves on.
  void next_step() { ++steps_; }

  /// \brief p -= update(g) for parameter `name` (n floats at p, gradient g).
  void update(ExecutionSpace const& exec, std::string const& name, float* p, float const* g, std::size_t n) {
    float const lr = static_cast<float>(learning_rate());
    if (config_.optimizer == "sgd") {
      Kokkos::parallel_for("KokkosMoE::Optimizer::sgd", Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, n),
                           KOKKOS_LAMBDA(std::size_t i) { p[i] -= lr * g[i]; });
      return;
    }
    auto& s = state_[name];
    if (s.m.extent(0) != n) {
      s.m = Kokkos::View<float*, MemorySpace>("KokkosMoE::Optimizer::m_" + name, n);
      s.v = Kokkos::View<float*, MemorySpace>("KokkosMoE::Optimizer::v_" + name, n);
      s.t = 0;
    }
    ++s.t;
    float const b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2), eps = static_cast<float>(config_.epsilon);
    float const c1 = static_cast<float>(1.0 - std::pow(config_.beta1, s.t)), c2 = static_cast<float>(1.0 - std::pow(config_.beta2, s.t));
    auto m = s.m;
    auto v = s.v;
    Kokkos::parallel_for("KokkosMoE::Optimizer::adam", Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, n),
                         KOKKOS_LAMBDA(std::size_t i) {
                           float const gi = g[i];
                           m(i) = b1 * m(i) + (1.0f - b1) * gi;
                           v(i) = b2 * v(i) + (1.0f - b2) * gi * gi;
                           p[i] -= lr * (m(i) / c1) / (Compat::sqrt(v(i) / c2) + eps);
                         });
  }

 private:
  struct State {
    Kokkos::View<float*, MemorySpace> m, v;
    int t = 0;
  };
  TrainConfig config_;
  std::map<std::string, State> state_;
  int steps_ = 0;
};

/// \brief Trains `student` toward `teacher` (both fp32 layers on the same
/// communicators and placement).
template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class Trainer {
 public:
  using layer_type = MoELayer<float, ExecutionSpace, MemorySpace>;

  /// \brief Collective over the student's EP communicator.
  Trainer(layer_type& student, layer_type& teacher, RowMatrix<float, MemorySpace> student_router_weight, TrainConfig config)
      : student_(student),
        teacher_(teacher),
        router_weight_(student_router_weight),
        config_(config),
        optimizer_(config),
        replicas_(student.communicators().ep().comm(), student.placement(), student.config().exchange.watchdog_seconds) {}

  /// \brief One step on this rank's rows (collective).
  TrainStepRecord step(ExecutionSpace const& exec, RowMatrix<float, MemorySpace> const& hidden) {
    TrainStepRecord rec;
    MPI_Comm ep = student_.communicators().ep().comm();
    double const watchdog = student_.config().exchange.watchdog_seconds;
    index_t const n = static_cast<index_t>(hidden.extent(0));
    int const d = static_cast<int>(hidden.extent(1));
    if (out_.extent(0) != hidden.extent(0) || out_.extent(1) != hidden.extent(1)) {
      out_ = RowMatrix<float, MemorySpace>("KokkosMoE::Trainer::out", n, d);
      target_ = RowMatrix<float, MemorySpace>("KokkosMoE::Trainer::target", n, d);
      dout_ = RowMatrix<float, MemorySpace>("KokkosMoE::Trainer::dout", n, d);
      dx_ = RowMatrix<float, MemorySpace>("KokkosMoE::Trainer::dx", n, d);
    }
    Kokkos::Timer timer;
    teacher_.forward(exec, hidden, target_);
    student_.forward(exec, hidden, out_);
    rec.forward_seconds = timer.seconds();
    // Loss and its gradient over the EP group's rows.
    double local[2] = {0.0, static_cast<double>(n)}, total[2] = {0.0, 0.0};
    {
      auto out = out_;
      auto target = target_;
      double sq = 0.0;
      using member_t = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
      if (n > 0)
        Kokkos::parallel_reduce(
            "KokkosMoE::Trainer::loss", Impl::row_policy(exec, n),
            KOKKOS_LAMBDA(member_t const& team, double& acc) {
              index_t const t = team.league_rank();
              double row = 0.0;
              Kokkos::parallel_reduce(
                  Kokkos::ThreadVectorRange(team, d),
                  [&](int c, double& r) {
                    double const e = static_cast<double>(out(t, c)) - static_cast<double>(target(t, c));
                    r += e * e;
                  },
                  row);
              Kokkos::single(Kokkos::PerThread(team), [&]() { acc += row; });
            },
            sq);
      local[0] = sq;
    }
    allreduce_watched(local, total, 2, MPI_DOUBLE, MPI_SUM, ep, "Trainer: loss", watchdog);
    double const count = total[1] * d;
    rec.loss = count > 0 ? total[0] / count : 0.0;
    {
      auto out = out_;
      auto target = target_;
      auto dout = dout_;
      float const scale = count > 0 ? static_cast<float>(2.0 / count) : 0.0f;
      for_each_row_element(exec, "KokkosMoE::Trainer::dloss", n, d, KOKKOS_LAMBDA(index_t t, int c) {
        dout(t, c) = scale * (out(t, c) - target(t, c));
      });
    }
    LayerBackwardOptions bo;
    bo.balance = config_.balance;
    bo.gradient_block = config_.gradient_block;
    bo.reproducible_shared = config_.reproducible_shared;
    rec.backward = student_.backward(exec, hidden, dout_, dx_, grads_, bo);
    rec.balance_loss = rec.backward.balance_loss;
    replicas_.reduce(exec, grads_.routed, student_.placement().generation(), &work_);
    rec.grad_norm = grad_norm(exec, ep, watchdog);
    apply(exec);
    Compat::fence(exec, "KokkosMoE::Trainer::step");
    return rec;
  }

  LayerGradients<MemorySpace> const& gradients() const { return grads_; }

  // Public only because CUDA forbids extended device lambdas inside private
  // member functions; not part of the interface.

  /// The L2 norm of every gradient, each replicated expert counted once
  /// (every copy holds the same sum) and the router and shared experts once.
  double grad_norm(ExecutionSpace const& exec, MPI_Comm ep, double watchdog) {
    auto const& p = student_.placement();
    int const me = student_.communicators().global_rank();
    auto const& mine = p.slots_of_rank(me);
    auto sq = [&](float const* x, std::size_t n) {
      double s = 0.0;
      Kokkos::parallel_reduce(
          "KokkosMoE::Trainer::norm", Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, n),
          KOKKOS_LAMBDA(std::size_t i, double& acc) { acc += static_cast<double>(x[i]) * x[i]; }, s);
      return s;
    };
    double local = 0.0;
    std::size_t const gsz = static_cast<std::size_t>(grads_.routed.d()) * grads_.routed.d_ff();
    for (std::size_t q = 0; q < mine.size(); ++q) {
      int const copies = p.logcnt()[static_cast<std::size_t>(p.slot(mine[q]).expert)];
      double const s = sq(grads_.routed.gate.data() + q * gsz, gsz) + sq(grads_.routed.up.data() + q * gsz, gsz) +
                       sq(grads_.routed.down.data() + q * gsz, gsz);
      local += s / copies;
    }
    int rank = 0;
    MPI_Comm_rank(ep, &rank);
    if (rank == 0) {
      local += sq(grads_.router.data(), grads_.router.size());
      if (grads_.shared.num_slots() > 0)
        local += sq(grads_.shared.gate.data(), grads_.shared.gate.size()) + sq(grads_.shared.up.data(), grads_.shared.up.size()) +
                 sq(grads_.shared.down.data(), grads_.shared.down.size());
    }
    double total = 0.0;
    allreduce_watched(&local, &total, 1, MPI_DOUBLE, MPI_SUM, ep, "Trainer: gradient norm", watchdog);
    return std::sqrt(total);
  }

  /// The optimizer step on every parameter.
  void apply(ExecutionSpace const& exec) {
    auto& w = student_.routed_weights();
    optimizer_.update(exec, "routed.gate", w.gate().data(), grads_.routed.gate.data(), w.gate().size());
    optimizer_.update(exec, "routed.up", w.up().data(), grads_.routed.up.data(), w.up().size());
    optimizer_.update(exec, "routed.down", w.down().data(), grads_.routed.down.data(), w.down().size());
    if (auto* s = student_.shared_weights(); s && s->num_slots() > 0) {
      optimizer_.update(exec, "shared.gate", s->gate().data(), grads_.shared.gate.data(), s->gate().size());
      optimizer_.update(exec, "shared.up", s->up().data(), grads_.shared.up.data(), s->up().size());
      optimizer_.update(exec, "shared.down", s->down().data(), grads_.shared.down.data(), s->down().size());
    }
    optimizer_.update(exec, "router", router_weight_.data(), grads_.router.data(), router_weight_.size());
    optimizer_.next_step();
  }

 private:
  layer_type& student_;
  layer_type& teacher_;
  RowMatrix<float, MemorySpace> router_weight_;
  TrainConfig config_;
  Optimizer<ExecutionSpace, MemorySpace> optimizer_;
  Experts::ReplicaGradients replicas_;
  Workspace<MemorySpace> work_{"KokkosMoE::Trainer"};
  LayerGradients<MemorySpace> grads_;
  RowMatrix<float, MemorySpace> out_, target_, dout_, dx_;
};

}  // namespace KokkosMoE

#endif
