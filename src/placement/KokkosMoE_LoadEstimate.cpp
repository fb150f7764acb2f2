#include <KokkosMoE_LoadEstimate.hpp>

#include <nlohmann/json.hpp>

#include <cmath>

namespace KokkosMoE {

LoadEstimate::LoadEstimate(int num_layers, int num_experts, std::string phase, std::uint64_t generation, bool moving,
                           double beta)
    : num_experts_(num_experts) {
  KOKKOSMOE_REQUIRE(num_layers > 0 && num_experts > 0,
                    "load estimate of " << num_layers << " layers x " << num_experts << " experts");
  KOKKOSMOE_REQUIRE(!moving || (beta >= 0 && beta < 1), "moving-average factor beta " << beta << " outside [0, 1)");
  load_.assign(static_cast<std::size_t>(num_layers), std::vector<double>(static_cast<std::size_t>(num_experts), 0.0));
  observations_.assign(static_cast<std::size_t>(num_layers), 0);
  last_layer_step_.assign(static_cast<std::size_t>(num_layers), -1);
  provenance_.phase = std::move(phase);
  provenance_.generation = generation;
  provenance_.moving_average = moving;
  provenance_.beta = moving ? beta : 0.0;
}

LoadEstimate LoadEstimate::cumulative(int num_layers, int num_experts, std::string phase, std::uint64_t generation) {
  return LoadEstimate(num_layers, num_experts, std::move(phase), generation, false, 0.0);
}

LoadEstimate LoadEstimate::moving_average(int num_layers, int num_experts, double beta, std::string phase,
                                          std::uint64_t generation) {
  return LoadEstimate(num_layers, num_experts, std::move(phase), generation, true, beta);
}

void LoadEstimate::observe(std::int64_t step, int layer, std::vector<std::int64_t> const& counts) {
  KOKKOSMOE_REQUIRE(num_experts_ > 0, "observe on an empty load estimate");
  KOKKOSMOE_REQUIRE(layer >= 0 && layer < num_layers(), "observe: layer " << layer << " outside [0, " << num_layers() << ")");
  KOKKOSMOE_REQUIRE(static_cast<int>(counts.size()) == num_experts_,
                    "observe: layer " << layer << " has " << counts.size() << " counts for " << num_experts_ << " experts");
  KOKKOSMOE_REQUIRE(step >= 0, "observe: negative step " << step);
  KOKKOSMOE_REQUIRE(step >= provenance_.last_step, "observe: step " << step << " is older than the last observed step "
                                                                    << provenance_.last_step);
  KOKKOSMOE_REQUIRE(last_layer_step_[static_cast<std::size_t>(layer)] != step,
                    "observe: layer " << layer << " was already observed at step " << step);
  for (std::size_t e = 0; e < counts.size(); ++e)
    KOKKOSMOE_REQUIRE(counts[e] >= 0, "observe: layer " << layer << ", expert " << e << " has count " << counts[e]);
  auto& ld = load_[static_cast<std::size_t>(layer)];
  auto& n = observations_[static_cast<std::size_t>(layer)];
  double const beta = provenance_.beta;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    double const c = static_cast<double>(counts[e]);
    if (!provenance_.moving_average)
      ld[e] += c;
    else
      ld[e] = n == 0 ? c : beta * ld[e] + (1.0 - beta) * c;
  }
  ++n;
  last_layer_step_[static_cast<std::size_t>(layer)] = step;
  if (step != provenance_.last_step) ++provenance_.steps;
  if (provenance_.first_step < 0) provenance_.first_step = step;
  provenance_.last_step = step;
}

void LoadEstimate::observe(std::int64_t step, std::vector<std::vector<std::int64_t>> const& counts) {
  KOKKOSMOE_REQUIRE(static_cast<int>(counts.size()) == num_layers(),
                    "observe: " << counts.size() << " layers of counts for an estimate of " << num_layers() << " layers");
  for (int l = 0; l < num_layers(); ++l) observe(step, l, counts[static_cast<std::size_t>(l)]);
}

std::string LoadEstimate::to_json(int indent) const {
  nlohmann::json j;
  j["provenance"] = {{"phase", provenance_.phase},
                     {"generation", provenance_.generation},
                     {"window", {provenance_.first_step, provenance_.last_step}},
                     {"steps", provenance_.steps},
                     {"mode", provenance_.moving_average ? "moving_average" : "cumulative"},
                     {"beta", provenance_.beta}};
  j["layers"] = nlohmann::json::array();
  for (auto const& ld : load_) j["layers"].push_back({{"load", ld}});
  return j.dump(indent);
}

}  // namespace KokkosMoE
