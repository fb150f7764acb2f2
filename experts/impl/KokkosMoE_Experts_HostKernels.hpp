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
using HostDecodeKernelF32 = void (*)(int K, float const* x, long ldx, float const* w, long ldw, float* out);
using HostDecodeKernelBF16 = void (*)(int K, float const* x, long ldx, std::uint16_t const* w, long ldw, float* out);

/// \brief bf16 rows times bf16 weights with bf16 pair dot products
/// (AVX512-BF16 vdpbf16ps), FP32 accumulation: every output adds, pair by
/// pair in increasing k, w[2p] x[2p] + w[2p+1] x[2p+1] as the instruction
/// does (an odd K ends with the pair (w[K-1], 0)). Both forms take their
/// rows as pairs xt2[p * R + i] = (x_i[2p], x_i[2p+1]) (R: the tile's row
/// vectors times the vector length, or the decode form's rows) and give the
/// same bits for a row.
using HostMicroKernelDP = void (*)(int K, std::uint32_t const* xt2, std::uint16_t const* w0, std::uint16_t const* w1,
                                   long ldw, float* acc);
using HostDecodeKernelDP = void (*)(int K, std::uint32_t const* xt2, std::uint16_t const* w, long ldw, float* out);

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
  /// dp[mv] with nrw[mv] weight rows, decode_dp[R].
  HostMicroKernelDP dp[host_max_vectors + 1] = {};
  HostDecodeKernelDP decode_dp[host_decode_max_rows + 1] = {};
};

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
