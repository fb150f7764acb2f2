#ifndef KOKKOSMOE_COMBINE_HPP
#define KOKKOSMOE_COMBINE_HPP

/// \file KokkosMoE_Combine.hpp
/// \brief Combine: per origin token the gate-weighted sum of its accepted
/// routes' returned rows, in k-slot order with FP32 accumulation (no atomics:
/// bitwise reproducible). Backward: expert-output gradients g_r * dY, gate
/// gradients <dY, Z_r>, and token-input gradients summed over a token's routes.

#include <KokkosMoE_DispatchPlan.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_RoutePlan.hpp>
#include <impl/KokkosMoE_HostRows.hpp>

namespace KokkosMoE {

/// \brief Who multiplies by the gate. It happens exactly once: in combine, or
/// in the expert runner (which then must be declared so here).
enum class GateOwner { combine, runner };

namespace Impl {

/// acc[c] += w * y[c] over a row (host loops the compiler vectorises).
KOKKOS_INLINE_FUNCTION void axpy_row(float* KOKKOS_RESTRICT acc, unsigned char const* KOKKOS_RESTRICT row, PayloadType type,
                                     float w, int d) {
  if (type == PayloadType::bf16) {
    auto const* KOKKOS_RESTRICT y = reinterpret_cast<std::uint16_t const*>(row);
    for (int c = 0; c < d; ++c) {
      std::uint32_t const u = static_cast<std::uint32_t>(y[c]) << 16;
      float f;
      memcpy(&f, &u, 4);
      acc[c] += w * f;
    }
  } else if (type == PayloadType::fp32) {
    auto const* KOKKOS_RESTRICT y = reinterpret_cast<float const*>(row);
    for (int c = 0; c < d; ++c) acc[c] += w * y[c];
  } else {
    for (int c = 0; c < d; ++c) acc[c] += w * payload_load(type, row, d, c);
  }
}

/// Throws Error unless inv is the inverse of perm over [0, rows): every
/// inv(a) in range and perm(inv(a)) == a (which also makes inv one to one).
/// One pass without atomics, before anything reads a row through inv.
template <class Exec, class MS>
void check_inverse(Exec const& exec, DispatchPlan<MS> const& plan, char const* label) {
  index_t const A = plan.rows();
  KOKKOSMOE_REQUIRE(static_cast<index_t>(plan.inv.extent(0)) == A && static_cast<index_t>(plan.perm.extent(0)) == A,
                    label << ": the dispatch plan's permutation has " << plan.perm.extent(0) << " and its inverse "
                          << plan.inv.extent(0) << " entries for " << A << " rows");
  auto perm = plan.perm;
  auto inv = plan.inv;
  index_t first_bad = A;
  Kokkos::parallel_reduce(
      "KokkosMoE::combine::check_inverse", Kokkos::RangePolicy<Exec>(exec, 0, A),
      KOKKOS_LAMBDA(index_t a, index_t & bad) {
        index_t const p = inv(a);
        bool const ok = p >= 0 && p < A && perm(p) == a;
        if (!ok && a < bad) bad = a;
      },
      Kokkos::Min<index_t>(first_bad));
  if (first_bad < A) {
    index_t p = -1;
    Kokkos::deep_copy(p, Kokkos::subview(inv, first_bad));
    KOKKOSMOE_THROW(label << ": the dispatch plan's inverse permutation is corrupt: route " << first_bad << " maps to send position "
                          << p << (p >= 0 && p < A ? ", which holds another route" : ", outside [0, " + std::to_string(A) + ")")
                          << "; the output is rejected");
  }
}

/// The combine's team body: out(t, :) = sum_j w_j * row(inv(route_index(t,
/// j)), :). A named functor, not a lambda: its host and device bodies differ,
/// and nvcc's two passes would have to lay out a lambda's captures alike (the
/// same variables, first named in the same order); members are declared once.
template <class Exec, class MS, class T>
struct WeightedRouteSum {
  using member_t = typename Kokkos::TeamPolicy<Exec>::member_type;
  using scratch_t = Kokkos::View<float*, typename Exec::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16_t>::value, "combine writes float or bf16_t rows");
  /// float rows accumulate in place; bf16 rows in a team scratch row.
  static constexpr bool direct = std::is_same<T, float>::value;

  RowMatrix<T, MS> out;
  typename PayloadBuffer<MS>::bytes_view rows;
  Kokkos::View<index_t**, Kokkos::LayoutRight, MS> route_index;
  Kokkos::View<float*, MS> gate;
  Kokkos::View<index_t*, MS> inv;
  index_t n_tokens = 0;
  int k = 0, d = 0, level = 0;
  PayloadType type = PayloadType::fp32;
  bool use_gate = true;
  /// Devices: eight elements per vector lane with 16-byte loads and stores
  /// and the sums in registers (bf16/fp32 rows, d % 8 == 0, aligned rows).
  bool vec8 = false;

  KOKKOS_INLINE_FUNCTION float* accumulator(member_t const& team, index_t t) const {
    if constexpr (direct) {
      return &out(t, 0);
    } else {
      (void)t;
      return scratch_t(team.team_scratch(level), d).data();
    }
  }

  KOKKOS_INLINE_FUNCTION void operator()(member_t const& team) const {
    index_t const t = team.league_rank();
    float* acc = nullptr;
#if !KOKKOSMOE_DEVICE_PASS
    // Host: one thread per team; bf16/fp32 rows go through the ISA-dispatched
    // row kernel (same bits as the loops below, k rows streamed together).
    constexpr int max_k = 64;
    if ((type == PayloadType::bf16 || type == PayloadType::fp32) && k <= max_k) {
      unsigned char const* src[max_k];
      unsigned char const* next[max_k];
      float wt[max_k];
      int n = 0, n_next = 0;
      for (int j = 0; j < k; ++j) {
        index_t const a = route_index(t, j);
        if (a < 0) continue;
        src[n] = &rows(inv(a), 0);
        wt[n++] = use_gate ? gate(a) : 1.0f;
      }
      for (int j = 0; t + 1 < n_tokens && j < k; ++j) {
        index_t const a = route_index(t + 1, j);
        if (a >= 0) next[n_next++] = &rows(inv(a), 0);
      }
      if constexpr (direct) host_weighted_rows(type, src, wt, n, d, &out(t, 0), nullptr, next, n_next);
      else host_weighted_rows(type, src, wt, n, d, nullptr, reinterpret_cast<std::uint16_t*>(&out(t, 0)), next, n_next);
      return;
    }
    acc = accumulator(team, t);
    for (int c = 0; c < d; ++c) acc[c] = 0.0f;
    for (int j = 0; j < k; ++j) {
      index_t const a = route_index(t, j);
      if (a < 0) continue;
      axpy_row(acc, &rows(inv(a), 0), type, use_gate ? gate(a) : 1.0f, d);
    }
#else
    if (vec8) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d / 8), [&](int v) {
        float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < k; ++j) {
          index_t const a = route_index(t, j);
          if (a < 0) continue;
          float const w = use_gate ? gate(a) : 1.0f;
          float y[8];
          if (type == PayloadType::bf16)
            load8(reinterpret_cast<bf16_t const*>(&rows(inv(a), 0)) + 8 * v, y);
          else
            load8(reinterpret_cast<float const*>(&rows(inv(a), 0)) + 8 * v, y);
          for (int i = 0; i < 8; ++i) sum[i] += Compat::mul_rn(w, y[i]);
        }
        store8(&out(t, 8 * v), sum);
      });
      return;
    }
    acc = accumulator(team, t);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int c) { acc[c] = 0.0f; });
    for (int j = 0; j < k; ++j) {
      index_t const a = route_index(t, j);
      if (a < 0) continue;
      float const w = use_gate ? gate(a) : 1.0f;
      unsigned char const* row = &rows(inv(a), 0);
      if (type == PayloadType::bf16) {
        auto const* y = reinterpret_cast<std::uint16_t const*>(row);
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d),
                             [&](int c) { acc[c] += Compat::mul_rn(w, to_float(bf16_t{y[c]})); });
      } else if (type == PayloadType::fp32) {
        auto const* y = reinterpret_cast<float const*>(row);
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int c) { acc[c] += Compat::mul_rn(w, y[c]); });
      } else {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d),
                             [&](int c) { acc[c] += Compat::mul_rn(w, payload_load(type, row, d, c)); });
      }
    }
#endif
    if constexpr (!direct) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int c) { out(t, c) = from_float<T>(acc[c]); });
    }
  }
};

/// out(t, :) = sum_j w_j * row(inv(route_index(t, j)), :) over accepted j,
/// in k-slot order; w_j = gate or 1.
template <class Exec, class MS, class T>
void weighted_route_sum(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                        PayloadBuffer<MS> const& returned, bool use_gate, RowMatrix<T, MS> const& out, char const* label) {
  KOKKOSMOE_REQUIRE(returned.rows() == plan.rows(),
                    label << ": " << returned.rows() << " returned rows for " << plan.rows() << " dispatched routes");
  check_inverse(exec, plan, label);
  KOKKOSMOE_REQUIRE(static_cast<index_t>(out.extent(0)) == routes.num_tokens && static_cast<int>(out.extent(1)) == returned.width,
                    label << ": output is " << out.extent(0) << "x" << out.extent(1) << ", expected " << routes.num_tokens
                          << "x" << returned.width);
  if (routes.num_tokens == 0) return;
  using body_t = WeightedRouteSum<Exec, MS, T>;
  body_t body;
  body.out = out;
  body.rows = returned.bytes;
  body.route_index = routes.route_index;
  body.gate = routes.gate;
  body.inv = plan.inv;
  body.n_tokens = routes.num_tokens;
  body.k = routes.top_k;
  body.d = returned.width;
  body.type = returned.type;
  body.use_gate = use_gate;
  body.vec8 = (body.type == PayloadType::bf16 || body.type == PayloadType::fp32) && body.d % 8 == 0 &&
              aligned16(returned.bytes.data()) && aligned16(out.data());
  // A scratch row for bf16 outputs, except where the device's eight-wide
  // path keeps the sums in registers.
  std::size_t const bytes = body_t::direct || (body.vec8 && !runs_on_host<Exec>())
                                ? 0
                                : body_t::scratch_t::shmem_size(static_cast<std::size_t>(body.d));
  body.level = bytes > 32768 ? 1 : 0;
  auto policy = Impl::row_policy(exec, routes.num_tokens);
  if (bytes > 0) policy.set_scratch_size(body.level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for(label, policy, body);
}

}  // namespace Impl

/// \brief out[T, d] = per token the sum over its accepted routes (k-slot
/// order) of gate * returned row, where returned holds the expert outputs in
/// the source's send order (after the return transport). With
/// GateOwner::runner the rows already carry the gate and are summed as they
/// are. Dropped routes add nothing; a token without accepted routes gets 0.
template <class Exec, class MS, class T>
void combine(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
             PayloadBuffer<MS> const& returned, RowMatrix<T, MS> const& out, GateOwner owner = GateOwner::combine) {
  Impl::weighted_route_sum(exec, routes, plan, returned, owner == GateOwner::combine, out, "KokkosMoE::combine");
}

/// \brief Backward of combine for the upstream gradient dY [T, d]:
/// d_out row p (send order, route a = perm(p)) = gate(a) * dY(token(a)), and
/// gate_grad(t, j) = <dY(t), Z(route (t, j))> in FP32 (0 for dropped routes),
/// where expert_out holds the un-gated expert outputs Z in send order.
/// Requires the gate to be owned by combine (a runner that applied the gate
/// would hide Z).
template <class Exec, class MS, class T>
void combine_backward(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                      RowMatrix<T, MS> const& dY, PayloadBuffer<MS> const& expert_out, PayloadBuffer<MS> const& d_out,
                      Kokkos::View<float**, Kokkos::LayoutRight, MS> const& gate_grad, GateOwner owner = GateOwner::combine) {
  KOKKOSMOE_REQUIRE(owner == GateOwner::combine,
                    "combine_backward needs un-gated expert outputs: the gate must be owned by combine, not the runner");
  KOKKOSMOE_REQUIRE(static_cast<index_t>(dY.extent(0)) == routes.num_tokens && static_cast<int>(dY.extent(1)) == expert_out.width,
                    "combine_backward: dY is " << dY.extent(0) << "x" << dY.extent(1) << ", expected " << routes.num_tokens
                                               << "x" << expert_out.width);
  KOKKOSMOE_REQUIRE(expert_out.rows() == plan.rows() && d_out.rows() == plan.rows() && d_out.width == expert_out.width,
                    "combine_backward: " << expert_out.rows() << " expert rows, " << d_out.rows()
                                         << " gradient rows, plan " << plan.rows());
  KOKKOSMOE_REQUIRE(static_cast<index_t>(gate_grad.extent(0)) == routes.num_tokens && static_cast<int>(gate_grad.extent(1)) == routes.top_k,
                    "combine_backward: gate_grad is " << gate_grad.extent(0) << "x" << gate_grad.extent(1));
  auto perm = plan.perm;
  auto inv = plan.inv;
  auto token = routes.token;
  auto gate = routes.gate;
  // d_out = gate * dY(token), encoded in d_out's payload type.
  {
    index_t const rows = plan.rows();
    int const d = d_out.width;
    PayloadType const t = d_out.type;
    auto bytes = d_out.bytes;
    using policy_t = Kokkos::TeamPolicy<Exec>;
    if (rows > 0)
      Kokkos::parallel_for(
          "KokkosMoE::combine_backward::expert_grad", Impl::row_policy(exec, rows),
          KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
            index_t const p = team.league_rank();
            index_t const a = perm(p);
            float const g = gate(a);
            T const* dy = &dY(token(a), 0);
            Impl::encode_row(team, t, d, [&](int j) { return g * to_float(dy[j]); }, &bytes(p, 0));
          });
  }
  // gate_grad(t, j) = <dY(t), Z(a)>.
  {
    index_t const Tn = routes.num_tokens;
    int const k = routes.top_k;
    int const d = expert_out.width;
    PayloadType const type = expert_out.type;
    auto z = expert_out.bytes;
    auto route_index = routes.route_index;
    using policy_t = Kokkos::TeamPolicy<Exec>;
    if (Tn > 0)
      Kokkos::parallel_for(
          "KokkosMoE::combine_backward::gate_grad", Impl::row_policy(exec, Tn * k),
          KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
            index_t const x = team.league_rank();
            index_t const t = x / k;
            int const j = static_cast<int>(x % k);
            index_t const a = route_index(t, j);
            float dot = 0.0f;
            if (a >= 0) {
              unsigned char const* row = &z(inv(a), 0);
              Kokkos::parallel_reduce(
                  Kokkos::ThreadVectorRange(team, d),
                  [&](int c, float& s) { s += to_float(dY(t, c)) * Impl::payload_load(type, row, d, c); }, dot);
            }
            Kokkos::single(Kokkos::PerThread(team), [&]() { gate_grad(t, j) = dot; });
          });
  }
}

/// \brief Backward of dispatch: dX(t) = sum over t's accepted routes (k-slot
/// order, FP32) of the expert-input gradient rows returned in send order.
template <class Exec, class MS, class T>
void dispatch_backward(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                       PayloadBuffer<MS> const& d_in, RowMatrix<T, MS> const& dX) {
  Impl::weighted_route_sum(exec, routes, plan, d_in, false, dX, "KokkosMoE::dispatch_backward");
}

}  // namespace KokkosMoE

#endif
