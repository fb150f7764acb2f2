// bf16 and fp8 e4m3 conversions: every code, ties, NaN, Inf, subnormals,
// saturation; the same on host and inside a Kokkos kernel; payload bytes of
// the payload_precision fixture.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Payload.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace KokkosMoE;

namespace {
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

TEST_CASE("bf16: every non-NaN code round-trips exactly", "[payload][bf16]") {
  for (std::uint32_t c = 0; c < 0x10000u; ++c) {
    bf16_t const b{static_cast<std::uint16_t>(c)};
    float const f = to_float(b);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(to_float(to_bf16(f))));
    } else {
      REQUIRE(to_bf16(f).bits == b.bits);
    }
  }
}

TEST_CASE("bf16: round to nearest, ties to even", "[payload][bf16]") {
  // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd): goes to 1.
  CHECK(to_bf16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3F80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  CHECK(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3F82);
  // Just above a tie rounds up, just below rounds down.
  CHECK(to_bf16(from_bits(0x3F808001u)).bits == 0x3F81);
  CHECK(to_bf16(from_bits(0x3F807FFFu)).bits == 0x3F80);
  CHECK(to_bf16(-1.0f - std::ldexp(1.0f, -8)).bits == 0xBF80);
  CHECK(to_float(to_bf16(3.140625f)) == 3.140625f);
}

TEST_CASE("bf16: NaN, Inf, overflow and subnormals", "[payload][bf16]") {
  float const inf = std::numeric_limits<float>::infinity();
  CHECK(to_bf16(inf).bits == 0x7F80);
  CHECK(to_bf16(-inf).bits == 0xFF80);
  // NaNs whose payload sits only in the dropped bits stay NaN, never Inf.
  for (std::uint32_t u : {0x7F800001u, 0x7FC00000u, 0xFF800001u, 0x7FFFFFFFu}) {
    bf16_t const b = to_bf16(from_bits(u));
    CHECK(std::isnan(to_float(b)));
    CHECK((b.bits & 0x8000u) == ((u >> 16) & 0x8000u));
  }
  // FLT_MAX is beyond the largest bf16 and rounds to Inf.
  CHECK(to_bf16(std::numeric_limits<float>::max()).bits == 0x7F80);
  // Largest finite bf16 stays.
  CHECK(to_bf16(from_bits(0x7F7F0000u)).bits == 0x7F7F);
  // Subnormals: exact ones survive, ties go to even.
  CHECK(to_bf16(from_bits(0x00010000u)).bits == 0x0001);
  CHECK(to_bf16(from_bits(0x00008000u)).bits == 0x0000);
  CHECK(to_bf16(from_bits(0x00018000u)).bits == 0x0002);
  CHECK(to_bf16(-0.0f).bits == 0x8000);
}

TEST_CASE("fp8 e4m3: every code round-trips exactly", "[payload][fp8]") {
  for (unsigned c = 0; c < 256; ++c) {
    fp8_e4m3_t const q{static_cast<std::uint8_t>(c)};
    float const f = to_float(q);
    if ((c & 0x7Fu) == 0x7Fu) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::isnan(to_float(to_fp8_e4m3(f))));
    } else {
      REQUIRE(to_fp8_e4m3(f).bits == q.bits);
    }
  }
  CHECK(to_float(fp8_e4m3_t{0x7E}) == 448.0f);
  CHECK(to_float(fp8_e4m3_t{0x08}) == std::ldexp(1.0f, -6));
  CHECK(to_float(fp8_e4m3_t{0x01}) == std::ldexp(1.0f, -9));
  CHECK(to_float(fp8_e4m3_t{0x38}) == 1.0f);
}

TEST_CASE("fp8 e4m3: ties to even, saturation, NaN, subnormals", "[payload][fp8]") {
  float const inf = std::numeric_limits<float>::infinity();
  CHECK(to_fp8_e4m3(1.0625f).bits == 0x38);   // between 1 (even) and 1.125
  CHECK(to_fp8_e4m3(1.1875f).bits == 0x3A);   // between 1.125 (odd) and 1.25
  CHECK(to_fp8_e4m3(1.07f).bits == 0x39);
  CHECK(to_fp8_e4m3(15.5f).bits == 0x58);     // tie between 15 (odd) and 16: carries into the exponent
  CHECK(to_fp8_e4m3(440.0f).bits == 0x7E);    // between 416 and 448 (even)
  CHECK(to_fp8_e4m3(448.0f).bits == 0x7E);
  CHECK(to_fp8_e4m3(464.0f).bits == 0x7E);    // saturates, never NaN
  CHECK(to_fp8_e4m3(1e30f).bits == 0x7E);
  CHECK(to_fp8_e4m3(-1e30f).bits == 0xFE);
  CHECK(to_fp8_e4m3(inf).bits == 0x7E);
  CHECK(to_fp8_e4m3(-inf).bits == 0xFE);
  CHECK(std::isnan(to_float(to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(to_fp8_e4m3(-std::numeric_limits<float>::quiet_NaN()).bits == 0xFF);
  float const sub = std::ldexp(1.0f, -9);
  CHECK(to_fp8_e4m3(sub).bits == 0x01);
  CHECK(to_fp8_e4m3(0.5f * sub).bits == 0x00);       // tie -> even (0)
  CHECK(to_fp8_e4m3(1.5f * sub).bits == 0x02);       // tie -> even (2)
  CHECK(to_fp8_e4m3(2.5f * sub).bits == 0x02);       // tie -> even (2)
  CHECK(to_fp8_e4m3(7.5f * sub).bits == 0x08);       // rounds up into the smallest normal
  CHECK(to_fp8_e4m3(-3.0f * sub).bits == 0x83);
  CHECK(to_fp8_e4m3(1e-30f).bits == 0x00);
  CHECK(to_fp8_e4m3(-0.0f).bits == 0x80);
}

TEST_CASE("fp8 scale: amax maps to 448 and dequantizes within a half ulp", "[payload][fp8]") {
  std::vector<float> row = {0.1f, -2.5f, 7.0f, 0.003f, -0.75f};
  float amax = 0;
  for (float x : row) amax = std::max(amax, std::fabs(x));
  float const scale = fp8_scale_for(amax);
  CHECK(scale == amax / 448.0f);
  CHECK(to_fp8_e4m3(7.0f / scale).bits == 0x7E);
  for (float x : row) {
    float const back = to_float(to_fp8_e4m3(x / scale)) * scale;
    // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormals.
    CHECK(std::fabs(back - x) <= std::max(std::fabs(x) * 0.0625f, scale * std::ldexp(1.0f, -10)));
  }
  CHECK(fp8_scale_for(0.0f) == 1.0f);
  CHECK(fp8_scale_for(std::numeric_limits<float>::infinity()) == 1.0f);
}

TEST_CASE("payload conversions agree inside a Kokkos kernel", "[payload][kokkos]") {
  int const n = 1 << 16;
  Kokkos::View<float*> in("in", n);
  Kokkos::View<std::uint16_t*> b16("b16", n);
  Kokkos::View<std::uint8_t*> f8("f8", n);
  auto h_in = Kokkos::create_mirror_view(in);
  for (int i = 0; i < n; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(i) * 2654435761u;
    h_in(i) = from_bits(u);  // every exponent, NaNs and Infs included
  }
  Kokkos::deep_copy(in, h_in);
  Kokkos::parallel_for(
      "test::convert", n, KOKKOS_LAMBDA(int i) {
        b16(i) = to_bf16(in(i)).bits;
        f8(i) = to_fp8_e4m3(in(i)).bits;
      });
  auto h16 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b16);
  auto h8 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), f8);
  int mismatches = 0;
  for (int i = 0; i < n; ++i) {
    if (h16(i) != to_bf16(h_in(i)).bits) ++mismatches;
    if (h8(i) != to_fp8_e4m3(h_in(i)).bits) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("payload bytes match the payload_precision fixture", "[payload][fixture]") {
  auto const fx = kmoe_test::fixture("payload_precision.json");
  int const rows = 6;
  for (auto const& c : fx.at("cases")) {
    std::int64_t const d = c.at("d").get<std::int64_t>();
    CHECK(rows * payload_row_bytes(PayloadType::bf16, d) == c.at("bf16").get<std::int64_t>());
    CHECK(rows * payload_row_bytes(PayloadType::fp8_row, d) == c.at("fp8_row_scale").get<std::int64_t>());
    CHECK(rows * payload_row_bytes(PayloadType::fp8_block128, d) == c.at("fp8_block128_scale").get<std::int64_t>());
  }
  CHECK(payload_row_bytes(PayloadType::fp32, 3) == 12);
  CHECK(from_string<PayloadType>("fp8_block128") == PayloadType::fp8_block128);
  CHECK_THROWS_AS(from_string<PayloadType>("fp16"), KokkosMoE::Error);
}
