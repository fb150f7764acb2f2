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
#include <cstring>
#include <string>
#include <vector>

namespace KokkosMoE {

namespace Impl {

/// \brief std::frexp's exponent of a finite v > 0: v in [2^(x-1), 2^x).
KOKKOS_INLINE_FUNCTION int binary_exponent(double v) {
  int shift = 0;
  if (((bits_as<std::uint64_t>(v) >> 52) & 0x7ff) == 0) {  // subnormal: scale by 2^64 (exact)
    v *= 18446744073709551616.0;
    shift = 64;
  }
  return static_cast<int>((bits_as<std::uint64_t>(v) >> 52) & 0x7ff) - 1022 - shift;
}

/// \brief std::ldexp(v, e) (one rounding, to nearest): a product with exact
/// powers of two; an exponent past a double's range is applied in steps
/// that do not round (the sums' scales keep every step's value normal).
KOKKOS_INLINE_FUNCTION double scale_pow2(double v, int e) {
  for (; e > 1023; e -= 1023) v *= bits_as<double>(std::uint64_t(2046) << 52);  // 2^1023
  for (; e < -1022; e += 1022) v *= bits_as<double>(std::uint64_t(1) << 52);    // 2^-1022
  return v * bits_as<double>(static_cast<std::uint64_t>(e + 1023) << 52);
}

}  // namespace Impl

/// \brief Reproducible sums of float arrays of n elements over the ranks of
/// a communicator (see the file comment), kept in MemorySpace: bounds,
/// scales and 64-bit accumulators live next to the terms, so adding a term
/// is one kernel and the host sees only the bounds (when they need an
/// agreement) and the integer sums. Use: bound_outer() or observe() every
/// term; agree_scale(); add() every term; result(). A term is a rank-1 view
/// of floats placed at an element offset (a contiguous gradient of any rank
/// through Impl::flat_elements).
template <class MemorySpace>
class FixedPointSum {
 public:
  using memory_space = MemorySpace;
  using terms_view = Kokkos::View<const float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  /// \brief n elements, bounds 0; the buffers come from ws under `label`
  /// when given (no allocation in repeated steps), else are allocated.
  template <class Exec>
  FixedPointSum(Exec const& exec, std::size_t n, Workspace<MemorySpace>* ws = nullptr, std::string const& label = "KokkosMoE::FixedPointSum")
      : bound_(scratch<Kokkos::View<double*, MemorySpace>>(ws, exec, label + "::bound", static_cast<index_t>(n))),
        expo_(scratch<Kokkos::View<int*, MemorySpace>>(ws, exec, label + "::scale", static_cast<index_t>(n))),
        acc_(scratch<Kokkos::View<std::int64_t*, MemorySpace>>(ws, exec, label + "::sum", static_cast<index_t>(n))),
        bad_(scratch<Kokkos::View<int*, MemorySpace>>(ws, exec, label + "::nonfinite", static_cast<index_t>(n))),
        out_(scratch<Kokkos::View<float*, MemorySpace>>(ws, exec, label + "::result", static_cast<index_t>(n))) {
    Kokkos::deep_copy(exec, bound_, 0.0);
    Kokkos::deep_copy(exec, acc_, std::int64_t(0));
    Kokkos::deep_copy(exec, bad_, 0);
  }

  std::size_t size() const { return bound_.extent(0); }

  /// \brief First pass: the finite magnitudes of a term (elements [at, at +
  /// term's extent)) raise the bound.
  template <class Exec, class TermView>
  void observe(Exec const& exec, TermView const& term_view, std::size_t at = 0) {
    terms_view const term = placed(term_view, at, "observe");
    auto bound = bound_;
    Kokkos::parallel_for(
        "KokkosMoE::FixedPointSum::observe", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, term.extent(0)),
        KOKKOS_LAMBDA(std::size_t i) {
          double const v = static_cast<double>(term(i));
          if (Compat::isfinite(v)) bound(at + i) = Compat::max(bound(at + i), Compat::fabs(v));
        });
  }

  /// \brief Every term's magnitude at element (i, j) of an [a.size(), b.size()]
  /// row-major array is at most factor * a[i] * b[j] (this rank's terms).
  template <class Exec>
  void bound_outer(Exec const& exec, double factor, std::vector<double> const& a, std::vector<double> const& b,
                   Workspace<MemorySpace>* ws = nullptr) {
    std::size_t const m = a.size(), k = b.size();
    KOKKOSMOE_REQUIRE(m * k == size(), "FixedPointSum: a " << m << " x " << k << " bound for " << size() << " elements");
    std::vector<double> ab(a);
    ab.insert(ab.end(), b.begin(), b.end());
    auto const f = scratch_copy(ws, exec, "KokkosMoE::FixedPointSum::outer_factors", ab);
    auto bound = bound_;
    Kokkos::parallel_for(
        "KokkosMoE::FixedPointSum::bound_outer", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, m * k),
        KOKKOS_LAMBDA(std::size_t e) {
          std::size_t const i = e / k, j = e - i * k;
          bound(e) = Compat::max(bound(e), factor * f(i) * f(m + j));
        });
  }

  /// \brief Collective: the common scale of every element from all ranks'
  /// bounds and the number of terms each rank adds. With bounds_common every
  /// rank holds the same bounds already (derived from reduced values), and
  /// only the term counts are reduced.
  template <class Exec>
  void agree_scale(Exec const& exec, MPI_Comm comm, std::int64_t local_terms, double watchdog, bool bounds_common = false) {
    if (!bounds_common) {
      std::vector<double> mine = copy_to_host(exec, bound_), global(mine.size(), 0.0);
      allreduce_watched(mine.data(), global.data(), static_cast<int>(global.size()), MPI_DOUBLE, MPI_MAX, comm,
                        "reproducible sum: bounds", watchdog);
      copy_from_host(exec, global, bound_);
    }
    std::int64_t terms = 0;
    allreduce_watched(&local_terms, &terms, 1, MPI_INT64_T, MPI_SUM, comm, "reproducible sum: terms", watchdog);
    // Every term * 2^e < 2^62 / terms: a factor 2 of margin on the bound.
    int const headroom = 61 - static_cast<int>(std::ceil(std::log2(static_cast<double>(std::max<std::int64_t>(1, terms)))));
    auto bound = bound_;
    auto expo = expo_;
    Kokkos::parallel_for(
        "KokkosMoE::FixedPointSum::scale", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, size()),
        KOKKOS_LAMBDA(std::size_t e) {
          double const g = bound(e);
          expo(e) = g > 0 && Compat::isfinite(g) ? headroom - Impl::binary_exponent(2.0 * g) : 0;  // 2 * bound < 2^x
        });
    agreed_ = true;
  }

  /// \brief Second pass: adds a term (exactly, after its rounding to the scale).
  template <class Exec, class TermView>
  void add(Exec const& exec, TermView const& term_view, std::size_t at = 0) {
    KOKKOSMOE_REQUIRE(agreed_, "FixedPointSum: add() before agree_scale()");
    terms_view const term = placed(term_view, at, "add");
    auto expo = expo_;
    auto acc = acc_;
    auto bad = bad_;
    Kokkos::parallel_for(
        "KokkosMoE::FixedPointSum::add", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, term.extent(0)),
        KOKKOS_LAMBDA(std::size_t i) {
          double const v = static_cast<double>(term(i));
          if (Compat::isfinite(v))
            acc(at + i) += static_cast<std::int64_t>(Compat::nearbyint(Impl::scale_pow2(v, expo(at + i))));
          else
            bad(at + i) = 1;
        });
  }

  /// \brief Collective: the sum over all ranks' terms of every element (the
  /// same bits on every rank; NaN where any term was not finite), valid
  /// until this sum's workspace hands its buffers out again.
  template <class Exec>
  Kokkos::View<float*, MemorySpace> result(Exec const& exec, MPI_Comm comm, double watchdog) {
    KOKKOSMOE_REQUIRE(agreed_, "FixedPointSum: result() before agree_scale()");
    std::vector<std::int64_t> acc = copy_to_host(exec, acc_), sum(acc.size(), 0);
    std::vector<int> bad = copy_to_host(exec, bad_), any(bad.size(), 0);
    allreduce_watched(acc.data(), sum.data(), static_cast<int>(sum.size()), MPI_INT64_T, MPI_SUM, comm, "reproducible sum", watchdog);
    allreduce_watched(bad.data(), any.data(), static_cast<int>(any.size()), MPI_INT, MPI_MAX, comm, "reproducible sum: finiteness",
                      watchdog);
    copy_from_host(exec, sum, acc_);
    copy_from_host(exec, any, bad_);
    auto expo = expo_;
    auto out = out_;
    auto total = acc_;
    auto nonfinite = bad_;
    Kokkos::parallel_for(
        "KokkosMoE::FixedPointSum::result", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, size()),
        KOKKOS_LAMBDA(std::size_t e) {
          float const quiet_nan = Impl::bits_float(0x7FC00000u);
          out(e) = nonfinite(e) ? quiet_nan : static_cast<float>(Impl::scale_pow2(static_cast<double>(total(e)), -expo(e)));
        });
    return out_;
  }

 private:
  template <class TermView>
  terms_view placed(TermView const& v, std::size_t at, char const* what) const {
    auto const flat = Impl::flat_elements(v);
    KOKKOSMOE_REQUIRE(flat.span_is_contiguous(), "FixedPointSum::" << what << ": the terms are not contiguous (stride " << flat.stride(0) << ")");
    KOKKOSMOE_REQUIRE(at + flat.extent(0) <= size(), "FixedPointSum::" << what << ": " << flat.extent(0) << " terms at element " << at
                                                                         << " of " << size());
    return terms_view(flat.data(), flat.extent(0));
  }

  Kokkos::View<double*, MemorySpace> bound_;
  Kokkos::View<int*, MemorySpace> expo_;
  Kokkos::View<std::int64_t*, MemorySpace> acc_;
  Kokkos::View<int*, MemorySpace> bad_;
  Kokkos::View<float*, MemorySpace> out_;
  bool agreed_ = false;
};

/// \brief Collective over comm: C [m, k] (float, LayoutRight) = sum over
/// all ranks' rows t of A(t, :)^T B(t, :), A [n, m] float, B [n, k] float or
/// bf16_t (n may differ between ranks, m and k may not). The same C on every
/// rank; the same bits for any split of the rows over ranks in multiples of
/// `block` rows (blocks count from each rank's first row). Everything stays
/// in the views' memory space but the column maxima and the integer sums;
/// the buffers come from ws when one is given.
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
  // |P_b(i, j)| <= block * max|A(:, i)| * max|B(:, j)|. A NaN leaves a
  // maximum as it was; an infinite one counts as 0 (non-finite rows make
  // their elements NaN through add()).
  auto const cmax = scratch<Kokkos::View<double*, MS>>(ws, exec, "KokkosMoE::reproducible_atb_sum::column_max", m + k);
  Kokkos::parallel_for(
      "KokkosMoE::reproducible_atb_sum::column_max", Kokkos::RangePolicy<Exec>(exec, 0, m + k), KOKKOS_LAMBDA(int c) {
        double mx = 0.0;
        for (index_t t = 0; t < n; ++t) {
          double const v = Compat::fabs(static_cast<double>(c < m ? to_float(A(t, c)) : to_float(B(t, c - m))));
          mx = mx < v ? v : mx;
        }
        cmax(c) = Compat::isfinite(mx) ? mx : 0.0;
      });
  std::vector<double> const mx = copy_to_host(exec, cmax);
  std::vector<double> gmx(mx.size(), 0.0);
  allreduce_watched(mx.data(), gmx.data(), static_cast<int>(mx.size()), MPI_DOUBLE, MPI_MAX, comm, "reproducible sum: column maxima", watchdog);
  FixedPointSum<MS> sum(exec, static_cast<std::size_t>(m) * static_cast<std::size_t>(k), ws, "KokkosMoE::reproducible_atb_sum");
  sum.bound_outer(exec, static_cast<double>(block), std::vector<double>(gmx.begin(), gmx.begin() + m),
                  std::vector<double>(gmx.begin() + m, gmx.end()), ws);
  sum.agree_scale(exec, comm, (n + block - 1) / block, watchdog, /*bounds_common=*/true);
  auto const P = scratch<Kokkos::View<float**, Kokkos::LayoutRight, MS>>(ws, exec, "KokkosMoE::reproducible_atb_sum::block", m,
                                                                       static_cast<std::size_t>(k));
  for (index_t b0 = 0; b0 < n; b0 += block) {
    std::pair<index_t, index_t> const rows(b0, std::min<index_t>(n, b0 + block));
    gemm(exec, 'T', 'N', 1.0f, Kokkos::subview(A, rows, Kokkos::ALL), Kokkos::subview(B, rows, Kokkos::ALL), 0.0f, P, path);
    sum.add(exec, P);
  }
  Kokkos::deep_copy(exec, Impl::flat_elements(C), sum.result(exec, comm, watchdog));
  Compat::fence(exec, "KokkosMoE::reproducible_atb_sum");
}

}  // namespace KokkosMoE

#endif
