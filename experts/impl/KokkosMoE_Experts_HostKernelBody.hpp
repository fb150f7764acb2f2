#ifndef KOKKOSMOE_EXPERTS_HOSTKERNELBODY_HPP
#define KOKKOSMOE_EXPERTS_HOSTKERNELBODY_HPP

/// \file impl/KokkosMoE_Experts_HostKernelBody.hpp
/// \brief Body of the host micro-kernels, compiled once per instruction set.
///
/// The including translation unit defines KOKKOSMOE_EXPERTS_ISA_NS (a
/// namespace name private to that unit, so that no inline or template code
/// compiled for a wide ISA can be merged into the baseline build by the
/// linker) and KOKKOSMOE_EXPERTS_VECTOR_BYTES (the SIMD width it is compiled
/// for). Such a unit odr-uses no inline function of external linkage from
/// any other header, and fills a table passed in by the dispatcher.
///
/// With GCC/Clang the accumulators are generic vector types (vector_size
/// attribute): each (weight row, row vector) pair is one register, the k loop
/// is a stream of broadcast + FMA that the compiler lowers to the unit's ISA.
/// Other compilers get plain loops over the same layout.

#include <impl/KokkosMoE_Experts_HostKernels.hpp>

#include <cstdint>
#include <cstring>

#if !defined(KOKKOSMOE_EXPERTS_ISA_NS) || !defined(KOKKOSMOE_EXPERTS_VECTOR_BYTES)
#error "define KOKKOSMOE_EXPERTS_ISA_NS and KOKKOSMOE_EXPERTS_VECTOR_BYTES before including this header"
#endif

namespace KokkosMoE {
namespace Experts {
namespace Impl {
namespace KOKKOSMOE_EXPERTS_ISA_NS {

constexpr int VL = KOKKOSMOE_EXPERTS_VECTOR_BYTES / static_cast<int>(sizeof(float));

// Weight element as float (bf16 is the upper half of binary32).
static inline float load_weight(float const* p) { return *p; }
static inline float load_weight(std::uint16_t const* p) {
  std::uint32_t const bits = static_cast<std::uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)

typedef float vfloat __attribute__((vector_size(KOKKOSMOE_EXPERTS_VECTOR_BYTES)));

// Broadcast (s - 0 is exact, folds away, and lowers to a broadcast load).
static inline vfloat splat(float s) { return s - vfloat{}; }

template <int MV, int NRW, class W>
void micro(int K, float const* __restrict xt, W const* __restrict w0, W const* __restrict w1, long ldw,
           float* __restrict acc) {
  constexpr int R = MV * VL, H = NRW / 2;
  vfloat c[NRW][MV];
#pragma GCC unroll 32
  for (int j = 0; j < NRW; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) c[j][m] = vfloat{};
  for (int k = 0; k < K; ++k) {
    vfloat x[MV];
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) std::memcpy(&x[m], xt + static_cast<long>(k) * R + m * VL, sizeof(vfloat));
#pragma GCC unroll 32
    for (int j = 0; j < NRW; ++j) {
      vfloat const wj = splat(load_weight(j < H ? w0 + j * ldw + k : w1 + (j - H) * ldw + k));
#pragma GCC unroll 8
      for (int m = 0; m < MV; ++m) c[j][m] += wj * x[m];
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < NRW; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) std::memcpy(acc + j * R + m * VL, &c[j][m], sizeof(vfloat));
}

#else

template <int MV, int NRW, class W>
void micro(int K, float const* xt, W const* w0, W const* w1, long ldw, float* acc) {
  constexpr int R = MV * VL, H = NRW / 2;
  for (int j = 0; j < NRW; ++j)
    for (int i = 0; i < R; ++i) acc[j * R + i] = 0.0f;
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < NRW; ++j) {
      float const wj = load_weight(j < H ? w0 + j * ldw + k : w1 + (j - H) * ldw + k);
      for (int i = 0; i < R; ++i) acc[j * R + i] += wj * xt[static_cast<long>(k) * R + i];
    }
}

#endif

/// Table entries f32[mv] and bf16[mv] with nrw[mv] weight rows.
template <int MV, int NRW>
void set_kernel(HostKernelTable& t) {
  static_assert(NRW % 2 == 0, "weight rows come in two groups");
  t.f32[MV] = &micro<MV, NRW, float>;
  t.bf16[MV] = &micro<MV, NRW, std::uint16_t>;
  t.nrw[MV] = NRW;
}

}  // namespace KOKKOSMOE_EXPERTS_ISA_NS
}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
