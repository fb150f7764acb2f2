#ifndef KOKKOSMOE_EXPERTS_HOSTKERNELS_HPP
#define KOKKOSMOE_EXPERTS_HOSTKERNELS_HPP

/// \file impl/KokkosMoE_Experts_HostKernels.hpp
/// \brief Register-blocked FP32 micro-kernels of the grouped runner on host
/// execution spaces, one table per instruction set, chosen at run time from
/// the CPU's features (the library is built for the baseline ISA; the wider
/// variants live in translation units compiled with their own flags).
///
/// A micro-kernel computes, for one row tile of R = mv * vector_length rows
/// and nrw = 2h weight rows,
///
///     acc[j][i] = sum_{k < K} w_j[k] * xt[k * R + i]
///     w_j = w0 + j * ldw (j < h),  w_j = w1 + (j - h) * ldw (j >= h)
///
/// where xt is the row tile staged transposed ([K][R], contiguous, FP32,
/// zero beyond the tile's rows) and the FP32 weight rows are read in place
/// (the caller converts bf16 rows into an FP32 panel first). Rows are the SIMD
/// dimension: every weight element is loaded once, broadcast, and meets R rows
/// in mv vector FMAs; the weights are never copied or transposed, so a tiny
/// tile streams them exactly once. The two row groups let phase 1 pair gate
/// row c with up row c in one call (w0 = gate, w1 = up) and phase 2 take nrw
/// consecutive down rows (w1 = w0 + h * ldw).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

/// \brief Largest number of row vectors of a host micro-kernel.
constexpr int host_max_vectors = 4;
/// \brief Largest number of rows of a decode micro-kernel.
constexpr int host_decode_max_rows = 8;

/// \brief acc[nrw][R] = w[nrw][K] . xt[K][R] with float weight rows.
using HostMicroKernelF32 = void (*)(int K, float const* xt, float const* w0, float const* w1, long ldw, float* acc);

/// \brief Decode kernel: out[i * VL + j] = w_j . x_i for the vector_length
/// weight rows w_j = w + j * ldw (read along k, float or bf16) and R FP32
/// rows x_i = x + i * ldx; each output accumulated in increasing k like the
/// micro-kernels (same bits), for segments of few rows.
/// `next` is the first of the vector_length weight rows (ldw apart) the
/// caller reads after these, or null: the kernel prefetches them into L2
/// across its k steps, since a block's rows are short streams that the
/// hardware prefetchers pick up late.
using HostDecodeKernelF32 = void (*)(int K, float const* x, long ldx, float const* w, long ldw, float* out,
                                     float const* next);
using HostDecodeKernelBF16 = void (*)(int K, float const* x, long ldx, std::uint16_t const* w, long ldw, float* out,
                                      std::uint16_t const* next);

/// \brief bf16 rows times bf16 weights with bf16 pair dot products
/// (AVX512-BF16 vdpbf16ps), FP32 accumulation: every output adds, pair by
/// pair in increasing k, w[2p] x[2p] + w[2p+1] x[2p+1] as the instruction
/// does (an odd K ends with the pair (w[K-1], 0)). Both forms take their
/// rows as pairs xt2[p * R + i] = (x_i[2p], x_i[2p+1]) (R: the tile's row
/// vectors times the vector length, or the decode form's rows) and give the
/// same bits for a row.
using HostMicroKernelDP = void (*)(int K, std::uint32_t const* xt2, std::uint16_t const* w0, std::uint16_t const* w1,
                                   long ldw, float* acc);
/// The decode forms take `next` as HostDecodeKernelF32 does.
using HostDecodeKernelDP = void (*)(int K, std::uint32_t const* xt2, std::uint16_t const* w, long ldw, float* out,
                                    std::uint16_t const* next);
/// \brief The decode form for weight rows whose stride maps them onto the
/// same few L1 sets (a row of 2048 bf16 is 4 KiB): the upper half of the
/// weight rows runs host_decode_skew pairs behind the lower half, so that a
/// step's loads spread over two sets. Lane 2m holds row m and lane 2m + 1
/// row 8 + m; the rows come as xs2[p * R + i] = pair p | pair (p - skew) << 32
/// for p in [0, K / 2 + skew), pairs outside [0, K / 2) zero. K must be a
/// multiple of 32. In the first and last steps the lanes without a pair are
/// masked off, so every output adds exactly its pairs in increasing k and
/// the bits are those of the other forms.
using HostDecodeKernelDPSkewed = void (*)(int K, std::uint64_t const* xs2, std::uint16_t const* w, long ldw, float* out,
                                          std::uint16_t const* next);
/// \brief Pairs by which the skewed decode form's upper rows trail.
constexpr int host_decode_skew = 32;

/// \brief The SwiGLU backward's element-wise pass over n elements:
/// h = silu(g) u, dg = dh u silu'(g), du = dh silu(g) with silu(g) = g s,
/// silu'(g) = s (1 + g (1 - s)), s = 1 / (1 + exp(-g)) (exp within 2 ulp),
/// outputs FP32 or bf16 (bits rounded to nearest even). dg may be dh.
using HostSwigluBackwardF32 = void (*)(std::size_t n, float const* g, float const* u, float const* dh, float* h, float* dg,
                                       float* du);
using HostSwigluBackwardBF16 = void (*)(std::size_t n, float const* g, float const* u, float const* dh, std::uint16_t* h,
                                        std::uint16_t* dg, std::uint16_t* du);

/// \brief The micro-kernels of one instruction set.
struct HostKernelTable {
  char const* isa = "none";                    ///< "avx512", "avx2" or "generic"
  int vector_length = 0;                       ///< floats per SIMD vector
  int max_vectors = 0;                         ///< row vectors of the widest kernel
  HostMicroKernelF32 f32[host_max_vectors + 1] = {};    ///< f32[mv], mv in [1, max_vectors]
  int nrw[host_max_vectors + 1] = {};          ///< weight rows of f32[mv] (always even)
  HostDecodeKernelF32 decode_f32[host_decode_max_rows + 1] = {};    ///< decode_f32[R], R in [1, host_decode_max_rows]
  HostDecodeKernelBF16 decode_bf16[host_decode_max_rows + 1] = {};  ///< decode_bf16[R]
  /// bf16 x bf16 dot-product kernels (null where the CPU lacks AVX512-BF16):
  /// dp[mv] with nrw[mv] weight rows, decode_dp[R] and decode_dp_skewed[R].
  HostMicroKernelDP dp[host_max_vectors + 1] = {};
  HostDecodeKernelDP decode_dp[host_decode_max_rows + 1] = {};
  HostDecodeKernelDPSkewed decode_dp_skewed[host_decode_max_rows + 1] = {};
  HostSwigluBackwardF32 swiglu_backward_f32 = nullptr;    ///< element-wise SwiGLU backward, FP32 outputs
  HostSwigluBackwardBF16 swiglu_backward_bf16 = nullptr;  ///< the same, bf16 outputs
};

/// \brief Whether the decode of `rows` bf16 rows against weight rows of K
/// bf16 takes the skewed form: where the table has it, K is a multiple of 32
/// and 16 rows of 2K bytes fall on at most two offsets within 4 KiB (eight
/// or more rows per L1 set: K a multiple of 1024), which costs the plain
/// form up to a third of its bandwidth; elsewhere the plain form is as fast.
inline bool host_decode_skewed(HostKernelTable const& table, int rows, int K) {
  return rows >= 1 && rows <= host_decode_max_rows && table.decode_dp_skewed[rows] != nullptr && K % 1024 == 0;
}

/// \brief Fills a table with one instruction set's kernels (defined in the
/// unit compiled for it; absent from builds without that unit).
void fill_host_kernels_avx512(HostKernelTable& table);
/// \brief Adds the AVX512-BF16 dot-product kernels to an AVX-512 table.
void fill_host_kernels_avx512bf16(HostKernelTable& table);
void fill_host_kernels_avx2(HostKernelTable& table);
void fill_host_kernels_generic(HostKernelTable& table);

/// \brief The widest table this build and this CPU support (decided once).
HostKernelTable const& host_kernel_table();

/// \brief The table of a named instruction set ("avx512", "avx2",
/// "generic"; "" or "auto" for host_kernel_table()). Throws Error naming the
/// available ones when this build or CPU lacks it.
HostKernelTable const& host_kernel_table(std::string const& isa);

/// \brief Instruction sets usable here, widest first.
std::vector<std::string> host_kernel_isas();

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
