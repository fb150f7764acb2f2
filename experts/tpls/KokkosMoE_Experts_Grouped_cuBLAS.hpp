#ifndef KOKKOSMOE_EXPERTS_GROUPED_CUBLAS_HPP
#define KOKKOSMOE_EXPERTS_GROUPED_CUBLAS_HPP

/// \file tpls/KokkosMoE_Experts_Grouped_cuBLAS.hpp
/// \brief The grouped runner's vendor specialization on CUDA: tensor-core
/// grouped GEMM through cuBLAS (cublasGemmGroupedBatchedEx, CUDA >= 12.5).
///
/// Two grouped calls per run, each over the non-empty segments of every
/// local expert (FP32 accumulation, on the execution space instance's
/// stream):
///
///     phase 1 (2 problems per segment q):  GU_q[:, 0:f]  = X_q Wg_q^T
///                                          GU_q[:, f:2f] = X_q Wu_q^T   (GU in W's type)
///     SwiGLU (one Kokkos kernel):          H = SiLU(GU[:, 0:f]) * GU[:, f:2f]  (FP32 math, stored as W's type)
///     phase 2 (1 problem per segment q):   Y_q = H_q Wd_q^T              (in W's type)
///     widen (one kernel, only for float Y with narrower weights): Y = float(Y in W's type)
///
/// cublasGemmGroupedBatchedEx takes C in the type of A and B (16BF->16BF,
/// 16F->16F, 32F->32F with CUBLAS_COMPUTE_32F; unlike cublasGemmEx it has no
/// bf16-in, fp32-out form), so with bf16 weights GU and Y leave the tensor
/// cores rounded to bf16 (accumulated in FP32). cuBLAS is column-major: a
/// row-major [rows, K] matrix is its column-major transpose, so
/// Y_q^T = Wd_q (H_q)^T is the call with op(A) = Wd (A = the row-major
/// weight, transposed) and op(B) = H_q^T (B = the row-major rows, not
/// transposed). The portable and host kernels keep GU in FP32, so results
/// agree to the rounding of GU, H and Y to the weights' type, not bitwise.
///
/// Selected by the trait GroupedVendor<Exec, W, X, Y>::available (true here
/// for Kokkos::Cuda with X of the weights' type and Y float or that type);
/// never required: without cuBLAS the primary template (not available) leaves
/// the portable kernel in charge.

#include <KokkosMoE_Cublas.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <KokkosMoE_config.hpp>
#include <impl/KokkosMoE_Experts_Grouped.hpp>

#if defined(KOKKOSMOE_HAVE_CUBLAS) && defined(KOKKOS_ENABLE_CUDA)
#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

using KokkosMoE::Impl::cublas_check;
using KokkosMoE::Impl::cublas_handle;
using KokkosMoE::Impl::cuda_data_type;

/// The problems of one grouped call (one problem per group), assembled on
/// the host; the operand pointer arrays travel to the device in one copy.
struct GroupedProblems {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  std::vector<void const*> a, b;
  std::vector<void*> c;
  /// C = A^T B (column-major; the forward's form: A a row-major weight).
  void add(int mm, int nn, int kk, void const* A, int la, void const* B, int lb, void* C, int lc) {
    ColumnProblem p;
    p.opa = 'T', p.opb = 'N', p.m = mm, p.n = nn, p.k = kk, p.a = A, p.lda = la, p.b = B, p.ldb = lb, p.c = C, p.ldc = lc;
    add(p);
  }
  /// A column-major problem (impl/: column_major of a row-major product).
  void add(ColumnProblem const& p) {
    ta.push_back(p.opa == 'T' ? CUBLAS_OP_T : CUBLAS_OP_N);
    tb.push_back(p.opb == 'T' ? CUBLAS_OP_T : CUBLAS_OP_N);
    m.push_back(p.m);
    n.push_back(p.n);
    k.push_back(p.k);
    a.push_back(p.a);
    lda.push_back(p.lda);
    b.push_back(p.b);
    ldb.push_back(p.ldb);
    c.push_back(p.c);
    ldc.push_back(p.ldc);
    alpha.push_back(1.0f);
    beta.push_back(p.beta);
    size.push_back(1);
  }
  int count() const { return static_cast<int>(m.size()); }
  /// Every operand pointer has the alignment cuBLAS's grouped kernels may
  /// assume (grouped_operand_aligned).
  bool aligned() const {
    for (std::size_t i = 0; i < m.size(); ++i)
      if (!grouped_operand_aligned(reinterpret_cast<std::uintptr_t>(a[i])) ||
          !grouped_operand_aligned(reinterpret_cast<std::uintptr_t>(b[i])) ||
          !grouped_operand_aligned(reinterpret_cast<std::uintptr_t>(c[i])))
        return false;
    return true;
  }
};

/// The operand pointer arrays of grouped calls in one device buffer from
/// ws, filled by one copy from the host: per call, [A... | B... | C...]
/// (as integers: a View of void* would read as a rank-2 view of void).
/// Returns each call's arrays (null for a call without problems).
template <class MS>
std::vector<void* const*> upload_operands(Kokkos::Cuda const& exec, std::vector<GroupedProblems const*> const& calls, Workspace<MS>& ws,
                                         char const* label) {
  std::vector<std::uintptr_t> host;
  std::vector<std::size_t> at;
  for (GroupedProblems const* p : calls) {
    at.push_back(host.size());
    for (auto const* a : p->a) host.push_back(reinterpret_cast<std::uintptr_t>(a));
    for (auto const* b : p->b) host.push_back(reinterpret_cast<std::uintptr_t>(b));
    for (auto* c : p->c) host.push_back(reinterpret_cast<std::uintptr_t>(c));
  }
  std::vector<void* const*> arrays(calls.size(), nullptr);
  if (host.empty()) return arrays;
  auto const dev = scratch_copy(&ws, exec, label, host);
  for (std::size_t i = 0; i < calls.size(); ++i)
    if (calls[i]->count() > 0) arrays[i] = reinterpret_cast<void* const*>(dev.data() + at[i]);
  return arrays;
}

/// Y_q = op(A_q) op(B_q) for every problem of p in one
/// cublasGemmGroupedBatchedEx, with the operand arrays of upload_operands.
/// Problems whose pointers lack the alignment the grouped kernels assume,
/// or a set the grouped kernels refuse, run as one cublasGemmEx each (same
/// types and accumulation, same stream): cublasGemmEx sees its pointers.
inline void grouped_gemm(cublasHandle_t h, GroupedProblems const& p, void* const* arrays, cudaDataType_t ab_type, cudaDataType_t c_type,
                         char const* label) {
  int const g = p.count();
  if (g == 0) return;
  Compat::ScopedRegion region(label);
  auto one_by_one = [&](char const* why) {
    Compat::ScopedRegion per_problem(why);
    for (std::size_t i = 0; i < static_cast<std::size_t>(g); ++i)
      cublas_check(cublasGemmEx(h, p.ta[i], p.tb[i], p.m[i], p.n[i], p.k[i], &p.alpha[i], p.a[i], ab_type, p.lda[i], p.b[i], ab_type,
                                p.ldb[i], &p.beta[i], p.c[i], c_type, p.ldc[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (grouped problems one by one)");
  };
  if (!p.aligned()) {
    one_by_one("KokkosMoE::Experts::grouped_gemm[TPL_CUBLAS,per-problem:unaligned]");
    return;
  }
  cublasStatus_t const status =
      cublasGemmGroupedBatchedEx(h, p.ta.data(), p.tb.data(), p.m.data(), p.n.data(), p.k.data(), p.alpha.data(),
                                 const_cast<void const* const*>(arrays), ab_type, p.lda.data(),
                                 const_cast<void const* const*>(arrays + g), ab_type, p.ldb.data(), p.beta.data(),
                                 const_cast<void* const*>(arrays + 2 * g), c_type, p.ldc.data(), g, p.size.data(),
                                 CUBLAS_COMPUTE_32F);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    // Refused before any launch.
    one_by_one("KokkosMoE::Experts::grouped_gemm[TPL_CUBLAS,per-problem:not-supported]");
  } else {
    cublas_check(status, "cublasGemmGroupedBatchedEx");
  }
}

/// Row-major grouped products of one element type (float: FP32 in and out;
/// bf16_t: bf16 in and out) in one cublasGemmGroupedBatchedEx; the
/// experts' backward runs its FP32 GEMM phases through it.
template <class T>
struct GroupedGemmVendor<Kokkos::Cuda, T, std::enable_if_t<std::is_same<T, float>::value || std::is_same<T, bf16_t>::value>> {
  static constexpr bool available = true;
  /// Runs the non-empty products (disjoint outputs) in one call; returns
  /// the calls made (0 or 1).
  template <class MS>
  static int run(Kokkos::Cuda const& exec, std::vector<RowProduct> const& list, Workspace<MS>& ws, char const* label) {
    GroupedProblems p;
    for (auto const& r : list)
      if (r.M > 0 && r.N > 0 && r.K > 0) p.add(column_major(r));
    if (p.count() == 0) return 0;
    auto const arrays = upload_operands(exec, {&p}, ws, "cublas_operands");
    grouped_gemm(cublas_handle(exec), p, arrays[0], cuda_data_type<T>(), cuda_data_type<T>(), label);
    return 1;
  }
};

template <class WT, class XT, class YT>
struct GroupedVendor<Kokkos::Cuda, WT, XT, YT,
                     std::enable_if_t<std::is_same<WT, XT>::value &&
                                      (std::is_same<YT, float>::value || std::is_same<YT, WT>::value)>> {
  static constexpr bool available = true;
  static constexpr char const* name = "cublas";

  /// Runs the two grouped phases and the SwiGLU kernel over segments offs
  /// (and the widening kernel for float Y with narrower weights); returns
  /// the number of launches (grouped calls and kernels).
  template <class MS, class WV, class XV, class YV>
  static int run(Kokkos::Cuda const& exec, WV const& gate, WV const& up, WV const& down, XV const& X,
          std::vector<index_t> const& offs, YV const& Y, Workspace<MS>& ws) {
    int const d = static_cast<int>(gate.extent(2)), f = static_cast<int>(gate.extent(1));
    index_t const n = offs.back();
    KOKKOSMOE_REQUIRE((X.extent(0) <= 1 || static_cast<index_t>(X.stride(0)) == d) &&
                          (Y.extent(0) <= 1 || static_cast<index_t>(Y.stride(0)) == d),
                      "Experts: cuBLAS path needs contiguous rows (X stride " << X.stride(0) << ", Y stride " << Y.stride(0)
                                                                             << ", d = " << d << ")");
    // cuBLAS grouped GEMM writes C in the operands' type (see the file comment).
    auto GU = ws.template matrix<WT>(exec, "cublas_gu", n, 2 * static_cast<std::size_t>(f));
    auto H = ws.template matrix<WT>(exec, "cublas_h", n, static_cast<std::size_t>(f));
    constexpr bool widen = !std::is_same<YT, WT>::value;  // float Y, narrower weights
    RowMatrix<WT, MS> Yw;
    WT* y_out = nullptr;
    if constexpr (widen) {
      Yw = ws.template matrix<WT>(exec, "cublas_y", n, static_cast<std::size_t>(d));
      y_out = Yw.data();
    } else {
      y_out = Y.data();
    }
    GroupedProblems p1, p2;
    std::size_t const per_w = static_cast<std::size_t>(d) * static_cast<std::size_t>(f);
    for (std::size_t q = 0; q + 1 < offs.size(); ++q) {
      index_t const b = offs[q], rows = offs[q + 1] - offs[q];
      if (rows == 0) continue;
      int const r = static_cast<int>(rows);
      auto const* x = X.data() + static_cast<std::size_t>(b) * d;
      WT* gu = GU.data() + static_cast<std::size_t>(b) * 2 * f;
      p1.add(f, r, d, gate.data() + q * per_w, d, x, d, gu, 2 * f);
      p1.add(f, r, d, up.data() + q * per_w, d, x, d, gu + f, 2 * f);
      p2.add(d, r, f, down.data() + q * per_w, f, H.data() + static_cast<std::size_t>(b) * f, f,
             y_out + static_cast<std::size_t>(b) * d, d);
    }
    // Both phases' operand arrays in one copy before the first launch.
    auto const arrays = upload_operands(exec, {&p1, &p2}, ws, "cublas_operands");
    cublasHandle_t h = cublas_handle(exec);
    cudaDataType_t const wt = cuda_data_type<WT>();
    grouped_gemm(h, p1, arrays[0], wt, wt, "KokkosMoE::Experts::Runner::grouped[TPL_CUBLAS,phase1]");
    std::size_t const total = static_cast<std::size_t>(n) * static_cast<std::size_t>(f);
    Kokkos::parallel_for(
        "KokkosMoE::Experts::Runner::grouped[TPL_CUBLAS,swiglu]",
        Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::size_t>>(exec, 0, total), KOKKOS_LAMBDA(std::size_t i) {
          std::size_t const r = i / static_cast<std::size_t>(f), j = i - r * static_cast<std::size_t>(f);
          H(r, j) = from_float<WT>(silu(to_float(GU(r, j))) * to_float(GU(r, f + j)));
        });
    grouped_gemm(h, p2, arrays[1], wt, wt, "KokkosMoE::Experts::Runner::grouped[TPL_CUBLAS,phase2]");
    if constexpr (widen) {
      std::size_t const out = static_cast<std::size_t>(n) * static_cast<std::size_t>(d);
      auto const* src = Yw.data();
      auto* dst = Y.data();
      Kokkos::parallel_for(
          "KokkosMoE::Experts::Runner::grouped[TPL_CUBLAS,widen]",
          Kokkos::RangePolicy<Kokkos::Cuda, Kokkos::IndexType<std::size_t>>(exec, 0, out),
          KOKKOS_LAMBDA(std::size_t i) { dst[i] = to_float(src[i]); });
      return 4;
    }
    return 3;
  }
};

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
#endif
