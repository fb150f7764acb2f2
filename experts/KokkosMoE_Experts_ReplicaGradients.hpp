#ifndef KOKKOSMOE_EXPERTS_REPLICA_GRADIENTS_HPP
#define KOKKOSMOE_EXPERTS_REPLICA_GRADIENTS_HPP

/// \file KokkosMoE_Experts_ReplicaGradients.hpp
/// \brief Sums the weight gradients of replicated experts over their
/// replicas, so that every copy of an expert takes the same optimizer step.
///
/// A placement (EPLB) may store an expert in several slots on several ranks;
/// each copy sees only the rows routed to it, so its gradient is a partial
/// sum. ReplicaGradients groups the replicated experts by the set of ranks
/// that hold them and builds one communicator per set (MPI_Comm_create_group
/// over the expert-parallel communicator, members only, in one global order),
/// for one placement generation. reduce() adds, per set, every rank's local
/// replicas (in local slot order), reduces to the set's first rank in a
/// fixed order and broadcasts: every replica ends with bitwise the same sum.
/// verify() checks that by digests. Local slot q of the gradients is
/// placement.slots_of_rank(rank)[q], the order of the rank's ExpertWeights.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_Backward.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Experts {

namespace Impl {

/// buf[x * per + i] = sum over the local replicas of expert x of element i
/// of (gate, up, down) flattened.
template <class Exec, class MS>
void pack_replicas(Exec const& exec, ExpertGradients<MS> const& g, std::vector<std::vector<int>> const& local, std::size_t per,
                   Kokkos::View<float*, MS> const& buf) {
  std::size_t const third = per / 3;
  for (std::size_t x = 0; x < local.size(); ++x) {
    std::vector<int> const& slots = local[x];
    for (std::size_t r = 0; r < slots.size(); ++r) {
      std::size_t const q = static_cast<std::size_t>(slots[r]);
      float const* gp = g.gate.data() + q * third;
      float const* up = g.up.data() + q * third;
      float const* dp = g.down.data() + q * third;
      float* out = buf.data() + x * per;
      bool const first = r == 0;
      Kokkos::parallel_for("KokkosMoE::Experts::ReplicaGradients::pack",
                           Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, third), KOKKOS_LAMBDA(std::size_t i) {
                             out[i] = (first ? 0.0f : out[i]) + gp[i];
                             out[third + i] = (first ? 0.0f : out[third + i]) + up[i];
                             out[2 * third + i] = (first ? 0.0f : out[2 * third + i]) + dp[i];
                           });
    }
  }
}

template <class Exec, class MS>
void unpack_replicas(Exec const& exec, Kokkos::View<float*, MS> const& buf, std::vector<std::vector<int>> const& local, std::size_t per,
                     ExpertGradients<MS>& g) {
  std::size_t const third = per / 3;
  for (std::size_t x = 0; x < local.size(); ++x)
    for (int slot : local[x]) {
      std::size_t const q = static_cast<std::size_t>(slot);
      float* gp = g.gate.data() + q * third;
      float* up = g.up.data() + q * third;
      float* dp = g.down.data() + q * third;
      float const* in = buf.data() + x * per;
      Kokkos::parallel_for("KokkosMoE::Experts::ReplicaGradients::unpack",
                           Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, third), KOKKOS_LAMBDA(std::size_t i) {
                             gp[i] = in[i];
                             up[i] = in[third + i];
                             dp[i] = in[2 * third + i];
                           });
    }
}

}  // namespace Impl

class ReplicaGradients {
 public:
  /// One set of ranks and the replicated experts they all hold.
  struct ReplicaSet {
    std::vector<int> ranks;    ///< ascending global ranks
    std::vector<int> experts;  ///< ascending logical experts held (in one or more slots) by every rank of the set
    MPI_Comm comm = MPI_COMM_NULL;  ///< this rank's communicator of the set (MPI_COMM_NULL when not a member)
  };

  ReplicaGradients() = default;
  /// \brief Collective over ep (rank i of ep = placement rank i): the sets
  /// and their communicators for `placement`.
  ReplicaGradients(MPI_Comm ep, Placement const& placement, double watchdog_seconds = 300.0)
      : generation_(placement.generation()), watchdog_(watchdog_seconds) {
    int rank = 0, size = 0;
    MPI_Comm_rank(ep, &rank);
    MPI_Comm_size(ep, &size);
    collective(ep, "ReplicaGradients", [&] {
      KOKKOSMOE_REQUIRE(placement.num_ranks() == size, "ReplicaGradients: the placement has " << placement.num_ranks()
                                                                                            << " ranks, the communicator " << size);
    }, watchdog_seconds);
    rank_ = rank;
    // Ranks of every replicated expert, grouped by rank set.
    std::map<std::vector<int>, std::vector<int>> by_ranks;
    for (int e = 0; e < placement.num_experts(); ++e) {
      std::vector<int> const& slots = placement.log2phy()[static_cast<std::size_t>(e)];  // padded with -1
      if (placement.logcnt()[static_cast<std::size_t>(e)] < 2) continue;
      std::vector<int> ranks;
      for (int s : slots)
        if (s >= 0) ranks.push_back(placement.slot(s).rank);
      std::sort(ranks.begin(), ranks.end());
      ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
      by_ranks[ranks].push_back(e);
    }
    MPI_Group world_group;
    MPI_Comm_group(ep, &world_group);
    int tag = 0;
    for (auto& [ranks, experts] : by_ranks) {
      ReplicaSet set;
      set.ranks = ranks;
      set.experts = experts;
      ++tag;
      if (std::binary_search(ranks.begin(), ranks.end(), rank) && ranks.size() > 1) {
        MPI_Group g;
        MPI_Group_incl(world_group, static_cast<int>(ranks.size()), ranks.data(), &g);
        MPI_Comm_create_group(ep, g, tag, &set.comm);
        MPI_Group_free(&g);
      }
      // Local replicas of each expert of the set (local slot indices).
      std::vector<std::vector<int>> local(experts.size());
      std::vector<int> const& mine = placement.slots_of_rank(rank);
      for (std::size_t q = 0; q < mine.size(); ++q) {
        int const e = placement.slot(mine[q]).expert;
        auto it = std::lower_bound(experts.begin(), experts.end(), e);
        if (it != experts.end() && *it == e) local[static_cast<std::size_t>(it - experts.begin())].push_back(static_cast<int>(q));
      }
      sets_.push_back(std::move(set));
      local_slots_.push_back(std::move(local));
    }
    MPI_Group_free(&world_group);
  }

  ReplicaGradients(ReplicaGradients const&) = delete;
  ReplicaGradients& operator=(ReplicaGradients const&) = delete;
  ReplicaGradients(ReplicaGradients&& o) noexcept { *this = std::move(o); }
  ReplicaGradients& operator=(ReplicaGradients&& o) noexcept {
    if (this != &o) {
      free_comms();
      sets_ = std::move(o.sets_);
      local_slots_ = std::move(o.local_slots_);
      generation_ = o.generation_;
      rank_ = o.rank_;
      watchdog_ = o.watchdog_;
      o.sets_.clear();
    }
    return *this;
  }
  ~ReplicaGradients() { free_comms(); }

  /// \brief Every set of ranks that shares replicated experts (all sets, on every rank).
  std::vector<ReplicaSet> const& sets() const { return sets_; }
  std::uint64_t generation() const { return generation_; }

  /// \brief Collective over the sets this rank belongs to: every local
  /// replica's gradients become the sum over all replicas of its expert.
  /// \param generation the placement generation the gradients were computed
  ///   under; another generation's gradients are refused (before any message).
  /// \param ws where the packed gradients live between steps (a fresh
  ///   buffer per set when none is given).
  template <class Exec, class MS>
  void reduce(Exec const& exec, ExpertGradients<MS>& grads, std::uint64_t generation, Workspace<MS>* ws = nullptr) {
    KOKKOSMOE_REQUIRE(generation == generation_, "ReplicaGradients::reduce: gradients of placement generation "
                                                     << generation << ", the replica sets are of generation " << generation_);
    Compat::ScopedRegion region("KokkosMoE::Experts::ReplicaGradients::reduce");
    std::size_t const per = expert_floats(grads);
    for (std::size_t i = 0; i < sets_.size(); ++i) {
      ReplicaSet const& set = sets_[i];
      if (set.comm == MPI_COMM_NULL && !holds_any(i)) continue;
      std::vector<std::vector<int>> const& local = local_slots_[i];
      std::size_t const count = per * set.experts.size();
      auto const buf = scratch<Kokkos::View<float*, MS>>(ws, exec, "KokkosMoE::Experts::ReplicaGradients::buffer",
                                                         static_cast<index_t>(count));
      Impl::pack_replicas(exec, grads, local, per, buf);
      copy_to_host(exec, buf, host_);
      auto& host = host_;
      if (set.comm != MPI_COMM_NULL) {
        // Reduce to the set's first rank in a fixed order, then broadcast:
        // every member gets the same bits.
        std::vector<float> sum(count);
        int set_rank = 0;
        MPI_Comm_rank(set.comm, &set_rank);
        MPI_Reduce(host.data(), set_rank == 0 ? sum.data() : nullptr, static_cast<int>(count), MPI_FLOAT, MPI_SUM, 0, set.comm);
        if (set_rank == 0) std::copy(sum.begin(), sum.end(), host.data());
        MPI_Bcast(host.data(), static_cast<int>(count), MPI_FLOAT, 0, set.comm);
      }
      copy_from_host(exec, host, buf);
      Impl::unpack_replicas(exec, buf, local, per, grads);
    }
    Compat::fence(exec, "KokkosMoE::Experts::ReplicaGradients::reduce");
  }

  /// \brief Collective over ep: every replica of every replicated expert
  /// holds bitwise the same gradients (digests gathered per set). Throws
  /// CollectiveError on every rank naming the expert and ranks otherwise.
  template <class MS>
  void verify(MPI_Comm ep, ExpertGradients<MS> const& grads) const {
    auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads.gate);
    auto hu = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads.up);
    auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads.down);
    std::size_t const gsz = hg.extent(1) * hg.extent(2), dsz = hd.extent(1) * hd.extent(2);
    auto digest = [&](int q) {
      std::uint64_t h = digest_bytes(hg.data() + q * gsz, gsz * sizeof(float));
      h = digest_bytes(hu.data() + q * gsz, gsz * sizeof(float), h);
      return digest_bytes(hd.data() + q * dsz, dsz * sizeof(float), h);
    };
    std::string problem;
    for (std::size_t i = 0; i < sets_.size() && problem.empty(); ++i) {
      for (std::size_t x = 0; x < sets_[i].experts.size() && problem.empty(); ++x) {
        std::vector<int> const& local = local_slots_[i][x];
        std::uint64_t mine = local.empty() ? 0 : digest(local[0]);
        for (int q : local)
          if (digest(q) != mine) problem = "expert " + std::to_string(sets_[i].experts[x]) + ": two local replicas on rank " +
                                           std::to_string(rank_) + " differ";
        if (sets_[i].comm == MPI_COMM_NULL || !problem.empty()) continue;
        std::uint64_t lo = mine, hi = mine;
        MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, sets_[i].comm);
        MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, sets_[i].comm);
        if (lo != hi) {
          problem = "expert " + std::to_string(sets_[i].experts[x]) + ": its replicas on ranks [";
          for (std::size_t r = 0; r < sets_[i].ranks.size(); ++r) {
            if (r) problem += ',';
            problem += std::to_string(sets_[i].ranks[r]);
          }
          problem += "] hold different gradients (digests " + digest_hex(lo) + " and " + digest_hex(hi) + ")";
        }
      }
    }
    agree(ep, problem, "ReplicaGradients::verify", watchdog_);
  }

 private:
  bool holds_any(std::size_t i) const {
    for (auto const& l : local_slots_[i])
      if (!l.empty()) return true;
    return false;
  }

  template <class MS>
  static std::size_t expert_floats(ExpertGradients<MS> const& g) {
    return 3 * static_cast<std::size_t>(g.d()) * static_cast<std::size_t>(g.d_ff());
  }

  void free_comms() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    for (auto& s : sets_)
      if (s.comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&s.comm);
    sets_.clear();
  }

  std::vector<ReplicaSet> sets_;
  std::vector<std::vector<std::vector<int>>> local_slots_;  ///< per set, per expert: local slot indices
  std::uint64_t generation_ = 0;
  int rank_ = 0;
  double watchdog_ = 300.0;
  std::vector<float> host_;  ///< one set's packed gradients on the host (kept between steps)
};

}  // namespace Experts
}  // namespace KokkosMoE

#endif
