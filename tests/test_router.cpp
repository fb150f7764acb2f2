// Router: every case of routing.json (group-limited selection with and
// without correction bias, domain-limited top-k, the sign bias update, device
// capacity admission); property tests against a sort-based host reference on
// random configurations (T = 0, k = 1, k = E, odd E, repeated scores);
// determinism; admission against a host reference; load statistics and their
// reduction over MPI_COMM_WORLD; rejected configurations.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Admission.hpp>
#include <KokkosMoE_BiasController.hpp>
#include <KokkosMoE_LoadStats.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_Router.hpp>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace KokkosMoE;

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
using FMat = RowMatrix<float, Mem>;
using HostTable = std::vector<std::vector<int>>;

FMat to_device(std::vector<float> const& v, int rows, int cols) {
  FMat m("m", rows, cols);
  auto h = Kokkos::create_mirror_view(m);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) h(i, j) = v[static_cast<std::size_t>(i) * cols + j];
  Kokkos::deep_copy(m, h);
  return m;
}

template <class View>
auto host_copy(View const& v) {
  auto h = Kokkos::create_mirror(Kokkos::HostSpace(), v);
  Kokkos::deep_copy(h, v);
  return h;
}

void set_bias(Router<Mem>& r, std::vector<float> const& b) {
  auto h = Kokkos::create_mirror_view(r.correction_bias());
  for (std::size_t e = 0; e < b.size(); ++e) h(e) = b[e];
  Kokkos::deep_copy(r.correction_bias(), h);
}

std::vector<int> row_ints(Kokkos::View<int**, Kokkos::LayoutRight, Mem> const& v, int t) {
  auto h = host_copy(v);
  std::vector<int> out;
  for (std::size_t j = 0; j < h.extent(1); ++j) out.push_back(h(t, j));
  return out;
}

std::vector<float> row_floats(Kokkos::View<float**, Kokkos::LayoutRight, Mem> const& v, int t) {
  auto h = host_copy(v);
  std::vector<float> out;
  for (std::size_t j = 0; j < h.extent(1); ++j) out.push_back(h(t, j));
  return out;
}

// ---------------------------------------------------------------------------
// Host reference: plain sorting, written from the definitions.

struct RefResult {
  std::vector<int> experts;  // selection order
  std::vector<float> gates;
  std::vector<int> sets;     // kept groups / domains, best first
};

float sanitize(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

// Orders indices by value descending, then index ascending.
void sort_desc(std::vector<int>& idx, std::vector<float> const& val) {
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    if (val[a] != val[b]) return val[a] > val[b];
    return a < b;
  });
}

float ref_set_score(SetScore mode, int m, std::vector<float> vals) {
  std::sort(vals.begin(), vals.end(), std::greater<float>());
  if (mode == SetScore::max) return vals.empty() ? -std::numeric_limits<float>::infinity() : vals[0];
  int const n = std::min<int>(m, static_cast<int>(vals.size()));
  float s = vals[0];
  for (int i = 1; i < n; ++i) s = s + vals[i];
  return s;
}

RefResult ref_route(RouterConfig const& c, std::vector<float> const& s, std::vector<float> const& bias) {
  int const E = c.num_experts;
  std::vector<float> v(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) v[e] = sanitize(c.use_correction_bias ? s[e] + bias[e] : s[e]);
  std::vector<char> eligible(static_cast<std::size_t>(E), 1);
  RefResult r;
  if (c.group_limited()) {
    int const G = c.num_groups, S = E / G;
    std::vector<float> gs(static_cast<std::size_t>(G));
    for (int g = 0; g < G; ++g)
      gs[g] = sanitize(ref_set_score(c.group_score, c.group_top_m, std::vector<float>(v.begin() + g * S, v.begin() + (g + 1) * S)));
    std::vector<int> order(static_cast<std::size_t>(G));
    std::iota(order.begin(), order.end(), 0);
    sort_desc(order, gs);
    r.sets.assign(order.begin(), order.begin() + c.topk_groups);
    std::fill(eligible.begin(), eligible.end(), 0);
    for (int g : r.sets)
      for (int e = g * S; e < (g + 1) * S; ++e) eligible[e] = 1;
    if (c.group_mask == GroupMask::zero)
      for (int e = 0; e < E; ++e)
        if (!eligible[e]) {
          v[e] = 0.0f;  // the dropped groups' experts compete with 0
          eligible[e] = 1;
        }
  } else if (c.domain_limited()) {
    int const D = c.num_domains();
    std::vector<float> ds(static_cast<std::size_t>(D));
    std::vector<int> nonempty;
    for (int d = 0; d < D; ++d) {
      std::vector<float> vals;
      for (int e = 0; e < E; ++e)
        if (c.expert_domain[e] == d) vals.push_back(v[e]);
      if (vals.empty()) continue;
      ds[d] = sanitize(ref_set_score(c.domain_score, c.domain_top_m, vals));
      nonempty.push_back(d);
    }
    sort_desc(nonempty, ds);
    int const keep = std::min<int>(c.max_domains, static_cast<int>(nonempty.size()));
    r.sets.assign(nonempty.begin(), nonempty.begin() + keep);
    while (static_cast<int>(r.sets.size()) < c.max_domains) r.sets.push_back(-1);
    std::fill(eligible.begin(), eligible.end(), 0);
    for (int e = 0; e < E; ++e)
      if (std::find(r.sets.begin(), r.sets.end(), c.expert_domain[e]) != r.sets.end()) eligible[e] = 1;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (eligible[e]) cand.push_back(e);
  sort_desc(cand, v);
  r.experts.assign(cand.begin(), cand.begin() + c.top_k);
  float sum = 0.0f;
  for (int e : r.experts) sum += s[e];
  for (int e : r.experts) r.gates.push_back((c.normalize && sum > 0.0f) ? s[e] / sum * c.route_scale : s[e] * c.route_scale);
  return r;
}

// Router on identity scores [T, E]; returns the table.
RouteTable<Mem> run_identity(Router<Mem>& router, std::vector<float> const& scores, int T) {
  RouteTable<Mem> table;
  router.route_logits(Exec(), to_device(scores, T, router.config().num_experts), table);
  return table;
}

RouterConfig v3_fixture_config(nlohmann::json const& cfg) {
  RouterConfig c;
  c.num_experts = cfg.at("experts");
  c.top_k = cfg.at("top_k");
  c.num_groups = cfg.at("groups");
  c.topk_groups = cfg.at("topk_groups");
  c.group_score = set_score_from_string(cfg.at("group_score").get<std::string>(), &c.group_top_m);
  c.normalize = cfg.at("normalize");
  c.route_scale = cfg.at("route_scale");
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------
// routing.json

TEST_CASE("routing.json v3_group_limited_bias: groups, experts and gates without and with bias", "[router][fixture]") {
  auto const fx = kmoe_test::fixture("routing.json");
  auto const& cs = fx.at("cases").at(0);
  REQUIRE(cs.at("name") == "v3_group_limited_bias");
  RouterConfig c = v3_fixture_config(cs.at("config"));
  CHECK(c.group_score == SetScore::top_m_sum);
  CHECK(c.group_top_m == 2);
  auto const affinity = cs.at("affinity").get<std::vector<float>>();
  auto const logits = cs.at("logits").get<std::vector<float>>();
  auto const bias = cs.at("correction_bias").get<std::vector<float>>();

  for (bool with_bias : {false, true}) {
    auto const& want = cs.at(with_bias ? "with_bias" : "without_bias");
    auto const groups = want.at("groups").get<std::vector<int>>();
    auto const experts = want.at("experts").get<std::vector<int>>();
    auto const gates = want.at("gates").get<std::vector<double>>();
    for (ScoreFunction sf : {ScoreFunction::identity, ScoreFunction::sigmoid}) {
      RouterConfig cc = c;
      cc.score = sf;
      cc.use_correction_bias = with_bias;
      Router<Mem> router(cc);
      set_bias(router, bias);
      RouteTable<Mem> table;
      router.route_logits(Exec(), to_device(sf == ScoreFunction::identity ? affinity : logits, 1, 12), table);
      INFO("bias " << with_bias << " score " << to_string(sf));
      CHECK(row_ints(router.selected_groups(), 0) == groups);
      CHECK(row_ints(table.expert, 0) == experts);
      auto const g = row_floats(table.gate, 0);
      for (std::size_t j = 0; j < gates.size(); ++j) CHECK(std::fabs(g[j] - gates[j]) <= 1e-6);
      CHECK(table.counts.accepted == 4);
      if (with_bias) {
        // Expert 1 is chosen through its bias but gated with its original score.
        CHECK(std::fabs(g[3] - cs.at("wrong_gate_if_corrected_score_is_used_for_expert_1").get<double>()) > 0.1);
      }
    }
  }
}

TEST_CASE("routing.json v3 case through hidden rows and the logits GEMM", "[router][fixture][gemm]") {
  auto const fx = kmoe_test::fixture("routing.json");
  auto const& cs = fx.at("cases").at(0);
  RouterConfig c = v3_fixture_config(cs.at("config"));
  c.score = ScoreFunction::sigmoid;
  c.use_correction_bias = true;
  auto const logits = cs.at("logits").get<std::vector<float>>();
  // hidden [2, 12] = logits and 2*logits; weight = identity [12, 12].
  std::vector<float> hidden(logits);
  for (float x : logits) hidden.push_back(2.0f * x);
  std::vector<float> eye(144, 0.0f);
  for (int i = 0; i < 12; ++i) eye[static_cast<std::size_t>(i) * 12 + i] = 1.0f;
  for (GemmPath path : {GemmPath::automatic, GemmPath::generic}) {
    Router<Mem> router(c);
    set_bias(router, cs.at("correction_bias").get<std::vector<float>>());
    RouteTable<Mem> table;
    RouteOptions<Mem> opt;
    opt.gemm_path = path;
    router.route(Exec(), to_device(hidden, 2, 12), to_device(eye, 12, 12), table, opt);
    CHECK(row_ints(table.expert, 0) == cs.at("with_bias").at("experts").get<std::vector<int>>());
    auto const g = row_floats(table.gate, 0);
    auto const want = cs.at("with_bias").at("gates").get<std::vector<double>>();
    for (std::size_t j = 0; j < want.size(); ++j) CHECK(std::fabs(g[j] - want[j]) <= 1e-6);
    auto const lg = host_copy(router.logits());
    for (int e = 0; e < 12; ++e) CHECK(lg(1, e) == 2.0f * logits[e]);
  }
  // bf16 hidden and weight (values exact in bf16) give the float result.
  RowMatrix<bf16_t, Mem> hb("hb", 1, 12), wb("wb", 12, 12);
  auto hh = Kokkos::create_mirror_view(hb);
  auto hw = Kokkos::create_mirror_view(wb);
  std::vector<float> vals;
  for (int e = 0; e < 12; ++e) {
    float const x = to_float(to_bf16(logits[e]));
    vals.push_back(x);
    hh(0, e) = to_bf16(x);
    for (int j = 0; j < 12; ++j) hw(e, j) = to_bf16(e == j ? 1.0f : 0.0f);
  }
  Kokkos::deep_copy(hb, hh);
  Kokkos::deep_copy(wb, hw);
  Router<Mem> rb(c), rf(c);
  set_bias(rb, cs.at("correction_bias").get<std::vector<float>>());
  set_bias(rf, cs.at("correction_bias").get<std::vector<float>>());
  RouteTable<Mem> tb, tf;
  rb.route(Exec(), hb, wb, tb);
  rf.route_logits(Exec(), to_device(vals, 1, 12), tf);
  CHECK(row_ints(tb.expert, 0) == row_ints(tf.expert, 0));
  CHECK(row_floats(tb.gate, 0) == row_floats(tf.gate, 0));
}

TEST_CASE("routing.json device_limited_topk: global versus domain-limited top-k", "[router][fixture]") {
  auto const fx = kmoe_test::fixture("routing.json");
  auto const& cs = fx.at("cases").at(1);
  REQUIRE(cs.at("name") == "device_limited_topk");
  auto const& cfg = cs.at("config");
  auto const aff = cs.at("affinity").get<std::vector<float>>();
  auto const dom = cfg.at("expert_domain").get<std::vector<int>>();
  RouterConfig c;
  c.num_experts = cfg.at("experts");
  c.top_k = cfg.at("top_k");
  c.score = ScoreFunction::identity;

  auto touched = [&](std::vector<int> const& ex) {
    std::set<int> d;
    for (int e : ex) d.insert(dom[e]);
    return static_cast<int>(d.size());
  };
  auto score_sum = [&](std::vector<int> const& ex) {
    double s = 0;
    for (int e : ex) s += aff[e];
    return s;
  };
  {
    Router<Mem> router(c);
    auto table = run_identity(router, aff, 1);
    auto const ex = row_ints(table.expert, 0);
    auto const& want = cs.at("global_topk");
    CHECK(ex == want.at("experts").get<std::vector<int>>());
    CHECK(score_sum(ex) == Approx(want.at("score_sum").get<double>()).margin(1e-6));
    CHECK(touched(ex) == want.at("domains_touched").get<int>());
  }
  {
    c.expert_domain = dom;
    c.max_domains = cfg.at("max_domains");
    c.domain_score = set_score_from_string(cfg.at("domain_score").get<std::string>());
    Router<Mem> router(c);
    auto table = run_identity(router, aff, 1);
    auto const ex = row_ints(table.expert, 0);
    auto const& want = cs.at("domain_limited");
    CHECK(row_ints(router.selected_domains(), 0) == want.at("domains").get<std::vector<int>>());
    CHECK(ex == want.at("experts").get<std::vector<int>>());
    CHECK(score_sum(ex) == Approx(want.at("score_sum").get<double>()).margin(1e-6));
    CHECK(touched(ex) == want.at("domains_touched").get<int>());
    CHECK(touched(ex) <= c.max_domains);
  }
}

TEST_CASE("routing.json bias_sign_update, frozen schedule and the proportional rule", "[router][fixture][bias]") {
  auto const fx = kmoe_test::fixture("routing.json");
  auto const& cs = fx.at("cases").at(2);
  REQUIRE(cs.at("name") == "bias_sign_update");
  auto const counts = cs.at("route_counts").get<std::vector<index_t>>();
  auto const delta = cs.at("bias_delta").get<std::vector<double>>();
  double const gamma = cs.at("gamma");
  int const E = static_cast<int>(counts.size());
  Kokkos::View<index_t*, Mem> c("c", E);
  Kokkos::View<float*, Mem> b("b", E);
  auto hc = Kokkos::create_mirror(c);  // a real copy: reused after c is overwritten
  for (int e = 0; e < E; ++e) hc(e) = counts[e];
  Kokkos::deep_copy(c, hc);

  // gamma for two steps, then frozen.
  BiasController ctl(BiasUpdateRule::sign, BiasSchedule::piecewise({{0, gamma}, {2, 0.0}}));
  CHECK(ctl.update(Exec(), Kokkos::View<const index_t*, Mem>(c), b) == gamma);
  auto hb = host_copy(b);
  for (int e = 0; e < E; ++e) CHECK(std::fabs(hb(e) - delta[e]) <= 1e-9);
  ctl.update(Exec(), Kokkos::View<const index_t*, Mem>(c), b);
  CHECK(ctl.update(Exec(), Kokkos::View<const index_t*, Mem>(c), b) == 0.0);
  CHECK(ctl.update(Exec(), Kokkos::View<const index_t*, Mem>(c), b) == 0.0);
  CHECK(ctl.step() == 4);
  hb = host_copy(b);
  for (int e = 0; e < E; ++e) CHECK(std::fabs(hb(e) - 2 * delta[e]) <= 1e-9);

  // sign(0) = 0: perfectly balanced counts leave the bias unchanged.
  Kokkos::deep_copy(c, index_t(3));
  Kokkos::deep_copy(b, 0.25f);
  BiasController(BiasUpdateRule::sign, BiasSchedule::constant(0.5)).update(Exec(), Kokkos::View<const index_t*, Mem>(c), b);
  hb = host_copy(b);
  for (int e = 0; e < E; ++e) CHECK(hb(e) == 0.25f);

  // Proportional: gamma * (mean - c_e) / mean.
  Kokkos::deep_copy(c, hc);
  Kokkos::deep_copy(b, 0.0f);
  BiasController(BiasUpdateRule::proportional, BiasSchedule::constant(0.01))
      .update(Exec(), Kokkos::View<const index_t*, Mem>(c), b);
  hb = host_copy(b);
  double const mean = 8.0 / 12.0;
  for (int e = 0; e < E; ++e) CHECK(hb(e) == Approx(0.01 * (mean - counts[e]) / mean).margin(1e-8));
}

TEST_CASE("bias update after routing changes the next step only", "[router][bias]") {
  RouterConfig c;
  c.num_experts = 16;
  c.top_k = 2;
  c.score = ScoreFunction::sigmoid;
  c.use_correction_bias = true;
  c.num_groups = 4;
  c.topk_groups = 2;
  c.group_score = SetScore::top_m_sum;
  c.normalize = true;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  int const T = 64;
  std::vector<float> lg(static_cast<std::size_t>(T) * 16);
  for (auto& x : lg) x = nd(rng);
  auto logits = to_device(lg, T, 16);
  Router<Mem> router(c);
  RouteTable<Mem> table;
  router.route_logits(Exec(), logits, table);
  auto const e0 = host_copy(table.expert);
  auto const g0 = host_copy(table.gate);
  BiasController ctl(BiasUpdateRule::sign, BiasSchedule::constant(0.5));
  ctl.update(Exec(), Kokkos::View<const index_t*, Mem>(table.expert_counts), router.correction_bias());
  // The table of this step is untouched by the update.
  auto const e1 = host_copy(table.expert);
  auto const g1 = host_copy(table.gate);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 2; ++j) {
      CHECK(e0(t, j) == e1(t, j));
      CHECK(g0(t, j) == g1(t, j));
    }
  // The next step uses the new bias: it equals the reference with that bias.
  auto const hb = host_copy(router.correction_bias());
  std::vector<float> bias(hb.data(), hb.data() + 16);
  router.route_logits(Exec(), logits, table);
  auto const s = host_copy(router.scores());
  auto const e2 = host_copy(table.expert);
  int changed = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<float> row(s.data() + t * 16, s.data() + (t + 1) * 16);
    auto const ref = ref_route(c, row, bias);
    for (int j = 0; j < 2; ++j) {
      CHECK(e2(t, j) == ref.experts[j]);
      changed += e2(t, j) != e0(t, j);
    }
  }
  CHECK(changed > 0);
}

TEST_CASE("routing.json device_capacity_admission: destination rows, capacity and drops", "[router][fixture][admission]") {
  auto const fx = kmoe_test::fixture("routing.json");
  auto const& cs = fx.at("cases").at(3);
  REQUIRE(cs.at("name") == "device_capacity_admission");
  auto const& cfg = cs.at("config");
  auto const& tokens = cs.at("tokens");
  int const T = static_cast<int>(tokens.size());
  int const k = static_cast<int>(tokens.at(0).at("routes").size());
  auto const expert_device = cfg.at("expert_device").get<std::vector<int>>();
  int const E = static_cast<int>(expert_device.size());
  auto const prot_seq = cfg.at("protected_sequences").get<std::vector<int>>();

  RouteTable<Mem> table("t", T, k, E);
  Kokkos::View<std::uint8_t*, Mem> prot("prot", T);
  auto he = Kokkos::create_mirror_view(table.expert);
  auto hg = Kokkos::create_mirror_view(table.gate);
  auto hp = Kokkos::create_mirror_view(prot);
  for (int t = 0; t < T; ++t) {
    auto const& tk = tokens.at(t);
    REQUIRE(tk.at("token") == t);
    hp(t) = std::count(prot_seq.begin(), prot_seq.end(), tk.at("sequence").get<int>()) ? 1 : 0;
    for (int j = 0; j < k; ++j) {
      he(t, j) = tk.at("routes").at(j).at("expert");
      hg(t, j) = tk.at("routes").at(j).at("gate");
    }
  }
  Kokkos::deep_copy(table.expert, he);
  Kokkos::deep_copy(table.gate, hg);
  Kokkos::deep_copy(prot, hp);

  AdmissionConfig ac;
  ac.policy = AdmissionPolicy::device_capacity;
  ac.capacity_factor = cfg.at("capacity_factor");
  ac.num_devices = cfg.at("devices");
  ac.expert_device = expert_device;
  auto const stats = admit(Exec(), ac, table, {}, prot);
  auto const& want = cs.at("expected");
  CHECK(stats.units == want.at("destination_rows_per_device").get<std::vector<index_t>>());
  CHECK(stats.capacity == want.at("capacity_per_device").get<index_t>());
  CHECK(table.counts.attempted == want.at("selected_routes").get<index_t>());
  CHECK(table.counts.accepted == want.at("executed_routes").get<index_t>());
  CHECK(table.counts.dropped == table.counts.attempted - table.counts.accepted);

  // Dropped destination rows are exactly the listed (token, device) pairs.
  auto const acc = host_copy(table.accepted);
  std::set<std::pair<int, int>> dropped_rows, want_rows;
  for (auto const& r : want.at("dropped_destination_rows"))
    want_rows.insert(std::make_pair(r.at("token").get<int>(), r.at("device").get<int>()));
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j)
      if (!acc(t, j)) dropped_rows.insert({t, expert_device[he(t, j)]});
  CHECK(dropped_rows == want_rows);
  // A dropped row drops every route of that token to that device, nothing else.
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j)
      CHECK((acc(t, j) == 0) == (dropped_rows.count({t, expert_device[he(t, j)]}) == 1));
  index_t dropped_units = 0;
  for (index_t d : stats.dropped_units) dropped_units += d;
  CHECK(dropped_units == static_cast<index_t>(want_rows.size()));

  // Gates are not renormalized: token 0's routed mass goes 0.79 -> 0.55.
  auto const g = host_copy(table.gate);
  double before = 0, after = 0;
  for (int j = 0; j < k; ++j) {
    before += g(0, j);
    after += acc(0, j) ? g(0, j) : 0.0f;
    CHECK(g(0, j) == hg(0, j));
  }
  CHECK(before == Approx(want.at("token0_routed_gate_mass").at("before").get<double>()).margin(1e-6));
  CHECK(after == Approx(want.at("token0_routed_gate_mass").at("after").get<double>()).margin(1e-6));
  auto const cnt = host_copy(table.expert_counts);
  std::vector<index_t> want_cnt(static_cast<std::size_t>(E), 0);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j)
      if (acc(t, j)) ++want_cnt[he(t, j)];
  for (int e = 0; e < E; ++e) CHECK(cnt(e) == want_cnt[e]);

  // Without protection token 2's row on device 1 competes on priority alone:
  // rows (1,d1)=0.40 and (2,d1)=0.49 survive, (0,d1)=0.24 is dropped again.
  admit(Exec(), ac, table);
  CHECK(table.counts.accepted == 11);
}

// ---------------------------------------------------------------------------
// Property tests

namespace {

struct Case {
  RouterConfig config;
  int T;
  int levels;  // > 0: scores drawn from `levels` values (ties)
};

RouterConfig random_config(std::mt19937& rng, int E) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RouterConfig c;
  c.num_experts = E;
  c.score = ScoreFunction::identity;
  c.use_correction_bias = pick(0, 1) == 1;
  c.normalize = pick(0, 1) == 1;
  c.route_scale = pick(0, 1) ? 1.0f : 2.5f;
  int const mode = pick(0, 2);
  if (mode == 1) {
    std::vector<int> divisors;
    for (int g = 1; g <= E; ++g)
      if (E % g == 0) divisors.push_back(g);
    c.num_groups = divisors[static_cast<std::size_t>(pick(0, static_cast<int>(divisors.size()) - 1))];
    c.topk_groups = pick(1, c.num_groups);
    int const gsize = E / c.num_groups;
    int const which = pick(0, 2);
    c.group_score = which == 0 ? SetScore::max : SetScore::top_m_sum;
    c.group_top_m = which == 0 ? 2 : std::min(gsize, pick(1, 4));
    if (c.topk_groups == c.num_groups && pick(0, 1)) c.group_score = SetScore::none;
    if (c.group_limited() && pick(0, 1)) c.group_mask = GroupMask::zero;
  } else if (mode == 2) {
    int const D = pick(1, std::min(E, 9));
    c.expert_domain.resize(static_cast<std::size_t>(E));
    for (auto& d : c.expert_domain) d = pick(0, D - 1);
    c.max_domains = pick(1, c.num_domains());
    c.domain_score = pick(0, 1) ? SetScore::max : SetScore::top_m_sum;
    c.domain_top_m = pick(1, 3);
  }
  int const eligible = c.min_eligible_experts();
  int const r = pick(0, 3);
  c.top_k = r == 0 ? 1 : r == 1 ? eligible : pick(1, eligible);
  return c;
}

std::vector<float> random_scores(std::mt19937& rng, std::size_t n, int levels) {
  std::vector<float> v(n);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& x : v) x = levels > 0 ? static_cast<float>(std::uniform_int_distribution<int>(0, levels - 1)(rng)) / levels : u(rng);
  return v;
}

void check_against_reference(Case const& cs, std::mt19937& rng) {
  RouterConfig const& c = cs.config;
  int const E = c.num_experts, T = cs.T, k = c.top_k;
  auto const scores = random_scores(rng, static_cast<std::size_t>(T) * E, cs.levels);
  auto const bias = random_scores(rng, static_cast<std::size_t>(E), cs.levels > 0 ? 4 : 0);
  Router<Mem> router(c);
  set_bias(router, bias);
  auto table = run_identity(router, scores, T);
  INFO("E=" << E << " T=" << T << " k=" << k << " groups=" << c.num_groups << "/" << c.topk_groups << " "
            << to_string(c.group_score) << " m=" << c.group_top_m << " domains=" << c.num_domains() << "/"
            << c.max_domains << " " << to_string(c.domain_score) << " dm=" << c.domain_top_m << " bias="
            << c.use_correction_bias << " levels=" << cs.levels);
  REQUIRE(table.num_tokens() == T);
  auto const ex = host_copy(table.expert);
  auto const gt = host_copy(table.gate);
  auto const acc = host_copy(table.accepted);
  auto const cnt = host_copy(table.expert_counts);
  Kokkos::View<int**, Kokkos::LayoutRight, Mem> sets =
      c.group_limited() ? router.selected_groups() : router.selected_domains();
  auto const hs = host_copy(sets);
  std::vector<index_t> want_cnt(static_cast<std::size_t>(E), 0);
  int bad = 0;
  for (int t = 0; t < T; ++t) {
    std::vector<float> row(scores.begin() + static_cast<std::ptrdiff_t>(t) * E,
                           scores.begin() + static_cast<std::ptrdiff_t>(t + 1) * E);
    auto const ref = ref_route(c, row, bias);
    for (int j = 0; j < k; ++j) {
      if (ex(t, j) != ref.experts[j] || std::fabs(gt(t, j) - ref.gates[j]) > 1e-6f || !acc(t, j)) ++bad;
      ++want_cnt[ref.experts[j]];
    }
    if (c.group_limited() || c.domain_limited())
      for (std::size_t j = 0; j < ref.sets.size(); ++j)
        if (hs(t, j) != ref.sets[j]) ++bad;
    if (c.domain_limited()) {
      std::set<int> doms;
      for (int j = 0; j < k; ++j) doms.insert(c.expert_domain[ex(t, j)]);
      if (static_cast<int>(doms.size()) > c.max_domains) ++bad;
    }
  }
  CHECK(bad == 0);
  for (int e = 0; e < E; ++e) CHECK(cnt(e) == want_cnt[e]);
  CHECK(table.counts.attempted == static_cast<index_t>(T) * k);
  CHECK(table.counts.accepted == static_cast<index_t>(T) * k);
  CHECK(table.counts.dropped == 0);

  // Identical on a repeated run (fresh router and table).
  Router<Mem> again(c);
  set_bias(again, bias);
  auto table2 = run_identity(again, scores, T);
  auto const ex2 = host_copy(table2.expert);
  auto const gt2 = host_copy(table2.gate);
  int diff = 0;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) diff += (ex2(t, j) != ex(t, j)) + (gt2(t, j) != gt(t, j));
  CHECK(diff == 0);
}

}  // namespace

TEST_CASE("router matches a sort-based host reference on random configurations", "[router][property]") {
  std::mt19937 rng(20240611);
  int cases = 0;
  for (int E : {1, 2, 3, 7, 8, 12, 13, 16, 30, 64, 100, 256}) {
    for (int rep = 0; rep < 12; ++rep) {
      Case cs;
      cs.config = random_config(rng, E);
      int const tsel = rep % 4;
      cs.T = tsel == 0 ? 0 : tsel == 1 ? 1 : tsel == 2 ? 37 : 160;
      cs.levels = rep % 3 == 0 ? 0 : (rep % 3 == 1 ? 3 : 16);
      check_against_reference(cs, rng);
      ++cases;
    }
  }
  // k = E without limits, and with every group kept.
  for (int E : {5, 24}) {
    Case cs;
    cs.config.num_experts = E;
    cs.config.top_k = E;
    cs.config.score = ScoreFunction::identity;
    cs.T = 9;
    cs.levels = 2;
    check_against_reference(cs, rng);
    cs.config.num_groups = 4;
    cs.config.topk_groups = 4;
    if (E % 4 == 0) check_against_reference(cs, rng);
    ++cases;
  }
  CHECK(cases > 100);
}

TEST_CASE("all-equal scores: every tie goes to the lower index", "[router][ties]") {
  RouterConfig c;
  c.num_experts = 12;
  c.top_k = 3;
  c.score = ScoreFunction::identity;
  c.num_groups = 4;
  c.topk_groups = 2;
  c.group_score = SetScore::top_m_sum;
  Router<Mem> router(c);
  auto table = run_identity(router, std::vector<float>(24, 0.5f), 2);
  for (int t = 0; t < 2; ++t) {
    CHECK(row_ints(router.selected_groups(), t) == std::vector<int>{0, 1});
    CHECK(row_ints(table.expert, t) == std::vector<int>{0, 1, 2});
  }
  // NaN scores count as -infinity: never chosen before a finite score.
  std::vector<float> s(12, std::numeric_limits<float>::quiet_NaN());
  s[11] = 0.1f;
  s[7] = 0.2f;
  RouterConfig c2 = c;
  c2.num_groups = 1;
  c2.topk_groups = 1;
  c2.group_score = SetScore::none;
  Router<Mem> r2(c2);
  auto t2 = run_identity(r2, s, 1);
  CHECK(row_ints(t2.expert, 0) == std::vector<int>{7, 11, 0});
}

TEST_CASE("softmax and sigmoid scores agree with an fp64 reference; selection uses them", "[router][scores]") {
  std::mt19937 rng(99);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (ScoreFunction sf : {ScoreFunction::softmax, ScoreFunction::sigmoid}) {
    RouterConfig c;
    c.num_experts = 40;
    c.top_k = 6;
    c.score = sf;
    c.num_groups = 8;
    c.topk_groups = 3;
    c.group_score = SetScore::max;
    c.normalize = sf == ScoreFunction::sigmoid;
    int const T = 50;
    std::vector<float> lg(static_cast<std::size_t>(T) * 40);
    for (auto& x : lg) x = nd(rng);
    Router<Mem> router(c);
    RouteTable<Mem> table;
    router.route_logits(Exec(), to_device(lg, T, 40), table);
    auto const s = host_copy(router.scores());
    auto const ex = host_copy(table.expert);
    auto const aff = host_copy(router.selected_scores());
    double worst = 0;
    int bad = 0;
    for (int t = 0; t < T; ++t) {
      double mx = -1e300, sum = 0;
      for (int e = 0; e < 40; ++e) mx = std::max(mx, double(lg[t * 40 + e]));
      for (int e = 0; e < 40; ++e) sum += std::exp(double(lg[t * 40 + e]) - mx);
      std::vector<float> row;
      for (int e = 0; e < 40; ++e) {
        double const x = lg[t * 40 + e];
        double const ref = sf == ScoreFunction::softmax ? std::exp(x - mx) / sum : 1.0 / (1.0 + std::exp(-x));
        worst = std::max(worst, std::fabs(ref - s(t, e)));
        row.push_back(s(t, e));
      }
      auto const ref = ref_route(c, row, std::vector<float>(40, 0.0f));
      for (int j = 0; j < 6; ++j) {
        bad += ex(t, j) != ref.experts[j];
        bad += aff(t, j) != s(t, ex(t, j));
      }
    }
    CHECK(worst < 1e-6);
    CHECK(bad == 0);
  }
}

// ---------------------------------------------------------------------------
// Admission against a host reference

namespace {

// Host reference of both capacity policies: sort units per bucket.
std::vector<std::vector<char>> ref_admit(AdmissionConfig const& ac, HostTable const& ex, std::vector<std::vector<float>> const& pr,
                                         std::vector<char> const& prot, int E, index_t* cap_out) {
  int const T = static_cast<int>(ex.size());
  int const k = T ? static_cast<int>(ex[0].size()) : 0;
  std::vector<std::vector<char>> acc(static_cast<std::size_t>(T), std::vector<char>(static_cast<std::size_t>(k), 1));
  struct Unit {
    int token;
    float prio;
    bool prot;
  };
  auto order = [](Unit const& a, Unit const& b) {
    if (a.prot != b.prot) return a.prot;
    if (a.prio != b.prio) return a.prio > b.prio;
    return a.token < b.token;
  };
  if (ac.policy == AdmissionPolicy::expert_capacity) {
    index_t const cap = static_cast<index_t>(std::ceil(ac.capacity_factor * T * k / E));
    *cap_out = cap;
    std::vector<std::vector<Unit>> b(static_cast<std::size_t>(E));
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) b[ex[t][j]].push_back({t, pr[t][j], prot[t] != 0});
    for (auto& v : b) {
      std::sort(v.begin(), v.end(), order);
      for (std::size_t i = static_cast<std::size_t>(cap); i < v.size(); ++i)
        for (int j = 0; j < k; ++j)
          if (ex[v[i].token][j] == &v - &b[0]) acc[v[i].token][j] = 0;
    }
  } else {
    int const D = ac.num_devices;
    std::vector<std::vector<Unit>> b(static_cast<std::size_t>(D));
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d) {
        bool any = false;
        float p = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < k; ++j)
          if (ac.expert_device[ex[t][j]] == d) {
            any = true;
            p = std::max(p, pr[t][j]);
          }
        if (any) b[d].push_back({t, p, prot[t] != 0});
      }
    index_t rows = 0;
    for (auto& v : b) rows += static_cast<index_t>(v.size());
    index_t const cap = static_cast<index_t>(std::ceil(ac.capacity_factor * rows / D));
    *cap_out = cap;
    for (int d = 0; d < D; ++d) {
      auto& v = b[d];
      std::sort(v.begin(), v.end(), order);
      for (std::size_t i = static_cast<std::size_t>(cap); i < v.size(); ++i)
        for (int j = 0; j < k; ++j)
          if (ac.expert_device[ex[v[i].token][j]] == d) acc[v[i].token][j] = 0;
    }
  }
  return acc;
}

}  // namespace

TEST_CASE("expert and device capacity admission match a host reference", "[router][admission][property]") {
  std::mt19937 rng(31337);
  for (int rep = 0; rep < 24; ++rep) {
    int const E = std::vector<int>{4, 8, 13, 32}[static_cast<std::size_t>(rep % 4)];
    int const T = std::vector<int>{0, 1, 50, 300}[static_cast<std::size_t>((rep / 4) % 4)];
    RouterConfig c;
    c.num_experts = E;
    c.top_k = std::min(E, 1 + rep % 4);
    c.score = ScoreFunction::identity;
    c.normalize = true;
    AdmissionConfig& ac = c.admission;
    ac.policy = rep % 2 ? AdmissionPolicy::expert_capacity : AdmissionPolicy::device_capacity;
    ac.capacity_factor = std::vector<double>{0.5, 1.0, 1.25}[static_cast<std::size_t>(rep % 3)];
    ac.num_devices = 1 + rep % 5;
    ac.expert_device.resize(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) ac.expert_device[e] = e * ac.num_devices / E;
    // Skewed, tied scores so that capacity binds and priorities tie.
    std::vector<float> s(static_cast<std::size_t>(T) * E);
    std::uniform_int_distribution<int> lvl(0, 5);
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) s[static_cast<std::size_t>(t) * E + e] = float(lvl(rng)) / 5.0f + (e < 2 ? 1.0f : 0.0f);
    Kokkos::View<std::uint8_t*, Mem> prot("prot", T);
    auto hp = Kokkos::create_mirror_view(prot);
    std::vector<char> protv(static_cast<std::size_t>(T));
    for (int t = 0; t < T; ++t) hp(t) = protv[t] = (t % 7 == 3);
    Kokkos::deep_copy(prot, hp);

    Router<Mem> router(c);
    RouteTable<Mem> table;
    RouteOptions<Mem> opt;
    opt.protected_tokens = prot;
    auto const stats = router.route_logits(Exec(), to_device(s, T, E), table, opt);
    auto const ex = host_copy(table.expert);
    auto const pr = host_copy(router.selected_scores());
    auto const acc = host_copy(table.accepted);
    auto const cnt = host_copy(table.expert_counts);
    HostTable hex(static_cast<std::size_t>(T));
    std::vector<std::vector<float>> hpr(static_cast<std::size_t>(T));
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < c.top_k; ++j) {
        hex[t].push_back(ex(t, j));
        hpr[t].push_back(pr(t, j));
      }
    index_t cap = 0;
    auto const want = ref_admit(ac, hex, hpr, protv, E, &cap);
    INFO("rep " << rep << " E=" << E << " T=" << T << " k=" << c.top_k << " " << to_string(ac.policy) << " cf="
                << ac.capacity_factor << " devices=" << ac.num_devices);
    CHECK(stats.capacity == cap);
    int bad = 0;
    index_t accepted = 0;
    std::vector<index_t> want_cnt(static_cast<std::size_t>(E), 0);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < c.top_k; ++j) {
        bad += (acc(t, j) != 0) != (want[t][j] != 0);
        if (want[t][j]) {
          ++accepted;
          ++want_cnt[hex[t][j]];
        }
      }
    CHECK(bad == 0);
    for (int e = 0; e < E; ++e) CHECK(cnt(e) == want_cnt[e]);
    CHECK(table.counts.attempted == static_cast<index_t>(T) * c.top_k);
    CHECK(table.counts.accepted == accepted);
    CHECK(table.counts.dropped == table.counts.attempted - accepted);
    index_t units = 0, dropped_units = 0;
    for (std::size_t b = 0; b < stats.units.size(); ++b) {
      units += stats.units[b];
      dropped_units += stats.dropped_units[b];
      CHECK(stats.units[b] - stats.dropped_units[b] <= cap);
    }
    if (ac.policy == AdmissionPolicy::expert_capacity) CHECK(dropped_units == table.counts.dropped);
    CHECK(dropped_units <= units);
  }
}

// ---------------------------------------------------------------------------
// Load statistics

TEST_CASE("sequence balance loss matches its definition", "[router][loadstats]") {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  RouterConfig c;
  c.num_experts = 24;
  c.top_k = 4;
  c.score = ScoreFunction::sigmoid;
  int const T = 70;
  std::vector<float> lg(static_cast<std::size_t>(T) * 24);
  for (auto& x : lg) x = nd(rng);
  Router<Mem> router(c);
  RouteTable<Mem> table;
  router.route_logits(Exec(), to_device(lg, T, 24), table);
  double const alpha = 1e-4;
  auto const bl = sequence_balance_loss(Exec(), router.scores(), table.expert, alpha);
  auto const s = host_copy(router.scores());
  auto const ex = host_copy(table.expert);
  std::vector<double> f(24, 0.0), P(24, 0.0);
  for (int t = 0; t < T; ++t) {
    double rs = 0;
    for (int e = 0; e < 24; ++e) rs += s(t, e);
    for (int e = 0; e < 24; ++e) P[e] += s(t, e) / rs / T;
    for (int j = 0; j < 4; ++j) f[ex(t, j)] += 24.0 / (4.0 * T);
  }
  double loss = 0;
  for (int e = 0; e < 24; ++e) {
    CHECK(bl.f[e] == Approx(f[e]).epsilon(1e-12));
    CHECK(bl.P[e] == Approx(P[e]).epsilon(1e-9));
    loss += f[e] * P[e];
  }
  CHECK(bl.loss == Approx(alpha * loss).epsilon(1e-9));
  // Uniform scores and perfectly balanced selection give L = alpha.
  double fsum = 0;
  for (double x : bl.f) fsum += x;
  CHECK(fsum == Approx(24.0));
  // Reproducible bit for bit.
  auto const again = sequence_balance_loss(Exec(), router.scores(), table.expert, alpha);
  CHECK(again.loss == bl.loss);
  // T = 0.
  RouteTable<Mem> empty;
  router.route_logits(Exec(), FMat("z", 0, 24), empty);
  CHECK(sequence_balance_loss(Exec(), router.scores(), empty.expert, alpha).loss == 0.0);
  CHECK(empty.counts.attempted == 0);
}

TEST_CASE("expert counts reduced over MPI_COMM_WORLD equal the sum over ranks", "[router][loadstats][mpi]") {
  int const me = kmoe_test::world_rank(), np = kmoe_test::world_size();
  RouterConfig c;
  c.num_experts = 20;
  c.top_k = 3;
  c.score = ScoreFunction::identity;
  c.num_groups = 5;
  c.topk_groups = 2;
  c.group_score = SetScore::top_m_sum;
  auto inputs_of = [&](int rank) {
    std::mt19937 rng(1000 + static_cast<unsigned>(rank));
    int const T = rank == 1 ? 0 : 20 + 7 * rank;  // rank 1 has no tokens
    return std::make_pair(T, random_scores(rng, static_cast<std::size_t>(T) * 20, 8));
  };
  auto const mine = inputs_of(me);
  Router<Mem> router(c);
  auto table = run_identity(router, mine.second, mine.first);
  auto const global = reduce_expert_counts(Exec(), Kokkos::View<const index_t*, Mem>(table.expert_counts), MPI_COMM_WORLD);
  auto const total = reduce_route_counts(table.counts, MPI_COMM_WORLD);
  // Expected: every rank's inputs routed by the host reference.
  std::vector<index_t> want(20, 0);
  index_t routes = 0;
  for (int r = 0; r < np; ++r) {
    auto const in = inputs_of(r);
    for (int t = 0; t < in.first; ++t) {
      std::vector<float> row(in.second.begin() + t * 20, in.second.begin() + (t + 1) * 20);
      for (int e : ref_route(c, row, std::vector<float>(20, 0.0f)).experts) ++want[e];
      routes += 3;
    }
  }
  auto const hg = host_copy(global);
  for (int e = 0; e < 20; ++e) CHECK(hg(e) == want[e]);
  CHECK(total.attempted == routes);
  CHECK(total.accepted == routes);
  CHECK(total.dropped == 0);
  // The local counts are left as they were.
  auto const local = host_copy(table.expert_counts);
  index_t lsum = 0;
  for (int e = 0; e < 20; ++e) lsum += local(e);
  CHECK(lsum == static_cast<index_t>(mine.first) * 3);
}

// ---------------------------------------------------------------------------
// Configuration errors

namespace {

void expect_error(RouterConfig const& c, std::string const& text) {
  std::string msg;
  try {
    Router<Mem> r(c);
  } catch (Error const& e) {
    msg = e.what();
  }
  INFO("message: " << msg);
  CHECK_THAT(msg, Catch::Matchers::Contains(text));
}

RouterConfig base() {
  RouterConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.num_groups = 4;
  c.topk_groups = 2;
  c.group_score = SetScore::top_m_sum;
  return c;
}

}  // namespace

TEST_CASE("bad router configurations are rejected with clear messages", "[router][errors]") {
  RouterConfig c = base();
  c.top_k = 9;
  expect_error(c, "top_k 9 > eligible experts 8");
  c = base();
  c.top_k = 17;
  expect_error(c, "top_k 17 > num_experts 16");
  c = base();
  c.top_k = 0;
  expect_error(c, "top_k must be >= 1 (got 0)");
  c = base();
  c.num_groups = 3;
  expect_error(c, "num_groups 3 does not divide num_experts 16");
  c = base();
  c.topk_groups = 5;
  expect_error(c, "topk_groups 5 > num_groups 4");
  c = base();
  c.group_score = SetScore::none;
  expect_error(c, "needs a group score");
  c = base();
  c.group_top_m = 5;
  expect_error(c, "group_top_m 5 must be in [1, min(16, group size 4)]");
  c = base();
  c.route_scale = -2.5f;
  expect_error(c, "route_scale must be finite and > 0 (got -2.5)");
  c = base();
  c.num_experts = 0;
  expect_error(c, "num_experts must be >= 1 (got 0)");
  c = base();
  c.admission.policy = AdmissionPolicy::expert_capacity;
  c.admission.capacity_factor = -1.0;
  expect_error(c, "capacity_factor must be finite and > 0 (got -1)");
  c = base();
  c.admission.policy = AdmissionPolicy::device_capacity;
  c.admission.num_devices = 2;
  c.admission.expert_device = {0, 1};
  expect_error(c, "expert_device has 2 entries for 16 experts");
  // Domain limits.
  RouterConfig d;
  d.num_experts = 8;
  d.top_k = 3;
  d.expert_domain = {0, 0, 1, 1, 2, 2, 3};
  d.max_domains = 2;
  expect_error(d, "expert_domain has 7 entries for 8 experts");
  d.expert_domain = {0, 0, 1, 1, 2, 2, 3, 3};
  d.max_domains = 5;
  expect_error(d, "max_domains 5 > number of domains 4");
  d.max_domains = 1;
  expect_error(d, "top_k 3 > eligible experts 2");
  d.max_domains = -1;
  expect_error(d, "max_domains must be >= 0 (got -1)");
  d.max_domains = 2;
  d.expert_domain[3] = -4;
  expect_error(d, "expert_domain[3] = -4");
  d.expert_domain[3] = 1;
  d.num_groups = 2;
  d.topk_groups = 1;
  d.group_score = SetScore::max;
  expect_error(d, "cannot be combined");
  // Names.
  std::string msg;
  try {
    from_string<ScoreFunction>("relu");
  } catch (Error const& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Catch::Matchers::Contains("unknown score function 'relu'"));
  int m = 0;
  CHECK(set_score_from_string("top3_sum", &m) == SetScore::top_m_sum);
  CHECK(m == 3);
  CHECK_THROWS_AS(BiasSchedule::constant(-0.1), Error);
  CHECK_THROWS_AS(BiasSchedule::piecewise({{0, 0.1}, {0, 0.0}}), Error);
  // Wrong extents at call time.
  Router<Mem> r(base());
  RouteTable<Mem> t;
  msg.clear();
  try {
    r.route_logits(Exec(), FMat("x", 3, 15), t);
  } catch (Error const& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Catch::Matchers::Contains("logits are 3x15, expected 3x16"));
}

TEST_CASE("expert domains from a placement", "[router][placement]") {
  auto p = Placement::contiguous(8, 4, {0, 0, 1, 1});
  CHECK(expert_domains(p, false) == std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3});
  CHECK(expert_domains(p, true) == std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1});
  std::vector<SlotInfo> slots;
  auto slot = [](int expert, int rank) {
    SlotInfo s;
    s.expert = expert;
    s.rank = rank;
    return s;
  };
  for (int e = 0; e < 4; ++e) slots.push_back(slot(e, e % 2));
  slots.push_back(slot(0, 1));
  Placement rep(4, 2, slots);
  CHECK_THROWS_WITH(expert_domains(rep, false), Catch::Matchers::Contains("expert 0 has copies on ranks 0 and 1"));
}

TEST_CASE("admission: a huge capacity factor admits every route (the capacity saturates, never wraps)", "[router][admission]") {
  int const T = 40, k = 2, E = 4;
  for (AdmissionPolicy policy : {AdmissionPolicy::expert_capacity, AdmissionPolicy::device_capacity}) {
    for (double cf : {1e6, 1e19, 1e300}) {
      INFO(to_string(policy) << " cf " << cf);
      RouteTable<Mem> table("t", T, k, E);
      auto he = Kokkos::create_mirror_view(table.expert);
      auto hg = Kokkos::create_mirror_view(table.gate);
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < k; ++j) {
          he(t, j) = (j == 0 ? 0 : 1 + t % 3);  // expert 0 is hot: every token's first route
          hg(t, j) = 0.5f;
        }
      Kokkos::deep_copy(table.expert, he);
      Kokkos::deep_copy(table.gate, hg);
      Kokkos::deep_copy(table.accepted, 1);
      AdmissionConfig c;
      c.policy = policy;
      c.capacity_factor = cf;
      c.num_devices = 2;
      c.expert_device = {0, 0, 1, 1};
      auto const stats = admit(c, table);
      CHECK(table.counts.dropped == 0);
      CHECK(table.counts.accepted == T * k);
      CHECK(stats.capacity >= 0);
    }
  }
}

TEST_CASE("group_mask: exclude and zero differ where a kept expert's score plus bias is below zero", "[router][groups]") {
  // 3 groups of 2, one kept (top-2 sums of score + bias: 0.2, 0.1, 0.04),
  // k = 2. Expert 1 is kept but its score plus bias is -0.4: excluded
  // groups leave it the second choice; zeroed ones let expert 2 (0.0, the
  // lowest index of the dropped groups) win over it. Gates are scores.
  RouterConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.score = ScoreFunction::identity;
  c.use_correction_bias = true;
  c.num_groups = 3;
  c.topk_groups = 1;
  c.group_score = SetScore::top_m_sum;
  c.group_top_m = 2;
  std::vector<float> const scores = {0.6f, 0.1f, 0.05f, 0.05f, 0.02f, 0.02f};
  std::vector<float> const bias = {0.0f, -0.5f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (GroupMask mask : {GroupMask::exclude, GroupMask::zero}) {
    c.group_mask = mask;
    Router<Mem> router(c);
    set_bias(router, bias);
    auto const table = run_identity(router, scores, 1);
    auto const want = mask == GroupMask::exclude ? std::vector<int>{0, 1} : std::vector<int>{0, 2};
    CHECK(row_ints(table.expert, 0) == want);
    CHECK(row_floats(table.gate, 0) == std::vector<float>{0.6f, mask == GroupMask::exclude ? 0.1f : 0.05f});
    auto const ref = ref_route(c, scores, bias);
    CHECK(ref.experts == want);
  }
  CHECK(to_string(GroupMask::zero) == "zero");
  CHECK(from_string<GroupMask>("exclude") == GroupMask::exclude);
}

TEST_CASE("team and thread selection mappings give the same bits", "[router][mapping]") {
  // The team mapping (a team of vector lanes per token, the GPU kernel) and
  // the thread mapping (one thread per token) on the same inputs: experts,
  // gates, scores, selected scores and kept groups/domains bit for bit,
  // including NaN and infinite logits, ties, empty domains, T = 0.
  std::mt19937 rng(77);
  auto bits = [](float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  };
  int cases = 0;
  for (int E : {1, 3, 7, 16, 33, 64, 100, 256}) {
    for (int rep = 0; rep < 8; ++rep) {
      RouterConfig c = random_config(rng, E);
      if (c.top_k > 16) c.top_k = 16;
      c.score = rep % 3 == 0 ? ScoreFunction::softmax : rep % 3 == 1 ? ScoreFunction::sigmoid : ScoreFunction::identity;
      int const T = rep % 4 == 0 ? 0 : rep % 4 == 1 ? 1 : rep % 4 == 2 ? 37 : 130;
      std::normal_distribution<float> nd(0.0f, 3.0f);
      std::vector<float> logits(static_cast<std::size_t>(T) * E);
      for (auto& x : logits) x = rep % 2 ? std::round(nd(rng)) : nd(rng);  // rounded: many ties
      if (T > 1) {
        logits[static_cast<std::size_t>(E) - 1] = std::numeric_limits<float>::quiet_NaN();
        logits[static_cast<std::size_t>(E)] = -std::numeric_limits<float>::infinity();
      }
      auto const bias = random_scores(rng, static_cast<std::size_t>(E), 4);
      INFO("E=" << E << " T=" << T << " k=" << c.top_k << " score=" << to_string(c.score) << " groups=" << c.num_groups
                << "/" << c.topk_groups << " domains=" << c.num_domains() << "/" << c.max_domains);
      RouterConfig ct = c, cm = c;
      ct.select_mapping = SelectMapping::thread;
      cm.select_mapping = SelectMapping::team;
      Router<Mem> rt(ct), rm(cm);
      set_bias(rt, bias);
      set_bias(rm, bias);
      auto const lg = to_device(logits, T, E);
      RouteTable<Mem> at, am;
      rt.route_logits(Exec(), lg, at);
      rm.route_logits(Exec(), lg, am);
      auto const e1 = host_copy(at.expert), e2 = host_copy(am.expert);
      auto const g1 = host_copy(at.gate), g2 = host_copy(am.gate);
      auto const s1 = host_copy(rt.scores()), s2 = host_copy(rm.scores());
      auto const a1 = host_copy(rt.selected_scores()), a2 = host_copy(rm.selected_scores());
      int diff = 0;
      for (int t = 0; t < T; ++t) {
        for (int j = 0; j < c.top_k; ++j)
          diff += (e1(t, j) != e2(t, j)) + (bits(g1(t, j)) != bits(g2(t, j))) + (bits(a1(t, j)) != bits(a2(t, j)));
        for (int e = 0; e < E; ++e) diff += bits(s1(t, e)) != bits(s2(t, e)) && !(s1(t, e) != s1(t, e) && s2(t, e) != s2(t, e));
      }
      if (c.group_limited() || c.domain_limited()) {
        auto const k1 = host_copy(c.group_limited() ? rt.selected_groups() : rt.selected_domains());
        auto const k2 = host_copy(c.group_limited() ? rm.selected_groups() : rm.selected_domains());
        for (int t = 0; t < T; ++t)
          for (std::size_t j = 0; j < k1.extent(1); ++j) diff += k1(t, j) != k2(t, j);
      }
      CHECK(diff == 0);
      ++cases;
    }
  }
  CHECK(cases == 64);
  // The team mapping keeps at most 16 experts per token.
  RouterConfig big;
  big.num_experts = 32;
  big.top_k = 17;
  big.select_mapping = SelectMapping::team;
  CHECK_THROWS_WITH(Router<Mem>(big), Catch::Matchers::Contains("team selection mapping keeps at most 16"));
}
