#ifndef KOKKOSMOE_ROWKIT_HPP
#define KOKKOSMOE_ROWKIT_HPP

/// \file KokkosMoE_RowKit.hpp
/// \brief The one row kit: every whole-row move of the pipeline (pack,
/// repack, relay permutations, pooled-wave compaction, padded batches, the
/// return) is a gather or a scatter of rows between row containers, with the
/// conversion the two containers imply:
///
/// | source           | destination      | per row                          |
/// |------------------|------------------|----------------------------------|
/// | PayloadBuffer    | PayloadBuffer    | byte copy (same type and width)  |
/// | RowMatrix<T>     | PayloadBuffer    | encode (byte copy when T is the wire type) |
/// | PayloadBuffer    | RowMatrix<T>     | decode (byte copy when T is the wire type) |
/// | RowMatrix<T>     | RowMatrix<U>     | convert through float (byte copy when T == U) |
/// | View<R*>         | View<R*>         | record copy (metadata)           |
///
/// gather_rows: dst row p = src row index(p) for every dst row p.
/// scatter_rows: dst row index(p) = src row p for every src row p.
/// A negative index skips the row (MissingRow::skip, the default) or, for
/// gathers, writes a zero row (MissingRow::zero). index is any functor
/// usable in kernels (a lambda over a View, say). Plus contiguous row-range
/// copies and zero fills.
///
/// PayloadParts: up to four payload buffers of one type and width seen as
/// one row container whose row index names the part (part_row(part, row)),
/// so that one gather or scatter reads rows from (writes rows to) wherever
/// they already are instead of first copying them into one buffer.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <string.h>
#include <string>
#include <type_traits>

namespace KokkosMoE {

/// \brief What a gather writes for a row whose source index is negative.
enum class MissingRow { skip, zero };

/// \brief Row `row` of part `part` (0..3) of a PayloadParts.
KOKKOS_INLINE_FUNCTION index_t part_row(int part, index_t row) { return (static_cast<index_t>(part) << 40) | row; }
KOKKOS_INLINE_FUNCTION int row_part(index_t r) { return static_cast<int>(r >> 40); }
KOKKOS_INLINE_FUNCTION index_t part_local_row(index_t r) { return r & ((index_t(1) << 40) - 1); }

/// \brief Up to four payload buffers of one type and width as one row
/// container (see the file comment); an absent part has no rows.
template <class MS>
struct PayloadParts {
  PayloadBuffer<MS> part0, part1, part2, part3;
};

/// \brief A reusable PayloadBuffer of n rows from a workspace.
template <class Exec, class MS>
PayloadBuffer<MS> payload_buffer(Workspace<MS>& ws, Exec const& exec, std::string const& label, PayloadType type, int width,
                                 index_t n) {
  PayloadBuffer<MS> b;
  b.type = type;
  b.width = width;
  b.bytes = ws.template get<typename PayloadBuffer<MS>::bytes_view>(exec, label, n,
                                                                    static_cast<std::size_t>(payload_row_bytes(type, width)));
  return b;
}

namespace Impl {

/// Identity index (the gather or scatter side that is in order).
struct SameRow {
  KOKKOS_INLINE_FUNCTION index_t operator()(index_t p) const { return p; }
};

/// Row containers as the kit's kernels see them.
template <class MS>
struct PayloadRows {
  Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS> bytes;
  PayloadType type;
  int width;
  std::int64_t row_bytes;
  explicit PayloadRows(PayloadBuffer<MS> const& b) : bytes(b.bytes), type(b.type), width(b.width), row_bytes(b.row_bytes()) {
    // A row is its elements and, for fp8, its scales: a buffer of other rows
    // (scales missing or extra) is refused before any row moves.
    KOKKOSMOE_REQUIRE(b.rows() == 0 || static_cast<std::int64_t>(b.bytes.extent(1)) == row_bytes,
                      "payload rows of " << b.bytes.extent(1) << " bytes, but " << to_string(b.type) << " rows of width " << b.width
                                         << " are " << row_bytes << " bytes"
                                         << (b.type == PayloadType::fp8_row || b.type == PayloadType::fp8_block128
                                                 ? " (elements and their FP32 scales)"
                                                 : ""));
  }
  index_t rows() const { return static_cast<index_t>(bytes.extent(0)); }
};

template <class T, class MS>
struct TypedRows {
  RowMatrix<T, MS> m;
  explicit TypedRows(RowMatrix<T, MS> const& v) : m(v) {}
  index_t rows() const { return static_cast<index_t>(m.extent(0)); }
  int width() const { return static_cast<int>(m.extent(1)); }
};

template <class MS>
PayloadRows<MS> row_access(PayloadBuffer<MS> const& b) { return PayloadRows<MS>(b); }

/// Rows of several payload buffers; a row index is part_row(part, row).
template <class MS>
struct PartRows {
  PayloadRows<MS> part0, part1, part2, part3;
  index_t rows() const { return part0.rows(); }
  KOKKOS_INLINE_FUNCTION PayloadRows<MS> const& part(int p) const { return p == 0 ? part0 : p == 1 ? part1 : p == 2 ? part2 : part3; }
};
template <class MS>
PartRows<MS> row_access(PayloadParts<MS> const& p) {
  auto part = [&](PayloadBuffer<MS> b) {
    if (b.rows() == 0) {  // an absent part: no rows, the others' shape
      b.type = p.part0.type;
      b.width = p.part0.width;
      b.bytes = typename PayloadBuffer<MS>::bytes_view();
    }
    return PayloadRows<MS>(b);
  };
  return PartRows<MS>{PayloadRows<MS>(p.part0), part(p.part1), part(p.part2), part(p.part3)};
}
/// Any row-major [rows, width] view with contiguous rows.
template <class T, class... P>
auto row_access(Kokkos::View<T**, Kokkos::LayoutRight, P...> const& v) {
  using MS = typename Kokkos::View<T**, Kokkos::LayoutRight, P...>::memory_space;
  KOKKOSMOE_REQUIRE(v.extent(0) <= 1 || static_cast<std::size_t>(v.stride(0)) == v.extent(1),
                    "row kit: rows of a " << v.extent(0) << "x" << v.extent(1) << " view are not contiguous (stride "
                                          << v.stride(0) << ")");
  return TypedRows<T, MS>(RowMatrix<T, MS>(v.data(), v.extent(0), v.extent(1)));
}

// One row from s to q, team-cooperative (vector lanes over elements).
template <class Member, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, PayloadRows<MS> const& src, index_t s, PayloadRows<MS> const& dst,
                                     index_t q) {
  copy_row_bytes(team, &src.bytes(s, 0), &dst.bytes(q, 0), dst.row_bytes);
}

template <class Member, class T, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, TypedRows<T, MS> const& src, index_t s, PayloadRows<MS> const& dst,
                                     index_t q) {
  T const* in = &src.m(s, 0);
  unsigned char* out = &dst.bytes(q, 0);
  if (same_representation<std::remove_const_t<T>>(dst.type)) {
    copy_row_bytes(team, reinterpret_cast<unsigned char const*>(in), out, dst.row_bytes);
  } else if (dst.type == PayloadType::bf16) {
    convert_row(team, in, reinterpret_cast<bf16_t*>(out), dst.width);
  } else if (dst.type == PayloadType::fp32) {
    convert_row(team, in, reinterpret_cast<float*>(out), dst.width);
  } else {
    encode_row(team, dst.type, dst.width, [&](int j) { return to_float(in[j]); }, out);
  }
}

template <class Member, class T, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, PayloadRows<MS> const& src, index_t s, TypedRows<T, MS> const& dst,
                                     index_t q) {
  unsigned char const* in = &src.bytes(s, 0);
  T* out = &dst.m(q, 0);
  if (same_representation<std::remove_const_t<T>>(src.type)) {
    copy_row_bytes(team, in, reinterpret_cast<unsigned char*>(out), src.row_bytes);
  } else if (src.type == PayloadType::bf16) {
    convert_row(team, reinterpret_cast<bf16_t const*>(in), out, src.width);
  } else if (src.type == PayloadType::fp32) {
    convert_row(team, reinterpret_cast<float const*>(in), out, src.width);
  } else {
    PayloadType const t = src.type;
    int const d = src.width;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](int j) { out[j] = from_float<T>(payload_load(t, in, d, j)); });
  }
}

template <class Member, class T, class U, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, TypedRows<T, MS> const& src, index_t s, TypedRows<U, MS> const& dst,
                                     index_t q) {
  T const* in = &src.m(s, 0);
  U* out = &dst.m(q, 0);
  int const d = static_cast<int>(dst.m.extent(1));
  if (std::is_same<std::remove_const_t<T>, U>::value) {
    copy_row_bytes(team, reinterpret_cast<unsigned char const*>(in), reinterpret_cast<unsigned char*>(out),
                   static_cast<std::int64_t>(d) * static_cast<std::int64_t>(sizeof(U)));
  } else {
    convert_row(team, in, out, d);
  }
}

// Rows of a PartRows: the part named by the index.
template <class Member, class MS, class Dst>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, PartRows<MS> const& src, index_t s, Dst const& dst, index_t q) {
  copy_row(team, src.part(row_part(s)), part_local_row(s), dst, q);
}

template <class Member, class T, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, TypedRows<T, MS> const& src, index_t s, PartRows<MS> const& dst, index_t q) {
  copy_row(team, src, s, dst.part(row_part(q)), part_local_row(q));
}

template <class Member, class MS>
KOKKOS_INLINE_FUNCTION void copy_row(Member const& team, PayloadRows<MS> const& src, index_t s, PartRows<MS> const& dst, index_t q) {
  copy_row(team, src, s, dst.part(row_part(q)), part_local_row(q));
}

template <class Member, class MS>
KOKKOS_INLINE_FUNCTION void zero_row(Member const& team, PayloadRows<MS> const& dst, index_t q) {
  unsigned char* out = &dst.bytes(q, 0);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(dst.row_bytes)), [&](int b) { out[b] = 0; });
}

template <class Member, class T, class MS>
KOKKOS_INLINE_FUNCTION void zero_row(Member const& team, TypedRows<T, MS> const& dst, index_t q) {
  T* out = &dst.m(q, 0);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(dst.m.extent(1))),
                       [&](int j) { out[j] = from_float<T>(0.0f); });
}

template <class Member, class MS>
KOKKOS_INLINE_FUNCTION void zero_row(Member const& team, PartRows<MS> const& dst, index_t q) {
  zero_row(team, dst.part(row_part(q)), part_local_row(q));
}

// Shape checks shared by gathers and scatters.
template <class MS>
void check_pair(PayloadRows<MS> const& s, PayloadRows<MS> const& d, char const* label) {
  KOKKOSMOE_REQUIRE(s.type == d.type && s.width == d.width, label << ": payload " << to_string(s.type) << "/" << s.width
                                                                  << " moved into " << to_string(d.type) << "/" << d.width);
}
template <class T, class MS>
void check_pair(TypedRows<T, MS> const& s, PayloadRows<MS> const& d, char const* label) {
  KOKKOSMOE_REQUIRE(s.width() == d.width, label << ": rows of width " << s.width() << " encoded into payload width " << d.width);
}
template <class T, class MS>
void check_pair(PayloadRows<MS> const& s, TypedRows<T, MS> const& d, char const* label) {
  KOKKOSMOE_REQUIRE(d.width() == s.width, label << ": payload width " << s.width << " decoded into rows of width " << d.width());
}
template <class MS, class Dst>
void check_pair(PartRows<MS> const& s, Dst const& d, char const* label) {
  check_pair(s.part0, d, label);
  check_pair(s.part1, d, label);
  check_pair(s.part2, d, label);
  check_pair(s.part3, d, label);
}
template <class T, class MS>
void check_pair(TypedRows<T, MS> const& s, PartRows<MS> const& d, char const* label) {
  check_pair(s, d.part0, label);
  check_pair(s, d.part1, label);
  check_pair(s, d.part2, label);
  check_pair(s, d.part3, label);
}
template <class MS>
void check_pair(PayloadRows<MS> const& s, PartRows<MS> const& d, char const* label) {
  check_pair(s, d.part0, label);
  check_pair(s, d.part1, label);
  check_pair(s, d.part2, label);
  check_pair(s, d.part3, label);
}
template <class T, class U, class MS>
void check_pair(TypedRows<T, MS> const& s, TypedRows<U, MS> const& d, char const* label) {
  KOKKOSMOE_REQUIRE(s.width() == d.width(), label << ": rows of width " << s.width() << " moved into rows of width " << d.width());
}

/// The kit's kernel: for p in [0, n), dst row dst_of(p) = src row src_of(p)
/// (negative destination: skipped; negative source: skipped or zeroed).
template <class Exec, class Src, class SrcOf, class Dst, class DstOf>
void move_rows(Exec const& exec, index_t n, Src const& src, SrcOf const& src_of, Dst const& dst, DstOf const& dst_of,
               MissingRow missing, char const* label) {
  if (n <= 0) return;
  check_pair(src, dst, label);
  bool const zero_missing = missing == MissingRow::zero;
  using member_t = typename Kokkos::TeamPolicy<Exec>::member_type;
  Kokkos::parallel_for(
      label, row_policy(exec, n), KOKKOS_LAMBDA(member_t const& team) {
        index_t const p = team.league_rank();
        index_t const q = dst_of(p);
        if (q < 0) return;
        index_t const s = src_of(p);
        if (s < 0) {
          if (zero_missing) zero_row(team, dst, q);
          return;
        }
        copy_row(team, src, s, dst, q);
      });
}

}  // namespace Impl

/// \brief dst row p = src row index(p) for every row p of dst (see the file
/// comment for the conversions). src and dst: PayloadBuffer or RowMatrix.
template <class Exec, class Src, class IndexF, class Dst>
void gather_rows(Exec const& exec, Src const& src, IndexF const& index, Dst const& dst, char const* label,
                 MissingRow missing = MissingRow::skip) {
  auto const d = Impl::row_access(dst);
  Impl::move_rows(exec, d.rows(), Impl::row_access(src), index, d, Impl::SameRow{}, missing, label);
}

/// \brief dst row index(p) = src row p for every row p of src; rows with a
/// negative index are skipped.
template <class Exec, class Src, class IndexF, class Dst>
void scatter_rows(Exec const& exec, Src const& src, IndexF const& index, Dst const& dst, char const* label) {
  auto const s = Impl::row_access(src);
  Impl::move_rows(exec, s.rows(), s, Impl::SameRow{}, Impl::row_access(dst), index, MissingRow::skip, label);
}

/// \brief dst(p) = src(index(p)) for every record p of dst (metadata records;
/// a negative index skips the record).
template <class Exec, class SrcView, class IndexF, class DstView>
void gather_records(Exec const& exec, SrcView const& src, IndexF const& index, DstView const& dst, char const* label) {
  static_assert(Compat::view_rank<SrcView> == 1 && Compat::view_rank<DstView> == 1, "gather_records: rank-1 views of records");
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(dst.extent(0))), KOKKOS_LAMBDA(index_t p) {
    index_t const s = index(p);
    if (s >= 0) dst(p) = src(s);
  });
}

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

/// \brief f(r, c) for every element (r, c) of `rows` rows of `width`
/// columns: a team per row with vector lanes over its columns (coalesced on
/// GPUs; a plain loop per row on hosts). For elementwise row kernels; each
/// element's result must not depend on the order of elements.
template <class Exec, class F>
void for_each_row_element(Exec const& exec, char const* label, index_t rows, int width, F const& f) {
  if (rows <= 0 || width <= 0) return;
  using member_t = typename Kokkos::TeamPolicy<Exec>::member_type;
  Kokkos::parallel_for(
      label, Impl::row_policy(exec, rows), KOKKOS_LAMBDA(member_t const& team) {
        index_t const r = team.league_rank();
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, width), [&](int c) { f(r, c); });
      });
}

/// \brief Reinterprets a view of trivially copyable records as [n, sizeof(R)] bytes.
template <class R, class MS>
Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS> as_rows(Kokkos::View<R*, MS> const& v) {
  return Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS>(reinterpret_cast<unsigned char*>(v.data()), v.extent(0), sizeof(R));
}

}  // namespace KokkosMoE

#endif
