#ifndef KOKKOSMOE_IMPL_ORDERKEYS_HPP
#define KOKKOSMOE_IMPL_ORDERKEYS_HPP

/// \file impl/KokkosMoE_OrderKeys.hpp
/// \brief Integer keys that order floats totally, for deterministic
/// selection: NaN counts as -infinity, equal values fall back to an index.

#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>

#include <cstdint>

namespace KokkosMoE {
namespace Impl {

KOKKOS_INLINE_FUNCTION float neg_infinity() { return bits_float(0xFF800000u); }

/// NaN -> -infinity, everything else unchanged.
KOKKOS_INLINE_FUNCTION float select_value(float x) { return x != x ? neg_infinity() : x; }

/// Order-preserving map float -> uint32 that agrees with float comparison:
/// a < b implies bits(a) < bits(b), -0 and +0 map to the same value, and
/// NaN counts as -infinity.
KOKKOS_INLINE_FUNCTION std::uint32_t float_order_bits(float x) {
  std::uint32_t u = float_bits(x);
  std::uint32_t const a = u & 0x7FFFFFFFu;
  u = a > 0x7F800000u ? 0xFF800000u : (a == 0u ? 0u : u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Inverse of float_order_bits (for values it produces).
KOKKOS_INLINE_FUNCTION float order_bits_float(std::uint32_t o) {
  return bits_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

}  // namespace Impl
}  // namespace KokkosMoE

#endif
