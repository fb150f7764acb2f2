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
///   that reads the weight rows in place (FP32; bf16 rows are converted into
///   an FP32 panel first) and keeps the
///   [nrw][R] result in registers over the whole reduction. SiLU and the
///   product are applied to the micro-kernel's result (phase 1 pairs gate and
///   up rows of the same columns in one call). Only the last, partial step of
///   a tensor copies its rows into scratch, so nothing past a tensor is read.
/// - PortableGroupedPhase (any execution space; the GPU mapping): MT x NT
///   output tiles, KT-deep panels of the row tile and of the weight rows
///   staged in team scratch as FP32 (padded against bank conflicts), every
///   team thread accumulating an RM x RN register tile over the whole
///   reduction.

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

/// Vendor grouped GEMM for weights WT, rows XT in, YT out on Exec: the
/// primary template is "not available" (the portable and host kernels run);
/// tpls/ specializes it where a vendor library applies (see
/// tpls/KokkosMoE_Experts_Grouped_cuBLAS.hpp).
template <class Exec, class WT, class XT, class YT, class Enable = void>
struct GroupedVendor {
  static constexpr bool available = false;
  static constexpr char const* name = "none";
};

/// \brief One row-major product of a grouped GEMM call:
/// C = op(A) op(B) + beta C with C [M, N] (row stride ldc), op(A) [M, K] and
/// op(B) [K, N]; A and B are stored row-major with row strides lda and ldb
/// (A is [M, K] for ta 'N', [K, M] for 'T'; B likewise).
struct RowProduct {
  char ta = 'N', tb = 'N';
  int M = 0, N = 0, K = 0;
  void const* A = nullptr;
  int lda = 0;
  void const* B = nullptr;
  int ldb = 0;
  void* C = nullptr;
  int ldc = 0;
  float beta = 0.0f;
};

/// \brief The same product for a column-major BLAS (cuBLAS): a row-major
/// [r, c] matrix with row stride ld is the column-major [c, r] matrix with
/// leading dimension ld, so row-major C = op(A) op(B) is column-major
/// C^T = op(B)^T op(A)^T: first operand B with B's op, second A with A's,
/// m = N, n = M.
struct ColumnProblem {
  char opa = 'N', opb = 'N';
  int m = 0, n = 0, k = 0;
  void const* a = nullptr;
  int lda = 0;
  void const* b = nullptr;
  int ldb = 0;
  void* c = nullptr;
  int ldc = 0;
  float beta = 0.0f;
};
inline ColumnProblem column_major(RowProduct const& p) {
  ColumnProblem c;
  c.opa = p.tb;
  c.opb = p.ta;
  c.m = p.N;
  c.n = p.M;
  c.k = p.K;
  c.a = p.B;
  c.lda = p.ldb;
  c.b = p.A;
  c.ldb = p.lda;
  c.c = p.C;
  c.ldc = p.ldc;
  c.beta = p.beta;
  return c;
}

/// \brief Whether an operand at address p suits vendor grouped and batched
/// GEMMs, which read the operand pointers from device memory and so cannot
/// see their alignment: 16 bytes, the alignment cuBLAS documents as the one
/// its fast (tensor-core) kernels may assume for every such pointer (with a
/// weaker rule for some inner dimensions, not relied on here). Row offsets
/// into a matrix whose rows are not a multiple of 16 bytes (bf16 rows of 20
/// elements) break it.
inline bool grouped_operand_aligned(std::uintptr_t p) { return p % 16 == 0; }

/// \brief A grouped GEMM in one vendor call over a list of products of
/// element type T (FP32 accumulation, C in T): tpls/ specializes it where a
/// vendor library has one (cublasGemmGroupedBatchedEx on CUDA).
template <class Exec, class T, class Enable = void>
struct GroupedGemmVendor {
  static constexpr bool available = false;
};

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
  using in_value = typename In::non_const_value_type;
  static constexpr bool bf16_weights = std::is_same<weight_value, bf16_t>::value;
  /// bf16 rows times bf16 weights (phase 1 of a bf16 layer, and phase 2
  /// when the intermediate rows are bf16): the pair dot-product kernels
  /// where the table has them.
  static constexpr bool dp_types = bf16_weights && std::is_same<in_value, bf16_t>::value;
  bool use_dp() const { return dp_types && table.dp[1] != nullptr; }

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
  int decode_rows = 0;  // tiles of at most this many rows take the decode kernel (same bits)

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
  std::size_t tail_bytes() const {
    return round_up(static_cast<std::size_t>(K) * Compat::max(nrw_max(), table.vector_length) * sizeof(float));
  }
  std::size_t acc_bytes() const {
    return round_up(static_cast<std::size_t>(nrw_max()) * table.max_vectors * table.vector_length * sizeof(float));
  }
  /// Bytes of team scratch (level 1) per team.
  std::size_t scratch_bytes() const { return align + xt_bytes() + tail_bytes() + acc_bytes(); }
  /// Output columns per micro-kernel call for mv row vectors.
  int cols_per_step(int mv) const { return Phase == 1 ? table.nrw[mv] / 2 : table.nrw[mv]; }

  void decode_tile(member_type const& team, Tile const& t, int g) const;

  void operator()(member_type const& team) const {
    int const item = team.league_rank();
    Tile const t = tiles(item / groups);
    int const g = item % groups;
    int const rows = static_cast<int>(t.rows);
    if (rows <= decode_rows) {
      decode_tile(team, t, g);
      return;
    }
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

    std::size_t const q = static_cast<std::size_t>(t.slot);
    long const ldw = K;
    if constexpr (dp_types) {
      if (use_dp()) {
        dp_tile(t, mv, c_begin, c_end, xt, tail, acc);
        return;
      }
    }
    // Row tile, transposed: xt[k * R + i], zero for i >= rows.
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        auto const* src = &in(t.row0 + i, 0);
        for (int k = 0; k < K; ++k) xt[static_cast<std::size_t>(k) * R + i] = to_float(src[k]);
      } else {
        for (int k = 0; k < K; ++k) xt[static_cast<std::size_t>(k) * R + i] = 0.0f;
      }
    }
    for (int c0 = c_begin; c0 < c_end; c0 += P) {
      int const nc = Compat::min(P, c_end - c0);
      bool in_place = false;
      if constexpr (!bf16_weights) {
        if (c0 + P <= N) {
          // FP32 weight rows read in place: phase 1 pairs gate/up rows c0..,
          // phase 2 takes nrw consecutive down rows.
          float const* a = &w0(q, c0, 0);
          float const* b = Phase == 1 ? &w1(q, c0, 0) : a + static_cast<std::size_t>(h) * K;
          table.f32[mv](K, xt, a, b, ldw, acc);
          in_place = true;
        }
      }
      if (!in_place) {
        // bf16 weight rows, converted once per step into an FP32 panel (a
        // vectorized copy, cheap next to the mv vector FMAs every element
        // then meets), and the last columns of the tensor: the valid rows
        // copied (the last one repeated) so that no row beyond it is read.
        for (int j = 0; j < nrw; ++j) {
          int const jj = Phase == 1 ? (j < h ? j : j - h) : j;
          int const col = c0 + Compat::min(jj, nc - 1);
          auto const* src = (Phase == 1 && j >= h) ? &w1(q, col, 0) : &w0(q, col, 0);
          float* dst = tail + static_cast<std::size_t>(j) * K;
          for (int k = 0; k < K; ++k) dst[k] = to_float(src[k]);
        }
        table.f32[mv](K, xt, tail, tail + static_cast<std::size_t>(h) * K, ldw, acc);
      }
      store(t, c0, nc, R, P, acc);
    }
  }

  /// Rows of the tile from the micro-kernel's acc (phase 1: SiLU(gate) * up).
  void store(Tile const& t, int c0, int nc, int R, int P, float const* acc) const {
    for (int i = 0; i < static_cast<int>(t.rows); ++i) {
      auto* dst = &out(t.row0 + i, c0);
      if (Phase == 1) {
        for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(silu(acc[j * R + i]) * acc[(P + j) * R + i]);
      } else {
        for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(acc[j * R + i]);
      }
    }
  }

  /// bf16 rows and weights with the pair dot-product kernel: the row tile as
  /// pairs xt2[p * R + i] (zero beyond the tile's rows), the weight rows read
  /// in place as bf16 (phase 1: gate/up rows c0..; phase 2: nrw consecutive
  /// down rows), the tensor's last columns copied as bf16, the last one
  /// repeated.
  void dp_tile(Tile const& t, int mv, int c_begin, int c_end, float* xt, float* tail, float* acc) const {
    int const rows = static_cast<int>(t.rows);
    int const R = mv * table.vector_length;
    int const nrw = table.nrw[mv], h = nrw / 2, P = cols_per_step(mv);
    int const Kp = (K + 1) / 2;
    auto* const xt2 = reinterpret_cast<std::uint32_t*>(xt);
    for (int i = 0; i < R; ++i) {
      std::uint16_t const* src = i < rows ? host_weight_ptr(&in(t.row0 + i, 0)) : nullptr;
      for (int p = 0; p < Kp; ++p) {
        std::uint32_t v = 0;
        if (src) v = 2 * p + 1 < K ? (std::uint32_t(src[2 * p + 1]) << 16 | src[2 * p]) : std::uint32_t(src[2 * p]);
        xt2[static_cast<std::size_t>(p) * R + i] = v;
      }
    }
    std::size_t const q = static_cast<std::size_t>(t.slot);
    auto* const panel = reinterpret_cast<std::uint16_t*>(tail);
    for (int c0 = c_begin; c0 < c_end; c0 += P) {
      int const nc = Compat::min(P, c_end - c0);
      if (c0 + P <= N) {
        std::uint16_t const* a = host_weight_ptr(&w0(q, c0, 0));
        std::uint16_t const* b = Phase == 1 ? host_weight_ptr(&w1(q, c0, 0)) : a + static_cast<std::size_t>(h) * K;
        table.dp[mv](K, xt2, a, b, K, acc);
      } else {
        for (int j = 0; j < nrw; ++j) {
          int const jj = Phase == 1 ? (j < h ? j : j - h) : j;
          int const col = c0 + Compat::min(jj, nc - 1);
          std::uint16_t const* src = host_weight_ptr((Phase == 1 && j >= h) ? &w1(q, col, 0) : &w0(q, col, 0));
          for (int k = 0; k < K; ++k) panel[static_cast<std::size_t>(j) * K + k] = src[k];
        }
        table.dp[mv](K, xt2, panel, panel + static_cast<std::size_t>(h) * K, K, acc);
      }
      store(t, c0, nc, R, P, acc);
    }
  }
};

/// The decode mapping of HostGroupedPhase for a tile of few rows: the
/// columns of the group's range in steps of vector_length weight rows, each
/// block of weights read once along k by the decode kernel, for all the
/// tile's rows at a time (see HostDecodeKernelF32).
template <class ExecutionSpace, class In, class W, class Out, int Phase>
void host_decode_tile(HostGroupedPhase<ExecutionSpace, In, W, Out, Phase> const& p,
                      typename HostGroupedPhase<ExecutionSpace, In, W, Out, Phase>::member_type const& team, Tile const& t,
                      int g) {
  using phase_t = HostGroupedPhase<ExecutionSpace, In, W, Out, Phase>;
  using out_value = typename phase_t::out_value;
  int const rows = static_cast<int>(t.rows);
  int const VL = p.table.vector_length;
  int const K = p.K, N = p.N;
  int const steps = (N + VL - 1) / VL;
  int const per_group = (steps + p.groups - 1) / p.groups;
  int const c_begin = Compat::min(N, g * per_group * VL);
  int const c_end = Compat::min(N, (g + 1) * per_group * VL);
  if (c_begin >= c_end) return;
  auto raw = reinterpret_cast<std::uintptr_t>(team.team_scratch(1).get_shmem(p.scratch_bytes()));
  float* const xs = reinterpret_cast<float*>((raw + phase_t::align - 1) / phase_t::align * phase_t::align);
  float* const tail = xs + p.xt_bytes() / sizeof(float);
  float* const acc = tail + p.tail_bytes() / sizeof(float);
  std::size_t const q = static_cast<std::size_t>(t.slot);
  long const ld = K;
  // The block of VL weight rows read after (gate or up, c0), prefetched
  // meanwhile (phase 1 alternates gate and up rows); null after the
  // group's last whole block.
  auto next_of = [&](bool up, int c0) -> typename phase_t::weight_value const* {
    if (Phase == 1 && !up) return &p.w1(q, c0, 0);
    int const c1 = c0 + VL;
    return c1 + VL <= c_end ? &p.w0(q, c1, 0) : nullptr;
  };
  if constexpr (phase_t::dp_types) {
    if (p.use_dp()) {
      // The tile's bf16 rows as pairs xt2[p * rows + i] (an odd K's last
      // element paired with 0), or for the skewed form as
      // xs2[p * rows + i] = pair p | pair (p - skew) << 32; bf16 weights as
      // pairs in place (the last columns copied).
      int const Kp = (K + 1) / 2;
      bool const skewed = host_decode_skewed(p.table, rows, K);
      auto pair = [&](std::uint16_t const* src, int pp) -> std::uint32_t {
        if (pp < 0 || pp >= Kp) return 0;
        return 2 * pp + 1 < K ? (std::uint32_t(src[2 * pp + 1]) << 16 | src[2 * pp]) : std::uint32_t(src[2 * pp]);
      };
      auto* const xt2 = reinterpret_cast<std::uint32_t*>(xs);
      auto* const xs2 = reinterpret_cast<std::uint64_t*>(xs);
      for (int i = 0; i < rows; ++i) {
        std::uint16_t const* src = host_weight_ptr(&p.in(t.row0 + i, 0));
        if (skewed) {
          for (int pp = 0; pp < Kp + host_decode_skew; ++pp)
            xs2[static_cast<std::size_t>(pp) * rows + i] =
                std::uint64_t(pair(src, pp)) | std::uint64_t(pair(src, pp - host_decode_skew)) << 32;
        } else {
          for (int pp = 0; pp < Kp; ++pp) xt2[static_cast<std::size_t>(pp) * rows + i] = pair(src, pp);
        }
      }
      auto* const panel = reinterpret_cast<std::uint16_t*>(tail);
      float* const a = acc;
      float* const b = acc + static_cast<std::size_t>(rows) * VL;
      // Weight rows [c0, c0 + nc) of w into o (in place, or the valid ones
      // copied with the last one repeated).
      auto block = [&](W const& w, int c0, int nc, float* o, std::uint16_t const* next) {
        std::uint16_t const* src = host_weight_ptr(&w(q, c0, 0));
        if (nc < VL) {
          for (int j = 0; j < VL; ++j) {
            std::uint16_t const* row = host_weight_ptr(&w(q, c0 + Compat::min(j, nc - 1), 0));
            for (int k = 0; k < K; ++k) panel[static_cast<std::size_t>(j) * K + k] = row[k];
          }
          src = panel;
          next = nullptr;
        }
        if (skewed)
          p.table.decode_dp_skewed[rows](K, xs2, src, ld, o, next);
        else
          p.table.decode_dp[rows](K, xt2, src, ld, o, next);
      };
      for (int c0 = c_begin; c0 < c_end; c0 += VL) {
        int const nc = Compat::min(VL, c_end - c0);
        block(p.w0, c0, nc, a, host_weight_ptr(next_of(false, c0)));
        if (Phase == 1) block(p.w1, c0, nc, b, host_weight_ptr(next_of(true, c0)));
        for (int i = 0; i < rows; ++i) {
          auto* dst = &p.out(t.row0 + i, c0);
          if (Phase == 1) {
            for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(silu(a[i * VL + j]) * b[i * VL + j]);
          } else {
            for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(a[i * VL + j]);
          }
        }
      }
      return;
    }
  }
  // The tile's rows as FP32, [rows][K].
  for (int i = 0; i < rows; ++i) {
    auto const* src = &p.in(t.row0 + i, 0);
    for (int k = 0; k < K; ++k) xs[static_cast<std::size_t>(i) * K + k] = to_float(src[k]);
  }
  // Weight rows [c0, c0 + VL) of w (in place, or the valid ones copied as
  // FP32 with the last one repeated) through the decode kernel into out.
  auto block = [&](typename phase_t::weight_value const* w, int nc, float* out,
                   typename phase_t::weight_value const* next) {
    if (nc == VL) {
      if constexpr (phase_t::bf16_weights)
        p.table.decode_bf16[rows](K, xs, ld, host_weight_ptr(w), ld, out, host_weight_ptr(next));
      else
        p.table.decode_f32[rows](K, xs, ld, host_weight_ptr(w), ld, out, next);
      return;
    }
    for (int j = 0; j < VL; ++j) {
      auto const* src = w + static_cast<std::size_t>(Compat::min(j, nc - 1)) * K;
      float* dst = tail + static_cast<std::size_t>(j) * K;
      for (int k = 0; k < K; ++k) dst[k] = to_float(src[k]);
    }
    p.table.decode_f32[rows](K, xs, ld, tail, ld, out, nullptr);
  };
  float* const a = acc;
  float* const b = acc + static_cast<std::size_t>(rows) * VL;
  for (int c0 = c_begin; c0 < c_end; c0 += VL) {
    int const nc = Compat::min(VL, c_end - c0);  // < VL only for the tensor's last columns
    block(&p.w0(q, c0, 0), nc, a, next_of(false, c0));
    if (Phase == 1) block(&p.w1(q, c0, 0), nc, b, next_of(true, c0));
    for (int i = 0; i < rows; ++i) {
      auto* dst = &p.out(t.row0 + i, c0);
      if (Phase == 1) {
        for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(silu(a[i * VL + j]) * b[i * VL + j]);
      } else {
        for (int j = 0; j < nc; ++j) dst[j] = from_float<out_value>(a[i * VL + j]);
      }
    }
  }
}

template <class ExecutionSpace, class In, class W, class Out, int Phase>
void HostGroupedPhase<ExecutionSpace, In, W, Out, Phase>::decode_tile(member_type const& team, Tile const& t, int g) const {
  host_decode_tile(*this, team, t, g);
}

/// Portable phase functor (the GPU mapping); see the file comment.
///
/// A team owns an MT x NT output tile of one segment and walks the reduction
/// in KT-deep panels staged in team scratch as FP32 (rows and weights may be
/// float or bf16; both panels padded by one column against bank conflicts).
/// The team's TR x TC threads each own an RM x RN register tile (per weight
/// set) held across all panels: rows ty + TR * i, columns tx + TC * j, so
/// neighbouring threads read neighbouring scratch words and write
/// neighbouring output columns. On host spaces the team is one thread that
/// owns the whole tile (TR = TC = 1).
template <class ExecutionSpace, class In, class W, class Out, class TileView, int Phase>
struct PortableGroupedPhase {
  static constexpr bool host = is_host_exec<ExecutionSpace>();
  static constexpr int MT = 64;             // rows per tile
  static constexpr int NT = 64;             // output columns per tile
  static constexpr int KT = 32;             // reduction depth per staged panel
  static constexpr int TR = host ? 1 : 16;  // thread rows of the team
  static constexpr int TC = host ? 1 : 16;  // thread columns of the team
  static constexpr int TS = TR * TC;        // team size
  static constexpr int RM = MT / TR;        // register tile rows
  static constexpr int RN = NT / TC;        // register tile columns
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
    return scratch_view::shmem_size(KT, MT + 1) + scratch_view::shmem_size(NW * KT, NT + 1);
  }
  static constexpr int team_size() { return TS; }

  KOKKOS_INLINE_FUNCTION void operator()(member_type const& team) const {
    int const item = team.league_rank();
    Tile const t = tiles(item / col_tiles);
    int const c0 = (item % col_tiles) * NT;
    int const rows = static_cast<int>(t.rows);
    int const nc = Compat::min(NT, N - c0);
    index_t const q = t.slot, r0 = t.row0;
    scratch_view xs(team.team_scratch(0), KT, MT + 1);
    scratch_view ws(team.team_scratch(0), NW * KT, NT + 1);
    int const tid = team.team_rank();
    int const ty = tid / TC, tx = tid - ty * TC;
    float acc[NW][RM][RN];
    for (int w = 0; w < NW; ++w)
      for (int i = 0; i < RM; ++i)
        for (int j = 0; j < RN; ++j) acc[w][i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += KT) {
      int const kk = Compat::min(KT, K - k0);
      team.team_barrier();
      // Consecutive threads take consecutive k of one row (coalesced reads).
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, MT * KT), [&](int idx) {
        int const i = idx / KT, p = idx - i * KT;
        xs(p, i) = (i < rows && p < kk) ? to_float(in(r0 + i, k0 + p)) : 0.0f;
      });
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, NW * NT * KT), [&](int idx) {
        int const wc = idx / KT, p = idx - wc * KT;
        int const w = wc / NT, c = wc - w * NT;
        float v = 0.0f;
        if (c < nc && p < kk) v = to_float(w == 0 ? w0(q, c0 + c, k0 + p) : w1(q, c0 + c, k0 + p));
        ws(w * KT + p, c) = v;
      });
      team.team_barrier();
      for (int p = 0; p < kk; ++p) {
        float a[RM], b[NW][RN];
        for (int i = 0; i < RM; ++i) a[i] = xs(p, ty + TR * i);
        for (int w = 0; w < NW; ++w)
          for (int j = 0; j < RN; ++j) b[w][j] = ws(w * KT + p, tx + TC * j);
        for (int w = 0; w < NW; ++w)
          for (int i = 0; i < RM; ++i)
            for (int j = 0; j < RN; ++j) acc[w][i][j] += a[i] * b[w][j];
      }
    }
    for (int i = 0; i < RM; ++i) {
      int const r = ty + TR * i;
      if (r >= rows) break;
      for (int j = 0; j < RN; ++j) {
        int const c = tx + TC * j;
        if (c >= nc) break;
        float const v = Phase == 1 ? silu(acc[0][i][j]) * acc[NW - 1][i][j] : acc[0][i][j];
        out(r0 + r, c0 + c) = from_float<out_value>(v);
      }
    }
  }
};

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
