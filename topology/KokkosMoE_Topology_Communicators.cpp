#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <utility>

namespace KokkosMoE {
namespace Topology {

CommLayout make_comm_layout(Topology const& topo, CommSpec const& spec) {
  CommLayout L;
  L.nranks = topo.size();
  L.relays_per_node = spec.relays_per_node;
  int const nodes = topo.num_nodes();
  KOKKOSMOE_REQUIRE(spec.relays_per_node >= 1, "relays_per_node must be at least 1 (got " << spec.relays_per_node << ")");
  KOKKOSMOE_REQUIRE(spec.relays_per_node <= topo.min_ranks_per_node(),
                    "relays_per_node = " << spec.relays_per_node << " is more than the " << topo.min_ranks_per_node()
                                         << " ranks of the smallest node");
  if (spec.peer_order.empty()) {
    for (int n = 0; n < nodes; ++n)
      for (int r : topo.ranks_of_node(n)) L.ep_order.push_back(r);
  } else {
    L.ep_order = spec.peer_order;
  }
  // Node-local order follows the EP order restricted to the node, so both
  // communicators list a node's ranks the same way.
  L.node_groups.assign(static_cast<std::size_t>(nodes), {});
  for (int r : L.ep_order)
    if (r >= 0 && r < topo.size()) L.node_groups[static_cast<std::size_t>(topo.node_of(r))].push_back(r);

  int const R = spec.relays_per_node;
  L.relays.assign(static_cast<std::size_t>(nodes), std::vector<int>(static_cast<std::size_t>(R), -1));
  if (!spec.relays.empty()) {
    KOKKOSMOE_REQUIRE(static_cast<int>(spec.relays.size()) == nodes * R,
                      "relays lists " << spec.relays.size() << " ranks, expected nodes x relays_per_node = "
                                      << nodes << " x " << R);
    for (int n = 0; n < nodes; ++n)
      for (int j = 0; j < R; ++j) L.relays[n][j] = spec.relays[static_cast<std::size_t>(n * R + j)];
  } else {
    for (int n = 0; n < nodes; ++n) {
      std::vector<int> cand = topo.ranks_of_node(n);
      if (spec.relay_policy == RelayPolicy::nearest_nic) {
        std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) {
          return topo.rank(a).nic_local && !topo.rank(b).nic_local;
        });
      }
      cand.resize(static_cast<std::size_t>(R));
      std::sort(cand.begin(), cand.end());
      L.relays[n] = cand;
    }
  }
  L.relay_groups.assign(static_cast<std::size_t>(R), {});
  for (int j = 0; j < R; ++j)
    for (int n = 0; n < nodes; ++n) L.relay_groups[j].push_back(L.relays[n][j]);
  return L;
}

void validate(Topology const& topo, CommLayout const& L) {
  int const N = topo.size();
  int const nodes = topo.num_nodes();
  KOKKOSMOE_REQUIRE(L.nranks == N, "communicator layout is for " << L.nranks << " ranks, topology has " << N);
  KOKKOSMOE_REQUIRE(static_cast<int>(L.ep_order.size()) == N,
                    "EP peer order has " << L.ep_order.size() << " entries for " << N << " ranks");
  std::vector<int> seen(static_cast<std::size_t>(N), -1);
  for (std::size_t s = 0; s < L.ep_order.size(); ++s) {
    int const r = L.ep_order[s];
    KOKKOSMOE_REQUIRE(r >= 0 && r < N, "EP peer order slot " << s << " names rank " << r << ", outside [0, " << N << ")");
    KOKKOSMOE_REQUIRE(seen[r] < 0, "rank " << r << " appears twice in the EP peer order (slots " << seen[r] << " and " << s << ")");
    seen[r] = static_cast<int>(s);
  }
  for (int r = 0; r < N; ++r) KOKKOSMOE_REQUIRE(seen[r] >= 0, "rank " << r << " is missing from the EP peer order");

  KOKKOSMOE_REQUIRE(static_cast<int>(L.node_groups.size()) == nodes,
                    L.node_groups.size() << " node-local groups for " << nodes << " nodes");
  std::vector<int> group_of(static_cast<std::size_t>(N), -1);
  for (int n = 0; n < nodes; ++n) {
    for (int r : L.node_groups[n]) {
      KOKKOSMOE_REQUIRE(r >= 0 && r < N, "node-local group " << n << " names rank " << r << ", outside [0, " << N << ")");
      KOKKOSMOE_REQUIRE(topo.node_of(r) == n, "node-local group " << n << " crosses nodes: it holds rank " << r
                                                                   << " of node " << topo.node_of(r));
      KOKKOSMOE_REQUIRE(group_of[r] < 0, "rank " << r << " is listed twice in node-local groups");
      group_of[r] = n;
    }
  }
  for (int r = 0; r < N; ++r) KOKKOSMOE_REQUIRE(group_of[r] >= 0, "rank " << r << " is in no node-local group");

  int const R = L.relays_per_node;
  KOKKOSMOE_REQUIRE(R >= 1, "relays_per_node must be at least 1 (got " << R << ")");
  KOKKOSMOE_REQUIRE(R <= topo.min_ranks_per_node(), "relays_per_node = " << R << " is more than the "
                                                                         << topo.min_ranks_per_node()
                                                                         << " ranks of the smallest node");
  KOKKOSMOE_REQUIRE(static_cast<int>(L.relays.size()) == nodes, "relays given for " << L.relays.size() << " nodes, topology has " << nodes);
  for (int n = 0; n < nodes; ++n) {
    KOKKOSMOE_REQUIRE(static_cast<int>(L.relays[n].size()) == R,
                      "node " << n << " has " << L.relays[n].size() << " relays, expected " << R);
    for (int j = 0; j < R; ++j) {
      int const r = L.relays[n][j];
      KOKKOSMOE_REQUIRE(r >= 0 && r < N, "relay " << j << " of node " << n << " is rank " << r << ", outside [0, " << N << ")");
      KOKKOSMOE_REQUIRE(topo.node_of(r) == n, "relay " << j << " of node " << n << " is rank " << r
                                                         << ", which is outside its node (on node " << topo.node_of(r) << ")");
      for (int i = 0; i < j; ++i)
        KOKKOSMOE_REQUIRE(L.relays[n][i] != r, "rank " << r << " relays two rails (" << i << " and " << j << ") of node " << n);
    }
  }
  KOKKOSMOE_REQUIRE(static_cast<int>(L.relay_groups.size()) == R, L.relay_groups.size() << " relay groups for " << R << " rails");
  for (int j = 0; j < R; ++j) {
    KOKKOSMOE_REQUIRE(static_cast<int>(L.relay_groups[j].size()) == nodes,
                      "relay group " << j << " has " << L.relay_groups[j].size() << " ranks, expected one per node (" << nodes << ")");
    for (int n = 0; n < nodes; ++n) {
      int const r = L.relay_groups[j][n];
      KOKKOSMOE_REQUIRE(r >= 0 && r < N, "relay group " << j << " names rank " << r << ", outside [0, " << N << ")");
      KOKKOSMOE_REQUIRE(r == L.relays[topo.node_of(r)][j], "relay group " << j << " holds rank " << r
                                                                            << ", which is not a relay of rail " << j);
      KOKKOSMOE_REQUIRE(topo.node_of(r) == n, "relay group " << j << " position " << n << " holds rank " << r
                                                              << " of node " << topo.node_of(r) << " (positions follow nodes)");
    }
  }
}

int rail_of(Topology const& topo, CommLayout const& L, int r) { return topo.local_rank_of(r) % L.relays_per_node; }

int relay_for(Topology const& topo, CommLayout const& L, int r, int node) {
  return L.relays[static_cast<std::size_t>(node)][static_cast<std::size_t>(rail_of(topo, L, r))];
}

// ---- Communicator ----------------------------------------------------------
Communicator::Communicator(MPI_Comm owned, std::vector<int> peer_order, int parent_size, std::string name,
                           std::uint64_t epoch)
    : comm_(owned), peers_(std::move(peer_order)), name_(std::move(name)), epoch_(epoch) {
  slot_of_.assign(static_cast<std::size_t>(parent_size), -1);
  for (std::size_t s = 0; s < peers_.size(); ++s) slot_of_[static_cast<std::size_t>(peers_[s])] = static_cast<int>(s);
  if (comm_ != MPI_COMM_NULL) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_set_name(comm_, name_.c_str());
    MPI_Comm_rank(comm_, &my_slot_);
  }
}

Communicator::~Communicator() { release(); }

void Communicator::release() noexcept {
  if (comm_ != MPI_COMM_NULL) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }
}

Communicator::Communicator(Communicator&& o) noexcept
    : comm_(o.comm_), peers_(std::move(o.peers_)), slot_of_(std::move(o.slot_of_)), my_slot_(o.my_slot_),
      name_(std::move(o.name_)), epoch_(o.epoch_) {
  o.comm_ = MPI_COMM_NULL;
  o.my_slot_ = -1;
}

Communicator& Communicator::operator=(Communicator&& o) noexcept {
  if (this != &o) {
    release();
    comm_ = o.comm_;
    peers_ = std::move(o.peers_);
    slot_of_ = std::move(o.slot_of_);
    my_slot_ = o.my_slot_;
    name_ = std::move(o.name_);
    epoch_ = o.epoch_;
    o.comm_ = MPI_COMM_NULL;
    o.my_slot_ = -1;
  }
  return *this;
}

std::vector<std::int64_t> send_split_in_order(std::vector<int> const& peer_order,
                                              std::vector<std::vector<std::int64_t>> const& counts, int me) {
  KOKKOSMOE_REQUIRE(me >= 0 && me < static_cast<int>(counts.size()), "rank " << me << " outside the count matrix");
  std::vector<std::int64_t> split(peer_order.size());
  auto const& row = counts[static_cast<std::size_t>(me)];
  for (std::size_t s = 0; s < peer_order.size(); ++s) {
    int const g = peer_order[s];
    KOKKOSMOE_REQUIRE(g >= 0 && g < static_cast<int>(row.size()), "peer slot " << s << " names rank " << g << " outside the count matrix");
    split[s] = row[static_cast<std::size_t>(g)];
  }
  return split;
}

std::vector<std::int64_t> recv_split_in_order(std::vector<int> const& peer_order,
                                              std::vector<std::vector<std::int64_t>> const& counts, int me) {
  std::vector<std::int64_t> split(peer_order.size());
  for (std::size_t s = 0; s < peer_order.size(); ++s) {
    int const g = peer_order[s];
    KOKKOSMOE_REQUIRE(g >= 0 && g < static_cast<int>(counts.size()), "peer slot " << s << " names rank " << g << " outside the count matrix");
    auto const& row = counts[static_cast<std::size_t>(g)];
    KOKKOSMOE_REQUIRE(me >= 0 && me < static_cast<int>(row.size()), "rank " << me << " outside the count matrix");
    split[s] = row[static_cast<std::size_t>(me)];
  }
  return split;
}

std::vector<std::int64_t> Communicator::send_split(std::vector<std::vector<std::int64_t>> const& counts, int me) const {
  return send_split_in_order(peers_, counts, me);
}

std::vector<std::int64_t> Communicator::recv_split(std::vector<std::vector<std::int64_t>> const& counts, int me) const {
  return recv_split_in_order(peers_, counts, me);
}

// ---- CommunicatorSet ---------------------------------------------------------
namespace {
std::uint64_t& epoch_counter() {
  static std::uint64_t counter = 0;
  return counter;
}
}  // namespace

CommunicatorSet::CommunicatorSet(MPI_Comm parent, Topology topo, CommLayout layout)
    : parent_(parent), topo_(std::move(topo)), layout_(std::move(layout)) {
  build();
}

CommunicatorSet::CommunicatorSet(MPI_Comm parent, Topology topo, CommSpec const& spec)
    : parent_(parent), topo_(std::move(topo)) {
  collective(parent, "communicator layout", [&] { layout_ = make_comm_layout(topo_, spec); });
  build();
}

void CommunicatorSet::build() {
  global_rank_ = comm_rank(parent_);
  int const N = comm_size(parent_);
  collective(parent_, "communicator set validation", [&] {
    KOKKOSMOE_REQUIRE(topo_.size() == N, "topology has " << topo_.size() << " ranks, communicator has " << N);
    validate(topo_, layout_);
  });
  std::uint64_t next = epoch_counter() + 1;
  MPI_Allreduce(MPI_IN_PLACE, &next, 1, MPI_UINT64_T, MPI_MAX, parent_);
  epoch_counter() = next;
  epoch_ = next;

  int const me = global_rank_;
  int const my_node = topo_.node_of(me);
  auto index_in = [](std::vector<int> const& v, int x) {
    return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
  };
  MPI_Comm c = MPI_COMM_NULL;
  KOKKOSMOE_MPI_CHECK(MPI_Comm_split(parent_, 0, index_in(layout_.ep_order, me), &c), parent_);
  ep_ = Communicator(c, layout_.ep_order, N, "kmoe-ep", epoch_);

  auto const& group = layout_.node_groups[static_cast<std::size_t>(my_node)];
  KOKKOSMOE_MPI_CHECK(MPI_Comm_split(parent_, my_node, index_in(group, me), &c), parent_);
  node_ = Communicator(c, group, N, "kmoe-node" + std::to_string(my_node), epoch_);

  relay_rail_ = -1;
  for (int j = 0; j < layout_.relays_per_node; ++j)
    if (layout_.relays[static_cast<std::size_t>(my_node)][static_cast<std::size_t>(j)] == me) relay_rail_ = j;
  KOKKOSMOE_MPI_CHECK(MPI_Comm_split(parent_, relay_rail_ >= 0 ? relay_rail_ : MPI_UNDEFINED, my_node, &c), parent_);
  if (relay_rail_ >= 0) {
    relay_ = Communicator(c, layout_.relay_groups[static_cast<std::size_t>(relay_rail_)], N,
                          "kmoe-relay" + std::to_string(relay_rail_), epoch_);
  }
}

void CommunicatorSet::check_epoch(std::uint64_t epoch, char const* what) const {
  KOKKOSMOE_REQUIRE(epoch == epoch_, what << " belongs to communicator epoch " << epoch
                                          << ", but the live communicator set has epoch " << epoch_);
}

std::string CommunicatorSet::table() const {
  std::ostringstream os;
  os << std::left << std::setw(5) << "rank" << std::setw(18) << "host" << std::setw(5) << "node" << std::setw(6)
     << "local" << std::setw(5) << "numa" << std::setw(12) << "cores" << std::setw(10) << "gpu" << std::setw(10)
     << "nic" << std::setw(7) << "relay" << std::setw(8) << "ep_slot" << std::setw(10) << "node_slot"
     << "relay_slot\n";
  for (int r = 0; r < topo_.size(); ++r) {
    auto const& rec = topo_.rank(r);
    int const node = rec.node;
    auto const& group = layout_.node_groups[static_cast<std::size_t>(node)];
    int node_slot = static_cast<int>(std::find(group.begin(), group.end(), r) - group.begin());
    int ep_slot = static_cast<int>(std::find(layout_.ep_order.begin(), layout_.ep_order.end(), r) - layout_.ep_order.begin());
    int rail = -1;
    for (int j = 0; j < layout_.relays_per_node; ++j)
      if (layout_.relays[static_cast<std::size_t>(node)][static_cast<std::size_t>(j)] == r) rail = j;
    std::string cores = rec.cpuset.empty() ? "-" : rec.cpuset;
    if (!rec.bound && !rec.cpuset.empty()) cores += "*";
    os << std::left << std::setw(5) << r << std::setw(18) << rec.host.substr(0, 17) << std::setw(5) << node
       << std::setw(6) << rec.local_rank << std::setw(5) << rec.numa << std::setw(12) << cores << std::setw(10)
       << (rec.gpu.empty() ? "-" : rec.gpu) << std::setw(10) << (rec.nic.empty() ? "-" : rec.nic) << std::setw(7)
       << (rail >= 0 ? std::string("r").append(std::to_string(rail)) : std::string("-")) << std::setw(8) << ep_slot
       << std::setw(10) << node_slot << (rail >= 0 ? std::to_string(node) : std::string("-")) << "\n";
  }
  return os.str();
}

std::string CommunicatorSet::to_json(int indent) const {
  using json = nlohmann::json;
  json j = json::parse(topo_.to_json(0));
  j["epoch"] = epoch_;
  j["relays_per_node"] = layout_.relays_per_node;
  j["ep_order"] = layout_.ep_order;
  j["node_groups"] = layout_.node_groups;
  j["relays"] = layout_.relays;
  j["relay_groups"] = layout_.relay_groups;
  return j.dump(indent);
}

}  // namespace Topology
}  // namespace KokkosMoE
