#ifndef KOKKOSMOE_IMPL_HOSTROWS_HPP
#define KOKKOSMOE_IMPL_HOSTROWS_HPP

/// \file KokkosMoE_HostRows.hpp
/// \brief Host row kernels of the combine, compiled once per x86-64 ISA level
/// (baseline, AVX2, AVX-512) and chosen at load time from the CPU's features.
/// Multiplies and adds are never contracted, so every ISA gives the bits of
/// the baseline.

#include <KokkosMoE_Payload.hpp>

#include <cstdint>

namespace KokkosMoE {
namespace Impl {

/// \brief out[c] = sum over j = 0..n-1, in that order, of w[j] * rows[j][c]
/// (FP32 accumulation starting from 0) for c < d. Rows are bf16 or fp32
/// (`type`); the result goes to out_f32 when it is not null, else rounded to
/// bf16 into out_bf16. The first blocks of next_rows[0..n_next) (the rows of
/// the next call) are prefetched while the last block is summed.
void host_weighted_rows(PayloadType type, unsigned char const* const* rows, float const* w, int n, int d,
                        float* out_f32, std::uint16_t* out_bf16, unsigned char const* const* next_rows = nullptr,
                        int n_next = 0);

}  // namespace Impl
}  // namespace KokkosMoE

#endif
