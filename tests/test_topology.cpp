// Topology discovery (hwloc, virtual, synthetic), the communicator set with
// explicit peer orders and relays, split vectors in peer order, and every
// validation error raised on all ranks without a hang.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <algorithm>
#include <numeric>
#include <set>

using namespace KokkosMoE;
using namespace KokkosMoE::Topology;

namespace {

using Matrix = std::vector<std::vector<std::int64_t>>;

// Count matrix [src][dst] of dispatch_v17.json.
Matrix v17_counts() {
  auto const fx = kmoe_test::fixture("dispatch_v17.json");
  return fx.at("expected").at("count_matrix_src_by_dst").get<Matrix>();
}

LayoutSpec virtual_rpn(int rpn) {
  LayoutSpec s;
  s.kind = LayoutKind::virtual_nodes;
  s.ranks_per_node = rpn;
  return s;
}

/// Expects a CollectiveError on every rank whose origin message contains `text`.
template <class F>
void expect_collective_error(F&& f, std::string const& text) {
  bool caught = false;
  std::string message;
  try {
    f();
  } catch (CollectiveError const& e) {
    caught = true;
    message = e.what();
  }
  INFO(message);
  CHECK(caught);
  CHECK(message.find(text) != std::string::npos);
  // Everybody is still in step: a barrier completes.
  MPI_Barrier(MPI_COMM_WORLD);
}

/// Checks the communicator set against its layout through real MPI calls:
/// every communicator's size, this rank's slot, and that MPI rank order is
/// the peer order (each rank sends its global rank, the gather must list the
/// peer order).
void check_set(CommunicatorSet const& set) {
  int const me = kmoe_test::world_rank();
  auto gather = [](Communicator const& c) {
    std::vector<int> got(static_cast<std::size_t>(c.size()));
    int const g = kmoe_test::world_rank();
    MPI_Allgather(&g, 1, MPI_INT, got.data(), 1, MPI_INT, c.comm());
    return got;
  };
  REQUIRE(set.ep().is_member());
  CHECK(gather(set.ep()) == set.layout().ep_order);
  CHECK(set.ep().global_rank(set.ep().my_slot()) == me);
  CHECK(gather(set.node_local()) == set.layout().node_groups[static_cast<std::size_t>(set.topology().node_of(me))]);
  if (set.is_relay()) {
    CHECK(gather(set.relay()) == set.layout().relay_groups[static_cast<std::size_t>(set.relay_rail())]);
  }
  CHECK(set.ep().epoch() == set.epoch());
  CHECK(set.node_local().epoch() == set.epoch());
}

}  // namespace

TEST_CASE("hwloc discovery: every rank agrees on hosts and node ids", "[topology][hwloc]") {
  auto const topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD);
  int const size = kmoe_test::world_size();
  REQUIRE(topo.size() == size);
  // The JSON record is identical on every rank.
  auto const mine = topo.to_json(0);
  auto const all = allgather_strings(MPI_COMM_WORLD, mine);
  for (auto const& other : all) CHECK(other == mine);
  // Ranks sharing a host share a node; local ranks enumerate each node.
  for (int r = 0; r < size; ++r) {
    for (int q = 0; q < size; ++q)
      if (topo.rank(r).host == topo.rank(q).host) CHECK(topo.node_of(r) == topo.node_of(q));
  }
  for (int n = 0; n < topo.num_nodes(); ++n) {
    auto const& members = topo.ranks_of_node(n);
    for (std::size_t l = 0; l < members.size(); ++l) CHECK(topo.local_rank_of(members[l]) == static_cast<int>(l));
    CHECK(topo.node_hardware(n).pus > 0);
    CHECK(topo.node_hardware(n).cores > 0);
  }
  CHECK(topo.rank(kmoe_test::world_rank()).bound_pus > 0);
}

TEST_CASE("virtual layouts: 2-rank nodes, node-major order, one relay per node", "[topology][virtual]") {
  int const size = kmoe_test::world_size();
  int const rpn = size % 2 == 0 ? 2 : 1;
  auto topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, virtual_rpn(rpn));
  REQUIRE(topo.num_nodes() == size / rpn);
  CommunicatorSet set(MPI_COMM_WORLD, topo, CommSpec{});
  check_set(set);
  for (int n = 0; n < topo.num_nodes(); ++n) CHECK(set.layout().relays[n] == std::vector<int>{n * rpn});
  std::vector<int> identity(static_cast<std::size_t>(size));
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(set.layout().ep_order == identity);
  CHECK(set.is_relay() == (kmoe_test::world_rank() % rpn == 0));
  if (set.is_relay()) CHECK(set.relay().size() == topo.num_nodes());
  // The table has a header and one line per rank.
  auto const table = set.table();
  CHECK(std::count(table.begin(), table.end(), '\n') == size + 1);
}

TEST_CASE("bad layouts are refused before anything is sized by them", "[topology][errors]") {
  KokkosMoE::Topology::LayoutSpec s;
  s.kind = KokkosMoE::Topology::LayoutKind::virtual_nodes;
  s.node_of_rank = {0, 200000000};
  CHECK_THROWS_WITH(KokkosMoE::Topology::Topology::simulated(2, s), Catch::Matchers::Contains("rank 1 is on node 200000000, but 2 ranks fill at most nodes 0..1"));
  KokkosMoE::Topology::LayoutSpec syn;
  syn.kind = KokkosMoE::Topology::LayoutKind::synthetic;
  syn.ranks_per_node = 1;
  syn.synthetic = "pack:65536 core:65536 pu:65536";
  CHECK_THROWS_WITH(KokkosMoE::Topology::Topology::simulated(1, syn), Catch::Matchers::Contains("describes more than 1048576 objects per node"));
}

TEST_CASE("virtual layouts 2x2, 4x2, uneven 3+1 and rail relays (simulated)", "[topology][virtual]") {
  SECTION("2x2") {
    auto t = KokkosMoE::Topology::Topology::simulated(4, virtual_rpn(2));
    auto L = make_comm_layout(t, CommSpec{});
    CHECK(L.node_groups == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
    CHECK(L.relay_groups == std::vector<std::vector<int>>{{0, 2}});
  }
  SECTION("4x2 with rail relays R = 2") {
    auto t = KokkosMoE::Topology::Topology::simulated(8, virtual_rpn(2));
    CommSpec spec;
    spec.relays_per_node = 2;
    auto L = make_comm_layout(t, spec);
    validate(t, L);
    CHECK(L.relays == std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
    CHECK(L.relay_groups == std::vector<std::vector<int>>{{0, 2, 4, 6}, {1, 3, 5, 7}});
    CHECK(rail_of(t, L, 5) == 1);
    CHECK(relay_for(t, L, 5, 0) == 1);
    CHECK(relay_for(t, L, 4, 3) == 6);
  }
  SECTION("uneven 3+1") {
    LayoutSpec s;
    s.kind = LayoutKind::virtual_nodes;
    s.node_of_rank = {0, 0, 0, 1};
    auto t = KokkosMoE::Topology::Topology::simulated(4, s);
    CHECK(t.ranks_of_node(0) == std::vector<int>{0, 1, 2});
    CHECK(t.min_ranks_per_node() == 1);
    auto L = make_comm_layout(t, CommSpec{});
    validate(t, L);
    CHECK(L.relay_groups == std::vector<std::vector<int>>{{0, 3}});
    CommSpec two;
    two.relays_per_node = 2;
    CHECK_THROWS_WITH(make_comm_layout(t, two), Catch::Matchers::Contains("more than the 1 ranks of the smallest node"));
  }
  SECTION("1024 simulated ranks on 128 nodes, 8 rails") {
    auto t = KokkosMoE::Topology::Topology::simulated(1024, virtual_rpn(8));
    CommSpec spec;
    spec.relays_per_node = 8;
    auto L = make_comm_layout(t, spec);
    validate(t, L);
    CHECK(L.relay_groups.size() == 8);
    CHECK(L.relay_groups[3].size() == 128);
    CHECK(L.relay_groups[3][127] == 127 * 8 + 3);
  }
}

TEST_CASE("explicit peer order [2, 0, 3, 1]: split vectors of dispatch_v17", "[topology][peer-order]") {
  auto const counts = v17_counts();
  std::vector<int> const order = {2, 0, 3, 1};
  // Pure conversion (any rank count).
  CHECK(send_split_in_order(order, counts, 0) == std::vector<std::int64_t>{1, 1, 0, 2});
  CHECK(send_split_in_order(order, counts, 1) == std::vector<std::int64_t>{1, 1, 1, 1});
  CHECK(recv_split_in_order(order, counts, 1) == std::vector<std::int64_t>{0, 2, 0, 1});

  if (kmoe_test::world_size() != 4) return;
  LayoutSpec s;
  s.kind = LayoutKind::virtual_nodes;
  s.nodes = {{0, 1}, {2, 3}};
  auto topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, s);
  CommSpec spec;
  spec.peer_order = order;
  CommunicatorSet set(MPI_COMM_WORLD, topo, spec);
  check_set(set);
  CHECK(set.layout().relays == std::vector<std::vector<int>>{{0}, {2}});
  int const me = kmoe_test::world_rank();
  CHECK(set.ep().my_slot() == static_cast<int>(std::find(order.begin(), order.end(), me) - order.begin()));
  // Move the splits over the EP communicator: what arrives is the receive split.
  auto send = set.ep().send_split(counts, me);
  std::vector<std::int64_t> recv(4);
  MPI_Alltoall(send.data(), 1, MPI_INT64_T, recv.data(), 1, MPI_INT64_T, set.ep().comm());
  CHECK(recv == set.ep().recv_split(counts, me));
  if (me == 0) CHECK(send == std::vector<std::int64_t>{1, 1, 0, 2});
  if (me == 1) {
    CHECK(send == std::vector<std::int64_t>{1, 1, 1, 1});
    CHECK(recv == std::vector<std::int64_t>{0, 2, 0, 1});
  }
}

TEST_CASE("rail relays on real communicators", "[topology][rail]") {
  int const size = kmoe_test::world_size();
  if (size % 2 != 0) return;
  auto topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, virtual_rpn(2));
  CommSpec spec;
  spec.relays_per_node = 2;
  CommunicatorSet set(MPI_COMM_WORLD, topo, spec);
  check_set(set);
  CHECK(set.is_relay());  // every local rank relays its rail
  CHECK(set.relay_rail() == kmoe_test::world_rank() % 2);
  CHECK(set.relay().size() == size / 2);
}

TEST_CASE("synthetic topologies: hwloc XML with GPUs and NICs, synthetic description", "[topology][synthetic]") {
  LayoutSpec s;
  s.kind = LayoutKind::synthetic;
  s.xml_file = kmoe_test::data_path("topology/two_packages_4numa_4gpu_2nic.xml");
  int const size = kmoe_test::world_size();
  s.ranks_per_node = size >= 4 && size % 4 == 0 ? 4 : size;
  auto topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, s);
  auto const& hw = topo.node_hardware(0);
  CHECK(hw.packages == 2);
  CHECK(hw.numa_nodes == 4);
  CHECK(hw.cores == 16);
  REQUIRE(hw.gpus.size() == 4);
  REQUIRE(hw.nics.size() == 2);
  CHECK(hw.gpus[0].name == "cuda0");
  CHECK(hw.gpus[0].package == 0);
  CHECK(hw.gpus[3].package == 1);
  CHECK(hw.nics[1].name == "mlx5_1");
  CHECK(hw.nics[1].package == 1);
  // Emulated binding: contiguous core blocks; GPU and NIC follow the package.
  for (int r = 0; r < topo.size(); ++r) {
    auto const& rec = topo.rank(r);
    if (rec.package >= 0) {
      CHECK(rec.nic == "mlx5_" + std::to_string(rec.package));
      int const gpu = std::stoi(rec.gpu.substr(4));
      CHECK(gpu / 2 == rec.package);
    }
  }
  if (s.ranks_per_node == 4) {
    // 4 ranks on 16 cores: 4 cores each; ranks 0,1 on package 0, 2,3 on 1.
    for (int l = 0; l < 4; ++l) {
      auto const& rec = topo.rank(l);
      CHECK(rec.bound_cores == 4);
      CHECK(rec.package == l / 2);
      CHECK(rec.numa == l);
      CHECK(rec.gpu == "cuda" + std::to_string(l));
    }
    CommSpec spec;
    spec.relay_policy = RelayPolicy::nearest_nic;
    CommunicatorSet set(MPI_COMM_WORLD, topo, spec);
    check_set(set);
  }

  LayoutSpec d;
  d.kind = LayoutKind::synthetic;
  d.synthetic = "pack:2 numa:2 core:4 pu:2";
  d.ranks_per_node = 1;
  auto t2 = KokkosMoE::Topology::Topology::simulated(3, d);
  CHECK(t2.num_nodes() == 3);
  CHECK(t2.node_hardware(2).packages == 2);
  CHECK(t2.node_hardware(2).numa_nodes == 4);
  CHECK(t2.node_hardware(2).pus == 32);
  CHECK(t2.to_json().find("synthetic:pack:2 numa:2 core:4 pu:2") != std::string::npos);
}

TEST_CASE("validation errors reach every rank", "[topology][validation]") {
  int const size = kmoe_test::world_size();
  int const me = kmoe_test::world_rank();

  SECTION("a rank in two nodes") {
    LayoutSpec s;
    s.kind = LayoutKind::virtual_nodes;
    std::vector<int> all(static_cast<std::size_t>(size));
    std::iota(all.begin(), all.end(), 0);
    s.nodes = {all, {size - 1}};
    expect_collective_error([&] { KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, s); },
                            "rank " + std::to_string(size - 1) + " is in two nodes");
  }
  SECTION("a bad synthetic description") {
    LayoutSpec s;
    s.kind = LayoutKind::synthetic;
    s.synthetic = "pack:2 bogus:7";
    s.ranks_per_node = size;
    expect_collective_error([&] { KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, s); }, "cannot parse the synthetic");
  }

  auto const rpn = size >= 2 && size % 2 == 0 ? 2 : size;
  auto topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD, virtual_rpn(rpn));
  auto const good = make_comm_layout(topo, CommSpec{});

  SECTION("peer order of the wrong size") {
    auto L = good;
    L.ep_order.push_back(0);
    expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, L); }, "EP peer order has");
  }
  SECTION("duplicate rank in a peer order") {
    auto L = good;
    L.ep_order.back() = L.ep_order.front();
    if (size > 1) expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, L); }, "appears twice in the EP peer order");
  }
  SECTION("missing rank in a peer order") {
    CommSpec spec;
    spec.peer_order.assign(static_cast<std::size_t>(size), 0);
    std::iota(spec.peer_order.begin(), spec.peer_order.end(), 0);
    spec.peer_order.back() = size;  // out of range: the last rank is missing
    expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, spec); }, "outside [0, ");
  }
  if (topo.num_nodes() >= 2) {
    SECTION("a node-local group crossing nodes") {
      auto L = good;
      std::swap(L.node_groups[0].back(), L.node_groups[1].front());
      expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, L); }, "crosses nodes");
    }
    SECTION("a relay outside its node") {
      auto L = good;
      L.relays[0][0] = topo.ranks_of_node(1).front();
      expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, L); }, "outside its node");
    }
    SECTION("a relay group holding a non-relay") {
      auto L = good;
      L.relay_groups[0][1] = topo.ranks_of_node(1).back();
      expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, L); }, "which is not a relay");
    }
    SECTION("more relays than ranks per node") {
      CommSpec spec;
      spec.relays_per_node = rpn + 1;
      expect_collective_error([&] { CommunicatorSet set(MPI_COMM_WORLD, topo, spec); }, "is more than the");
    }
  }
  SECTION("an epoch that no longer matches a live handle") {
    std::uint64_t old_epoch = 0;
    {
      CommunicatorSet first(MPI_COMM_WORLD, topo, good);
      old_epoch = first.epoch();
    }
    CommunicatorSet second(MPI_COMM_WORLD, topo, good);
    CHECK(second.epoch() > old_epoch);
    expect_collective_error(
        [&] { collective(MPI_COMM_WORLD, "combine", [&] { second.check_epoch(old_epoch, "dispatch handle"); }); },
        "dispatch handle belongs to communicator epoch " + std::to_string(old_epoch));
  }
  (void)me;
}
