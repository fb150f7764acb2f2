#ifndef KOKKOSMOE_PAYLOADBUFFER_HPP
#define KOKKOSMOE_PAYLOADBUFFER_HPP

/// \file KokkosMoE_PayloadBuffer.hpp
/// \brief Rows of a payload in their wire representation, the per-row
/// encode/decode/copy primitives, and the wire metadata record. Whole-buffer
/// row moves (gathers, scatters, range copies) are in KokkosMoE_RowKit.hpp.
///
/// A row is payload_row_bytes(type, width) contiguous bytes: width elements
/// (fp32, bf16 or fp8 e4m3), followed for fp8 by its FP32 scales (one per row
/// or one per 128 elements). Transports move whole rows, so scales always
/// travel with their row.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>

#include <string.h>
#include <string>
#include <type_traits>

namespace KokkosMoE {

/// \brief rows x row_bytes bytes (LayoutRight) holding rows of one PayloadType.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct PayloadBuffer {
  using memory_space = MemorySpace;
  using bytes_view = Kokkos::View<unsigned char**, Kokkos::LayoutRight, MemorySpace>;
  PayloadType type = PayloadType::fp32;
  int width = 0;
  bytes_view bytes;

  PayloadBuffer() = default;
  PayloadBuffer(std::string const& label, PayloadType t, int d, index_t rows)
      : type(t), width(d),
        bytes(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), rows,
              static_cast<std::size_t>(payload_row_bytes(t, d))) {}
  template <class Exec>
  PayloadBuffer(Exec const& exec, std::string const& label, PayloadType t, int d, index_t rows)
      : type(t), width(d),
        bytes(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, label), rows,
              static_cast<std::size_t>(payload_row_bytes(t, d))) {}

  index_t rows() const { return static_cast<index_t>(bytes.extent(0)); }
  std::int64_t row_bytes() const { return payload_row_bytes(type, width); }
  unsigned char* row_ptr(index_t r) const { return bytes.data() + r * row_bytes(); }
};

/// \brief Per-row metadata moved with dispatched rows (declared schema,
/// 16 bytes): the physical slot the row is for, its final destination rank,
/// its origin rank and its route at the origin (token * top_k + k_slot).
struct RowMeta {
  std::int32_t slot;
  std::int32_t dest_rank;
  std::int32_t origin_rank;
  std::int32_t route;
};
static_assert(sizeof(RowMeta) == 16, "RowMeta is a 16-byte wire record");

/// \brief The metadata schema as text (reports).
inline char const* row_meta_schema() {
  return "int32 slot, int32 dest_rank, int32 origin_rank, int32 route (= token * top_k + k_slot at origin)";
}

namespace Impl {

/// Element j of an encoded row as float.
KOKKOS_INLINE_FUNCTION float payload_load(PayloadType t, unsigned char const* row, int d, int j) {
  switch (t) {
    case PayloadType::fp32: {
      float v;
      memcpy(&v, row + 4 * j, 4);
      return v;
    }
    case PayloadType::bf16: {
      bf16_t v;
      memcpy(&v.bits, row + 2 * j, 2);
      return to_float(v);
    }
    default: {
      int const block = t == PayloadType::fp8_row ? 0 : j / fp8_block_size;
      float scale;
      memcpy(&scale, row + d + 4 * block, 4);
      return to_float(fp8_e4m3_t{row[j]}) * scale;
    }
  }
}

/// Reads element j of a typed source row.
template <class T>
KOKKOS_INLINE_FUNCTION float load_typed(T const* row, int j) {
  return to_float(row[j]);
}

/// Encodes one row (source values read through `src(j)` as float) into dst.
/// Team-cooperative: vector lanes over elements; for fp8 one scale per block.
template <class Member, class Src>
KOKKOS_INLINE_FUNCTION void encode_row(Member const& team, PayloadType t, int d, Src const& src, unsigned char* dst) {
  if (t == PayloadType::fp32) {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int j) {
      float const v = src(j);
      memcpy(dst + 4 * j, &v, 4);
    });
  } else if (t == PayloadType::bf16) {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int j) {
      bf16_t const v = to_bf16(src(j));
      memcpy(dst + 2 * j, &v.bits, 2);
    });
  } else {
    int const bs = t == PayloadType::fp8_row ? d : fp8_block_size;
    int const nb = t == PayloadType::fp8_row ? 1 : (d + fp8_block_size - 1) / fp8_block_size;
    for (int b = 0; b < nb; ++b) {
      int const lo = b * bs, hi = Compat::min(d, lo + bs);
      float amax = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, hi - lo),
          [&](int jj, float& m) {
            float const a = Compat::fabs(src(lo + jj));
            if (a > m && !Compat::isinf(a)) m = a;
          },
          Kokkos::Max<float>(amax));
      float const scale = fp8_scale_for(amax);
      float const inv = 1.0f / scale;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, hi - lo),
                           [&](int jj) { dst[lo + jj] = to_fp8_e4m3(src(lo + jj) * inv).bits; });
      Kokkos::single(Kokkos::PerThread(team), [&]() { memcpy(dst + d + 4 * b, &scale, 4); });
    }
  }
}

/// 16 bytes moved as one vector load/store on devices.
struct alignas(16) Bytes16 {
  std::uint64_t lo, hi;
};

KOKKOS_INLINE_FUNCTION bool aligned16(void const* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Eight consecutive elements of a float or bf16 row as floats (p 16-byte
/// aligned): one or two 16-byte loads.
KOKKOS_INLINE_FUNCTION void load8(float const* p, float* f) {
  Bytes16 const a = reinterpret_cast<Bytes16 const*>(p)[0], b = reinterpret_cast<Bytes16 const*>(p)[1];
  memcpy(f, &a, 16);
  memcpy(f + 4, &b, 16);
}
KOKKOS_INLINE_FUNCTION void load8(bf16_t const* p, float* f) {
  Bytes16 const a = *reinterpret_cast<Bytes16 const*>(p);
  std::uint64_t const w[2] = {a.lo, a.hi};
  for (int i = 0; i < 8; ++i)
    f[i] = bits_float(static_cast<std::uint32_t>((w[i / 4] >> (16 * (i % 4))) & 0xFFFFu) << 16);
}
/// Stores eight floats into a float or bf16 row (p 16-byte aligned; bf16
/// rounds to nearest even like from_float).
KOKKOS_INLINE_FUNCTION void store8(float* p, float const* f) {
  Bytes16 a, b;
  memcpy(&a, f, 16);
  memcpy(&b, f + 4, 16);
  reinterpret_cast<Bytes16*>(p)[0] = a;
  reinterpret_cast<Bytes16*>(p)[1] = b;
}
KOKKOS_INLINE_FUNCTION void store8(bf16_t* p, float const* f) {
  std::uint64_t w[2] = {0, 0};
  for (int i = 0; i < 8; ++i) w[i / 4] |= static_cast<std::uint64_t>(to_bf16(f[i]).bits) << (16 * (i % 4));
  *reinterpret_cast<Bytes16*>(p) = Bytes16{w[0], w[1]};
}

/// Byte copy of one row: memcpy on host backends; on devices vector lanes
/// over 16-byte words where both rows allow (8-byte words, then bytes, where
/// they do not).
template <class Member>
KOKKOS_INLINE_FUNCTION void copy_row_bytes(Member const& team, unsigned char const* src, unsigned char* dst,
                                           std::int64_t nbytes) {
#if !KOKKOSMOE_DEVICE_PASS
  // Host backends run one thread per team here: one memcpy per row.
  if (team.team_rank() == 0) memcpy(dst, src, static_cast<std::size_t>(nbytes));
#else
  if (nbytes % 16 == 0 && aligned16(src) && aligned16(dst)) {
    auto const* s = reinterpret_cast<Bytes16 const*>(src);
    auto* o = reinterpret_cast<Bytes16*>(dst);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(nbytes / 16)), [&](int w) { o[w] = s[w]; });
  } else if (nbytes % 8 == 0 && reinterpret_cast<std::uintptr_t>(src) % 8 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 8 == 0) {
    auto const* s = reinterpret_cast<std::uint64_t const*>(src);
    auto* o = reinterpret_cast<std::uint64_t*>(dst);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(nbytes / 8)), [&](int w) { o[w] = s[w]; });
  } else {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(nbytes)), [&](int b) { dst[b] = src[b]; });
  }
#endif
}

/// out[j] = in[j] converted (float <-> bf16, RNE) for j < d, team-cooperative:
/// on devices each vector lane moves eight elements with 16-byte accesses
/// where the rows allow; elementwise otherwise (same bits either way).
template <class Member, class S, class D>
KOKKOS_INLINE_FUNCTION void convert_row(Member const& team, S const* in, D* out, int d) {
#if KOKKOSMOE_DEVICE_PASS
  if (d % 8 == 0 && aligned16(in) && aligned16(out)) {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d / 8), [&](int v) {
      float f[8];
      load8(in + 8 * v, f);
      store8(out + 8 * v, f);
    });
    return;
  }
#endif
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int j) { out[j] = from_float<D>(to_float(in[j])); });
}

/// True when Exec runs on the host (vector lanes are then plain loops).
template <class Exec>
constexpr bool runs_on_host() {
  // Exec's kernels reach host memory: a host backend (with unified memory a
  // device's memory space is host-accessible, but its kernels still run there).
  return Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;
}

/// One team per row; vector lanes over the row's elements (32 on GPUs).
template <class Exec>
Kokkos::TeamPolicy<Exec> row_policy(Exec const& exec, index_t rows) {
  return Kokkos::TeamPolicy<Exec>(exec, rows, 1, runs_on_host<Exec>() ? 1 : 32);
}

template <class T>
KOKKOS_INLINE_FUNCTION constexpr bool same_representation(PayloadType t) {
  return (std::is_same<T, float>::value && t == PayloadType::fp32) ||
         (std::is_same<T, bf16_t>::value && t == PayloadType::bf16);
}

}  // namespace Impl

}  // namespace KokkosMoE

#endif
