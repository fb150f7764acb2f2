#ifndef KOKKOSMOE_REPRODUCIBLESUM_HPP
#define KOKKOSMOE_REPRODUCIBLESUM_HPP

/// \file KokkosMoE_ReproducibleSum.hpp
/// \brief C = sum over the rows of every rank of A^T B (a weight gradient
/// summed over an EP group) with bits that do not depend on how the rows are
/// spread over the ranks: one rank holding all rows gives the same C as any
/// number of ranks holding consecutive shares, when every share is a
/// multiple of the block size.
///
/// The rows are cut into blocks of `block` consecutive rows (counted from
/// each rank's first row). Each block's product P_b = A_b^T B_b is one GEMM
/// of fixed shape; its elements are converted to 64-bit fixed point at a
/// scale common to all ranks, summed as integers (exactly, so in any order,
/// MPI_SUM included) and converted back once. The scale of element (i, j) is
/// a power of two from a bound on every block's |P_b(i, j)|:
/// 2 * block * max_t |A(t, i)| * max_t |B(t, j)| over all ranks' rows, so
/// that the sum over all blocks stays below 2^62; the bits below the scale
/// are rounded per block (to nearest), which keeps about 40 significant bits
/// of the largest possible term, far below FP32's resolution. A NaN or
/// infinite block product makes its element NaN on every rank.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <KokkosMoE_Payload.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace KokkosMoE {

/// \brief Collective over comm: C [m, k] (float, LayoutRight) = sum over
/// all ranks' rows t of A(t, :)^T B(t, :), A [n, m] float, B [n, k] float or
/// bf16_t (n may differ between ranks, m and k may not). The same C on every
/// rank; the same bits for any split of the rows over ranks in multiples of
/// `block` rows.
template <class Exec, class AV, class BV, class CV>
void reproducible_atb_sum(Exec const& exec, AV const& A, BV const& B, CV const& C, int block, MPI_Comm comm, double watchdog,
                          GemmPath path = GemmPath::automatic) {
  using MS = typename CV::memory_space;
  index_t const n = static_cast<index_t>(A.extent(0));
  int const m = static_cast<int>(A.extent(1)), k = static_cast<int>(B.extent(1));
  KOKKOSMOE_REQUIRE(block > 0 && static_cast<index_t>(B.extent(0)) == n && static_cast<int>(C.extent(0)) == m &&
                        static_cast<int>(C.extent(1)) == k,
                    "reproducible_atb_sum: A " << A.extent(0) << "x" << m << ", B " << B.extent(0) << "x" << k << ", C "
                                               << C.extent(0) << "x" << C.extent(1) << ", block " << block);
  // Column maxima of |A| and |B| and the number of blocks, over all ranks.
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), A);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), B);
  std::vector<double> mx(static_cast<std::size_t>(m + k), 0.0), gmx(mx.size(), 0.0);
  for (index_t t = 0; t < n; ++t) {
    for (int i = 0; i < m; ++i) mx[static_cast<std::size_t>(i)] = std::max(mx[static_cast<std::size_t>(i)], std::fabs(static_cast<double>(to_float(ha(t, i)))));
    for (int j = 0; j < k; ++j)
      mx[static_cast<std::size_t>(m + j)] = std::max(mx[static_cast<std::size_t>(m + j)], std::fabs(static_cast<double>(to_float(hb(t, j)))));
  }
  allreduce_watched(mx.data(), gmx.data(), static_cast<int>(mx.size()), MPI_DOUBLE, MPI_MAX, comm, "reproducible sum: bounds", watchdog);
  std::int64_t const local_blocks = (n + block - 1) / block;
  std::int64_t blocks = 0;
  allreduce_watched(&local_blocks, &blocks, 1, MPI_INT64_T, MPI_SUM, comm, "reproducible sum: blocks", watchdog);
  // Exponent e(i, j): every block's |P| * 2^e < 2^62 / blocks.
  int const headroom = 61 - static_cast<int>(std::ceil(std::log2(static_cast<double>(std::max<std::int64_t>(1, blocks)))));
  std::vector<int> expo(static_cast<std::size_t>(m) * k, 0);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j) {
      double const bound = 2.0 * block * gmx[static_cast<std::size_t>(i)] * gmx[static_cast<std::size_t>(m + j)];
      int e = 0;
      if (bound > 0 && std::isfinite(bound)) {
        std::frexp(bound, &e);  // bound < 2^e
        e = headroom - e;
      }
      expo[static_cast<std::size_t>(i) * k + j] = e;
    }
  // Block products, accumulated exactly.
  std::vector<std::int64_t> acc(static_cast<std::size_t>(m) * k, 0), sum(acc.size(), 0);
  std::vector<int> bad(acc.size(), 0), any_bad(acc.size(), 0);  // a NaN or infinite term: the sum is NaN
  Kokkos::View<float**, Kokkos::LayoutRight, MS> P("KokkosMoE::reproducible_atb_sum::block", m, k);
  auto hp = Kokkos::create_mirror_view(Kokkos::HostSpace(), P);
  for (index_t b0 = 0; b0 < n; b0 += block) {
    std::pair<index_t, index_t> const rows(b0, std::min<index_t>(n, b0 + block));
    gemm(exec, 'T', 'N', 1.0f, Kokkos::subview(A, rows, Kokkos::ALL), Kokkos::subview(B, rows, Kokkos::ALL), 0.0f, P, path);
    Compat::fence(exec, "KokkosMoE::reproducible_atb_sum: block product");
    Kokkos::deep_copy(hp, P);
    for (std::size_t e = 0; e < acc.size(); ++e) {
      double const v = static_cast<double>(hp.data()[e]);
      if (std::isfinite(v))
        acc[e] += static_cast<std::int64_t>(std::nearbyint(std::ldexp(v, expo[e])));
      else
        bad[e] = 1;
    }
  }
  allreduce_watched(acc.data(), sum.data(), static_cast<int>(sum.size()), MPI_INT64_T, MPI_SUM, comm, "reproducible sum", watchdog);
  allreduce_watched(bad.data(), any_bad.data(), static_cast<int>(bad.size()), MPI_INT, MPI_MAX, comm, "reproducible sum: finiteness",
                    watchdog);
  for (std::size_t e = 0; e < sum.size(); ++e)
    hp.data()[e] = any_bad[e] ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(std::ldexp(static_cast<double>(sum[e]), -expo[e]));
  Kokkos::deep_copy(C, hp);
}

}  // namespace KokkosMoE

#endif
