#ifndef KOKKOSMOE_BIASCONTROLLER_HPP
#define KOKKOSMOE_BIASCONTROLLER_HPP

/// \file KokkosMoE_BiasController.hpp
/// \brief Auxiliary-loss-free load balancing (DeepSeek-V3): after a step,
/// the router's correction bias moves toward balance,
///   sign rule:         b_e += gamma * sign(mean(c) - c_e)      (sign(0) = 0)
///   proportional rule: b_e += gamma * (mean(c) - c_e) / mean(c) (no change when mean(c) = 0)
/// with c the per-expert route counts of the step and gamma from a schedule
/// (gamma = 0 freezes the bias). The update is an explicit call after
/// routing: routes already chosen are never changed; the new bias is used by
/// the next Router::route call. Pass counts reduced over the expert-parallel
/// communicator (reduce_expert_counts) so that every rank applies the same
/// update.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Types.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {

/// \brief Which bias update rule.
enum class BiasUpdateRule {
  sign,          ///< gamma * sign(mean(c) - c_e)
  proportional,  ///< gamma * (mean(c) - c_e) / mean(c)
};

/// \brief "sign", "proportional".
inline EnumTable<BiasUpdateRule> const& names_of(BiasUpdateRule) {
  static EnumTable<BiasUpdateRule> const t{"bias update rule",
                                           {{BiasUpdateRule::sign, "sign"},
                                            {BiasUpdateRule::proportional, "proportional"}}};
  return t;
}

/// \brief Piecewise-constant gamma over steps: gamma(step) is the value of
/// the last breakpoint whose first step is <= step. Default: gamma = 0 (frozen).
class BiasSchedule {
 public:
  BiasSchedule() = default;
  /// \brief gamma for every step; throws Error unless gamma is finite and >= 0.
  static BiasSchedule constant(double gamma);
  /// \brief Breakpoints (first step, gamma): the first at step 0, first steps
  /// strictly increasing, every gamma finite and >= 0; throws Error otherwise.
  static BiasSchedule piecewise(std::vector<std::pair<std::int64_t, double>> breakpoints);
  /// \brief gamma of a step (>= 0).
  double gamma(std::int64_t step) const;
  std::vector<std::pair<std::int64_t, double>> const& breakpoints() const { return points_; }

 private:
  std::vector<std::pair<std::int64_t, double>> points_{{0, 0.0}};
};

/// \brief Updates a correction bias from route counts once per step.
class BiasController {
 public:
  BiasController() = default;
  BiasController(BiasUpdateRule rule, BiasSchedule schedule) : rule_(rule), schedule_(std::move(schedule)) {}

  BiasUpdateRule rule() const { return rule_; }
  BiasSchedule const& schedule() const { return schedule_; }
  /// \brief Steps updated so far (the step the next update() uses).
  std::int64_t step() const { return step_; }
  /// \brief Sets the step counter (checkpoint restart); throws Error when negative.
  void set_step(std::int64_t step) {
    KOKKOSMOE_REQUIRE(step >= 0, "BiasController::set_step: step must be >= 0 (got " << step << ")");
    step_ = step;
  }

  /// \brief Applies one step's update to bias on exec (fenced) and advances
  /// the step. counts and bias must have the same extent E > 0. With gamma = 0
  /// the bias is left untouched (frozen).
  /// \return the gamma used
  template <class ExecutionSpace, class CountsView, class BiasView>
  double update(ExecutionSpace const& exec, CountsView const& counts_view, BiasView const& bias_view) {
    using MemorySpace = typename BiasView::memory_space;
    Kokkos::View<const index_t*, MemorySpace> counts = counts_view;
    Kokkos::View<float*, MemorySpace> bias = bias_view;
    int const E = static_cast<int>(bias.extent(0));
    KOKKOSMOE_REQUIRE(E > 0 && counts.extent(0) == bias.extent(0),
                      "BiasController::update: counts has " << counts.extent(0) << " entries, bias " << bias.extent(0)
                                                            << " (need equal and > 0)");
    double const gamma = schedule_.gamma(step_);
    ++step_;
    if (gamma == 0.0) return gamma;
    using range_t = Kokkos::RangePolicy<ExecutionSpace>;
    index_t total = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::BiasController::total", range_t(exec, 0, E),
        KOKKOS_LAMBDA(int e, index_t& acc) { acc += counts(e); }, total);
    bool const sign_rule = rule_ == BiasUpdateRule::sign;
    Kokkos::parallel_for(
        "KokkosMoE::BiasController::update", range_t(exec, 0, E), KOKKOS_LAMBDA(int e) {
          // mean(c) - c_e has the sign of total - E * c_e (exact in integers).
          index_t const diff = total - static_cast<index_t>(E) * counts(e);
          double delta = 0.0;
          if (sign_rule)
            delta = diff > 0 ? gamma : (diff < 0 ? -gamma : 0.0);
          else if (total > 0)
            delta = gamma * static_cast<double>(diff) / static_cast<double>(total);
          bias(e) += static_cast<float>(delta);
        });
    Compat::fence(exec, "KokkosMoE::BiasController::update");
    return gamma;
  }

 private:
  BiasUpdateRule rule_ = BiasUpdateRule::sign;
  BiasSchedule schedule_;
  std::int64_t step_ = 0;
};

}  // namespace KokkosMoE

#endif
