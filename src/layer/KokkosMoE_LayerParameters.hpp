#ifndef KOKKOSMOE_LAYER_PARAMETERS_HPP
#define KOKKOSMOE_LAYER_PARAMETERS_HPP

/// \file KokkosMoE_LayerParameters.hpp
/// \brief Every parameter of an MoE layer and its gradient, by name and
/// index, as FP32 values: what the C API, Fortran and Python read and write.
///
///   parameter        index            shape (one tensor)
///   router_weight    0                [E, d]
///   correction_bias  0                [E]      (routers with router.correction_bias)
///   expert_gate      global expert e  [f, d]
///   expert_up        global expert e  [f, d]
///   expert_down      global expert e  [d, f]
///   shared_gate      shared expert s  [fs, d]
///   shared_up        shared expert s  [fs, d]
///   shared_down      shared expert s  [d, fs]
///
/// Routed experts are addressed by global (logical) expert id: the layer
/// keeps each where the placement puts it. set_parameter writes every
/// physical slot of the expert (its replicas included), on whichever ranks
/// hold them; get_parameter returns the copy of the lowest rank holding one,
/// on every rank. The router weight, the correction bias and the shared
/// experts live on every rank: set_parameter checks that every rank passes
/// the same bits (a rank-local change would let the ranks route the same
/// token differently).
///
/// Gradients are those of a LayerGradients filled by MoELayer::backward:
/// the router weight's and the shared experts' are summed over the EP group
/// already (the same on every rank); a routed expert's is the sum over its
/// replicas, taken in global slot order when the slots hold partial sums
/// (ReplicaSums::partial, as backward leaves them) or read from the first
/// slot when Experts::ReplicaGradients has summed them (ReplicaSums::reduced).
/// The correction bias has no gradient (it only selects).
///
/// Every call is collective over the layer's EP communicator; a bad name,
/// index, count or value on any rank is the same error on every rank and
/// changes nothing. Writes through set_parameter bump nothing else: the
/// routed weights' per-slot digests are refreshed (checkpoint records).

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Layer.hpp>
#include <KokkosMoE_Payload.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief A parameter tensor family of a layer (see the file's table).
enum class Parameter { router_weight, correction_bias, expert_gate, expert_up, expert_down, shared_gate, shared_up, shared_down };

/// \brief Whether a LayerGradients' routed slots hold per-replica partial
/// sums (as MoELayer::backward leaves them) or every replica's total (after
/// Experts::ReplicaGradients::reduce).
enum class ReplicaSums { partial, reduced };

/// \brief Every parameter family, in the order of the file's table.
inline std::vector<Parameter> const& all_parameters() {
  static std::vector<Parameter> const all = {Parameter::router_weight, Parameter::correction_bias, Parameter::expert_gate,
                                             Parameter::expert_up,     Parameter::expert_down,     Parameter::shared_gate,
                                             Parameter::shared_up,     Parameter::shared_down};
  return all;
}

/// \brief The name of p ("router_weight", "expert_gate", ...).
inline char const* parameter_name(Parameter p) {
  switch (p) {
    case Parameter::router_weight: return "router_weight";
    case Parameter::correction_bias: return "correction_bias";
    case Parameter::expert_gate: return "expert_gate";
    case Parameter::expert_up: return "expert_up";
    case Parameter::expert_down: return "expert_down";
    case Parameter::shared_gate: return "shared_gate";
    case Parameter::shared_up: return "shared_up";
    case Parameter::shared_down: return "shared_down";
  }
  return "unknown";
}

/// \brief The parameter called `name`, or nothing.
inline std::optional<Parameter> parse_parameter(std::string const& name) {
  for (Parameter p : all_parameters())
    if (name == parameter_name(p)) return p;
  return std::nullopt;
}

namespace Impl {

inline bool routed_family(Parameter p) {
  return p == Parameter::expert_gate || p == Parameter::expert_up || p == Parameter::expert_down;
}
inline bool shared_family(Parameter p) {
  return p == Parameter::shared_gate || p == Parameter::shared_up || p == Parameter::shared_down;
}

/// The [L, rows, cols] tensor of family p in weights-like w (gate, up, down).
template <class W>
auto const& family_tensor(W const& w, Parameter p) {
  if (p == Parameter::expert_gate || p == Parameter::shared_gate) return w.gate();
  if (p == Parameter::expert_up || p == Parameter::shared_up) return w.up();
  return w.down();
}
template <class MS>
auto const& gradient_tensor(Experts::ExpertGradients<MS> const& g, Parameter p) {
  if (p == Parameter::expert_gate || p == Parameter::shared_gate) return g.gate;
  if (p == Parameter::expert_up || p == Parameter::shared_up) return g.up;
  return g.down;
}

/// Host FP32 copy of n elements at device pointer src (type T).
template <class T, class MS>
std::vector<float> host_floats(T const* src, std::size_t n) {
  std::vector<float> out(n);
  if (n == 0) return out;
  Kokkos::View<T const*, MS, Kokkos::MemoryTraits<Kokkos::Unmanaged>> dev(src, n);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dev);
  for (std::size_t i = 0; i < n; ++i) out[i] = to_float(h(i));
  return out;
}

/// Writes n FP32 values (rounded to T) to device pointer dst.
template <class T, class MS>
void store_floats(float const* values, T* dst, std::size_t n) {
  if (n == 0) return;
  Kokkos::View<T*, MS, Kokkos::MemoryTraits<Kokkos::Unmanaged>> dev(dst, n);
  auto h = Kokkos::create_mirror_view(dev);
  for (std::size_t i = 0; i < n; ++i) h(i) = from_float<T>(values[i]);
  Kokkos::deep_copy(dev, h);
}

/// Rank `root`'s values on every rank, bit for bit (a bitwise OR with zeros
/// from the others, under the watchdog).
inline void broadcast_floats(std::vector<float>& v, int root, MPI_Comm comm, double watchdog, char const* what) {
  std::vector<std::uint32_t> bits(v.size(), 0u), out(v.size(), 0u);
  if (comm_rank(comm) == root && !v.empty()) std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  KOKKOSMOE_REQUIRE(v.size() <= static_cast<std::size_t>(INT32_MAX), what << ": " << v.size() << " values do not fit one MPI call");
  allreduce_watched(bits.data(), out.data(), static_cast<int>(v.size()), MPI_UINT32_T, MPI_BOR, comm, what, watchdog);
  if (!v.empty()) std::memcpy(v.data(), out.data(), v.size() * sizeof(float));
}

/// FNV-1a over the bits of n floats (null: no values).
inline std::uint64_t float_bits_digest(float const* v, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  auto const* b = reinterpret_cast<unsigned char const*>(v);
  for (std::size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

}  // namespace Impl

/// \brief Number of tensors of family p in `layer`: 1 for the router weight
/// (and the correction bias when the router uses one, else 0), E for routed
/// families, the shared expert count for shared families.
template <class Layer>
int parameter_count(Layer const& layer, Parameter p) {
  auto const& c = layer.config();
  if (p == Parameter::router_weight) return 1;
  if (p == Parameter::correction_bias) return c.router.use_correction_bias ? 1 : 0;
  if (Impl::routed_family(p)) return c.router.num_experts;
  auto const* s = layer.shared_weights();
  return s ? s->num_slots() : 0;
}

/// \brief Shape of one tensor of family p (see the file's table).
template <class Layer>
std::vector<std::int64_t> parameter_shape(Layer const& layer, Parameter p) {
  auto const& c = layer.config();
  std::int64_t const E = c.router.num_experts, d = c.hidden;
  if (p == Parameter::router_weight) return {E, d};
  if (p == Parameter::correction_bias) return {E};
  std::int64_t f = layer.routed_weights().d_ff();
  if (Impl::shared_family(p)) {
    auto const* s = layer.shared_weights();
    f = s ? s->d_ff() : 0;
  }
  if (p == Parameter::expert_down || p == Parameter::shared_down) return {d, f};
  return {f, d};
}

/// \brief Elements of one tensor of family p.
template <class Layer>
std::size_t parameter_elements(Layer const& layer, Parameter p) {
  std::size_t n = 1;
  for (auto x : parameter_shape(layer, p)) n *= static_cast<std::size_t>(x);
  return n;
}

namespace Impl {

/// What is wrong with (p, index) for `layer` ("" for nothing).
template <class Layer>
std::string parameter_index_problem(Layer const& layer, Parameter p, int index, char const* call) {
  std::ostringstream os;
  int const n = parameter_count(layer, p);
  if (n == 0 && p == Parameter::correction_bias)
    os << call << ": the layer's router has no correction bias (router.correction_bias = false)";
  else if (n == 0)
    os << call << ": the layer has no shared experts (model.shared_experts = 0)";
  else if (index < 0 || index >= n)
    os << call << ": " << parameter_name(p) << " index " << index << " is outside 0.." << n - 1;
  else if (Impl::routed_family(p) && layer.routed_weights().d_ff() == 0)
    os << call << ": the layer's routed experts are scalar test experts (no SwiGLU tensors)";
  return os.str();
}

}  // namespace Impl

/// \brief Collective: tensor `index` of family p as FP32 (row-major), the
/// same bits on every rank.
template <class Layer, class Exec>
std::vector<float> get_parameter(Exec const& exec, Layer& layer, Parameter p, int index) {
  using T = typename Layer::value_type;
  using MS = typename Layer::memory_space;
  MPI_Comm ep = layer.communicators().ep().comm();
  double const watchdog = layer.config().exchange.watchdog_seconds;
  agree(ep, Impl::parameter_index_problem(layer, p, index, "get_parameter"), "get_parameter", watchdog);
  exec.fence();
  std::size_t const n = parameter_elements(layer, p);
  if (p == Parameter::router_weight) return Impl::host_floats<T, MS>(layer.router_weight().data(), n);
  if (p == Parameter::correction_bias) return Impl::host_floats<float, MS>(layer.router().correction_bias().data(), n);
  if (Impl::shared_family(p))
    return Impl::host_floats<T, MS>(Impl::family_tensor(*layer.shared_weights(), p).data() + static_cast<std::size_t>(index) * n, n);
  // A routed expert: the lowest rank holding a slot of it sends its copy.
  auto const& pl = layer.placement();
  int const me = layer.communicators().global_rank();
  int root = -1, local = -1;
  for (int s = 0; s < pl.num_slots(); ++s)
    if (pl.slot(s).expert == index && (root < 0 || pl.slot(s).rank < root)) root = pl.slot(s).rank;
  auto const& mine = pl.slots_of_rank(me);
  for (std::size_t q = 0; q < mine.size() && local < 0; ++q)
    if (pl.slot(mine[q]).expert == index) local = static_cast<int>(q);
  std::vector<float> v(n, 0.0f);
  if (me == root) v = Impl::host_floats<T, MS>(Impl::family_tensor(layer.routed_weights(), p).data() + static_cast<std::size_t>(local) * n, n);
  Impl::broadcast_floats(v, root, ep, watchdog, "get_parameter");
  return v;
}

/// \brief Collective: sets tensor `index` of family p from `count` FP32
/// values (rounded to the layer's type). Router weight, correction bias,
/// shared experts: every rank passes the same values. Routed experts: every
/// rank holding a slot of the expert passes its values (the same on all of
/// them); the others may pass none (values null, count 0). Every value must
/// be finite. Nothing changes on any rank when any rank's arguments are bad.
template <class Layer, class Exec>
void set_parameter(Exec const& exec, Layer& layer, Parameter p, int index, float const* values, std::size_t count) {
  using T = typename Layer::value_type;
  using MS = typename Layer::memory_space;
  MPI_Comm ep = layer.communicators().ep().comm();
  double const watchdog = layer.config().exchange.watchdog_seconds;
  int const me = layer.communicators().global_rank();
  std::string problem = Impl::parameter_index_problem(layer, p, index, "set_parameter");
  std::vector<int> local_slots;  // this rank's local slots of a routed expert
  if (problem.empty() && Impl::routed_family(p)) {
    auto const& pl = layer.placement();
    auto const& mine = pl.slots_of_rank(me);
    for (std::size_t q = 0; q < mine.size(); ++q)
      if (pl.slot(mine[q]).expert == index) local_slots.push_back(static_cast<int>(q));
  }
  bool const needs_values = !Impl::routed_family(p) || !local_slots.empty();
  std::size_t const n = problem.empty() ? parameter_elements(layer, p) : 0;
  if (problem.empty()) {
    std::ostringstream os;
    if (needs_values && (values == nullptr || count != n)) {
      os << "set_parameter: " << parameter_name(p) << " " << index << " takes " << n << " values, rank " << me << " passed "
         << (values ? std::to_string(count) : std::string("none"));
    } else if (values && count != n && count != 0) {
      os << "set_parameter: " << parameter_name(p) << " " << index << " takes " << n << " values, rank " << me << " passed " << count;
    } else if (values) {
      for (std::size_t i = 0; i < count; ++i)
        if (!std::isfinite(values[i])) {
          os << "set_parameter: " << parameter_name(p) << " " << index << ": value " << i << " is " << values[i] << " on rank " << me;
          break;
        }
    }
    problem = os.str();
  }
  agree(ep, problem, "set_parameter", watchdog);
  // Every rank that passes values passes the same bits (replicated tensors,
  // replicas of a routed expert).
  bool const gives = values != nullptr && count == n && n > 0;
  std::uint64_t const mine_digest = gives ? Impl::float_bits_digest(values, n) : 0;
  auto const digests = allgather_strings(ep, gives ? std::to_string(mine_digest) : std::string(), watchdog);
  {
    std::string first;
    int first_rank = -1;
    std::ostringstream os;
    for (std::size_t r = 0; r < digests.size(); ++r) {
      if (digests[r].empty()) continue;
      if (first_rank < 0) {
        first = digests[r];
        first_rank = static_cast<int>(r);
      } else if (digests[r] != first && os.str().empty()) {
        os << "set_parameter: " << parameter_name(p) << " " << index << ": ranks " << first_rank << " and " << r
           << " pass different values (every copy of a parameter must be the same)";
      }
    }
    agree(ep, os.str(), "set_parameter values", watchdog);
  }
  exec.fence();
  if (p == Parameter::router_weight) {
    Impl::store_floats<T, MS>(values, layer.router_weight().data(), n);
  } else if (p == Parameter::correction_bias) {
    Impl::store_floats<float, MS>(values, layer.router().correction_bias().data(), n);
  } else if (Impl::shared_family(p)) {
    Impl::store_floats<T, MS>(values, Impl::family_tensor(*layer.shared_weights(), p).data() + static_cast<std::size_t>(index) * n, n);
    layer.shared_weights()->refresh_digests();
  } else {
    for (int q : local_slots)
      Impl::store_floats<T, MS>(values, Impl::family_tensor(layer.routed_weights(), p).data() + static_cast<std::size_t>(q) * n, n);
    if (!local_slots.empty()) layer.routed_weights().refresh_digests();
  }
  Kokkos::fence();
}

/// \brief Collective: the gradient of tensor `index` of family p in grads
/// (MoELayer::backward's), as FP32, the same bits on every rank. `sums`
/// says whether grads' routed slots hold partial sums or totals.
template <class Layer, class Exec, class MS>
std::vector<float> get_gradient(Exec const& exec, Layer& layer, LayerGradients<MS> const& grads, Parameter p, int index,
                                ReplicaSums sums = ReplicaSums::partial) {
  MPI_Comm ep = layer.communicators().ep().comm();
  double const watchdog = layer.config().exchange.watchdog_seconds;
  std::string problem = Impl::parameter_index_problem(layer, p, index, "get_gradient");
  if (problem.empty() && p == Parameter::correction_bias)
    problem = "get_gradient: the correction bias has no gradient (it only selects experts; update it with router.bias_update)";
  if (problem.empty() && grads.router.extent(0) == 0)
    problem = "get_gradient: no backward has filled these gradients yet";
  agree(ep, problem, "get_gradient", watchdog);
  exec.fence();
  std::size_t const n = parameter_elements(layer, p);
  if (p == Parameter::router_weight) return Impl::host_floats<float, MS>(grads.router.data(), n);
  if (Impl::shared_family(p))
    return Impl::host_floats<float, MS>(Impl::gradient_tensor(grads.shared, p).data() + static_cast<std::size_t>(index) * n, n);
  auto const& pl = layer.placement();
  int const me = layer.communicators().global_rank();
  auto const& mine = pl.slots_of_rank(me);
  auto local_of = [&](int slot) {
    for (std::size_t q = 0; q < mine.size(); ++q)
      if (mine[q] == slot) return static_cast<int>(q);
    return -1;
  };
  auto const& tensor = Impl::gradient_tensor(grads.routed, p);
  std::vector<float> total;
  // Every slot of the expert in global slot order, each added on every rank
  // in the same order (the same bits everywhere); after a replica reduction
  // the first slot already holds the total.
  for (int s = 0; s < pl.num_slots(); ++s) {
    if (pl.slot(s).expert != index) continue;
    int const owner = pl.slot(s).rank;
    std::vector<float> v(n, 0.0f);
    if (owner == me) v = Impl::host_floats<float, MS>(tensor.data() + static_cast<std::size_t>(local_of(s)) * n, n);
    Impl::broadcast_floats(v, owner, ep, watchdog, "get_gradient");
    if (total.empty()) {
      total = std::move(v);
      if (sums == ReplicaSums::reduced) break;
    } else {
      for (std::size_t i = 0; i < n; ++i) total[i] += v[i];
    }
  }
  return total;
}

}  // namespace KokkosMoE

#endif
