#ifndef KOKKOSMOE_EXPERTS_HOSTGEMM_HPP
#define KOKKOSMOE_EXPERTS_HOSTGEMM_HPP

/// \file impl/KokkosMoE_Experts_HostGemm.hpp
/// \brief FP32 GEMMs of any transposition (NN, NT, TN) on host execution
/// spaces with the grouped runner's register-blocked micro-kernels
/// (impl/KokkosMoE_Experts_HostKernels.hpp), for the experts' backward.
///
/// Every product is brought into the micro-kernels' form
///
///     C(j, r) (+)= sum_k B_j[k] S(k, r)
///
/// where the rows B_j are read in place (contiguous along k) and S is staged,
/// R columns at a time, as a [kc][R] tile in team scratch (FP32, zero beyond
/// its columns). The reduction runs in blocks of at most host_gemm_kc steps
/// (a staged tile stays in L2); later blocks add to C. Per C = op(A) op(B):
///
/// - NN: B_j = row i of A (j = i), S(k, r) = B[k][r]: tiles are contiguous
///   runs of B's rows, results contiguous runs of C's rows.
/// - NT: B_j = row i of A, S(k, r) = B[r][k] (the tile staged transposed).
/// - TN: A copied transposed first (a blocked transpose into the caller's
///   scratch: both operands run along the rows of their matrices, and one
///   must run along k in place), then as NN.
///
/// Each result element adds its products in increasing k, one block after
/// the other, whatever the matrices' other extents and however the work is
/// split between threads: a row's bits do not depend on how many rows share
/// the call.
///
/// Grouped: run_host_products takes a list of products (the experts'
/// segments of one GEMM phase) and runs them in one launch; the staged
/// operand may be bf16 (expert weights), converted to FP32 as it is staged.
///
/// bf16 products: when the in-place rows B_j are bf16, the product runs on
/// the AVX512-BF16 pair kernels (HostKernelTable::dp, FP32 accumulation):
/// S is staged as bf16 pairs (S(k, r), S(k + 1, r)), FP32 values rounded to
/// the nearest even bf16 as they are staged, and every result adds its
/// pairs in increasing k, block after block (host_gemm_kc is even, so pairs
/// never straddle blocks). A row's bits again do not depend on the call.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <impl/KokkosMoE_Experts_HostKernels.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

/// \brief Reduction steps per staged tile.
constexpr int host_gemm_kc = 2048;
static_assert(host_gemm_kc % 2 == 0, "bf16 products stage whole pairs per block");

/// The bits of v rounded to bf16 (to nearest even), as the pair kernels read them.
inline std::uint32_t bf16_bits(float v) { return to_bf16(v).bits; }
inline std::uint32_t bf16_bits(bf16_t v) { return v.bits; }

/// \brief One product in the micro-kernels' form (see the file comment);
/// the staged operand S holds SV (float, or bf16_t converted as staged),
/// the rows read in place BV (float; bf16_t for the pair kernels).
template <class SV, class BV = float>
struct HostProductOf {
  int J = 0, N = 0, K = 0;       ///< rows read in place, staged columns, reduction length
  BV const* b = nullptr;         ///< row j at b + j * ldb, contiguous along k
  long ldb = 0;
  SV const* s = nullptr;         ///< S(k, r) = s[k * sk + r * sr]
  long sk = 0, sr = 0;
  float* c = nullptr;            ///< C(j, r) = c[j * cj + r * cr]
  long cj = 0, cr = 0;
  bool accumulate = false;       ///< add to C (else overwrite it)
};
using HostProduct = HostProductOf<float>;

/// A work item of a launch: product, tile of staged columns, range of rows.
struct HostProductItem {
  int product, tile, group, groups;
};

/// Team functor of a list of products: one work item per (product, tile of
/// R staged columns, range of in-place rows); team size 1.
template <class ExecutionSpace, class SV, class BV = float>
struct HostProductTeams {
  using policy_type = Kokkos::TeamPolicy<ExecutionSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_type = typename policy_type::member_type;
  using product_type = HostProductOf<SV, BV>;
  static constexpr bool pairs = std::is_same<BV, bf16_t>::value;  // the pair dot-product kernels

  Kokkos::View<product_type*, Kokkos::HostSpace> products;
  Kokkos::View<HostProductItem*, Kokkos::HostSpace> items;
  HostKernelTable table;
  int kc_max = 1;  // longest reduction block of any product

  static constexpr std::size_t align = 64;
  static std::size_t round_up(std::size_t n) { return (n + align - 1) / align * align; }
  int R() const { return table.max_vectors * table.vector_length; }
  int nrw_max() const {
    int m = 0;
    for (int v = 1; v <= table.max_vectors; ++v) m = std::max(m, table.nrw[v]);
    return m;
  }
  std::size_t xt_floats() const { return round_up(static_cast<std::size_t>(kc_max) * R() * sizeof(float)) / sizeof(float); }
  std::size_t tail_floats() const { return round_up(static_cast<std::size_t>(kc_max) * nrw_max() * sizeof(float)) / sizeof(float); }
  std::size_t acc_floats() const { return round_up(static_cast<std::size_t>(nrw_max()) * R() * sizeof(float)) / sizeof(float); }
  std::size_t scratch_bytes() const { return align + (xt_floats() + tail_floats() + acc_floats()) * sizeof(float); }

  void operator()(member_type const& team) const {
    HostProductItem const it = items(team.league_rank());
    product_type const& p = products(it.product);
    int const VL = table.vector_length;
    int const r0 = it.tile * R();
    int const cols = std::min(R(), p.N - r0);
    int const mv = (cols + VL - 1) / VL, Rt = mv * VL;
    int const nrw = table.nrw[mv], h = nrw / 2;
    // In-place rows of this group, in whole steps of nrw rows.
    int const steps = (p.J + nrw - 1) / nrw;
    int const per = (steps + it.groups - 1) / it.groups;
    int const j_begin = std::min(p.J, it.group * per * nrw), j_end = std::min(p.J, (it.group + 1) * per * nrw);
    if (j_begin >= j_end) return;
    auto raw = reinterpret_cast<std::uintptr_t>(team.team_scratch(1).get_shmem(scratch_bytes()));
    float* const xt = reinterpret_cast<float*>((raw + align - 1) / align * align);
    float* const tail = xt + xt_floats();
    float* const acc = tail + tail_floats();
    for (int k0 = 0; k0 < p.K; k0 += host_gemm_kc) {
      int const kc = std::min(host_gemm_kc, p.K - k0);
      if constexpr (pairs)
        stage_pairs(p, k0, kc, r0, cols, Rt, reinterpret_cast<std::uint32_t*>(xt));
      else
        stage(p, k0, kc, r0, cols, Rt, xt);
      bool const add = p.accumulate || k0 > 0;
      for (int j0 = j_begin; j0 < j_end; j0 += nrw) {
        int const nj = std::min(nrw, j_end - j0);
        BV const* w = p.b + static_cast<long>(j0) * p.ldb + k0;
        long ldw = p.ldb;
        if (nj < nrw) {
          // The last rows: copied (the last one repeated) so that nothing
          // past the matrix is read.
          auto* const t = reinterpret_cast<BV*>(tail);
          for (int j = 0; j < nrw; ++j)
            std::memcpy(t + static_cast<std::size_t>(j) * kc, p.b + static_cast<long>(j0 + std::min(j, nj - 1)) * p.ldb + k0,
                        static_cast<std::size_t>(kc) * sizeof(BV));
          w = t;
          ldw = kc;
        }
        if constexpr (pairs) {
          auto const* w16 = reinterpret_cast<std::uint16_t const*>(w);
          table.dp[mv](kc, reinterpret_cast<std::uint32_t const*>(xt), w16, w16 + static_cast<long>(h) * ldw, ldw, acc);
        } else {
          table.f32[mv](kc, xt, w, w + static_cast<long>(h) * ldw, ldw, acc);
        }
        store(p, j0, nj, r0, cols, Rt, acc, add);
      }
    }
  }

  /// xt2[pp * Rt + r] = the bf16 pair (S(k0 + 2 pp, r0 + r), S(k0 + 2 pp + 1,
  /// r0 + r)) for pp < ceil(kc / 2) (low half first; an odd kc's last pair
  /// has a zero high half), zero for r >= cols.
  static void stage_pairs(product_type const& p, int k0, int kc, int r0, int cols, int Rt, std::uint32_t* xt2) {
    int const kp = (kc + 1) / 2;
    if (p.sr == 1) {
      for (int pp = 0; pp < kp; ++pp) {
        std::uint32_t* dst = xt2 + static_cast<std::size_t>(pp) * Rt;
        SV const* lo = p.s + static_cast<long>(k0 + 2 * pp) * p.sk + r0;
        if (2 * pp + 1 < kc) {
          SV const* hi = lo + p.sk;
          for (int r = 0; r < cols; ++r) dst[r] = bf16_bits(lo[r]) | bf16_bits(hi[r]) << 16;
        } else {
          for (int r = 0; r < cols; ++r) dst[r] = bf16_bits(lo[r]);
        }
        for (int r = cols; r < Rt; ++r) dst[r] = 0;
      }
      return;
    }
    for (int r = 0; r < Rt; ++r) {
      if (r < cols) {
        SV const* src = p.s + static_cast<long>(r0 + r) * p.sr + static_cast<long>(k0) * p.sk;
        for (int pp = 0; pp < kp; ++pp) {
          std::uint32_t v = bf16_bits(src[static_cast<long>(2 * pp) * p.sk]);
          if (2 * pp + 1 < kc) v |= bf16_bits(src[static_cast<long>(2 * pp + 1) * p.sk]) << 16;
          xt2[static_cast<std::size_t>(pp) * Rt + r] = v;
        }
      } else {
        for (int pp = 0; pp < kp; ++pp) xt2[static_cast<std::size_t>(pp) * Rt + r] = 0;
      }
    }
  }

  /// xt[k * Rt + r] = S(k0 + k, r0 + r) as FP32, zero for r >= cols.
  static void stage(product_type const& p, int k0, int kc, int r0, int cols, int Rt, float* xt) {
    if (p.sr == 1) {
      for (int k = 0; k < kc; ++k) {
        float* dst = xt + static_cast<std::size_t>(k) * Rt;
        SV const* src = p.s + static_cast<long>(k0 + k) * p.sk + r0;
        if constexpr (std::is_same<SV, float>::value)
          std::memcpy(dst, src, static_cast<std::size_t>(cols) * sizeof(float));
        else
          for (int r = 0; r < cols; ++r) dst[r] = to_float(src[r]);
        for (int r = cols; r < Rt; ++r) dst[r] = 0.0f;
      }
      return;
    }
    for (int r = 0; r < Rt; ++r) {
      if (r < cols) {
        SV const* src = p.s + static_cast<long>(r0 + r) * p.sr + static_cast<long>(k0) * p.sk;
        for (int k = 0; k < kc; ++k) xt[static_cast<std::size_t>(k) * Rt + r] = to_float(src[static_cast<long>(k) * p.sk]);
      } else {
        for (int k = 0; k < kc; ++k) xt[static_cast<std::size_t>(k) * Rt + r] = 0.0f;
      }
    }
  }

  static void store(product_type const& p, int j0, int nj, int r0, int cols, int Rt, float const* acc, bool add) {
    for (int j = 0; j < nj; ++j) {
      float* dst = p.c + static_cast<long>(j0 + j) * p.cj + static_cast<long>(r0) * p.cr;
      float const* a = acc + static_cast<std::size_t>(j) * Rt;
      if (add)
        for (int r = 0; r < cols; ++r) dst[r * p.cr] += a[r];
      else
        for (int r = 0; r < cols; ++r) dst[r * p.cr] = a[r];
    }
  }
};

/// \brief Runs a list of products (disjoint outputs) in one launch on exec
/// (a host execution space); returns the number of launches (0 or 1).
/// bf16 rows (BV = bf16_t) need the table's pair kernels (Error otherwise).
template <class ExecutionSpace, class SV, class BV>
int run_host_products(ExecutionSpace const& exec, HostKernelTable const& table, std::vector<HostProductOf<SV, BV>> const& list) {
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, Kokkos::HostSpace>::accessible,
                "host products run on host execution spaces");
  using F = HostProductTeams<ExecutionSpace, SV, BV>;
  KOKKOSMOE_REQUIRE(!F::pairs || table.dp[1] != nullptr,
                    "host products: bf16 rows need the bf16 pair dot-product kernels, which the '" << table.isa
                                                                                                  << "' kernels of this CPU lack");
  F f;
  f.table = table;
  std::vector<HostProductItem> items;
  std::vector<HostProductOf<SV, BV>> work;
  int const threads = std::max(1, static_cast<int>(exec.concurrency()));
  for (auto const& p : list) {
    if (p.J == 0 || p.N == 0) continue;
    if (p.K == 0) {
      // An empty reduction: C = 0 (or unchanged).
      if (!p.accumulate)
        for (int j = 0; j < p.J; ++j)
          for (int r = 0; r < p.N; ++r) p.c[static_cast<long>(j) * p.cj + static_cast<long>(r) * p.cr] = 0.0f;
      continue;
    }
    int const tiles = (p.N + f.R() - 1) / f.R();
    // Enough items for every thread (a few each), in whole steps of rows.
    int const steps = (p.J + f.nrw_max() - 1) / f.nrw_max();
    int const groups = std::max(1, std::min(steps, (4 * threads + tiles - 1) / tiles));
    for (int t = 0; t < tiles; ++t)
      for (int g = 0; g < groups; ++g) items.push_back({static_cast<int>(work.size()), t, g, groups});
    f.kc_max = std::max(f.kc_max, std::min(p.K, host_gemm_kc));
    work.push_back(p);
  }
  if (items.empty()) return 0;
  // The kernel reads the lists where they are (fenced below): no Kokkos
  // allocation per launch.
  f.products = Kokkos::View<HostProductOf<SV, BV>*, Kokkos::HostSpace>(work.data(), work.size());
  f.items = Kokkos::View<HostProductItem*, Kokkos::HostSpace>(items.data(), items.size());
  typename F::policy_type policy(exec, static_cast<int>(items.size()), 1);
  Kokkos::parallel_for("KokkosMoE::Experts::host_gemm", policy.set_scratch_size(1, Kokkos::PerTeam(f.scratch_bytes())), f);
  Compat::fence(exec, "KokkosMoE::Experts::host_gemm: lists");
  return 1;
}

/// \brief Runs one product on exec (a host execution space).
template <class ExecutionSpace, class SV, class BV>
void run_host_product(ExecutionSpace const& exec, HostKernelTable const& table, HostProductOf<SV, BV> const& p) {
  run_host_products(exec, table, std::vector<HostProductOf<SV, BV>>{p});
}

/// \brief Blocks of at[i][k] = a[k][i] (a [K][M] with row stride lda, at
/// [M][K]): a list transposed in one launch; T float or bf16_t.
template <class T>
struct HostTransposeOf {
  int K = 0, M = 0;
  T const* a = nullptr;
  long lda = 0;
  T* at = nullptr;
};
using HostTranspose = HostTransposeOf<float>;

/// \brief Transposes every matrix of the list in one launch (blocks of 64 x
/// 64 bf16 or 32 x 32 FP32, 8 KiB or 4 KiB).
template <class ExecutionSpace, class T>
void host_transposes(ExecutionSpace const& exec, std::vector<HostTransposeOf<T>> const& list) {
  constexpr int B = sizeof(T) == 2 ? 64 : 32;
  struct Block {
    int m, i0, k0;
  };
  std::vector<Block> blocks;
  for (std::size_t m = 0; m < list.size(); ++m)
    for (int k0 = 0; k0 < list[m].K; k0 += B)
      for (int i0 = 0; i0 < list[m].M; i0 += B) blocks.push_back({static_cast<int>(m), i0, k0});
  if (blocks.empty()) return;
  // The kernel reads the lists where they are (fenced below).
  Kokkos::View<HostTransposeOf<T> const*, Kokkos::HostSpace> l(list.data(), list.size());
  Kokkos::View<Block const*, Kokkos::HostSpace> bl(blocks.data(), blocks.size());
  Kokkos::parallel_for(
      "KokkosMoE::Experts::host_transpose", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, static_cast<int>(blocks.size())), [=](int b) {
        Block const blk = bl(b);
        HostTransposeOf<T> const t = l(blk.m);  // a copy: the stores below cannot alias it
        int const ni = std::min(t.M, blk.i0 + B) - blk.i0, nk = std::min(t.K, blk.k0 + B) - blk.k0;
        // Through a block in L1: the source's rows read once, contiguously
        // (rows lda apart often share a few L1 sets, so reading the block
        // column by column would reload them), the destination's rows
        // written contiguously.
        T tile[B][B];
        for (int k = 0; k < nk; ++k) {
          T const* src = t.a + static_cast<long>(blk.k0 + k) * t.lda + blk.i0;
          for (int i = 0; i < ni; ++i) tile[i][k] = src[i];
        }
        for (int i = 0; i < ni; ++i) {
          T* dst = t.at + static_cast<long>(blk.i0 + i) * t.K + blk.k0;
          for (int k = 0; k < nk; ++k) dst[k] = tile[i][k];
        }
      });
  Compat::fence(exec, "KokkosMoE::Experts::host_transpose: lists");
}

/// \brief C = op(A) op(B) + beta C (beta 0 or 1) for row-major views on a
/// host execution space, op 'N' or 'T' ('T','T' is not supported); C is
/// FP32, A and B FP32 or bf16. bf16 A runs on the pair kernels, B then
/// rounded to bf16 as staged (a bf16 product, FP32 accumulation); FP32 A
/// takes B converted to FP32. TN products transpose A into `scratch` (at
/// least rows(op(A)) * K elements of A's type).
/// Throws Error naming mismatched extents.
template <class ExecutionSpace, class AV, class BV, class CV>
void host_gemm(ExecutionSpace const& exec, HostKernelTable const& table, char ta, char tb, AV const& A, BV const& B, float beta,
               CV const& C, typename AV::non_const_value_type* scratch) {
  using AT = typename AV::non_const_value_type;
  using ST = typename BV::non_const_value_type;
  auto stride_ok = [](auto const& v) { return v.extent(0) <= 1 || v.extent(1) <= 1 || v.stride(1) == 1; };
  KOKKOSMOE_REQUIRE(stride_ok(A) && stride_ok(B) && stride_ok(C), "host_gemm: operands must be row-major");
  KOKKOSMOE_REQUIRE((ta == 'N' || ta == 'T') && (tb == 'N' || tb == 'T') && !(ta == 'T' && tb == 'T'),
                    "host_gemm: op(A) op(B) with '" << ta << "', '" << tb << "' is not supported");
  KOKKOSMOE_REQUIRE(beta == 0.0f || beta == 1.0f, "host_gemm: beta " << beta << " (0 or 1)");
  int const M = static_cast<int>(ta == 'N' ? A.extent(0) : A.extent(1));
  int const K = static_cast<int>(ta == 'N' ? A.extent(1) : A.extent(0));
  int const KB = static_cast<int>(tb == 'N' ? B.extent(0) : B.extent(1));
  int const N = static_cast<int>(tb == 'N' ? B.extent(1) : B.extent(0));
  KOKKOSMOE_REQUIRE(K == KB && static_cast<int>(C.extent(0)) == M && static_cast<int>(C.extent(1)) == N,
                    "host_gemm: op(A) is " << M << "x" << K << ", op(B) " << KB << "x" << N << ", C " << C.extent(0) << "x"
                                           << C.extent(1));
  auto ld = [](auto const& v) { return static_cast<long>(v.extent(0) > 1 ? v.stride(0) : v.extent(1)); };
  HostProductOf<ST, AT> p;
  p.J = M;
  p.N = N;
  p.K = K;
  p.c = C.data();
  p.cj = ld(C);
  p.cr = 1;
  p.accumulate = beta == 1.0f;
  if (ta == 'N') {
    p.b = A.data();
    p.ldb = ld(A);
  } else {
    KOKKOSMOE_REQUIRE(scratch != nullptr || M == 0 || K == 0, "host_gemm: a TN product needs scratch for A transposed");
    host_transposes(exec, std::vector<HostTransposeOf<AT>>{{K, M, A.data(), ld(A), scratch}});
    p.b = scratch;
    p.ldb = K;
  }
  p.s = B.data();
  if (tb == 'N') {
    p.sk = ld(B);
    p.sr = 1;
  } else {
    p.sk = 1;
    p.sr = ld(B);
  }
  run_host_product(exec, table, p);
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
