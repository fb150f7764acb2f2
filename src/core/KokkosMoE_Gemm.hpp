#ifndef KOKKOSMOE_GEMM_HPP
#define KOKKOSMOE_GEMM_HPP

/// \file KokkosMoE_Gemm.hpp
/// \brief C = alpha * op(A) * op(B) + beta * C with FP32 accumulation on an
/// execution space instance: Kokkos Kernels (BLAS / cuBLAS TPL) for float
/// operands when available; cuBLAS cublasGemmEx (tensor cores) for bf16
/// operands in CUDA builds with cuBLAS (tpls/KokkosMoE_Gemm_cuBLAS.hpp); a
/// portable tiled Kokkos kernel otherwise. The profiling region names the
/// path that ran.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_KOKKOSKERNELS
#include <KokkosBlas3_gemm.hpp>
#endif

#include <string>
#include <type_traits>

namespace KokkosMoE {
namespace Impl {
/// Vendor GEMM for operand views AV, BV and result CV on Exec: not
/// available by default; tpls/ specializes it (cuBLAS on CUDA).
template <class Exec, class AV, class BV, class CV, class Enable = void>
struct GemmVendor {
  static constexpr bool available = false;
  static bool usable(AV const&, BV const&, CV const&) { return false; }
};
}  // namespace Impl
}  // namespace KokkosMoE
#include <tpls/KokkosMoE_Gemm_cuBLAS.hpp>

namespace KokkosMoE {

/// \brief Which GEMM implementation to use.
enum class GemmPath {
  automatic,       ///< Kokkos Kernels for float operands, else the vendor GEMM, else generic
  kokkos_kernels,  ///< Kokkos Kernels; an error when it is not available
  generic,         ///< the portable Kokkos kernel
  vendor,          ///< cuBLAS cublasGemmEx (CUDA builds with cuBLAS); an error elsewhere
};

inline EnumTable<GemmPath> const& names_of(GemmPath) {
  static EnumTable<GemmPath> const t{"GEMM path",
                                     {{GemmPath::automatic, "auto"},
                                      {GemmPath::kokkos_kernels, "kokkos_kernels"},
                                      {GemmPath::generic, "generic"},
                                      {GemmPath::vendor, "vendor"}}};
  return t;
}

/// \brief True when this build has the Kokkos Kernels path.
constexpr bool have_kokkos_kernels() {
#ifdef KOKKOSMOE_HAVE_KOKKOSKERNELS
  return true;
#else
  return false;
#endif
}

/// \brief True when gemm() has a vendor path on Exec for operands of T with a
/// result of C (cuBLAS in CUDA builds).
template <class Exec, class T, class C = T>
constexpr bool have_vendor_gemm() {
  using MS = typename Exec::memory_space;
  using A = Kokkos::View<T**, Kokkos::LayoutRight, MS>;
  return Impl::GemmVendor<Exec, A, A, Kokkos::View<C**, Kokkos::LayoutRight, MS>>::available;
}

namespace Impl {

/// Element (i, j) of op(M) for 'N' or 'T', converted to float.
template <class View>
KOKKOS_INLINE_FUNCTION float op_at(View const& M, bool trans, int i, int j) {
  return to_float(trans ? M(j, i) : M(i, j));
}

/// Portable tiled GEMM: teams own 32x32 tiles of C; A and B panels of depth
/// 64 are staged in team scratch; the tile accumulates in scratch in FP32.
template <class Exec, class AV, class BV, class CV>
void gemm_generic(Exec const& exec, bool ta, bool tb, float alpha, AV const& A, BV const& B, float beta,
                  CV const& C) {
  constexpr int TM = 32, TN = 32, TK = 64;
  int const m = static_cast<int>(C.extent(0));
  int const n = static_cast<int>(C.extent(1));
  int const k = static_cast<int>(ta ? A.extent(0) : A.extent(1));
  int const tiles_m = (m + TM - 1) / TM;
  int const tiles_n = (n + TN - 1) / TN;
  using policy_t = Kokkos::TeamPolicy<Exec>;
  using member_t = typename policy_t::member_type;
  using scratch_t = Kokkos::View<float**, Kokkos::LayoutRight, typename Exec::scratch_memory_space,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  std::size_t const bytes = scratch_t::shmem_size(TM, TK) + scratch_t::shmem_size(TK, TN) + scratch_t::shmem_size(TM, TN);
  policy_t policy(exec, tiles_m * tiles_n, Kokkos::AUTO);
  Kokkos::parallel_for(
      "KokkosMoE::gemm[generic]", policy.set_scratch_size(0, Kokkos::PerTeam(bytes)),
      KOKKOS_LAMBDA(member_t const& team) {
        int const tm = team.league_rank() / tiles_n;
        int const tn = team.league_rank() % tiles_n;
        int const i0 = tm * TM, j0 = tn * TN;
        int const mi = Compat::min(TM, m - i0), nj = Compat::min(TN, n - j0);
        scratch_t As(team.team_scratch(0), TM, TK);
        scratch_t Bs(team.team_scratch(0), TK, TN);
        scratch_t Cs(team.team_scratch(0), TM, TN);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TM), [&](int i) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TN), [&](int j) { Cs(i, j) = 0.0f; });
        });
        for (int k0 = 0; k0 < k; k0 += TK) {
          int const kk = Compat::min(TK, k - k0);
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TM), [&](int i) {
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TK), [&](int p) {
              As(i, p) = (i < mi && p < kk) ? op_at(A, ta, i0 + i, k0 + p) : 0.0f;
            });
          });
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TK), [&](int p) {
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TN), [&](int j) {
              Bs(p, j) = (p < kk && j < nj) ? op_at(B, tb, k0 + p, j0 + j) : 0.0f;
            });
          });
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TM), [&](int i) {
            for (int p = 0; p < kk; ++p) {
              float const a = As(i, p);
              Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TN), [&](int j) { Cs(i, j) += a * Bs(p, j); });
            }
          });
        }
        team.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, mi), [&](int i) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nj), [&](int j) {
            float const prev = beta == 0.0f ? 0.0f : to_float(C(i0 + i, j0 + j));
            C(i0 + i, j0 + j) = from_float<typename CV::non_const_value_type>(alpha * Cs(i, j) + beta * prev);
          });
        });
      });
}

}  // namespace Impl

/// \brief C[m, n] = alpha * op(A) * op(B) + beta * C on exec, FP32 accumulation.
/// A, B may hold float or bf16_t; C float or bf16_t. trans_a/trans_b are 'N'
/// or 'T'. All views must be accessible from exec. Throws Error on mismatched
/// extents (every extent named) or when GemmPath::kokkos_kernels is forced but
/// unavailable for these operand types.
/// \return the path that ran.
template <class Exec, class AV, class BV, class CV>
GemmPath gemm(Exec const& exec, char trans_a, char trans_b, float alpha, AV const& A, BV const& B, float beta,
              CV const& C, GemmPath path = GemmPath::automatic) {
  static_assert(Compat::view_rank<AV> == 2 && Compat::view_rank<BV> == 2 && Compat::view_rank<CV> == 2,
                "gemm: A, B and C must be rank-2 views");
  KOKKOSMOE_REQUIRE((trans_a == 'N' || trans_a == 'T') && (trans_b == 'N' || trans_b == 'T'),
                    "gemm: transpose flags must be 'N' or 'T' (got '" << trans_a << "', '" << trans_b << "')");
  bool const ta = trans_a == 'T', tb = trans_b == 'T';
  std::size_t const m = C.extent(0), n = C.extent(1);
  std::size_t const am = ta ? A.extent(1) : A.extent(0), ak = ta ? A.extent(0) : A.extent(1);
  std::size_t const bk = tb ? B.extent(1) : B.extent(0), bn = tb ? B.extent(0) : B.extent(1);
  KOKKOSMOE_REQUIRE(am == m && bn == n && ak == bk,
                    "gemm: op(A) is " << am << "x" << ak << ", op(B) is " << bk << "x" << bn << ", C is " << m << "x" << n
                                      << " (A " << A.extent(0) << "x" << A.extent(1) << " '" << trans_a << "', B "
                                      << B.extent(0) << "x" << B.extent(1) << " '" << trans_b << "')");
  constexpr bool all_float = std::is_same<typename AV::non_const_value_type, float>::value &&
                             std::is_same<typename BV::non_const_value_type, float>::value &&
                             std::is_same<typename CV::non_const_value_type, float>::value;
  bool const use_kk =
      all_float && have_kokkos_kernels() && (path == GemmPath::automatic || path == GemmPath::kokkos_kernels);
  KOKKOSMOE_REQUIRE(path != GemmPath::kokkos_kernels || use_kk,
                    "gemm: the Kokkos Kernels path was requested but "
                        << (have_kokkos_kernels() ? "the operands are not all float" : "this build has no Kokkos Kernels"));
  using vendor = Impl::GemmVendor<Exec, AV, BV, CV>;
  bool const use_vendor =
      vendor::available && (path == GemmPath::vendor || (path == GemmPath::automatic && !use_kk)) && vendor::usable(A, B, C);
  KOKKOSMOE_REQUIRE(path != GemmPath::vendor || use_vendor,
                    "gemm: the vendor path was requested but "
                        << (vendor::available ? "the operands' rows are not contiguous"
                                              : "this build has no vendor GEMM for these operand types on this execution space "
                                                "(cuBLAS in CUDA builds, KokkosMoE_ENABLE_CUBLAS)"));
  GemmPath const ran = use_vendor ? GemmPath::vendor : use_kk ? GemmPath::kokkos_kernels : GemmPath::generic;
  if (m == 0 || n == 0) return ran;
  if (ak == 0) {
    // An empty product: C = beta * C on every path (a BLAS may skip the
    // call or read an empty operand's leading dimension as 0).
    using CT = typename CV::non_const_value_type;
    Kokkos::parallel_for("KokkosMoE::gemm[scale]", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>(exec, {0, 0}, {m, n}),
                         KOKKOS_LAMBDA(std::size_t i, std::size_t j) {
                           C(i, j) = from_float<CT>(beta == 0.0f ? 0.0f : beta * to_float(C(i, j)));
                         });
    return ran;
  }
  if constexpr (vendor::available) {
    if (use_vendor) {
      vendor::run(exec, ta, tb, alpha, A, B, beta, C);
      return ran;
    }
  }
#ifdef KOKKOSMOE_HAVE_KOKKOSKERNELS
  if constexpr (all_float) {
    if (use_kk) {
      char const ta_s[2] = {trans_a, '\0'}, tb_s[2] = {trans_b, '\0'};
      Compat::ScopedRegion region("KokkosMoE::gemm[KokkosKernels]");
#if KOKKOSMOE_KOKKOS_MODERN
      KokkosBlas::gemm(exec, ta_s, tb_s, alpha, A, B, beta, C);
#else
      Compat::fence(exec, "KokkosMoE::gemm: order before the default-instance call");
      KokkosBlas::gemm(ta_s, tb_s, alpha, A, B, beta, C);
      // ... and what exec runs next (another instance's stream) after it.
      Compat::fence(Exec(), "KokkosMoE::gemm: order after the default-instance call");
#endif
      return GemmPath::kokkos_kernels;
    }
  }
#endif
  Compat::ScopedRegion region("KokkosMoE::gemm[generic]");
  Impl::gemm_generic(exec, ta, tb, alpha, A, B, beta, C);
  return GemmPath::generic;
}

}  // namespace KokkosMoE

#endif
