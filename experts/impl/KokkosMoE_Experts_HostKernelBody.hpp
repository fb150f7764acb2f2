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

// SwiGLU backward, element-wise (see HostSwigluBackwardF32): straight-line
// float and integer arithmetic that the compiler vectorizes for the unit's
// ISA, with exp from a Cephes-style reduction and polynomial (within 2 ulp).
static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // 2^i stays a normal float
  // The nearest integer to x log2(e) (adding and removing 1.5 * 2^23 rounds
  // to an integer in the default rounding mode; floorf would not vectorize).
  float const fi = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float const r = (x - fi * 0.693359375f) + fi * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float const e = p * r * r + r + 1.0f;
  std::int32_t const bits = (static_cast<std::int32_t>(fi) + 127) * (1 << 23);
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// Round to nearest even bf16 (a NaN stays a quiet NaN), as to_bf16 does.
static inline std::uint16_t round_bf16(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  bool const nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0u;
  std::uint32_t const r = nan ? ((u >> 16) | 0x0040u) : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return static_cast<std::uint16_t>(r);
}
static inline float out_value(float v, float*) { return v; }
static inline std::uint16_t out_value(float v, std::uint16_t*) { return round_bf16(v); }

template <class O>
void swiglu_backward(std::size_t n, float const* g, float const* u, float const* dh, O* h, O* dg, O* du) {
  // dg may be dh (FP32): each block of dh is read into a buffer first, so
  // the loop below reads and writes distinct arrays.
  constexpr std::size_t B = 512;
  alignas(64) float dhb[B];
  for (std::size_t i0 = 0; i0 < n; i0 += B) {
    std::size_t const m = n - i0 < B ? n - i0 : B;
    std::memcpy(dhb, dh + i0, m * sizeof(float));
    float const* __restrict gg = g + i0;
    float const* __restrict uu = u + i0;
    O* __restrict hh = h + i0;
    O* __restrict gd = dg + i0;
    O* __restrict ud = du + i0;
    for (std::size_t i = 0; i < m; ++i) {
      float const x = gg[i], uv = uu[i], d = dhb[i];
      float const s = 1.0f / (1.0f + exp_approx(-x));
      float const silu = x * s, dsilu = s * (1.0f + x * (1.0f - s));
      hh[i] = out_value(silu * uv, hh);
      gd[i] = out_value(d * uv * dsilu, gd);
      ud[i] = out_value(d * silu, ud);
    }
  }
}

/// Element-wise entries.
inline void set_elementwise_kernels(HostKernelTable& t) {
  t.swiglu_backward_f32 = &swiglu_backward<float>;
  t.swiglu_backward_bf16 = &swiglu_backward<std::uint16_t>;
}

}  // namespace KOKKOSMOE_EXPERTS_ISA_NS
}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
