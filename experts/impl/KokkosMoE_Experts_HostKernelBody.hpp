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
#include <utility>

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

// Decode micro-kernel: out[i * VL + j] = sum_k w_j[k] * x_i[k] for the VL
// weight rows w_j = w + j * ldw and R rows x_i = x + i * ldx (FP32). Output
// columns are the SIMD lanes: VL x VL weight blocks are read along k (each
// weight element once, contiguous), transposed in registers, and every
// output accumulates its products one k at a time in increasing k, exactly
// as micro() does, so both kernels give the same bits for a row.

// Swaps row bit P with lane bit P of the rows (i, i + P) pair.
template <int P, std::size_t... L>
static inline vfloat mix_low(vfloat a, vfloat b, std::index_sequence<L...>) {
  return __builtin_shufflevector(a, b, static_cast<int>((L & P) ? VL + L - P : L)...);
}
template <int P, std::size_t... L>
static inline vfloat mix_high(vfloat a, vfloat b, std::index_sequence<L...>) {
  return __builtin_shufflevector(a, b, static_cast<int>((L & P) ? VL + L : L + P)...);
}
template <int P>
static inline void transpose_stage(vfloat* r) {
  if constexpr (P >= 1) {
    for (int i = 0; i < VL; ++i) {
      if (i & P) continue;
      vfloat const a = r[i], b = r[i + P];
      r[i] = mix_low<P>(a, b, std::make_index_sequence<VL>{});
      r[i + P] = mix_high<P>(a, b, std::make_index_sequence<VL>{});
    }
    transpose_stage<P / 2>(r);
  }
}

static inline vfloat load_row(float const* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline vfloat load_row(std::uint16_t const* p) {
  typedef std::uint16_t vu16 __attribute__((vector_size(VL * 2)));
  typedef std::uint32_t vu32 __attribute__((vector_size(VL * 4)));
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  vu32 const u = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Prefetches into L2 the share of step s (of steps) of the next block: VL
// weight rows of ldw elements from next, one contiguous range.
template <class W>
static inline void prefetch_next_block(W const* next, long ldw, int s, int steps) {
  if (next == nullptr || steps <= 0) return;
  long const lines = (VL * ldw * static_cast<long>(sizeof(W)) + 63) / 64;
  long const per = (lines + steps - 1) / steps;
  char const* base = reinterpret_cast<char const*>(next);
  for (long l = s * per, e = l + per < lines ? l + per : lines; l < e; ++l) __builtin_prefetch(base + l * 64, 0, 2);
}

template <int R, class W>
void decode(int K, float const* __restrict x, long ldx, W const* __restrict w, long ldw, float* __restrict out,
            W const* next) {
  // Whole blocks of the k loops below, over which next is prefetched.
  int const steps = sizeof(W) == 2 ? K / (2 * VL) + (K % (2 * VL)) / VL : K / VL;
  int s = 0;
  vfloat acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = vfloat{};
  int k0 = 0;
  if constexpr (sizeof(W) == 2) {
    // bf16 weights: blocks of VL rows x 2 VL elements moved as 32-bit pairs
    // (one transpose for twice the k of an FP32 block), each pair split
    // into its two floats by a shift and a mask; k stays in order.
    typedef std::uint32_t vu32 __attribute__((vector_size(VL * 4)));
    for (; k0 + 2 * VL <= K; k0 += 2 * VL) {
      prefetch_next_block(next, ldw, s++, steps);
      vfloat t[VL];
#pragma GCC unroll 16
      for (int j = 0; j < VL; ++j) std::memcpy(&t[j], w + j * ldw + k0, sizeof(vfloat));
      transpose_stage<VL / 2>(t);
#pragma GCC unroll 16
      for (int pp = 0; pp < VL; ++pp) {
        vu32 u;
        std::memcpy(&u, &t[pp], sizeof u);
        vu32 const lo = u << 16, hi = u & 0xFFFF0000u;
        vfloat even, odd;
        std::memcpy(&even, &lo, sizeof even);
        std::memcpy(&odd, &hi, sizeof odd);
        int const k = k0 + 2 * pp;
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i] += even * splat(x[i * ldx + k]);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i] += odd * splat(x[i * ldx + k + 1]);
      }
    }
  }
  for (; k0 + VL <= K; k0 += VL) {
    prefetch_next_block(next, ldw, s++, steps);
    vfloat t[VL];
#pragma GCC unroll 16
    for (int j = 0; j < VL; ++j) t[j] = load_row(w + j * ldw + k0);
    transpose_stage<VL / 2>(t);
#pragma GCC unroll 16
    for (int kk = 0; kk < VL; ++kk)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i] += t[kk] * splat(x[i * ldx + k0 + kk]);
  }
  for (int k = k0; k < K; ++k) {
    float col[VL];
    for (int j = 0; j < VL; ++j) col[j] = load_weight(w + j * ldw + k);
    vfloat const t = load_row(col);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] += t * splat(x[i * ldx + k]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) std::memcpy(out + i * VL, &acc[i], sizeof(vfloat));
}

#else

template <int R, class W>
void decode(int K, float const* x, long ldx, W const* w, long ldw, float* out, W const*) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < VL; ++j) out[i * VL + j] = 0.0f;
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < VL; ++j) out[i * VL + j] += load_weight(w + j * ldw + k) * x[i * ldx + k];
}

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

/// Table entry f32[mv] with nrw[mv] weight rows.
template <int MV, int NRW>
void set_kernel(HostKernelTable& t) {
  static_assert(NRW % 2 == 0, "weight rows come in two groups");
  t.f32[MV] = &micro<MV, NRW, float>;
  t.nrw[MV] = NRW;
}

/// Decode entries for 1..host_decode_max_rows rows.
template <std::size_t... R>
void set_decode_kernels(HostKernelTable& t, std::index_sequence<R...>) {
  ((t.decode_f32[R + 1] = &decode<static_cast<int>(R + 1), float>), ...);
  ((t.decode_bf16[R + 1] = &decode<static_cast<int>(R + 1), std::uint16_t>), ...);
}
inline void set_decode_kernels(HostKernelTable& t) {
  set_decode_kernels(t, std::make_index_sequence<host_decode_max_rows>{});
}

}  // namespace KOKKOSMOE_EXPERTS_ISA_NS
}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
