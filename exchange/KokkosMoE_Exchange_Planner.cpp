#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>

#include <algorithm>

namespace KokkosMoE {
namespace Exchange {

namespace {

using Matrix = std::vector<std::vector<std::int64_t>>;

ByteLedger blank(Algorithm algorithm, PlanInput const& in) {
  ByteLedger l;
  l.algorithm = to_string(algorithm);
  l.payload = to_string(in.config.payload);
  l.combine_payload = to_string(in.config.return_payload);
  l.width = in.width;
  l.row_bytes = payload_row_bytes(in.config.payload, in.width);
  l.combine_row_bytes = payload_row_bytes(in.config.return_payload, in.width);
  l.meta_row_bytes = sizeof(RowMeta);
  l.ranks = 1;
  return l;
}

/// What the planner reads of a rank's route plan: per accepted route (route
/// order) the destination rank and the local slot index there.
struct Flow {
  std::vector<int> dest;
  std::vector<int> local_slot;
};

std::vector<Flow> flows_of(PlanInput const& in) {
  std::vector<Flow> f(in.routes.size());
  for (std::size_t r = 0; r < in.routes.size(); ++r) {
    auto const& rp = in.routes[r];
    KOKKOSMOE_REQUIRE(rp.origin_rank == static_cast<int>(r), "planner: route plan " << r << " is rank " << rp.origin_rank << "'s");
    for (index_t a = 0; a < rp.size(); ++a) {
      int const s = rp.slot(a);
      KOKKOSMOE_REQUIRE(s >= 0 && s < in.placement.num_slots() && in.placement.slot(s).rank == rp.dest_rank(a),
                        "planner: route " << a << " of rank " << r << " has slot " << s << " and destination " << rp.dest_rank(a)
                                          << ", which placement generation " << in.placement.generation() << " does not match");
      f[r].dest.push_back(rp.dest_rank(a));
      f[r].local_slot.push_back(in.placement.local_index(s));
    }
  }
  return f;
}

/// Whether rows go straight to and from their expert-major places (both
/// payloads the rows' own type).
bool receives_into_experts(PlanInput const& in) {
  return in.config.receive_into_experts && in.config.payload == in.rows && in.config.return_payload == in.rows;
}

/// Per (source, destination rank): the destination's local slots the
/// source has rows for (one run each where rows go to their expert-major places).
Matrix slot_run_matrix(std::vector<Flow> const& routes, int N) {
  Matrix runs(static_cast<std::size_t>(N), std::vector<std::int64_t>(static_cast<std::size_t>(N), 0));
  for (int s = 0; s < N; ++s) {
    auto const& f = routes[static_cast<std::size_t>(s)];
    std::vector<std::vector<bool>> used(static_cast<std::size_t>(N));
    auto& row = runs[static_cast<std::size_t>(s)];
    for (std::size_t a = 0; a < f.dest.size(); ++a) {
      auto& u = used[static_cast<std::size_t>(f.dest[a])];
      auto const l = static_cast<std::size_t>(f.local_slot[a]);
      if (u.size() <= l) u.resize(l + 1, false);
      if (!u[l]) ++row[static_cast<std::size_t>(f.dest[a])];
      u[l] = true;
    }
  }
  return runs;
}

std::vector<int> nodes_of(Topology::Topology const& topo) {
  std::vector<int> n(static_cast<std::size_t>(topo.size()));
  for (int r = 0; r < topo.size(); ++r) n[static_cast<std::size_t>(r)] = topo.node_of(r);
  return n;
}

Matrix count_matrix(std::vector<Flow> const& routes, int N) {
  Matrix c(static_cast<std::size_t>(N), std::vector<std::int64_t>(static_cast<std::size_t>(N), 0));
  for (int s = 0; s < N; ++s)
    for (int d : routes[static_cast<std::size_t>(s)].dest) {
      KOKKOSMOE_REQUIRE(d >= 0 && d < N, "planner: rank " << s << " routes to rank " << d << " of " << N);
      ++c[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)];
    }
  return c;
}

/// counts by global rank -> counts in a peer order.
std::vector<std::int64_t> in_order(std::vector<std::int64_t> const& by_rank, std::vector<int> const& order) {
  std::vector<std::int64_t> v(order.size());
  for (std::size_t p = 0; p < order.size(); ++p) v[p] = by_rank[static_cast<std::size_t>(order[p])];
  return v;
}

std::vector<Flow> check_inputs(PlanInput const& in) {
  KOKKOSMOE_REQUIRE(static_cast<int>(in.routes.size()) == in.topology.size(),
                    "planner: routes for " << in.routes.size() << " ranks, topology has " << in.topology.size());
  KOKKOSMOE_REQUIRE(in.placement.num_ranks() == in.topology.size(),
                    "planner: placement spans " << in.placement.num_ranks() << " ranks, topology has " << in.topology.size());
  Topology::validate(in.topology, in.layout);
  return flows_of(in);
}

}  // namespace

std::vector<ByteLedger> plan_flat(PlanInput const& in) {
  auto const routes = check_inputs(in);
  auto const& topo = in.topology;
  auto const& layout = in.layout;
  int const N = topo.size();
  auto const nor = nodes_of(topo);
  auto const c = count_matrix(routes, N);
  // Rows straight to their expert-major places (FlatExchange::Direct): one
  // run per (source, destination's local slot) with rows, both ways.
  Matrix const runs = receives_into_experts(in)
                          ? slot_run_matrix(routes, N)
                          : Matrix(static_cast<std::size_t>(N), std::vector<std::int64_t>(static_cast<std::size_t>(N), 1));
  // FlatExchange's send from the hidden rows: MPI gathers runs, host rows.
  bool const gathered = receives_into_experts(in) && in.config.transport == TransportKind::mpi && !in.config.pair_runs && in.host_rows &&
                        in.topology.single_host();
  std::vector<ByteLedger> out(static_cast<std::size_t>(N), blank(Algorithm::flat, in));
  std::string const ep = "kmoe-ep";
  for (int me = 0; me < N; ++me) {
    auto& l = out[static_cast<std::size_t>(me)];
    std::vector<std::int64_t> recv(static_cast<std::size_t>(N)), recv_runs(static_cast<std::size_t>(N));
    for (int s = 0; s < N; ++s) {
      recv[static_cast<std::size_t>(s)] = c[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
      recv_runs[static_cast<std::size_t>(s)] = runs[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
    }
    StageLedger d{"all-to-all", ep};
    d.self_in_place = receives_into_experts(in);  // FlatExchange packs the own rows straight into their expert rows
    std::vector<std::int64_t> const one(static_cast<std::size_t>(N), 1);  // metadata: one message per peer
    // Rows gathered from the hidden rows travel as one message per peer too.
    auto const send_runs = gathered ? one : in_order(runs[static_cast<std::size_t>(me)], layout.ep_order);
    add_sends(d, in_order(c[static_cast<std::size_t>(me)], layout.ep_order), layout.ep_order, me, nor, l.row_bytes, l.meta_row_bytes,
              &send_runs, &one);
    l.dispatch.stages.push_back(d);
    for (auto x : recv) l.dispatch.useful_rows += x;
    StageLedger b{"all-to-all (reverse)", ep};
    auto const back_runs = in_order(recv_runs, layout.ep_order);
    add_sends(b, in_order(recv, layout.ep_order), layout.ep_order, me, nor, l.combine_row_bytes, 0, &back_runs);
    l.combine.stages.push_back(b);
    l.combine.useful_rows = static_cast<std::int64_t>(routes[static_cast<std::size_t>(me)].dest.size());
    l.dispatch.rows_in_place = l.combine.rows_in_place = receives_into_experts(in);
  }
  return out;
}

std::vector<ByteLedger> plan_hierarchical(PlanInput const& in) {
  auto const routes = check_inputs(in);
  auto const& topo = in.topology;
  auto const& layout = in.layout;
  int const N = topo.size();
  int const nodes = topo.num_nodes();
  auto const nor = nodes_of(topo);
  auto const c = count_matrix(routes, N);
  auto relay_of = [&](int s) { return Topology::relay_for(topo, layout, s, nor[static_cast<std::size_t>(s)]); };
  auto rail_of = [&](int s) { return Topology::rail_of(topo, layout, s); };
  // Stage 1 counts s -> x (x on s's node): direct rows, plus transit rows to s's relay.
  Matrix s1(static_cast<std::size_t>(N), std::vector<std::int64_t>(static_cast<std::size_t>(N), 0));
  // Stage 2 counts relay -> relay; stage 3 counts relay -> final.
  Matrix s2 = s1, s3 = s1;
  std::vector<std::int64_t> transit(static_cast<std::size_t>(N), 0);
  for (int s = 0; s < N; ++s)
    for (int d = 0; d < N; ++d) {
      std::int64_t const n = c[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)];
      if (n == 0) continue;
      int const a = nor[static_cast<std::size_t>(s)], b = nor[static_cast<std::size_t>(d)];
      if (a == b) {
        s1[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)] += n;
        continue;
      }
      int const r = relay_of(s);
      int const r2 = layout.relays[static_cast<std::size_t>(b)][static_cast<std::size_t>(rail_of(s))];
      s1[static_cast<std::size_t>(s)][static_cast<std::size_t>(r)] += n;
      transit[static_cast<std::size_t>(s)] += n;
      s2[static_cast<std::size_t>(r)][static_cast<std::size_t>(r2)] += n;
      s3[static_cast<std::size_t>(r2)][static_cast<std::size_t>(d)] += n;
    }
  // Runs, as HierarchicalExchange sends them (messages: transfer_messages).
  // Stage 2: per relay peer, one run per (source feeding the relay,
  // destination node). Stage 3: per final rank, one run per origin. The
  // reverse stages return in the same runs; the last one into the origin's
  // plan order: per node peer x, the destinations x carries in stage-1
  // order (node, node-local slot), one run per stretch of them that is also
  // consecutive in the plan's order (EP peer order, empty destinations
  // skipped).
  Matrix runs1 = s1, runs2 = s1, runs3 = s1;
  for (auto* m : {&runs1, &runs2, &runs3})
    for (auto& row : *m) std::fill(row.begin(), row.end(), 0);
  std::vector<int> group_slot(static_cast<std::size_t>(N), 0);
  for (auto const& g : layout.node_groups)
    for (std::size_t i = 0; i < g.size(); ++i) group_slot[static_cast<std::size_t>(g[i])] = static_cast<int>(i);
  for (int s = 0; s < N; ++s) {
    auto const& cs = c[static_cast<std::size_t>(s)];
    int const a = nor[static_cast<std::size_t>(s)];
    for (int b = 0; b < nodes; ++b) {
      if (b == a) continue;
      std::int64_t t = 0;
      for (int d : topo.ranks_of_node(b)) t += cs[static_cast<std::size_t>(d)];
      if (t > 0) runs2[static_cast<std::size_t>(relay_of(s))][static_cast<std::size_t>(layout.relays[static_cast<std::size_t>(b)][static_cast<std::size_t>(rail_of(s))])] += 1;
    }
    for (int d = 0; d < N; ++d) {
      int const b = nor[static_cast<std::size_t>(d)];
      if (b != a && cs[static_cast<std::size_t>(d)] > 0)
        runs3[static_cast<std::size_t>(layout.relays[static_cast<std::size_t>(b)][static_cast<std::size_t>(rail_of(s))])][static_cast<std::size_t>(d)] += 1;
    }
    // Destinations in plan order, and the one after each (non-empty).
    std::vector<int> next(static_cast<std::size_t>(N), -1);
    int prev = -1;
    for (int d : layout.ep_order) {
      if (cs[static_cast<std::size_t>(d)] == 0) continue;
      if (prev >= 0) next[static_cast<std::size_t>(prev)] = d;
      prev = d;
    }
    std::vector<std::pair<std::pair<int, int>, int>> order;  // ((node, node-local slot), destination)
    for (int d = 0; d < N; ++d)
      if (cs[static_cast<std::size_t>(d)] > 0) order.push_back({{nor[static_cast<std::size_t>(d)], group_slot[static_cast<std::size_t>(d)]}, d});
    std::sort(order.begin(), order.end());
    std::vector<int> last(static_cast<std::size_t>(N), -1);  // per node peer: the destination its last run ends with
    for (auto const& [key, d] : order) {
      int const x = nor[static_cast<std::size_t>(d)] == a ? d : relay_of(s);
      auto& l = last[static_cast<std::size_t>(x)];
      if (l < 0 || next[static_cast<std::size_t>(l)] != d) runs1[static_cast<std::size_t>(s)][static_cast<std::size_t>(x)] += 1;
      l = d;
    }
  }
  // Rows straight to and from their expert-major places
  // (HierarchicalExchange::dispatch_start_direct): the own node's rows one
  // run per (source, destination's local slot) both ways, their metadata one
  // message per peer; transit rows to the relay one run per destination
  // rank (payload and metadata alike, both ways); stage 3's payload one run
  // per (origin, local slot) both ways, its metadata one run per origin.
  // Stage 2 hands each receiving relay its own rows straight (one run per
  // (origin, slot), metadata one run per origin; the other rows as before,
  // a source's rows for a node after those for its relay), so stage 3
  // carries no row for the relay itself.
  bool const direct = receives_into_experts(in);
  Matrix const slot_runs = direct ? slot_run_matrix(routes, N) : Matrix{};
  Matrix fine3(static_cast<std::size_t>(N), std::vector<std::int64_t>(static_cast<std::size_t>(N), 0));
  Matrix own2 = fine3, own2_runs = fine3, own2_meta = fine3;
  std::vector<std::int64_t> far_runs(static_cast<std::size_t>(N), 0);
  if (direct) {
    for (int s = 0; s < N; ++s)
      for (int d = 0; d < N; ++d) {
        auto const su = static_cast<std::size_t>(s), du = static_cast<std::size_t>(d);
        int const b = nor[du];
        if (b == nor[su] || c[su][du] == 0) continue;
        ++far_runs[su];
        auto const r2 = static_cast<std::size_t>(layout.relays[static_cast<std::size_t>(b)][static_cast<std::size_t>(rail_of(s))]);
        if (r2 == du) {
          auto const r = static_cast<std::size_t>(relay_of(s));
          own2[r][r2] += c[su][du];
          own2_runs[r][r2] += slot_runs[su][du];
          own2_meta[r][r2] += 1;
          s2[r][r2] -= c[su][du];
          s3[r2][du] -= c[su][du];
          runs3[r2][du] -= 1;
        } else {
          fine3[r2][du] += slot_runs[su][du];
        }
      }
    // Other rows per (source, node): a run where any are left.
    for (auto& row : runs2) std::fill(row.begin(), row.end(), 0);
    for (int s = 0; s < N; ++s) {
      auto const su = static_cast<std::size_t>(s);
      for (int b = 0; b < nodes; ++b) {
        if (b == nor[su]) continue;
        auto const r2 = layout.relays[static_cast<std::size_t>(b)][static_cast<std::size_t>(rail_of(s))];
        std::int64_t t = 0;
        for (int d : topo.ranks_of_node(b))
          if (d != r2) t += c[su][static_cast<std::size_t>(d)];
        if (t > 0) runs2[static_cast<std::size_t>(relay_of(s))][static_cast<std::size_t>(r2)] += 1;
      }
    }
  }
  std::vector<ByteLedger> out(static_cast<std::size_t>(N), blank(Algorithm::hierarchical, in));
  for (int me = 0; me < N; ++me) {
    auto& l = out[static_cast<std::size_t>(me)];
    int const node = nor[static_cast<std::size_t>(me)];
    auto const& group = layout.node_groups[static_cast<std::size_t>(node)];
    std::string const node_name = "kmoe-node" + std::to_string(node);
    int rail = -1;
    for (int j = 0; j < layout.relays_per_node; ++j)
      if (layout.relays[static_cast<std::size_t>(node)][static_cast<std::size_t>(j)] == me) rail = j;
    std::int64_t const per_row = l.row_bytes + l.meta_row_bytes;
    auto column = [&](Matrix const& m) {
      std::vector<std::int64_t> v(static_cast<std::size_t>(N));
      for (int s = 0; s < N; ++s) v[static_cast<std::size_t>(s)] = m[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
      return v;
    };
    // Dispatch.
    // Rows for the own rank are packed where they arrive (stage 1), read
    // where they are (stage 3) and written there (its reverse): no copy.
    StageLedger d1{"gather to relay + node-local direct", node_name};
    d1.self_in_place = true;  // the own rows are packed where they arrive
    // Where rows go straight to their expert rows, the own node's rows and
    // the transit rows are two transfers.
    std::vector<std::int64_t> own(group.size(), 0), own_runs(group.size(), 0), own_back(group.size(), 0),
        own_back_runs(group.size(), 0), far(group.size(), 0), far_back(group.size(), 0), far_out_runs(group.size(), 0),
        far_back_runs(group.size(), 0);
    for (std::size_t k = 0; direct && k < group.size(); ++k) {
      auto const x = static_cast<std::size_t>(group[k]);
      auto const m = static_cast<std::size_t>(me);
      own[k] = c[m][x];
      own_runs[k] = slot_runs[m][x];
      own_back[k] = c[x][m];
      own_back_runs[k] = slot_runs[x][m];
      if (group[k] == relay_of(me)) {
        far[k] = transit[m];
        far_out_runs[k] = far_runs[m];
      }
      if (relay_of(group[k]) == me) {
        far_back[k] = transit[x];
        far_back_runs[k] = far_runs[x];
      }
    }
    std::vector<std::int64_t> const one(group.size(), 1);
    if (direct) {
      d1.extra_count_rounds = {"kmoe-ep"};
      add_sends(d1, own, group, me, nor, l.row_bytes, l.meta_row_bytes, &own_runs, &one);
      add_sends(d1, far, group, me, nor, l.row_bytes, l.meta_row_bytes, &far_out_runs);
    } else {
      add_sends(d1, in_order(s1[static_cast<std::size_t>(me)], group), group, me, nor, l.row_bytes, l.meta_row_bytes);
    }
    if (relay_of(me) != me) {
      d1.relay_rows += transit[static_cast<std::size_t>(me)];
      d1.relay_bytes += transit[static_cast<std::size_t>(me)] * per_row;
    }
    StageLedger d2{"relay to relay", rail >= 0 ? "kmoe-relay" + std::to_string(rail) : std::string("-")};
    if (rail >= 0) {
      auto const& rg = layout.relay_groups[static_cast<std::size_t>(rail)];
      auto const runs = in_order(runs2[static_cast<std::size_t>(me)], rg);
      add_sends(d2, in_order(s2[static_cast<std::size_t>(me)], rg), rg, me, nor, l.row_bytes, l.meta_row_bytes, &runs);
      if (direct) {
        auto const own_runs = in_order(own2_runs[static_cast<std::size_t>(me)], rg);
        auto const own_meta = in_order(own2_meta[static_cast<std::size_t>(me)], rg);
        add_sends(d2, in_order(own2[static_cast<std::size_t>(me)], rg), rg, me, nor, l.row_bytes, l.meta_row_bytes, &own_runs, &own_meta);
      }
    }
    StageLedger d3{"relay scatter", node_name};
    d3.self_in_place = !direct;
    auto const runs_d3 = in_order(runs3[static_cast<std::size_t>(me)], group);
    auto const fine_d3 = in_order(fine3[static_cast<std::size_t>(me)], group);
    add_sends(d3, in_order(s3[static_cast<std::size_t>(me)], group), group, me, nor, l.row_bytes, l.meta_row_bytes,
              direct ? &fine_d3 : &runs_d3, &runs_d3);
    std::int64_t moved = 0;
    for (int x : group)
      if (x != me) moved += s3[static_cast<std::size_t>(me)][static_cast<std::size_t>(x)];
    d3.relay_rows += moved;
    d3.relay_bytes += moved * per_row;
    l.dispatch.stages = {d1, d2, d3};
    for (int s = 0; s < N; ++s) l.dispatch.useful_rows += c[static_cast<std::size_t>(s)][static_cast<std::size_t>(me)];
    // Combine: the reverse stages send back what each stage received.
    StageLedger c3{"relay gather (reverse of relay scatter)", node_name};
    c3.self_in_place = !direct;
    auto const runs_c3 = in_order(column(direct ? fine3 : runs3), group);
    add_sends(c3, in_order(column(s3), group), group, me, nor, l.combine_row_bytes, 0, &runs_c3);
    StageLedger c2{"relay to relay (reverse)", d2.communicator};
    if (rail >= 0) {
      auto const& rg = layout.relay_groups[static_cast<std::size_t>(rail)];
      auto const runs = in_order(column(runs2), rg);
      add_sends(c2, in_order(column(s2), rg), rg, me, nor, l.combine_row_bytes, 0, &runs);
      if (direct) {
        auto const own_runs = in_order(column(own2_runs), rg);
        add_sends(c2, in_order(column(own2), rg), rg, me, nor, l.combine_row_bytes, 0, &own_runs);
      }
    }
    StageLedger c1{"return from relay + node-local direct", node_name};
    // The own kept rows are written into the return buffer by the first
    // scatter; a rank that is its own relay copies its transit rows back.
    if (direct) {
      add_sends(c1, own_back, group, me, nor, l.combine_row_bytes, 0, &own_back_runs);
      add_sends(c1, far_back, group, me, nor, l.combine_row_bytes, 0, &far_back_runs);
    } else {
      c1.self_in_place = !(relay_of(me) == me && transit[static_cast<std::size_t>(me)] > 0);
      auto const runs_c1 = in_order(column(runs1), group);
      add_sends(c1, in_order(column(s1), group), group, me, nor, l.combine_row_bytes, 0, &runs_c1);
    }
    l.combine.stages = {c3, c2, c1};
    for (std::size_t i = 0; i < 3; ++i) {
      l.combine.stages[i].relay_rows = l.dispatch.stages[2 - i].relay_rows;
      l.combine.stages[i].relay_bytes = l.combine.stages[i].relay_rows * l.combine_row_bytes;
    }
    l.combine.useful_rows = static_cast<std::int64_t>(routes[static_cast<std::size_t>(me)].dest.size());
    l.dispatch.rows_in_place = l.combine.rows_in_place = receives_into_experts(in);
  }
  (void)nodes;
  return out;
}

std::vector<ByteLedger> plan_hierarchical_dedup(PlanInput const& in) {
  auto const flows = check_inputs(in);
  auto const& topo = in.topology;
  auto const& layout = in.layout;
  int const N = topo.size();
  int const nodes = topo.num_nodes();
  auto const nor = nodes_of(topo);
  auto const c = count_matrix(flows, N);
  auto const Nu = static_cast<std::size_t>(N);
  auto relay_on = [&](int r, int node) { return Topology::relay_for(topo, layout, r, node); };
  // Per origin and node: units (tokens with a route there) and the routes they carry.
  Matrix units(Nu, std::vector<std::int64_t>(static_cast<std::size_t>(nodes), 0)), unit_routes = units;
  int k = 1;
  for (int o = 0; o < N; ++o) {
    auto const& rp = in.routes[static_cast<std::size_t>(o)];
    k = std::max(k, rp.top_k);
    int const a_node = nor[static_cast<std::size_t>(o)];
    for (index_t t = 0; t < rp.num_tokens; ++t) {
      std::vector<int> per_node(static_cast<std::size_t>(nodes), 0);
      for (int j = 0; j < rp.top_k; ++j) {
        index_t const a = rp.route_index(t, j);
        if (a < 0) continue;
        int const b = nor[static_cast<std::size_t>(rp.dest_rank(a))];
        if (b != a_node) ++per_node[static_cast<std::size_t>(b)];
      }
      for (int b = 0; b < nodes; ++b)
        if (per_node[static_cast<std::size_t>(b)] > 0) {
          ++units[static_cast<std::size_t>(o)][static_cast<std::size_t>(b)];
          unit_routes[static_cast<std::size_t>(o)][static_cast<std::size_t>(b)] += per_node[static_cast<std::size_t>(b)];
        }
    }
  }
  std::int64_t const unit_bytes = UnitMeta::bytes(k);
  std::int64_t const meta = static_cast<std::int64_t>(sizeof(RowMeta));
  // Stage 1 units (origin -> its relay), stage 2 units (relay -> relay),
  // stage 3 rows (the destination relay -> final rank), with their routes.
  Matrix u1(Nu, std::vector<std::int64_t>(Nu, 0)), u1r = u1, s2 = u1, s2r = u1, s3 = u1;
  for (int o = 0; o < N; ++o) {
    auto const ou = static_cast<std::size_t>(o);
    int const a_node = nor[ou];
    auto const ra = static_cast<std::size_t>(relay_on(o, a_node));
    for (int b = 0; b < nodes; ++b) {
      auto const bu = static_cast<std::size_t>(b);
      if (b == a_node || units[ou][bu] == 0) continue;
      u1[ou][ra] += units[ou][bu];
      u1r[ou][ra] += unit_routes[ou][bu];
      auto const rb = static_cast<std::size_t>(relay_on(o, b));
      s2[ra][rb] += units[ou][bu];
      s2r[ra][rb] += unit_routes[ou][bu];
    }
    for (int x = 0; x < N; ++x) {
      auto const xu = static_cast<std::size_t>(x);
      if (nor[xu] != a_node && c[ou][xu] > 0) s3[static_cast<std::size_t>(relay_on(o, nor[xu]))][xu] += c[ou][xu];
    }
  }
  std::vector<ByteLedger> out(Nu, blank(Algorithm::hierarchical_dedup, in));
  for (int me = 0; me < N; ++me) {
    auto const mu = static_cast<std::size_t>(me);
    auto& l = out[mu];
    int const node = nor[mu];
    auto const& group = layout.node_groups[static_cast<std::size_t>(node)];
    std::string const node_name = "kmoe-node" + std::to_string(node);
    int rail = -1;
    for (int j = 0; j < layout.relays_per_node; ++j)
      if (layout.relays[static_cast<std::size_t>(node)][static_cast<std::size_t>(j)] == me) rail = j;
    auto row_of = [&](Matrix const& m, std::vector<int> const& order) { return in_order(m[mu], order); };
    auto column = [&](Matrix const& m, std::vector<int> const& order) {
      std::vector<std::int64_t> v(order.size());
      for (std::size_t p = 0; p < order.size(); ++p) v[p] = m[static_cast<std::size_t>(order[p])][mu];
      return v;
    };
    std::vector<std::int64_t> direct(group.size(), 0), direct_back(group.size(), 0);
    for (std::size_t x = 0; x < group.size(); ++x) {
      direct[x] = c[mu][static_cast<std::size_t>(group[x])];
      direct_back[x] = c[static_cast<std::size_t>(group[x])][mu];
    }
    StageLedger d1{"gather to relay + node-local direct", node_name};
    d1.self_in_place = true;
    add_sends(d1, direct, group, me, nor, l.row_bytes, meta);
    auto const u1_routes = row_of(u1r, group);
    add_sends(d1, row_of(u1, group), group, me, nor, l.row_bytes, unit_bytes, nullptr, nullptr, &u1_routes);
    std::int64_t my_units = 0;
    for (auto x : u1[mu]) my_units += x;
    if (relay_on(me, node) != me) {
      d1.relay_rows = my_units;
      d1.relay_bytes = my_units * (l.row_bytes + unit_bytes);
    }
    StageLedger d2{"relay to relay", rail >= 0 ? "kmoe-relay" + std::to_string(rail) : std::string("-")};
    StageLedger c2{"relay to relay (reverse)", d2.communicator};
    if (rail >= 0) {
      auto const& rg = layout.relay_groups[static_cast<std::size_t>(rail)];
      auto const routes2 = row_of(s2r, rg);
      add_sends(d2, row_of(s2, rg), rg, me, nor, l.row_bytes, unit_bytes, nullptr, nullptr, &routes2);
      auto const back_routes = column(s2r, rg);
      add_sends(c2, column(s2, rg), rg, me, nor, l.combine_row_bytes, 0, nullptr, nullptr, &back_routes);
    }
    StageLedger d3{"relay expand", node_name};
    d3.self_in_place = true;
    auto const rows3 = row_of(s3, group);
    add_sends(d3, rows3, group, me, nor, l.row_bytes, meta);
    for (std::size_t x = 0; x < group.size(); ++x)
      if (group[x] != me) d3.relay_rows += rows3[x];
    d3.relay_bytes = d3.relay_rows * (l.row_bytes + meta);
    l.dispatch.stages = {d1, d2, d3};
    for (int src = 0; src < N; ++src) l.dispatch.useful_rows += c[static_cast<std::size_t>(src)][mu];
    StageLedger c3{"relay gather (reverse of relay expand)", node_name};
    c3.self_in_place = true;
    add_sends(c3, column(s3, group), group, me, nor, l.combine_row_bytes, 0);
    c3.relay_rows = d3.relay_rows;
    c3.relay_bytes = c3.relay_rows * l.combine_row_bytes;
    StageLedger c1{"return from relay + node-local direct", node_name};
    c1.self_in_place = true;
    add_sends(c1, direct_back, group, me, nor, l.combine_row_bytes, 0);
    auto const back1_routes = column(u1r, group);
    add_sends(c1, column(u1, group), group, me, nor, l.combine_row_bytes, 0, nullptr, nullptr, &back1_routes);
    c1.relay_rows = d1.relay_rows;
    c1.relay_bytes = c1.relay_rows * l.combine_row_bytes;
    l.combine.stages = {c3, c2, c1};
    l.combine.useful_rows = static_cast<std::int64_t>(flows[mu].dest.size());
  }
  return out;
}

std::vector<ByteLedger> plan_pooled_wave(PlanInput const& in) {
  auto const routes = check_inputs(in);
  auto const& topo = in.topology;
  auto const& layout = in.layout;
  auto const config = pooled_wave_config(in.config, in.placement);
  int const N = topo.size();
  auto const nor = nodes_of(topo);
  auto const shapes = pooled_wave_shapes(config, N, payload_row_bytes(in.config.payload, in.width),
                                         payload_row_bytes(in.config.return_payload, in.width));
  int const W = config.waves;
  int const L = config.local_experts;
  std::int64_t const Rs = shapes.sender_pool_rows, Rr = shapes.receiver_expert_rows;
  auto const& order = layout.ep_order;
  // Over MPI, rows of the rows' own type go straight to and from the expert
  // rows, after headers of their own (PooledWaveExchange::direct_rows).
  bool const direct = receives_into_experts(in) && in.config.transport == TransportKind::mpi;
  std::int64_t const id_bytes = direct ? pooled_wave_id_span(Rs, L) : 0;
  std::int64_t const flag_bytes = direct ? pooled_wave_flag_bytes(Rs) : 0;
  // seq[s][d]: local slot ids of s's routes to d in stable route order.
  std::vector<std::vector<std::vector<int>>> seq(static_cast<std::size_t>(N), std::vector<std::vector<int>>(static_cast<std::size_t>(N)));
  for (int s = 0; s < N; ++s) {
    auto const& r = routes[static_cast<std::size_t>(s)];
    KOKKOSMOE_REQUIRE(r.dest.size() == r.local_slot.size(), "planner: rank " << s << " has " << r.dest.size()
                                                                            << " destinations and " << r.local_slot.size() << " slots");
    for (std::size_t i = 0; i < r.dest.size(); ++i)
      seq[static_cast<std::size_t>(s)][static_cast<std::size_t>(r.dest[i])].push_back(r.local_slot[i]);
  }
  std::vector<ByteLedger> out(static_cast<std::size_t>(N), blank(Algorithm::pooled_wave, in));
  for (int me = 0; me < N; ++me) {
    auto& l = out[static_cast<std::size_t>(me)];
    std::int64_t sender_drops = 0, receiver_drops = 0;
    for (int d = 0; d < N; ++d)
      sender_drops += std::max<std::int64_t>(0, static_cast<std::int64_t>(seq[static_cast<std::size_t>(me)][static_cast<std::size_t>(d)].size()) - Rs * W);
    for (int w = 0; w < W; ++w) {
      // Rows this rank sends in wave w to each peer slot, and rows it keeps of
      // what every source sends it (receiver compaction in (source, row) order).
      // Direct rows travel in one run per local expert.
      std::vector<std::int64_t> useful(order.size(), 0), kept_from(order.size(), 0), runs(order.size(), 0);
      for (std::size_t p = 0; p < order.size(); ++p) {
        auto const& mine = seq[static_cast<std::size_t>(me)][static_cast<std::size_t>(order[p])];
        std::vector<bool> expert(static_cast<std::size_t>(L), false);
        for (std::int64_t j = 0; j < Rs; ++j)
          if (j * W + w < static_cast<std::int64_t>(mine.size())) {
            ++useful[p];
            int const q = mine[static_cast<std::size_t>(j * W + w)];
            KOKKOSMOE_REQUIRE(q >= 0 && q < L, "planner: local slot " << q << " outside the static " << L << " experts");
            auto const e = static_cast<std::size_t>(q);
            runs[p] += expert[e] ? 0 : 1;
            expert[e] = true;
          }
      }
      std::vector<std::int64_t> per_expert(static_cast<std::size_t>(L), 0);
      for (std::size_t p = 0; p < order.size(); ++p) {
        auto const& from = seq[static_cast<std::size_t>(order[p])][static_cast<std::size_t>(me)];
        for (std::int64_t j = 0; j < Rs; ++j) {
          std::int64_t const i = j * W + w;
          if (i >= static_cast<std::int64_t>(from.size())) break;
          int const q = from[static_cast<std::size_t>(i)];
          KOKKOSMOE_REQUIRE(q >= 0 && q < L, "planner: local slot " << q << " outside the static " << L << " experts");
          if (per_expert[static_cast<std::size_t>(q)]++ < Rr)
            ++kept_from[p];
          else
            ++receiver_drops;
        }
      }
      auto const st = pooled_wave_stage("wave " + std::to_string(w), "kmoe-ep", useful, order, me, nor, l.row_bytes, shapes, id_bytes,
                                        direct ? &runs : nullptr);
      auto const back = pooled_wave_stage("wave " + std::to_string(w) + " (return)", "kmoe-ep", kept_from, order, me, nor,
                                          l.combine_row_bytes, shapes, flag_bytes);
      l.dispatch.stages.push_back(st);
      l.combine.stages.push_back(back);
    }
    std::int64_t const A = static_cast<std::int64_t>(routes[static_cast<std::size_t>(me)].dest.size());
    l.dispatch.sender_drops = sender_drops;
    l.dispatch.receiver_drops = receiver_drops;
    l.dispatch.rows_in_place = l.combine.rows_in_place = direct;
    l.dispatch.useful_rows = (A - sender_drops) - receiver_drops;
    l.combine.useful_rows = l.dispatch.useful_rows;
  }
  return out;
}

namespace Impl {

RoutePlan<Kokkos::HostSpace> gathered_route_plan(int origin_rank, index_t num_tokens, int top_k, index_t id_base,
                                                 std::uint64_t generation, std::vector<int> const* fields, std::vector<float> gate) {
  // fields: token, k-slot, expert, slot, destination rank.
  std::size_t const A = fields[0].size();
  for (int f = 1; f < 5; ++f)
    KOKKOSMOE_REQUIRE(fields[f].size() == A, "allgather_routes: rank " << origin_rank << " sent fields of different lengths");
  KOKKOSMOE_REQUIRE(gate.size() == A, "allgather_routes: rank " << origin_rank << " sent " << gate.size() << " gates for " << A << " routes");
  RoutePlan<Kokkos::HostSpace> p;
  p.origin_rank = origin_rank;
  p.num_tokens = num_tokens;
  p.top_k = top_k;
  p.id_base = id_base;
  p.generation = generation;
  auto view_of = [&](std::vector<int> const& v, char const* name) {
    Kokkos::View<int*, Kokkos::HostSpace> out(std::string("KokkosMoE::gathered_routes::") + name, v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out(i) = v[i];
    return out;
  };
  p.token = view_of(fields[0], "token");
  p.kslot = view_of(fields[1], "kslot");
  p.expert = view_of(fields[2], "expert");
  p.slot = view_of(fields[3], "slot");
  p.dest_rank = view_of(fields[4], "dest_rank");
  p.gate = Kokkos::View<float*, Kokkos::HostSpace>("KokkosMoE::gathered_routes::gate", A);
  for (std::size_t i = 0; i < A; ++i) p.gate(i) = gate[i];
  p.route_index = Kokkos::View<index_t**, Kokkos::LayoutRight, Kokkos::HostSpace>("KokkosMoE::gathered_routes::route_index", num_tokens, top_k);
  Kokkos::deep_copy(p.route_index, -1);
  for (std::size_t a = 0; a < A; ++a) {
    int const t = fields[0][a], j = fields[1][a];
    KOKKOSMOE_REQUIRE(t >= 0 && t < num_tokens && j >= 0 && j < top_k,
                      "allgather_routes: rank " << origin_rank << " route " << a << " is (token " << t << ", k-slot " << j << ")");
    p.route_index(t, j) = static_cast<index_t>(a);
  }
  return p;
}

template <class V, class MPIType>
std::vector<std::vector<V>> allgather_values(MPI_Comm comm, std::vector<V> const& mine, MPIType type) {
  int const size = comm_size(comm);
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size) + 1, 0);
  KOKKOSMOE_MPI_CHECK(MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, comm), comm);
  for (int r = 0; r < size; ++r) displs[static_cast<std::size_t>(r) + 1] = displs[static_cast<std::size_t>(r)] + counts[static_cast<std::size_t>(r)];
  std::vector<V> all(static_cast<std::size_t>(displs.back()));
  KOKKOSMOE_MPI_CHECK(MPI_Allgatherv(mine.data(), n, type, all.data(), counts.data(), displs.data(), type, comm), comm);
  std::vector<std::vector<V>> out(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r)
    out[static_cast<std::size_t>(r)].assign(all.begin() + displs[static_cast<std::size_t>(r)], all.begin() + displs[static_cast<std::size_t>(r) + 1]);
  return out;
}

std::vector<std::vector<int>> allgather_ints(MPI_Comm comm, std::vector<int> const& mine) { return allgather_values(comm, mine, MPI_INT); }
std::vector<std::vector<float>> allgather_floats(MPI_Comm comm, std::vector<float> const& mine) {
  return allgather_values(comm, mine, MPI_FLOAT);
}
std::vector<std::vector<std::int64_t>> allgather_int64s(MPI_Comm comm, std::vector<std::int64_t> const& mine) {
  return allgather_values(comm, mine, MPI_INT64_T);
}

}  // namespace Impl

ByteLedger sum_ledgers(std::vector<ByteLedger> const& ledgers) {
  KOKKOSMOE_REQUIRE(!ledgers.empty(), "sum_ledgers: no ledgers");
  ByteLedger total = ledgers[0];
  for (std::size_t i = 1; i < ledgers.size(); ++i) total.accumulate(ledgers[i]);
  total.ranks = static_cast<int>(ledgers.size());
  return total;
}

LedgerMaxima ledger_maxima(Topology::Topology const& topo, std::vector<ByteLedger> const& ledgers) {
  LedgerMaxima m;
  std::vector<std::int64_t> node_bytes(static_cast<std::size_t>(topo.num_nodes()), 0), node_msgs(node_bytes.size(), 0);
  for (int r = 0; r < topo.size(); ++r) {
    auto const& l = ledgers[static_cast<std::size_t>(r)];
    auto const inter = l.dispatch.by_class(LinkClass::inter_node);
    node_bytes[static_cast<std::size_t>(topo.node_of(r))] += inter.payload_bytes;
    node_msgs[static_cast<std::size_t>(topo.node_of(r))] += inter.messages;
    std::int64_t relay_inter = 0, relay_rows = l.dispatch.relay_rows();
    for (auto const& s : l.dispatch.stages)
      if (s.name == "relay to relay") {
        relay_inter += s.by_class[static_cast<int>(LinkClass::inter_node)].payload_bytes;
        relay_rows += s.total().rows;
      }
    if (relay_inter > m.relay_inter_bytes) {
      m.relay_inter_bytes = relay_inter;
      m.relay_inter_bytes_rank = r;
    }
    if (relay_rows > m.relay_rows) {
      m.relay_rows = relay_rows;
      m.relay_rows_rank = r;
    }
  }
  for (int n = 0; n < topo.num_nodes(); ++n) {
    if (node_bytes[static_cast<std::size_t>(n)] > m.node_inter_bytes || m.node_inter_bytes_node < 0) {
      m.node_inter_bytes = node_bytes[static_cast<std::size_t>(n)];
      m.node_inter_bytes_node = n;
    }
    m.node_inter_messages = std::max(m.node_inter_messages, node_msgs[static_cast<std::size_t>(n)]);
  }
  return m;
}

}  // namespace Exchange
}  // namespace KokkosMoE
