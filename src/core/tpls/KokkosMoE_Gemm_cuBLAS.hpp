#ifndef KOKKOSMOE_GEMM_CUBLAS_HPP
#define KOKKOSMOE_GEMM_CUBLAS_HPP

/// \file tpls/KokkosMoE_Gemm_cuBLAS.hpp
/// \brief gemm()'s vendor specialization on CUDA: cublasGemmEx with FP32
/// accumulation (tensor cores for bf16), for rank-2 views with contiguous
/// rows of float or bf16_t (A and B of one type; C float or that type).
///
/// The views are row-major; cuBLAS is column-major, so C^T = op(B)^T op(A)^T
/// is computed on the same buffers: a row-major [r, c] view with row stride
/// ld is the column-major [c, r] matrix with leading dimension ld.

#include <KokkosMoE_Cublas.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_config.hpp>

#if defined(KOKKOSMOE_HAVE_CUBLAS) && defined(KOKKOS_ENABLE_CUDA)
#include <type_traits>

namespace KokkosMoE {
namespace Impl {

template <class AV, class BV, class CV>
constexpr bool cublas_gemm_types() {
  using A = typename AV::non_const_value_type;
  using B = typename BV::non_const_value_type;
  using C = typename CV::non_const_value_type;
  return std::is_same<A, B>::value && (std::is_same<A, float>::value || std::is_same<A, bf16_t>::value) &&
         (std::is_same<C, float>::value || std::is_same<C, A>::value);
}

template <class AV, class BV, class CV>
struct GemmVendor<Kokkos::Cuda, AV, BV, CV, std::enable_if_t<cublas_gemm_types<AV, BV, CV>()>> {
  static constexpr bool available = true;
  using A = typename AV::non_const_value_type;
  using C = typename CV::non_const_value_type;

  /// True when every view has unit column stride (cuBLAS takes a leading
  /// dimension, not two strides).
  static bool usable(AV const& a, BV const& b, CV const& c) {
    return a.stride(1) == 1 && b.stride(1) == 1 && c.stride(1) == 1;
  }

  static void run(Kokkos::Cuda const& exec, bool ta, bool tb, float alpha, AV const& a, BV const& b, float beta, CV const& c) {
    int const m = static_cast<int>(c.extent(0)), n = static_cast<int>(c.extent(1));
    int const k = static_cast<int>(ta ? a.extent(0) : a.extent(1));
    // The row stride, at least 1 (cuBLAS refuses a leading dimension of 0).
    auto ld = [](auto const& v) {
      std::size_t const s = v.extent(0) <= 1 ? v.extent(1) : static_cast<std::size_t>(v.stride(0));
      return static_cast<int>(s > 0 ? s : 1);
    };
    Compat::ScopedRegion region(std::is_same<A, float>::value ? "KokkosMoE::gemm[TPL_CUBLAS,float]"
                                                               : "KokkosMoE::gemm[TPL_CUBLAS,bf16]");
    cublas_check(cublasGemmEx(cublas_handle(exec), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                              &alpha, b.data(), cuda_data_type<A>(), ld(b), a.data(), cuda_data_type<A>(), ld(a), &beta,
                              c.data(), cuda_data_type<C>(), ld(c), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  }
};

}  // namespace Impl
}  // namespace KokkosMoE

#endif
#endif
