#ifndef KOKKOSMOE_REPRODUCIBLESUM_HPP
#define KOKKOSMOE_REPRODUCIBLESUM_HPP

/// \file KokkosMoE_ReproducibleSum.hpp
/// \brief Sums over ranks whose bits do not depend on how the terms are
/// spread over the ranks or in which order they are added: weight gradients
/// summed over an EP group give one rank's bits.
///
/// FixedPointSum adds float arrays ("terms", e.g. one weight gradient per
/// block of rows) element by element in 64-bit fixed point at a scale common
/// to all ranks, sums the integers exactly (in any order, MPI_SUM included)
/// and converts back once. The scale of an element is a power of two from a
/// bound on every term's magnitude there (given, or observed in a first pass
/// over the terms), such that the sum of all terms over all ranks stays below
/// 2^62; the bits of a term below the scale are rounded (to nearest), which
/// keeps about 40 significant bits of the largest term, far below FP32's
/// resolution. A NaN or infinite term makes its element NaN on every rank.
///
/// reproducible_atb_sum() is the sum over all ranks' rows of A^T B with
/// terms of `block` rows and a bound from the column maxima of |A| and |B|:
/// one rank holding all rows gives the same C as any number of ranks holding
/// consecutive shares, when every share is a multiple of the block size.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace KokkosMoE {

/// \brief Reproducible sums of float arrays of n elements over the ranks of
/// a communicator (see the file comment). Use: set_bound() or observe()
/// every term; agree_scale(); add() every term; result().
class FixedPointSum {
 public:
  explicit FixedPointSum(std::size_t n) : bound_(n, 0.0), expo_(n, 0), acc_(n, 0), bad_(n, 0) {}

  std::size_t size() const { return bound_.size(); }

  /// \brief Every term's magnitude at element e is at most bound[e] (this rank's terms).
  void set_bound(std::vector<double> const& bound) {
    KOKKOSMOE_REQUIRE(bound.size() == bound_.size(), "FixedPointSum: " << bound.size() << " bounds for " << bound_.size() << " elements");
    for (std::size_t e = 0; e < bound.size(); ++e) bound_[e] = std::max(bound_[e], bound[e]);
  }

  /// \brief First pass: a term's magnitudes raise the bound.
  void observe(float const* term) {
    for (std::size_t e = 0; e < bound_.size(); ++e)
      if (std::isfinite(term[e])) bound_[e] = std::max(bound_[e], std::fabs(static_cast<double>(term[e])));
  }

  /// \brief Collective: the common scale of every element from all ranks'
  /// bounds and the number of terms each rank adds.
  void agree_scale(MPI_Comm comm, std::int64_t local_terms, double watchdog) {
    std::vector<double> global(bound_.size(), 0.0);
    allreduce_watched(bound_.data(), global.data(), static_cast<int>(global.size()), MPI_DOUBLE, MPI_MAX, comm,
                      "reproducible sum: bounds", watchdog);
    std::int64_t terms = 0;
    allreduce_watched(&local_terms, &terms, 1, MPI_INT64_T, MPI_SUM, comm, "reproducible sum: terms", watchdog);
    // Every term * 2^e < 2^62 / terms: a factor 2 of margin on the bound.
    int const headroom = 61 - static_cast<int>(std::ceil(std::log2(static_cast<double>(std::max<std::int64_t>(1, terms)))));
    for (std::size_t e = 0; e < global.size(); ++e) {
      int x = 0;
      if (global[e] > 0 && std::isfinite(global[e])) {
        std::frexp(2.0 * global[e], &x);  // 2 * bound < 2^x
        x = headroom - x;
      }
      expo_[e] = x;
    }
    agreed_ = true;
  }

  /// \brief Second pass: adds a term (exactly, after its rounding to the scale).
  void add(float const* term) {
    KOKKOSMOE_REQUIRE(agreed_, "FixedPointSum: add() before agree_scale()");
    for (std::size_t e = 0; e < acc_.size(); ++e) {
      double const v = static_cast<double>(term[e]);
      if (std::isfinite(v))
        acc_[e] += static_cast<std::int64_t>(std::nearbyint(std::ldexp(v, expo_[e])));
      else
        bad_[e] = 1;
    }
  }

  /// \brief Collective: out[e] = the sum over all ranks' terms (the same on every rank).
  void result(MPI_Comm comm, float* out, double watchdog) const {
    std::vector<std::int64_t> sum(acc_.size(), 0);
    std::vector<int> bad(acc_.size(), 0);
    allreduce_watched(acc_.data(), sum.data(), static_cast<int>(sum.size()), MPI_INT64_T, MPI_SUM, comm, "reproducible sum", watchdog);
    allreduce_watched(bad_.data(), bad.data(), static_cast<int>(bad.size()), MPI_INT, MPI_MAX, comm, "reproducible sum: finiteness",
                      watchdog);
    for (std::size_t e = 0; e < sum.size(); ++e)
      out[e] = bad[e] ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(std::ldexp(static_cast<double>(sum[e]), -expo_[e]));
  }

 private:
  std::vector<double> bound_;
  std::vector<int> expo_;
  std::vector<std::int64_t> acc_;
  std::vector<int> bad_;
  bool agreed_ = false;
};

/// \brief Collective over comm: C [m, k] (float, LayoutRight) = sum over
/// all ranks' rows t of A(t, :)^T B(t, :), A [n, m] float, B [n, k] float or
/// bf16_t (n may differ between ranks, m and k may not). The same C on every
/// rank; the same bits for any split of the rows over ranks in multiples of
/// `block` rows (blocks count from each rank's first row). The block
/// product's buffer comes from ws when one is given.
template <class Exec, class AV, class BV, class CV>
void reproducible_atb_sum(Exec const& exec, AV const& A, BV const& B, CV const& C, int block, MPI_Comm comm, double watchdog,
                          GemmPath path = GemmPath::automatic, Workspace<typename CV::memory_space>* ws = nullptr) {
  using MS = typename CV::memory_space;
  index_t const n = static_cast<index_t>(A.extent(0));
  int const m = static_cast<int>(A.extent(1)), k = static_cast<int>(B.extent(1));
  KOKKOSMOE_REQUIRE(block > 0 && static_cast<index_t>(B.extent(0)) == n && static_cast<int>(C.extent(0)) == m &&
                        static_cast<int>(C.extent(1)) == k,
                    "reproducible_atb_sum: A " << A.extent(0) << "x" << m << ", B " << B.extent(0) << "x" << k << ", C "
                                               << C.extent(0) << "x" << C.extent(1) << ", block " << block);
  // Column maxima of |A| and |B| over all ranks bound every block's terms:
  // |P_b(i, j)| <= block * max|A(:, i)| * max|B(:, j)|.
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), A);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), B);
  std::vector<double> mx(static_cast<std::size_t>(m + k), 0.0), gmx(mx.size(), 0.0);
  for (index_t t = 0; t < n; ++t) {
    for (int i = 0; i < m; ++i) mx[static_cast<std::size_t>(i)] = std::max(mx[static_cast<std::size_t>(i)], std::fabs(static_cast<double>(to_float(ha(t, i)))));
    for (int j = 0; j < k; ++j)
      mx[static_cast<std::size_t>(m + j)] = std::max(mx[static_cast<std::size_t>(m + j)], std::fabs(static_cast<double>(to_float(hb(t, j)))));
  }
  for (double& v : mx)
    if (!std::isfinite(v)) v = 0;  // non-finite rows make their elements NaN through add()
  allreduce_watched(mx.data(), gmx.data(), static_cast<int>(mx.size()), MPI_DOUBLE, MPI_MAX, comm, "reproducible sum: column maxima", watchdog);
  FixedPointSum sum(static_cast<std::size_t>(m) * k);
  std::vector<double> bound(sum.size());
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j)
      bound[static_cast<std::size_t>(i) * k + j] = static_cast<double>(block) * gmx[static_cast<std::size_t>(i)] * gmx[static_cast<std::size_t>(m + j)];
  sum.set_bound(bound);
  sum.agree_scale(comm, (n + block - 1) / block, watchdog);
  auto const P = scratch<Kokkos::View<float**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::reproducible_atb_sum::block", m,
                                                                       static_cast<std::size_t>(k));
  std::vector<float> hp_values(static_cast<std::size_t>(m) * static_cast<std::size_t>(k));
  Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> hp(hp_values.data(), m, k);
  for (index_t b0 = 0; b0 < n; b0 += block) {
    std::pair<index_t, index_t> const rows(b0, std::min<index_t>(n, b0 + block));
    gemm(exec, 'T', 'N', 1.0f, Kokkos::subview(A, rows, Kokkos::ALL), Kokkos::subview(B, rows, Kokkos::ALL), 0.0f, P, path);
    Compat::fence(exec, "KokkosMoE::reproducible_atb_sum: block product");
    Kokkos::deep_copy(hp, P);
    sum.add(hp.data());
  }
  sum.result(comm, hp.data(), watchdog);
  Kokkos::deep_copy(C, hp);
}

}  // namespace KokkosMoE

#endif
