// TOML decks: values and defaults, located errors for unknown keys, wrong
// types, out-of-range values and inconsistent settings, the shipped decks,
// and the resolved echo parsing back to the same configuration.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_LayerSetup.hpp>

#include <fstream>
#include <sstream>

using namespace KokkosMoE;

namespace {
std::string read(std::string const& path) {
  std::ifstream in(path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}
#define KMOE_DECK_ERROR(text, ranks, message) \
  CHECK_THROWS_WITH(parse_layer_deck("d.toml", text, ranks), Catch::Matchers::Contains(message))
}  // namespace

TEST_CASE("defaults and values", "[deck]") {
  auto const d = parse_layer_deck("d.toml", "", 4);
  CHECK(d.experts.kernel == Experts::GroupedKernel::automatic);
  CHECK(d.experts.decode_rows == -1);
  auto const e = parse_layer_deck("d.toml", "[experts]\nkernel = \"portable\"\ndecode_rows = 0\n", 1);
  CHECK(e.experts.kernel == Experts::GroupedKernel::portable);
  CHECK(e.experts.decode_rows == 0);
  CHECK(d.train.products == "fp32");
  auto const t = parse_layer_deck("d.toml", "[run]\nmode = \"train\"\n[train]\nproducts = \"bf16\"\n", 1);
  CHECK(t.train.products == "bf16");
  CHECK(Setup::layer_config(t, Placement::contiguous(8, 1)).backward_products == Experts::BackwardProducts::bf16);
  CHECK(d.model.experts == 8);
  CHECK(d.model.top_k == 2);
  CHECK(d.exchange.algorithm == Exchange::Algorithm::flat);
  CHECK(d.exchange.transport == Exchange::TransportKind::mpi);
  CHECK(d.topology.ranks_per_node == 4);
  CHECK(d.router.num_experts == 8);
  auto const v = parse_layer_deck("d.toml", R"(
[model]
experts = 16
top_k = 4
payload = "fp8_block128"
[router]
score = "sigmoid"
groups = 4
topk_groups = 2
group_score = "top2_sum"
route_scale = 2.5
[topology]
nodes = 3
relays_per_node = 1
peer_order = [3, 2, 1, 0, 5, 4]
[exchange]
algorithm = "pooled_wave"
waves = 3
)",
                                  6);
  CHECK(v.router.group_score == SetScore::top_m_sum);
  CHECK(v.router.group_top_m == 2);
  CHECK(v.router.normalize);  // sigmoid scores are normalized unless told otherwise
  CHECK(v.model.payload == PayloadType::fp8_block128);
  CHECK(v.topology.node_of_rank == std::vector<int>{0, 0, 1, 1, 2, 2});
  CHECK(v.exchange.waves == 3);
}

TEST_CASE("errors name file, line, column and key", "[deck]") {
  KMOE_DECK_ERROR("[model]\nhiden = 3\n", 1, "d.toml:2:1: unknown key 'model.hiden'");
  KMOE_DECK_ERROR("[modle]\nhidden = 3\n", 1, "unknown key 'modle.hidden'");
  KMOE_DECK_ERROR("[model]\nexperts = 2.5\n", 1, "d.toml:2:11: key 'model.experts': expected an integer, got a float");
  KMOE_DECK_ERROR("[model]\ntop_k = 0\n", 1, "key 'model.top_k': = 0 is out of range");
  KMOE_DECK_ERROR("[model]\nexperts = 3\ntop_k = 4\n", 1, "d.toml:3:9: key 'model.top_k': = 4 exceeds model.experts = 3");
  KMOE_DECK_ERROR("[router]\ngroups = 3\n", 1, "key 'router.groups': = 3 does not divide model.experts = 8");
  KMOE_DECK_ERROR("[router]\ngroups = 4\ntopk_groups = 5\n", 1, "key 'router.topk_groups': = 5 exceeds router.groups = 4");
  KMOE_DECK_ERROR("[model]\ntop_k = 3\n[router]\ngroups = 4\ntopk_groups = 1\n", 1, "exceeds the 2 experts of router.topk_groups = 1 groups");
  KMOE_DECK_ERROR("[exchange]\nalgorithm = \"ring\"\n", 1, "key 'exchange.algorithm': 'ring' is not one of 'flat' 'hierarchical' 'pooled_wave'");
  KMOE_DECK_ERROR("[topology]\nranks_per_node = 3\n", 4, "key 'topology.ranks_per_node': = 3 does not divide the 4 ranks");
  KMOE_DECK_ERROR("[topology]\nranks_per_node = 2\nrelays_per_node = 3\n", 4, "is more than the 2 ranks of the smallest node");
  KMOE_DECK_ERROR("[topology]\npeer_order = [0, 0]\n", 2, "key 'topology.peer_order': lists rank 0 twice");
  KMOE_DECK_ERROR("[router]\ncapacity_factor = -1\n", 1, "key 'router.capacity_factor': = -1 is out of range (must be > 0)");
  KMOE_DECK_ERROR("[router]\nbias_update = \"sign\"\n", 1, "needs router.correction_bias = true");
  KMOE_DECK_ERROR("[placement]\npolicy = \"explicit\"\n", 1, "an explicit placement needs [[placement.slots]]");
  KMOE_DECK_ERROR("[model]\nexperts = 4\n[placement]\npolicy = \"eplb\"\nphysical_slots = 6\n", 4, "is not a multiple of the 4 ranks");
  KMOE_DECK_ERROR("[tokens]\nsource = \"explicit\"\n", 2, "explicit tokens are given for 0 ranks, the run has 2");
  KMOE_DECK_ERROR("[model\n", 1, "d.toml:1:");
  KMOE_DECK_ERROR("[experts]\nrunner = \"scalar\"\nscales = [1, 2]\n", 1, "key 'experts.scales': has 2 entries for 8 experts");
  KMOE_DECK_ERROR("[exchange]\ntransport = \"ucx\"\n", 1, "d.toml:2:13: key 'exchange.transport': 'ucx' is not one of 'mpi' 'nccl'");
  KMOE_DECK_ERROR("[run]\ncompare = [\"flat\", \"ring\"]\n", 1, "key 'run.compare': 'ring' is not one of 'flat' 'hierarchical' 'pooled_wave'");
  KMOE_DECK_ERROR("[run]\nschedule = \"async\"\n", 1, "key 'run.schedule': 'async' is not one of 'serial' 'shared_overlap' 'chunked' 'chunked_shared_overlap'");
  KMOE_DECK_ERROR("[run]\nchunks = 4\n", 1, "key 'run.chunks': = 4 needs a chunked schedule (run.schedule is 'serial'");
  KMOE_DECK_ERROR("[run]\nschedule = \"chunked\"\nchunks = 0\n", 1, "key 'run.chunks'");
  KMOE_DECK_ERROR("[experts]\nrunner = \"padded\"\nalignment = 2147483647\n", 1, "key 'experts.alignment': = 2147483647 is out of range");
  KMOE_DECK_ERROR("[experts]\ndecode_rows = 9\n", 1, "d.toml:2:15: key 'experts.decode_rows': = 9 is out of range");
  KMOE_DECK_ERROR("[experts]\nkernel = \"cuda\"\n", 1, "key 'experts.kernel': 'cuda' is not one of 'auto' 'host_simd' 'portable' 'vendor'");
  KMOE_DECK_ERROR("[train]\nproducts = \"bf16\"\n", 1, "d.toml:2:12: key 'train.products': is read only with run.mode = \"train\"");
  KMOE_DECK_ERROR("[run]\nmode = \"train\"\n[train]\nproducts = \"fp16\"\n", 1, "key 'train.products': 'fp16' is not one of 'fp32' 'bf16'");
  KMOE_DECK_ERROR("[serve]\nrank_tokens = 4\n", 1, "d.toml:2:15: key 'serve.rank_tokens': is read only with run.mode = \"serve\"");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[serve]\nrank_tokens = 0\n", 1, "key 'serve.rank_tokens': = 0 is out of range");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[[serve.step]]\ntokens = [1, 2, 3]\n", 2,
                  "key 'serve.step[0].tokens': of step 0 has 3 entries; give one per rank (2) or one for every rank");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[[serve.step]]\nprefill = [1]\n", 1, "of step 0 is missing (decode rows per rank)");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[[serve.step]]\ntokens = [1]\nphase = \"decode\"\n", 1, "phase");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[router]\nadmission = \"expert_capacity\"\n", 1,
                  "key 'router.admission': must be \"dropless\" with run.mode = \"serve\"");
  KMOE_DECK_ERROR("[run]\nmode = \"serve\"\n[tokens]\nsource = \"uniform\"\n", 1, "needs tokens.source = \"router\"");
  // A user's string is shown shortened.
  KMOE_DECK_ERROR("[exchange]\nalgorithm = \"" + std::string(5000, 'x') + "\"\n", 1, "... (5000 characters)' is not one of");
}

TEST_CASE("the exchange transport is a deck choice; one this build lacks is refused where it is asked for", "[deck][transport]") {
  auto const mpi = parse_layer_deck("d.toml", "[exchange]\ntransport = \"mpi\"\n", 1);
  CHECK(mpi.exchange.transport == Exchange::TransportKind::mpi);
  CHECK(mpi.resolved().find("transport = \"mpi\"") != std::string::npos);
  CHECK_FALSE(Setup::exchange_config(mpi).stage_through_host);
  CHECK(mpi.resolved().find("stage_through_host = false") != std::string::npos);
  // MPI rows staged through host copies on request: in the exchange's configuration and the echo.
  auto const staged = parse_layer_deck("d.toml", "[exchange]\nstage_through_host = true\n", 1);
  CHECK(Setup::exchange_config(staged).stage_through_host);
  CHECK(Setup::exchange_config(staged).transport_options().stage_through_host);
  CHECK(staged.resolved().find("stage_through_host = true") != std::string::npos);
  KMOE_DECK_ERROR("[exchange]\nstage_through_host = 1\n", 1, "key 'exchange.stage_through_host'");
  // Rows straight to the expert rows (flat): on by default, off by the deck.
  CHECK(Setup::exchange_config(mpi).receive_into_experts);
  CHECK(mpi.resolved().find("receive_into_experts = true") != std::string::npos);
  auto const copies = parse_layer_deck("d.toml", "[exchange]\nreceive_into_experts = false\n", 1);
  CHECK_FALSE(Setup::exchange_config(copies).receive_into_experts);
  CHECK(copies.resolved().find("receive_into_experts = false") != std::string::npos);
  KMOE_DECK_ERROR("[exchange]\nreceive_into_experts = \"yes\"\n", 1, "key 'exchange.receive_into_experts'");
  std::string const nccl = "[exchange]\nalgorithm = \"hierarchical\"\ntransport = \"nccl\"\n";
  if (Exchange::transport_available(Exchange::TransportKind::nccl)) {
    CHECK(parse_layer_deck("d.toml", nccl, 2).exchange.transport == Exchange::TransportKind::nccl);
  } else {
    KMOE_DECK_ERROR(nccl, 2, "d.toml:3:13: key 'exchange.transport': exchange transport 'nccl' is not available");
    KMOE_DECK_ERROR(nccl, 2, "KokkosMoE_ENABLE_NCCL=ON");
  }
}

TEST_CASE("shipped decks parse, and the resolved echo parses to the same settings", "[deck]") {
  for (std::string const name : {"quickstart", "deepseek_v3", "mixtral", "hot_expert", "pooled_wave", "decode", "dispatch_v17"}) {
    INFO(name);
    std::string const path = std::string(KMOE_TEST_DATA_DIR) + "/../../inputs/" + name + ".toml";
    auto const d = parse_layer_deck(path, read(path), 4);
    auto const again = parse_layer_deck(path + " (resolved)", d.resolved(), 4);
    CHECK(again.resolved().substr(again.resolved().find('\n')) == d.resolved().substr(d.resolved().find('\n')));
    CHECK(again.model.experts == d.model.experts);
    CHECK(again.router.route_scale == d.router.route_scale);
  }
}

TEST_CASE("strings with backslashes, quotes and control characters echo as TOML that reads back the same", "[deck]") {
  // Found by the deck fuzzer: the echo wrote strings unescaped, so a
  // backslash read back as half as many (and a quote ended the string).
  std::string const text = "[run]\nreport = \"a\\\\b\\\"c\\td\\u0001e\"\nhdf5 = 'C:\\x\\y'\n";
  auto const d = parse_layer_deck("s.toml", text, 1);
  CHECK(d.run.report == std::string("a\\b\"c\td\x01") + "e");
  CHECK(d.run.hdf5 == "C:\\x\\y");
  auto const again = parse_layer_deck("s.toml (resolved)", d.resolved(), 1);
  CHECK(again.run.report == d.run.report);
  CHECK(again.run.hdf5 == d.run.hdf5);
  CHECK(again.resolved().substr(again.resolved().find('\n')) == d.resolved().substr(d.resolved().find('\n')));
}
