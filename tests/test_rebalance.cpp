// Live rebalancing (KokkosMoE_Rebalance.hpp): EPLB on a skewed window of
// loads builds the next generation; after the migration every slot holds its
// logical expert's weights (the same bytes as weights made for the new
// placement directly, SwiGLU and scalar); the new placement balances the
// window better than the old one; a layer rebuilt on it computes the same
// bits as the old one (flat, hierarchical, pooled-wave); bad input is refused
// on every rank with the current weights untouched.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Rebalance.hpp>

#include <sstream>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

namespace {

std::string deck_text(std::string const& algorithm, std::string const& runner, int size) {
  std::ostringstream os;
  os << "[run]\nseed = 91\n"
     << "[model]\nhidden = 16\nexperts = 8\ntop_k = 2\nffn = 12\n"
     << "[tokens]\nper_rank = 10\nsource = \"router\"\n"
     << "[topology]\nlayout = \"virtual\"\nnodes = " << (size >= 2 ? 2 : 1) << "\n"
     << "[placement]\npolicy = \"eplb\"\nphysical_slots = " << 8 + 2 * size << "\n"
     << "[exchange]\nalgorithm = \"" << algorithm << "\"\nwaves = 2\nsender_cf = " << 4 * size << "\nreceiver_cf = " << 8 * size << "\n"
     << "[experts]\nrunner = \"" << runner << "\"\n";
  if (runner == "scalar") os << "scales = [1, 2, 3, 4, 5, 6, 7, 8]\n";
  // Bitwise equality across placements needs GEMMs that round a row
  // independently of the row count: device builds run the portable kernel
  // (a vendor GEMM may pick its kernel by the rows).
  if (runner == "grouped" && !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) os << "kernel = \"portable\"\n";
  return os.str();
}

/// Expert 7 carries most of the load, expert 0 almost none.
std::vector<double> skewed_load() { return {1, 10, 10, 10, 10, 10, 10, 400}; }

PlacementSpec spec_of(LayerDeck const& deck) {
  PlacementSpec spec;
  spec.policy = deck.placement.policy;
  spec.physical_slots = deck.placement.physical_slots;
  spec.groups = deck.placement.groups;
  return spec;
}

}  // namespace

TEST_CASE("rebalancing moves every expert's weights to its new slots", "[rebalance]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Exec exec;
  for (std::string const runner : {"grouped", "scalar"}) {
    INFO(runner << " experts at " << size << " ranks");
    auto const deck = parse_layer_deck("rebalance-test", deck_text("flat", runner, size), size);
    auto const setup = Setup::make_run(deck, MPI_COMM_WORLD);
    auto const weights = Setup::routed_weights<float, MS>(exec, deck, setup, rank, MPI_COMM_WORLD);
    auto r = rebalance_experts(MPI_COMM_WORLD, setup.placement, setup.node_of_rank, weights, skewed_load(), spec_of(deck));
    CHECK(r.placement.generation() == setup.placement.generation() + 1);
    CHECK(r.record.generation == r.placement.generation());
    CHECK(r.placement.num_slots() == deck.placement.physical_slots);
    // The hot expert gets replicas; the window is better balanced.
    int hot = 0;
    for (int s = 0; s < r.placement.num_slots(); ++s) hot += r.placement.slot(s).expert == 7;
    CHECK(hot > 1);
    if (size > 1)
      CHECK(r.record.after.max_over_mean < r.record.before.max_over_mean);
    else
      CHECK(r.record.after.max_over_mean == 1.0);
    // Every slot now holds its logical expert's parameters, bit for bit.
    auto const direct = Setup::routed_weights<float, MS>(exec, deck, r.placement, setup.comms->epoch(), rank, MPI_COMM_WORLD);
    REQUIRE(r.weights.num_slots() == direct.num_slots());
    CHECK(r.weights.slot_expert() == direct.slot_expert());
    auto const got = slot_blobs(r.weights), want = slot_blobs(direct);
    CHECK(got == want);
    if (runner == "grouped") CHECK(r.weights.digests() == direct.digests());
    // Whatever moved between ranks is in the ledger, summed over ranks.
    std::int64_t moved = 0;
    for (auto a : {MigrationAction::same_node_copy, MigrationAction::cross_node_copy}) moved += r.record.ledger.sent_total.bytes_of(a);
    if (size == 1) CHECK(moved == 0);
  }
}

TEST_CASE("a layer rebuilt on the rebalanced placement computes the same bits", "[rebalance][layer]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Exec exec;
  for (std::string const algorithm : {"flat", "hierarchical", "pooled_wave"}) {
    INFO(algorithm << " at " << size << " ranks");
    auto const deck = parse_layer_deck("rebalance-test", deck_text(algorithm, "grouped", size), size);
    auto const setup = Setup::make_run(deck, MPI_COMM_WORLD);
    auto const rw = Setup::router_weight<float, MS>(deck);
    MoELayer<float, Exec, MS> before(setup.config, *setup.comms, setup.placement, rw,
                                     Setup::routed_weights<float, MS>(exec, deck, setup, rank, MPI_COMM_WORLD));
    index_t const T = deck.tokens.per_rank;
    auto const hidden = Setup::hidden_rows<float, MS>(deck, 0, rank * T, T, rank);
    RowMatrix<float, MS> out0("out0", T, deck.model.hidden), out1("out1", T, deck.model.hidden);
    auto const rec0 = before.forward(exec, hidden, out0);
    REQUIRE(rec0.routes.dropped == 0);
    // The window: this step's routes, summed over the ranks.
    std::vector<index_t> global(rec0.expert_counts.size());
    MPI_Allreduce(rec0.expert_counts.data(), global.data(), static_cast<int>(global.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    std::vector<double> window(global.begin(), global.end());
    window[3] += 200;  // and a hot expert, so that the placement changes
    auto r = rebalance_experts(MPI_COMM_WORLD, before.placement(), setup.node_of_rank, before.routed_weights(), window, spec_of(deck));
    MoELayer<float, Exec, MS> after(Setup::layer_config(deck, setup, r.placement), *setup.comms, r.placement, rw, r.weights);
    auto const rec1 = after.forward(exec, hidden, out1);
    CHECK(rec1.routes.dropped == 0);
    auto const h0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out0);
    auto const h1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out1);
    CHECK(kmoe_test::same_bits(h0, h1));
  }
}

TEST_CASE("rebalancing refuses bad input on every rank", "[rebalance][errors]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Exec exec;
  auto const deck = parse_layer_deck("rebalance-test", deck_text("flat", "grouped", size), size);
  auto const setup = Setup::make_run(deck, MPI_COMM_WORLD);
  auto const weights = Setup::routed_weights<float, MS>(exec, deck, setup, rank, MPI_COMM_WORLD);
  auto const digests = weights.digests();
  std::string const short_load = kmoe_test::collective_error_of([&] {
    rebalance_experts(MPI_COMM_WORLD, setup.placement, setup.node_of_rank, weights, std::vector<double>(5, 1.0), spec_of(deck));
  });
  CHECK(short_load.find("5 expert loads for 8 experts") != std::string::npos);
  PlacementSpec contiguous = spec_of(deck);
  contiguous.policy = PlacementPolicy::contiguous;
  std::string const policy = kmoe_test::collective_error_of(
      [&] { rebalance_experts(MPI_COMM_WORLD, setup.placement, setup.node_of_rank, weights, skewed_load(), contiguous); });
  CHECK(policy.find("needs an EPLB placement policy, not contiguous") != std::string::npos);
  // One rank passes the weights of other slots.
  Experts::ExpertWeights<float, MS> wrong("wrong", {0}, deck.model.hidden, deck.model.ffn);
  std::string const slots = kmoe_test::collective_error_of([&] {
    rebalance_experts(MPI_COMM_WORLD, setup.placement, setup.node_of_rank, rank == size - 1 ? wrong : weights, skewed_load(),
                      spec_of(deck));
  });
  CHECK(slots.find("rank " + std::to_string(size - 1) + " holds 1 weight slots") != std::string::npos);
  CHECK(weights.digests() == digests);
}
