// Flat and hierarchical exchanges over real MPI: the dispatch_v17 fixture at
// np 4 (virtual nodes {0,1} and {2,3}), random routings against the
// single-process reference (bitwise), ledger conservation, and faults: count
// mismatch, stale handles, a rank that skips a call.

#include "kmoe_catch.hpp"
#include "kmoe_exchange_util.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>

#include <sstream>

#include <cstring>
#include <numeric>
#include <random>

using namespace KokkosMoE;
using namespace KokkosMoE::Exchange;
using namespace kmoe_test;

namespace {

Topology::Topology virtual_topology(std::vector<std::vector<int>> nodes) {
  Topology::LayoutSpec s;
  s.kind = Topology::LayoutKind::virtual_nodes;
  s.nodes = std::move(nodes);
  return Topology::Topology::discover(MPI_COMM_WORLD, s);
}

/// The world as one node, and its communicators.
Topology::CommunicatorSet one_node_comms() { return Topology::CommunicatorSet(MPI_COMM_WORLD, nodes_of(1), Topology::CommSpec{}); }

using rows_view = Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS>;

/// A transport test's buffers of `rows` rows of `bytes`: send rows marked
/// with the sender's slot + 1, receive rows marked 255 (what was there).
std::pair<rows_view, rows_view> marked_rows(index_t rows, int bytes, int my_slot) {
  rows_view send("send", rows, bytes), recv("recv", rows, bytes);
  Kokkos::deep_copy(send, static_cast<unsigned char>(1 + my_slot));
  Kokkos::deep_copy(recv, static_cast<unsigned char>(255));
  return {send, recv};
}


/// dispatch_v17 inputs for this rank.
struct V17Rank {
  Placement placement;
  HostRoutes routes;
  RowMatrix<float, MS> hidden;
  std::vector<float> scale;
  std::vector<index_t> bases;
  nlohmann::json expected;
};

V17Rank v17_for(int rank) {
  auto const fx = fixture("dispatch_v17.json");
  auto const& in = fx.at("inputs");
  V17Rank v;
  std::vector<SlotInfo> slots;
  for (auto const& s : in.at("physical_slots")) slots.push_back(SlotInfo{s.at("expert").get<int>(), s.at("rank").get<int>(), -1, 0, 0});
  v.placement = Placement(4, 4, slots, in.at("node_of_rank").get<std::vector<int>>());
  v.scale = in.at("expert_scale").get<std::vector<float>>();
  auto const& h = in.at("hidden").at("rank" + std::to_string(rank));
  int const T = static_cast<int>(h.size());
  v.hidden = RowMatrix<float, MS>("hidden", T, 3);
  auto hh = Kokkos::create_mirror_view(v.hidden);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < 3; ++c) hh(t, c) = h[t][c].get<float>();
  Kokkos::deep_copy(v.hidden, hh);
  v.routes.tokens = T;
  v.routes.k = 2;
  v.routes.expert.assign(static_cast<std::size_t>(2 * T), -1);
  v.routes.gate.assign(v.routes.expert.size(), 0.0f);
  v.routes.slot.assign(v.routes.expert.size(), -1);
  for (auto const& rt : in.at("routes")) {
    if (rt.at("rank").get<int>() != rank) continue;
    int const i = rt.at("token").get<int>() * 2 + rt.at("k_slot").get<int>();
    v.routes.expert[i] = rt.at("expert").get<int>();
    v.routes.gate[i] = rt.at("gate").get<float>();
    v.routes.slot[i] = rt.at("physical_slot").get<int>();
  }
  index_t base = 0;
  for (int r = 0; r < 4; ++r) {
    v.bases.push_back(base);
    base += 2 * static_cast<index_t>(in.at("hidden").at("rank" + std::to_string(r)).size());
  }
  v.expected = fx.at("expected");
  return v;
}

template <class X>
void check_v17(X& xchg, V17Rank const& v, int rank) {
  auto r = run_step(xchg, v.placement, v.routes, v.hidden, v.scale, rank, v.bases[rank], v.bases);
  auto const& ex = v.expected;
  CHECK(r.send_counts == ex.at("count_matrix_src_by_dst")[rank].get<std::vector<index_t>>());
  CHECK(r.recv_counts == ex.at("recv_splits_by_src")[rank].get<std::vector<index_t>>());
  CHECK(r.arrival_ids == ex.at("recv_order_route_ids")[rank].get<std::vector<index_t>>());
  CHECK(r.expert_major_ids == ex.at("expert_major_route_ids")[rank].get<std::vector<index_t>>());
  CHECK(r.slot_counts == ex.at("local_slot_counts")[rank].get<std::vector<index_t>>());
  if (rank < 2) {
    auto h = to_host_vector(r.out);
    auto const want = ex.at("output").at("rank" + std::to_string(rank));
    for (int t = 0; t < 2; ++t)
      for (int c = 0; c < 3; ++c) CHECK(h[t * 3 + c] == Approx(want[t][c].get<double>()).epsilon(1e-6));
  }
  auto const total = r.ledger.reduced(MPI_COMM_WORLD);
  auto const& wl = ex.at("ledger");
  CHECK(total.dispatch.useful_rows == wl.at("useful_rows_per_direction").get<std::int64_t>());
  CHECK(total.combine.useful_rows == wl.at("useful_rows_per_direction").get<std::int64_t>());
  auto const remote = total.dispatch.by_class(LinkClass::intra_node).payload_bytes + total.dispatch.by_class(LinkClass::inter_node).payload_bytes;
  if (X::algorithm == Algorithm::flat) {
    CHECK(total.dispatch.by_class(LinkClass::same_rank).rows == wl.at("same_rank_rows").get<std::int64_t>());
    CHECK(remote == wl.at("remote_payload_bytes_per_direction").get<std::int64_t>());
    // Pairs: the directed rank pairs of the count matrix that carry rows,
    // by class, in either direction; metadata and count messages make more
    // messages than pairs, but no pairs.
    auto const counts = ex.at("count_matrix_src_by_dst").get<std::vector<std::vector<index_t>>>();
    auto const node = [](int r) { return r / 2; };
    std::int64_t want[3] = {0, 0, 0};
    for (int a = 0; a < 4; ++a)
      for (int b = 0; b < 4; ++b)
        if (counts[a][b] > 0) ++want[a == b ? 0 : node(a) == node(b) ? 1 : 2];
    CHECK(want[2] == 3);  // (0,2), (1,2), (1,3)
    for (auto const* d : {&total.dispatch, &total.combine}) {
      CHECK(d->by_class(LinkClass::same_rank).pairs == want[0]);
      CHECK(d->by_class(LinkClass::intra_node).pairs == want[1]);
      CHECK(d->by_class(LinkClass::inter_node).pairs == want[2]);
    }
    CHECK(total.dispatch.by_class(LinkClass::inter_node).messages + total.combine.by_class(LinkClass::inter_node).messages >
          total.dispatch.by_class(LinkClass::inter_node).pairs + total.combine.by_class(LinkClass::inter_node).pairs);
  } else {
    // Relay pairs carry the inter-node rows: node 0's relay to node 1's
    // (one relay: 0 -> 2), or one pair per rail (0 -> 2 and 1 -> 3).
    for (auto const* d : {&total.dispatch, &total.combine}) {
      CHECK(d->by_class(LinkClass::inter_node).pairs >= 1);
      CHECK(d->by_class(LinkClass::inter_node).pairs <= 2);
    }
  }
  // Every route row crosses nodes exactly once in either algorithm: routes
  // 3, 4 and 6 (origin node != destination node), 6 bf16 bytes each.
  CHECK(total.dispatch.inter_node_payload_bytes() == 3 * 6);
}

}  // namespace

TEST_CASE("dispatch_v17 over MPI: flat and hierarchical (1 relay, 2 rails)", "[exchange][fixture]") {
  if (world_size() != 4) return;
  int const rank = world_rank();
  auto v = v17_for(rank);
  auto topo = virtual_topology({{0, 1}, {2, 3}});
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  auto const bf16 = exchange_config(PayloadType::bf16);
  FlatExchange<> flat(comms, v.placement, bf16);
  check_v17(flat, v, rank);
  HierarchicalExchange<> hier(comms, v.placement, bf16);
  check_v17(hier, v, rank);
  Topology::CommSpec rails;
  rails.relays_per_node = 2;
  Topology::CommunicatorSet comms2(MPI_COMM_WORLD, topo, rails);
  HierarchicalExchange<> hier2(comms2, v.placement, bf16);
  check_v17(hier2, v, rank);
  // Explicit peer order [2, 0, 3, 1]: same results.
  Topology::CommSpec order;
  order.peer_order = {2, 0, 3, 1};
  Topology::CommunicatorSet comms3(MPI_COMM_WORLD, topo, order);
  FlatExchange<> flat3(comms3, v.placement, bf16);
  auto r = run_step(flat3, v.placement, v.routes, v.hidden, v.scale, rank, v.bases[rank], v.bases);
  if (rank == 0) CHECK(r.send_counts == std::vector<index_t>{1, 1, 0, 2});
  if (rank == 1) CHECK(r.recv_counts == std::vector<index_t>{0, 2, 0, 1});
  CHECK(r.expert_major_ids == v.expected.at("expert_major_route_ids")[rank].get<std::vector<index_t>>());
  HierarchicalExchange<> hier3(comms3, v.placement, bf16);
  auto r3 = run_step(hier3, v.placement, v.routes, v.hidden, v.scale, rank, v.bases[rank], v.bases);
  CHECK(r3.arrival_ids == r.arrival_ids);
  CHECK(r3.expert_major_ids == r.expert_major_ids);
}

namespace {

}  // namespace

TEST_CASE("random routings: every algorithm equals the reference bitwise; ledgers conserve", "[exchange][property]") {
  int const size = world_size();
  int const rank = world_rank();
  if (size < 2) return;
  std::vector<int> rpns;
  if (size % 2 == 0) rpns.push_back(size / 2);          // 2 nodes
  if (size % 4 == 0 && size > 4) rpns.push_back(size / 4);  // 4 nodes
  if (size == 4) rpns.push_back(1);                     // 4 nodes of 1
  int const experts = 2 * size + 1;
  int const k = 3;
  for (int rpn : rpns) {
    auto topo = nodes_of(rpn);
    auto const nor = nodes_vector(topo);
    // Round-robin experts + replicas of expert 0 on the last rank.
    auto const placement = round_robin_with_replica(experts, 0, nor);
    std::vector<float> scale;
    for (int e = 0; e < experts; ++e) scale.push_back(1.0f + 0.125f * e);
    std::vector<int> reversed(static_cast<std::size_t>(size));
    std::iota(reversed.begin(), reversed.end(), 0);
    std::reverse(reversed.begin(), reversed.end());
    for (Dist dist : {Dist::uniform, Dist::one_rank, Dist::empty_ranks, Dist::hot_expert}) {
      std::mt19937 rng(1000u + static_cast<unsigned>(rank) * 7u + static_cast<unsigned>(dist));
      int tokens = 0;
      auto routes = random_routes(dist, rank, size, experts, k, rng, tokens);
      RowMatrix<float, MS> hidden("hidden", tokens, 6);
      std::vector<float> x(static_cast<std::size_t>(tokens * 6));
      {
        auto h = Kokkos::create_mirror_view(hidden);
        std::uniform_real_distribution<float> u(-3.0f, 3.0f);
        for (auto& v : x) v = u(rng);
        for (std::size_t i = 0; i < x.size(); ++i) h.data()[i] = x[i];
        Kokkos::deep_copy(hidden, h);
      }
      // (Named members, not a structured binding: C++17 lambdas below may
      // not capture one.)
      auto const route_ids = route_bases(static_cast<index_t>(tokens) * k);
      auto const& bases = route_ids.bases;
      index_t const total_routes = route_ids.total;
      // Reference: direct token-major evaluation of the same routes (the
      // single-process result; locality choice only picks among copies of
      // the same expert, which have the same scale).
      std::vector<float> ref(static_cast<std::size_t>(tokens * 6), 0.0f);
      for (int t = 0; t < tokens; ++t)
        for (int c = 0; c < 6; ++c) {
          float acc = 0.0f;
          for (int j = 0; j < k; ++j) {
            int const i = t * k + j;
            acc += routes.gate[i] * (scale[routes.expert[i]] * x[static_cast<std::size_t>(t * 6 + c)]);
          }
          ref[static_cast<std::size_t>(t * 6 + c)] = acc;
        }
      for (auto const& peer_order : {std::vector<int>{}, reversed}) {
        for (int R : {1, rpn >= 2 ? 2 : 1}) {
          Topology::CommSpec spec;
          spec.peer_order = peer_order;
          spec.relays_per_node = R;
          Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, spec);
          INFO("np " << size << " ranks/node " << rpn << " R " << R << " dist " << static_cast<int>(dist)
                     << " explicit order " << !peer_order.empty());
          auto const fp32 = exchange_config(PayloadType::fp32);
          FlatExchange<> flat(comms, placement, fp32);
          HierarchicalExchange<> hier(comms, placement, fp32);
          REQUIRE(flat.receives_into_experts<float>());
          auto rf = run_step(flat, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
          auto rh = run_step(hier, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
          auto of = to_host_vector(rf.out), oh = to_host_vector(rh.out);
          REQUIRE(of.size() == ref.size());
          CHECK(kmoe_test::same_bits(of, ref));
          CHECK(kmoe_test::same_bits(oh, ref));
          CHECK(rh.arrival_ids == rf.arrival_ids);
          {
            // Rows through one message per peer and the repack copies (the
            // relay stages: gathered from the stages' buffers): the same
            // arrival and expert-major orders, the same bits, the same expert
            // rows bit for bit (the step would not see rows swapped within
            // one slot).
            auto copies = fp32;
            copies.receive_into_experts = false;
            Exec exec;
            auto const plans = plans_of(comms, placement, routes, rank, bases[rank], nor[rank]);
            auto const& rp = plans.first;
            auto const& plan = plans.second;
            auto same_with_copies = [&](auto& direct, auto& with_copies, auto const& rd, char const* what) {
              INFO(what << " with repack copies");
              REQUIRE(direct.template receives_into_experts<float>());
              REQUIRE_FALSE(with_copies.template receives_into_experts<float>());
              auto rc = run_step(with_copies, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
              CHECK(kmoe_test::same_bits(to_host_vector(rc.out), ref));
              CHECK(rc.arrival_ids == rd.arrival_ids);
              CHECK(rc.expert_major_ids == rd.expert_major_ids);
              CHECK(rc.slot_counts == rd.slot_counts);
              auto hd = direct.dispatch(exec, rp, plan, hidden);
              auto hc = with_copies.dispatch(exec, rp, plan, hidden);
              auto const rows = to_host_vector(hd.expert_rows);
              CHECK(kmoe_test::same_bits(rows, to_host_vector(hc.expert_rows)));
              return rows;
            };
            FlatExchange<> fc(comms, placement, copies);
            HierarchicalExchange<> hc(comms, placement, copies);
            auto const flat_rows = same_with_copies(flat, fc, rf, "flat");
            CHECK(kmoe_test::same_bits(same_with_copies(hier, hc, rh, "hierarchical"), flat_rows));
          }
          // Pooled waves with factors large enough for no drops.
          auto pc = fp32;
          pc.waves = 2;
          pc.tokens_per_rank = 16;
          pc.top_k = k;
          pc.sender_cf = size;
          pc.receiver_cf = 3.0 * size;
          PooledWaveExchange<> pooled(comms, placement, pc);
          REQUIRE(pooled.shape().local_experts == 3);
          auto rp = run_step(pooled, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
          auto op = to_host_vector(rp.out);
          CHECK(kmoe_test::same_bits(op, ref));
          {
            // In-band headers and compaction copies: the same bits, the same
            // expert rows in the same order.
            auto in_band = pc;
            in_band.receive_into_experts = false;
            PooledWaveExchange<> pb(comms, placement, in_band);
            REQUIRE(pooled.direct_rows<float>());
            REQUIRE_FALSE(pb.direct_rows<float>());
            auto rb = run_step(pb, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
            CHECK(kmoe_test::same_bits(to_host_vector(rb.out), ref));
            CHECK(rb.slot_counts == rp.slot_counts);
            Exec exec;
            auto const [route_plan, dispatch_plan] = plans_of(comms, placement, routes, rank, bases[rank], nor[rank]);
            for (int w = 0; w < pooled.waves(); ++w) {
              auto hd = pooled.dispatch(exec, route_plan, dispatch_plan, hidden, w);
              auto hb = pb.dispatch(exec, route_plan, dispatch_plan, hidden, w);
              CHECK(hd.expert_counts == hb.expert_counts);
              CHECK(to_host_vector(hd.arrival_key) == to_host_vector(hb.arrival_key));
              CHECK(kmoe_test::same_bits(to_host_vector(hd.expert_rows), to_host_vector(hb.expert_rows)));
            }
          }
          if (peer_order.empty() && R == 1) {
            // Rows staged through host copies (the path of device memory
            // without a CUDA-aware MPI): the same bits for every algorithm.
            auto staged = fp32;
            staged.stage_through_host = true;
            auto staged_pc = pc;
            staged_pc.stage_through_host = true;
            FlatExchange<> sf(comms, placement, staged);
            HierarchicalExchange<> sh(comms, placement, staged);
            PooledWaveExchange<> sp(comms, placement, staged_pc);
            INFO("staged through the host");
            CHECK(kmoe_test::same_bits(to_host_vector(run_step(sf, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]).out), ref));
            CHECK(kmoe_test::same_bits(to_host_vector(run_step(sh, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]).out), ref));
            CHECK(kmoe_test::same_bits(to_host_vector(run_step(sp, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]).out), ref));
          }
          auto lp = rp.ledger.reduced(MPI_COMM_WORLD);
          CHECK(lp.dispatch.sender_drops == 0);
          CHECK(lp.dispatch.receiver_drops == 0);
          CHECK(lp.dispatch.useful_rows == total_routes);
          auto lf = rf.ledger.reduced(MPI_COMM_WORLD);
          auto lh = rh.ledger.reduced(MPI_COMM_WORLD);
          CHECK(lf.dispatch.useful_rows == total_routes);
          CHECK(lh.dispatch.useful_rows == total_routes);
          CHECK(lf.combine.useful_rows == total_routes);
          CHECK(lh.combine.useful_rows == total_routes);
          index_t moved = 0;
          for (int c = 0; c < num_link_classes; ++c) moved += lf.dispatch.by_class(static_cast<LinkClass>(c)).rows;
          CHECK(moved == total_routes);
          CHECK_NOTHROW(check_inter_node_equal(lf, lh));
          if (rpn == 1 || rpn == size) CHECK(lh.dispatch.relay_rows() == 0);
        }
      }
    }
  }
}

TEST_CASE("pooled-wave shapes and drop rates of the pooled_wave fixture", "[exchange][pooled][fixture]") {
  auto const fx = fixture("pooled_wave.json");
  auto const& in = fx.at("inputs");
  auto const& ex = fx.at("expected");
  // The shape as an exchange derives it from its configuration and placement.
  ExchangeConfig xc;
  xc.waves = in.at("waves").get<int>();
  xc.sender_cf = in.at("sender_cf").get<double>();
  xc.receiver_cf = in.at("receiver_cf").get<double>();
  xc.tokens_per_rank = in.at("tokens_per_rank").get<index_t>();
  xc.top_k = in.at("top_k").get<int>();
  int const ranks = in.at("ranks").get<int>();
  int const local = in.at("local_experts").get<int>();
  std::vector<SlotInfo> slots;
  for (int e = 0; e < local * ranks; ++e) slots.push_back(SlotInfo{e, e / local, -1, 0, 0});
  auto const c = pooled_wave_config(xc, Placement(local * ranks, ranks, slots));
  CHECK(c.local_experts == local);
  auto const s = pooled_wave_shapes(c, ranks);
  CHECK(s.assignments == ex.at("assignments_per_rank").get<index_t>());
  CHECK(s.sender_pool_rows == ex.at("sender_pool_rows").get<index_t>());
  CHECK(s.receiver_expert_rows == ex.at("receiver_expert_rows").get<index_t>());
  int const width = in.at("width").get<int>();
  CHECK(std::vector<index_t>{ranks, s.pool_rows_with_header, width} == ex.at("send_buffer_shape_per_wave").get<std::vector<index_t>>());
  CHECK(std::vector<index_t>{c.local_experts, s.receiver_expert_rows, width} ==
        ex.at("receiver_compact_shape_per_wave").get<std::vector<index_t>>());
  // The header row holds the pool's 3004 ids packed in 3 bits (0..5, 6 = empty).
  CHECK(pooled_wave_id_bits(c.local_experts) == 3);
  CHECK(pooled_wave_header_bytes(s.sender_pool_rows, c.local_experts) == (3004 * 3 + 7) / 8);
  CHECK(pooled_wave_header_bytes(s.sender_pool_rows, c.local_experts) <= payload_row_bytes(PayloadType::bf16, width));
  auto const& dr = ex.at("drop_rate_example");
  auto const rates = drop_rates(dr.at("assignments").get<std::int64_t>(), dr.at("sender_drops").get<std::int64_t>(),
                                dr.at("receiver_drops").get<std::int64_t>());
  CHECK(rates.sender == Approx(dr.at("sender_rate").get<double>()).margin(1e-9));
  CHECK(rates.receiver == Approx(dr.at("receiver_rate").get<double>()).margin(1e-9));
  CHECK(rates.total == Approx(dr.at("total_rate").get<double>()).margin(1e-9));
  CHECK(rates.conditional_receiver == Approx(dr.at("conditional_receiver_rate").get<double>()).margin(1e-6));
  CHECK_THROWS_WITH(pooled_wave_shapes(PooledWaveConfig{0, 1, 1, 4, 1, 1}, 2), Catch::Matchers::Contains("waves must be at least 1"));
}

TEST_CASE("pooled-wave drops are exact on constructed overflows", "[exchange][pooled]") {
  int const size = world_size();
  int const rank = world_rank();
  auto topo = nodes_of(size);
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  // Experts 0..2*size-1 round-robin: expert 0 lives on rank 0 (local id 0).
  int const experts = 2 * size;
  Placement placement = Placement::round_robin(experts, size);
  std::vector<float> scale(static_cast<std::size_t>(experts), 3.0f);
  int const T = 10;
  for (int waves : {1, 3}) {
    // Every token of every rank picks expert 0, and (second k-slot) expert 1.
    HostRoutes routes;
    routes.tokens = T;
    routes.k = 2;
    for (int t = 0; t < T; ++t) {
      routes.expert.push_back(0);
      routes.expert.push_back(1 % experts);
      routes.gate.push_back(0.75f);
      routes.gate.push_back(0.25f);
    }
    RowMatrix<float, MS> hidden("hidden", T, 4);
    Kokkos::deep_copy(hidden, 1.0f);
    auto pc = exchange_config(PayloadType::fp32);
    pc.waves = waves;
    pc.tokens_per_rank = T;
    pc.top_k = 2;
    pc.sender_cf = 0.3 * size;   // Rs = ceil(0.3 * 20 / W) rows per destination and wave
    pc.receiver_cf = 0.4;        // Rr = ceil(0.4 * 20 / 2 / W) rows per expert and wave
    PooledWaveExchange<> pooled(comms, placement, pc);
    REQUIRE(pooled.shape().local_experts == 2);
    auto const sh = pooled.shapes();
    auto r = run_step(pooled, placement, routes, hidden, scale, rank, 0, {});
    // Sender side: rank 0 receives 2T routes from each rank when size == 1,
    // else T (expert 0) from each rank plus expert 1 (rank 1) gets the other T.
    std::int64_t s_expected = 0;
    std::vector<std::int64_t> to_dest(static_cast<std::size_t>(size), 0);
    to_dest[0] += T;
    to_dest[static_cast<std::size_t>(1 % size)] += T;
    for (auto n : to_dest) s_expected += std::max<std::int64_t>(0, n - sh.sender_pool_rows * waves);
    CHECK(r.ledger.dispatch.sender_drops == s_expected);
    // Receiver side: every source sends this rank the same n_here routes;
    // the i-th goes to wave i % W, pool row i / W (if that row exists). With
    // one rank both experts are local and alternate (k-slots 0, 1); else
    // rank 0 gets only expert 0 and rank 1 only expert 1.
    std::int64_t const n_here = to_dest[static_cast<std::size_t>(rank)];
    std::int64_t r_expected = 0;
    for (int w = 0; w < waves; ++w)
      for (int ex = 0; ex < 2; ++ex) {
        std::int64_t in_wave = 0;
        for (std::int64_t i = 0; i < n_here; ++i) {
          int const expert_of_i = size == 1 ? static_cast<int>(i % 2) : (rank == 0 ? 0 : 1);
          if (i / waves < sh.sender_pool_rows && i % waves == w && expert_of_i == ex) in_wave += size;
        }
        r_expected += std::max<std::int64_t>(0, in_wave - sh.receiver_expert_rows);
      }
    CHECK(r.ledger.dispatch.receiver_drops == r_expected);
    auto const total = r.ledger.reduced(MPI_COMM_WORLD);
    CHECK(total.dispatch.useful_rows + total.dispatch.sender_drops + total.dispatch.receiver_drops == 2 * T * size);
    // Surviving routes add gate * scale * 1, dropped ones nothing.
    auto out = to_host_vector(r.out);
    for (float v : out) {
      bool const ok = v == 0.0f || v == 0.75f * 3.0f || v == 0.25f * 3.0f || v == 3.0f;
      CHECK(ok);
    }
  }
}

TEST_CASE("faults: count mismatch, stale handles and a skipped call fail every rank without a hang", "[exchange][fault]") {
  int const size = world_size();
  int const rank = world_rank();
  auto topo = nodes_of(size % 2 == 0 ? std::max(1, size / 2) : size);
  auto const nor = nodes_vector(topo);
  Placement placement = Placement::round_robin(2 * size, size, nor);
  std::vector<float> scale(static_cast<std::size_t>(2 * size), 2.0f);
  HostRoutes routes;
  routes.tokens = 4;
  routes.k = 2;
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 2; ++j) {
      routes.expert.push_back((rank + t + j * 3) % (2 * size));
      routes.gate.push_back(0.5f);
    }
  RowMatrix<float, MS> hidden("hidden", 4, 4);
  Kokkos::deep_copy(hidden, 1.0f);
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  Exec exec;
  auto const fp32 = exchange_config(PayloadType::fp32);
  auto prepare = [&](auto& xchg) {
    auto const [rp, plan] = plans_of(comms, placement, routes, rank, 0, nor[rank]);
    return xchg.dispatch(exec, rp, plan, hidden);
  };
  // Identity experts: the expert rows go back as they came.
  auto combine_of = [&](auto& xchg, auto& h) {
    PayloadBuffer<MS> returned("returned", PayloadType::fp32, 4, h.plan.rows());
    xchg.combine(exec, h, h.expert_rows, returned);
  };

  SECTION("a count mismatch injected on one rank") {
    FlatExchange<> flat(comms, placement, fp32);
    auto h = prepare(flat);
    int const culprit = size > 1 ? 1 : 0;
    if (rank == culprit) h.plan.counts[0] += 1;  // this rank now expects one row more from slot 0
    bool caught = false;
    try {
      combine_of(flat, h);
    } catch (CollectiveError const& e) {
      caught = true;
      std::string const what = e.what();
      CHECK(what.find("count agreement") != std::string::npos);
      CHECK(what.find("rank " + std::to_string(culprit)) != std::string::npos);
    }
    CHECK(caught);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  SECTION("a handle from another communicator epoch") {
    FlatExchange<> flat(comms, placement, fp32);
    auto h = prepare(flat);
    Topology::CommunicatorSet newer(MPI_COMM_WORLD, topo, Topology::CommSpec{});
    FlatExchange<> flat2(newer, placement, fp32);
    CHECK_THROWS_WITH(combine_of(flat2, h), Catch::Matchers::Contains("dispatch handle belongs to communicator epoch"));
    // The original exchange still combines it.
    CHECK_NOTHROW(combine_of(flat, h));
    CHECK_THROWS_WITH(combine_of(flat, h), Catch::Matchers::Contains("already combined"));
    // The caller replans on the new communicators and retries.
    auto retry = prepare(flat2);
    CHECK(retry.epoch == newer.epoch());
    CHECK_NOTHROW(combine_of(flat2, retry));
  }
  SECTION("a handle from another placement generation") {
    HierarchicalExchange<> hier(comms, placement, fp32);
    auto h = prepare(hier);
    h.generation += 1;
    CHECK_THROWS_WITH(combine_of(hier, h), Catch::Matchers::Contains("placement generation"));
    // A fresh dispatch of the same step goes through.
    auto retry = prepare(hier);
    CHECK_NOTHROW(combine_of(hier, retry));
  }
  SECTION("a dispatch still in flight: its rows are not combined, and it completes afterwards") {
    auto in_flight = [&](auto& xchg) {
      auto const [rp, plan] = plans_of(comms, placement, routes, rank, 0, nor[rank]);
      auto h = xchg.dispatch_start(exec, rp, plan, hidden);
      CHECK_FALSE(h.delivered);
      // A combine (an expert's output returned) before dispatch_finish: every rank refuses.
      CHECK_THROWS_WITH(combine_of(xchg, h), Catch::Matchers::Contains("whose dispatch has not finished"));
      xchg.dispatch_finish(exec, h);
      CHECK(h.delivered);
      CHECK_THROWS_WITH(xchg.dispatch_finish(exec, h), Catch::Matchers::Contains("not a dispatch in flight"));
      // Started and finished, the step returns every row as the blocking form does.
      PayloadBuffer<MS> returned("returned", PayloadType::fp32, 4, h.plan.rows());
      xchg.combine_start(exec, h, h.expert_rows, returned);
      CHECK_FALSE(h.combined);
      xchg.combine_finish(exec, h);
      CHECK(h.combined);
      auto blocking = prepare(xchg);
      PayloadBuffer<MS> returned2("returned2", PayloadType::fp32, 4, blocking.plan.rows());
      xchg.combine(exec, blocking, blocking.expert_rows, returned2);
      auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), returned.bytes);
      auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), returned2.bytes);
      REQUIRE(a.size() == b.size());
      CHECK(std::equal(a.data(), a.data() + a.size(), b.data()));
      // The identity experts sent every row back as it left.
      auto hid = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), hidden);
      auto const* f = reinterpret_cast<float const*>(a.data());
      for (std::size_t i = 0; i < a.size() / sizeof(float); ++i) CHECK(f[i] == hid.data()[0]);
    };
    FlatExchange<> flat(comms, placement, fp32);
    in_flight(flat);
    HierarchicalExchange<> hier(comms, placement, fp32);
    in_flight(hier);
  }
  SECTION("two dispatches in flight at once: each keeps its send rows until it finishes") {
    // Two steps' dispatches started back to back (other routes, so other
    // metadata), then finished: with verify_send_rows a send buffer the
    // second start reused while the first was in flight fails the first
    // finish; each step delivers what its blocking form delivers.
    auto verified = fp32;
    verified.verify_send_rows = true;
    HostRoutes other = routes;
    for (auto& e : other.expert) e = (e + 1) % (2 * size);
    RowMatrix<float, MS> rows("rows", 4, 4);  // distinct rows: a misplaced row shows
    auto hr = Kokkos::create_mirror_view(rows);
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 4; ++j) hr(t, j) = static_cast<float>(100 * rank + 10 * t + j);
    Kokkos::deep_copy(rows, hr);
    auto both = [&](auto& xchg) {
      auto const [rp1, plan1] = plans_of(comms, placement, routes, rank, 0, nor[rank]);
      auto const [rp2, plan2] = plans_of(comms, placement, other, rank, 0, nor[rank]);
      auto h1 = xchg.dispatch_start(exec, rp1, plan1, rows);
      auto h2 = xchg.dispatch_start(exec, rp2, plan2, rows);
      CHECK_NOTHROW(xchg.dispatch_finish(exec, h1));
      CHECK_NOTHROW(xchg.dispatch_finish(exec, h2));
      auto const blocking1 = xchg.dispatch(exec, rp1, plan1, rows);
      auto const blocking2 = xchg.dispatch(exec, rp2, plan2, rows);
      for (auto const& [h, b] : {std::pair{&h1, &blocking1}, std::pair{&h2, &blocking2}}) {
        CHECK(h->expert_counts == b->expert_counts);
        auto const x = to_host_vector(h->expert_rows), y = to_host_vector(b->expert_rows);
        CHECK(kmoe_test::same_bits(x, y));
      }
    };
    FlatExchange<> flat(comms, placement, verified);
    both(flat);
    HierarchicalExchange<> hier(comms, placement, verified);
    both(hier);
  }
  SECTION("a handle of another algorithm") {
    FlatExchange<> flat(comms, placement, fp32);
    HierarchicalExchange<> hier(comms, placement, fp32);
    auto h = prepare(flat);
    CHECK_THROWS_WITH(combine_of(hier, h), Catch::Matchers::Contains("a flat dispatch handle was given to the hierarchical combine"));
  }
  SECTION("a failing expert on one rank fails the combine on every rank") {
    PooledWaveExchange<> pooled(comms, placement, [&] {
      auto c = fp32;
      c.tokens_per_rank = 4;
      c.top_k = 2;
      return c;
    }());
    auto h = prepare(pooled);
    PayloadBuffer<MS> returned("returned", PayloadType::fp32, 4, h.plan.rows());
    std::string const problem = rank == size - 1 ? "expert runner failed on this rank" : "";
    try {
      pooled.combine(exec, h, h.expert_rows, returned, problem);
      FAIL("no error raised");
    } catch (CollectiveError const& e) {
      CHECK(e.origin_rank() == size - 1);
      CHECK(e.origin_message() == "expert runner failed on this rank");
    }
  }
  SECTION("the watchdog names a rank that skipped the call") {
    if (size < 2) return;
    TransportOptions quick;
    quick.watchdog_seconds = 1.0;
    FlatExchange<> flat(comms, placement, exchange_config(PayloadType::fp32, quick));
    bool caught = false;
    if (rank != 1) {
      try {
        prepare(flat);
      } catch (Error const& e) {
        caught = true;
        std::string const what = e.what();
        INFO(what);
        CHECK(what.find("still waiting to receive from") != std::string::npos);
        CHECK(what.find("(rank 1)") != std::string::npos);
      }
      CHECK(caught);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

namespace {

/// Ledger text without times (planned ledgers carry none).
std::string untimed(ByteLedger l) {
  for (auto* d : {&l.dispatch, &l.combine})
    for (auto& s : d->stages) s.seconds = 0;
  return l.to_json(0);
}

}  // namespace

TEST_CASE("the planner predicts every measured ledger exactly", "[exchange][planner]") {
  int const size = world_size();
  int const rank = world_rank();
  PlannerLayout const layout(size);
  for (Dist dist : {Dist::uniform, Dist::hot_expert}) {
    auto const pr = planner_routes(layout, dist, 55u, rank, size);
    REQUIRE(static_cast<int>(pr.all.size()) == size);
    CHECK(to_host_vector(pr.all[static_cast<std::size_t>(rank)].dest_rank) == to_host_vector(pr.mine.dest_rank));
    CHECK(to_host_vector(pr.all[static_cast<std::size_t>(rank)].gate) == to_host_vector(pr.mine.gate));
    // Narrow rows (runs packed into one message per peer) and wide ones
    // (runs of 4 rows and more travel as separate messages).
    for (int width : {4, 4096})
    for (int R : {1, layout.rpn >= 2 ? 2 : 1}) {
      RowMatrix<float, MS> hidden("hidden", pr.tokens, width);
      Kokkos::deep_copy(hidden, 0.5f);
      Topology::CommSpec spec;
      spec.relays_per_node = R;
      Topology::CommunicatorSet comms(MPI_COMM_WORLD, layout.topo, spec);
      auto c = exchange_config(PayloadType::fp32);
      c.waves = 2;
      c.tokens_per_rank = 16;
      c.top_k = 3;
      c.sender_cf = 0.6;  // small factors: pooled-wave drops included
      c.receiver_cf = 0.7;
      auto planned_of = [&](Algorithm a) {
        auto ca = c;
        ca.algorithm = a;
        return plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, ca, width});
      };
      INFO("np " << size << " R " << R << " dist " << static_cast<int>(dist) << " width " << width);
      FlatExchange<> flat(comms, layout.placement, c);
      auto rf = run_step(flat, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
      CHECK(untimed(rf.ledger) == untimed(planned_of(Algorithm::flat)[static_cast<std::size_t>(rank)]));
      {
        // One message per peer and the repack copies; and the rows as
        // another type than the payload (the planner told so), which
        // needs them too.
        auto copies = c;
        copies.receive_into_experts = false;
        copies.algorithm = Algorithm::flat;
        FlatExchange<> fc(comms, layout.placement, copies);
        auto rc = run_step(fc, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
        auto const copies_plan = plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, copies, width})[static_cast<std::size_t>(rank)];
        auto const with_copies = untimed(copies_plan);
        CHECK(untimed(rc.ledger) == with_copies);
        auto other_rows = c;
        other_rows.algorithm = Algorithm::flat;
        CHECK(untimed(plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, other_rows, width, PayloadType::bf16})[static_cast<std::size_t>(rank)]) ==
              with_copies);
      }
      HierarchicalExchange<> hier(comms, layout.placement, c);
      REQUIRE(hier.receives_into_experts<float>());
      auto rh = run_step(hier, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
      CHECK(untimed(rh.ledger) == untimed(planned_of(Algorithm::hierarchical)[static_cast<std::size_t>(rank)]));
      {
        // The relay stages with the repack copies.
        auto copies = c;
        copies.receive_into_experts = false;
        copies.algorithm = Algorithm::hierarchical;
        HierarchicalExchange<> hc(comms, layout.placement, copies);
        auto rc = run_step(hc, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
        CHECK(untimed(rc.ledger) == untimed(plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, copies, width})[static_cast<std::size_t>(rank)]));
        CHECK(rc.ledger.dispatch.inter_node_payload_bytes() == rh.ledger.dispatch.inter_node_payload_bytes());
      }
      PooledWaveExchange<> pooled(comms, layout.placement, c);
      REQUIRE(pooled.direct_rows<float>());
      auto rpw = run_step(pooled, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
      auto const planned = planned_of(Algorithm::pooled_wave);
      CHECK(untimed(rpw.ledger) == untimed(planned[static_cast<std::size_t>(rank)]));
      // Sums over ranks agree with the reduced measured ledger.
      CHECK(untimed(rpw.ledger.reduced(MPI_COMM_WORLD)) == untimed(sum_ledgers(planned)));
      {
        // In-band headers and the compaction copies: the same drops and
        // outputs, the ledger the planner predicts for them.
        auto copies = c;
        copies.receive_into_experts = false;
        copies.algorithm = Algorithm::pooled_wave;
        PooledWaveExchange<> pc(comms, layout.placement, copies);
        REQUIRE_FALSE(pc.direct_rows<float>());
        auto rc = run_step(pc, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
        CHECK(untimed(rc.ledger) == untimed(plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, copies, width})[static_cast<std::size_t>(rank)]));
        CHECK(rc.ledger.dispatch.sender_drops == rpw.ledger.dispatch.sender_drops);
        CHECK(rc.ledger.dispatch.receiver_drops == rpw.ledger.dispatch.receiver_drops);
        CHECK(kmoe_test::same_bits(to_host_vector(rc.out), to_host_vector(rpw.out)));
        // With drops and rows that differ (token, rank, column), wave by
        // wave: the same expert rows in the same order, the same keys
        // (receiver drops split a source's run of an expert: its kept prefix
        // must be the one kept); staged through the host too.
        RowMatrix<float, MS> distinct("distinct", pr.tokens, width);
        {
          auto hd = Kokkos::create_mirror_view(distinct);
          for (int t = 0; t < pr.tokens; ++t)
            for (int x = 0; x < width; ++x) hd(t, x) = 1.0f + 0.5f * t + 64.0f * rank + 0.001f * x;
          Kokkos::deep_copy(distinct, hd);
        }
        auto staged = c;
        staged.stage_through_host = true;
        PooledWaveExchange<> ps(comms, layout.placement, staged);
        REQUIRE(ps.direct_rows<float>());
        auto const in_band_out = to_host_vector(run_step(pc, layout.placement, pr.routes, distinct, layout.scale, rank, 0, {}, layout.nor[rank]).out);
        CHECK(kmoe_test::same_bits(to_host_vector(run_step(pooled, layout.placement, pr.routes, distinct, layout.scale, rank, 0, {}, layout.nor[rank]).out), in_band_out));
        CHECK(kmoe_test::same_bits(to_host_vector(run_step(ps, layout.placement, pr.routes, distinct, layout.scale, rank, 0, {}, layout.nor[rank]).out), in_band_out));
        Exec exec;
        auto const [route_plan, dispatch_plan] = plans_of(comms, layout.placement, pr.routes, rank, 0, layout.nor[rank]);
        for (int w = 0; w < pooled.waves(); ++w) {
          INFO("wave " << w);
          auto hb = pc.dispatch(exec, route_plan, dispatch_plan, distinct, w);
          for (auto* x : {&pooled, &ps}) {
            auto hd = x->dispatch(exec, route_plan, dispatch_plan, distinct, w);
            CHECK(hd.expert_counts == hb.expert_counts);
            CHECK(to_host_vector(hd.arrival_key) == to_host_vector(hb.arrival_key));
            CHECK(kmoe_test::same_bits(to_host_vector(hd.expert_rows), to_host_vector(hb.expert_rows)));
          }
        }
      }
    }
  }
}

TEST_CASE("simulated clusters: 1024 ranks on 128 nodes, one relay vs rail relays", "[exchange][planner][simulate]") {
  // A planner computation without communication: one rank runs it, the others
  // would repeat the same work.
  if (world_rank() != 0) return;
  Topology::LayoutSpec s;
  s.kind = Topology::LayoutKind::virtual_nodes;
  s.ranks_per_node = 8;
  auto topo = Topology::Topology::simulated(1024, s);
  int const experts = 2048;
  // Expert e on rank e % 1024 (local slot e / 1024); 64 tokens of top-1 per rank.
  std::vector<int> nodes;
  for (int r = 0; r < 1024; ++r) nodes.push_back(topo.node_of(r));
  Placement const placement = Placement::round_robin(experts, 1024, nodes);
  auto const dp = make_device_placement<Kokkos::HostSpace>(placement);
  RankRoutePlans rr;
  std::mt19937 rng(3);
  for (int r = 0; r < 1024; ++r) {
    RouteTable<Kokkos::HostSpace> table("test::table", 16 * 4, 1, experts);
    for (int t = 0; t < 16 * 4; ++t) {
      table.expert(t, 0) = static_cast<int>(rng() % experts);
      table.gate(t, 0) = 1.0f;
      table.accepted(t, 0) = 1;
    }
    rr.push_back(make_route_plan(Kokkos::DefaultHostExecutionSpace(), table, dp, make_replica_choice<Kokkos::HostSpace>(placement, r, nodes[r]), r));
  }
  ExchangeConfig c;
  Topology::CommSpec one, rails;
  rails.relays_per_node = 8;
  auto const L1 = make_comm_layout(topo, one);
  auto const L8 = make_comm_layout(topo, rails);
  auto plan = [&](Algorithm a, Topology::CommLayout const& l) {
    auto ca = c;
    ca.algorithm = a;
    return plan_ledgers(PlanInput{topo, l, rr, placement, ca, 64});
  };
  auto const flat = sum_ledgers(plan(Algorithm::flat, L1));
  auto const h1 = sum_ledgers(plan(Algorithm::hierarchical, L1));
  auto const h8 = sum_ledgers(plan(Algorithm::hierarchical, L8));
  CHECK_NOTHROW(check_inter_node_equal(flat, h1));
  CHECK_NOTHROW(check_inter_node_equal(flat, h8));
  CHECK(flat.dispatch.useful_rows == 1024 * 64);
  // One relay per node: few inter-node message pairs (node pairs; a message
  // of rows and one of metadata each, narrow runs packed), many relay rows.
  CHECK(h1.dispatch.by_class(LinkClass::inter_node).messages <= 2 * 128 * 127);
  CHECK(h8.dispatch.by_class(LinkClass::inter_node).messages <= 2 * 8 * 128 * 127);
  CHECK(flat.dispatch.by_class(LinkClass::inter_node).messages > h8.dispatch.by_class(LinkClass::inter_node).messages);
  auto const m1 = ledger_maxima(topo, plan(Algorithm::hierarchical, L1));
  auto const m8 = ledger_maxima(topo, plan(Algorithm::hierarchical, L8));
  CHECK(m1.relay_rows > m8.relay_rows);  // rails spread the relay work
}

TEST_CASE("pooled-wave: narrow rows take several header rows; huge factors saturate; outputs equal the flat exchange", "[exchange][pooled]") {
  int const size = world_size();
  int const rank = world_rank();
  auto topo = nodes_of(size % 2 == 0 ? std::max(1, size / 2) : size);
  auto const nor = nodes_vector(topo);
  int const experts = 3 * size;
  Placement placement = Placement::round_robin(experts, size, nor);
  std::vector<float> scale;
  for (int e = 0; e < experts; ++e) scale.push_back(0.5f + 0.25f * e);
  std::mt19937 rng(77u + static_cast<unsigned>(rank));
  int tokens = 0;
  auto routes = random_routes(Dist::uniform, rank, size, experts, 2, rng, tokens);
  RowMatrix<float, MS> hidden("hidden", tokens, 1);  // 4-byte rows: a pool's ids need several
  {
    auto h = Kokkos::create_mirror_view(hidden);
    for (int t = 0; t < tokens; ++t) h(t, 0) = 0.25f * t - 1.0f + rank;
    Kokkos::deep_copy(hidden, h);
  }
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  auto c = exchange_config(PayloadType::fp32);
  c.tokens_per_rank = 16;
  c.top_k = 2;
  c.waves = 2;
  FlatExchange<> flat(comms, placement, c);
  auto const rf = run_step(flat, placement, routes, hidden, scale, rank, 0, {}, nor[rank]);
  for (bool in_band : {true, false})
  for (double cf : {4.0 * size, 1e19, 1e300}) {
    INFO("capacity factors " << cf << (in_band ? ", headers in band" : ", headers first, rows straight to the expert rows"));
    c.sender_cf = cf;
    c.receiver_cf = cf;
    c.receive_into_experts = !in_band;
    PooledWaveExchange<> pooled(comms, placement, c);
    REQUIRE(pooled.direct_rows<float>() == !in_band);
    auto const sh = pooled.shapes_for(1);
    CHECK(sh.header_rows > 1);
    CHECK(sh.sender_pool_rows <= 16 * 2);  // never more than a rank's routes
    CHECK(sh.receiver_expert_rows <= size * sh.sender_pool_rows);
    auto const rp = run_step(pooled, placement, routes, hidden, scale, rank, 0, {}, nor[rank]);
    auto const of = to_host_vector(rf.out), op = to_host_vector(rp.out);
    REQUIRE(of.size() == op.size());
    CHECK(kmoe_test::same_bits(of, op));
    auto const total = rp.ledger.reduced(MPI_COMM_WORLD);
    CHECK(total.dispatch.sender_drops + total.dispatch.receiver_drops == 0);
    if (in_band) {
      CHECK(total.dispatch.stages.at(0).header_rows == size * size * sh.header_rows);  // every rank sends P pools
    } else {
      // Headers of their own: the ids' bytes to every peer, no header rows.
      CHECK(total.dispatch.stages.at(0).header_rows == 0);
      std::int64_t meta = 0;
      for (int k = 0; k < num_link_classes; ++k) meta += total.dispatch.stages.at(0).by_class[static_cast<std::size_t>(k)].meta_bytes;
      CHECK(meta == size * size * pooled_wave_id_span(sh.sender_pool_rows, pooled.shape().local_experts));
      CHECK(total.dispatch.rows_in_place);
      CHECK(total.combine.rows_in_place);
    }
    // The planner agrees, header rows included.
    Exec exec;
    auto rp_plan = make_route_plan(exec, make_table(routes, experts), make_device_placement<MS>(placement),
                                   make_replica_choice<MS>(placement, rank, nor[rank]), rank);
    auto const rr = allgather_routes(MPI_COMM_WORLD, rp_plan);
    auto cp = c;
    cp.algorithm = Algorithm::pooled_wave;
    auto const planned = plan_ledgers(PlanInput{topo, comms.layout(), rr, placement, cp, 1});
    CHECK(untimed(rp.ledger) == untimed(planned[static_cast<std::size_t>(rank)]));
  }
}

TEST_CASE("a send buffer reused before its transfer completed is caught when send rows are verified", "[exchange][fault]") {
  // A started transfer over MPI reads its send rows until it finishes. With
  // verify_send_rows, refilling the send buffer meanwhile (the injected
  // fault) fails the finish on every rank that sends to a peer, naming the
  // transfer; an untouched buffer passes, and without verification the
  // rows simply move.
  int const size = world_size();
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  Exec exec;
  int const P = ep.size();
  index_t const per_peer = 3;
  int const width = 16;
  std::vector<index_t> counts(static_cast<std::size_t>(P), per_peer);
  rows_view send("send", P * per_peer, width), recv("recv", P * per_peer, width);
  Kokkos::deep_copy(send, static_cast<unsigned char>(1 + ep.my_slot()));
  std::vector<RowSet<MS>> const sets{RowSet<MS>{send, recv}};
  MpiTransport<Exec, MS> mpi;
  TransportOptions verify;
  verify.watchdog_seconds = 60;
  verify.verify_send_rows = true;
  {
    auto flight = mpi.start_alltoallv(exec, ep, sets, counts, counts, "verified rows", verify);
    CHECK_NOTHROW(flight.finish());
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    for (int p = 0; p < P; ++p) CHECK(h(p * per_peer, 0) == static_cast<unsigned char>(1 + p));
  }
  // Device memory without a CUDA-aware MPI is staged through the host: such
  // a transfer completes before its start returns, so a refill is harmless.
  bool const in_flight = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible || mpi_is_cuda_aware();
  {
    auto flight = mpi.start_alltoallv(exec, ep, sets, counts, counts, "reused rows", verify);
    Kokkos::deep_copy(send, static_cast<unsigned char>(200));  // the fault: refilled while in flight
    if (size > 1 && in_flight)
      CHECK_THROWS_WITH(flight.finish(), Catch::Matchers::Contains("reused rows: the send rows (buffer 0 of 1) changed while the "
                                                                   "transfer was in flight"));
    else
      CHECK_NOTHROW(flight.finish());  // one rank sends nothing to a peer, or the rows were staged
  }
  {
    // Staged on purpose: the rows were copied out at the start, so the
    // refill neither fails the finish nor reaches the peers.
    Kokkos::deep_copy(send, static_cast<unsigned char>(1 + ep.my_slot()));
    TransportOptions staged = verify;
    staged.stage_through_host = true;
    auto flight = mpi.start_alltoallv(exec, ep, sets, counts, counts, "staged rows", staged);
    Kokkos::deep_copy(send, static_cast<unsigned char>(200));
    CHECK_NOTHROW(flight.finish());
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    for (int p = 0; p < P; ++p) CHECK(h(p * per_peer, 0) == static_cast<unsigned char>(1 + p));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("transport: rows a rank placed for itself are not copied over", "[exchange][transport]") {
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  Exec exec;
  int const P = ep.size(), me = ep.my_slot();
  index_t const per_peer = 2;
  std::vector<index_t> counts(static_cast<std::size_t>(P), per_peer);
  MpiTransport<Exec, MS> mpi;
  for (bool const staged : {false, true})
  for (bool const in_place : {false, true}) {
    INFO("self_in_place " << in_place << (staged ? ", staged through the host" : ""));
    auto const [send, recv] = marked_rows(P * per_peer, 8, me);  // recv: what the caller placed for itself
    TransportOptions options;
    options.stage_through_host = staged;
    mpi.alltoallv(exec, ep, {RowSet<MS>{send, recv, {}, {}, in_place}}, counts, counts, "self rows", options);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    for (int p = 0; p < P; ++p)
      for (index_t r = 0; r < per_peer; ++r)
        CHECK(h(p * per_peer + r, 0) == (p == me && in_place ? 255 : 1 + p));
  }
}

TEST_CASE("transport: a gathered send takes each position's row from where it is, repeats included", "[exchange][transport]") {
  // A source of 5 rows; send position i to peer p names row (p + me + i) % 5,
  // and the last position repeats the first (a token's row for two routes).
  // Each peer's 4 rows travel as one indexed-datatype message and land in
  // two runs placed back to front; the own rows are the caller's (in place).
  // A verified flight notices a refilled source; a row outside the source
  // and a transport that pairs runs are refused before anything moves.
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  Exec exec;
  int const P = ep.size(), me = ep.my_slot();
  index_t const per = 4, rows = 5;
  int const width = 24;
  MpiTransport<Exec, MS> mpi;
  REQUIRE(mpi.gathers_runs());
  auto const mark = [](int slot, int row) { return static_cast<unsigned char>(16 * slot + row); };
  rows_view source("source", rows, width);
  auto hsrc = Kokkos::create_mirror_view(source);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < width; ++b) hsrc(r, b) = mark(me, r);
  Kokkos::deep_copy(source, hsrc);
  auto const gathered = [&](int bad_row) {
    auto list = std::make_shared<std::vector<int>>();
    for (int p = 0; p < P; ++p)
      for (index_t i = 0; i < per; ++i) list->push_back(static_cast<int>((p + me + (i == per - 1 ? 0 : i)) % rows));
    if (bad_row >= 0) list->back() = bad_row;
    return std::shared_ptr<std::vector<int> const>(list);
  };
  std::vector<index_t> counts(static_cast<std::size_t>(P), per);
  RowRuns recv_runs(static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p) recv_runs[static_cast<std::size_t>(p)] = {{p * per + 2, 2}, {p * per, 2}};
  for (bool const staged : {false, true}) {
    INFO((staged ? "staged through the host" : "direct"));
    rows_view recv("recv", P * per, width);
    Kokkos::deep_copy(recv, static_cast<unsigned char>(255));
    RowSet<MS> set{source, recv, {}, recv_runs, /*self_in_place=*/true};
    set.send_rows = gathered(-1);
    TransportOptions options;
    options.stage_through_host = staged;
    mpi.alltoallv(exec, ep, {set}, counts, counts, "gathered rows", options);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    int bad = 0;
    for (int p = 0; p < P; ++p)
      for (index_t i = 0; i < per; ++i) {
        // Position i of peer p's message: its row (me + p + i') % 5 of p's source, in run order.
        index_t const at = i < 2 ? p * per + 2 + i : p * per + (i - 2);
        int const row = static_cast<int>((me + p + (i == per - 1 ? 0 : i)) % rows);
        unsigned char const want = p == me ? 255 : mark(p, row);
        bad += h(at, 0) != want || h(at, width - 1) != want;
      }
    CHECK(bad == 0);
  }
  {
    rows_view recv("recv", P * per, width);
    RowSet<MS> set{source, recv, {}, recv_runs, true};
    set.send_rows = gathered(-1);
    TransportOptions verify;
    verify.verify_send_rows = true;
    verify.watchdog_seconds = 60;
    auto flight = mpi.start_alltoallv(exec, ep, {set}, counts, counts, "gathered rows", verify);
    Kokkos::deep_copy(source, static_cast<unsigned char>(200));  // refilled while in flight
    bool const in_flight = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible || mpi_is_cuda_aware();
    if (P > 1 && in_flight)
      CHECK_THROWS_WITH(flight.finish(), Catch::Matchers::Contains("gathered rows: the send rows (buffer 0 of 1) changed"));
    else
      CHECK_NOTHROW(flight.finish());
    Kokkos::deep_copy(source, hsrc);
  }
  rows_view recv("recv", P * per, width);
  RowSet<MS> outside{source, recv, {}, recv_runs, true};
  outside.send_rows = gathered(rows);
  CHECK_THROWS_WITH(mpi.alltoallv(exec, ep, {outside}, counts, counts, "gathered rows", TransportOptions{}),
                    Catch::Matchers::Contains("gathered rows: a gathered send names row 5 of a buffer of 5 rows"));
  MpiTransport<Exec, MS> paired(/*pair_runs=*/true);
  RowSet<MS> set{source, recv, {}, recv_runs, true};
  set.send_rows = gathered(-1);
  CHECK_THROWS_WITH(paired.alltoallv(exec, ep, {set}, counts, counts, "gathered rows", TransportOptions{}),
                    Catch::Matchers::Contains("cannot gather a peer's rows into one message"));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("transport: an MPI receive takes up to its count", "[exchange][transport]") {
  // Peer slot p sends 1 + p % 3 rows of its 3-row slot (one run, at the
  // slot's static place) into a 3-row receive segment: the rows sent
  // arrive, the rest of the segment keeps what it held, also when the rows
  // are staged through host copies (the path of device memory without a
  // CUDA-aware MPI).
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  Exec exec;
  int const P = ep.size(), me = ep.my_slot();
  index_t const slot = 3;
  MpiTransport<Exec, MS> mpi;
  REQUIRE(mpi.receives_up_to());
  for (bool const staged : {false, true}) {
    INFO((staged ? "staged through the host" : "direct"));
    auto const [send, recv] = marked_rows(P * slot, 8, me);
    std::vector<index_t> sent(static_cast<std::size_t>(P)), whole(static_cast<std::size_t>(P), slot);
    RowRuns runs(static_cast<std::size_t>(P));
    for (int p = 0; p < P; ++p) {
      sent[static_cast<std::size_t>(p)] = p == me ? slot : 1 + me % slot;
      runs[static_cast<std::size_t>(p)] = {{p * slot, sent[static_cast<std::size_t>(p)]}};
    }
    TransportOptions options;
    options.stage_through_host = staged;
    mpi.alltoallv(exec, ep, {RowSet<MS>{send, recv, runs, {}}}, sent, whole, "rows up to a count", options);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    for (int p = 0; p < P; ++p)
      for (index_t r = 0; r < slot; ++r) {
        INFO("from slot " << p << " row " << r);
        bool const arrived = p == me || r < 1 + p % slot;
        CHECK(h(p * slot + r, 0) == (arrived ? 1 + p : 255));
      }
  }
}

TEST_CASE("counts and run lengths agreed in one round: bad announcements fail every rank", "[exchange][transport][errors]") {
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  int const P = ep.size();
  std::vector<index_t> counts(static_cast<std::size_t>(P), 3);
  RowRuns runs(static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p) runs[static_cast<std::size_t>(p)] = {{3 * p, 1}, {3 * p + 1, 2}};
  // Two runs for every peer: announced within a bound of 2; a bound of 1 and
  // runs that do not hold their count fail on every rank, naming the call.
  auto const ok = agree_counts_and_runs(ep, counts, 3 * P, runs, 2, "good runs");
  CHECK(ok.recv_run_lengths.at(0) == std::vector<index_t>{1, 2});
  std::vector<index_t> short_counts = counts;
  short_counts[0] = 2;  // runs of slot 0 hold 3 rows
  auto const fails = [&](std::vector<index_t> const& c, index_t rows, int max_runs, std::string const& text) {
    try {
      agree_counts_and_runs(ep, c, rows, runs, max_runs, "bad runs");
      FAIL("no error");
    } catch (CollectiveError const& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(text) != std::string::npos);
      CHECK(std::string(e.what()).find("bad runs") != std::string::npos);
    }
  };
  fails(counts, 3 * P, 1, "at most 1 may be announced");
  fails(short_counts, 3 * P - 1, 2, "the runs for peer slot 0 hold 3 rows, its count is 2");
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("every run announced, empty ones too: positions agree, a wrong number of runs fails every rank", "[exchange][transport][errors]") {
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  int const P = ep.size();
  int const me = ep.my_slot();
  // Three runs for every peer, the middle one empty and, for peer 0, the
  // first one too.
  std::vector<index_t> counts(static_cast<std::size_t>(P), 3);
  RowRuns runs(static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p) runs[static_cast<std::size_t>(p)] = {{3 * p, p == 0 ? 0 : 1}, {3 * p + 1, 0}, {3 * p + 1, p == 0 ? 3 : 2}};
  for (int p = 0; p < P; ++p) counts[static_cast<std::size_t>(p)] = p == 0 ? 3 : 3;
  auto const ok = agree_counts_and_every_run(ep, counts, 3 * P, runs, 3, 3, "every run");
  REQUIRE(ok.recv_run_lengths.size() == static_cast<std::size_t>(P));
  for (int p = 0; p < P; ++p)
    CHECK(ok.recv_run_lengths[static_cast<std::size_t>(p)] == (me == 0 ? std::vector<index_t>{0, 0, 3} : std::vector<index_t>{1, 0, 2}));
  // Rank 0 expects four runs from every peer: every rank fails, naming the call.
  try {
    agree_counts_and_every_run(ep, counts, 3 * P, runs, 4, me == 0 ? 4 : 3, "four runs");
    FAIL("no error");
  } catch (CollectiveError const& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("announced 3 runs, this rank expects 4") != std::string::npos);
    CHECK(std::string(e.what()).find("four runs") != std::string::npos);
  }
  // A local problem fails every rank before any count is trusted.
  try {
    agree_counts_and_every_run(ep, counts, 3 * P, runs, 3, 3, "with a problem", {}, me == P - 1 ? "the pack failed" : "");
    FAIL("no error");
  } catch (CollectiveError const& e) {
    CHECK(std::string(e.what()).find("the pack failed") != std::string::npos);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("rows given as runs leave from and arrive at their places, small runs and large", "[exchange][transport]") {
  // Every rank sends each peer 3 runs of its rows taken back to front, and
  // receives each peer's rows into 3 runs placed back to front as well; run
  // lengths are announced with the counts (agree_counts_and_runs). Narrow
  // rows take the indexed-datatype message, wide rows one message per run.
  Topology::CommunicatorSet comms = one_node_comms();
  auto const& ep = comms.ep();
  Exec exec;
  int const P = ep.size(), me = ep.my_slot();
  index_t const per = 7;  // rows per peer: runs of 1, 2, 4
  for (bool const staged : {false, true})
  for (int width : {8, 70000}) {
    INFO("row width " << width << (staged ? ", staged through the host" : ""));
    rows_view send("send", P * per, width), recv("recv", P * per, width);
    auto hs = Kokkos::create_mirror_view(send);
    for (int p = 0; p < P; ++p)
      for (index_t r = 0; r < per; ++r)
        for (int b = 0; b < width; ++b) hs(p * per + r, b) = static_cast<unsigned char>(31 * me + 7 * p + r);
    Kokkos::deep_copy(send, hs);
    // Runs of each peer's segment, last rows first: [6,7) then [4,6) then [0,4).
    RowRuns send_runs(static_cast<std::size_t>(P)), recv_runs(static_cast<std::size_t>(P));
    for (int p = 0; p < P; ++p) {
      index_t const b = p * per;
      send_runs[static_cast<std::size_t>(p)] = {{b + 6, 1}, {b + 4, 2}, {b, 4}};
    }
    std::vector<index_t> counts(static_cast<std::size_t>(P), per);
    auto const agreed = agree_counts_and_runs(ep, counts, P * per, send_runs, 3, "test counts and runs");
    CHECK(agreed.recv == counts);
    for (int p = 0; p < P; ++p) {
      CHECK(agreed.recv_run_lengths[static_cast<std::size_t>(p)] == std::vector<index_t>{1, 2, 4});
      index_t const b = (P - 1 - p) * per;  // peers' rows land back to front, each run reversed in place
      recv_runs[static_cast<std::size_t>(p)] = {{b + 6, 1}, {b + 4, 2}, {b, 4}};
    }
    MpiTransport<Exec, MS> mpi;
    TransportOptions options;
    options.stage_through_host = staged;
    mpi.alltoallv(exec, ep, {RowSet<MS>{send, recv, send_runs, recv_runs}}, counts, counts, "runs", options);
    auto hr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
    int bad = 0;
    for (int p = 0; p < P; ++p)
      for (index_t r = 0; r < per; ++r) {
        // Row r of peer p's segment (sent from its place r) arrives at place r of slot P-1-p.
        unsigned char const want = static_cast<unsigned char>(31 * p + 7 * me + r);
        index_t const at = (P - 1 - p) * per + r;
        bad += hr(at, 0) != want || hr(at, width - 1) != want;
      }
    CHECK(bad == 0);
  }
}
