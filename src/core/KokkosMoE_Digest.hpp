#ifndef KOKKOSMOE_DIGEST_HPP
#define KOKKOSMOE_DIGEST_HPP

/// \file KokkosMoE_Digest.hpp
/// \brief 64-bit content digests of parameter bytes (expert weights, slots).
/// Not cryptographic: it detects corruption, truncation and mix-ups.

#include <cstddef>
#include <cstdint>
#include <string>

namespace KokkosMoE {

/// \brief Digest of n bytes, chained from seed (so several buffers can be
/// digested in sequence: d = digest(b, nb, digest(a, na))).
std::uint64_t digest_bytes(void const* data, std::size_t n, std::uint64_t seed = 0x9E3779B97F4A7C15ULL);

/// \brief 16 lowercase hex digits.
std::string digest_hex(std::uint64_t digest);

}  // namespace KokkosMoE

#endif
