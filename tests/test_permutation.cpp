// Route plan, dispatch permutation, repack, combine and backward on
// simulated ranks in one process: the dispatch_v17 and transpose_backward
// fixtures exactly, and properties on random plans.

#include "kmoe_catch.hpp"
#include "kmoe_sim.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_CountingSort.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <impl/KokkosMoE_HostRows.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>

using namespace KokkosMoE;
using namespace kmoe_test;

namespace {

RowMatrix<float, MS> rows_from_json(nlohmann::json const& j, int d) {
  RowMatrix<float, MS> m("test::hidden", j.size(), d);
  auto h = Kokkos::create_mirror_view(m);
  for (std::size_t i = 0; i < j.size(); ++i)
    for (int c = 0; c < d; ++c) h(i, c) = j[i][static_cast<std::size_t>(c)].get<float>();
  Kokkos::deep_copy(m, h);
  return m;
}

/// Global route ids of a rank's send order.
std::vector<index_t> send_order_ids(SimRank const& s) {
  auto perm = to_host_vector(s.dispatch.perm);
  auto token = to_host_vector(s.routes.token);
  auto kslot = to_host_vector(s.routes.kslot);
  std::vector<index_t> ids;
  for (auto a : perm) ids.push_back(s.id_base + token[a] * s.routes.top_k + kslot[a]);
  return ids;
}

std::vector<index_t> meta_ids(Kokkos::View<RowMeta*, MS> meta, std::vector<index_t> const& bases) {
  auto h = to_host_vector(meta);
  std::vector<index_t> ids;
  for (auto const& m : h) ids.push_back(bases[m.origin_rank] + m.route);
  return ids;
}

struct V17 {
  Placement placement;
  std::vector<HostRoutes> routes;
  std::vector<RowMatrix<float, MS>> hidden;
  std::vector<float> scale;
  nlohmann::json expected;
};

V17 load_v17() {
  auto const fx = fixture("dispatch_v17.json");
  auto const& in = fx.at("inputs");
  V17 v;
  int const ranks = in.at("ranks").get<int>();
  int const d = in.at("hidden_width").get<int>();
  std::vector<SlotInfo> slots;
  for (auto const& s : in.at("physical_slots")) {
    SlotInfo si;
    si.expert = s.at("expert").get<int>();
    si.rank = s.at("rank").get<int>();
    slots.push_back(si);
  }
  v.placement = Placement(4, ranks, slots, in.at("node_of_rank").get<std::vector<int>>());
  v.scale = in.at("expert_scale").get<std::vector<float>>();
  for (int r = 0; r < ranks; ++r) {
    auto const& h = in.at("hidden").at("rank" + std::to_string(r));
    v.hidden.push_back(h.empty() ? RowMatrix<float, MS>("test::hidden", 0, d) : rows_from_json(h, d));
    HostRoutes hr;
    hr.tokens = static_cast<int>(h.size());
    hr.k = 2;
    hr.expert.assign(static_cast<std::size_t>(hr.tokens * 2), -1);
    hr.gate.assign(hr.expert.size(), 0.0f);
    hr.slot.assign(hr.expert.size(), -1);
    for (auto const& rt : in.at("routes")) {
      if (rt.at("rank").get<int>() != r) continue;
      int const i = rt.at("token").get<int>() * 2 + rt.at("k_slot").get<int>();
      hr.expert[i] = rt.at("expert").get<int>();
      hr.gate[i] = rt.at("gate").get<float>();
      hr.slot[i] = rt.at("physical_slot").get<int>();
    }
    v.routes.push_back(hr);
  }
  v.expected = fx.at("expected");
  return v;
}

}  // namespace

TEST_CASE("dispatch_v17: every expected array on four simulated ranks", "[permutation][fixture]") {
  auto v = load_v17();
  auto const& ex = v.expected;
  std::vector<int> const peers = {0, 1, 2, 3};
  auto sim = simulate(v.placement, v.routes, v.hidden, peers, PayloadType::bf16, v.scale);
  std::vector<index_t> bases;
  for (auto const& s : sim) bases.push_back(s.id_base);
  std::vector<std::vector<index_t>> counts;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    auto const& s = sim[static_cast<std::size_t>(r)];
    counts.push_back(s.dispatch.counts);
    CHECK(s.dispatch.counts == ex.at("count_matrix_src_by_dst")[r].get<std::vector<index_t>>());
    CHECK(s.dispatch.offsets == ex.at("send_offsets_with_sentinel")[r].get<std::vector<index_t>>());
    CHECK(send_order_ids(s) == ex.at("send_order_route_ids")[r].get<std::vector<index_t>>());
    CHECK(s.recv_counts == ex.at("recv_splits_by_src")[r].get<std::vector<index_t>>());
    CHECK(meta_ids(s.arrived_meta, bases) == ex.at("recv_order_route_ids")[r].get<std::vector<index_t>>());
    auto em = meta_ids(s.arrived_meta, bases);
    auto perm = to_host_vector(s.repack.perm);
    std::vector<index_t> em_ids;
    for (auto p : perm) em_ids.push_back(em[static_cast<std::size_t>(p)]);
    CHECK(em_ids == ex.at("expert_major_route_ids")[r].get<std::vector<index_t>>());
    CHECK(s.repack.slot_counts == ex.at("local_slot_counts")[r].get<std::vector<index_t>>());
    // inverse(permutation) is the identity on both sides.
    auto inv = to_host_vector(s.dispatch.inv);
    auto sp = to_host_vector(s.dispatch.perm);
    for (std::size_t a = 0; a < inv.size(); ++a) CHECK(sp[static_cast<std::size_t>(inv[a])] == static_cast<index_t>(a));
  }
  // Outputs of the ranks that own tokens.
  for (int r = 0; r < 2; ++r) {
    auto const& s = sim[static_cast<std::size_t>(r)];
    RowMatrix<float, MS> out("test::out", s.routes.num_tokens, 3);
    combine(Exec(), s.routes, s.dispatch, s.returned, out);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
    auto const want = ex.at("output").at("rank" + std::to_string(r));
    for (int t = 0; t < 2; ++t)
      for (int c = 0; c < 3; ++c) CHECK(h(t, c) == Approx(want[t][c].get<double>()).epsilon(1e-6));
  }
  // The one ledger type: the flat exchange's ledger, planned from the route
  // plans (one rank per node here would change nothing: bytes are by rank).
  Topology::LayoutSpec layout;
  layout.kind = Topology::LayoutKind::virtual_nodes;
  layout.node_of_rank = fixture("dispatch_v17.json").at("inputs").at("node_of_rank").get<std::vector<int>>();
  auto const topo = Topology::Topology::simulated(4, layout);
  auto const comm_layout = Topology::make_comm_layout(topo, Topology::CommSpec{});
  Exchange::RankRoutePlans plans;
  for (auto const& s : sim) plans.push_back(to_host(s.routes));
  Exchange::ExchangeConfig config;
  config.payload = PayloadType::bf16;
  auto const led = Exchange::sum_ledgers(Exchange::plan_flat(Exchange::PlanInput{topo, comm_layout, plans, v.placement, config, 3}));
  using Exchange::LinkClass;
  auto const& d = led.dispatch;
  std::int64_t const remote_rows = d.by_class(LinkClass::intra_node).rows + d.by_class(LinkClass::inter_node).rows;
  std::int64_t const all_bytes = d.by_class(LinkClass::same_rank).payload_bytes + d.by_class(LinkClass::intra_node).payload_bytes +
                                 d.by_class(LinkClass::inter_node).payload_bytes;
  auto const& wl = ex.at("ledger");
  CHECK(d.useful_rows == wl.at("useful_rows_per_direction").get<index_t>());
  CHECK(d.by_class(LinkClass::same_rank).rows == wl.at("same_rank_rows").get<index_t>());
  CHECK(remote_rows == wl.at("remote_rows").get<index_t>());
  CHECK(all_bytes == wl.at("staging_payload_bytes_per_direction").get<std::int64_t>());
  CHECK(all_bytes - d.by_class(LinkClass::same_rank).payload_bytes == wl.at("remote_payload_bytes_per_direction").get<std::int64_t>());
  // A uniform padded all-to-all would move P x P x (largest count) row slots.
  index_t largest = 0;
  for (auto const& row : counts)
    for (auto c : row) largest = std::max(largest, c);
  CHECK(static_cast<index_t>(counts.size() * counts.size()) * largest == wl.at("uniform_padded_row_slots").get<index_t>());
}

TEST_CASE("dispatch_v17 in the explicit peer order [2, 0, 3, 1]", "[permutation][peer-order]") {
  auto v = load_v17();
  auto sim = simulate(v.placement, v.routes, v.hidden, {2, 0, 3, 1}, PayloadType::bf16, v.scale);
  CHECK(sim[0].dispatch.counts == std::vector<index_t>{1, 1, 0, 2});
  CHECK(sim[1].dispatch.counts == std::vector<index_t>{1, 1, 1, 1});
  CHECK(sim[1].recv_counts == std::vector<index_t>{0, 2, 0, 1});
  // Peer order changes the transport order, never the result.
  auto base = simulate(v.placement, v.routes, v.hidden, {0, 1, 2, 3}, PayloadType::bf16, v.scale);
  for (int r = 0; r < 2; ++r) {
    RowMatrix<float, MS> a("a", 2, 3), b("b", 2, 3);
    combine(Exec(), sim[r].routes, sim[r].dispatch, sim[r].returned, a);
    combine(Exec(), base[r].routes, base[r].dispatch, base[r].returned, b);
    auto ha = to_host_vector(a), hb = to_host_vector(b);
    CHECK(kmoe_test::same_bits(ha, hb));
  }
}

TEST_CASE("transpose_backward: forward and backward within 1e-6", "[permutation][backward][fixture]") {
  auto const fx = fixture("transpose_backward.json");
  auto const& in = fx.at("inputs");
  auto const& ex = fx.at("expected");
  auto const scale = in.at("expert_scale").get<std::vector<float>>();
  // Two partitions (simulated ranks); one owner (rank 0) holds all four experts.
  std::vector<SlotInfo> slots;
  for (int e = 0; e < 4; ++e) slots.push_back(SlotInfo{e, 0, -1, 0, 0});
  Placement placement(4, 2, slots);
  std::vector<HostRoutes> routes(2);
  std::vector<std::vector<float>> hid(2);
  for (auto& r : routes) {
    r.tokens = 2;
    r.k = 2;
    r.expert.assign(4, -1);
    r.gate.assign(4, 0.0f);
  }
  for (auto const& rt : in.at("routes")) {
    int const p = rt.at("partition").get<int>();
    int const i = rt.at("token").get<int>() * 2 + rt.at("k_slot").get<int>();
    routes[p].expert[i] = rt.at("expert").get<int>();
    routes[p].gate[i] = rt.at("gate").get<float>();
    if (rt.at("k_slot").get<int>() == 0)
      for (auto x : rt.at("hidden")) hid[p].push_back(x.get<float>());
  }
  std::vector<RowMatrix<float, MS>> hidden;
  for (int p = 0; p < 2; ++p) {
    RowMatrix<float, MS> m("h", 2, 3);
    auto h = Kokkos::create_mirror_view(m);
    for (int i = 0; i < 6; ++i) h.data()[i] = hid[p][static_cast<std::size_t>(i)];
    Kokkos::deep_copy(m, h);
    hidden.push_back(m);
  }
  auto sim = simulate(placement, routes, hidden, {0, 1}, PayloadType::fp32, scale);
  auto const& owner = sim[0];
  CHECK(owner.repack.slot_counts == ex.at("expert_counts").get<std::vector<index_t>>());
  CHECK(owner.repack.slot_offsets == ex.at("expert_offsets").get<std::vector<index_t>>());
  std::vector<index_t> const bases = {sim[0].id_base, sim[1].id_base};
  auto arrival = meta_ids(owner.arrived_meta, bases);
  auto perm = to_host_vector(owner.repack.perm);
  std::vector<index_t> em;
  for (auto p : perm) em.push_back(arrival[static_cast<std::size_t>(p)]);
  CHECK(em == ex.at("permutation").get<std::vector<index_t>>());
  // inverse_permutation[route id] = expert-major position.
  std::vector<index_t> inv_by_id(8);
  for (std::size_t q = 0; q < em.size(); ++q) inv_by_id[static_cast<std::size_t>(em[q])] = static_cast<index_t>(q);
  CHECK(inv_by_id == ex.at("inverse_permutation").get<std::vector<index_t>>());

  // Forward outputs by (partition, token).
  auto const want = ex.at("output_by_partition_token");
  for (int p = 0; p < 2; ++p) {
    RowMatrix<float, MS> out("out", 2, 3);
    combine(Exec(), sim[p].routes, sim[p].dispatch, sim[p].returned, out);
    auto h = to_host_vector(out);
    for (int t = 0; t < 2; ++t)
      for (int c = 0; c < 3; ++c) CHECK(h[t * 3 + c] == Approx(want[p * 2 + t][c].get<double>()).margin(1e-6));
  }

  // Backward with dY = 1: gate grads, expert-output grads g * dY travel to the
  // owner, scale grads there, input grads s_e * dZ travel back and are summed.
  auto const& bw = ex.at("backward_ones");
  std::vector<PayloadBuffer<MS>> dz(2);
  std::vector<std::vector<index_t>> counts;
  for (int p = 0; p < 2; ++p) {
    auto& s = sim[p];
    RowMatrix<float, MS> dY("dY", 2, 3);
    Kokkos::deep_copy(dY, 1.0f);
    // Z in send order: the un-gated expert outputs are what returned holds.
    dz[p] = PayloadBuffer<MS>("dz", PayloadType::fp32, 3, s.dispatch.rows());
    Kokkos::View<float**, Kokkos::LayoutRight, MS> gg("gg", 2, 2);
    combine_backward(Exec(), s.routes, s.dispatch, dY, s.returned, dz[p], gg);
    auto hg = to_host_vector(gg);
    auto const expect_gg = bw.at("gate_grad_by_route").get<std::vector<double>>();
    for (int i = 0; i < 4; ++i) CHECK(hg[i] == Approx(expect_gg[static_cast<std::size_t>(p * 4 + i)]).margin(1e-5));
    counts.push_back(s.dispatch.counts);
  }
  std::vector<std::vector<index_t>> rc;
  auto dz_owner = simulated_alltoallv(Exec(), dz, counts, {0, 1}, rc);
  // On the owner: expert-major dZ, scale grads <dZ_r, x_r>, input grads s_e * dZ_r.
  auto& o = sim[0];
  RowMatrix<float, MS> dz_em("dz_em", o.repack.rows(), 3);
  repack(Exec(), o.repack, dz_owner[0], dz_em);
  auto hdz = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dz_em);
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), o.x_em);
  auto const expect_sg = bw.at("expert_scale_grad").get<std::vector<double>>();
  RowMatrix<float, MS> dx_em("dx_em", o.repack.rows(), 3);
  auto hdx = Kokkos::create_mirror_view(dx_em);
  for (int e = 0; e < 4; ++e) {
    double g = 0;
    for (auto i = o.repack.slot_offsets[e]; i < o.repack.slot_offsets[e + 1]; ++i)
      for (int c = 0; c < 3; ++c) {
        g += static_cast<double>(hdz(i, c)) * hx(i, c);
        hdx(i, c) = scale[static_cast<std::size_t>(e)] * hdz(i, c);
      }
    CHECK(g == Approx(expect_sg[static_cast<std::size_t>(e)]).margin(1e-5));
  }
  Kokkos::deep_copy(dx_em, hdx);
  PayloadBuffer<MS> dx_back("dx_back", PayloadType::fp32, 3, o.repack.rows());
  unrepack(Exec(), o.repack, dx_em, dx_back);
  std::vector<PayloadBuffer<MS>> backs = {dx_back, PayloadBuffer<MS>("empty", PayloadType::fp32, 3, 0)};
  std::vector<std::vector<index_t>> rc2;
  auto dx_ret = simulated_alltoallv(Exec(), backs, rc, {0, 1}, rc2);
  auto const factor = bw.at("token_grad_factor").get<std::vector<double>>();
  for (int p = 0; p < 2; ++p) {
    RowMatrix<float, MS> dX("dX", 2, 3);
    dispatch_backward(Exec(), sim[p].routes, sim[p].dispatch, dx_ret[p], dX);
    auto h = to_host_vector(dX);
    for (int t = 0; t < 2; ++t)
      for (int c = 0; c < 3; ++c) CHECK(h[t * 3 + c] == Approx(factor[static_cast<std::size_t>(p * 2 + t)]).margin(1e-6));
  }
}

namespace {

struct RandomCase {
  int ranks, experts, k, d;
  std::vector<int> tokens;  // per rank
  bool drops;
  bool one_hot_expert;
  bool replicas;
};

/// Direct token-major evaluation on the host: out_t = sum_j g_j * (s_e * x_t).
std::vector<float> direct(HostRoutes const& r, std::vector<float> const& x, int d, std::vector<float> const& scale) {
  std::vector<float> out(static_cast<std::size_t>(r.tokens * d), 0.0f);
  for (int t = 0; t < r.tokens; ++t)
    for (int c = 0; c < d; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < r.k; ++j) {
        int const i = t * r.k + j;
        if (!r.accepted.empty() && !r.accepted[i]) continue;
        float const y = scale[static_cast<std::size_t>(r.expert[i])] * x[static_cast<std::size_t>(t * d + c)];
        acc += r.gate[i] * y;
      }
      out[static_cast<std::size_t>(t * d + c)] = acc;
    }
  return out;
}

}  // namespace

TEST_CASE("random plans: inverses, conservation, direct agreement, reproducibility", "[permutation][property]") {
  std::mt19937 rng(1234);
  std::vector<RandomCase> cases = {
      {3, 7, 2, 5, {6, 0, 9}, true, false, true},     // a rank with zero tokens, drops, replicas
      {4, 8, 8, 4, {5, 3, 7, 2}, false, false, true}, // k = 8 = E
      {2, 5, 1, 3, {11, 4}, false, false, false},     // k = 1
      {4, 6, 3, 6, {8, 8, 8, 8}, true, true, false},  // every route to one expert
      {1, 3, 2, 2, {0}, false, false, false},         // nothing at all
  };
  for (auto const& rc : cases) {
    INFO("ranks " << rc.ranks << " experts " << rc.experts << " k " << rc.k);
    // Placement: round-robin, plus a replica of expert 0 on the last rank.
    std::vector<SlotInfo> slots;
    for (int e = 0; e < rc.experts; ++e) slots.push_back(SlotInfo{e, e % rc.ranks, -1, 0, 0});
    if (rc.replicas) slots.push_back(SlotInfo{0, rc.ranks - 1, -1, 0, 0});
    Placement placement(rc.experts, rc.ranks, slots);
    std::vector<float> scale;
    for (int e = 0; e < rc.experts; ++e) scale.push_back(0.5f + 0.25f * e);
    std::vector<HostRoutes> routes;
    std::vector<RowMatrix<float, MS>> hidden;
    std::vector<std::vector<float>> xs;
    index_t accepted_total = 0;
    for (int r = 0; r < rc.ranks; ++r) {
      HostRoutes h;
      h.tokens = rc.tokens[r];
      h.k = rc.k;
      std::uniform_real_distribution<float> u(-2.0f, 2.0f);
      for (int t = 0; t < h.tokens; ++t) {
        std::vector<int> ids(static_cast<std::size_t>(rc.experts));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < rc.k; ++j) {
          h.expert.push_back(rc.one_hot_expert ? 2 : ids[static_cast<std::size_t>(j)]);
          h.gate.push_back(u(rng));
          int const ok = rc.drops ? static_cast<int>(rng() % 4 != 0) : 1;
          h.accepted.push_back(ok);
          accepted_total += ok;
        }
      }
      std::vector<float> x(static_cast<std::size_t>(h.tokens * rc.d));
      for (auto& v : x) v = u(rng);
      RowMatrix<float, MS> m("x", h.tokens, rc.d);
      auto hm = Kokkos::create_mirror_view(m);
      for (std::size_t i = 0; i < x.size(); ++i) hm.data()[i] = x[i];
      Kokkos::deep_copy(m, hm);
      hidden.push_back(m);
      xs.push_back(x);
      routes.push_back(h);
    }
    std::vector<int> peers(static_cast<std::size_t>(rc.ranks));
    std::iota(peers.begin(), peers.end(), 0);
    std::reverse(peers.begin(), peers.end());
    for (ReplicaPolicy policy : {ReplicaPolicy::locality, ReplicaPolicy::hash}) {
      auto sim = simulate(placement, routes, hidden, peers, PayloadType::fp32, scale, policy);
      index_t sent = 0, segment_rows = 0;
      for (int r = 0; r < rc.ranks; ++r) {
        auto& s = sim[static_cast<std::size_t>(r)];
        for (auto c : s.dispatch.counts) sent += c;
        segment_rows += s.repack.rows();
        // inverse(permutation(a)) = a for every route.
        auto perm = to_host_vector(s.dispatch.perm);
        auto inv = to_host_vector(s.dispatch.inv);
        for (std::size_t a = 0; a < inv.size(); ++a) REQUIRE(perm[static_cast<std::size_t>(inv[a])] == static_cast<index_t>(a));
        auto rperm = to_host_vector(s.repack.perm);
        auto rinv = to_host_vector(s.repack.inv);
        for (std::size_t i = 0; i < rinv.size(); ++i) REQUIRE(rperm[static_cast<std::size_t>(rinv[i])] == static_cast<index_t>(i));
        CHECK(s.routes.size() == static_cast<index_t>(std::count(routes[r].accepted.begin(), routes[r].accepted.end(), 1)));
        // fp32 payload: combine equals direct token-major evaluation bitwise.
        RowMatrix<float, MS> out("out", routes[r].tokens, rc.d);
        combine(Exec(), s.routes, s.dispatch, s.returned, out);
        auto got = to_host_vector(out);
        auto want = direct(routes[r], xs[r], rc.d, scale);
        REQUIRE(got.size() == want.size());
        CHECK(kmoe_test::same_bits(got, want));
        // Repeated combine: identical bits.
        RowMatrix<float, MS> again("again", routes[r].tokens, rc.d);
        combine(Exec(), s.routes, s.dispatch, s.returned, again);
        auto got2 = to_host_vector(again);
        CHECK(kmoe_test::same_bits(got, got2));
      }
      CHECK(sent == accepted_total);
      CHECK(segment_rows == accepted_total);
    }
    // bf16 payload: within bf16 rounding of the fp32 result.
    auto sim16 = simulate(placement, routes, hidden, peers, PayloadType::bf16, scale);
    for (int r = 0; r < rc.ranks; ++r) {
      auto& s = sim16[static_cast<std::size_t>(r)];
      RowMatrix<float, MS> out("out16", routes[r].tokens, rc.d);
      combine(Exec(), s.routes, s.dispatch, s.returned, out);
      auto got = to_host_vector(out);
      auto want = direct(routes[r], xs[r], rc.d, scale);
      for (std::size_t i = 0; i < got.size(); ++i) {
        float bound = 0.0f;
        int const t = static_cast<int>(i) / rc.d;
        for (int j = 0; j < rc.k; ++j) {
          int const ri = t * rc.k + j;
          if (routes[r].accepted.empty() || routes[r].accepted[ri])
            bound += std::fabs(routes[r].gate[ri]) * scale[routes[r].expert[ri]] * std::fabs(xs[r][i]);
        }
        CHECK(std::fabs(got[i] - want[i]) <= bound * 2.0f * 0.00390625f + 1e-6f);
      }
      // bf16 output: the FP32 sum rounded once to bf16.
      RowMatrix<bf16_t, MS> out_b("out16b", routes[r].tokens, rc.d);
      combine(Exec(), s.routes, s.dispatch, s.returned, out_b);
      auto got_b = to_host_vector(out_b);
      REQUIRE(got_b.size() == got.size());
      std::size_t mismatched = 0;
      for (std::size_t i = 0; i < got.size(); ++i) mismatched += got_b[i].bits != to_bf16(got[i]).bits ? 1 : 0;
      CHECK(mismatched == 0);
    }
  }
}

TEST_CASE("fp8 payload rows carry their scales through the permutation", "[permutation][fp8]") {
  for (PayloadType type : {PayloadType::fp8_row, PayloadType::fp8_block128}) {
    int const d = 300;  // three 128-blocks, the last one partial
    Placement placement = Placement::round_robin(4, 2);
    std::vector<HostRoutes> routes(2);
    std::vector<RowMatrix<float, MS>> hidden;
    std::vector<std::vector<float>> xs;
    std::mt19937 rng(5);
    for (int r = 0; r < 2; ++r) {
      routes[r].tokens = 5;
      routes[r].k = 2;
      for (int t = 0; t < 5; ++t)
        for (int j = 0; j < 2; ++j) {
          routes[r].expert.push_back((t + j + r) % 4);
          routes[r].gate.push_back(1.0f);
        }
      RowMatrix<float, MS> m("x", 5, d);
      auto h = Kokkos::create_mirror_view(m);
      std::vector<float> x;
      for (int i = 0; i < 5 * d; ++i) {
        // Blocks of very different magnitude: per-block scales matter.
        float const mag = (i % d) < 128 ? 1000.0f : ((i % d) < 256 ? 0.01f : 1.0f);
        h.data()[i] = mag * (static_cast<float>(rng() % 2001) / 1000.0f - 1.0f);
        x.push_back(h.data()[i]);
      }
      Kokkos::deep_copy(m, h);
      hidden.push_back(m);
      xs.push_back(x);
    }
    std::vector<float> ones(4, 1.0f);
    auto sim = simulate(placement, routes, hidden, {0, 1}, type, ones);
    for (int r = 0; r < 2; ++r) {
      RowMatrix<float, MS> out("out", 5, d);
      combine(Exec(), sim[r].routes, sim[r].dispatch, sim[r].returned, out);
      auto got = to_host_vector(out);
      for (int t = 0; t < 5; ++t)
        for (int c = 0; c < d; ++c) {
          float const x = xs[r][static_cast<std::size_t>(t * d + c)];
          float const blk_amax = c < 128 ? 1000.0f : (c < 256 ? 0.01f : 1.0f);
          float const amax = type == PayloadType::fp8_row ? 1000.0f : blk_amax;
          // Two routes of gate 1: 2x; fp8 relative step 2^-4 plus bf16 return.
          CHECK(std::fabs(got[static_cast<std::size_t>(t * d + c)] - 2 * x) <=
                2 * (std::fabs(x) * (0.0625f + 0.0079f) + amax * 0.0025f));
        }
    }
  }
}

TEST_CASE("bad plans are rejected with clear errors", "[permutation][errors]") {
  Placement placement = Placement::round_robin(4, 2);
  HostRoutes h;
  h.tokens = 1;
  h.k = 2;
  h.expert = {0, 1};
  h.gate = {0.5f, 0.5f};
  h.slot = {1, 0};  // slot 1 stores expert 1, not 0
  auto table = make_table(h, 4);
  auto dp = make_device_placement<MS>(placement);
  auto choice = make_replica_choice<MS>(placement, 0, -1);
  Kokkos::View<int**, Kokkos::LayoutRight, MS> ex("ex", 1, 2);
  auto hx = Kokkos::create_mirror_view(ex);
  hx(0, 0) = 2;
  hx(0, 1) = 0;
  Kokkos::deep_copy(ex, hx);
  CHECK_THROWS_WITH(make_route_plan(Exec(), table, dp, choice, 0, 0, ex),
                    Catch::Matchers::Contains("token 0, k-slot 0) to expert 0 has no valid physical slot (explicit slot 2)"));
  auto plan = make_route_plan(Exec(), table, dp, choice, 0);
  CHECK_THROWS_WITH(make_dispatch_plan(Exec(), plan, placement, {0}),
                    Catch::Matchers::Contains("outside the communicator's peer order"));
  CHECK_THROWS_WITH(make_dispatch_plan(Exec(), plan, placement, {0, 0}), Catch::Matchers::Contains("appears twice"));
  // A row arriving at a rank that does not hold its slot.
  Kokkos::View<RowMeta*, MS> meta("meta", 1);
  auto hm = Kokkos::create_mirror_view(meta);
  hm(0) = RowMeta{2, 1, 0, 0};  // slot 2 lives on rank 1
  Kokkos::deep_copy(meta, hm);
  CHECK_THROWS_WITH(make_repack_plan(Exec(), meta, placement, 0),
                    Catch::Matchers::Contains("arrived at rank 0 for physical slot 2"));
}

TEST_CASE("host row kernel: the sequential FP32 sum, rounded once to bf16", "[permutation][combine]") {
  // Whatever clone the CPU selects (baseline, AVX2, AVX-512) must give the
  // bits of a plain loop: products and sums in k order, never fused.
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  float const inf = std::numeric_limits<float>::infinity();
  for (int d : {1, 7, 128, 129, 300, 1000}) {
    for (int n : {0, 1, 3, 8}) {
      std::vector<std::vector<float>> f32(static_cast<std::size_t>(n), std::vector<float>(static_cast<std::size_t>(d)));
      std::vector<std::vector<std::uint16_t>> b16(static_cast<std::size_t>(n), std::vector<std::uint16_t>(static_cast<std::size_t>(d)));
      std::vector<float> w(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {
        w[j] = u(rng);
        for (int c = 0; c < d; ++c) {
          float v = u(rng) * 1e3f;
          if (c == 5 && j == 0) v = inf;
          if (c == 6 && j == 1) v = std::numeric_limits<float>::quiet_NaN();
          f32[j][c] = v;
          b16[j][c] = to_bf16(v).bits;
        }
      }
      for (PayloadType type : {PayloadType::fp32, PayloadType::bf16}) {
        std::vector<unsigned char const*> rows(static_cast<std::size_t>(n));
        for (int j = 0; j < n; ++j)
          rows[j] = type == PayloadType::fp32 ? reinterpret_cast<unsigned char const*>(f32[j].data())
                                              : reinterpret_cast<unsigned char const*>(b16[j].data());
        std::vector<float> want(static_cast<std::size_t>(d));
        for (int c = 0; c < d; ++c) {
          volatile float acc = 0.0f;  // one rounding per product and per sum
          for (int j = 0; j < n; ++j) {
            volatile float const y = type == PayloadType::fp32 ? f32[j][c] : to_float(bf16_t{b16[j][c]});
            volatile float const prod = w[j] * y;
            acc = acc + prod;
          }
          want[c] = acc;
        }
        std::vector<float> got(static_cast<std::size_t>(d), -1.0f);
        std::vector<std::uint16_t> got_b(static_cast<std::size_t>(d), 0xFFFFu);
        Impl::host_weighted_rows(type, rows.data(), w.data(), n, d, got.data(), nullptr, rows.data(), n);
        Impl::host_weighted_rows(type, rows.data(), w.data(), n, d, nullptr, got_b.data());
        std::size_t bad = 0, bad_b = 0;
        for (int c = 0; c < d; ++c) {
          bad += std::memcmp(&got[c], &want[c], sizeof(float)) != 0 && !(std::isnan(got[c]) && std::isnan(want[c])) ? 1 : 0;
          bad_b += got_b[c] != to_bf16(want[c]).bits ? 1 : 0;
        }
        INFO("d = " << d << ", n = " << n << ", type " << static_cast<int>(type));
        CHECK(bad == 0);
        CHECK(bad_b == 0);
      }
    }
  }
}

TEST_CASE("explicit slots per route: a route without one takes the replica policy's, the others keep theirs", "[permutation][routes]") {
  Exec exec;
  // Expert 0 on rank 0 (slot 0) and rank 1 (slot 2); expert 1 on rank 1 (slot 1).
  std::vector<SlotInfo> slots = {SlotInfo{0, 0, -1, 0, 0}, SlotInfo{1, 1, -1, 0, 0}, SlotInfo{0, 1, -1, 0, 0}};
  Placement placement(2, 2, slots, {0, 1});
  HostRoutes h;
  h.tokens = 3;
  h.k = 1;
  h.expert = {0, 0, 1};
  h.gate = {1.0f, 1.0f, 1.0f};
  auto table = make_table(h, 2);
  Kokkos::View<int**, Kokkos::LayoutRight, MS> explicit_slot("explicit", 3, 1);
  auto hs = Kokkos::create_mirror_view(explicit_slot);
  hs(0, 0) = 2;   // pinned to the copy on rank 1
  hs(1, 0) = -1;  // the locality policy's copy: rank 0's own
  hs(2, 0) = -1;
  Kokkos::deep_copy(explicit_slot, hs);
  auto rp = make_route_plan(exec, table, make_device_placement<MS>(placement), make_replica_choice<MS>(placement, 0, 0), 0, 0,
                            explicit_slot);
  CHECK(to_host_vector(rp.slot) == std::vector<int>{2, 0, 1});
  CHECK(to_host_vector(rp.dest_rank) == std::vector<int>{1, 0, 1});
  // A given slot that does not hold the route's expert is still an error.
  hs(2, 0) = 0;
  Kokkos::deep_copy(explicit_slot, hs);
  CHECK_THROWS_WITH(make_route_plan(exec, table, make_device_placement<MS>(placement), make_replica_choice<MS>(placement, 0, 0), 0, 0,
                                    explicit_slot),
                    Catch::Matchers::Contains("(explicit slot 0)"));
}

TEST_CASE("combine rejects a corrupt inverse permutation before it writes the output", "[permutation][fault]") {
  auto v = load_v17();
  auto sim = simulate(v.placement, v.routes, v.hidden, {0, 1, 2, 3}, PayloadType::bf16, v.scale);
  auto& s = sim[0];
  REQUIRE(s.dispatch.rows() >= 2);
  for (int fault : {0, 1}) {
    INFO((fault == 0 ? "duplicate index" : "index out of range"));
    auto inv = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), s.dispatch.inv);
    DispatchPlan<MS> bad = s.dispatch;
    bad.inv = Kokkos::View<index_t*, MS>("bad_inv", inv.extent(0));
    auto hb = Kokkos::create_mirror_view(bad.inv);
    for (std::size_t a = 0; a < inv.extent(0); ++a) hb(a) = inv(a);
    if (fault == 0) hb(1) = hb(0);
    else hb(1) = static_cast<index_t>(inv.extent(0)) + 5;
    Kokkos::deep_copy(bad.inv, hb);
    RowMatrix<float, MS> out("out", s.routes.num_tokens, 3);
    Kokkos::deep_copy(out, 7.0f);
    CHECK_THROWS_WITH(combine(Exec(), s.routes, bad, s.returned, out), Catch::Matchers::Contains("inverse permutation is corrupt"));
    for (float x : to_host_vector(out)) CHECK(x == 7.0f);  // nothing was written
  }
}

TEST_CASE("stable counting sort: the order of std::stable_sort, with many keys and few; bad keys rejected", "[permutation][sort]") {
  std::mt19937 rng(17);
  // {rows, keys}: few keys; more keys than rows, so that the (key, chunk)
  // table meets its cap of max(rows, 2^20) cells; no rows.
  for (auto const& [n, K] : {std::pair<int, int>{5000, 7}, std::pair<int, int>{70000, 300000}, std::pair<int, int>{0, 3}}) {
    INFO(n << " rows, " << K << " keys");
    std::vector<int> keys(static_cast<std::size_t>(n));
    for (auto& k : keys) k = std::uniform_int_distribution<int>(0, K - 1)(rng);
    Kokkos::View<int*, MS> kd("keys", n);
    auto kh = Kokkos::create_mirror_view(kd);
    for (int i = 0; i < n; ++i) kh(i) = keys[static_cast<std::size_t>(i)];
    Kokkos::deep_copy(kd, kh);
    Kokkos::View<index_t*, MS> perm("perm", n), offsets("offsets", K + 1);
    stable_counting_sort(Exec(), kd, K, perm, offsets);
    std::vector<index_t> want(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) want[static_cast<std::size_t>(i)] = i;
    std::stable_sort(want.begin(), want.end(), [&](index_t a, index_t b) { return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)]; });
    CHECK(to_host_vector(perm) == want);
    auto const off = to_host_vector(offsets);
    for (int k = 0; k <= K; ++k) {
      auto const first = std::lower_bound(want.begin(), want.end(), k, [&](index_t a, int key) { return keys[static_cast<std::size_t>(a)] < key; });
      if (off[static_cast<std::size_t>(k)] != first - want.begin()) {
        FAIL_CHECK("offsets(" << k << ") = " << off[static_cast<std::size_t>(k)] << ", expected " << (first - want.begin()));
        break;
      }
    }
  }
  Kokkos::View<int*, MS> bad("bad", 3);
  Kokkos::deep_copy(bad, 5);
  Kokkos::View<index_t*, MS> perm("perm", 3), offsets("offsets", 4);
  CHECK_THROWS_WITH(stable_counting_sort(Exec(), bad, 3, perm, offsets, "sort test"),
                    Catch::Matchers::Contains("sort test: 3 keys outside [0, 3)"));
}
