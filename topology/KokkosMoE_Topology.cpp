#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Topology.hpp>

#include <hwloc.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <sstream>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <utility>

namespace KokkosMoE {
namespace Topology {

using json = nlohmann::json;

namespace {

// ---- JSON (de)serialisation of records ------------------------------------
json device_json(Device const& d) {
  return json{{"name", d.name}, {"subtype", d.subtype}, {"package", d.package}, {"numa", d.numa}, {"cpuset", d.cpuset}};
}
Device device_from(json const& j) {
  Device d;
  d.name = j.at("name").get<std::string>();
  d.subtype = j.at("subtype").get<std::string>();
  d.package = j.at("package").get<int>();
  d.numa = j.at("numa").get<int>();
  d.cpuset = j.at("cpuset").get<std::string>();
  return d;
}
json hardware_json(NodeHardware const& h) {
  json g = json::array(), n = json::array();
  for (auto const& d : h.gpus) g.push_back(device_json(d));
  for (auto const& d : h.nics) n.push_back(device_json(d));
  return json{{"packages", h.packages}, {"numa_nodes", h.numa_nodes}, {"cores", h.cores}, {"pus", h.pus},
              {"gpus", g}, {"nics", n}, {"source", h.source}};
}
NodeHardware hardware_from(json const& j) {
  NodeHardware h;
  h.packages = j.at("packages").get<int>();
  h.numa_nodes = j.at("numa_nodes").get<int>();
  h.cores = j.at("cores").get<int>();
  h.pus = j.at("pus").get<int>();
  for (auto const& d : j.at("gpus")) h.gpus.push_back(device_from(d));
  for (auto const& d : j.at("nics")) h.nics.push_back(device_from(d));
  h.source = j.at("source").get<std::string>();
  return h;
}
json record_json(RankRecord const& r) {
  return json{{"rank", r.rank},       {"host", r.host},       {"node", r.node},
              {"local_rank", r.local_rank}, {"local_size", r.local_size}, {"package", r.package},
              {"numa", r.numa},       {"cpuset", r.cpuset},   {"bound_cores", r.bound_cores},
              {"bound_pus", r.bound_pus}, {"bound", r.bound}, {"gpu", r.gpu},
              {"nic", r.nic},         {"nic_local", r.nic_local}};
}
RankRecord record_from(json const& j) {
  RankRecord r;
  r.rank = j.at("rank").get<int>();
  r.host = j.at("host").get<std::string>();
  r.node = j.at("node").get<int>();
  r.local_rank = j.at("local_rank").get<int>();
  r.local_size = j.at("local_size").get<int>();
  r.package = j.at("package").get<int>();
  r.numa = j.at("numa").get<int>();
  r.cpuset = j.at("cpuset").get<std::string>();
  r.bound_cores = j.at("bound_cores").get<int>();
  r.bound_pus = j.at("bound_pus").get<int>();
  r.bound = j.at("bound").get<bool>();
  r.gpu = j.at("gpu").get<std::string>();
  r.nic = j.at("nic").get<std::string>();
  r.nic_local = j.at("nic_local").get<bool>();
  return r;
}

// ---- hwloc -----------------------------------------------------------------
struct HwlocTopology {
  hwloc_topology_t topo = nullptr;
  HwlocTopology() = default;
  HwlocTopology(HwlocTopology const&) = delete;
  HwlocTopology& operator=(HwlocTopology const&) = delete;
  ~HwlocTopology() {
    if (topo) hwloc_topology_destroy(topo);
  }
};

struct Bitmap {
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  Bitmap() = default;
  Bitmap(Bitmap const&) = delete;
  Bitmap& operator=(Bitmap const&) = delete;
  ~Bitmap() { hwloc_bitmap_free(set); }
};

std::string list_string(hwloc_const_bitmap_t set) {
  char* text = nullptr;
  if (hwloc_bitmap_list_asprintf(&text, set) < 0 || !text) return "";
  std::string s(text);
  std::free(text);
  return s;
}

/// A synthetic description ("pack:2 numa:2 core:8 pu:2") must describe a
/// node of at most 2^20 objects: hwloc would otherwise build (or spin on)
/// whatever product of counts it is given.
void check_synthetic_size(std::string const& text) {
  constexpr double most = 1 << 20;
  double level = 1, total = 1;
  std::istringstream in(text);
  std::string token;
  while (in >> token) {
    auto const colon = token.find(':');
    if (colon == std::string::npos) continue;  // hwloc reports malformed tokens itself
    std::size_t end = colon + 1;
    while (end < token.size() && std::isdigit(static_cast<unsigned char>(token[end]))) ++end;
    if (end == colon + 1) continue;
    level *= std::stod(token.substr(colon + 1, end - colon - 1));
    total += level;
    KOKKOSMOE_REQUIRE(total <= most, "synthetic topology '" << (text.size() > 200 ? text.substr(0, 200) + "..." : text)
                                                          << "' describes more than " << static_cast<long>(most)
                                                          << " objects per node");
  }
}

/// Loads the real machine or the spec's synthetic/XML description.
std::unique_ptr<HwlocTopology> load_hwloc(LayoutSpec const& spec, std::string& source) {
  auto h = std::make_unique<HwlocTopology>();
  KOKKOSMOE_REQUIRE(hwloc_topology_init(&h->topo) == 0, "hwloc_topology_init failed");
  hwloc_topology_set_io_types_filter(h->topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  source = "hwloc";
  if (spec.kind == LayoutKind::synthetic) {
    KOKKOSMOE_REQUIRE(!spec.synthetic.empty() || !spec.xml_file.empty(),
                      "synthetic topology layout needs a synthetic description or an XML file");
    KOKKOSMOE_REQUIRE(spec.synthetic.empty() || spec.xml_file.empty(),
                      "synthetic topology layout takes a synthetic description or an XML file, not both");
    if (!spec.synthetic.empty()) {
      check_synthetic_size(spec.synthetic);
      KOKKOSMOE_REQUIRE(hwloc_topology_set_synthetic(h->topo, spec.synthetic.c_str()) == 0,
                        "hwloc cannot parse the synthetic description '" << spec.synthetic << "'");
      source = "synthetic:" + spec.synthetic;
    } else {
      KOKKOSMOE_REQUIRE(access(spec.xml_file.c_str(), R_OK) == 0,
                        "hwloc XML file '" << spec.xml_file << "' cannot be read");
      KOKKOSMOE_REQUIRE(hwloc_topology_set_xml(h->topo, spec.xml_file.c_str()) == 0,
                        "hwloc cannot use the XML file '" << spec.xml_file << "'");
      source = "xml:" + spec.xml_file;
    }
  }
  KOKKOSMOE_REQUIRE(hwloc_topology_load(h->topo) == 0,
                    "hwloc_topology_load failed for " << source);
  return h;
}

int first_intersecting(hwloc_topology_t topo, hwloc_obj_type_t type, hwloc_const_cpuset_t set) {
  int const n = hwloc_get_nbobjs_by_type(topo, type);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t o = hwloc_get_obj_by_type(topo, type, static_cast<unsigned>(i));
    if (o && o->cpuset && hwloc_bitmap_intersects(o->cpuset, set)) return i;
  }
  return -1;
}

int single_package(hwloc_topology_t topo, hwloc_const_cpuset_t set) {
  int found = -1;
  int const n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t o = hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, static_cast<unsigned>(i));
    if (o && hwloc_bitmap_intersects(o->cpuset, set)) {
      if (found >= 0) return -1;
      found = i;
    }
  }
  return found;
}

NodeHardware summarize(hwloc_topology_t topo, std::string const& source) {
  NodeHardware h;
  h.source = source;
  h.packages = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE));
  h.numa_nodes = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE));
  h.cores = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE));
  h.pus = std::max(0, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU));
  for (hwloc_obj_t os = hwloc_get_next_osdev(topo, nullptr); os; os = hwloc_get_next_osdev(topo, os)) {
    auto const type = os->attr->osdev.type;
    bool const gpu = type == HWLOC_OBJ_OSDEV_GPU || type == HWLOC_OBJ_OSDEV_COPROC;
    bool const nic = type == HWLOC_OBJ_OSDEV_NETWORK || type == HWLOC_OBJ_OSDEV_OPENFABRICS;
    if (!gpu && !nic) continue;
    Device d;
    d.name = os->name ? os->name : "";
    d.subtype = os->subtype ? os->subtype
                : type == HWLOC_OBJ_OSDEV_OPENFABRICS ? "OpenFabrics"
                : type == HWLOC_OBJ_OSDEV_NETWORK     ? "Network"
                                                      : "GPU";
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, os);
    if (anc && anc->cpuset) {
      d.cpuset = list_string(anc->cpuset);
      d.package = single_package(topo, anc->cpuset);
      d.numa = first_intersecting(topo, HWLOC_OBJ_NUMANODE, anc->cpuset);
    }
    (gpu ? h.gpus : h.nics).push_back(d);
  }
  // Several OS devices may name one GPU (cuda0 and nvml0): keep one per
  // backend kind, preferring CUDA, then NVML, then anything else.
  auto keep_kind = [&](char const* kind) {
    std::vector<Device> only;
    for (auto const& d : h.gpus)
      if (d.subtype == kind) only.push_back(d);
    return only;
  };
  for (char const* kind : {"CUDA", "NVML", "RSMI", "LevelZero", "OpenCL"}) {
    auto only = keep_kind(kind);
    if (!only.empty()) {
      h.gpus = only;
      break;
    }
  }
  // Prefer RDMA devices over plain network interfaces when both exist.
  std::vector<Device> rdma;
  for (auto const& d : h.nics)
    if (d.subtype == "OpenFabrics") rdma.push_back(d);
  if (!rdma.empty()) h.nics = rdma;
  return h;
}

int intersection_weight(hwloc_const_bitmap_t a, std::string const& list) {
  if (list.empty()) return 0;
  Bitmap b, both;
  if (hwloc_bitmap_list_sscanf(b.set, list.c_str()) < 0) return 0;
  hwloc_bitmap_and(both.set, a, b.set);
  return hwloc_bitmap_weight(both.set);
}

/// Binding of the local process, or the emulated binding of local rank l of
/// L on a synthetic node (contiguous blocks of cores).
void binding_of(hwloc_topology_t topo, bool emulate, int local_rank, int local_size, hwloc_bitmap_t out) {
  hwloc_const_cpuset_t all = hwloc_topology_get_topology_cpuset(topo);
  if (emulate) {
    int const cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_bitmap_zero(out);
    if (cores <= 0) {
      hwloc_bitmap_copy(out, all);
      return;
    }
    int lo = static_cast<int>(static_cast<long long>(local_rank) * cores / local_size);
    int hi = static_cast<int>(static_cast<long long>(local_rank + 1) * cores / local_size);
    if (hi <= lo) {
      lo = local_rank % cores;
      hi = lo + 1;
    }
    for (int c = lo; c < hi; ++c) {
      hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, static_cast<unsigned>(c));
      if (core) hwloc_bitmap_or(out, out, core->cpuset);
    }
    return;
  }
  if (hwloc_get_cpubind(topo, out, HWLOC_CPUBIND_PROCESS) != 0) hwloc_bitmap_copy(out, all);
  hwloc_bitmap_and(out, out, all);
  if (hwloc_bitmap_iszero(out)) hwloc_bitmap_copy(out, all);
}

RankRecord local_record(hwloc_topology_t topo, NodeHardware const& hw, bool emulate, int rank,
                        std::string const& host, int node, int local_rank, int local_size,
                        std::vector<std::string> const& declared_nics) {
  RankRecord r;
  r.rank = rank;
  r.host = host;
  r.node = node;
  r.local_rank = local_rank;
  r.local_size = local_size;
  Bitmap bind;
  binding_of(topo, emulate, local_rank, local_size, bind.set);
  r.cpuset = list_string(bind.set);
  r.bound = !hwloc_bitmap_isequal(bind.set, hwloc_topology_get_topology_cpuset(topo));
  r.bound_pus = hwloc_bitmap_weight(bind.set);
  r.bound_cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, bind.set, HWLOC_OBJ_CORE);
  r.package = single_package(topo, bind.set);
  r.numa = first_intersecting(topo, HWLOC_OBJ_NUMANODE, bind.set);

  // GPU by locality: among GPUs local to the binding, the one at this rank's
  // position among the node's ranks; otherwise local rank modulo GPUs.
  if (!hw.gpus.empty()) {
    std::vector<int> near;
    for (std::size_t g = 0; g < hw.gpus.size(); ++g)
      if (r.bound && intersection_weight(bind.set, hw.gpus[g].cpuset) > 0) near.push_back(static_cast<int>(g));
    int pick = local_rank % static_cast<int>(hw.gpus.size());
    if (!near.empty()) {
      // Ranks sharing this package form a group; index inside the group.
      int const per_pkg = std::max(1, local_size / std::max(1, hw.packages));
      pick = near[static_cast<std::size_t>((local_rank % per_pkg) % static_cast<int>(near.size()))];
    }
    r.gpu = hw.gpus[static_cast<std::size_t>(pick)].name;
  }
  if (!declared_nics.empty()) {
    std::size_t const n = declared_nics.size();
    r.nic = declared_nics[static_cast<std::size_t>(local_rank) * n / static_cast<std::size_t>(local_size)];
    r.nic_local = true;
  } else if (!hw.nics.empty()) {
    int best = -1, best_w = 0;
    for (std::size_t i = 0; i < hw.nics.size(); ++i) {
      int const w = intersection_weight(bind.set, hw.nics[i].cpuset);
      if (w > best_w) {
        best = static_cast<int>(i);
        best_w = w;
      }
    }
    r.nic_local = r.bound && best >= 0;
    r.nic = hw.nics[static_cast<std::size_t>(best >= 0 ? best : 0)].name;
  }
  return r;
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

}  // namespace

std::vector<int> resolve_node_of_rank(LayoutSpec const& spec, int nranks) {
  int given = (spec.ranks_per_node > 0 ? 1 : 0) + (!spec.node_of_rank.empty() ? 1 : 0) + (!spec.nodes.empty() ? 1 : 0);
  KOKKOSMOE_REQUIRE(spec.ranks_per_node >= 0, "ranks_per_node must be positive (got " << spec.ranks_per_node << ")");
  KOKKOSMOE_REQUIRE(given == 1, "a " << to_string(spec.kind)
                                     << " topology layout needs exactly one of ranks_per_node, node_of_rank or nodes ("
                                     << given << " given)");
  std::vector<int> node(static_cast<std::size_t>(nranks), -1);
  if (spec.ranks_per_node > 0) {
    KOKKOSMOE_REQUIRE(nranks % spec.ranks_per_node == 0,
                      "ranks_per_node = " << spec.ranks_per_node << " does not divide " << nranks << " ranks");
    for (int r = 0; r < nranks; ++r) node[r] = r / spec.ranks_per_node;
  } else if (!spec.node_of_rank.empty()) {
    KOKKOSMOE_REQUIRE(static_cast<int>(spec.node_of_rank.size()) == nranks,
                      "node_of_rank has " << spec.node_of_rank.size() << " entries for " << nranks << " ranks");
    node = spec.node_of_rank;
  } else {
    for (std::size_t n = 0; n < spec.nodes.size(); ++n) {
      KOKKOSMOE_REQUIRE(!spec.nodes[n].empty(), "node " << n << " lists no ranks");
      for (int r : spec.nodes[n]) {
        KOKKOSMOE_REQUIRE(r >= 0 && r < nranks, "node " << n << " lists rank " << r << ", outside [0, " << nranks << ")");
        KOKKOSMOE_REQUIRE(node[r] < 0 || node[r] == static_cast<int>(n),
                          "rank " << r << " is in two nodes (" << node[r] << " and " << n << ")");
        KOKKOSMOE_REQUIRE(node[r] < 0, "rank " << r << " is listed twice in node " << n);
        node[r] = static_cast<int>(n);
      }
    }
  }
  int max_node = -1;
  for (int r = 0; r < nranks; ++r) {
    KOKKOSMOE_REQUIRE(node[r] >= 0, "rank " << r << " belongs to no node");
    // Nodes are contiguous from 0 and hold at least one rank each, so no id
    // reaches the rank count (checked before anything is sized by it).
    KOKKOSMOE_REQUIRE(node[r] < nranks, "rank " << r << " is on node " << node[r] << ", but " << nranks
                                                << " ranks fill at most nodes 0.." << nranks - 1);
    max_node = std::max(max_node, node[r]);
  }
  std::vector<int> count(static_cast<std::size_t>(max_node + 1), 0);
  for (int r = 0; r < nranks; ++r) ++count[static_cast<std::size_t>(node[r])];
  for (int n = 0; n <= max_node; ++n)
    KOKKOSMOE_REQUIRE(count[n] > 0, "node ids must be contiguous from 0: node " << n << " has no ranks");
  return node;
}

Topology Topology::from_records(LayoutKind kind, std::vector<RankRecord> records,
                                std::vector<NodeHardware> node_hw) {
  Topology t;
  t.kind_ = kind;
  int const n = static_cast<int>(records.size());
  int max_node = -1;
  for (int r = 0; r < n; ++r) {
    KOKKOSMOE_REQUIRE(records[r].rank == r, "topology record " << r << " claims rank " << records[r].rank);
    KOKKOSMOE_REQUIRE(records[r].node >= 0, "rank " << r << " has no node");
    max_node = std::max(max_node, records[r].node);
  }
  t.node_ranks_.assign(static_cast<std::size_t>(max_node + 1), {});
  for (int r = 0; r < n; ++r) t.node_ranks_[static_cast<std::size_t>(records[r].node)].push_back(r);
  for (int node = 0; node <= max_node; ++node) {
    auto const& members = t.node_ranks_[static_cast<std::size_t>(node)];
    KOKKOSMOE_REQUIRE(!members.empty(), "node ids must be contiguous from 0: node " << node << " has no ranks");
    for (std::size_t l = 0; l < members.size(); ++l) {
      auto const& rec = records[static_cast<std::size_t>(members[l])];
      KOKKOSMOE_REQUIRE(rec.local_rank == static_cast<int>(l) && rec.local_size == static_cast<int>(members.size()),
                        "rank " << rec.rank << " claims local rank " << rec.local_rank << " of " << rec.local_size
                                << " on node " << node << ", expected " << l << " of " << members.size());
    }
  }
  KOKKOSMOE_REQUIRE(node_hw.size() == t.node_ranks_.size(),
                    "hardware given for " << node_hw.size() << " nodes, topology has " << t.node_ranks_.size());
  t.ranks_ = std::move(records);
  t.node_hw_ = std::move(node_hw);
  return t;
}

int Topology::min_ranks_per_node() const {
  int m = size();
  for (auto const& nr : node_ranks_) m = std::min(m, static_cast<int>(nr.size()));
  return m;
}

std::string Topology::to_json(int indent) const {
  json ranks = json::array(), nodes = json::array();
  for (auto const& r : ranks_) ranks.push_back(record_json(r));
  for (std::size_t n = 0; n < node_ranks_.size(); ++n) {
    json node = hardware_json(node_hw_[n]);
    node["node"] = n;
    node["ranks"] = node_ranks_[n];
    nodes.push_back(node);
  }
  json j{{"layout", to_string(kind_)}, {"size", size()}, {"nodes", nodes}, {"ranks", ranks}};
  return j.dump(indent);
}

namespace {
std::vector<int> local_ranks_from_nodes(std::vector<int> const& node_of_rank, std::vector<int>& local_size) {
  int const n = static_cast<int>(node_of_rank.size());
  int max_node = *std::max_element(node_of_rank.begin(), node_of_rank.end());
  std::vector<int> next(static_cast<std::size_t>(max_node + 1), 0), local(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) local[r] = next[static_cast<std::size_t>(node_of_rank[r])]++;
  local_size.assign(static_cast<std::size_t>(n), 0);
  for (int r = 0; r < n; ++r) local_size[r] = next[static_cast<std::size_t>(node_of_rank[r])];
  return local;
}
}  // namespace

Topology Topology::discover(MPI_Comm comm, LayoutSpec const& spec) {
  int const rank = comm_rank(comm);
  int const size = comm_size(comm);
  std::string const host = host_name();

  // Node identity. For the real machine: shared-memory domain leader + host name.
  std::vector<int> node_of_rank;
  if (spec.kind == LayoutKind::hwloc) {
    MPI_Comm shm = MPI_COMM_NULL;
    KOKKOSMOE_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shm), comm);
    int leader = rank;
    MPI_Allreduce(&rank, &leader, 1, MPI_INT, MPI_MIN, shm);
    MPI_Comm_free(&shm);
    auto keys = allgather_strings(comm, host + "#" + std::to_string(leader));
    std::map<std::string, int> id;
    node_of_rank.resize(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) {
      auto it = id.find(keys[r]);
      if (it == id.end()) it = id.emplace(keys[r], static_cast<int>(id.size())).first;
      node_of_rank[r] = it->second;
    }
  } else {
    collective(comm, "topology layout", [&] { node_of_rank = resolve_node_of_rank(spec, size); });
  }

  std::string mine;
  collective(comm, "topology discovery", [&] {
    std::vector<int> local_size;
    auto const local = local_ranks_from_nodes(node_of_rank, local_size);
    std::string source;
    auto hw = load_hwloc(spec, source);
    NodeHardware hardware = summarize(hw->topo, source);
    std::vector<std::string> declared;
    if (spec.kind == LayoutKind::virtual_nodes && !spec.nic_names.empty()) {
      declared = spec.nic_names;
      hardware.nics.clear();
      for (auto const& name : declared) hardware.nics.push_back(Device{name, "declared", -1, -1, ""});
      hardware.source = "virtual (hwloc of " + host + ")";
    } else if (spec.kind == LayoutKind::virtual_nodes) {
      hardware.source = "virtual (hwloc of " + host + ")";
    }
    RankRecord rec = local_record(hw->topo, hardware, spec.kind == LayoutKind::synthetic, rank, host,
                                  node_of_rank[rank], local[rank], local_size[rank], declared);
    mine = json{{"record", record_json(rec)}, {"hardware", hardware_json(hardware)}}.dump();
  });

  auto all = allgather_strings(comm, mine);
  Topology result;
  collective(comm, "topology agreement", [&] {
    std::vector<RankRecord> records;
    std::vector<NodeHardware> hw;
    for (int r = 0; r < size; ++r) {
      json const j = json::parse(all[r]);
      records.push_back(record_from(j.at("record")));
      int const node = records.back().node;
      if (node >= static_cast<int>(hw.size())) hw.resize(static_cast<std::size_t>(node) + 1);
      if (records.back().local_rank == 0) hw[static_cast<std::size_t>(node)] = hardware_from(j.at("hardware"));
    }
    result = from_records(spec.kind, std::move(records), std::move(hw));
  });
  if (comm == MPI_COMM_WORLD) {
    // Where every rank runs, for the watchdogs' messages.
    std::vector<std::string> places, hosts;
    for (auto const& r : result.ranks()) {
      places.push_back("host " + r.host + ", node " + std::to_string(r.node));
      hosts.push_back(r.host);
    }
    set_rank_places(std::move(places), std::move(hosts));
  }
  return result;
}

Topology Topology::simulated(int nranks, LayoutSpec const& spec) {
  KOKKOSMOE_REQUIRE(nranks > 0, "a simulated topology needs at least one rank (got " << nranks << ")");
  KOKKOSMOE_REQUIRE(spec.kind != LayoutKind::hwloc,
                    "a simulated topology needs a virtual or synthetic layout, not hwloc");
  auto const node_of_rank = resolve_node_of_rank(spec, nranks);
  std::vector<int> local_size;
  auto const local = local_ranks_from_nodes(node_of_rank, local_size);
  std::string source;
  std::unique_ptr<HwlocTopology> hw;
  NodeHardware hardware;
  if (spec.kind == LayoutKind::synthetic) {
    hw = load_hwloc(spec, source);
    hardware = summarize(hw->topo, source);
  } else {
    hardware.source = "virtual (simulated)";
    for (auto const& name : spec.nic_names) hardware.nics.push_back(Device{name, "declared", -1, -1, ""});
  }
  std::vector<RankRecord> records;
  int const nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  for (int r = 0; r < nranks; ++r) {
    std::string const host = "sim-node" + std::to_string(node_of_rank[r]);
    if (hw) {
      records.push_back(local_record(hw->topo, hardware, true, r, host, node_of_rank[r], local[r], local_size[r], {}));
    } else {
      RankRecord rec;
      rec.rank = r;
      rec.host = host;
      rec.node = node_of_rank[r];
      rec.local_rank = local[r];
      rec.local_size = local_size[r];
      if (!spec.nic_names.empty()) {
        std::size_t const n = spec.nic_names.size();
        rec.nic = spec.nic_names[static_cast<std::size_t>(local[r]) * n / static_cast<std::size_t>(local_size[r])];
        rec.nic_local = true;
      }
      records.push_back(rec);
    }
  }
  return from_records(spec.kind, std::move(records), std::vector<NodeHardware>(static_cast<std::size_t>(nodes), hardware));
}

void export_hwloc_xml(LayoutSpec const& spec, std::string const& path) {
  std::string source;
  auto hw = load_hwloc(spec, source);
  KOKKOSMOE_REQUIRE(hwloc_topology_export_xml(hw->topo, path.c_str(), 0) == 0,
                    "cannot write hwloc XML to '" << path << "'");
}

}  // namespace Topology
}  // namespace KokkosMoE
