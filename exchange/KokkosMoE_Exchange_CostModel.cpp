#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_CostModel.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>

namespace KokkosMoE {
namespace Exchange {

namespace {

using json = nlohmann::json;

json link_json(LinkCost const& l) { return {{"alpha_s", l.alpha_s}, {"beta_s_per_byte", l.beta_s_per_byte}}; }

LinkCost link_from(json const& j, std::string const& key, std::string const& where) {
  KOKKOSMOE_REQUIRE(j.contains(key) && j.at(key).is_object(), where << ": cost model has no \"" << key << "\" object");
  LinkCost l;
  for (auto [name, field] : {std::pair<char const*, double*>{"alpha_s", &l.alpha_s}, {"beta_s_per_byte", &l.beta_s_per_byte}}) {
    KOKKOSMOE_REQUIRE(j.at(key).contains(name) && j.at(key).at(name).is_number(),
                      where << ": cost model field \"" << key << "." << name << "\" is missing or not a number");
    *field = j.at(key).at(name).get<double>();
    KOKKOSMOE_REQUIRE(std::isfinite(*field) && *field >= 0.0,
                      where << ": cost model field \"" << key << "." << name << "\" = " << *field << " must be a finite number >= 0");
  }
  return l;
}

}  // namespace

std::pair<int, int> count_message_peers(std::string const& name, int r, Topology::Topology const& topo,
                                        Topology::CommLayout const& layout) {
  int const node_size = static_cast<int>(topo.ranks_of_node(topo.node_of(r)).size());
  if (name.rfind("kmoe-ep", 0) == 0) return {node_size - 1, layout.nranks - node_size};
  if (name.rfind("kmoe-node", 0) == 0) return {node_size - 1, 0};
  if (name.rfind("kmoe-relay", 0) == 0)
    for (auto const& g : layout.relay_groups)
      if (std::find(g.begin(), g.end(), r) != g.end()) return {0, static_cast<int>(g.size()) - 1};
  return {0, 0};
}

CostModel CostModel::stated(FabricSpec const& fabric, CostModel const* base) {
  CostModel m = base ? *base : CostModel{};
  m.nic.alpha_s = fabric.inter_latency_us * 1e-6;
  m.nic.beta_s_per_byte = fabric.inter_bandwidth_gbps > 0 ? 1e-9 / fabric.inter_bandwidth_gbps : 0.0;
  m.nics_per_node = fabric.nics_per_node;
  m.evidence = base ? base->evidence + " + stated" : "stated";
  m.origin = (base ? base->origin + "; " : std::string()) + "NIC stated: " + fabric.describe();
  return m;
}

namespace {
bool same_fabric(FabricSpec const& a, FabricSpec const& b) {
  if (!a.enabled() || !b.enabled()) return a.enabled() == b.enabled();
  return a.inter_latency_us == b.inter_latency_us && a.inter_bandwidth_gbps == b.inter_bandwidth_gbps &&
         a.nics_per_node == b.nics_per_node && a.intra_latency_us == b.intra_latency_us &&
         a.intra_bandwidth_gbps == b.intra_bandwidth_gbps;
}
}  // namespace

CostModel CostModel::for_fabric(FabricSpec const& f) const {
  if (same_fabric(f, fabric)) return *this;
  if (f.enabled()) {
    CostModel m = stated(f, this);
    m.fabric = f;
    return m;
  }
  CostModel m = *this;
  m.nic = LinkCost{};
  m.fabric = FabricSpec{};
  m.origin += "; NIC term dropped (no fabric)";
  return m;
}

std::string CostModel::to_json(int indent) const {
  json j;
  j["format"] = "kokkosmoe-cost-model";
  j["version"] = 1;
  j["evidence"] = evidence;
  j["origin"] = origin;
  j["links"] = {{"same_rank", link_json(same_rank)}, {"intra_node", link_json(intra_node)}, {"inter_node", link_json(inter_node)}};
  j["nic"] = link_json(nic);
  j["nic"]["nics_per_node"] = nics_per_node;
  if (fabric.enabled())
    j["fabric"] = {{"inter_latency_us", fabric.inter_latency_us}, {"inter_bandwidth_gbps", fabric.inter_bandwidth_gbps},
                   {"nics_per_node", fabric.nics_per_node}, {"intra_latency_us", fabric.intra_latency_us},
                   {"intra_bandwidth_gbps", fabric.intra_bandwidth_gbps}};
  j["encode_s_per_byte"] = encode_s_per_byte;
  j["decode_s_per_byte"] = decode_s_per_byte;
  j["return_encode_s_per_byte"] = return_encode_s_per_byte;
  j["stage_s"] = stage_s;
  j["stage_s_of"] = json::object();
  for (auto const& [a, v] : stage_s_of) j["stage_s_of"][a] = v;
  j["samples"] = json::array();
  for (auto const& s : samples) j["samples"].push_back({{"link", s.link}, {"bytes", s.bytes}, {"seconds", s.seconds}});
  return j.dump(indent);
}

CostModel CostModel::from_json(std::string const& text, std::string const& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (std::exception const& e) {
    KOKKOSMOE_THROW(where << ": not a JSON cost model: " << e.what());
  }
  KOKKOSMOE_REQUIRE(j.is_object() && j.value("format", std::string()) == "kokkosmoe-cost-model",
                    where << ": not a KokkosMoE cost model (no \"format\": \"kokkosmoe-cost-model\"; write one with kmoe-bench calibrate)");
  KOKKOSMOE_REQUIRE(j.value("version", 0) == 1, where << ": cost model version " << j.value("version", 0) << " (this build reads 1)");
  KOKKOSMOE_REQUIRE(j.contains("links") && j.at("links").is_object(), where << ": cost model has no \"links\" object");
  CostModel m;
  m.same_rank = link_from(j.at("links"), "same_rank", where);
  m.intra_node = link_from(j.at("links"), "intra_node", where);
  m.inter_node = link_from(j.at("links"), "inter_node", where);
  m.nic = link_from(j, "nic", where);
  m.nics_per_node = j.at("nic").value("nics_per_node", 1);
  KOKKOSMOE_REQUIRE(m.nics_per_node >= 1, where << ": cost model nic.nics_per_node = " << m.nics_per_node << " must be >= 1");
  for (auto [name, field] : {std::pair<char const*, double*>{"encode_s_per_byte", &m.encode_s_per_byte},
                                                {"decode_s_per_byte", &m.decode_s_per_byte},
                                                {"stage_s", &m.stage_s}}) {
    KOKKOSMOE_REQUIRE(j.contains(name) && j.at(name).is_number() && std::isfinite(j.at(name).get<double>()) && j.at(name).get<double>() >= 0,
                      where << ": cost model field \"" << name << "\" is missing or not a number >= 0");
    *field = j.at(name).get<double>();
  }
  m.return_encode_s_per_byte = m.encode_s_per_byte;  // files written before it was calibrated on its own
  if (j.contains("return_encode_s_per_byte")) {
    auto const& v = j.at("return_encode_s_per_byte");
    KOKKOSMOE_REQUIRE(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
                      where << ": cost model field \"return_encode_s_per_byte\" is not a number >= 0");
    m.return_encode_s_per_byte = v.get<double>();
  }
  if (j.contains("fabric") && j.at("fabric").is_object()) {
    auto const& f = j.at("fabric");
    m.fabric.inter_latency_us = f.value("inter_latency_us", 0.0);
    m.fabric.inter_bandwidth_gbps = f.value("inter_bandwidth_gbps", 0.0);
    m.fabric.nics_per_node = f.value("nics_per_node", 1);
    m.fabric.intra_latency_us = f.value("intra_latency_us", 0.0);
    m.fabric.intra_bandwidth_gbps = f.value("intra_bandwidth_gbps", 0.0);
    m.fabric.validate(where + ": fabric");
  }
  if (j.contains("stage_s_of") && j.at("stage_s_of").is_object())
    for (auto const& [a, v] : j.at("stage_s_of").items()) {
      KOKKOSMOE_REQUIRE(v.is_number() && v.get<double>() >= 0, where << ": cost model field \"stage_s_of." << a << "\" is not a number >= 0");
      m.stage_s_of[a] = v.get<double>();
    }
  m.evidence = j.value("evidence", std::string("measured"));
  m.origin = j.value("origin", where);
  if (j.contains("samples") && j.at("samples").is_array())
    for (auto const& s : j.at("samples"))
      m.samples.push_back({s.value("link", std::string()), s.value("bytes", 0.0), s.value("seconds", 0.0)});
  return m;
}

LinkCost fit_alpha_beta(std::vector<std::pair<double, double>> const& points) {
  // beta: the least-squares slope of the larger half of the sizes (where
  // bytes dominate); alpha: what the smallest size takes beyond its bytes.
  // Robust where ranks share cores, which makes small and large operations
  // see different machines; exact for points on a line.
  LinkCost l;
  if (points.empty()) return l;
  auto p = points;
  std::sort(p.begin(), p.end());
  std::size_t const from = p.size() / 2;
  double const n = static_cast<double>(p.size() - from);
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = from; i < p.size(); ++i) {
    sx += p[i].first;
    sy += p[i].second;
    sxx += p[i].first * p[i].first;
    sxy += p[i].first * p[i].second;
  }
  double const den = n * sxx - sx * sx;
  if (p.size() - from >= 2 && den > 0)
    l.beta_s_per_byte = (n * sxy - sx * sy) / den;
  else if (sxx > 0)
    l.beta_s_per_byte = sxy / sxx;
  l.beta_s_per_byte = std::max(0.0, l.beta_s_per_byte);
  l.alpha_s = std::max(0.0, p.front().second - l.beta_s_per_byte * p.front().first);
  return l;
}

double total_seconds(ByteLedger const& ledger) {
  double t = 0;
  for (auto const* d : {&ledger.dispatch, &ledger.combine})
    for (auto const& s : d->stages) t += s.seconds;
  return t;
}

ByteLedger predict(CostModel const& model, Topology::Topology const& topo, Topology::CommLayout const& layout,
                   std::vector<ByteLedger> const& ledgers) {
  KOKKOSMOE_REQUIRE(!ledgers.empty(), "cost model: no ledgers to predict");
  ByteLedger out = ledgers.front();
  for (std::size_t r = 1; r < ledgers.size(); ++r) out.accumulate(ledgers[r]);
  bool const counts = out.algorithm != "pooled_wave";  // static shapes agree on no counts
  // Pooled-wave waves are exchanges of their own: each packs what it sends.
  bool const every_stage_packs = out.algorithm == "pooled_wave";
  bool const dedup = out.algorithm == "hierarchical_dedup";
  int const N = static_cast<int>(ledgers.size());
  for (int dir = 0; dir < 2; ++dir) {
    auto& stages = dir == 0 ? out.dispatch.stages : out.combine.stages;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      double rank_max = 0, copy_max = 0;
      std::map<std::pair<int, int>, double> nic_busy;  // (node, nic) -> seconds
      for (int r = 0; r < N; ++r) {
        auto const& dl = dir == 0 ? ledgers[static_cast<std::size_t>(r)].dispatch : ledgers[static_cast<std::size_t>(r)].combine;
        KOKKOSMOE_REQUIRE(dl.stages.size() == stages.size(), "cost model: rank " << r << " has " << dl.stages.size() << " stages, rank 0 "
                                                                                  << stages.size());
        auto const& st = dl.stages[s];
        auto [intra_peers, inter_peers] = counts ? count_message_peers(st.communicator, r, topo, layout) : std::pair<int, int>{0, 0};
        for (auto const& extra : st.extra_count_rounds) {
          if (!counts) break;
          auto const more = count_message_peers(extra, r, topo, layout);
          intra_peers += more.first;
          inter_peers += more.second;
        }
        double rank_t = 0, sent = 0;  // this rank's transport seconds and bytes it sends
        LinkCost const* cost[3] = {&model.same_rank, &model.intra_node, &model.inter_node};
        for (int c = 0; c < num_link_classes; ++c) {
          auto const& cc = st.by_class[static_cast<std::size_t>(c)];
          double const bytes = static_cast<double>(cc.payload_bytes + cc.meta_bytes);
          double msgs = static_cast<double>(cc.messages);
          if (c == 1) msgs += intra_peers;
          if (c == 2) msgs += inter_peers;
          // Same-rank rows written where they arrive cost no copy (their
          // encoding is counted with the pack below).
          if (!(c == 0 && st.self_in_place)) rank_t += cost[c]->seconds(msgs, bytes);
          sent += bytes;
        }
        auto const& inter = st.by_class[static_cast<std::size_t>(LinkClass::inter_node)];
        double const inter_msgs = static_cast<double>(inter.messages) + inter_peers;
        int const nic = topo.local_rank_of(r) % std::max(1, model.nics_per_node);
        nic_busy[{topo.node_of(r), nic}] += model.nic.seconds(inter_msgs, static_cast<double>(inter.payload_bytes + inter.meta_bytes));
        rank_max = std::max(rank_max, rank_t);
        // Rows are encoded where they start (the dispatch's first stage, or
        // every pooled-wave wave, packs what the rank sends; the combine
        // encodes every expert output row
        // the rank holds, whichever stage sends it) and, dispatched rows,
        // decoded where they end (the last stage's useful rows); relays
        // forward encoded rows.
        double coded = 0;
        if (dir == 0 && (s == 0 || every_stage_packs)) coded += sent * model.encode_s_per_byte;
        if (s == 0 && dir == 1 && !out.combine.rows_in_place)
          coded += static_cast<double>(ledgers[static_cast<std::size_t>(r)].dispatch.useful_rows) *
                   static_cast<double>(out.combine_row_bytes) * model.return_encode_s_per_byte;
        if (dir == 0 && s + 1 == stages.size() && !out.dispatch.rows_in_place)
          coded += static_cast<double>(dl.useful_rows) * static_cast<double>(out.row_bytes + out.meta_row_bytes) * model.decode_s_per_byte;
        // A deduplicating exchange's relays copy rows besides the
        // transport, in runs: the units they forward, ordered by destination
        // node (dispatch stage 2), the units expanded into one row per route
        // (dispatch stage 3), and the route results they sum into one
        // partial per unit (combine stage 1, the rows stage 3 expanded).
        if (dedup && stages.size() == 3) {
          auto const& expand = ledgers[static_cast<std::size_t>(r)].dispatch.stages[2];
          double expanded = 0;
          for (auto const& cc : expand.by_class) expanded += static_cast<double>(cc.rows);
          if (dir == 0 && s == 1) coded += sent * model.decode_s_per_byte;
          if (dir == 0 && s == 2) coded += expanded * static_cast<double>(out.row_bytes) * model.decode_s_per_byte;
          if (dir == 1 && s == 0) coded += expanded * static_cast<double>(out.combine_row_bytes) * model.decode_s_per_byte;
        }
        copy_max = std::max(copy_max, coded);
      }
      double nic_max = 0;
      for (auto const& [k, v] : nic_busy) nic_max = std::max(nic_max, v);
      stages[s].seconds = model.stage_seconds(out.algorithm) + copy_max + std::max(rank_max, nic_max);
    }
  }
  return out;
}

}  // namespace Exchange
}  // namespace KokkosMoE
