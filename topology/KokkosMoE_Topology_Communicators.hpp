#ifndef KOKKOSMOE_TOPOLOGY_COMMUNICATORS_HPP
#define KOKKOSMOE_TOPOLOGY_COMMUNICATORS_HPP

/// \file KokkosMoE_Topology_Communicators.hpp
/// \brief The expert-parallel communicator set: full EP, node-local and relay
/// communicators, each with an explicit peer map and an epoch.
///
/// Peer slot = index of a rank in one communicator's order = its rank in that
/// MPI communicator. Split vectors are always indexed by the peer slot of the
/// communicator that runs the collective.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Topology.hpp>

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Topology {

/// \brief How relays are chosen inside each node.
enum class RelayPolicy { lowest_local_rank, nearest_nic };
inline EnumTable<RelayPolicy> const& names_of(RelayPolicy) {
  static EnumTable<RelayPolicy> const t{"relay policy",
                                        {{RelayPolicy::lowest_local_rank, "lowest_local_rank"},
                                         {RelayPolicy::nearest_nic, "nearest_nic"}}};
  return t;
}

/// \brief What the caller asks for (deck keys of the [topology] table).
struct CommSpec {
  /// Full EP peer order as global ranks; empty = node-major (node, local rank).
  std::vector<int> peer_order;
  /// Relays per node: 1 = one relay per node; R > 1 = rail relays where relay j
  /// of a node serves the node's local ranks congruent to j modulo R.
  int relays_per_node = 1;
  RelayPolicy relay_policy = RelayPolicy::lowest_local_rank;
  /// Explicit relays (global ranks), nodes x relays_per_node, node-major; empty = by policy.
  std::vector<int> relays;
};

/// \brief The fully resolved communicator layout, identical on every rank.
/// Built from a Topology and a CommSpec by make_comm_layout(); validate()
/// checks every invariant (tests may build malformed layouts on purpose).
struct CommLayout {
  int nranks = 0;
  int relays_per_node = 1;
  std::vector<int> ep_order;                    ///< global ranks in EP peer order
  std::vector<std::vector<int>> node_groups;    ///< [node] global ranks in node-local peer order
  std::vector<std::vector<int>> relays;         ///< [node][rail] global rank of the relay
  std::vector<std::vector<int>> relay_groups;   ///< [rail] relay ranks in relay-communicator order (by node)
};

/// \brief Resolves a CommSpec against a topology (pure, no MPI).
CommLayout make_comm_layout(Topology const& topo, CommSpec const& spec);

/// \brief Checks a layout against a topology; throws Error naming the first
/// violation: wrong-size or non-permutation peer order, a node-local group
/// crossing nodes or missing ranks, a relay outside its node, a relay group
/// holding a non-relay, more relays than ranks on a node.
void validate(Topology const& topo, CommLayout const& layout);

/// \brief Rail (0..R-1) whose relays carry the traffic of global rank r.
int rail_of(Topology const& topo, CommLayout const& layout, int r);

/// \brief Relay on node `node` for the rail of global rank r.
int relay_for(Topology const& topo, CommLayout const& layout, int r, int node);

/// \brief Send split of global rank `me` in a peer order, from a global-rank
/// count matrix counts[src][dst] (zero-count peers included).
std::vector<std::int64_t> send_split_in_order(std::vector<int> const& peer_order,
                                              std::vector<std::vector<std::int64_t>> const& counts, int me);
/// \brief Receive split of global rank `me` in a peer order from counts[src][dst].
std::vector<std::int64_t> recv_split_in_order(std::vector<int> const& peer_order,
                                              std::vector<std::vector<std::int64_t>> const& counts, int me);

/// \brief A communicator KokkosMoE owns (freed by RAII), with its peer map:
/// peer slot <-> global rank (rank in the parent communicator), and the epoch
/// of the set it belongs to. A null Communicator (this rank is not a member)
/// has comm() == MPI_COMM_NULL.
class Communicator {
 public:
  Communicator() = default;
  Communicator(MPI_Comm owned, std::vector<int> peer_order, int parent_size, std::string name,
               std::uint64_t epoch);
  ~Communicator();
  Communicator(Communicator&& other) noexcept;
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(Communicator const&) = delete;
  Communicator& operator=(Communicator const&) = delete;

  MPI_Comm comm() const { return comm_; }
  bool is_member() const { return comm_ != MPI_COMM_NULL; }
  int size() const { return static_cast<int>(peers_.size()); }
  /// \brief This rank's peer slot (-1 when not a member).
  int my_slot() const { return my_slot_; }
  /// \brief Global rank at a peer slot.
  int global_rank(int slot) const { return peers_.at(static_cast<std::size_t>(slot)); }
  /// \brief Peer slot of a global rank, -1 when it is not a member.
  int slot_of(int global) const { return slot_of_.at(static_cast<std::size_t>(global)); }
  std::vector<int> const& peer_order() const { return peers_; }
  std::uint64_t epoch() const { return epoch_; }
  std::string const& name() const { return name_; }

  /// \brief Send split in this communicator's peer order for the calling
  /// rank `me` (global) from a global-rank count matrix [src][dst].
  std::vector<std::int64_t> send_split(std::vector<std::vector<std::int64_t>> const& counts, int me) const;
  /// \brief Receive split in peer order for `me` from the same matrix.
  std::vector<std::int64_t> recv_split(std::vector<std::vector<std::int64_t>> const& counts, int me) const;

 private:
  void release() noexcept;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<int> peers_;
  std::vector<int> slot_of_;
  int my_slot_ = -1;
  std::string name_;
  std::uint64_t epoch_ = 0;
};

/// \brief Full EP, node-local and relay communicators of one layout, built
/// collectively over a parent communicator. Owns every communicator.
class CommunicatorSet {
 public:
  /// \brief Collective over parent: validates the layout on every rank (an
  /// invalid one throws CollectiveError everywhere), then creates the
  /// communicators. A new epoch is agreed by all ranks.
  CommunicatorSet(MPI_Comm parent, Topology topo, CommLayout layout);
  /// \brief Same, resolving spec with make_comm_layout() first.
  CommunicatorSet(MPI_Comm parent, Topology topo, CommSpec const& spec);

  CommunicatorSet(CommunicatorSet const&) = delete;
  CommunicatorSet& operator=(CommunicatorSet const&) = delete;

  Topology const& topology() const { return topo_; }
  CommLayout const& layout() const { return layout_; }
  /// \brief The parent communicator's rank of this process (the "global" rank).
  int global_rank() const { return global_rank_; }
  int size() const { return layout_.nranks; }
  MPI_Comm parent() const { return parent_; }
  Communicator const& ep() const { return ep_; }
  Communicator const& node_local() const { return node_; }
  /// \brief Relay communicator of this rank's rail (null when not a relay).
  Communicator const& relay() const { return relay_; }
  bool is_relay() const { return relay_.is_member(); }
  /// \brief The rail this rank relays (-1 when not a relay).
  int relay_rail() const { return relay_rail_; }
  std::uint64_t epoch() const { return epoch_; }

  /// \brief Throws Error unless epoch is this set's epoch (stale handle).
  void check_epoch(std::uint64_t epoch, char const* what) const;

  /// \brief One text line per rank (host, node, local rank, NUMA, cores,
  /// GPU, NIC, relay, peer slots), identical on every rank.
  std::string table() const;
  /// \brief The topology plus the communicator layout as JSON.
  std::string to_json(int indent = 2) const;

 private:
  void build();
  MPI_Comm parent_;
  Topology topo_;
  CommLayout layout_;
  int global_rank_ = -1;
  Communicator ep_;
  Communicator node_;
  Communicator relay_;
  int relay_rail_ = -1;
  std::uint64_t epoch_ = 0;
};

}  // namespace Topology
}  // namespace KokkosMoE

#endif
