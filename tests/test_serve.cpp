// Serving mode: a decode bucket replays admitted steps on its fixed buffers
// with the ordinary path's bits; the admission predicate refuses, in its
// documented order, prefill rows, a stale key, too many tokens on a rank,
// too many routes on a slot and released buffers, and the refused step runs
// every row and route unchanged; padding never reaches an expert; mixed
// batches split by phase and sum their units.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_AllocationLog.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Serve.hpp>

#include <sstream>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

namespace {

std::string deck_text(int size, int shared) {
  std::ostringstream os;
  os << "[run]\nseed = 5\n"
     << "[model]\nhidden = 3\nexperts = 6\ntop_k = 2\nffn = 4\nshared_experts = " << shared << "\nshared_ffn = 4\n"
     << "[router]\nscore = \"softmax\"\ngemm = \"generic\"\n"
     << "[tokens]\nper_rank = 4\n"
     << "[topology]\nlayout = \"virtual\"\nnodes = " << (size % 2 == 0 ? 2 : 1) << "\n"
     << "[experts]\nrunner = \"grouped\"\n";
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) os << "kernel = \"portable\"\n";
  return os.str();
}

struct Parts {
  LayerDeck deck;
  Setup::Run run;
  std::unique_ptr<MoELayer<float, Exec, MS>> layer;
  explicit Parts(int shared = 0)
      : deck(parse_layer_deck("serve-test", deck_text(kmoe_test::world_size(), shared), kmoe_test::world_size())),
        run(Setup::make_run(deck, MPI_COMM_WORLD)), layer(on_generation(0)) {}
  /// The deck's layer on the run's communicators, placement generation g.
  std::unique_ptr<MoELayer<float, Exec, MS>> on_generation(std::uint64_t g) const {
    Exec exec;
    auto l = std::make_unique<MoELayer<float, Exec, MS>>(
        run.config, *run.comms, run.placement.with_generation(g), Setup::router_weight<float, MS>(deck),
        Setup::routed_weights<float, MS>(exec, deck, run, kmoe_test::world_rank(), MPI_COMM_WORLD), Setup::shared_weights<float, MS>(exec, deck));
    l->set_checkpoint("seed:5");
    return l;
  }
};

RowMatrix<float, MS> rows_of(index_t n, int rank, int salt = 0) {
  RowMatrix<float, MS> x("hidden", n, 3);
  auto h = Kokkos::create_mirror_view(x);
  for (index_t t = 0; t < n; ++t)
    for (int c = 0; c < 3; ++c) h(t, c) = 0.25f * static_cast<float>((rank * 7 + t * 3 + c + salt) % 11) - 1.0f;
  Kokkos::deep_copy(x, h);
  return x;
}

/// Routes [n, 2] with the given experts, gates 0.75 / 0.25, all accepted.
RouteTable<MS> table_of(std::vector<std::pair<int, int>> const& experts) {
  auto const n = static_cast<index_t>(experts.size());
  RouteTable<MS> t("routes", n, 2, 6);
  auto e = Kokkos::create_mirror_view(t.expert);
  auto g = Kokkos::create_mirror_view(t.gate);
  auto a = Kokkos::create_mirror_view(t.accepted);
  auto c = Kokkos::create_mirror_view(t.expert_counts);
  Kokkos::deep_copy(c, 0);
  for (index_t i = 0; i < n; ++i) {
    e(i, 0) = experts[static_cast<std::size_t>(i)].first;
    e(i, 1) = experts[static_cast<std::size_t>(i)].second;
    g(i, 0) = 0.75f;
    g(i, 1) = 0.25f;
    a(i, 0) = a(i, 1) = 1;
    ++c(e(i, 0));
    ++c(e(i, 1));
  }
  Kokkos::deep_copy(t.expert, e);
  Kokkos::deep_copy(t.gate, g);
  Kokkos::deep_copy(t.accepted, a);
  Kokkos::deep_copy(t.expert_counts, c);
  t.counts = {2 * n, 2 * n, 0};
  return t;
}

std::vector<float> host(RowMatrix<float, MS> const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.size());
}

/// Every rank's expert counts of a step summed (what reached each logical expert).
std::vector<index_t> experts_reached(StepRecord const& rec) {
  std::vector<index_t> sum(rec.expert_counts.size());
  MPI_Allreduce(rec.expert_counts.data(), sum.data(), static_cast<int>(sum.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return sum;
}

/// The example's routes of rank r: ranks contribute [3, 2, 0, 0] rows at 4
/// ranks (every slot gets at most 2 routes); other rank counts one row per
/// rank on two experts that depend on the rank.
std::vector<std::pair<int, int>> example_routes(int rank, int size) {
  if (size == 4) {
    if (rank == 0) return {{0, 1}, {2, 3}, {4, 5}};
    if (rank == 1) return {{0, 2}, {1, 3}};
    return {};
  }
  return {{rank % 6, (rank + 1) % 6}};
}

}  // namespace

TEST_CASE("an admitted decode step replays on the bucket with the ordinary path's bits; padding reaches no expert", "[serve]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Parts p;
  Exec exec;
  DecodeBucket<float, Exec, MS> bucket(*p.layer, BucketConfig{4, size == 4 ? 2 : 2 * size});
  auto const routes = example_routes(rank, size);
  auto const n = static_cast<index_t>(routes.size());
  auto const table = table_of(routes);
  auto const x = rows_of(n, rank);
  RowMatrix<float, MS> out("out", n, 3), ref("ref", n, 3);
  auto const rec = bucket.step_routes(exec, *p.layer, x, table, out, Phase::decode);
  INFO(rec.why);
  REQUIRE(rec.replayed);
  CHECK(rec.refusal == Refusal::none);
  index_t const useful = size == 4 ? 5 : size;
  CHECK(rec.counts.useful_tokens == useful);
  CHECK(rec.counts.executed_tokens == 4 * size);
  CHECK(rec.counts.padding_tokens == 4 * size - useful);
  CHECK(rec.counts.routes == 2 * useful);
  // Padding never reaches an expert: the experts' rows are the valid routes.
  CHECK(rec.counts.useful_rows == 2 * useful);
  auto const reached = experts_reached(rec.step);
  index_t total = 0;
  for (auto v : reached) total += v;
  CHECK(total == 2 * useful);
  if (size == 4) {
    CHECK(rec.rank_tokens == std::vector<index_t>{3, 2, 0, 0});
    CHECK(rec.rank_offsets == std::vector<index_t>{0, 3, 5, 5});
    // Six physical slots (no replicas), at most two routes each.
    REQUIRE(rec.slot_routes.size() == 6);
    std::vector<index_t> per_expert(6, 0);
    for (int s = 0; s < 6; ++s) per_expert[static_cast<std::size_t>(p.layer->placement().slot(s).expert)] += rec.slot_routes[static_cast<std::size_t>(s)];
    CHECK(per_expert == std::vector<index_t>{2, 2, 2, 2, 1, 1});
    CHECK(reached == std::vector<index_t>{2, 2, 2, 2, 1, 1});
  }
  // The ordinary path on the same rows and routes: the same bits.
  p.layer->forward_routes(exec, x, table, ref);
  CHECK(kmoe_test::same_bits(host(out), host(ref)));
  // Replayed again: the same bits, and no buffer moves (no Kokkos
  // allocation anywhere in the step: bucket, layer, exchange, experts).
  RowMatrix<float, MS> again("again", n, 3);
  ServeRecord rec2;
  std::string allocated;
  auto const held_before = bucket.step_ledger(*p.layer);
  {
    AllocationLog log;
    rec2 = bucket.step_routes(exec, *p.layer, x, table, again, Phase::decode);
    allocated = log.text();
  }
  INFO(allocated);
  CHECK(allocated.empty());
  CHECK(rec2.replayed);
  // The step's ledger: the bucket's buffers, then the layer's reused ones
  // (the exchange's among them), unchanged by the replay.
  auto const held_after = bucket.step_ledger(*p.layer);
  REQUIRE(held_after.size() == held_before.size());
  std::int64_t exchange_bytes = 0;
  for (std::size_t i = 0; i < held_after.size(); ++i) {
    CHECK(held_after[i].name == held_before[i].name);
    CHECK(held_after[i].bytes == held_before[i].bytes);
    if (held_after[i].name.rfind("layer:exchange_", 0) == 0) exchange_bytes += held_after[i].bytes;
  }
  CHECK(held_after[0].name == "hidden");
  CHECK(exchange_bytes > 0);
  CHECK(kmoe_test::same_bits(host(out), host(again)));
  // The reserved payload is the fixed buffers', named.
  auto const ledger = bucket.ledger();
  REQUIRE(ledger.size() == 7);
  CHECK(ledger[0].name == "hidden");
  CHECK(ledger[0].bytes == 4 * 3 * 4);
  CHECK(bucket.reserved_bytes() > 0);
}

TEST_CASE("a refused decode step runs every row and route on the ordinary path and says why", "[serve]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Parts p;
  Exec exec;
  DecodeBucket<float, Exec, MS> bucket(*p.layer, BucketConfig{4, 2});
  SECTION("rank token capacity") {
    // [5, 4, 2, 0] at 4 ranks (rank 0 over capacity); other counts: rank 0 has 5.
    std::vector<index_t> const rows4{5, 4, 2, 0};
    index_t const n = size == 4 ? rows4[static_cast<std::size_t>(rank)] : (rank == 0 ? 5 : 1);
    std::vector<std::pair<int, int>> routes;
    for (index_t t = 0; t < n; ++t) routes.push_back({static_cast<int>((t + rank) % 6), static_cast<int>((t + rank + 3) % 6)});
    auto const table = table_of(routes);
    auto const x = rows_of(n, rank);
    RowMatrix<float, MS> out("out", n, 3), ref("ref", n, 3);
    auto const rec = bucket.step_routes(exec, *p.layer, x, table, out, Phase::decode);
    CHECK_FALSE(rec.replayed);
    CHECK(rec.refusal == Refusal::rank_token_capacity_exceeded);
    CHECK(rec.why.find("rank 0 has 5 tokens, capacity 4") != std::string::npos);
    index_t const all = size == 4 ? 11 : 5 + (size - 1);
    CHECK(rec.counts.useful_tokens == all);
    CHECK(rec.counts.executed_tokens == all);
    CHECK(rec.counts.routes == 2 * all);
    CHECK(rec.counts.useful_rows == 2 * all);
    CHECK(rec.step.routes.dropped == 0);
    p.layer->forward_routes(exec, x, table, ref);
    CHECK(kmoe_test::same_bits(host(out), host(ref)));
  }
  SECTION("slot route capacity") {
    // Three ranks' rows (or one rank's three rows) all on expert 0.
    index_t const n = size >= 3 ? (rank < 3 ? 1 : 0) : (rank == 0 ? 3 : 0);
    std::vector<std::pair<int, int>> routes(static_cast<std::size_t>(n), {0, 1});
    auto const table = table_of(routes);
    auto const x = rows_of(n, rank);
    RowMatrix<float, MS> out("out", n, 3);
    auto const rec = bucket.step_routes(exec, *p.layer, x, table, out, Phase::decode);
    CHECK(rec.refusal == Refusal::expert_route_capacity_exceeded);
    CHECK(rec.why.find("(expert 0) gets 3 routes, capacity 2") != std::string::npos);
    CHECK(rec.counts.routes == 6);
  }
  SECTION("prefill rows, then the order of the refusals") {
    index_t const n = 5;  // over the token capacity too: the phase is named first
    auto const x = rows_of(n, rank);
    RowMatrix<float, MS> out("out", n, 3);
    auto const rec = bucket.step(exec, *p.layer, x, out, Phase::prefill);
    CHECK(rec.refusal == Refusal::phase_not_decode);
    CHECK(rec.counts.useful_tokens == n * size);
  }
  SECTION("released buffers") {
    bucket.release();
    index_t const n = rank == 0 ? 1 : 0;
    auto const x = rows_of(n, rank);
    RowMatrix<float, MS> out("out", n, 3);
    CHECK(bucket.step(exec, *p.layer, x, out, Phase::decode).refusal == Refusal::stable_buffer_unavailable);
    bucket.reserve();
    CHECK(bucket.step(exec, *p.layer, x, out, Phase::decode).replayed);
  }
}

TEST_CASE("a new placement generation invalidates the bucket's key", "[serve]") {
  int const rank = kmoe_test::world_rank();
  Parts p;
  auto next = p.on_generation(1);
  Exec exec;
  DecodeBucket<float, Exec, MS> bucket(*p.layer, BucketConfig{4, 64});
  auto const x = rows_of(2, rank);
  RowMatrix<float, MS> out("out", 2, 3), ref("ref", 2, 3);
  auto const rec = bucket.step(exec, *next, x, out, Phase::decode);
  CHECK(rec.refusal == Refusal::graph_key_mismatch);
  CHECK(rec.why.find("placement_generation: bucket 0, layer 1") != std::string::npos);
  next->forward(exec, x, ref);
  CHECK(kmoe_test::same_bits(host(out), host(ref)));
  bucket.rebind(*next);
  CHECK(bucket.step(exec, *next, x, out, Phase::decode).replayed);
  CHECK(kmoe_test::same_bits(host(out), host(ref)));
}

TEST_CASE("a mixed batch splits by phase; its units sum; every row gets the ordinary path's output", "[serve]") {
  int const size = kmoe_test::world_size(), rank = kmoe_test::world_rank();
  Parts p(1);
  Exec exec;
  DecodeBucket<float, Exec, MS> bucket(*p.layer, BucketConfig{4, 64});
  index_t const n = 6;
  std::vector<Phase> phase{Phase::prefill, Phase::decode, Phase::decode, Phase::prefill, Phase::decode, Phase::prefill};
  auto const x = rows_of(n, rank, 1);
  RowMatrix<float, MS> out("out", n, 3), ref("ref", n, 3);
  auto const m = bucket.serve(exec, *p.layer, x, out, phase);
  REQUIRE(m.units.size() == 2);
  CHECK(m.units[0].phase == Phase::prefill);
  CHECK(m.units[0].refusal == Refusal::phase_not_decode);
  CHECK(m.units[1].replayed);
  CHECK(m.units[0].counts.useful_tokens == 3 * size);
  CHECK(m.units[1].counts.useful_tokens == 3 * size);
  CHECK(m.units[1].counts.executed_tokens == 4 * size);
  CHECK(m.total.useful_tokens == 6 * size);
  CHECK(m.total.executed_tokens == 7 * size);
  CHECK(m.total.routes == 12 * size);
  // Routing and the experts treat each row alone (generic router GEMM,
  // grouped runner, dropless): the batch's outputs are the whole batch's
  // ordinary forward, bit for bit.
  p.layer->forward(exec, x, ref);
  CHECK(kmoe_test::same_bits(host(out), host(ref)));
  std::vector<Phase> short_phase(2, Phase::decode);
  CHECK_THROWS_WITH(bucket.serve(exec, *p.layer, x, out, short_phase), Catch::Matchers::Contains("2 phases for 6 rows"));
}

TEST_CASE("bad bucket capacities and dropping routers are errors on every rank", "[serve]") {
  Parts p;
  CHECK_THROWS_WITH((DecodeBucket<float, Exec, MS>(*p.layer, BucketConfig{0, 2})),
                    Catch::Matchers::Contains("rank token capacity 0 must be >= 1"));
  CHECK_THROWS_WITH((DecodeBucket<float, Exec, MS>(*p.layer, BucketConfig{2, 0})),
                    Catch::Matchers::Contains("slot route capacity 0 must be >= 1"));
}
