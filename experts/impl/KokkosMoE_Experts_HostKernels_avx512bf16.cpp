// Host micro-kernels for bf16 rows times bf16 weights with AVX512-BF16 pair
// dot products (vdpbf16ps: 32 multiply-adds per instruction, FP32
// accumulation); compiled with the AVX-512 flags and -mavx512bf16 when the
// build enables it, empty otherwise. The weights are read as bf16 pairs in
// place (no conversion), so the tiled form does twice the work of an FP32
// FMA per instruction and the decode form transposes pairs, half the
// shuffles per weight of the FP32 decode kernel.

#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512BF16) && defined(__AVX512BF16__)

#define KOKKOSMOE_EXPERTS_ISA_NS avx512bf16
#define KOKKOSMOE_EXPERTS_VECTOR_BYTES 64
#include <impl/KokkosMoE_Experts_HostKernelBody.hpp>

#include <immintrin.h>

namespace KokkosMoE {
namespace Experts {
namespace Impl {
namespace avx512bf16 {

static inline std::uint32_t pair_at(std::uint16_t const* p) {
  std::uint32_t u;
  std::memcpy(&u, p, sizeof u);
  return u;
}

static inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// acc[j * R + i] over the nrw = NRW weight rows (w0 rows then w1 rows) and
// the R = 16 MV rows of the pair tile xt2 ([ceil(K/2)][R] pairs).
template <int MV, int NRW>
void micro_dp(int K, std::uint32_t const* __restrict xt2, std::uint16_t const* __restrict w0,
              std::uint16_t const* __restrict w1, long ldw, float* __restrict acc) {
  constexpr int R = MV * 16, H = NRW / 2;
  __m512 c[NRW][MV];
#pragma GCC unroll 32
  for (int j = 0; j < NRW; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) c[j][m] = _mm512_setzero_ps();
  int const Kp = (K + 1) / 2;
  bool const odd = K % 2 != 0;
  for (int p = 0; p < Kp; ++p) {
    bool const last_half = odd && p == Kp - 1;
    __m512i x[MV];
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) x[m] = _mm512_loadu_si512(xt2 + static_cast<long>(p) * R + m * 16);
#pragma GCC unroll 32
    for (int j = 0; j < NRW; ++j) {
      std::uint16_t const* w = (j < H ? w0 + j * ldw : w1 + (j - H) * ldw) + 2 * p;
      __m512i const wj = _mm512_set1_epi32(static_cast<int>(last_half ? std::uint32_t(*w) : pair_at(w)));
#pragma GCC unroll 8
      for (int m = 0; m < MV; ++m) c[j][m] = dot(c[j][m], wj, x[m]);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < NRW; ++j)
#pragma GCC unroll 8
    for (int m = 0; m < MV; ++m) _mm512_storeu_ps(acc + j * R + m * 16, c[j][m]);
}

// Prefetches into L2 the share of step s (of steps) of the next block: 16
// weight rows of ldw bf16 from next, one contiguous range.
static inline void prefetch_next_block(std::uint16_t const* next, long ldw, int s, int steps) {
  if (next == nullptr) return;
  long const lines = (16 * ldw * 2 + 63) / 64;
  long const per = (lines + steps - 1) / steps;
  char const* base = reinterpret_cast<char const*>(next);
  for (long l = s * per, e = l + per < lines ? l + per : lines; l < e; ++l) _mm_prefetch(base + l * 64, _MM_HINT_T1);
}

// acc[i] += the transposed block t (vector pp: pair pp of every lane's row)
// times row i's pairs broadcast by x(pp, i), on the given lanes.
template <int R, class X>
static inline void dot_block(__m512* acc, vfloat const* t, __mmask16 lanes, X const& x) {
#pragma GCC unroll 16
  for (int pp = 0; pp < 16; ++pp) {
    __m512i const wv = reinterpret_cast<__m512i const&>(t[pp]);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      __m512i const xv = x(pp, i);
      acc[i] = _mm512_mask_dpbf16_ps(acc[i], lanes, reinterpret_cast<__m512bh const&>(wv), reinterpret_cast<__m512bh const&>(xv));
    }
  }
}

// out[i * 16 + j] over the 16 weight rows w + j * ldw and the R rows given
// as pairs xt2[p * R + i]: blocks of 16 rows x 16 pairs (one cache line per
// row) are transposed as 32-bit pairs, so lane j of block vector pp holds
// row j's pair p0 + pp, met by row i's pair broadcast.
template <int R>
void decode_dp(int K, std::uint32_t const* __restrict xt2, std::uint16_t const* __restrict w, long ldw, float* __restrict out,
               std::uint16_t const* next) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int const full = K / 2;  // whole pairs
  int const steps = full / 16;
  for (int s = 0; s < steps; ++s) {
    int const p0 = 16 * s;
    prefetch_next_block(next, ldw, s, steps);
    vfloat t[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) std::memcpy(&t[j], w + j * ldw + 2 * p0, sizeof(vfloat));
    transpose_stage<8>(t);
    std::uint32_t const* xp = xt2 + static_cast<long>(p0) * R;
    dot_block<R>(acc, t, 0xFFFF, [xp](int pp, int i) { return _mm512_set1_epi32(static_cast<int>(xp[pp * R + i])); });
  }
  int const Kp = (K + 1) / 2;
  for (int p = 16 * steps; p < Kp; ++p) {
    bool const last_half = p == full;  // an odd K's last element, paired with 0
    alignas(64) std::uint32_t col[16];
    for (int j = 0; j < 16; ++j) {
      std::uint16_t const* e = w + j * ldw + 2 * p;
      col[j] = last_half ? std::uint32_t(*e) : pair_at(e);
    }
    __m512i const wv = _mm512_load_si512(col);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] = dot(acc[i], wv, _mm512_set1_epi32(static_cast<int>(xt2[static_cast<long>(p) * R + i])));
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * 16, acc[i]);
}

// The skewed form (see HostDecodeKernelDPSkewed): lane 2m is row m at pair
// p, lane 2m + 1 row 8 + m at pair p - S; a step's two groups of eight rows
// start 2 cache lines apart. Lanes without a pair (the upper rows in the
// first S / 16 steps, the lower ones in the last) are masked off.
template <int R>
void decode_dp_skewed(int K, std::uint64_t const* __restrict xs2, std::uint16_t const* __restrict w, long ldw,
                      float* __restrict out, std::uint16_t const* next) {
  constexpr int S = host_decode_skew;
  static_assert(S % 16 == 0, "the skew is whole steps");
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int const Kp = K / 2;  // a multiple of 16
  int const steps = (Kp + S) / 16;
  for (int s = 0; s < steps; ++s) {
    int const p0 = 16 * s;
    prefetch_next_block(next, ldw, s, steps);
    bool const lower = p0 < Kp, upper = p0 >= S;
    __mmask16 const lanes = lower ? (upper ? 0xFFFF : 0x5555) : 0xAAAA;
    vfloat t[16];
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) {
      t[2 * m] = vfloat{};
      t[2 * m + 1] = vfloat{};
      if (lower) std::memcpy(&t[2 * m], w + m * ldw + 2 * p0, sizeof(vfloat));
      if (upper) std::memcpy(&t[2 * m + 1], w + (8 + m) * ldw + 2 * (p0 - S), sizeof(vfloat));
    }
    transpose_stage<8>(t);
    std::uint64_t const* xp = xs2 + static_cast<long>(p0) * R;
    dot_block<R>(acc, t, lanes, [xp](int pp, int i) { return _mm512_set1_epi64(static_cast<long long>(xp[pp * R + i])); });
  }
  // Lanes (2m, 2m + 1) are columns (m, 8 + m).
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    vfloat const v = reinterpret_cast<vfloat const&>(acc[i]);
    vfloat const c = __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    std::memcpy(out + i * 16, &c, sizeof c);
  }
}

template <int MV, int NRW>
void set_dp(HostKernelTable& t) {
  static_assert(NRW % 2 == 0, "weight rows come in two groups");
  t.dp[MV] = &micro_dp<MV, NRW>;
}
template <std::size_t... R>
void set_decode_dp(HostKernelTable& t, std::index_sequence<R...>) {
  ((t.decode_dp[R + 1] = &decode_dp<static_cast<int>(R + 1)>), ...);
  ((t.decode_dp_skewed[R + 1] = &decode_dp_skewed<static_cast<int>(R + 1)>), ...);
}

}  // namespace avx512bf16

// The same nrw per row-vector count as the AVX-512 FP32 kernels (the table's
// nrw[]), which the AVX-512 table was filled with first.
void fill_host_kernels_avx512bf16(HostKernelTable& t) {
  avx512bf16::set_dp<4, 6>(t);
  avx512bf16::set_dp<3, 8>(t);
  avx512bf16::set_dp<2, 12>(t);
  avx512bf16::set_dp<1, 12>(t);
  avx512bf16::set_decode_dp(t, std::make_index_sequence<host_decode_max_rows>{});
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
