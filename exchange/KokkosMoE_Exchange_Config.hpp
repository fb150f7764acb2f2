#ifndef KOKKOSMOE_EXCHANGE_CONFIG_HPP
#define KOKKOSMOE_EXCHANGE_CONFIG_HPP

/// \file KokkosMoE_Exchange_Config.hpp
/// \brief What an exchange is asked to be: its algorithm, its transport, the
/// wire representation of the rows in both directions, the watchdog, and the
/// static shape of the pooled-wave algorithm. Names of the enums are the deck
/// and command-line values (KokkosMoE_EnumNames.hpp).

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>

#include <memory>
#include <string>

namespace KokkosMoE {
namespace Exchange {

class FabricEmulator;

/// \brief Exchange algorithms; every one implements the contract of
/// KokkosMoE_Exchange.hpp (dispatch / combine through a handle).
/// hierarchical_dedup is the hierarchical relay exchange with node
/// deduplication: a token's row crosses to each remote node once, and that
/// node's relay returns one gated partial sum per token
/// (KokkosMoE_Exchange_HierarchicalDedup.hpp).
enum class Algorithm { flat, hierarchical, pooled_wave, hierarchical_dedup };

inline EnumTable<Algorithm> const& names_of(Algorithm) {
  static EnumTable<Algorithm> const t{"exchange algorithm",
                                      {{Algorithm::flat, "flat"},
                                       {Algorithm::hierarchical, "hierarchical"},
                                       {Algorithm::pooled_wave, "pooled_wave"},
                                       {Algorithm::hierarchical_dedup, "hierarchical_dedup"}}};
  return t;
}

/// \brief How rows move between ranks: MPI (host buffers, or device buffers
/// directly when the MPI is CUDA-aware, else staged), or NCCL (device
/// buffers on the execution space instance's stream; CUDA builds with NCCL).
enum class TransportKind { mpi, nccl };

inline EnumTable<TransportKind> const& names_of(TransportKind) {
  static EnumTable<TransportKind> const t{"exchange transport", {{TransportKind::mpi, "mpi"}, {TransportKind::nccl, "nccl"}}};
  return t;
}

/// \brief True when this build can run the transport (NCCL: built with
/// KokkosMoE_ENABLE_NCCL on a CUDA Kokkos).
bool transport_available(TransportKind kind);

/// \brief Why the transport is not available in this build ("" when it is),
/// naming the build option that enables it.
std::string transport_unavailable_reason(TransportKind kind);

/// \brief Watchdog of every wait of a transport or an agreement.
struct TransportOptions {
  /// Seconds a rank waits for its peers before reporting which ones are
  /// missing and failing the call (0: wait forever).
  double watchdog_seconds = 300.0;
  /// Check that the send rows of a started transfer are unchanged when it
  /// completes (digests at the start and at the finish): a send buffer
  /// refilled while MPI may still read it becomes an error instead of
  /// silently wrong rows. Costs a pass over the rows; off by default.
  bool verify_send_rows = false;
  /// An emulated fabric (virtual layouts, MPI transport): every message the
  /// transport sends between emulated links completes no earlier than the
  /// fabric's model allows (KokkosMoE_Exchange_Fabric.hpp). Null: none.
  std::shared_ptr<FabricEmulator> fabric;
  /// MPI transport: move rows through host copies even where MPI could read
  /// the buffers themselves (host memory, or device memory with a
  /// CUDA-aware MPI): for an MPI whose device support is missing or
  /// unreliable, and so that host builds test the staged path. A staged
  /// transfer completes before its start returns.
  bool stage_through_host = false;
  /// MPI transport: pair sends and receives the way NCCL must, so that CPU
  /// runs take NCCL's paths and check its rule: every run is a message of
  /// exactly its rows (no derived datatype gathers a peer's runs), receive
  /// counts are exact (no receive up to a count), and the exchanges choose
  /// the layouts they choose for NCCL. Set by the transport
  /// (ExchangeConfig::pair_runs).
  bool pair_runs = false;
};

/// \brief Configuration of one exchange (any algorithm).
struct ExchangeConfig {
  Algorithm algorithm = Algorithm::flat;
  TransportKind transport = TransportKind::mpi;
  PayloadType payload = PayloadType::bf16;         ///< dispatch rows on the wire
  PayloadType return_payload = PayloadType::bf16;  ///< combine rows on the wire
  double watchdog_seconds = 300.0;                 ///< see TransportOptions
  bool verify_send_rows = false;                   ///< see TransportOptions
  std::shared_ptr<FabricEmulator> fabric;          ///< see TransportOptions
  bool stage_through_host = false;                 ///< see TransportOptions
  bool pair_runs = false;                          ///< MPI transport: see TransportOptions
  /// Flat exchange, where both payloads are the rows' own type: rows land
  /// straight in their expert-major places and return straight from the
  /// expert outputs (one message per source and local slot with rows), with
  /// no repack copy either way. False: one message per peer, then a repack.
  bool receive_into_experts = true;
  // Pooled-wave static shape (A = tokens_per_rank * top_k routes per rank).
  int waves = 1;                 ///< W
  double sender_cf = 1.25;       ///< sender pool rows ceil(sender_cf * A / P / W)
  double receiver_cf = 1.5;      ///< receiver rows per local expert ceil(receiver_cf * A / L / W)
  index_t tokens_per_rank = 0;   ///< the largest token count of any rank
  int top_k = 1;

  TransportOptions transport_options() const { return TransportOptions{watchdog_seconds, verify_send_rows, fabric, stage_through_host, pair_runs}; }
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
