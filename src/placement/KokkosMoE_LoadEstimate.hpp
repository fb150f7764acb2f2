#ifndef KOKKOSMOE_LOADESTIMATE_HPP
#define KOKKOSMOE_LOADESTIMATE_HPP

/// \file KokkosMoE_LoadEstimate.hpp
/// \brief Per-layer expert load estimates built from the router's accepted
/// route counts, with their provenance (window of steps, phase, generation).
///
/// Two modes:
///  - cumulative: load[l][e] = sum of the counts observed for layer l;
///  - moving average with factor beta in [0, 1): the first observation of a
///    layer sets load = counts, every later one sets
///    load = beta * load + (1 - beta) * counts.
/// Observations carry a step number; steps never decrease, and a layer is
/// observed at most once per step.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Where an estimate comes from.
struct LoadProvenance {
  std::string phase;              ///< e.g. "prefill", "decode"
  std::uint64_t generation = 0;   ///< placement generation the counts were routed under
  std::int64_t first_step = -1;   ///< first observed step (-1: none yet)
  std::int64_t last_step = -1;    ///< last observed step (-1: none yet)
  std::int64_t steps = 0;         ///< number of distinct steps observed
  bool moving_average = false;    ///< false: cumulative counts
  double beta = 0;                ///< moving-average factor (moving_average only)
};

/// \brief Load estimate of L layers x E experts (host data).
class LoadEstimate {
 public:
  LoadEstimate() = default;
  /// \brief Cumulative estimate (sum of counts over the window).
  static LoadEstimate cumulative(int num_layers, int num_experts, std::string phase, std::uint64_t generation);
  /// \brief Moving average with factor beta in [0, 1).
  static LoadEstimate moving_average(int num_layers, int num_experts, double beta, std::string phase,
                                     std::uint64_t generation);

  int num_layers() const { return static_cast<int>(load_.size()); }
  int num_experts() const { return num_experts_; }

  /// \brief Adds one layer's counts ([E], >= 0) observed at `step`. Throws
  /// Error for a wrong size, a negative count, a step older than the last one,
  /// or a layer already observed at this step.
  void observe(std::int64_t step, int layer, std::vector<std::int64_t> const& counts);
  /// \brief Adds every layer's counts ([L][E]) observed at `step`.
  void observe(std::int64_t step, std::vector<std::vector<std::int64_t>> const& counts);
  /// \brief Adds the accepted-route counts of a RouteTable (copied to host).
  template <class MemorySpace>
  void observe(std::int64_t step, int layer, RouteTable<MemorySpace> const& routes) {
    // The table may come from any instance: every one completes first.
    Compat::fence_all("KokkosMoE::LoadEstimate::observe: counts complete");
    auto const host = copy_to_host(typename MemorySpace::execution_space(), routes.expert_counts);
    observe(step, layer, std::vector<std::int64_t>(host.begin(), host.end()));
  }

  /// \brief [L][E] estimated load (0 for a layer not observed yet).
  std::vector<std::vector<double>> const& loads() const { return load_; }
  std::vector<double> const& load(int layer) const { return load_.at(static_cast<std::size_t>(layer)); }
  /// \brief Number of observations of a layer.
  std::int64_t observations(int layer) const { return observations_.at(static_cast<std::size_t>(layer)); }
  LoadProvenance const& provenance() const { return provenance_; }

  /// \brief JSON in the kmoe-eplb load format:
  /// {"provenance": {...}, "layers": [{"load": [...]}, ...]}.
  std::string to_json(int indent = 2) const;

 private:
  LoadEstimate(int num_layers, int num_experts, std::string phase, std::uint64_t generation, bool moving, double beta);
  int num_experts_ = 0;
  std::vector<std::vector<double>> load_;
  std::vector<std::int64_t> observations_, last_layer_step_;
  LoadProvenance provenance_;
};

}  // namespace KokkosMoE

#endif
