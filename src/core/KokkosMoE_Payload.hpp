#ifndef KOKKOSMOE_PAYLOAD_HPP
#define KOKKOSMOE_PAYLOAD_HPP

/// \file KokkosMoE_Payload.hpp
/// \brief Payload element types moved between ranks: fp32, bf16, and fp8 e4m3
/// with FP32 scales (one per row, or one per 128-element block of a row).
/// Conversions are usable inside Kokkos kernels on every backend.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>

#include <cstddef>
#include <cstdint>
#include <string.h>
#include <string>

namespace KokkosMoE {

/// \brief bfloat16 storage: the upper 16 bits of an IEEE float.
struct bf16_t {
  std::uint16_t bits;
};

/// \brief OCP fp8 E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa
/// bits; no infinities, NaN = S.1111.111, largest finite 448.
struct fp8_e4m3_t {
  std::uint8_t bits;
};

namespace Impl {
/// The bits of x as a To of the same size, in host and device code.
template <class To, class From>
KOKKOS_INLINE_FUNCTION To bits_as(From const& x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: types of one size");
  To t;
  memcpy(&t, &x, sizeof t);
  return t;
}
KOKKOS_INLINE_FUNCTION std::uint32_t float_bits(float f) { return bits_as<std::uint32_t>(f); }
KOKKOS_INLINE_FUNCTION float bits_float(std::uint32_t u) { return bits_as<float>(u); }
}  // namespace Impl

/// \brief float -> bf16, round to nearest, ties to even. NaN stays a (quiet)
/// NaN with its sign; +-Inf stays +-Inf; values beyond the bf16 range round to
/// +-Inf as IEEE rounding requires.
KOKKOS_INLINE_FUNCTION bf16_t to_bf16(float x) {
  std::uint32_t const u = Impl::float_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0u) {
    return bf16_t{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
  }
  std::uint32_t const bias = 0x7FFFu + ((u >> 16) & 1u);
  return bf16_t{static_cast<std::uint16_t>((u + bias) >> 16)};
}

/// \brief bf16 -> float (exact).
KOKKOS_INLINE_FUNCTION float to_float(bf16_t x) {
  return Impl::bits_float(static_cast<std::uint32_t>(x.bits) << 16);
}

KOKKOS_INLINE_FUNCTION float to_float(float x) { return x; }

/// \brief Largest finite e4m3 value.
constexpr float fp8_e4m3_max = 448.0f;

/// \brief float -> fp8 e4m3, round to nearest, ties to even, saturating:
/// finite values beyond +-448 and +-Inf become +-448; NaN becomes NaN (sign
/// kept); values below the smallest subnormal (2^-9) round to (signed) zero.
KOKKOS_INLINE_FUNCTION fp8_e4m3_t to_fp8_e4m3(float x) {
  std::uint32_t const u = Impl::float_bits(x);
  std::uint8_t const sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  std::uint32_t const au = u & 0x7FFFFFFFu;
  if (au > 0x7F800000u) return fp8_e4m3_t{static_cast<std::uint8_t>(sign | 0x7Fu)};
  if (au >= 0x43E00000u) return fp8_e4m3_t{static_cast<std::uint8_t>(sign | 0x7Eu)};  // >= 448 or Inf
  int const exponent = static_cast<int>(au >> 23) - 127;
  if (exponent < -6) {
    // Subnormal range: value = m * 2^-9 with m in [0, 8]; m == 8 is the
    // smallest normal (0x08), which the encoding produces naturally.
    float const q = Impl::bits_float(au) * 512.0f;  // exact: power-of-two scaling
    std::uint32_t m = static_cast<std::uint32_t>(q);
    float const frac = q - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return fp8_e4m3_t{static_cast<std::uint8_t>(sign | m)};
  }
  std::uint32_t mant = au & 0x007FFFFFu;
  std::uint32_t const bias = 0x7FFFFu + ((mant >> 20) & 1u);
  mant += bias;
  int e = exponent;
  if (mant & 0x00800000u) {  // mantissa rounding carried into the exponent
    mant = 0;
    ++e;
  }
  std::uint32_t const m3 = (mant >> 20) & 0x7u;
  if (e > 8 || (e == 8 && m3 == 7u)) return fp8_e4m3_t{static_cast<std::uint8_t>(sign | 0x7Eu)};
  return fp8_e4m3_t{static_cast<std::uint8_t>(sign | (static_cast<std::uint32_t>(e + 7) << 3) | m3)};
}

/// \brief fp8 e4m3 -> float (exact).
KOKKOS_INLINE_FUNCTION float to_float(fp8_e4m3_t x) {
  std::uint32_t const sign = static_cast<std::uint32_t>(x.bits & 0x80u) << 24;
  std::uint32_t const e = (x.bits >> 3) & 0xFu;
  std::uint32_t const m = x.bits & 0x7u;
  if (e == 0xFu && m == 0x7u) return Impl::bits_float(sign | 0x7FC00000u);
  if (e == 0u) {
    float const v = static_cast<float>(m) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return Impl::bits_float(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

/// \brief Converts float to a storage type: identity for float, RNE for bf16.
template <class T>
KOKKOS_INLINE_FUNCTION T from_float(float x);
template <>
KOKKOS_INLINE_FUNCTION float from_float<float>(float x) { return x; }
template <>
KOKKOS_INLINE_FUNCTION bf16_t from_float<bf16_t>(float x) { return to_bf16(x); }

/// \brief FP32 scale for an fp8 row/block whose largest magnitude is amax:
/// amax / 448, or 1 when the block is all zeros (or not finite).
KOKKOS_INLINE_FUNCTION float fp8_scale_for(float amax) {
  return (amax > 0.0f && amax <= 3.4028234e38f) ? amax / fp8_e4m3_max : 1.0f;
}

/// \brief The representation of a payload row on the wire.
enum class PayloadType : int {
  fp32 = 0,
  bf16 = 1,
  fp8_row = 2,       ///< fp8 e4m3 + one FP32 scale per row
  fp8_block128 = 3,  ///< fp8 e4m3 + one FP32 scale per 128 elements of a row
};

/// \brief Elements per fp8 scale block in PayloadType::fp8_block128.
constexpr int fp8_block_size = 128;

/// \brief Number of FP32 scales per row of width d.
KOKKOS_INLINE_FUNCTION constexpr std::int64_t payload_scales_per_row(PayloadType t, std::int64_t d) {
  return t == PayloadType::fp8_row ? 1
         : t == PayloadType::fp8_block128 ? (d + fp8_block_size - 1) / fp8_block_size
                                          : 0;
}

/// \brief Logical bytes of one payload row of width d, scales included.
KOKKOS_INLINE_FUNCTION constexpr std::int64_t payload_row_bytes(PayloadType t, std::int64_t d) {
  return t == PayloadType::fp32   ? 4 * d
         : t == PayloadType::bf16 ? 2 * d
                                  : d + 4 * payload_scales_per_row(t, d);
}

/// \brief "fp32", "bf16", "fp8_row", "fp8_block128".
inline EnumTable<PayloadType> const& names_of(PayloadType) {
  static EnumTable<PayloadType> const t{"payload type",
                                        {{PayloadType::fp32, "fp32"},
                                         {PayloadType::bf16, "bf16"},
                                         {PayloadType::fp8_row, "fp8_row"},
                                         {PayloadType::fp8_block128, "fp8_block128"}}};
  return t;
}

}  // namespace KokkosMoE

#endif
