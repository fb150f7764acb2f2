#ifndef KOKKOSMOE_CUBLAS_HPP
#define KOKKOSMOE_CUBLAS_HPP

/// \file KokkosMoE_Cublas.hpp
/// \brief What the cuBLAS vendor paths share (CUDA builds with cuBLAS,
/// KOKKOSMOE_HAVE_CUBLAS): status checks that name the call, the process's
/// cuBLAS handle, and the CUDA data type of an element type. Empty in other
/// builds.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_config.hpp>

#if defined(KOKKOSMOE_HAVE_CUBLAS) && defined(KOKKOS_ENABLE_CUDA)
#include <cublas_v2.h>

#include <type_traits>

namespace KokkosMoE {
namespace Impl {

/// Throws Error naming the cuBLAS call and its status.
inline void cublas_check(cublasStatus_t status, char const* call) {
  KOKKOSMOE_REQUIRE(status == CUBLAS_STATUS_SUCCESS,
                    call << " failed: " << cublasGetStatusName(status) << " (" << cublasGetStatusString(status) << ")");
}

/// The process's cuBLAS handle, created on first use and destroyed when
/// Kokkos finalizes (before the CUDA context goes), bound to the stream of
/// exec for the calls that follow (calls are ordered on one host thread).
inline cublasHandle_t cublas_handle(Kokkos::Cuda const& exec) {
  static cublasHandle_t handle = nullptr;
  if (!handle) {
    cublas_check(cublasCreate(&handle), "cublasCreate");
    Kokkos::push_finalize_hook([] {
      if (handle) cublasDestroy(handle);
      handle = nullptr;
    });
  }
  cublas_check(cublasSetStream(handle, exec.cuda_stream()), "cublasSetStream");
  return handle;
}

/// CUDA_R_32F for float, CUDA_R_16BF for bf16_t.
template <class T>
constexpr cudaDataType_t cuda_data_type() {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16_t>::value, "cuBLAS paths: float or bf16_t");
  return std::is_same<T, float>::value ? CUDA_R_32F : CUDA_R_16BF;
}

}  // namespace Impl
}  // namespace KokkosMoE

#endif
#endif
