#include <KokkosMoE_Digest.hpp>

#include <cstdio>
#include <cstring>

namespace KokkosMoE {

namespace {
inline std::uint64_t mix(std::uint64_t h, std::uint64_t w) {
  h ^= w * 0x87C37B91114253D5ULL;
  h = (h << 31) | (h >> 33);
  return h * 0x4CF5AD432745937FULL + 0x52DCE729ULL;
}
}  // namespace

std::uint64_t digest_bytes(void const* data, std::size_t n, std::uint64_t seed) {
  auto const* p = static_cast<unsigned char const*>(data);
  // Four independent lanes over 32-byte blocks keep the multiplies pipelined.
  std::uint64_t h[4] = {seed, seed ^ 0xA0761D6478BD642FULL, seed ^ 0xE7037ED1A0B428DBULL, seed ^ 0x8EBC6AF09C88C6E3ULL};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int l = 0; l < 4; ++l) h[l] = mix(h[l], w[l]);
  }
  std::uint64_t acc = mix(mix(mix(h[0], h[1]), h[2]), h[3]);
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc = mix(acc, w);
  }
  std::uint64_t tail = 0;
  if (i < n) std::memcpy(&tail, p + i, n - i);
  acc = mix(acc, tail ^ (static_cast<std::uint64_t>(n) << 8));
  acc ^= acc >> 29;
  acc *= 0xBF58476D1CE4E5B9ULL;
  acc ^= acc >> 32;
  return acc;
}

std::string digest_hex(std::uint64_t digest) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(digest));
  return buf;
}

}  // namespace KokkosMoE
