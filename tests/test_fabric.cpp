// The emulated fabric and the cost model: messages across an emulated link
// complete no earlier than the model's lower bound (their NIC serves them one
// at a time) with their bytes intact; an intra-node link when one is given;
// layer outputs with emulation equal outputs without, bit for bit, for every
// exchange algorithm; bad fabric decks are refused naming the key; the
// alpha-beta fit and the model's stage prediction against hand-computed
// figures; cost model files with missing fields are refused.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Exchange_CostModel.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_LayerSetup.hpp>

#include <nlohmann/json.hpp>

#include <cstring>
#include <sstream>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

namespace {

std::string deck_text(std::string const& algorithm, std::string const& fabric, int hidden = 16) {
  std::ostringstream os;
  os << "[run]\nseed = 5\n"
     << "[model]\nhidden = " << hidden << "\nexperts = 8\ntop_k = 2\nffn = 24\ndtype = \"fp32\"\npayload = \"fp32\"\nreturn_payload = \"fp32\"\n"
     << "[router]\nscore = \"softmax\"\nnormalize = true\ngemm = \"generic\"\n"
     << "[tokens]\nper_rank = 24\nsource = \"router\"\n"
     << "[topology]\nlayout = \"virtual\"\nnodes = 2\n"
     << "[exchange]\nalgorithm = \"" << algorithm << "\"\nwaves = 2\nsender_cf = 16\nreceiver_cf = 64\n"
     << "[experts]\nrunner = \"grouped\"\n";
  // The runs are compared bit for bit: device builds take the portable
  // kernel, whose rows round independently of the row count.
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) os << "kernel = \"portable\"\n";
  if (!fabric.empty()) os << "[topology.fabric]\n" << fabric;
  return os.str();
}

/// Seconds of ns.
double sec(std::int64_t ns) { return 1e-9 * static_cast<double>(ns); }

}  // namespace

TEST_CASE("emulated link: completion no earlier than the model's lower bound, bytes intact", "[fabric][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const P = comm_size(world), rank = comm_rank(world);
  if (P < 2) return;
  auto const deck = parse_layer_deck("fabric-test", deck_text("flat", "inter_latency_us = 40\ninter_bandwidth_gbps = 1.0\n"), P);
  auto run = Setup::make_run(deck, world);
  auto const& ep = run.comms->ep();
  auto const options = run.config.exchange.transport_options();
  REQUIRE(options.fabric);
  auto const& topo = run.topology;
  auto const& senders = topo.ranks_of_node(0);
  auto const& receivers = topo.ranks_of_node(1);
  int const m = 3;                     // messages from every sender to every receiver
  std::size_t const bytes = 150000;    // each
  std::int64_t const cost = deck.topology.fabric.cost_ns(true, bytes);
  bool const sending = topo.node_of(rank) == 0, receiving = topo.node_of(rank) == 1;
  std::vector<std::vector<unsigned char>> bufs;
  std::vector<Exchange::Impl::Pending> pending;
  auto pattern = [](int from, int to, int msg, std::size_t i) { return static_cast<unsigned char>((from * 31 + to * 7 + msg * 3 + i) & 0xff); };
  MPI_Barrier(world);
  std::int64_t const t0 = Exchange::FabricEmulator::now_ns();
  for (int peer : sending ? receivers : receiving ? senders : std::vector<int>{})
    for (int k = 0; k < m; ++k) {
      bufs.emplace_back(bytes, 0);
      if (sending)
        for (std::size_t i = 0; i < bytes; ++i) bufs.back()[i] = pattern(rank, peer, k, i);
      Exchange::Impl::post(ep, receiving, bufs.back().data(), static_cast<int>(bytes), MPI_BYTE, ep.slot_of(peer), 6990, pending, options);
    }
  Exchange::Impl::wait_all(ep, pending, "fabric test", options);
  std::int64_t const t1 = Exchange::FabricEmulator::now_ns();
  // A sender's own messages leave through its node's one NIC, one at a time.
  if (sending) CHECK(sec(t1 - t0) >= sec(static_cast<std::int64_t>(m * receivers.size()) * cost));
  // Every message of node 0 enters node 1 through its one NIC: the last
  // receive completes no earlier than all of them served after the first post.
  std::int64_t first_post = t0, last_done = t1, earliest = 0, latest = 0;
  if (!sending) first_post = std::numeric_limits<std::int64_t>::max();
  if (!receiving) last_done = 0;
  MPI_Allreduce(&first_post, &earliest, 1, MPI_INT64_T, MPI_MIN, world);
  MPI_Allreduce(&last_done, &latest, 1, MPI_INT64_T, MPI_MAX, world);
  CHECK(sec(latest - earliest) >= sec(static_cast<std::int64_t>(m * senders.size() * receivers.size()) * cost));
  if (receiving) {
    std::size_t b = 0;
    for (int peer : senders)
      for (int k = 0; k < m; ++k, ++b) {
        bool intact = true;
        for (std::size_t i = 0; i < bytes; ++i) intact = intact && bufs[b][i] == pattern(peer, rank, k, i);
        CHECK(intact);
      }
  }
  auto const& st = options.fabric->stats();
  CHECK(st.messages[2] == (sending ? static_cast<std::int64_t>(m * receivers.size()) : 0));
}

TEST_CASE("emulated intra-node link: a message between ranks of one node pays it", "[fabric][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const P = comm_size(world), rank = comm_rank(world);
  if (P < 4) return;
  auto const deck = parse_layer_deck(
      "fabric-test", deck_text("flat", "inter_latency_us = 1\ninter_bandwidth_gbps = 50\nintra_latency_us = 300\nintra_bandwidth_gbps = 2\n"), P);
  auto run = Setup::make_run(deck, world);
  auto const& ep = run.comms->ep();
  auto const options = run.config.exchange.transport_options();
  auto const& node = run.topology.ranks_of_node(run.topology.node_of(rank));
  REQUIRE(node.size() >= 2);
  std::size_t const bytes = 100000;
  std::vector<unsigned char> buf(bytes, static_cast<unsigned char>(rank));
  std::vector<Exchange::Impl::Pending> pending;
  bool const first = rank == node[0], second = rank == node[1];
  MPI_Barrier(world);
  std::int64_t const t0 = Exchange::FabricEmulator::now_ns();
  if (first || second)
    Exchange::Impl::post(ep, second, buf.data(), static_cast<int>(bytes), MPI_BYTE, ep.slot_of(first ? node[1] : node[0]), 6990, pending,
                         options);
  Exchange::Impl::wait_all(ep, pending, "fabric intra test", options);
  std::int64_t const t1 = Exchange::FabricEmulator::now_ns();
  // The send completes no earlier than its port allows after it was posted
  // (after this rank's t0); the receive no earlier than that after the
  // sender posted, which is after the earliest rank's t0 (one host, one clock).
  std::int64_t earliest = 0;
  MPI_Allreduce(&t0, &earliest, 1, MPI_INT64_T, MPI_MIN, world);
  std::int64_t const cost = deck.topology.fabric.cost_ns(false, bytes);
  if (first) CHECK(sec(t1 - t0) >= sec(cost));
  if (second) CHECK(sec(t1 - earliest) >= sec(cost));
  if (second) CHECK(buf[bytes - 1] == static_cast<unsigned char>(node[0]));
}

TEST_CASE("layer outputs with an emulated fabric equal outputs without, bit for bit", "[fabric][mpi]") {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const P = comm_size(world), rank = comm_rank(world);
  for (std::string algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    std::vector<std::vector<float>> outs;
    for (std::string fabric : {std::string(), std::string("inter_latency_us = 30\ninter_bandwidth_gbps = 2\nintra_latency_us = 5\n")}) {
      auto const deck = parse_layer_deck("fabric-test", deck_text(algorithm, fabric), P);
      auto run = Setup::make_run(deck, world);
      CHECK(static_cast<bool>(run.config.exchange.fabric) == !fabric.empty());
      Exec exec;
      auto const router_weight = Setup::router_weight<float, MS>(deck);
      MoELayer<float, Exec, MS> layer(run.config, *run.comms, run.placement, router_weight,
                                      Setup::routed_weights<float, MS>(exec, deck, run, rank, world));
      index_t const T = Setup::tokens_per_rank(deck);
      auto const hidden = Setup::hidden_rows<float, MS>(deck, 0, Setup::first_token(deck, rank), T, rank);
      RowMatrix<float, MS> out("out", T, deck.model.hidden);
      layer.forward(exec, hidden, out);
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
      outs.emplace_back(h.data(), h.data() + h.size());
    }
    INFO(algorithm);
    REQUIRE(outs[0].size() == outs[1].size());
    CHECK(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("the ledger counts the messages an exchange posts", "[fabric][mpi]") {
  // The emulated fabric counts every message a rank posts to another rank,
  // per link (the intra-node link is emulated here too); the ledger's
  // messages of that class plus one count message per peer of the class in
  // each counted stage must be exactly that, for narrow rows (runs packed
  // into one message) and wide ones (runs of 16 KiB rows and more sent one
  // by one), so the cost model prices the messages that really move.
  MPI_Comm const world = MPI_COMM_WORLD;
  int const P = comm_size(world), rank = comm_rank(world);
  for (std::string algorithm : {"flat", "hierarchical", "pooled_wave"})
    for (int hidden : {16, 4096}) {
      INFO(algorithm << " hidden " << hidden << " np " << P);
      auto const deck = parse_layer_deck(
          "fabric-test", deck_text(algorithm, "inter_latency_us = 1\ninter_bandwidth_gbps = 100\nintra_latency_us = 1\n", hidden), P);
      auto run = Setup::make_run(deck, world);
      REQUIRE(run.config.exchange.fabric);
      Exec exec;
      MoELayer<float, Exec, MS> layer(run.config, *run.comms, run.placement, Setup::router_weight<float, MS>(deck),
                                      Setup::routed_weights<float, MS>(exec, deck, run, rank, world));
      index_t const T = Setup::tokens_per_rank(deck);
      auto const x = Setup::hidden_rows<float, MS>(deck, 0, Setup::first_token(deck, rank), T, rank);
      RowMatrix<float, MS> out("out", T, deck.model.hidden);
      auto const before = run.config.exchange.fabric->stats().messages;
      auto const rec = layer.forward(exec, x, out);
      auto const after = run.config.exchange.fabric->stats().messages;
      for (auto [link, cls] : {std::pair{Exchange::FabricLink::intra, Exchange::LinkClass::intra_node},
                               std::pair{Exchange::FabricLink::inter, Exchange::LinkClass::inter_node}}) {
        bool const inter = link == Exchange::FabricLink::inter;
        INFO((inter ? "inter-node" : "intra-node"));
        std::int64_t const sent = after[static_cast<std::size_t>(link)] - before[static_cast<std::size_t>(link)];
        std::int64_t expected = 0;
        for (auto const* d : {&rec.ledger.dispatch, &rec.ledger.combine})
          for (auto const& st : d->stages) {
            expected += st.by_class[static_cast<int>(cls)].messages;
            if (algorithm == "pooled_wave") continue;  // static shapes: no count messages
            auto rounds = st.extra_count_rounds;
            rounds.push_back(st.communicator);
            for (auto const& c : rounds) {
              auto const peers = Exchange::count_message_peers(c, rank, run.topology, run.comms->layout());
              expected += inter ? peers.second : peers.first;
            }
          }
        CHECK(sent == expected);
        std::int64_t all = 0;  // not every rank sends across nodes (hierarchical: relays only)
        MPI_Allreduce(&sent, &all, 1, MPI_INT64_T, MPI_SUM, world);
        if (P > 2 || (inter && P > 1)) CHECK(all > 0);
      }
    }
}

TEST_CASE("fabric decks: bad values are refused naming the key", "[fabric][deck]") {
  auto refused = [](std::string const& fabric, std::string const& extra, std::string const& message) {
    INFO(fabric << extra);
    CHECK_THROWS_WITH(parse_layer_deck("d.toml", deck_text("flat", fabric) + extra, 4), Catch::Matchers::Contains(message));
  };
  refused("inter_latency_us = 20\n", "", "inter_bandwidth_gbps");
  refused("inter_bandwidth_gbps = 0\n", "", "topology.fabric.inter_bandwidth_gbps");
  refused("inter_bandwidth_gbps = 5\ninter_latency_us = -1\n", "", "topology.fabric.inter_latency_us");
  refused("inter_bandwidth_gbps = 5\nnics_per_node = 0\n", "", "topology.fabric.nics_per_node");
  refused("inter_bandwidth_gbps = 5\nlatency = 3\n", "", "latency");
  auto const ok = parse_layer_deck("d.toml", deck_text("flat", "inter_bandwidth_gbps = 5\ninter_latency_us = 20\nnics_per_node = 2\n"), 4);
  CHECK(ok.topology.fabric.enabled());
  CHECK(ok.topology.fabric.nics_per_node == 2);
  // The resolved deck reads back to the same fabric.
  auto const again = parse_layer_deck("r.toml", ok.resolved(), 4);
  CHECK(again.topology.fabric.inter_latency_us == 20.0);
  CHECK(again.topology.fabric.inter_bandwidth_gbps == 5.0);
  CHECK(again.topology.fabric.nics_per_node == 2);
}

TEST_CASE("cost model: alpha-beta fit, stage prediction, files", "[fabric][model]") {
  // Points on t = 3 us + bytes / 2 GB/s are fitted exactly.
  std::vector<std::pair<double, double>> pts;
  for (double b : {8.0, 4096.0, 65536.0, 1048576.0}) pts.push_back({b, 3e-6 + b * 0.5e-9});
  auto const l = Exchange::fit_alpha_beta(pts);
  CHECK(l.alpha_s == Approx(3e-6).epsilon(1e-6));
  CHECK(l.beta_s_per_byte == Approx(0.5e-9).epsilon(1e-6));

  // Two nodes of two ranks; flat exchange ledgers by hand: every rank sends
  // 100 rows of 1000 B (+ 8 B metadata) to each of the other three ranks.
  Topology::LayoutSpec spec;
  spec.kind = Topology::LayoutKind::virtual_nodes;
  spec.node_of_rank = {0, 0, 1, 1};
  auto const topo = Topology::Topology::simulated(4, spec);
  auto const layout = Topology::make_comm_layout(topo, Topology::CommSpec{});
  std::vector<Exchange::ByteLedger> ledgers(4);
  for (int r = 0; r < 4; ++r) {
    auto& L = ledgers[static_cast<std::size_t>(r)];
    L.algorithm = "flat";
    L.row_bytes = 1000;
    L.meta_row_bytes = 8;
    L.dispatch.useful_rows = 300;  // rows arriving at this rank (decoded there)
    Exchange::StageLedger st{"all-to-all", "kmoe-ep"};
    auto& intra = st.by_class[1];
    auto& inter = st.by_class[2];
    intra = {100, 100000, 800, 2};  // messages: payload and metadata
    inter = {200, 200000, 1600, 4};
    L.dispatch.stages.push_back(st);
  }
  Exchange::CostModel model;
  model.same_rank = {0.0, 0.1e-9};
  model.intra_node = {2e-6, 0.2e-9};
  model.inter_node = {2e-6, 0.2e-9};
  model.nic = {20e-6, 0.2e-9};  // 5 GB/s
  model.encode_s_per_byte = 0.1e-9;
  model.decode_s_per_byte = 0.05e-9;
  model.return_encode_s_per_byte = 0.3e-9;
  model.stage_s = 10e-6;
  auto const p = Exchange::predict(model, topo, layout, ledgers);
  // Rank: intra 1 pair x 2 messages + 1 count message, inter 2 pairs x 2 + 2 counts.
  double const rank_t = (3 * 2e-6 + 100800 * 0.2e-9) + (6 * 2e-6 + 201600 * 0.2e-9);
  // NIC of a node: its two ranks' inter-node messages.
  double const nic_t = 2 * (6 * 20e-6 + 201600 * 0.2e-9);
  // Encoded: what the rank sends; decoded: its 300 useful rows of 1008 B.
  double const copy_t = (100800 + 201600) * 0.1e-9 + 300 * 1008 * 0.05e-9;
  REQUIRE(p.dispatch.stages.size() == 1);
  CHECK(p.dispatch.stages[0].seconds == Approx(10e-6 + copy_t + std::max(rank_t, nic_t)));
  CHECK(nic_t > rank_t);
  {
    // Rows that land straight in their expert rows take no decode pass.
    auto in_place = ledgers;
    for (auto& L : in_place) L.dispatch.rows_in_place = true;
    CHECK(Exchange::predict(model, topo, layout, in_place).dispatch.stages[0].seconds ==
          Approx(10e-6 + (100800 + 201600) * 0.1e-9 + std::max(rank_t, nic_t)));
  }
  // The combine encodes every expert output row the rank holds (its
  // dispatch's 300 useful rows), even when its first stage sends fewer
  // (a relay gather that moves 50 rows of 1000 B to one node peer).
  {
    auto with_combine = ledgers;
    for (auto& L : with_combine) {
      L.combine_row_bytes = 1000;
      Exchange::StageLedger c{"relay gather", "kmoe-node"};
      c.by_class[1] = {50, 50000, 0, 1};
      L.combine.stages.push_back(c);
    }
    auto const pc = Exchange::predict(model, topo, layout, with_combine);
    REQUIRE(pc.combine.stages.size() == 1);
    double const rank_c = 2 * 2e-6 + 50000 * 0.2e-9;  // one pair (no metadata) + one count message
    CHECK(pc.combine.stages[0].seconds == Approx(10e-6 + 300 * 1000 * 0.3e-9 + rank_c));
    // Results sent from the expert rows themselves take no encode pass.
    for (auto& L : with_combine) L.combine.rows_in_place = true;
    CHECK(Exchange::predict(model, topo, layout, with_combine).combine.stages[0].seconds == Approx(10e-6 + rank_c));
  }
  {
    // Every pooled-wave wave packs what it sends; the last decodes the
    // direction's useful rows. Static shapes: no count messages.
    auto waves = ledgers;
    for (auto& L : waves) {
      L.algorithm = "pooled_wave";
      L.dispatch.stages.push_back(L.dispatch.stages[0]);
    }
    auto const pw = Exchange::predict(model, topo, layout, waves);
    REQUIRE(pw.dispatch.stages.size() == 2);
    double const rank_w = (2 * 2e-6 + 100800 * 0.2e-9) + (4 * 2e-6 + 201600 * 0.2e-9);
    double const nic_w = 2 * (4 * 20e-6 + 201600 * 0.2e-9);
    double const pack_w = (100800 + 201600) * 0.1e-9;
    CHECK(pw.dispatch.stages[0].seconds == Approx(10e-6 + pack_w + std::max(rank_w, nic_w)));
    CHECK(pw.dispatch.stages[1].seconds == Approx(10e-6 + pack_w + 300 * 1008 * 0.05e-9 + std::max(rank_w, nic_w)));
  }
  // Two NICs per node: each serves one rank.
  model.nics_per_node = 2;
  CHECK(Exchange::predict(model, topo, layout, ledgers).dispatch.stages[0].seconds == Approx(10e-6 + copy_t + std::max(rank_t, nic_t / 2)));

  // A file round trip, and files that are not cost models.
  model.evidence = "measured";
  model.samples.push_back({"intra_node", 8, 1e-6});
  auto const back = Exchange::CostModel::from_json(model.to_json(), "m.json");
  CHECK(back.nic.alpha_s == model.nic.alpha_s);
  CHECK(back.nics_per_node == 2);
  CHECK(back.samples.size() == 1);
  CHECK(back.return_encode_s_per_byte == model.return_encode_s_per_byte);
  {
    // A file written before the return pack was calibrated on its own
    // prices it like the pack.
    auto older = nlohmann::json::parse(model.to_json());
    older.erase("return_encode_s_per_byte");
    CHECK(Exchange::CostModel::from_json(older.dump(), "old.json").return_encode_s_per_byte == model.encode_s_per_byte);
    older["return_encode_s_per_byte"] = -1.0;
    CHECK_THROWS_WITH(Exchange::CostModel::from_json(older.dump(), "old.json"), Catch::Matchers::Contains("return_encode_s_per_byte"));
  }
  CHECK_THROWS_WITH(Exchange::CostModel::from_json("{", "m.json"), Catch::Matchers::Contains("m.json: not a JSON cost model"));
  CHECK_THROWS_WITH(Exchange::CostModel::from_json("{\"format\": \"other\"}", "m.json"), Catch::Matchers::Contains("not a KokkosMoE cost model"));
  std::string broken = model.to_json();
  broken.replace(broken.find("\"stage_s\""), 9, "\"stage_x\"");
  CHECK_THROWS_WITH(Exchange::CostModel::from_json(broken, "m.json"), Catch::Matchers::Contains("stage_s"));
  // A stated fabric: its NIC, nothing else.
  Exchange::FabricSpec f;
  f.inter_latency_us = 50;
  f.inter_bandwidth_gbps = 10;
  auto const stated = Exchange::CostModel::stated(f);
  CHECK(stated.nic.alpha_s == Approx(50e-6));
  CHECK(stated.nic.beta_s_per_byte == Approx(0.1e-9));
  CHECK(stated.evidence == "stated");
}
