#ifndef KOKKOSMOE_SIMULATEDEXCHANGE_HPP
#define KOKKOSMOE_SIMULATEDEXCHANGE_HPP

/// \file KokkosMoE_SimulatedExchange.hpp
/// \brief An all-to-all of payload rows among simulated ranks inside one
/// process, with the same ordering contract as the real transports: rank q
/// receives, for each source peer slot in peer order, that source's segment
/// for q in the source's send order. Used to build and check multi-rank plans
/// without MPI, and as the reference the MPI exchanges are compared with.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_RowKit.hpp>

#include <vector>

namespace KokkosMoE {

/// \brief Rows (and optionally metadata) of simulated ranks indexed by global
/// rank; counts[r][p] = rows rank r sends to peer slot p (peer_order[p]).
/// Returns the received buffers by global rank; recv_counts[q][p] = rows rank
/// q received from peer slot p.
template <class Exec, class MS>
std::vector<PayloadBuffer<MS>> simulated_alltoallv(Exec const& exec, std::vector<PayloadBuffer<MS>> const& send,
                                                   std::vector<std::vector<index_t>> const& counts,
                                                   std::vector<int> const& peer_order,
                                                   std::vector<std::vector<index_t>>& recv_counts,
                                                   std::vector<Kokkos::View<RowMeta*, MS>> const& send_meta = {},
                                                   std::vector<Kokkos::View<RowMeta*, MS>>* recv_meta = nullptr) {
  std::size_t const N = send.size();
  std::size_t const P = peer_order.size();
  KOKKOSMOE_REQUIRE(N == P && counts.size() == N, "simulated exchange: " << N << " send buffers, " << counts.size()
                                                                         << " count vectors, " << P << " peers");
  KOKKOSMOE_REQUIRE(send_meta.empty() || send_meta.size() == N, "simulated exchange: metadata for " << send_meta.size() << " ranks");
  std::vector<int> slot_of(N, -1);
  for (std::size_t p = 0; p < P; ++p) slot_of[static_cast<std::size_t>(peer_order[p])] = static_cast<int>(p);
  std::vector<std::vector<index_t>> offsets(N, std::vector<index_t>(P + 1, 0));
  for (std::size_t r = 0; r < N; ++r) {
    KOKKOSMOE_REQUIRE(counts[r].size() == P, "simulated exchange: rank " << r << " has " << counts[r].size() << " counts");
    for (std::size_t p = 0; p < P; ++p) offsets[r][p + 1] = offsets[r][p] + counts[r][p];
    KOKKOSMOE_REQUIRE(offsets[r][P] == send[r].rows(),
                      "simulated exchange: rank " << r << " sends " << offsets[r][P] << " rows from a buffer of " << send[r].rows());
  }
  recv_counts.assign(N, std::vector<index_t>(P, 0));
  std::vector<PayloadBuffer<MS>> recv(N);
  if (recv_meta) recv_meta->assign(N, {});
  for (std::size_t q = 0; q < N; ++q) {
    std::size_t const pq = static_cast<std::size_t>(slot_of[q]);
    index_t total = 0;
    for (std::size_t ps = 0; ps < P; ++ps) {
      std::size_t const src = static_cast<std::size_t>(peer_order[ps]);
      recv_counts[q][ps] = counts[src][pq];
      total += counts[src][pq];
    }
    recv[q] = PayloadBuffer<MS>(exec, "KokkosMoE::simulated_alltoallv::recv", send[0].type, send[0].width, total);
    if (recv_meta && !send_meta.empty())
      (*recv_meta)[q] = Kokkos::View<RowMeta*, MS>(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::simulated_alltoallv::meta"), total);
    index_t at = 0;
    for (std::size_t ps = 0; ps < P; ++ps) {
      std::size_t const src = static_cast<std::size_t>(peer_order[ps]);
      index_t const c = counts[src][pq];
      if (c == 0) continue;
      auto const lo = offsets[src][pq];
      copy_row_range(exec, recv[q].bytes, at, send[src].bytes, lo, c);
      if (recv_meta && !send_meta.empty()) {
        using range = std::pair<index_t, index_t>;
        Kokkos::deep_copy(exec, Kokkos::subview((*recv_meta)[q], range(at, at + c)),
                          Kokkos::subview(send_meta[src], range(lo, lo + c)));
      }
      at += c;
    }
  }
  Compat::fence(exec, "KokkosMoE::simulated_alltoallv");
  return recv;
}

}  // namespace KokkosMoE

#endif
