#ifndef KOKKOSMOE_PAYLOADBUFFER_HPP
#define KOKKOSMOE_PAYLOADBUFFER_HPP

/// \file KokkosMoE_PayloadBuffer.hpp
/// \brief Rows of a payload in their wire representation, and the kernels
/// that gather/encode rows into it and decode/scatter rows out of it.
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

/// Byte copy of one row: memcpy on host backends, vector lanes over 8-byte
/// words (where aligned) on devices.
template <class Member>
KOKKOS_INLINE_FUNCTION void copy_row_bytes(Member const& team, unsigned char const* src, unsigned char* dst,
                                           std::int64_t nbytes) {
#if !KOKKOSMOE_DEVICE_PASS
  // Host backends run one thread per team here: one memcpy per row.
  if (team.team_rank() == 0) memcpy(dst, src, static_cast<std::size_t>(nbytes));
#else
  if (nbytes % 8 == 0 && reinterpret_cast<std::uintptr_t>(src) % 8 == 0 && reinterpret_cast<std::uintptr_t>(dst) % 8 == 0) {
    auto const* s = reinterpret_cast<std::uint64_t const*>(src);
    auto* o = reinterpret_cast<std::uint64_t*>(dst);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(nbytes / 8)), [&](int w) { o[w] = s[w]; });
  } else {
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(nbytes)), [&](int b) { dst[b] = src[b]; });
  }
#endif
}

/// True when Exec runs on the host (vector lanes are then plain loops).
template <class Exec>
constexpr bool runs_on_host() {
  return Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible;
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

/// \brief Copies count consecutive rows of a [rows, bytes] LayoutRight view
/// into another (same row width), on exec: one memcpy on host backends, an
/// asynchronous contiguous deep_copy elsewhere.
template <class Exec, class DstView, class SrcView>
void copy_row_range(Exec const& exec, DstView const& dst, index_t dst_first, SrcView const& src, index_t src_first,
                    index_t count) {
  if (count <= 0) return;
  KOKKOSMOE_REQUIRE(dst.extent(1) == src.extent(1) && dst_first + count <= static_cast<index_t>(dst.extent(0)) &&
                        src_first + count <= static_cast<index_t>(src.extent(0)),
                    "copy_row_range: " << count << " rows of " << src.extent(1) << " from [" << src_first << ") of "
                                       << src.extent(0) << " into [" << dst_first << ") of " << dst.extent(0) << " x "
                                       << dst.extent(1));
  std::size_t const row = dst.extent(1) * sizeof(typename DstView::value_type);
  if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename DstView::memory_space>::accessible &&
                Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename SrcView::memory_space>::accessible) {
    Compat::fence(exec, "KokkosMoE::copy_row_range");
    memcpy(dst.data() + dst_first * static_cast<index_t>(dst.extent(1)), src.data() + src_first * static_cast<index_t>(src.extent(1)),
           static_cast<std::size_t>(count) * row);
  } else {
    using range = std::pair<index_t, index_t>;
    Kokkos::deep_copy(exec, Kokkos::subview(dst, range(dst_first, dst_first + count), Kokkos::ALL),
                      Kokkos::subview(src, range(src_first, src_first + count), Kokkos::ALL));
  }
}

/// \brief Sets every byte of a contiguous view to zero on exec (memset on host
/// backends, a fill elsewhere).
template <class Exec, class View>
void zero_fill(Exec const& exec, View const& v) {
  if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible) {
    Compat::fence(exec, "KokkosMoE::zero_fill");
    if (v.span() > 0) memset(v.data(), 0, v.span() * sizeof(typename View::value_type));
  } else {
    Kokkos::deep_copy(exec, v, typename View::non_const_value_type{});
  }
}

/// \brief dst row p = encode(src row index(p)) for p in [0, dst.rows()), on exec.
/// src is a typed [n, d] matrix (float or bf16_t); index(p) returns the source
/// row (a functor usable in kernels). Rows whose source index is negative are
/// left untouched.
template <class Exec, class T, class SrcMS, class DstMS, class IndexF>
void gather_encode(Exec const& exec, RowMatrix<T, SrcMS> const& src, IndexF const& index, PayloadBuffer<DstMS> const& dst,
                   char const* label) {
  KOKKOSMOE_REQUIRE(static_cast<int>(src.extent(1)) == dst.width,
                    label << ": source rows have width " << src.extent(1) << ", payload width " << dst.width);
  index_t const rows = dst.rows();
  if (rows == 0) return;
  int const d = dst.width;
  PayloadType const t = dst.type;
  auto bytes = dst.bytes;
  std::int64_t const rb = dst.row_bytes();
  bool const same = Impl::same_representation<T>(t);
  using policy_t = Kokkos::TeamPolicy<Exec>;
  Kokkos::parallel_for(
      label, Impl::row_policy(exec, rows), KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
        index_t const p = team.league_rank();
        index_t const s = index(p);
        if (s < 0) return;
        unsigned char* out = &bytes(p, 0);
        T const* in = &src(s, 0);
        if (same) {
          Impl::copy_row_bytes(team, reinterpret_cast<unsigned char const*>(in), out, rb);
        } else {
          Impl::encode_row(team, t, d, [&](int j) { return to_float(in[j]); }, out);
        }
      });
}

/// \brief dst row index(p) = decode(src row p) for p in [0, src.rows()).
/// Rows whose destination index is negative are skipped.
template <class Exec, class SrcMS, class T, class DstMS, class IndexF>
void decode_scatter(Exec const& exec, PayloadBuffer<SrcMS> const& src, IndexF const& index, RowMatrix<T, DstMS> const& dst,
                    char const* label) {
  KOKKOSMOE_REQUIRE(static_cast<int>(dst.extent(1)) == src.width,
                    label << ": destination rows have width " << dst.extent(1) << ", payload width " << src.width);
  index_t const rows = src.rows();
  if (rows == 0) return;
  int const d = src.width;
  PayloadType const t = src.type;
  auto bytes = src.bytes;
  std::int64_t const rb = src.row_bytes();
  bool const same = Impl::same_representation<T>(t);
  using policy_t = Kokkos::TeamPolicy<Exec>;
  Kokkos::parallel_for(
      label, Impl::row_policy(exec, rows), KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
        index_t const p = team.league_rank();
        index_t const q = index(p);
        if (q < 0) return;
        unsigned char const* in = &bytes(p, 0);
        T* out = &dst(q, 0);
        if (same) {
          Impl::copy_row_bytes(team, in, reinterpret_cast<unsigned char*>(out), rb);
        } else {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d),
                               [&](int j) { out[j] = from_float<T>(Impl::payload_load(t, in, d, j)); });
        }
      });
}

/// \brief dst row p = src row index(p) for payload buffers of the same type
/// and width (a permutation of wire rows; scales move with their rows).
template <class Exec, class MS, class IndexF>
void gather_rows(Exec const& exec, PayloadBuffer<MS> const& src, IndexF const& index, PayloadBuffer<MS> const& dst,
                 char const* label) {
  KOKKOSMOE_REQUIRE(src.type == dst.type && src.width == dst.width,
                    label << ": payload " << to_string(src.type) << "/" << src.width << " gathered into "
                          << to_string(dst.type) << "/" << dst.width);
  index_t const rows = dst.rows();
  if (rows == 0) return;
  auto in = src.bytes;
  auto out = dst.bytes;
  std::int64_t const rb = dst.row_bytes();
  using policy_t = Kokkos::TeamPolicy<Exec>;
  Kokkos::parallel_for(
      label, Impl::row_policy(exec, rows), KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
        index_t const p = team.league_rank();
        index_t const s = index(p);
        if (s < 0) return;
        Impl::copy_row_bytes(team, &in(s, 0), &out(p, 0), rb);
      });
}

}  // namespace KokkosMoE

#endif
