#ifndef KOKKOSMOE_EXPERTS_GROUPED_HPP
#define KOKKOSMOE_EXPERTS_GROUPED_HPP

/// \file impl/KokkosMoE_Experts_Grouped.hpp
/// \brief The grouped SwiGLU kernel: one TeamPolicy launch per GEMM phase over
/// all (segment, row tile, column range) work items.
///
/// Phase 1: H[r, j] = SiLU(X[r,:] . Wg[q, j, :]) * (X[r,:] . Wu[q, j, :])
/// Phase 2: Y[r, c] = H[r,:] . Wd[q, c, :]
/// for rows r of segment q. Both phases are "NT" products (both operands
/// contiguous along the reduction) and share one functor per mapping:
///
/// - HostGroupedPhase (host execution spaces, team size 1): the team stages
///   its row tile (up to 64 rows with AVX-512) transposed in team scratch
///   ([K][R], FP32, zero beyond the tile), then walks its column range in
///   steps of nrw weight rows, each one call of the register-blocked
///   micro-kernel of the CPU's ISA (impl/KokkosMoE_Experts_HostKernels.hpp)
///   that reads the weight rows in place (float or bf16) and keeps the
///   [nrw][R] result in registers over the whole reduction. SiLU and the
///   product are applied to the micro-kernel's result (phase 1 pairs gate and
///   up rows of the same columns in one call). Only the last, partial step of
///   a tensor copies its rows into scratch, so nothing past a tensor is read.
/// - PortableGroupedPhase (any execution space; the GPU mapping): MT x NT
///   output tiles, KT-deep panels of the row tile and of the weight rows
///   staged in team scratch (padded against bank conflicts), team threads
///   over RM-row strips, vector lanes over columns, FP32 accumulation in
///   scratch between panels.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <impl/KokkosMoE_Experts_HostKernels.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

/// True for execution spaces that run on the host (Serial, OpenMP, Threads).
template <class ExecutionSpace>
constexpr bool is_host_exec() {
  return Kokkos::SpaceAccessibility<ExecutionSpace, Kokkos::HostSpace>::accessible;
}

KOKKOS_INLINE_FUNCTION float silu(float g) { return g / (1.0f + Compat::exp(-g)); }

/// A work tile: rows [row0, row0 + rows) of local slot `slot`.
struct Tile {
  index_t slot, row0, rows;
};

/// Splits every segment [offs[q], offs[q+1]) into tiles of at most
/// tile_rows rows (full tiles first). Empty segments produce no tile.
inline std::vector<Tile> make_tiles(std::vector<index_t> const& offs, index_t tile_rows) {
  std::vector<Tile> tiles;
  for (std::size_t q = 0; q + 1 < offs.size(); ++q)
    for (index_t r = offs[q]; r < offs[q + 1]; r += tile_rows)
      tiles.push_back(Tile{static_cast<index_t>(q), r, Compat::min(tile_rows, offs[q + 1] - r)});
  return tiles;
}

/// Weight pointer types of the host micro-kernels.
inline float const* host_weight_ptr(float const* p) { return p; }
inline std::uint16_t const* host_weight_ptr(bf16_t const* p) { return reinterpret_cast<std::uint16_t const*>(p); }

/// Host phase functor; see the file comment. W is the weight tensor view
/// type ([L, N, K] row-major), In the row source ([rows, K]), Out the result.
template <class ExecutionSpace, class In, class W, class Out, int Phase>
struct HostGroupedPhase {
  using policy_type = Kokkos::TeamPolicy<ExecutionSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_type = typename policy_type::member_type;
  using out_value = typename Out::non_const_value_type;
  using weight_value = typename W::non_const_value_type;
  static constexpr bool bf16_weights = std::is_same<weight_value, bf16_t>::value;

  // User-provided: see ExpertWeights() on GCC 12 and View members.
  HostGroupedPhase() {}

  In in;
  W w0, w1;  // phase 1: gate, up; phase 2: down (w1 unused)
  Out out;
  Kokkos::View<Tile*, Kokkos::HostSpace> tiles;
  HostKernelTable table;
  int K = 0;       // reduction length (d, or d_ff)
  int N = 0;       // output columns (d_ff, or d)
  int groups = 1;  // column ranges per tile

  static constexpr std::size_t align = 64;
  static std::size_t round_up(std::size_t n) { return (n + align - 1) / align * align; }
  int nrw_max() const {
    int m = 0;
    for (int v = 1; v <= table.max_vectors; ++v) m = Compat::max(m, table.nrw[v]);
    return m;
  }
  std::size_t xt_bytes() const {
    return round_up(static_cast<std::size_t>(K) * table.max_vectors * table.vector_length * sizeof(float));
  }
  std::size_t tail_bytes() const { return round_up(static_cast<std::size_t>(K) * nrw_max() * sizeof(float)); }
  std::size_t acc_bytes() const {
    return round_up(static_cast<std::size_t>(nrw_max()) * table.max_vectors * table.vector_length * sizeof(float));
  }
  /// Bytes of team scratch (level 1) per team.
  std::size_t scratch_bytes() const { return align + xt_bytes() + tail_bytes() + acc_bytes(); }
  /// Output columns per micro-kernel call for mv row vectors.
  int cols_per_step(int mv) const { return Phase == 1 ? table.nrw[mv] / 2 : table.nrw[mv]; }

  void operator()(member_type const& team) const {
    int const item = team.league_rank();
    Tile const t = tiles(item / groups);
    int const g = item % groups;
    int const rows = static_cast<int>(t.rows);
    int const VL = table.vector_length;
    int const mv = (rows + VL - 1) / VL;
    int const R = mv * VL;
    int const nrw = table.nrw[mv];
    int const h = nrw / 2;
    int const P = cols_per_step(mv);
    // Column range of this group, in whole steps of P columns.
    int const steps = (N + P - 1) / P;
    int const per_group = (steps + groups - 1) / groups;
    int const c_begin = Compat::min(N, g * per_group * P);
    int const c_end = Compat::min(N, (g + 1) * per_group * P);
    if (c_begin >= c_end) return;

    auto raw = reinterpret_cast<std::uintptr_t>(team.team_scratch(1).get_shmem(scratch_bytes()));
    float* const xt = reinterpret_cast<float*>((raw + align - 1) / align * align);
    float* const tail = xt + xt_bytes() / sizeof(float);
    float* const acc = tail + tail_bytes() / sizeof(float);

    // Row tile, transposed: xt[k * R + i], zero for i >= rows.
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        auto const* src = &in(t.row0 + i, 0);
        for (int k = 0; k < K; ++k) xt[static_cast<std::size_t>(k) * R + i] = to_float(src[k]);
      } else {
        for (int k = 0; k < K; ++k) xt[static_cast<std::size_t>(k) * R + i] = 0.0f;
      }
    }
    std::size_t const q = static_cast<std::size_t>(t.slot);
    long const ldw = K;
    for (int c0 = c_begin; c0 < c_end; c0 += P) {
      int const nc = Compat::min(P, c_end - c0);
      if (c0 + P <= N) {
        // Weight rows read in place: phase 1 pairs gate/up rows c0.., phase 2
        // takes nrw consecutive down rows.
        auto const* a = &w0(q, c0, 0);
        auto const* b = Phase == 1 ? &w1(q, c0, 0) : a + static_cast<std::size_t>(h) * K;
        if constexpr (bf16_weights)
          table.bf16[mv](K, xt, host_weight_ptr(a), host_weight_ptr(b), ldw, acc);
        else
          table.f32[mv](K, xt, host_weight_ptr(a), host_weight_ptr(b), ldw, acc);
      } else {
        // Last columns of the tensor: copy the valid rows (FP32, the last one
        // repeated) so that no row beyond the tensor is read.
        for (int j = 0; j < nrw; ++j) {
          int const jj = Phase == 1 ? (j < h ? j : j - h) : j;
          int const col = c0 + Compat::min(jj, nc - 1);
          auto const* src = (Phase == 1 && j >= h) ? &w1(q, col, 0) : &w0(q, col, 0);
          float* dst = tail + static_cast<std::size_t>(j) * K;
          for (int k = 0; k < K; ++k) dst[k] = to_float(src[k]);
        }
        table.f32[mv](K, xt, tail, tail + static_cast<std::size_t>(h) * K, ldw, acc);
      }
      for (int i = 0; i < rows; ++i) {
        auto* dst = &out(t.row0 + i, c0);
        if (Phase == 1) {
          for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(silu(acc[j * R + i]) * acc[(P + j) * R + i]);
        } else {
          for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(acc[j * R + i]);
        }
      }
    }
  }
};

/// Portable phase functor (the GPU mapping); see the file comment.
template <class ExecutionSpace, class In, class W, class Out, class TileView, int Phase>
struct PortableGroupedPhase {
  static constexpr int MT = 32;       // rows per tile
  static constexpr int NT = 32;       // output columns per tile (vector lanes)
  static constexpr int KT = 32;       // reduction depth per staged panel
  static constexpr int RM = 4;        // rows per team thread
  static constexpr int TT = MT / RM;  // team threads
  static constexpr int NW = Phase == 1 ? 2 : 1;

  using policy_type = Kokkos::TeamPolicy<ExecutionSpace>;
  using member_type = typename policy_type::member_type;
  using out_value = typename Out::non_const_value_type;
  using scratch_view = Kokkos::View<float**, Kokkos::LayoutRight, typename ExecutionSpace::scratch_memory_space,
                                    Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  // User-provided: see ExpertWeights() on GCC 12 and View members.
  KOKKOS_FUNCTION PortableGroupedPhase() {}

  In in;
  W w0, w1;
  Out out;
  TileView tiles;  // [num_tiles] of Tile
  int K = 0, N = 0, col_tiles = 1;

  static std::size_t scratch_bytes() {
    return scratch_view::shmem_size(KT, MT + 1) + scratch_view::shmem_size(NW * KT, NT + 1) +
           scratch_view::shmem_size(NW * MT, NT);
  }

  KOKKOS_INLINE_FUNCTION void operator()(member_type const& team) const {
    int const item = team.league_rank();
    Tile const t = tiles(item / col_tiles);
    int const c0 = (item % col_tiles) * NT;
    int const rows = static_cast<int>(t.rows);
    int const nc = Compat::min(NT, N - c0);
    index_t const q = t.slot, r0 = t.row0;
    scratch_view xs(team.team_scratch(0), KT, MT + 1);
    scratch_view ws(team.team_scratch(0), NW * KT, NT + 1);
    scratch_view cs(team.team_scratch(0), NW * MT, NT);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, NW * MT), [&](int i) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, NT), [&](int c) { cs(i, c) = 0.0f; });
    });
    for (int k0 = 0; k0 < K; k0 += KT) {
      int const kk = Compat::min(KT, K - k0);
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, MT), [&](int i) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, KT), [&](int p) {
          xs(p, i) = (i < rows && p < kk) ? to_float(in(r0 + i, k0 + p)) : 0.0f;
        });
      });
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, NW * NT), [&](int wc) {
        int const w = wc / NT, c = wc - w * NT;
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, KT), [&](int p) {
          float v = 0.0f;
          if (c < nc && p < kk) v = to_float(w == 0 ? w0(q, c0 + c, k0 + p) : w1(q, c0 + c, k0 + p));
          ws(w * KT + p, c) = v;
        });
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TT), [&](int tt) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, NT), [&](int c) {
          float a[NW][RM];
          for (int w = 0; w < NW; ++w)
            for (int r = 0; r < RM; ++r) a[w][r] = cs(w * MT + tt * RM + r, c);
          for (int p = 0; p < KT; ++p) {
            float b[NW];
            for (int w = 0; w < NW; ++w) b[w] = ws(w * KT + p, c);
            for (int r = 0; r < RM; ++r) {
              float const x = xs(p, tt * RM + r);
              for (int w = 0; w < NW; ++w) a[w][r] += x * b[w];
            }
          }
          for (int w = 0; w < NW; ++w)
            for (int r = 0; r < RM; ++r) cs(w * MT + tt * RM + r, c) = a[w][r];
        });
      });
    }
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int i) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nc), [&](int c) {
        float const v = Phase == 1 ? silu(cs(i, c)) * cs(MT + i, c) : cs(i, c);
        out(r0 + i, c0 + c) = from_float<out_value>(v);
      });
    });
  }
};

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
