#ifndef KMOE_EXCHANGE_UTIL_HPP
#define KMOE_EXCHANGE_UTIL_HPP

// One distributed MoE step with scalar experts through any exchange
// algorithm: route plan -> dispatch plan -> pack -> exchange.dispatch ->
// repack -> scalar experts -> unrepack -> exchange.combine -> combine.

#include "kmoe_sim.hpp"

#include <KokkosMoE_Exchange_Flat.hpp>
#include <KokkosMoE_Exchange_Hierarchical.hpp>
#include <KokkosMoE_Exchange_PooledWave.hpp>

namespace kmoe_test {

struct StepResult {
  KokkosMoE::RowMatrix<float, MS> out;
  KokkosMoE::Exchange::ByteLedger ledger;  // this rank's
  std::vector<KokkosMoE::index_t> arrival_ids;       // global route ids in arrival order
  std::vector<KokkosMoE::index_t> expert_major_ids;  // global route ids expert-major
  std::vector<KokkosMoE::index_t> slot_counts;
  std::vector<KokkosMoE::index_t> send_counts;
  std::vector<KokkosMoE::index_t> recv_counts;
};

/// Scalar experts on expert-major rows: y = scale[expert of local slot q] * x.
inline KokkosMoE::RowMatrix<float, MS> scalar_expert_rows(KokkosMoE::RowMatrix<float, MS> const& x,
                                                         KokkosMoE::RepackPlan<MS> const& repack,
                                                         KokkosMoE::Placement const& p, int rank,
                                                         std::vector<float> const& scale) {
  auto const& slots = p.slots_of_rank(rank);
  std::vector<float> slot_scale;
  for (int s : slots) slot_scale.push_back(scale[static_cast<std::size_t>(p.slot(s).expert)]);
  KokkosMoE::Vector<float, MS> sc("test::slot_scale", slot_scale.size());
  auto hs = Kokkos::create_mirror_view(sc);
  for (std::size_t i = 0; i < slot_scale.size(); ++i) hs(i) = slot_scale[i];
  Kokkos::deep_copy(sc, hs);
  KokkosMoE::RowMatrix<float, MS> y("test::y", x.extent(0), x.extent(1));
  auto off = repack.offsets;
  int const L = static_cast<int>(slot_scale.size());
  Kokkos::parallel_for(
      "test::scalar_experts", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {static_cast<KokkosMoE::index_t>(x.extent(0)), static_cast<KokkosMoE::index_t>(x.extent(1))}),
      KOKKOS_LAMBDA(KokkosMoE::index_t i, KokkosMoE::index_t c) {
        int q = 0;
        while (q + 1 < L && off(q + 1) <= i) ++q;
        y(i, c) = sc(q) * x(i, c);
      });
  return y;
}

template <class ExchangeT>
StepResult run_step(ExchangeT& xchg, KokkosMoE::Placement const& placement, HostRoutes const& routes,
                    KokkosMoE::RowMatrix<float, MS> const& hidden, std::vector<float> const& scale, int rank,
                    KokkosMoE::index_t id_base, std::vector<KokkosMoE::index_t> const& bases, KokkosMoE::PayloadType type,
                    int origin_node = -1) {
  using namespace KokkosMoE;
  Exec exec;
  auto const& comms = xchg.communicators();
  auto table = make_table(routes, placement.num_experts());
  Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot;
  if (!routes.slot.empty()) {
    explicit_slot = Kokkos::View<int**, Kokkos::LayoutRight, MS>("test::explicit", routes.tokens, routes.k);
    auto h = Kokkos::create_mirror_view(explicit_slot);
    for (int i = 0; i < routes.tokens * routes.k; ++i) h.data()[i] = routes.slot[static_cast<std::size_t>(i)];
    Kokkos::deep_copy(explicit_slot, h);
  }
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, rank, origin_node);
  auto rp = make_route_plan(exec, table, dp, choice, rank, id_base, explicit_slot);
  auto plan = make_dispatch_plan(exec, rp, placement, comms.ep().peer_order());
  PayloadBuffer<MS> send("test::send", type, static_cast<int>(hidden.extent(1)), plan.rows());
  Kokkos::View<RowMeta*, MS> meta("test::meta", plan.rows());
  pack(exec, rp, plan, hidden, send, meta);
  auto h = xchg.dispatch(exec, placement, plan, send, meta);
  RowMatrix<float, MS> x("test::x_em", h.repack.rows(), hidden.extent(1));
  repack(exec, h.repack, h.arrived, x);
  auto y = scalar_expert_rows(x, h.repack, placement, rank, scale);
  PayloadType const back_type = type == PayloadType::fp32 ? PayloadType::fp32 : PayloadType::bf16;
  PayloadBuffer<MS> back("test::back", back_type, static_cast<int>(hidden.extent(1)), h.repack.rows());
  unrepack(exec, h.repack, y, back);
  auto returned = xchg.combine(exec, h, back);
  StepResult r;
  r.out = RowMatrix<float, MS>("test::out", routes.tokens, hidden.extent(1));
  combine(exec, rp, h.plan, returned, r.out);
  r.ledger = h.ledger;
  auto am = to_host_vector(h.arrived_meta);
  for (auto const& m : am) r.arrival_ids.push_back(bases[static_cast<std::size_t>(m.origin_rank)] + m.route);
  auto perm = to_host_vector(h.repack.perm);
  for (auto p : perm) r.expert_major_ids.push_back(r.arrival_ids[static_cast<std::size_t>(p)]);
  r.slot_counts = h.repack.slot_counts;
  r.send_counts = h.plan.counts;
  r.recv_counts = h.recv_counts;
  return r;
}

/// Scalar experts as a pooled-wave callback: decode, scale per local slot, encode.
inline KokkosMoE::Exchange::WaveExpertFn<MS> scalar_wave_experts(KokkosMoE::Placement const& p, int rank,
                                                                 std::vector<float> const& scale,
                                                                 KokkosMoE::PayloadType return_type) {
  return [&p, rank, scale, return_type](KokkosMoE::PayloadBuffer<MS> const& x_rows, std::vector<KokkosMoE::index_t> const&,
                                        Kokkos::View<KokkosMoE::index_t*, MS> const& offsets_d) {
    using namespace KokkosMoE;
    RowMatrix<float, MS> x("test::wave_x", x_rows.rows(), x_rows.width);
    decode_scatter(Exec(), x_rows, KOKKOS_LAMBDA(index_t i)->index_t { return i; }, x, "test::wave_decode");
    RepackPlan<MS> fake;
    fake.offsets = offsets_d;
    auto y = scalar_expert_rows(x, fake, p, rank, scale);
    PayloadBuffer<MS> out("test::wave_y", return_type, x_rows.width, x_rows.rows());
    gather_encode(Exec(), y, KOKKOS_LAMBDA(index_t i)->index_t { return i; }, out, "test::wave_encode");
    Kokkos::fence();
    return out;
  };
}

/// One step through the pooled-wave exchange.
inline StepResult run_pooled(KokkosMoE::Exchange::PooledWaveExchange<>& xchg, KokkosMoE::Placement const& placement,
                             HostRoutes const& routes, KokkosMoE::RowMatrix<float, MS> const& hidden,
                             std::vector<float> const& scale, int rank, KokkosMoE::PayloadType type, int origin_node = -1,
                             KokkosMoE::Exchange::PooledWaveResult<MS>* raw = nullptr) {
  using namespace KokkosMoE;
  Exec exec;
  auto const& comms = xchg.communicators();
  auto table = make_table(routes, placement.num_experts());
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, rank, origin_node);
  auto rp = make_route_plan(exec, table, dp, choice, rank);
  auto plan = make_dispatch_plan(exec, rp, placement, comms.ep().peer_order());
  PayloadType const back_type = type == PayloadType::fp32 ? PayloadType::fp32 : PayloadType::bf16;
  auto res = xchg.forward(exec, placement, rp, plan, hidden, type, back_type, scalar_wave_experts(placement, rank, scale, back_type));
  StepResult r;
  r.out = RowMatrix<float, MS>("test::out", routes.tokens, hidden.extent(1));
  combine(exec, rp, plan, res.returned, r.out);
  r.ledger = res.ledger;
  r.send_counts = plan.counts;
  if (raw) *raw = res;
  return r;
}

}  // namespace kmoe_test

#endif
