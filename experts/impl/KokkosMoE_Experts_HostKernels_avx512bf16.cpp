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

// out[i * 16 + j] over the 16 weight rows w + j * ldw and the R rows given
// as pairs xt2[p * R + i]: blocks of 16 rows x 16 pairs (one cache line per
// row) are transposed as 32-bit pairs, so lane j of block vector pp holds
// row j's pair p0 + pp, met by row i's pair broadcast.
template <int R>
void decode_dp(int K, std::uint32_t const* __restrict xt2, std::uint16_t const* __restrict w, long ldw, float* __restrict out) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int const full = K / 2;  // whole pairs
  int const blocked = full / 16 * 16;
  for (int p0 = 0; p0 < blocked; p0 += 16) {
    vfloat t[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      std::uint16_t const* row = w + j * ldw + 2 * p0;
      __builtin_prefetch(row + 256);
      std::memcpy(&t[j], row, sizeof(vfloat));
    }
    transpose_stage<8>(t);
    std::uint32_t const* xp = xt2 + static_cast<long>(p0) * R;
#pragma GCC unroll 16
    for (int pp = 0; pp < 16; ++pp) {
      __m512i const wv = reinterpret_cast<__m512i const&>(t[pp]);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[i] = dot(acc[i], wv, _mm512_set1_epi32(static_cast<int>(xp[pp * R + i])));
    }
  }
  int const Kp = (K + 1) / 2;
  for (int p = blocked; p < Kp; ++p) {
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

template <int MV, int NRW>
void set_dp(HostKernelTable& t) {
  static_assert(NRW % 2 == 0, "weight rows come in two groups");
  t.dp[MV] = &micro_dp<MV, NRW>;
}
template <std::size_t... R>
void set_decode_dp(HostKernelTable& t, std::index_sequence<R...>) {
  ((t.decode_dp[R + 1] = &decode_dp<static_cast<int>(R + 1)>), ...);
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
