// The node-deduplicating hierarchical exchange (hierarchical_dedup): its
// outputs are the documented summation tree bit for bit (node partial sums
// in k-slot order, added at the k-slot of each node's first route), equal
// the flat exchange's within rounding and bitwise on one node; it delivers
// the flat exchange's expert rows; its ledgers count one inter-node row per
// (token, node) and the rows that saved; the planner predicts them exactly.

#include "kmoe_catch.hpp"
#include "kmoe_exchange_util.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Exchange_Planner.hpp>

#include <cmath>
#include <random>

using namespace KokkosMoE;
using namespace KokkosMoE::Exchange;
using namespace kmoe_test;

namespace {

/// The documented output of hierarchical_dedup for scalar experts, from
/// the route plan the exchange moved: per token, in k-slot order, gate *
/// (scale * x) for a route to the own node, and at the first route of every
/// other node that node's partial sum (its routes in k-slot order from 0),
/// rows rounded through the dispatch payload `sent`, results and partial
/// sums through the return payload `ret`.
std::vector<float> dedup_reference(RoutePlan<Kokkos::HostSpace> const& rp, std::vector<int> const& nor, int my_node,
                                   std::vector<float> const& x, int d, std::vector<float> const& scale, PayloadType sent,
                                   PayloadType ret, std::vector<float>* abs_sum = nullptr) {
  auto round_to = [](PayloadType type, float v) { return type == PayloadType::bf16 ? to_float(to_bf16(v)) : v; };
  auto through = [&](float v) { return round_to(ret, v); };
  std::vector<float> out(static_cast<std::size_t>(rp.num_tokens * d), 0.0f);
  if (abs_sum) abs_sum->assign(out.size(), 0.0f);
  for (index_t t = 0; t < rp.num_tokens; ++t)
    for (int c = 0; c < d; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < rp.top_k; ++j) {
        index_t const a = rp.route_index(t, j);
        if (a < 0) continue;
        int const b = nor[static_cast<std::size_t>(rp.dest_rank(a))];
        auto result = [&](index_t r) {
          return through(scale[static_cast<std::size_t>(rp.expert(r))] * round_to(sent, x[static_cast<std::size_t>(t * d + c)]));
        };
        if (abs_sum) (*abs_sum)[static_cast<std::size_t>(t * d + c)] += std::fabs(rp.gate(a) * result(a));
        if (b == my_node) {
          acc += rp.gate(a) * result(a);
          continue;
        }
        bool first = true;
        for (int i = 0; i < j; ++i) {
          index_t const e = rp.route_index(t, i);
          first = first && !(e >= 0 && nor[static_cast<std::size_t>(rp.dest_rank(e))] == b);
        }
        if (!first) continue;
        float partial = 0.0f;
        for (int i = j; i < rp.top_k; ++i) {
          index_t const e = rp.route_index(t, i);
          if (e >= 0 && nor[static_cast<std::size_t>(rp.dest_rank(e))] == b) partial += rp.gate(e) * result(e);
        }
        acc += through(partial);
      }
      out[static_cast<std::size_t>(t * d + c)] = acc;
    }
  return out;
}

/// Distinct rows per (rank, token, column).
RowMatrix<float, MS> distinct_rows(int tokens, int d, int rank, std::vector<float>& x, std::mt19937& rng) {
  RowMatrix<float, MS> hidden("hidden", tokens, d);
  x.assign(static_cast<std::size_t>(tokens * d), 0.0f);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (auto& v : x) v = u(rng) + 0.001f * static_cast<float>(rank);
  auto h = Kokkos::create_mirror_view(hidden);
  for (std::size_t i = 0; i < x.size(); ++i) h.data()[i] = x[i];
  Kokkos::deep_copy(hidden, h);
  return hidden;
}

std::string untimed(ByteLedger l) {
  for (auto* d : {&l.dispatch, &l.combine})
    for (auto& s : d->stages) s.seconds = 0;
  return l.to_json(0);
}

}  // namespace

TEST_CASE("hierarchical_dedup: the documented summation tree bit for bit, the flat exchange's expert rows, one row per token and node",
          "[exchange][dedup]") {
  int const size = world_size();
  int const rank = world_rank();
  std::vector<int> rpns = {size};  // one node: the flat exchange's bits
  if (size % 2 == 0) rpns.push_back(size / 2);
  if (size >= 4 && size % 4 == 0) rpns.push_back(size / 4);
  if (size > 1) rpns.push_back(1);  // a node per rank
  int const experts = 3 * size + 2;
  int const d = 5;
  for (int k : {1, 4}) {
    for (int rpn : rpns) {
      auto topo = nodes_of(rpn);
      auto const nor = nodes_vector(topo);
      int const my_node = nor[static_cast<std::size_t>(rank)];
      // Round-robin experts and a replica of expert 0 on the last rank.
      auto const placement = round_robin_with_replica(experts, 0, nor);
      std::vector<float> scale;
      for (int e = 0; e < experts; ++e) scale.push_back(0.75f + 0.125f * e);
      for (Dist dist : {Dist::uniform, Dist::one_rank, Dist::empty_ranks, Dist::hot_expert}) {
        std::mt19937 rng(4242u + static_cast<unsigned>(rank) * 13u + static_cast<unsigned>(dist) + 100u * static_cast<unsigned>(k));
        int tokens = 0;
        auto routes = random_routes(dist, rank, size, experts, k, rng, tokens);
        std::vector<float> x;
        auto hidden = distinct_rows(tokens, d, rank, x, rng);
        auto const [bases, total] = route_bases(static_cast<index_t>(tokens) * k);
        for (int R : {1, rpn >= 2 ? 2 : 1}) {
          for (PayloadType type : {PayloadType::fp32, PayloadType::bf16}) {
            Topology::CommSpec spec;
            spec.relays_per_node = R;
            Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, spec);
            INFO("np " << size << " ranks/node " << rpn << " R " << R << " k " << k << " dist " << static_cast<int>(dist) << " payload "
                       << to_string(type));
            auto const c = exchange_config(type);
            FlatExchange<> flat(comms, placement, c);
            HierarchicalDedupExchange<> dedup(comms, placement, c);
            auto rf = run_step(flat, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
            auto rd = run_step(dedup, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]);
            auto const od = to_host_vector(rd.out), of = to_host_vector(rf.out);
            // The flat exchange's expert rows, in its order.
            CHECK(rd.arrival_ids == rf.arrival_ids);
            CHECK(rd.expert_major_ids == rf.expert_major_ids);
            CHECK(rd.slot_counts == rf.slot_counts);
            CHECK(rd.recv_counts == rf.recv_counts);
            // The summation tree, bit for bit (so the same bits at any rank
            // count with the same nodes of the experts), and the same bits
            // run after run.
            auto const [rp, plan] = plans_of(comms, placement, routes, rank, bases[rank], nor[rank]);
            std::vector<float> abs_sum;
            auto const ref = dedup_reference(to_host(rp), nor, my_node, x, d, scale, c.payload, c.return_payload, &abs_sum);
            REQUIRE(od.size() == ref.size());
            CHECK(kmoe_test::same_bits(od, ref));
            CHECK(kmoe_test::same_bits(to_host_vector(run_step(dedup, placement, routes, hidden, scale, rank, bases[rank], bases, nor[rank]).out), od));
            if (topo.num_nodes() == 1) CHECK(kmoe_test::same_bits(od, of));
            // Within rounding of the flat exchange: the summation order
            // (FP32) plus, in bf16, one more rounding of each partial sum.
            double const rel = type == PayloadType::bf16 ? 2.0 * std::ldexp(1.0, -8) : (2.0 * k + 2.0) * std::ldexp(1.0, -24);
            std::size_t off = 0;
            for (std::size_t i = 0; i < od.size(); ++i)
              if (std::fabs(static_cast<double>(od[i]) - of[i]) > rel * abs_sum[i] + 1e-30) ++off;
            CHECK(off == 0);
            // One inter-node row per (token, node), the routes it saved.
            auto const lf = rf.ledger.reduced(MPI_COMM_WORLD), ld = rd.ledger.reduced(MPI_COMM_WORLD);
            for (auto dir : {0, 1}) {
              auto const& f = dir == 0 ? lf.dispatch : lf.combine;
              auto const& g = dir == 0 ? ld.dispatch : ld.combine;
              auto const fi = f.by_class(LinkClass::inter_node), gi = g.by_class(LinkClass::inter_node);
              CHECK(gi.rows + gi.dedup_saved_rows == fi.rows);
              CHECK(gi.dedup_saved_bytes == gi.dedup_saved_rows * (dir == 0 ? ld.row_bytes : ld.combine_row_bytes));
              CHECK(gi.rows <= fi.rows);
              CHECK(g.useful_rows == total);
              if (topo.num_nodes() == 1) CHECK(gi.rows == 0);
            }
            if (k == 1) CHECK(ld.dispatch.by_class(LinkClass::inter_node).dedup_saved_rows == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("hierarchical_dedup: the planner predicts every measured ledger exactly, pairs included", "[exchange][dedup][planner]") {
  int const size = world_size();
  int const rank = world_rank();
  PlannerLayout const layout(size);
  for (Dist dist : {Dist::uniform, Dist::empty_ranks, Dist::hot_expert}) {
    auto const pr = planner_routes(layout, dist, 77u, rank, size);
    for (int R : {1, layout.rpn >= 2 ? 2 : 1}) {
      RowMatrix<float, MS> hidden("hidden", pr.tokens, 16);
      Kokkos::deep_copy(hidden, 0.5f);
      Topology::CommSpec spec;
      spec.relays_per_node = R;
      Topology::CommunicatorSet comms(MPI_COMM_WORLD, layout.topo, spec);
      for (PayloadType type : {PayloadType::fp32, PayloadType::bf16}) {
        auto c = exchange_config(type);
        c.algorithm = Algorithm::hierarchical_dedup;
        INFO("np " << size << " R " << R << " dist " << static_cast<int>(dist) << " payload " << to_string(type));
        HierarchicalDedupExchange<> dedup(comms, layout.placement, c);
        auto rd = run_step(dedup, layout.placement, pr.routes, hidden, layout.scale, rank, 0, {}, layout.nor[rank]);
        auto const planned = plan_ledgers(PlanInput{layout.topo, comms.layout(), pr.all, layout.placement, c, 16});
        CHECK(untimed(rd.ledger) == untimed(planned[static_cast<std::size_t>(rank)]));
        auto const sum = sum_ledgers(planned);
        auto const reduced = rd.ledger.reduced(MPI_COMM_WORLD);
        for (auto cls : {LinkClass::same_rank, LinkClass::intra_node, LinkClass::inter_node}) {
          CHECK(reduced.dispatch.by_class(cls).payload_bytes == sum.dispatch.by_class(cls).payload_bytes);
          CHECK(reduced.combine.by_class(cls).dedup_saved_rows == sum.combine.by_class(cls).dedup_saved_rows);
        }
        // Pairs: at most one per (sender, receiver) and stage, never more than messages.
        for (auto const* dir : {&rd.ledger.dispatch, &rd.ledger.combine})
          for (auto const& s : dir->stages)
            for (auto const& cl : s.by_class) {
              CHECK(cl.pairs <= cl.messages);
              CHECK((cl.rows == 0) == (cl.pairs == 0));
            }
      }
    }
  }
}

TEST_CASE("hierarchical_dedup: a wrong handle, a skipped dispatch_finish and a failed expert fail every rank", "[exchange][dedup][fault]") {
  int const size = world_size();
  int const rank = world_rank();
  int const rpn = size % 2 == 0 && size > 1 ? size / 2 : size;
  auto topo = nodes_of(rpn);
  auto const nor = nodes_vector(topo);
  int const experts = 2 * size;
  Placement placement = Placement::round_robin(experts, size, nor);
  std::mt19937 rng(9u + static_cast<unsigned>(rank));
  int tokens = 0;
  auto routes = random_routes(Dist::uniform, rank, size, experts, 2, rng, tokens);
  RowMatrix<float, MS> hidden("hidden", tokens, 8);
  Kokkos::deep_copy(hidden, 1.0f);
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  auto c = exchange_config(PayloadType::fp32);
  c.watchdog_seconds = 60;
  HierarchicalDedupExchange<> dedup(comms, placement, c);
  FlatExchange<> flat(comms, placement, c);
  Exec exec;
  auto const [rp, plan] = plans_of(comms, placement, routes, rank, 0, nor[rank]);
  PayloadBuffer<MS> returned("returned", c.return_payload, 8, plan.rows());
  {
    auto h = flat.dispatch(exec, rp, plan, hidden);
    CHECK_THROWS_WITH(dedup.combine(exec, h, h.expert_rows, returned), Catch::Matchers::Contains("flat dispatch handle"));
  }
  {
    auto h = dedup.dispatch_start(exec, rp, plan, hidden);
    CHECK_THROWS_WITH(dedup.combine(exec, h, h.expert_rows, returned), Catch::Matchers::Contains("has not finished"));
    dedup.dispatch_finish(exec, h);
  }
  {
    auto h = dedup.dispatch(exec, rp, plan, hidden);
    std::string const problem = rank == size - 1 ? "experts failed on the last rank" : "";
    CHECK_THROWS_WITH(dedup.combine(exec, h, h.expert_rows, returned, problem),
                      Catch::Matchers::Contains("experts failed on the last rank"));
  }
  // The exchange stays usable after the failures.
  auto r = run_step(dedup, placement, routes, hidden, std::vector<float>(static_cast<std::size_t>(experts), 1.0f), rank, 0, {}, nor[rank]);
  CHECK(r.ledger.combine.useful_rows == plan.rows());
}
