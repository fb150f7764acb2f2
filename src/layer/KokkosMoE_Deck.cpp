#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Error.hpp>

#include <impl/KokkosMoE_DeckReader.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <sys/stat.h>

namespace KokkosMoE {

namespace {

constexpr std::int64_t big = std::numeric_limits<std::int32_t>::max();
constexpr double huge = 1e300;

/// Typed, located reads out of the deck (TOML kept out of this file).
using Reader = Impl::DeckReader;

PayloadType payload_of(Reader& r, std::string const& key, std::string const& def, bool allow_fp8) {
  std::vector<std::string> choices = {"fp32", "bf16"};
  if (allow_fp8) {
    choices.push_back("fp8_row");
    choices.push_back("fp8_block128");
  }
  return from_string<PayloadType>(r.choice(key, def, choices));
}

std::string toml_list(std::vector<int> const& v) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

template <class T>
std::string toml_list_of(std::vector<T> const& v) {
  std::ostringstream os;
  os.precision(9);
  os << "[";
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

/// A TOML basic string that reads back as s: backslash, quote and control
/// characters escaped.
std::string quoted(std::string const& s) {
  std::ostringstream os;
  os << '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      case '\b': os << "\\b"; break;
      case '\t': os << "\\t"; break;
      case '\n': os << "\\n"; break;
      case '\f': os << "\\f"; break;
      case '\r': os << "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", static_cast<unsigned>(c));
          os << buf;
        } else {
          os << static_cast<char>(c);
        }
    }
  }
  os << '"';
  return os.str();
}

template <class E>
std::vector<std::string> names_of_values(std::vector<E> const& v) {
  std::vector<std::string> out;
  for (E e : v) out.push_back(to_string(e));
  return out;
}

std::string quoted_list(std::vector<std::string> const& v) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << quoted(v[i]);
  os << "]";
  return os.str();
}

/// [run]
void parse_run(Reader& r, LayerDeck& d) {
  d.run.steps = static_cast<int>(r.integer("run.steps", d.run.steps, 0, big));
  d.run.warmup = static_cast<int>(r.integer("run.warmup", d.run.warmup, 0, big));
  d.run.seed = static_cast<std::uint64_t>(r.integer("run.seed", 1234, 0, std::numeric_limits<std::int64_t>::max()));
  d.run.report = r.string("run.report", "");
  d.run.hdf5 = r.string("run.hdf5", "");
  d.run.record_routes = r.string("run.record_routes", "");
  d.run.record_logits = r.boolean("run.record_logits", false);
  d.run.progress_every = static_cast<int>(r.integer("run.progress_every", 0, 0, big));
  d.run.compare = r.options<Exchange::Algorithm>("run.compare");
  d.run.schedule = r.option<ScheduleKind>("run.schedule", ScheduleKind::serial);
  bool const chunked = d.run.schedule == ScheduleKind::chunked || d.run.schedule == ScheduleKind::chunked_shared_overlap;
  d.run.chunks = static_cast<int>(r.integer("run.chunks", chunked ? 2 : 1, 1, 1024));
  d.run.mode = r.choice("run.mode", "forward", {"forward", "train", "serve"});
  d.train.optimizer = r.choice("train.optimizer", "adam", {"adam", "sgd"});
  d.train.learning_rate = r.real("train.learning_rate", 1e-2, 0.0, 1e6, true);
  d.train.teacher_seed = static_cast<std::uint64_t>(r.integer("train.teacher_seed", 0, 0, std::numeric_limits<std::int64_t>::max()));
  d.train.balance_alpha = r.real("train.balance_alpha", 0.0, 0.0, 1e6);
  d.train.teacher_router = r.choice("train.teacher_router", "student", {"student", "own"});
  d.train.schedule = r.choice("train.schedule", "constant", {"constant", "cosine"});
  d.train.gradient_block = static_cast<int>(r.integer("train.gradient_block", 64, 1, big));
  d.train.reproducible_shared = r.boolean("train.reproducible_shared", false);
  d.train.products = r.choice("train.products", "fp32", {"fp32", "bf16"});
  // gradient_block and reproducible_shared govern every backward (a
  // training run's, and a layer's backward through the C, Fortran and
  // Python doors); the other keys only a training run.
  if (d.run.mode != "train")
    for (char const* key : {"train.optimizer", "train.learning_rate", "train.teacher_seed", "train.balance_alpha", "train.teacher_router",
                            "train.schedule", "train.products"})
      if (r.has(key)) r.fail(key, "is read only with run.mode = \"train\"");
  if (!chunked && d.run.chunks != 1)
    r.fail("run.chunks", "= " + std::to_string(d.run.chunks) + " needs a chunked schedule (run.schedule is '" + to_string(d.run.schedule) +
                             "'; use 'chunked' or 'chunked_shared_overlap')");
}

/// [serve]: read only with run.mode = "serve"; needs [model] (top_k) and the rank count.
void parse_serve(Reader& r, LayerDeck& d, int ranks) {
  auto& sv = d.serve;
  if (d.run.mode != "serve") {
    for (char const* key : {"serve.rank_tokens", "serve.slot_routes", "serve.check", "serve.repeat", "serve.step"})
      if (r.has(key)) r.fail(key, "is read only with run.mode = \"serve\"");
    return;
  }
  sv.rank_tokens = r.integer("serve.rank_tokens", sv.rank_tokens, 1, 1 << 24);
  sv.slot_routes = r.integer("serve.slot_routes", 0, 0, big);
  if (sv.slot_routes == 0) sv.slot_routes = static_cast<index_t>(ranks) * sv.rank_tokens * d.model.top_k;
  sv.check = r.boolean("serve.check", true);
  sv.repeat = static_cast<int>(r.integer("serve.repeat", 1, 1, big));
  // One entry per rank, or one entry for every rank.
  auto per_rank = [&](Reader& t, std::size_t i, char const* key) {
    auto const v = t.integers(key, 0, 1 << 24);
    if (v.empty()) return std::vector<index_t>(static_cast<std::size_t>(ranks), 0);
    if (v.size() != 1 && static_cast<int>(v.size()) != ranks)
      t.fail(key, "of step " + std::to_string(i) + " has " + std::to_string(v.size()) + " entries; give one per rank (" +
                      std::to_string(ranks) + ") or one for every rank");
    std::vector<index_t> out(static_cast<std::size_t>(ranks));
    for (int p = 0; p < ranks; ++p) out[static_cast<std::size_t>(p)] = static_cast<index_t>(v.size() == 1 ? v[0] : v[static_cast<std::size_t>(p)]);
    return out;
  };
  r.tables("serve.step", [&](Reader& t, std::size_t i) {
    if (!t.has("tokens")) t.fail("tokens", "of step " + std::to_string(i) + " is missing (decode rows per rank)");
    LayerDeck::Serve::Step step;
    step.decode = per_rank(t, i, "tokens");
    step.prefill = per_rank(t, i, "prefill");
    sv.steps.push_back(std::move(step));
  });
  if (sv.steps.empty())
    for (index_t t = 1;; t = std::min(2 * t, sv.rank_tokens)) {
      sv.steps.push_back({std::vector<index_t>(static_cast<std::size_t>(ranks), t), std::vector<index_t>(static_cast<std::size_t>(ranks), 0)});
      if (t == sv.rank_tokens) break;
    }
  if (d.tokens.source != "router")
    r.fail("run.mode", "= \"serve\" draws every step's rows: it needs tokens.source = \"router\" (got \"" + d.tokens.source + "\")");
  if (d.router.admission.policy != AdmissionPolicy::dropless)
    r.fail("router.admission", "must be \"dropless\" with run.mode = \"serve\" (padding rows would compete for expert capacity)");
  if (!d.run.compare.empty()) r.fail("run.compare", "is not read with run.mode = \"serve\"");
  if (d.run.schedule != ScheduleKind::serial) r.fail("run.schedule", "must be \"serial\" with run.mode = \"serve\"");
  if (d.placement.rebalance_every != 0) r.fail("placement.rebalance_every", "is not read with run.mode = \"serve\"");
  if (!d.run.record_routes.empty()) r.fail("run.record_routes", "is not read with run.mode = \"serve\"");
}

/// [model]
void parse_model(Reader& r, LayerDeck& d) {
  d.model.hidden = static_cast<int>(r.integer("model.hidden", d.model.hidden, 1, big));
  d.model.experts = static_cast<int>(r.integer("model.experts", d.model.experts, 1, 65535));
  d.model.top_k = static_cast<int>(r.integer("model.top_k", d.model.top_k, 1, big));
  if (d.model.top_k > d.model.experts)
    r.fail("model.top_k", "= " + std::to_string(d.model.top_k) + " exceeds model.experts = " + std::to_string(d.model.experts));
  d.model.ffn = static_cast<int>(r.integer("model.ffn", d.model.ffn, 1, big));
  d.model.shared_experts = static_cast<int>(r.integer("model.shared_experts", 0, 0, 64));
  d.model.shared_ffn = static_cast<int>(r.integer("model.shared_ffn", d.model.ffn, 1, big));
  d.model.dtype = r.choice("model.dtype", "fp32", {"fp32", "bf16"});
  d.model.payload = payload_of(r, "model.payload", "bf16", true);
  d.model.return_payload = payload_of(r, "model.return_payload", "bf16", false);
  d.model.checkpoint = r.string("model.checkpoint", "");
  d.model.layer = static_cast<int>(r.integer("model.layer", -1, -1, big));
  if (d.model.checkpoint.empty()) {
    if (d.model.layer >= 0) r.fail("model.layer", "selects a layer of model.checkpoint, which is not given");
    return;
  }
  if (d.model.layer < 0) r.fail("model.checkpoint", "needs model.layer: the index of the checkpoint's MoE layer to run");
  try {
    d.model.hf = Checkpoint::hf_moe_layer(d.model.checkpoint, d.model.layer);
  } catch (Error const& e) {
    // A layer that is out of range or dense is the layer's key; anything else the checkpoint's.
    std::string const what = e.what();
    bool const about_layer = what.find("layer " + std::to_string(d.model.layer) + " is") != std::string::npos;
    r.fail(about_layer ? "model.layer" : "model.checkpoint", what);
  }
  auto const& hf = d.model.hf;
  // Sizes come from config.json; a deck that states one must agree.
  auto size = [&](char const* key, int& field, int value, char const* config_key) {
    if (r.has(key) && field != value)
      r.fail(key, "= " + std::to_string(field) + " contradicts the checkpoint's config.json (" + config_key + " = " + std::to_string(value) + ")");
    field = value;
  };
  size("model.hidden", d.model.hidden, hf.hidden, "hidden_size");
  size("model.experts", d.model.experts, hf.experts, hf.family == "mixtral" ? "num_local_experts" : hf.family == "qwen3_moe" ? "num_experts" : "n_routed_experts");
  size("model.top_k", d.model.top_k, hf.top_k, "num_experts_per_tok");
  size("model.ffn", d.model.ffn, hf.ffn, hf.family == "mixtral" ? "intermediate_size" : "moe_intermediate_size");
  size("model.shared_experts", d.model.shared_experts, hf.shared_ffn > 0 ? 1 : 0, "n_shared_experts > 0: one shared MLP");
  size("model.shared_ffn", d.model.shared_ffn, hf.shared_ffn > 0 ? hf.shared_ffn : d.model.ffn, "n_shared_experts x moe_intermediate_size");
}

/// [router] (num_experts and top_k from [model])
void parse_router(Reader& r, LayerDeck& d) {
  RouterConfig& rc = d.router;
  rc.num_experts = d.model.experts;
  rc.top_k = d.model.top_k;
  bool const ck = !d.model.checkpoint.empty();
  auto const& hf = d.model.hf;
  // With a checkpoint, its config.json gives the routing; a deck that states
  // a key must agree with it.
  auto agree = [&](char const* key, std::string const& deck_value, std::string const& config_value, char const* config_key) {
    if (ck && r.has(key) && deck_value != config_value)
      r.fail(key, "= " + deck_value + " contradicts the checkpoint's config.json (" + config_key + ": " + config_value + ")");
  };
  {
    std::string const score = r.choice("router.score", ck ? hf.score : "softmax", {"softmax", "sigmoid"});
    agree("router.score", score, hf.score, "scoring_func");
    rc.score = from_string<ScoreFunction>(score);
  }
  rc.num_groups = static_cast<int>(r.integer("router.groups", ck ? hf.groups : 1, 1, 65535));
  agree("router.groups", std::to_string(rc.num_groups), std::to_string(hf.groups), "n_group");
  if (d.model.experts % rc.num_groups != 0)
    r.fail("router.groups", "= " + std::to_string(rc.num_groups) + " does not divide model.experts = " + std::to_string(d.model.experts));
  rc.topk_groups = static_cast<int>(r.integer("router.topk_groups", ck ? hf.topk_groups : rc.num_groups, 1, 65535));
  agree("router.topk_groups", std::to_string(rc.topk_groups), std::to_string(hf.topk_groups), "topk_group");
  if (rc.topk_groups > rc.num_groups)
    r.fail("router.topk_groups", "= " + std::to_string(rc.topk_groups) + " exceeds router.groups = " + std::to_string(rc.num_groups));
  {
    std::string const gs = r.string("router.group_score", ck && !hf.group_score.empty() ? hf.group_score
                                                          : rc.topk_groups < rc.num_groups   ? "max"
                                                                                             : "none");
    if (!hf.group_score.empty()) agree("router.group_score", gs, hf.group_score, "topk_method");
    try {
      rc.group_score = set_score_from_string(gs, &rc.group_top_m);
    } catch (Error const& e) {
      r.fail("router.group_score", e.what());
    }
  }
  rc.group_mask = r.option("router.group_mask", GroupMask::exclude);
  d.domain_limit = r.choice("router.domain_limit", "none", {"none", "rank", "node"});
  rc.max_domains = static_cast<int>(r.integer("router.max_domains", d.domain_limit == "none" ? 0 : 1, 0, 65535));
  if (d.domain_limit != "none" && rc.max_domains < 1) r.fail("router.max_domains", "must be >= 1 with a domain limit");
  {
    std::string const ds = r.string("router.domain_score", "max");
    try {
      rc.domain_score = set_score_from_string(ds, &rc.domain_top_m);
    } catch (Error const& e) {
      r.fail("router.domain_score", e.what());
    }
  }
  if (d.domain_limit != "none" && rc.group_limited())
    r.fail("router.domain_limit", "a domain limit cannot be combined with a group limit (router.topk_groups < router.groups)");
  rc.normalize = r.boolean("router.normalize", ck ? hf.normalize : rc.score == ScoreFunction::sigmoid);
  agree("router.normalize", rc.normalize ? "true" : "false", hf.normalize ? "true" : "false", "norm_topk_prob");
  rc.route_scale = static_cast<float>(r.real("router.route_scale", ck ? hf.route_scale : 1.0, 0.0, huge, true));
  if (ck && r.has("router.route_scale") && rc.route_scale != static_cast<float>(hf.route_scale))
    r.fail("router.route_scale", "contradicts the checkpoint's config.json (routed_scaling_factor: " + std::to_string(hf.route_scale) + ")");
  rc.use_correction_bias = r.boolean("router.correction_bias", ck && hf.correction_bias);
  agree("router.correction_bias", rc.use_correction_bias ? "true" : "false", hf.correction_bias ? "true" : "false",
        "topk_method noaux_tc: e_score_correction_bias");
  d.bias_update = r.choice("router.bias_update", "none", {"none", "sign", "proportional"});
  d.bias_gamma = r.real("router.bias_gamma", 0.001, 0.0, huge);
  if (d.bias_update != "none" && !rc.use_correction_bias)
    r.fail("router.bias_update", "needs router.correction_bias = true");
  rc.admission.policy = r.option("router.admission", AdmissionPolicy::dropless);
  rc.admission.capacity_factor = r.real("router.capacity_factor", 1.0, 0.0, huge, true);
  d.router_gemm = r.option("router.gemm", GemmPath::automatic);
  if (rc.top_k > rc.min_eligible_experts() && d.domain_limit == "none")
    r.fail("model.top_k", "= " + std::to_string(rc.top_k) + " exceeds the " + std::to_string(rc.min_eligible_experts()) +
                              " experts of router.topk_groups = " + std::to_string(rc.topk_groups) + " groups");
}

/// [tokens]: synthetic distributions or explicit tokens of every rank
void parse_tokens(Reader& r, LayerDeck& d, int ranks_for_layout) {
  d.tokens.per_rank = r.integer("tokens.per_rank", 64, 0, big);
  d.tokens.source = r.choice("tokens.source", "router", {"router", "uniform", "zipf", "hot", "explicit", "trace"});
  d.tokens.trace = r.string("tokens.trace", "");
  if (d.tokens.source == "trace" && d.tokens.trace.empty())
    r.fail("tokens.source", "\"trace\" replays recorded routes: give tokens.trace (an .h5 file or a directory of .npy files)");
  if (d.tokens.source != "trace" && !d.tokens.trace.empty())
    r.fail("tokens.trace", "a trace is only read with tokens.source = \"trace\"");
  if (d.tokens.source == "trace" && !r.has("tokens.per_rank"))
    r.fail("tokens.trace", "a trace replay needs tokens.per_rank (the trace's tokens per rank)");
  std::string const replay = r.choice("tokens.replay", "auto", {"auto", "routes", "logits"});
  d.tokens.replay = replay == "routes" ? TraceReplay::routes : replay == "logits" ? TraceReplay::logits : TraceReplay::automatic;
  if (d.tokens.source != "trace" && r.has("tokens.replay"))
    r.fail("tokens.replay", "chooses what a trace replay reads: it needs tokens.source = \"trace\"");
  // Logits exist where the layer's router runs: on hidden rows, or on replayed logits.
  if (d.run.record_logits && d.tokens.source != "router" && !(d.tokens.source == "trace" && d.tokens.replay != TraceReplay::routes))
    r.fail("run.record_logits", "records the router's logits: it needs tokens.source = \"router\" (or a trace replay of logits), not \"" +
                                    d.tokens.source + "\"");
  d.tokens.zipf_s = r.real("tokens.zipf_s", 1.2, 0.0, huge, true);
  d.tokens.hot_expert = static_cast<int>(r.integer("tokens.hot_expert", 0, 0, d.model.experts - 1));
  d.tokens.hot_fraction = r.real("tokens.hot_fraction", 0.5, 0.0, 1.0);
  r.tables("tokens.rank", [&](Reader& t, std::size_t i) {
    DeckRankTokens rank;
    t.number_rows("hidden", [&](std::size_t row, std::vector<double> const& values) {
      std::vector<float> v;
      for (double const x : values) v.push_back(static_cast<float>(x));
      if (static_cast<int>(v.size()) != d.model.hidden)
        t.fail("hidden", "row " + std::to_string(row) + " has " + std::to_string(v.size()) + " values, model.hidden is " +
                             std::to_string(d.model.hidden));
      rank.hidden.push_back(v);
    });
    t.tables("routes", [&](Reader& rt, std::size_t) {
      DeckRoute route;
      route.token = static_cast<int>(rt.integer("token", 0, 0, static_cast<std::int64_t>(rank.hidden.size()) - 1));
      route.k_slot = static_cast<int>(rt.integer("k_slot", 0, 0, d.model.top_k - 1));
      route.expert = static_cast<int>(rt.integer("expert", 0, 0, d.model.experts - 1));
      route.gate = static_cast<float>(rt.real("gate", 0.0, -huge, huge));
      route.slot = static_cast<int>(rt.integer("slot", -1, -1, big));
      rank.routes.push_back(route);
    });
    (void)i;
    d.tokens.ranks.push_back(std::move(rank));
  });
  if (d.tokens.source == "explicit") {
    if (static_cast<int>(d.tokens.ranks.size()) != ranks_for_layout)
      r.fail("tokens.rank", "explicit tokens are given for " + std::to_string(d.tokens.ranks.size()) + " ranks, the run has " +
                                std::to_string(ranks_for_layout));
    for (std::size_t q = 0; q < d.tokens.ranks.size(); ++q) {
      auto const& rk = d.tokens.ranks[q];
      std::vector<int> seen(rk.hidden.size() * static_cast<std::size_t>(d.model.top_k), 0);
      for (auto const& rt : rk.routes) ++seen[static_cast<std::size_t>(rt.token) * static_cast<std::size_t>(d.model.top_k) + static_cast<std::size_t>(rt.k_slot)];
      for (std::size_t x = 0; x < seen.size(); ++x)
        if (seen[x] != 1)
          r.fail("tokens.rank", "rank " + std::to_string(q) + " token " + std::to_string(x / static_cast<std::size_t>(d.model.top_k)) +
                                    " k-slot " + std::to_string(x % static_cast<std::size_t>(d.model.top_k)) + " has " +
                                    std::to_string(seen[x]) + " routes (exactly one expected)");
    }
  } else if (!d.tokens.ranks.empty()) {
    r.fail("tokens.rank", "explicit tokens need tokens.source = \"explicit\"");
  }
  if (d.tokens.source == "explicit" && r.has("tokens.per_rank"))
    r.fail("tokens.per_rank", "explicit tokens take their count from [[tokens.rank]]");
}

/// [topology]: virtual, synthetic or hwloc nodes; peer order; relays
void parse_topology(Reader& r, LayerDeck& d, int ranks_for_layout) {
  d.topology.layout = r.option("topology.layout", Topology::LayoutKind::virtual_nodes);
  d.topology.nodes = static_cast<int>(r.integer("topology.nodes", 0, 1, big));
  d.topology.ranks_per_node = static_cast<int>(r.integer("topology.ranks_per_node", 0, 1, big));
  for (auto v : r.integers("topology.node_of_rank", 0, big)) d.topology.node_of_rank.push_back(static_cast<int>(v));
  d.topology.nics = r.strings("topology.nics");
  d.topology.synthetic = r.string("topology.synthetic", "");
  d.topology.xml = r.string("topology.xml", "");
  for (auto v : r.integers("topology.peer_order", 0, big)) d.topology.peer_order.push_back(static_cast<int>(v));
  d.topology.relays_per_node = static_cast<int>(r.integer("topology.relays_per_node", 1, 1, big));
  d.topology.relay_policy = r.option("topology.relay_policy", Topology::RelayPolicy::lowest_local_rank);
  if (d.topology.layout != Topology::LayoutKind::hwloc) {
    int const given = (d.topology.nodes > 0) + (d.topology.ranks_per_node > 0) + !d.topology.node_of_rank.empty();
    if (given > 1)
      r.fail(d.topology.nodes > 0 ? "topology.nodes" : "topology.node_of_rank",
             "give one of topology.nodes, topology.ranks_per_node and topology.node_of_rank");
    if (d.topology.nodes > 0) {
      // Nodes as even as possible, at most one per rank.
      int const nodes = std::min(d.topology.nodes, ranks_for_layout);
      for (int q = 0; q < ranks_for_layout; ++q)
        d.topology.node_of_rank.push_back(static_cast<int>(static_cast<std::int64_t>(q) * nodes / ranks_for_layout));
      d.topology.nodes = nodes;
    }
    if (d.topology.ranks_per_node == 0 && d.topology.node_of_rank.empty()) d.topology.ranks_per_node = ranks_for_layout;
    if (d.topology.ranks_per_node > 0 && ranks_for_layout % d.topology.ranks_per_node != 0)
      r.fail("topology.ranks_per_node", "= " + std::to_string(d.topology.ranks_per_node) + " does not divide the " +
                                            std::to_string(ranks_for_layout) + " ranks of the run");
    if (!d.topology.node_of_rank.empty() && static_cast<int>(d.topology.node_of_rank.size()) != ranks_for_layout)
      r.fail("topology.node_of_rank", "has " + std::to_string(d.topology.node_of_rank.size()) + " entries for " +
                                          std::to_string(ranks_for_layout) + " ranks");
    int min_rpn = d.topology.ranks_per_node;
    if (!d.topology.node_of_rank.empty()) {
      std::vector<int> count;
      for (int n : d.topology.node_of_rank) {
        if (n >= static_cast<int>(count.size())) count.resize(static_cast<std::size_t>(n) + 1, 0);
        ++count[static_cast<std::size_t>(n)];
      }
      min_rpn = *std::min_element(count.begin(), count.end());
      if (min_rpn == 0) r.fail("topology.node_of_rank", "node ids must be contiguous from 0");
    }
    if (d.topology.relays_per_node > min_rpn)
      r.fail("topology.relays_per_node", "= " + std::to_string(d.topology.relays_per_node) + " is more than the " +
                                             std::to_string(min_rpn) + " ranks of the smallest node");
  } else if (d.topology.ranks_per_node > 0 || !d.topology.node_of_rank.empty() || d.topology.nodes > 0) {
    r.fail("topology.layout", "\"hwloc\" takes nodes from the machine; remove topology.nodes / ranks_per_node / node_of_rank");
  }
  if (r.has("topology.fabric")) {
    auto& f = d.topology.fabric;
    f.inter_latency_us = r.real("topology.fabric.inter_latency_us", 0.0, 0.0, 1e9);
    f.inter_bandwidth_gbps = r.real("topology.fabric.inter_bandwidth_gbps", 0.0, 0.0, 1e9, true);
    f.nics_per_node = static_cast<int>(r.integer("topology.fabric.nics_per_node", 1, 1, 1024));
    f.intra_latency_us = r.real("topology.fabric.intra_latency_us", 0.0, 0.0, 1e9);
    f.intra_bandwidth_gbps = r.real("topology.fabric.intra_bandwidth_gbps", 0.0, 0.0, 1e9);
    if (!r.has("topology.fabric.inter_bandwidth_gbps"))
      r.fail("topology.fabric", "an emulated fabric needs inter_bandwidth_gbps (GB/s per NIC)");
    if (d.topology.layout == Topology::LayoutKind::hwloc)
      r.fail("topology.fabric", "an emulated fabric needs a virtual or synthetic layout (its nodes are declared, not real)");
  }
  if (d.topology.layout == Topology::LayoutKind::synthetic && d.topology.synthetic.empty() == d.topology.xml.empty())
    r.fail("topology.synthetic", "a synthetic layout needs exactly one of topology.synthetic and topology.xml");
  if (!d.topology.peer_order.empty()) {
    if (static_cast<int>(d.topology.peer_order.size()) != ranks_for_layout)
      r.fail("topology.peer_order", "has " + std::to_string(d.topology.peer_order.size()) + " entries for " +
                                        std::to_string(ranks_for_layout) + " ranks");
    std::vector<int> seen(static_cast<std::size_t>(ranks_for_layout), 0);
    for (int x : d.topology.peer_order) {
      if (x >= ranks_for_layout) r.fail("topology.peer_order", "names rank " + std::to_string(x) + " of a " + std::to_string(ranks_for_layout) + "-rank run");
      if (seen[static_cast<std::size_t>(x)]++) r.fail("topology.peer_order", "lists rank " + std::to_string(x) + " twice");
    }
  }
}

/// [placement]
void parse_placement(Reader& r, LayerDeck& d, int ranks_for_layout) {
  d.placement.policy = r.option("placement.policy", PlacementPolicy::round_robin);
  d.placement.physical_slots = static_cast<int>(r.integer("placement.physical_slots", 0, 0, big));
  d.placement.groups = static_cast<int>(r.integer("placement.groups", 1, 1, 65535));
  d.placement.loads = r.reals("placement.loads", 0.0, huge);
  d.placement.load_file = r.string("placement.load_file", "");
  d.placement.rebalance_every = static_cast<int>(r.integer("placement.rebalance_every", 0, 0, big));
  d.placement.replica_policy = r.option("placement.replica_policy", ReplicaPolicy::locality);
  r.tables("placement.slots", [&](Reader& s, std::size_t) {
    DeckSlot slot;
    slot.expert = static_cast<int>(s.integer("expert", 0, 0, d.model.experts - 1));
    slot.rank = static_cast<int>(s.integer("rank", 0, 0, ranks_for_layout - 1));
    d.placement.slots.push_back(slot);
  });
  bool const eplb = is_eplb(d.placement.policy);
  if (d.placement.policy == PlacementPolicy::explicit_slots) {
    if (d.placement.slots.empty()) r.fail("placement.slots", "an explicit placement needs [[placement.slots]]");
    std::vector<int> copies(static_cast<std::size_t>(d.model.experts), 0);
    for (auto const& s : d.placement.slots) ++copies[static_cast<std::size_t>(s.expert)];
    for (int e = 0; e < d.model.experts; ++e)
      if (copies[static_cast<std::size_t>(e)] == 0) r.fail("placement.slots", "expert " + std::to_string(e) + " has no slot");
  } else if (!d.placement.slots.empty()) {
    r.fail("placement.slots", "slots are only read with placement.policy = \"explicit\"");
  }
  if (eplb) {
    int const S = d.placement.physical_slots == 0 ? d.model.experts : d.placement.physical_slots;
    if (S < d.model.experts) r.fail("placement.physical_slots", "= " + std::to_string(S) + " is fewer than the " + std::to_string(d.model.experts) + " experts");
    if (S % ranks_for_layout != 0)
      r.fail("placement.physical_slots", "= " + std::to_string(S) + " is not a multiple of the " + std::to_string(ranks_for_layout) + " ranks");
    if (d.model.experts % d.placement.groups != 0)
      r.fail("placement.groups", "= " + std::to_string(d.placement.groups) + " does not divide model.experts = " + std::to_string(d.model.experts));
    if (!d.placement.loads.empty() && static_cast<int>(d.placement.loads.size()) != d.model.experts)
      r.fail("placement.loads", "has " + std::to_string(d.placement.loads.size()) + " entries for " + std::to_string(d.model.experts) + " experts");
    d.placement.physical_slots = S;
  } else if (d.placement.physical_slots != 0 || !d.placement.loads.empty() || !d.placement.load_file.empty() ||
             d.placement.rebalance_every != 0) {
    r.fail(d.placement.physical_slots != 0 ? "placement.physical_slots"
           : d.placement.rebalance_every != 0 ? "placement.rebalance_every"
           : (d.placement.loads.empty() ? "placement.load_file" : "placement.loads"),
           "is only read with an EPLB placement policy");
  }
}

/// [exchange]
void parse_exchange(Reader& r, LayerDeck& d) {
  d.exchange.algorithm = r.option("exchange.algorithm", Exchange::Algorithm::flat);
  d.exchange.transport = r.option("exchange.transport", Exchange::TransportKind::mpi);
  if (!Exchange::transport_available(d.exchange.transport))
    r.fail("exchange.transport", Exchange::transport_unavailable_reason(d.exchange.transport));
  d.exchange.watchdog_seconds = r.real("exchange.watchdog_seconds", 300.0, 0.0, huge);
  d.exchange.verify_send_rows = r.boolean("exchange.verify_send_rows", false);
  d.exchange.stage_through_host = r.boolean("exchange.stage_through_host", false);
  d.exchange.pair_runs = r.boolean("exchange.pair_runs", false);
  d.exchange.receive_into_experts = r.boolean("exchange.receive_into_experts", true);
  d.exchange.node_dedup = r.boolean("exchange.node_dedup", false);
  if (d.exchange.node_dedup) {
    // The deduplicating variant of the hierarchical exchange, wherever the deck names it.
    auto dedup = [](Exchange::Algorithm& a) {
      if (a == Exchange::Algorithm::hierarchical) a = Exchange::Algorithm::hierarchical_dedup;
    };
    dedup(d.exchange.algorithm);
    for (auto& a : d.run.compare) dedup(a);
  }
  d.exchange.waves = static_cast<int>(r.integer("exchange.waves", 1, 1, 1024));
  d.exchange.sender_cf = r.real("exchange.sender_cf", 1.25, 0.0, huge, true);
  d.exchange.receiver_cf = r.real("exchange.receiver_cf", 1.5, 0.0, huge, true);
}

/// [experts]
void parse_experts(Reader& r, LayerDeck& d) {
  d.experts.runner = r.option("experts.runner", Experts::RunnerKind::grouped);
  // Rows per slot: far above any batch, low enough that L * rows cannot overflow.
  constexpr std::int64_t rows_limit = std::int64_t(1) << 24;
  d.experts.capacity = r.integer("experts.capacity", 0, 0, rows_limit);
  d.experts.alignment = r.integer("experts.alignment", 1, 1, rows_limit);
  d.experts.block_size = r.integer("experts.block_size", 128, 1, rows_limit);
  d.experts.gemm = r.option("experts.gemm", GemmPath::automatic);
  d.experts.kernel = r.option("experts.kernel", Experts::GroupedKernel::automatic);
  d.experts.decode_rows = static_cast<int>(r.integer("experts.decode_rows", -1, -1, Experts::max_decode_rows));
  d.experts.weights = r.string("experts.weights", "");
  d.experts.save_weights = r.string("experts.save_weights", "");
  if (!d.model.checkpoint.empty()) {
    if (!d.experts.weights.empty()) r.fail("experts.weights", "cannot be combined with model.checkpoint, which gives the routed experts");
    if (d.experts.runner == Experts::RunnerKind::scalar) r.fail("experts.runner", "scalar experts cannot run model.checkpoint's SwiGLU experts");
  }
  for (double s : r.reals("experts.scales", -huge, huge)) d.experts.scales.push_back(static_cast<float>(s));
  if (d.experts.runner == Experts::RunnerKind::scalar) {
    if (d.experts.scales.empty()) d.experts.scales.assign(static_cast<std::size_t>(d.model.experts), 1.0f);
    if (static_cast<int>(d.experts.scales.size()) != d.model.experts)
      r.fail("experts.scales", "has " + std::to_string(d.experts.scales.size()) + " entries for " + std::to_string(d.model.experts) + " experts");
    if (!d.experts.weights.empty()) r.fail("experts.weights", "scalar experts have no weights to load");
  } else if (!d.experts.scales.empty()) {
    r.fail("experts.scales", "scales are only read with experts.runner = \"scalar\"");
  }
}

/// The router's own checks (groups, scores, admission) with file context.
void check_router(Reader const& r, LayerDeck const& d, int ranks) {
  try {
    RouterConfig check = d.router;
    if (d.domain_limit != "none") {
      check.expert_domain.assign(static_cast<std::size_t>(d.model.experts), 0);
      for (int e = 0; e < d.model.experts; ++e) check.expert_domain[static_cast<std::size_t>(e)] = e % std::max(1, d.router.max_domains);
    }
    if (check.admission.policy == AdmissionPolicy::device_capacity) {
      check.admission.num_devices = ranks;
      check.admission.expert_device.assign(static_cast<std::size_t>(d.model.experts), 0);
    }
    check.validate();
  } catch (Error const& e) {
    KOKKOSMOE_THROW(r.where("router") << ": table [router]: " << e.what());
  }
}

}  // namespace

LayerDeck parse_layer_deck(std::string const& path, std::string const& text, int nranks) {
  KOKKOSMOE_REQUIRE(nranks >= 1, "deck '" << path << "': a run needs at least one rank");
  Reader r = Reader::parse(path, text);
  LayerDeck d;
  d.path = path;
  d.text = text;
  // [simulate]: a deck for a simulated cluster is checked against its rank count.
  bool const sim = r.has("simulate.ranks");
  int const ranks = sim ? static_cast<int>(r.integer("simulate.ranks", 0, 1, 1 << 20)) : nranks;
  d.simulate.ranks = sim ? ranks : 0;
  parse_run(r, d);
  parse_model(r, d);
  parse_router(r, d);
  parse_tokens(r, d, ranks);
  parse_topology(r, d, ranks);
  parse_placement(r, d, ranks);
  parse_exchange(r, d);
  parse_experts(r, d);
  parse_serve(r, d, ranks);
  if (d.run.mode == "train") {
    // What the layer's backward covers.
    if (d.model.dtype != "fp32") r.fail("run.mode", "= \"train\" needs model.dtype = \"fp32\" (got \"" + d.model.dtype + "\")");
    if (d.tokens.source != "router")
      r.fail("run.mode", "= \"train\" needs tokens.source = \"router\" (the router's gates are trained; got \"" + d.tokens.source + "\")");
    if (!d.run.compare.empty()) r.fail("run.compare", "is not read with run.mode = \"train\"");
    if (d.run.schedule != ScheduleKind::serial) r.fail("run.schedule", "must be \"serial\" with run.mode = \"train\"");
    if (d.placement.rebalance_every != 0)
      r.fail("placement.rebalance_every", "is not read with run.mode = \"train\" (the optimizer state stays with its slots)");
    if (!d.run.record_routes.empty()) r.fail("run.record_routes", "is not read with run.mode = \"train\"");
  }
  if (d.run.record_logits && d.run.record_routes.empty())
    r.fail("run.record_logits", "writes the logits into the trace of run.record_routes: give that path");
  r.finish();
  check_router(r, d, ranks);
  return d;
}

std::string LayerDeck::resolved() const {
  std::ostringstream os;
  os.precision(9);  // floats (gates, rows, scales) parse back to the same values
  os << "# resolved configuration of " << path << "\n";
  os << "[run]\nsteps = " << run.steps << "\nwarmup = " << run.warmup << "\nseed = " << run.seed << "\nreport = " << quoted(run.report)
     << "\nhdf5 = " << quoted(run.hdf5) << "\nrecord_routes = " << quoted(run.record_routes) << "\nrecord_logits = " << (run.record_logits ? "true" : "false") << "\nprogress_every = " << run.progress_every << "\ncompare = " << quoted_list(names_of_values(run.compare))
     << "\nschedule = " << quoted(to_string(run.schedule)) << "\nchunks = " << run.chunks << "\nmode = " << quoted(run.mode) << "\n";
  if (run.mode == "train")
    os << "\n[train]\noptimizer = " << quoted(train.optimizer) << "\nlearning_rate = " << train.learning_rate
       << "\nschedule = " << quoted(train.schedule)
       << "\nteacher_seed = " << train.teacher_seed << "\nbalance_alpha = " << train.balance_alpha
       << "\nteacher_router = " << quoted(train.teacher_router) << "\ngradient_block = " << train.gradient_block
       << "\nreproducible_shared = " << (train.reproducible_shared ? "true" : "false") << "\nproducts = " << quoted(train.products)
       << "\n";
  os << "\n[model]\nhidden = " << model.hidden << "\nexperts = " << model.experts << "\ntop_k = " << model.top_k << "\nffn = " << model.ffn
     << "\nshared_experts = " << model.shared_experts << "\nshared_ffn = " << model.shared_ffn << "\ndtype = " << quoted(model.dtype)
     << "\npayload = " << quoted(to_string(model.payload)) << "\nreturn_payload = " << quoted(to_string(model.return_payload)) << "\n";
  if (!model.checkpoint.empty()) os << "checkpoint = " << quoted(model.checkpoint) << "\nlayer = " << model.layer << "\n";
  os << "\n[router]\nscore = " << quoted(to_string(router.score)) << "\ngroups = " << router.num_groups << "\ntopk_groups = " << router.topk_groups
     << "\ngroup_score = " << quoted(router.group_score == SetScore::top_m_sum ? "top" + std::to_string(router.group_top_m) + "_sum" : to_string(router.group_score))
     << "\ngroup_mask = " << quoted(to_string(router.group_mask))
     << "\ndomain_limit = " << quoted(domain_limit) << "\nmax_domains = " << router.max_domains
     << "\ndomain_score = " << quoted(router.domain_score == SetScore::top_m_sum ? "top" + std::to_string(router.domain_top_m) + "_sum" : to_string(router.domain_score))
     << "\nnormalize = " << (router.normalize ? "true" : "false") << "\nroute_scale = " << router.route_scale
     << "\ncorrection_bias = " << (router.use_correction_bias ? "true" : "false") << "\nbias_update = " << quoted(bias_update)
     << "\nbias_gamma = " << bias_gamma << "\nadmission = "
     << quoted(to_string(router.admission.policy))
     << "\ncapacity_factor = " << router.admission.capacity_factor << "\ngemm = " << quoted(to_string(router_gemm)) << "\n";
  os << "\n[tokens]\n";
  if (tokens.source != "explicit") os << "per_rank = " << tokens.per_rank << "\n";
  if (!tokens.trace.empty()) os << "trace = " << quoted(tokens.trace) << "\nreplay = " << quoted(to_string(tokens.replay)) << "\n";
  os << "source = " << quoted(tokens.source) << "\nzipf_s = " << tokens.zipf_s
     << "\nhot_expert = " << tokens.hot_expert << "\nhot_fraction = " << tokens.hot_fraction << "\n";
  for (auto const& rk : tokens.ranks) {
    os << "[[tokens.rank]]\nhidden = [";
    for (std::size_t t = 0; t < rk.hidden.size(); ++t) os << (t ? ", " : "") << toml_list_of(rk.hidden[t]);
    os << "]\nroutes = [";
    for (std::size_t i = 0; i < rk.routes.size(); ++i) {
      auto const& r = rk.routes[i];
      os << (i ? ", " : "") << "{token = " << r.token << ", k_slot = " << r.k_slot << ", expert = " << r.expert
         << ", gate = " << r.gate << ", slot = " << r.slot << "}";
    }
    os << "]\n";
  }
  os << "\n[topology]\nlayout = " << quoted(to_string(topology.layout)) << "\n";
  if (!topology.node_of_rank.empty())
    os << "node_of_rank = " << toml_list(topology.node_of_rank) << "\n";
  else if (topology.ranks_per_node > 0)
    os << "ranks_per_node = " << topology.ranks_per_node << "\n";
  os << "nics = " << quoted_list(topology.nics) << "\n";
  if (!topology.synthetic.empty()) os << "synthetic = " << quoted(topology.synthetic) << "\n";
  if (!topology.xml.empty()) os << "xml = " << quoted(topology.xml) << "\n";
  os << "peer_order = " << toml_list(topology.peer_order) << "\nrelays_per_node = " << topology.relays_per_node
     << "\nrelay_policy = " << quoted(to_string(topology.relay_policy)) << "\n";
  if (topology.fabric.enabled())
    os << "\n[topology.fabric]\ninter_latency_us = " << topology.fabric.inter_latency_us
       << "\ninter_bandwidth_gbps = " << topology.fabric.inter_bandwidth_gbps << "\nnics_per_node = " << topology.fabric.nics_per_node
       << "\nintra_latency_us = " << topology.fabric.intra_latency_us << "\nintra_bandwidth_gbps = " << topology.fabric.intra_bandwidth_gbps
       << "\n";
  os << "\n[placement]\npolicy = " << quoted(to_string(placement.policy)) << "\n";
  if (is_eplb(placement.policy))
    os << "physical_slots = " << placement.physical_slots << "\ngroups = " << placement.groups << "\nloads = " << toml_list_of(placement.loads)
       << "\nload_file = " << quoted(placement.load_file) << "\nrebalance_every = " << placement.rebalance_every << "\n";
  os << "replica_policy = " << quoted(to_string(placement.replica_policy)) << "\n";
  for (auto const& s : placement.slots) os << "[[placement.slots]]\nexpert = " << s.expert << "\nrank = " << s.rank << "\n";
  os << "\n[exchange]\nalgorithm = " << quoted(to_string(exchange.algorithm)) << "\ntransport = " << quoted(to_string(exchange.transport))
     << "\nwatchdog_seconds = " << exchange.watchdog_seconds
     << "\nverify_send_rows = " << (exchange.verify_send_rows ? "true" : "false")
     << "\nstage_through_host = " << (exchange.stage_through_host ? "true" : "false")
     << "\npair_runs = " << (exchange.pair_runs ? "true" : "false")
     << "\nreceive_into_experts = " << (exchange.receive_into_experts ? "true" : "false")
     << "\nnode_dedup = " << (exchange.node_dedup ? "true" : "false")
     << "\nwaves = " << exchange.waves << "\nsender_cf = " << exchange.sender_cf << "\nreceiver_cf = " << exchange.receiver_cf << "\n";
  os << "\n[experts]\nrunner = " << quoted(to_string(experts.runner)) << "\ncapacity = " << experts.capacity << "\nalignment = " << experts.alignment
     << "\nblock_size = " << experts.block_size << "\ngemm = " << quoted(to_string(experts.gemm))
     << "\nkernel = " << quoted(to_string(experts.kernel)) << "\ndecode_rows = " << experts.decode_rows << "\nweights = " << quoted(experts.weights)
     << "\nsave_weights = " << quoted(experts.save_weights) << "\nscales = " << toml_list_of(experts.scales) << "\n";
  if (simulate.ranks > 0) os << "\n[simulate]\nranks = " << simulate.ranks << "\n";
  if (run.mode == "serve") {
    os << "\n[serve]\nrank_tokens = " << serve.rank_tokens << "\nslot_routes = " << serve.slot_routes
       << "\ncheck = " << (serve.check ? "true" : "false") << "\nrepeat = " << serve.repeat << "\n";
    auto list = [](std::vector<index_t> const& v) {
      std::ostringstream l;
      l << "[";
      for (std::size_t i = 0; i < v.size(); ++i) l << (i ? ", " : "") << v[i];
      l << "]";
      return l.str();
    };
    for (auto const& st : serve.steps) os << "\n[[serve.step]]\ntokens = " << list(st.decode) << "\nprefill = " << list(st.prefill) << "\n";
  }
  return os.str();
}

LayerDeck read_layer_deck(MPI_Comm comm, std::string const& path) {
  int const rank = comm_rank(comm);
  std::string text;
  std::string problem;
  if (rank == 0) {
    struct stat st;
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      problem = "cannot read deck '" + path + "': " + std::strerror(errno);
    } else if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      problem = "cannot read deck '" + path + "': not a regular file";
    } else {
      std::ostringstream os;
      if (st.st_size > 0) os << in.rdbuf();
      if (in.bad() || (st.st_size > 0 && !os)) problem = "cannot read deck '" + path + "': " + std::strerror(errno);
      text = os.str();
    }
  }
  // Agree on the read before broadcasting, so a missing file fails everywhere.
  agree(comm, problem, "reading the deck");
  text = broadcast_string(comm, text, 0);
  LayerDeck deck;
  collective(comm, "parsing the deck", [&] { deck = parse_layer_deck(path, text, comm_size(comm)); });
  return deck;
}

}  // namespace KokkosMoE
