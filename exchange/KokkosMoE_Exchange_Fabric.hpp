#ifndef KOKKOSMOE_EXCHANGE_FABRIC_HPP
#define KOKKOSMOE_EXCHANGE_FABRIC_HPP

/// \file KokkosMoE_Exchange_Fabric.hpp
/// \brief An emulated fabric for the MPI transport on virtual layouts: the
/// rows still move through MPI (and are checked), but a message between two
/// virtual nodes completes no earlier than a modelled network would let it.
///
/// The model. Every node has `nics_per_node` NICs; a rank uses NIC
/// (local rank mod nics_per_node) of its node. A message of b bytes between
/// ranks on different nodes costs c = inter_latency + b / inter_bandwidth of
/// exclusive time on the sending rank's NIC (egress) and on the receiving
/// rank's NIC (ingress). A NIC serves one message at a time, in the order the
/// messages reach it, which is the order they were posted (the sender
/// reserves both ends when it posts); the ingress may start a message as
/// soon as its egress did (cut-through), so one message alone completes c
/// after it was posted, and k messages through one NIC take at least k c. A
/// send completes when its egress ends, a receive when its ingress ends (and
/// the real data are there). Optionally, messages between ranks of one node
/// pay an intra-node link the same way, with one port per rank instead of a
/// shared NIC.
/// Messages of a rank to itself are local copies and never emulated.
///
/// What it does not model: switches and their contention, adaptive routing,
/// congestion control, the NIC's own per-message overlap (latency is
/// exclusive NIC time here, a conservative choice that makes message counts
/// matter), and the library's collectives (agreements, reductions), which
/// run at this machine's speed. The time the real transfer takes on this
/// machine adds to the emulated one, so emulated times are upper bounds of
/// the model's and are labelled "emulated" in every report.
///
/// Mechanism. The NICs' "busy until" times live in one shared-memory segment
/// (so every rank of the run must be on one host, which virtual layouts
/// are); each emulated message is followed by a 16-byte stamp message
/// carrying its egress end and its arrival (the ingress end the sender
/// reserved). Clocks: CLOCK_MONOTONIC, one per host.

#include <KokkosMoE_Types.hpp>

#include <mpi.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Parameters of an emulated fabric (deck: [topology.fabric]).
struct FabricSpec {
  double inter_latency_us = 0.0;      ///< per message, exclusive NIC time
  double inter_bandwidth_gbps = 0.0;  ///< GB/s (1e9 B/s) per NIC; > 0 when the fabric is on
  int nics_per_node = 1;
  double intra_latency_us = 0.0;      ///< intra-node link (optional): per message
  double intra_bandwidth_gbps = 0.0;  ///< GB/s per rank port; 0 with 0 latency: intra-node untouched

  bool enabled() const { return inter_bandwidth_gbps > 0.0; }
  bool intra_enabled() const { return intra_bandwidth_gbps > 0.0 || intra_latency_us > 0.0; }
  /// Nanoseconds a message of `bytes` occupies a NIC (inter) or a port (intra).
  std::int64_t cost_ns(bool inter, std::size_t bytes) const;
  /// "inter-node link 20 us + B / 5 GB/s per message, 1 NIC per node; intra-node untouched"
  std::string describe() const;
  /// Throws Error naming the first bad parameter (prefix: where it came from).
  void validate(std::string const& where) const;
};

/// \brief Link class of a message for the emulation.
enum class FabricLink : int { none = 0, intra = 1, inter = 2 };

/// \brief The emulated fabric of one run (see the file comment). Built
/// collectively over the run's communicator; the ranks named below are ranks
/// of that communicator (Topology::Communicator::global_rank). Destruction is
/// local (no MPI call).
class FabricEmulator {
 public:
  /// Collective over comm: node_of_rank[r] is the virtual node of rank r.
  /// Throws the same CollectiveError on every rank when the spec is invalid
  /// or the ranks do not share one host.
  FabricEmulator(MPI_Comm comm, std::vector<int> node_of_rank, FabricSpec const& spec);
  ~FabricEmulator();
  FabricEmulator(FabricEmulator const&) = delete;
  FabricEmulator& operator=(FabricEmulator const&) = delete;

  FabricSpec const& spec() const { return spec_; }
  int rank() const { return me_; }
  int nic_of(int rank) const { return nic_[static_cast<std::size_t>(rank)]; }
  FabricLink link(int from, int to) const;

  /// What travels with an emulated message.
  struct Stamp {
    std::int64_t egress_end_ns = 0;  ///< the send completes then
    std::int64_t arrival_ns = 0;     ///< the receive completes then (ingress end, not before the egress end)
  };
  /// Sender side, at posting `bytes` to rank `to` (link not none): reserves
  /// the egress and, in posting order, the receiver's ingress.
  Stamp depart(int to, std::size_t bytes);

  /// Messages and bytes this rank sent over each emulated link class, and the
  /// seconds its waits were held back beyond the real transfer.
  struct Stats {
    std::array<std::int64_t, 3> messages{};
    std::array<std::int64_t, 3> bytes{};
    double held_seconds = 0.0;
  };
  Stats const& stats() const { return stats_; }
  void add_held(double seconds) { stats_.held_seconds += seconds; }

  static std::int64_t now_ns();
  /// Yields the core until the monotonic clock reaches ns.
  static void wait_until(std::int64_t ns);

 private:
  std::int64_t* slot(int index) const { return shared_ + index; }
  std::int64_t reserve(std::int64_t* busy, std::int64_t earliest, std::int64_t cost);
  int ingress_of(int rank, bool inter) const;

  FabricSpec spec_;
  int me_ = 0;
  int nranks_ = 0;
  int nodes_ = 0;
  std::vector<int> node_;
  std::vector<int> nic_;  ///< NIC (within its node) of every rank
  std::int64_t* shared_ = nullptr;
  std::size_t shared_bytes_ = 0;
  Stats stats_;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
