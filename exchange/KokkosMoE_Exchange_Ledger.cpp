#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace KokkosMoE {
namespace Exchange {

using json = nlohmann::json;

ClassCounts StageLedger::total() const {
  ClassCounts t;
  for (auto const& c : by_class) {
    t.rows += c.rows;
    t.payload_bytes += c.payload_bytes;
    t.meta_bytes += c.meta_bytes;
    t.messages += c.messages;
    t.pairs += c.pairs;
    t.dedup_saved_rows += c.dedup_saved_rows;
    t.dedup_saved_bytes += c.dedup_saved_bytes;
  }
  return t;
}

ClassCounts DirectionLedger::by_class(LinkClass c) const {
  ClassCounts t;
  for (auto const& s : stages) {
    auto const& x = s.by_class[static_cast<int>(c)];
    t.rows += x.rows;
    t.payload_bytes += x.payload_bytes;
    t.meta_bytes += x.meta_bytes;
    t.messages += x.messages;
    t.pairs += x.pairs;
    t.dedup_saved_rows += x.dedup_saved_rows;
    t.dedup_saved_bytes += x.dedup_saved_bytes;
  }
  return t;
}

std::int64_t DirectionLedger::pairs() const {
  std::int64_t n = 0;
  for (auto const& s : stages)
    for (auto const& c : s.by_class) n += c.pairs;
  return n;
}

std::int64_t DirectionLedger::relay_rows() const {
  std::int64_t n = 0;
  for (auto const& s : stages) n += s.relay_rows;
  return n;
}
std::int64_t DirectionLedger::relay_bytes() const {
  std::int64_t n = 0;
  for (auto const& s : stages) n += s.relay_bytes;
  return n;
}
std::int64_t DirectionLedger::padding_rows() const {
  std::int64_t n = 0;
  for (auto const& s : stages) n += s.padding_rows;
  return n;
}

namespace {

json counts_json(ClassCounts const& c) {
  json j{{"rows", c.rows}, {"payload_bytes", c.payload_bytes}, {"meta_bytes", c.meta_bytes}, {"messages", c.messages}, {"pairs", c.pairs}};
  if (c.dedup_saved_rows != 0 || c.dedup_saved_bytes != 0) {
    j["dedup_saved_rows"] = c.dedup_saved_rows;
    j["dedup_saved_bytes"] = c.dedup_saved_bytes;
  }
  return j;
}

json direction_json(DirectionLedger const& d) {
  json stages = json::array();
  for (auto const& s : d.stages) {
    json cls;
    for (int c = 0; c < num_link_classes; ++c) cls[to_string(static_cast<LinkClass>(c))] = counts_json(s.by_class[c]);
    stages.push_back(json{{"name", s.name},
                          {"communicator", s.communicator},
                          {"classes", cls},
                          {"total", counts_json(s.total())},
                          {"relay_rows", s.relay_rows},
                          {"relay_bytes", s.relay_bytes},
                          {"padding_rows", s.padding_rows},
                          {"header_rows", s.header_rows},
                          {"self_in_place", s.self_in_place},
                          {"extra_count_rounds", s.extra_count_rounds},
                          {"seconds", s.seconds}});
  }
  json totals;
  for (int c = 0; c < num_link_classes; ++c) totals[to_string(static_cast<LinkClass>(c))] = counts_json(d.by_class(static_cast<LinkClass>(c)));
  return json{{"stages", stages},
              {"totals", totals},
              {"useful_rows", d.useful_rows},
              {"pairs", d.pairs()},
              {"relay_rows", d.relay_rows()},
              {"relay_bytes", d.relay_bytes()},
              {"padding_rows", d.padding_rows()},
              {"sender_drops", d.sender_drops},
              {"rows_in_place", d.rows_in_place},
              {"receiver_drops", d.receiver_drops}};
}

// Flattens every counter in a fixed order (for reductions).
void flatten(DirectionLedger const& d, std::vector<std::int64_t>& v) {
  v.push_back(d.useful_rows);
  v.push_back(d.sender_drops);
  v.push_back(d.receiver_drops);
  for (auto const& s : d.stages) {
    for (auto const& c : s.by_class) {
      v.push_back(c.rows);
      v.push_back(c.payload_bytes);
      v.push_back(c.meta_bytes);
      v.push_back(c.messages);
      v.push_back(c.pairs);
      v.push_back(c.dedup_saved_rows);
      v.push_back(c.dedup_saved_bytes);
    }
    v.push_back(s.relay_rows);
    v.push_back(s.relay_bytes);
    v.push_back(s.padding_rows);
    v.push_back(s.header_rows);
  }
}

void unflatten(DirectionLedger& d, std::vector<std::int64_t> const& v, std::size_t& i) {
  d.useful_rows = v[i++];
  d.sender_drops = v[i++];
  d.receiver_drops = v[i++];
  for (auto& s : d.stages) {
    for (auto& c : s.by_class) {
      c.rows = v[i++];
      c.payload_bytes = v[i++];
      c.meta_bytes = v[i++];
      c.messages = v[i++];
      c.pairs = v[i++];
      c.dedup_saved_rows = v[i++];
      c.dedup_saved_bytes = v[i++];
    }
    s.relay_rows = v[i++];
    s.relay_bytes = v[i++];
    s.padding_rows = v[i++];
    s.header_rows = v[i++];
  }
}

void accumulate_direction(DirectionLedger& a, DirectionLedger const& b) {
  KOKKOSMOE_REQUIRE(a.stages.size() == b.stages.size(), "ledgers with different stage structure cannot be added");
  for (std::size_t s = 0; s < a.stages.size(); ++s) a.stages[s].seconds = std::max(a.stages[s].seconds, b.stages[s].seconds);
  a.rows_in_place = a.rows_in_place && b.rows_in_place;
  std::vector<std::int64_t> va, vb;
  flatten(a, va);
  flatten(b, vb);
  KOKKOSMOE_REQUIRE(va.size() == vb.size(), "ledgers with different stage structure cannot be added");
  for (std::size_t i = 0; i < va.size(); ++i) va[i] += vb[i];
  std::size_t i = 0;
  unflatten(a, va, i);
}

}  // namespace

std::string ByteLedger::to_json(int indent) const {
  json j{{"algorithm", algorithm},
         {"payload", payload},
         {"combine_payload", combine_payload},
         {"width", width},
         {"row_bytes", row_bytes},
         {"combine_row_bytes", combine_row_bytes},
         {"meta_row_bytes", meta_row_bytes},
         {"ranks", ranks},
         {"dispatch", direction_json(dispatch)}, {"combine", direction_json(combine)}};
  return j.dump(indent);
}

void ByteLedger::accumulate(ByteLedger const& other) {
  KOKKOSMOE_REQUIRE(algorithm == other.algorithm, "cannot add a " << other.algorithm << " ledger to a " << algorithm << " ledger");
  accumulate_direction(dispatch, other.dispatch);
  accumulate_direction(combine, other.combine);
}

void ByteLedger::append(ByteLedger const& next) {
  if (algorithm.empty()) {
    *this = next;
    return;
  }
  KOKKOSMOE_REQUIRE(algorithm == next.algorithm && payload == next.payload && width == next.width,
                    "cannot append a " << next.algorithm << " ledger of " << next.payload << "/" << next.width << " to a "
                                       << algorithm << " ledger of " << payload << "/" << width);
  for (auto [into, from] : {std::make_pair(&dispatch, &next.dispatch), std::make_pair(&combine, &next.combine)}) {
    into->stages.insert(into->stages.end(), from->stages.begin(), from->stages.end());
    into->useful_rows += from->useful_rows;
    into->sender_drops += from->sender_drops;
    into->receiver_drops += from->receiver_drops;
    into->rows_in_place = into->rows_in_place && from->rows_in_place;
  }
  if (combine_payload.empty()) {
    combine_payload = next.combine_payload;
    combine_row_bytes = next.combine_row_bytes;
  }
}

ByteLedger ByteLedger::reduced(MPI_Comm comm, double watchdog_seconds) const {
  std::vector<std::int64_t> v;
  flatten(dispatch, v);
  flatten(combine, v);
  std::int64_t const n = static_cast<std::int64_t>(v.size());
  std::int64_t in[2] = {n, -n}, ext[2] = {0, 0};  // the largest count and (negated) the smallest, in one reduction
  allreduce_watched(in, ext, 2, MPI_INT64_T, MPI_MAX, comm, "ledger reduction", watchdog_seconds);
  std::int64_t const n_max = ext[0], n_min = -ext[1];
  KOKKOSMOE_REQUIRE(n_max == n_min, "ledger reduction: ranks disagree on the stage structure (" << n_min << " vs " << n_max << " counters)");
  std::vector<std::int64_t> sum(v.size());
  allreduce_watched(v.data(), sum.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_SUM, comm, "ledger reduction", watchdog_seconds);
  ByteLedger out = *this;
  std::size_t i = 0;
  unflatten(out.dispatch, sum, i);
  unflatten(out.combine, sum, i);
  // Stage times: the slowest rank's.
  std::vector<double> t, tmax;
  for (auto const* d : {&dispatch, &combine})
    for (auto const& s : d->stages) t.push_back(s.seconds);
  tmax.resize(t.size());
  if (!t.empty())
    allreduce_watched(t.data(), tmax.data(), static_cast<int>(t.size()), MPI_DOUBLE, MPI_MAX, comm, "ledger reduction", watchdog_seconds);
  std::size_t k = 0;
  for (auto* d : {&out.dispatch, &out.combine})
    for (auto& s : d->stages) s.seconds = tmax[k++];
  out.ranks = comm_size(comm);
  return out;
}

std::string ByteLedger::table() const {
  std::ostringstream os;
  os << algorithm << " (" << payload << "/" << combine_payload << ", width " << width << ", " << row_bytes << "/"
     << combine_row_bytes << " B/row, " << meta_row_bytes
     << " B meta/row, " << ranks << " rank" << (ranks > 1 ? "s" : "") << ")\n";
  os << std::left << std::setw(10) << "direction" << std::setw(26) << "stage" << std::setw(12) << "class"
     << std::right << std::setw(12) << "rows" << std::setw(16) << "payload_B" << std::setw(14) << "meta_B"
     << std::setw(10) << "msgs" << std::setw(8) << "pairs" << std::setw(12) << "seconds" << "\n";
  for (auto const* dir : {&dispatch, &combine}) {
    char const* dname = dir == &dispatch ? "dispatch" : "combine";
    for (auto const& s : dir->stages)
      for (int c = 0; c < num_link_classes; ++c) {
        auto const& x = s.by_class[c];
        if (x.rows == 0 && x.messages == 0) continue;
        os << std::left << std::setw(10) << dname << std::setw(26) << s.name << std::setw(12)
           << to_string(static_cast<LinkClass>(c)) << std::right << std::setw(12) << x.rows << std::setw(16)
           << x.payload_bytes << std::setw(14) << x.meta_bytes << std::setw(10) << x.messages << std::setw(8) << x.pairs
           << std::setw(12) << s.seconds << "\n";
      }
    os << std::left << std::setw(10) << dname << "useful_rows=" << dir->useful_rows << " relay_rows=" << dir->relay_rows()
       << " relay_bytes=" << dir->relay_bytes() << " padding_rows=" << dir->padding_rows()
       << " sender_drops=" << dir->sender_drops << " receiver_drops=" << dir->receiver_drops;
    auto const saved = dir->by_class(LinkClass::inter_node).dedup_saved_rows + dir->by_class(LinkClass::intra_node).dedup_saved_rows;
    if (saved > 0)
      os << " dedup_saved_rows=" << saved << " (inter_node " << dir->by_class(LinkClass::inter_node).dedup_saved_rows << ", "
         << dir->by_class(LinkClass::inter_node).dedup_saved_bytes << " B)";
    os << "\n";
  }
  return os.str();
}

void check_inter_node_equal(ByteLedger const& flat, ByteLedger const& hier) {
  auto const fd = flat.dispatch.inter_node_payload_bytes(), hd = hier.dispatch.inter_node_payload_bytes();
  auto const fc = flat.combine.inter_node_payload_bytes(), hc = hier.combine.inter_node_payload_bytes();
  KOKKOSMOE_REQUIRE(fd == hd && fc == hc, "inter-node payload differs: flat dispatch " << fd << " B / combine " << fc
                                                                                         << " B, hierarchical dispatch " << hd
                                                                                         << " B / combine " << hc << " B");
}

void add_sends(StageLedger& stage, std::vector<std::int64_t> const& rows, std::vector<int> const& peer_global, int me,
               std::vector<int> const& node_of_rank, std::int64_t row_bytes, std::int64_t meta_row_bytes,
               std::vector<std::int64_t> const* runs, std::vector<std::int64_t> const* meta_runs,
               std::vector<std::int64_t> const* routes) {
  KOKKOSMOE_REQUIRE(rows.size() == peer_global.size(), "ledger: " << rows.size() << " counts for " << peer_global.size() << " peers");
  KOKKOSMOE_REQUIRE(!runs || runs->size() == rows.size(), "ledger: " << runs->size() << " run counts for " << rows.size() << " peers");
  KOKKOSMOE_REQUIRE(!meta_runs || meta_runs->size() == rows.size(),
                    "ledger: " << meta_runs->size() << " metadata run counts for " << rows.size() << " peers");
  KOKKOSMOE_REQUIRE(!routes || routes->size() == rows.size(), "ledger: " << routes->size() << " route counts for " << rows.size() << " peers");
  if (!meta_runs) meta_runs = runs;
  for (std::size_t p = 0; p < rows.size(); ++p) {
    if (rows[p] == 0) continue;
    int const g = peer_global[p];
    LinkClass const c = g == me ? LinkClass::same_rank
                        : node_of_rank[static_cast<std::size_t>(g)] == node_of_rank[static_cast<std::size_t>(me)]
                            ? LinkClass::intra_node
                            : LinkClass::inter_node;
    auto& x = stage.by_class[static_cast<int>(c)];
    x.rows += rows[p];
    x.payload_bytes += rows[p] * row_bytes;
    x.meta_bytes += rows[p] * meta_row_bytes;
    std::int64_t const n = runs ? (*runs)[p] : 1;
    std::int64_t const m = meta_runs ? (*meta_runs)[p] : 1;
    x.messages += transfer_messages(n, rows[p], row_bytes) + (meta_row_bytes > 0 ? transfer_messages(m, rows[p], meta_row_bytes) : 0);
    if (std::find(stage.paired.begin(), stage.paired.end(), g) == stage.paired.end()) {
      stage.paired.push_back(g);
      ++x.pairs;
    }
    if (routes) {
      KOKKOSMOE_REQUIRE((*routes)[p] >= rows[p], "ledger: " << rows[p] << " rows to peer " << p << " stand for " << (*routes)[p] << " routes");
      x.dedup_saved_rows += (*routes)[p] - rows[p];
      x.dedup_saved_bytes += ((*routes)[p] - rows[p]) * row_bytes;
    }
  }
}

}  // namespace Exchange
}  // namespace KokkosMoE
