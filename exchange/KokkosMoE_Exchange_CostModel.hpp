#ifndef KOKKOSMOE_EXCHANGE_COSTMODEL_HPP
#define KOKKOSMOE_EXCHANGE_COSTMODEL_HPP

/// \file KokkosMoE_Exchange_CostModel.hpp
/// \brief An alpha-beta cost model of the exchanges, honest about being a
/// model: it turns byte ledgers (planned or measured) into predicted stage
/// times. Its parameters come from a calibration (kmoe-bench calibrate, on
/// this machine, optionally under an emulated fabric) or are stated
/// (a fabric's latency and bandwidth). Every figure it produces is of the
/// evidence class "model".
///
/// Per stage of a direction, with the ledgers of every rank:
///   t = stage_s + encode_s_per_byte * (bytes the rank encodes)
///               + decode_s_per_byte * (bytes the rank decodes)
///       + max( max over ranks of  sum over link classes c of
///                  messages_c * alpha_c + bytes_c * beta_c,
///              max over NICs of   sum over its ranks' inter-node messages of
///                  nic.alpha + bytes * nic.beta )
/// where the rank terms are what each rank's own transport work costs (the
/// same-rank class is a local copy) and the NIC term is the exclusive time
/// of a shared NIC (an emulated or a stated fabric; zero for a machine
/// without one). Rows are encoded in a direction's first stage (the
/// dispatch: the bytes the rank sends there, token rows read scattered, in
/// every wave of a pooled-wave exchange; the
/// combine: every expert output row the rank holds, its dispatch's useful
/// rows, read in runs: return_encode_s_per_byte) and, in the
/// dispatch, decoded in its last (its useful rows); relays forward encoded
/// rows. A direction whose rows need no repack copy (DirectionLedger::
/// rows_in_place: rows land in their expert rows, results leave from them)
/// has no decode (dispatch) or expert-output encode (combine) term. A
/// deduplicating hierarchical exchange's relays also copy rows in runs
/// (decode_s_per_byte): the units they forward (dispatch stage 2), the rows
/// they expand them into (stage 3) and the results they sum into partials
/// (combine stage 1). The messages are the ledger's (the rows' and their metadata's,
/// one per run where a stage sends runs separately: transfer_messages),
/// and every rank of the stage's communicator sends one count message to
/// each of its peers (the counts and, for runs, their lengths, one round).

#include <KokkosMoE_Exchange_Fabric.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_Topology.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Seconds of `messages` messages carrying `bytes` bytes.
struct LinkCost {
  double alpha_s = 0.0;          ///< per message
  double beta_s_per_byte = 0.0;  ///< per byte
  double seconds(double messages, double bytes) const { return messages * alpha_s + bytes * beta_s_per_byte; }
};

/// \brief One calibration point: a message size and the one-way time of a
/// message of that size on a link class.
struct CalibrationSample {
  std::string link;  ///< same_rank, intra_node, inter_node, nic
  double bytes = 0;
  double seconds = 0;
};

/// \brief Model parameters and where they came from.
struct CostModel {
  LinkCost same_rank;   ///< a rank's rows to itself (a local copy)
  LinkCost intra_node;  ///< per rank, to a peer of its node
  LinkCost inter_node;  ///< per rank, the transport's own cost to a peer on another node
  LinkCost nic;         ///< exclusive time of a node's NIC per inter-node message (0: no shared NIC)
  int nics_per_node = 1;
  double encode_s_per_byte = 0.0;  ///< packing token rows into the payload (reads scattered), per payload byte
  double decode_s_per_byte = 0.0;  ///< unpacking arrived rows into expert rows (in runs), per payload byte
  /// Packing expert outputs into the return payload (reads in runs), per
  /// payload byte; a calibration file without it uses encode_s_per_byte.
  double return_encode_s_per_byte = 0.0;
  double stage_s = 0.0;          ///< fixed per stage (agreements, fences, plans): any algorithm not below
  std::map<std::string, double> stage_s_of;  ///< fixed per stage of one algorithm (by name), measured
  double stage_seconds(std::string const& algorithm) const {
    auto const it = stage_s_of.find(algorithm);
    return it == stage_s_of.end() ? stage_s : it->second;
  }
  FabricSpec fabric;     ///< the emulated fabric the calibration ran under (disabled: none)
  std::string evidence;  ///< what the parameters rest on: "measured", "emulated", or "stated"
  std::string origin;    ///< the machine / fabric / statement they came from
  std::vector<CalibrationSample> samples;  ///< raw calibration points (empty when stated)

  /// A model of a stated fabric alone: its NIC (latency, 1 / bandwidth, NICs
  /// per node) on top of `base`'s per-rank costs (zero when none is given).
  static CostModel stated(FabricSpec const& fabric, CostModel const* base = nullptr);
  /// The model for a run on `fabric` (disabled: none): this one when it was
  /// calibrated under that fabric (or under none, for none), else its
  /// per-rank costs with the NIC stated by the fabric (none: no NIC term).
  CostModel for_fabric(FabricSpec const& fabric) const;
  std::string to_json(int indent = 2) const;
  /// Parses a calibration file's text; throws Error naming `where` and the
  /// missing or bad field.
  static CostModel from_json(std::string const& text, std::string const& where);
};

/// \brief Least-squares alpha and beta (both >= 0) of (bytes, seconds) points.
LinkCost fit_alpha_beta(std::vector<std::pair<double, double>> const& points);

/// \brief Peers a rank of the stage communicator `name` (a ledger stage's
/// communicator) sends one count message to in that stage: {of its own
/// node, on other nodes}; none where the rank is not in it ("-").
std::pair<int, int> count_message_peers(std::string const& name, int rank, Topology::Topology const& topo,
                                        Topology::CommLayout const& layout);

/// \brief The model's stage times of an exchange: the sum of the ranks'
/// ledgers (index = global rank) with every stage's seconds replaced by the
/// model's prediction. The ledgers must come from one algorithm on the
/// topology and communicator layout given.
ByteLedger predict(CostModel const& model, Topology::Topology const& topo, Topology::CommLayout const& layout,
                   std::vector<ByteLedger> const& ledgers);

/// \brief Total seconds of both directions of a ledger (its stages summed).
double total_seconds(ByteLedger const& ledger);

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
