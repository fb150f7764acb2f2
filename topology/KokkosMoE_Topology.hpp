#ifndef KOKKOSMOE_TOPOLOGY_HPP
#define KOKKOSMOE_TOPOLOGY_HPP

/// \file KokkosMoE_Topology.hpp
/// \brief Who runs where: node identity, local ranks, hwloc hardware view,
/// binding, nearest GPU and NIC, for every rank of a communicator.
///
/// Three layouts yield the same record:
///  - hwloc: the real machine (nodes from MPI shared-memory split + host names);
///  - virtual: nodes declared by the caller (e.g. an input deck), so one
///    machine can emulate several nodes;
///  - synthetic: the hardware of every node comes from an hwloc synthetic
///    description or XML file (topology experiments), nodes as in virtual.

#include <KokkosMoE_EnumNames.hpp>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Topology {

enum class LayoutKind { hwloc, virtual_nodes, synthetic };

/// \brief "hwloc", "virtual", "synthetic".
inline EnumTable<LayoutKind> const& names_of(LayoutKind) {
  static EnumTable<LayoutKind> const t{"topology layout",
                                       {{LayoutKind::hwloc, "hwloc"},
                                        {LayoutKind::virtual_nodes, "virtual"},
                                        {LayoutKind::synthetic, "synthetic"}}};
  return t;
}

/// \brief How node identity and hardware are obtained.
struct LayoutSpec {
  LayoutKind kind = LayoutKind::hwloc;
  /// virtual/synthetic: uniform nodes of this many consecutive ranks (0 = unset).
  int ranks_per_node = 0;
  /// virtual/synthetic: node id of every rank (alternative to ranks_per_node).
  std::vector<int> node_of_rank;
  /// virtual/synthetic: explicit rank lists per node (alternative to the above).
  std::vector<std::vector<int>> nodes;
  /// virtual: NIC names of every node (each node gets the same list).
  std::vector<std::string> nic_names;
  /// synthetic: an hwloc synthetic description, e.g. "pack:2 numa:2 core:4 pu:1".
  std::string synthetic;
  /// synthetic: an hwloc XML file describing one node (I/O devices included).
  std::string xml_file;
};

/// \brief An OS device (GPU or NIC) of a node, with its locality.
struct Device {
  std::string name;     ///< OS name: cuda0, nvml0, mlx5_0, eth0, ...
  std::string subtype;  ///< CUDA, NVML, OpenFabrics, Network, ...
  int package = -1;     ///< package logical index, -1 when not local to one
  int numa = -1;        ///< first NUMA node logical index local to it, -1 unknown
  std::string cpuset;   ///< locality as a PU list ("0-15")
};

/// \brief Hardware of one node as hwloc (or the synthetic description) sees it.
struct NodeHardware {
  int packages = 0;
  int numa_nodes = 0;
  int cores = 0;
  int pus = 0;
  std::vector<Device> gpus;
  std::vector<Device> nics;
  std::string source;  ///< "hwloc", "synthetic:<desc>", "xml:<file>", "virtual"
};

/// \brief One rank's place in the machine.
struct RankRecord {
  int rank = -1;        ///< rank in the communicator the topology was built on
  std::string host;     ///< host name (real)
  int node = -1;        ///< node id, agreed by all ranks, 0..nodes-1 by lowest rank
  int local_rank = -1;  ///< index among the node's ranks (ascending rank)
  int local_size = 0;
  int package = -1;     ///< package of the binding (-1: unbound or spans several)
  int numa = -1;        ///< first NUMA node of the binding
  std::string cpuset;   ///< binding as a PU list
  int bound_cores = 0;
  int bound_pus = 0;
  bool bound = false;   ///< false when the binding covers the whole node
  std::string gpu;      ///< GPU assigned by locality (local rank order), "" none
  std::string nic;      ///< nearest NIC, "" none
  bool nic_local = false;  ///< the binding shares locality with that NIC
};

/// \brief The agreed topology of a communicator: identical on every rank.
class Topology {
 public:
  Topology() = default;

  /// \brief Collective over comm: discovers or declares the layout, gathers
  /// every rank's record and validates it. Errors reach every rank.
  static Topology discover(MPI_Comm comm, LayoutSpec const& spec = {});

  /// \brief Builds the topology of nranks simulated ranks in one process
  /// (virtual or synthetic layouts only; no MPI). Hosts are "sim-node<N>".
  static Topology simulated(int nranks, LayoutSpec const& spec);

  int size() const { return static_cast<int>(ranks_.size()); }
  int num_nodes() const { return static_cast<int>(node_ranks_.size()); }
  LayoutKind kind() const { return kind_; }
  RankRecord const& rank(int r) const { return ranks_.at(static_cast<std::size_t>(r)); }
  std::vector<RankRecord> const& ranks() const { return ranks_; }
  int node_of(int r) const { return rank(r).node; }
  int local_rank_of(int r) const { return rank(r).local_rank; }
  /// \brief Ranks of node n in ascending order (local rank order).
  std::vector<int> const& ranks_of_node(int n) const { return node_ranks_.at(static_cast<std::size_t>(n)); }
  NodeHardware const& node_hardware(int n) const { return node_hw_.at(static_cast<std::size_t>(n)); }
  int min_ranks_per_node() const;
  /// \brief True when every rank runs on one host (one host name).
  bool single_host() const {
    for (auto const& r : ranks_)
      if (r.host != ranks_.front().host) return false;
    return true;
  }

  /// \brief JSON text of the whole record (ranks, nodes, hardware).
  std::string to_json(int indent = 2) const;

  /// \brief Builds from explicit per-rank records (used by discover/simulated
  /// and by tests); validates node ids, local ranks and per-node hardware.
  static Topology from_records(LayoutKind kind, std::vector<RankRecord> records,
                               std::vector<NodeHardware> node_hw);

 private:
  LayoutKind kind_ = LayoutKind::hwloc;
  std::vector<RankRecord> ranks_;
  std::vector<std::vector<int>> node_ranks_;
  std::vector<NodeHardware> node_hw_;
};

/// \brief Resolves the node of every rank for a virtual/synthetic layout and
/// checks it (a rank in two nodes, a missing rank, an empty node, ...).
/// Pure function, identical on every rank.
std::vector<int> resolve_node_of_rank(LayoutSpec const& spec, int nranks);

/// \brief Writes the calling process' hwloc topology (or the spec's
/// synthetic/XML one) as hwloc XML to path.
void export_hwloc_xml(LayoutSpec const& spec, std::string const& path);

}  // namespace Topology
}  // namespace KokkosMoE

#endif
