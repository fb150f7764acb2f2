#ifndef KOKKOSMOE_REBALANCE_HPP
#define KOKKOSMOE_REBALANCE_HPP

/// \file KokkosMoE_Rebalance.hpp
/// \brief Live rebalancing of a layer's routed experts: EPLB on the load a
/// window of steps observed builds the next placement generation, and the
/// expert weights move to their new slots through execute_migration (same-rank
/// copies, point-to-point messages between ranks, every blob's digest checked
/// at both ends).
///
/// A slot's parameters travel as one blob: the stored bytes of its gate, up
/// and down rows (T, in that order), or for scalar test experts the float
/// scale. The weights of a slot depend only on its logical expert, so a layer
/// rebuilt on the new placement computes what the old one did, bit for bit
/// (unless routing depends on the placement: node-limited domains or
/// device-capacity admission follow the new expert -> rank map).
///
/// Memory: while it runs, a rank holds its slots' parameters as host blobs
/// twice (the old slots' and the new slots'); the caller holds both
/// generations' device weights until it releases the old layer.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Migration.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Parameter blob of every local slot of `w` (host bytes): gate, up,
/// down as stored, or the scalar scale for scalar test experts.
template <class T, class MS>
std::vector<ParameterBlob> slot_blobs(Experts::ExpertWeights<T, MS> const& w) {
  int const L = w.num_slots();
  std::vector<ParameterBlob> blobs(static_cast<std::size_t>(L));
  if (!w.has_swiglu()) {
    KOKKOSMOE_REQUIRE(w.has_scalar(), "slot_blobs: the weights '" << w.label() << "' hold neither SwiGLU tensors nor scalar scales");
    for (int q = 0; q < L; ++q) {
      auto& b = blobs[static_cast<std::size_t>(q)];
      b.resize(sizeof(float));
      std::memcpy(b.data(), &w.scalar_scale_host()[static_cast<std::size_t>(q)], sizeof(float));
    }
    return blobs;
  }
  auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w.gate());
  auto hu = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w.up());
  auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w.down());
  std::size_t const per = static_cast<std::size_t>(w.d()) * static_cast<std::size_t>(w.d_ff()) * sizeof(T);
  for (int q = 0; q < L; ++q) {
    auto& b = blobs[static_cast<std::size_t>(q)];
    b.resize(3 * per);
    std::size_t const off = static_cast<std::size_t>(q) * per;
    std::memcpy(b.data(), reinterpret_cast<unsigned char const*>(hg.data()) + off, per);
    std::memcpy(b.data() + per, reinterpret_cast<unsigned char const*>(hu.data()) + off, per);
    std::memcpy(b.data() + 2 * per, reinterpret_cast<unsigned char const*>(hd.data()) + off, per);
  }
  return blobs;
}

/// \brief Weights shaped like `like` (label, d, d_ff, T, SwiGLU or scalar) for
/// the local slots `slot_expert`, filled from one blob per slot (slot_blobs()
/// layout); every slot gets checkpoint version `version`, digests recomputed.
template <class T, class MS>
Experts::ExpertWeights<T, MS> weights_from_blobs(Experts::ExpertWeights<T, MS> const& like, std::vector<int> const& slot_expert,
                                                 std::vector<ParameterBlob> const& blobs, std::uint64_t version) {
  KOKKOSMOE_REQUIRE(blobs.size() == slot_expert.size(), "weights_from_blobs: " << blobs.size() << " blobs for " << slot_expert.size() << " slots");
  int const L = static_cast<int>(slot_expert.size());
  if (!like.has_swiglu()) {
    int const E = slot_expert.empty() ? 0 : *std::max_element(slot_expert.begin(), slot_expert.end()) + 1;
    std::vector<float> scale(static_cast<std::size_t>(E), 0.0f);
    for (int q = 0; q < L; ++q) {
      KOKKOSMOE_REQUIRE(blobs[static_cast<std::size_t>(q)].size() == sizeof(float),
                        "weights_from_blobs: slot " << q << " has " << blobs[static_cast<std::size_t>(q)].size() << " bytes, a scale has 4");
      std::memcpy(&scale[static_cast<std::size_t>(slot_expert[static_cast<std::size_t>(q)])], blobs[static_cast<std::size_t>(q)].data(),
                  sizeof(float));
    }
    auto w = Experts::ExpertWeights<T, MS>::scalar(like.label(), slot_expert, like.d(), scale);
    w.set_version(version);
    return w;
  }
  Experts::ExpertWeights<T, MS> w(like.label(), slot_expert, like.d(), like.d_ff());
  auto hg = Kokkos::create_mirror_view(Kokkos::HostSpace(), w.gate());
  auto hu = Kokkos::create_mirror_view(Kokkos::HostSpace(), w.up());
  auto hd = Kokkos::create_mirror_view(Kokkos::HostSpace(), w.down());
  std::size_t const per = static_cast<std::size_t>(w.d()) * static_cast<std::size_t>(w.d_ff()) * sizeof(T);
  for (int q = 0; q < L; ++q) {
    auto const& b = blobs[static_cast<std::size_t>(q)];
    KOKKOSMOE_REQUIRE(b.size() == 3 * per, "weights_from_blobs: slot " << q << " has " << b.size() << " bytes, its tensors " << 3 * per);
    std::size_t const off = static_cast<std::size_t>(q) * per;
    std::memcpy(reinterpret_cast<unsigned char*>(hg.data()) + off, b.data(), per);
    std::memcpy(reinterpret_cast<unsigned char*>(hu.data()) + off, b.data() + per, per);
    std::memcpy(reinterpret_cast<unsigned char*>(hd.data()) + off, b.data() + 2 * per, per);
  }
  Kokkos::deep_copy(w.gate(), hg);
  Kokkos::deep_copy(w.up(), hu);
  Kokkos::deep_copy(w.down(), hd);
  w.set_version(version);
  w.refresh_digests();
  return w;
}

/// \brief What one rebalancing did.
struct RebalanceRecord {
  std::uint64_t generation = 0;  ///< the new placement's generation
  RankLoadSummary before;        ///< the window's load on the old placement (ideal split over replicas)
  RankLoadSummary after;         ///< the same load on the new placement
  MigrationPlan plan;
  MigrationLedger ledger;        ///< this rank's bytes and messages; sent_total over all ranks
  double seconds = 0;            ///< this rank's time: placement, planning, migration, new weights
};

/// \brief A placement generation and this rank's weights for it.
template <class T, class MS>
struct Rebalanced {
  Placement placement;  ///< with every slot's parameter digest
  Experts::ExpertWeights<T, MS> weights;
  RebalanceRecord record;
};

/// \brief Collective over comm (rank i of comm is placement rank i): builds
/// the next placement generation by `spec` (EPLB policies; ranks, nodes and
/// generation are set here) from `window_load` ([E] routes per logical expert,
/// the same on every rank) and moves `weights` (this rank's slots of
/// `current`) to it. Errors are CollectiveErrors on every rank; on an error
/// `current` and `weights` are untouched.
template <class T, class MS>
Rebalanced<T, MS> rebalance_experts(MPI_Comm comm, Placement const& current, std::vector<int> const& node_of_rank,
                                    Experts::ExpertWeights<T, MS> const& weights, std::vector<double> const& window_load,
                                    PlacementSpec spec) {
  Kokkos::Timer timer;
  int const me = comm_rank(comm);
  Rebalanced<T, MS> r;
  std::vector<ParameterBlob> blobs;
  std::vector<std::uint64_t> local_digests;
  std::uint64_t version = 0;
  collective(comm, "rebalancing: next placement", [&] {
    KOKKOSMOE_REQUIRE(is_eplb(spec.policy), "rebalancing needs an EPLB placement policy, not " << to_string(spec.policy));
    KOKKOSMOE_REQUIRE(static_cast<int>(window_load.size()) == current.num_experts(),
                      "rebalancing: " << window_load.size() << " expert loads for " << current.num_experts() << " experts");
    KOKKOSMOE_REQUIRE(static_cast<int>(node_of_rank.size()) == current.num_ranks(),
                      "rebalancing: nodes of " << node_of_rank.size() << " ranks for a placement of " << current.num_ranks());
    KOKKOSMOE_REQUIRE(weights.num_slots() == static_cast<int>(current.slots_of_rank(me).size()),
                      "rebalancing: rank " << me << " holds " << weights.num_slots() << " weight slots, the placement "
                                           << current.slots_of_rank(me).size());
    spec.ranks = current.num_ranks();
    spec.nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
    spec.generation = current.generation() + 1;
    r.placement = eplb_layer(window_load, spec).placement.with_nodes(node_of_rank);
    blobs = slot_blobs(weights);
    for (auto const& b : blobs) local_digests.push_back(digest_bytes(b.data(), b.size()));
    for (auto v : weights.versions()) version = std::max(version, v);
  });
  std::uint64_t agreed_version = 0;
  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(&version, &agreed_version, 1, MPI_UINT64_T, MPI_MAX, comm), comm);
  Placement const source = current.with_digests(gather_slot_digests(comm, current, local_digests));
  std::vector<std::uint64_t> digest_of_expert(static_cast<std::size_t>(current.num_experts()), 0);
  std::vector<std::int64_t> bytes_of_expert(static_cast<std::size_t>(current.num_experts()), 0);
  std::int64_t const slot_bytes = weights.has_swiglu()
                                      ? 3 * static_cast<std::int64_t>(weights.d()) * weights.d_ff() * static_cast<std::int64_t>(sizeof(T))
                                      : static_cast<std::int64_t>(sizeof(float));
  for (int s = 0; s < source.num_slots(); ++s) {
    digest_of_expert[static_cast<std::size_t>(source.slot(s).expert)] = source.slot(s).digest;
    bytes_of_expert[static_cast<std::size_t>(source.slot(s).expert)] = slot_bytes;
  }
  r.placement = r.placement.with_expert_digests(digest_of_expert, agreed_version);
  r.record.generation = r.placement.generation();
  r.record.before = rank_load_summary(current, window_load);
  r.record.after = rank_load_summary(r.placement, window_load);
  r.record.plan = plan_migration(source, r.placement, bytes_of_expert);
  std::vector<ParameterBlob> moved;
  r.record.ledger = execute_migration(comm, r.record.plan, source, r.placement, blobs, moved);
  collective(comm, "rebalancing: new weights", [&] {
    std::vector<int> slot_expert;
    for (int s : r.placement.slots_of_rank(me)) slot_expert.push_back(r.placement.slot(s).expert);
    r.weights = weights_from_blobs(weights, slot_expert, moved, agreed_version);
  });
  r.record.seconds = timer.seconds();
  return r;
}

}  // namespace KokkosMoE

#endif
