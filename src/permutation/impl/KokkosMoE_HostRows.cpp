// Host row kernels of the combine (see KokkosMoE_HostRows.hpp).

#include <impl/KokkosMoE_HostRows.hpp>

#include <cstring>

// GCC and Clang on x86-64 build one clone per ISA level and pick it through an
// ifunc at load time. This file is compiled with -ffp-contract=off (see
// src/CMakeLists.txt) so that no clone fuses a multiply and an add. (A HIP
// build's device pass sees the host's macros but has no multiversioning.)
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(__CUDACC__) && \
    !defined(__HIP_DEVICE_COMPILE__) && !defined(__NVCOMPILER) && !defined(__INTEL_LLVM_COMPILER) && defined(__linux__)
#define KOKKOSMOE_HOST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KOKKOSMOE_HOST_CLONES
#endif

namespace KokkosMoE {
namespace Impl {

namespace {

inline float bf16_bits_to_float(std::uint16_t b) {
  std::uint32_t const u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// to_bf16() without branches, so that the store loop vectorises.
inline std::uint16_t float_to_bf16_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  bool const nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0u;
  std::uint32_t const rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t const quiet = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>(nan ? quiet : rounded);
}

inline void prefetch(unsigned char const* p, int bytes) {
#if defined(__GNUC__) || defined(__clang__)
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace

KOKKOSMOE_HOST_CLONES
void host_weighted_rows(PayloadType type, unsigned char const* const* rows, float const* w, int n, int d,
                        float* out_f32, std::uint16_t* out_bf16, unsigned char const* const* next_rows, int n_next) {
  // Blocks that stay in L1: within a block each row adds its slice in order,
  // so every element sees the sequential sum while the n rows stream together.
  constexpr int block = 128;
  constexpr int distance = 8;  // blocks ahead (tuned on a DDR host; rows are scattered)
  alignas(64) float acc[block];
  bool const bf16 = type == PayloadType::bf16;
  int const eb = bf16 ? 2 : 4;
  for (int c0 = 0; c0 < d; c0 += block) {
    int const len = d - c0 < block ? d - c0 : block;
    // The rows are scattered: ask for the block `distance` blocks ahead,
    // running on into the next call's rows near the end of this one.
    int const ahead = c0 + distance * block;
    if (ahead < d) {
      int const ahead_len = d - ahead < block ? d - ahead : block;
      for (int j = 0; j < n; ++j) prefetch(rows[j] + static_cast<std::ptrdiff_t>(ahead) * eb, ahead_len * eb);
    } else {
      int const at = ahead - (d + block - 1) / block * block;
      if (at >= 0 && at < d) {
        int const at_len = d - at < block ? d - at : block;
        for (int j = 0; j < n_next; ++j) prefetch(next_rows[j] + static_cast<std::ptrdiff_t>(at) * eb, at_len * eb);
      }
    }
    for (int c = 0; c < len; ++c) acc[c] = 0.0f;
    for (int j = 0; j < n; ++j) {
      float const wj = w[j];
      if (bf16) {
        auto const* __restrict y = reinterpret_cast<std::uint16_t const*>(rows[j]) + c0;
        for (int c = 0; c < len; ++c) acc[c] += wj * bf16_bits_to_float(y[c]);
      } else {
        auto const* __restrict y = reinterpret_cast<float const*>(rows[j]) + c0;
        for (int c = 0; c < len; ++c) acc[c] += wj * y[c];
      }
    }
    if (out_f32) {
      std::memcpy(out_f32 + c0, acc, sizeof(float) * static_cast<std::size_t>(len));
    } else {
      std::uint16_t* __restrict o = out_bf16 + c0;
      for (int c = 0; c < len; ++c) o[c] = float_to_bf16_bits(acc[c]);
    }
  }
}

}  // namespace Impl
}  // namespace KokkosMoE
