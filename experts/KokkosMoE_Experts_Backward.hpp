#ifndef KOKKOSMOE_EXPERTS_BACKWARD_HPP
#define KOKKOSMOE_EXPERTS_BACKWARD_HPP

/// \file KokkosMoE_Experts_Backward.hpp
/// \brief Backward of the routed SwiGLU experts over expert-major segments:
/// for y = W2 (silu(W1 x) * (W3 x)) (gate W1 = gate(), up W3 = up(), down
/// W2 = down()), given dY per row, the input gradient dX and the weight
/// gradients dW1, dW2, dW3 of every local slot, FP32 accumulation.
///
/// Per segment q of rows [b, e) (m rows, X_q [m, d], dY_q [m, d]):
///
///     G = X_q W1^T, U = X_q W3^T            (kept by forward_keep, or recomputed)
///     dH = dY_q W2
///     H = silu(G) * U, dG = dH * U * silu'(G), dU = dH * silu(G)   (one element-wise pass)
///     dX_q = dG W1 + dU W3                  dW2 += dY_q^T H
///                                           dW1 += dG^T X_q, dW3 += dU^T X_q
///
/// with silu'(g) = s (1 + g (1 - s)), s = sigmoid(g). Six GEMMs per segment
/// (twelve n d d_ff FLOPs over all rows), eight when G and U are recomputed;
/// every GEMM runs on the grouped runner's host micro-kernels on host
/// execution spaces with the automatic GEMM path (impl/KokkosMoE_Experts_HostGemm.hpp:
/// NN, NT and TN products, a row's bits independent of the rows beside it),
/// else through KokkosMoE::gemm on the deck's path (Kokkos Kernels / BLAS on
/// hosts, cuBLAS on CUDA when available); the element-wise phases are one
/// kernel over all rows (vectorized for the CPU's ISA on the host path). With
/// BackwardProducts::bf16 the host products take bf16 operands on the
/// AVX512-BF16 pair kernels, FP32 accumulation, as a bf16 forward does
/// (about half the FP32 products' time). The gradient with respect to every runner's forward
/// is this one: the grouped, blas, padded and block runners compute the same
/// function (padding rows carry no gradient), so one backward serves them.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <impl/KokkosMoE_Experts_Grouped.hpp>
#include <impl/KokkosMoE_Experts_HostGemm.hpp>

#include <Kokkos_Core.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace KokkosMoE {
namespace Experts {

/// \brief FP32 gradients of a set of local experts, the shapes of their
/// ExpertWeights: gate and up [L, d_ff, d], down [L, d, d_ff].
template <class MemorySpace>
struct ExpertGradients {
  using tensor_type = Kokkos::View<float***, Kokkos::LayoutRight, MemorySpace>;
  tensor_type gate, up, down;

  ExpertGradients() = default;
  /// \brief Zero gradients for L slots of width d and intermediate width d_ff.
  ExpertGradients(std::string const& label, int L, int d, int d_ff)
      : gate(label + "::dgate", L, d_ff, d), up(label + "::dup", L, d_ff, d), down(label + "::ddown", L, d, d_ff) {}
  /// \brief Zero gradients shaped like `weights`.
  template <class WT>
  explicit ExpertGradients(ExpertWeights<WT, MemorySpace> const& weights)
      : ExpertGradients(weights.label() + "::grad", weights.num_slots(), weights.d(), weights.d_ff()) {}

  int num_slots() const { return static_cast<int>(gate.extent(0)); }
  int d() const { return static_cast<int>(gate.extent(2)); }
  int d_ff() const { return static_cast<int>(gate.extent(1)); }

  /// \brief Sets every gradient to zero on exec.
  template <class Exec>
  void zero(Exec const& exec) {
    Kokkos::deep_copy(exec, gate, 0.0f);
    Kokkos::deep_copy(exec, up, 0.0f);
    Kokkos::deep_copy(exec, down, 0.0f);
  }
};

/// \brief The gate and up activations G = X W1^T and U = X W3^T of a forward
/// ([n, d_ff] FP32 each), kept for the backward.
template <class MemorySpace>
struct SavedActivations {
  RowMatrix<float, MemorySpace> gate, up;
  bool empty() const { return gate.extent(0) == 0 && gate.data() == nullptr; }
};

/// \brief The operands of a training step's expert GEMMs (forward_keep and
/// backward).
enum class BackwardProducts {
  /// FP32 operands (bf16 weights and rows widened): the gradients of the
  /// function to FP32 rounding.
  fp32,
  /// bf16 operands with FP32 accumulation, as a bf16 forward multiplies:
  /// the rows (X, dY), the activations H and the activation gradients dG and
  /// dU are rounded to bf16 before their products (weights are bf16, or
  /// rounded as staged); dH, dX and the weight gradients come out in FP32.
  /// On host execution spaces whose CPU has the AVX512-BF16 pair kernels
  /// (automatic GEMM path); segment by segment through KokkosMoE::gemm with
  /// bf16 operands and an FP32 result where it has a vendor GEMM for them
  /// (cuBLAS cublasGemmEx on CUDA, tensor cores; automatic or vendor path)
  /// and on the generic path (the portable GEMM); elsewhere (Kokkos Kernels,
  /// a host without the pair kernels) the products stay FP32. The ledger's
  /// path ends in ",bf16" when they ran. forward_keep multiplies the same
  /// way on the same route (X and H rounded to bf16).
  bf16
};

/// \brief "fp32", "bf16".
inline EnumTable<BackwardProducts> const& names_of(BackwardProducts) {
  static EnumTable<BackwardProducts> const t{"backward products", {{BackwardProducts::fp32, "fp32"}, {BackwardProducts::bf16, "bf16"}}};
  return t;
}

/// \brief Backward options.
struct BackwardOptions {
  GemmPath gemm_path = GemmPath::automatic;
  BackwardProducts products = BackwardProducts::fp32;
  /// Add the weight gradients to what the gradient tensors hold (several
  /// micro-batches, or several segments sets into one set of experts);
  /// otherwise they are overwritten.
  bool accumulate = false;
};

/// \brief What a backward executed.
struct BackwardLedger {
  std::string path;            ///< e.g. "swiglu[KokkosKernels,recompute]", "swiglu[host:avx512,saved,bf16]"
  bool recomputed = false;     ///< G and U recomputed (no saved activations)
  index_t rows = 0;            ///< rows with a gradient (offsets[L])
  index_t matmul_flops = 0;    ///< 12 (16 when recomputing) * rows * d * d_ff
  index_t kernel_launches = 0; ///< GEMM calls and element-wise kernels
  index_t saved_bytes = 0;     ///< bytes of kept activations used (0 when recomputing)
};

namespace Impl {

KOKKOS_INLINE_FUNCTION float sigmoid(float g) { return 1.0f / (1.0f + Compat::exp(-g)); }

/// H = silu(G) * U for all rows (H float, or bf16 rounded).
template <class Exec, class CM, class M>
void swiglu_rows(Exec const& exec, CM const& G, CM const& U, M const& H) {
  using HT = typename M::non_const_value_type;
  std::size_t const cols = G.extent(1), total = G.extent(0) * cols;
  float const* g = G.data();
  float const* u = U.data();
  HT* h = H.data();
  Kokkos::parallel_for("KokkosMoE::Experts::backward[swiglu]",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, total), KOKKOS_LAMBDA(std::size_t i) {
                         float const s = sigmoid(g[i]);
                         h[i] = from_float<HT>(g[i] * s * u[i]);
                       });
}

/// H = silu(G) * U, dG = dH * U * silu'(G) and dU = dH * silu(G) for all
/// rows in one pass (one sigmoid per element), each float or bf16 rounded:
/// G, U and dH are only read, element by element, so dG may be written over
/// dH (float).
template <class Exec, class CM, class OT>
void swiglu_backward_rows(Exec const& exec, CM const& G, CM const& U, float const* dh, OT* h, OT* dg, OT* du) {
  std::size_t const total = G.extent(0) * G.extent(1);
  float const* g = G.data();
  float const* u = U.data();
  Kokkos::parallel_for("KokkosMoE::Experts::backward[swiglu,swiglu']",
                       Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, total), KOKKOS_LAMBDA(std::size_t i) {
                         float const x = g[i], s = sigmoid(x), uv = u[i];
                         float const silu = x * s, dsilu = s * (1.0f + x * (1.0f - s));
                         float const dhv = dh[i];
                         h[i] = from_float<OT>(silu * uv);
                         dg[i] = from_float<OT>(dhv * uv * dsilu);
                         du[i] = from_float<OT>(dhv * silu);
                       });
}

}  // namespace Impl

/// \brief Backward of the routed experts; keeps reusable buffers between
/// calls (one call at a time per object).
template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class Backward {
 public:
  explicit Backward(BackwardOptions options = BackwardOptions()) : options_(options) {}

  BackwardOptions const& options() const { return options_; }

  /// \brief Y = experts(X) per segment (blas form), keeping G and U in
  /// `saved` for backward(): the forward of a training step. Same function
  /// as Runner::run (fp32 accumulation; not bitwise the grouped kernel). Its
  /// products take the operands backward() takes (BackwardProducts), on the
  /// same route: with bf16 products X and H are rounded to bf16 before their
  /// products, as a bf16 forward multiplies.
  template <class WT, class XV, class OffV, class YV>
  void forward_keep(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X, OffV const& offsets,
                    YV const& Y, SavedActivations<MemorySpace>& saved) {
    std::vector<index_t> const offs = host_offsets(exec, w, X, offsets, Y, "forward_keep");
    index_t const n = offs.back();
    int const d = w.d(), dff = w.d_ff();
    // From the workspace: reused by a later step once these are released.
    saved.gate = ws_.template matrix<float>(exec, "saved_gate", n, static_cast<std::size_t>(dff));
    saved.up = ws_.template matrix<float>(exec, "saved_up", n, static_cast<std::size_t>(dff));
    if (n == 0) return;
    Compat::ScopedRegion region("KokkosMoE::Experts::forward_keep");
    auto Yf = float_target(exec, Y, n, d);
    float_matrix const G(saved.gate.data(), static_cast<std::size_t>(n), static_cast<std::size_t>(dff));
    float_matrix const U(saved.up.data(), static_cast<std::size_t>(n), static_cast<std::size_t>(dff));
    GemmPath ran = GemmPath::generic;
    switch (route<WT>()) {
      case Route::host_bf16: host_forward(exec, *host_table(), offs, w, as_rows<bf16_t>(exec, X, "x16"), G, U, Yf); break;
      case Route::host_fp32: host_forward(exec, *host_table(), offs, w, as_rows<float>(exec, X, "x"), G, U, Yf); break;
      case Route::segment_bf16: segment_forward<SlotWeights16>(exec, offs, w, as_rows<bf16_t>(exec, X, "x16"), G, U, Yf, ran); break;
      case Route::grouped_fp32: grouped_forward(exec, offs, w, as_rows<float>(exec, X, "x"), G, U, Yf); break;
      case Route::segment_fp32: segment_forward<Weights32>(exec, offs, w, as_rows<float>(exec, X, "x"), G, U, Yf, ran); break;
    }
    finish_target(exec, Yf, Y);
    Compat::fence(exec, "KokkosMoE::Experts::Backward::forward_keep");
  }

  /// \brief dX and the weight gradients from dY (see the file comment).
  /// \param X, offsets the forward's input rows and segments ([n, d], [L + 1])
  /// \param dY [n, d] gradient of the forward's output rows (float or bf16_t)
  /// \param dX [n, d] out: gradient of X (float or bf16_t); not aliasing dY
  /// \param grads out: weight gradients (overwritten, or added to with
  ///   BackwardOptions::accumulate)
  /// \param saved the forward's activations (forward_keep), or empty: recomputed
  /// Throws Error naming every mismatched extent before any kernel runs.
  template <class WT, class XV, class OffV, class DYV, class DXV>
  BackwardLedger backward(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                          OffV const& offsets, DYV const& dY, DXV const& dX, ExpertGradients<MemorySpace>& grads,
                          SavedActivations<MemorySpace> const& saved = {}) {
    std::vector<index_t> const offs = host_offsets(exec, w, X, offsets, dX, "backward");
    int const L = w.num_slots(), d = w.d(), dff = w.d_ff();
    index_t const n = offs.back();
    KOKKOSMOE_REQUIRE(dY.extent(0) == X.extent(0) && static_cast<int>(dY.extent(1)) == d,
                      "Experts::backward: dY is " << dY.extent(0) << "x" << dY.extent(1) << ", X is " << X.extent(0) << "x"
                                                  << X.extent(1));
    KOKKOSMOE_REQUIRE(grads.num_slots() == L && grads.d() == d && grads.d_ff() == dff,
                      "Experts::backward: gradients for " << grads.num_slots() << " slots of " << grads.d() << "x"
                                                          << grads.d_ff() << ", the experts are " << L << " slots of " << d
                                                          << "x" << dff);
    bool const recompute = saved.empty();
    KOKKOSMOE_REQUIRE(recompute || (static_cast<index_t>(saved.gate.extent(0)) == n && static_cast<int>(saved.gate.extent(1)) == dff &&
                                    saved.up.extent(0) == saved.gate.extent(0) && saved.up.extent(1) == saved.gate.extent(1)),
                      "Experts::backward: saved activations are " << saved.gate.extent(0) << "x" << saved.gate.extent(1)
                                                                  << ", the rows need " << n << "x" << dff);
    BackwardLedger ledger;
    ledger.recomputed = recompute;
    ledger.rows = n;
    ledger.saved_bytes = recompute ? 0 : static_cast<index_t>(2 * sizeof(float)) * n * dff;
    ledger.matmul_flops = (recompute ? 16 : 12) * n * static_cast<index_t>(d) * dff;
    Compat::ScopedRegion region("KokkosMoE::Experts::backward");
    // Weight gradients: a slot with rows gets one GEMM per tensor, with
    // beta 0 unless accumulating (BLAS zeroes C right before it adds, while
    // C is still in cache, instead of a separate pass over every gradient);
    // a slot without rows is zeroed here.
    if (!options_.accumulate) {
      for (int q = 0; q < L; ++q) {
        auto const r = segment(offs, q);
        if (r.first != r.second) continue;
        Kokkos::deep_copy(exec, Kokkos::subview(grads.gate, q, Kokkos::ALL, Kokkos::ALL), 0.0f);
        Kokkos::deep_copy(exec, Kokkos::subview(grads.up, q, Kokkos::ALL, Kokkos::ALL), 0.0f);
        Kokkos::deep_copy(exec, Kokkos::subview(grads.down, q, Kokkos::ALL, Kokkos::ALL), 0.0f);
        ledger.kernel_launches += 3;
      }
    }
    GemmPath ran = GemmPath::generic;
    Route const how = route<WT>();
    if (n > 0) {
      auto dXf = float_target(exec, dX, n, d);
      // G and U: the saved ones, read in place, or recomputed below.
      const_float_matrix G, U;
      if (!recompute) {
        G = const_float_matrix(saved.gate.data(), n, static_cast<std::size_t>(dff));
        U = const_float_matrix(saved.up.data(), n, static_cast<std::size_t>(dff));
      }
      switch (how) {
        case Route::host_bf16:
          ledger.kernel_launches += host_backward(exec, *host_table(), offs, w, as_rows<bf16_t>(exec, X, "x16"), as_rows<bf16_t>(exec, dY, "dy16"),
                                                  recompute, G, U, dXf, grads);
          break;
        case Route::host_fp32:
          ledger.kernel_launches += host_backward(exec, *host_table(), offs, w, as_rows<float>(exec, X, "x"), as_rows<float>(exec, dY, "dy"),
                                                  recompute, G, U, dXf, grads);
          break;
        case Route::segment_bf16:
          ledger.kernel_launches += segment_backward<SlotWeights16>(exec, offs, w, as_rows<bf16_t>(exec, X, "x16"),
                                                                    as_rows<bf16_t>(exec, dY, "dy16"), recompute, G, U, dXf, grads, ran);
          break;
        case Route::grouped_fp32:
          ledger.kernel_launches +=
              grouped_backward(exec, offs, w, as_rows<float>(exec, X, "x"), as_rows<float>(exec, dY, "dy"), recompute, G, U, dXf, grads);
          break;
        case Route::segment_fp32:
          ledger.kernel_launches += segment_backward<Weights32>(exec, offs, w, as_rows<float>(exec, X, "x"), as_rows<float>(exec, dY, "dy"),
                                                                recompute, G, U, dXf, grads, ran);
          break;
      }
      finish_target(exec, dXf, dX);
    }
    bool const on_host = how == Route::host_bf16 || how == Route::host_fp32;
    ledger.path = std::string("swiglu[") +
                  (on_host                           ? std::string("host:") + host_table()->isa
                   : how == Route::grouped_fp32      ? "cublas:grouped"
                   : ran == GemmPath::kokkos_kernels ? "KokkosKernels"
                   : ran == GemmPath::vendor         ? "cublas"
                                                     : "generic") +
                  (recompute ? ",recompute" : ",saved") + (how == Route::host_bf16 || how == Route::segment_bf16 ? ",bf16]" : "]");
    Compat::fence(exec, "KokkosMoE::Experts::Backward::backward");
    return ledger;
  }

  /// Bytes of the buffers kept between calls.
  std::int64_t held_bytes() const { return ws_.held_bytes(); }

 private:
  using float_matrix = Impl::Unmanaged2D<float, MemorySpace>;
  using const_float_matrix = Impl::Unmanaged2D<float const, MemorySpace>;
  using const_bf16_matrix = Impl::Unmanaged2D<bf16_t const, MemorySpace>;

  /// The host micro-kernels' table when the products run on them: a host
  /// execution space, the automatic GEMM path and a CPU with vector kernels
  /// (the generic table is left to BLAS); null otherwise.
  static Impl::HostKernelTable const* host_table_for(GemmPath path) {
    if constexpr (Impl::is_host_exec<ExecutionSpace>()) {
      if (path != GemmPath::automatic) return nullptr;
      auto const& t = Impl::host_kernel_table();
      return std::string(t.isa) == "generic" ? nullptr : &t;
    } else {
      (void)path;
      return nullptr;
    }
  }
  Impl::HostKernelTable const* host_table() const { return host_table_for(options_.gemm_path); }
  /// Where a training step's products run, and with which operands.
  enum class Route {
    host_bf16,     ///< host micro-kernels, bf16 operands on the pair kernels
    host_fp32,     ///< host micro-kernels, FP32 operands
    segment_bf16,  ///< KokkosMoE::gemm per segment, bf16 operands, FP32 results
    grouped_fp32,  ///< one grouped vendor GEMM (cuBLAS) per phase, FP32
    segment_fp32   ///< KokkosMoE::gemm per segment, FP32 operands
  };
  /// The route for weights of type WT: the host micro-kernels on a host
  /// execution space with the automatic GEMM path (bf16 operands where the
  /// CPU has the pair kernels); else bf16 products segment by segment where
  /// KokkosMoE::gemm takes bf16 operands on the deck's path (the vendor GEMM,
  /// cuBLAS tensor cores; or the portable GEMM on the generic path); else
  /// FP32 weights take the grouped vendor GEMM where there is one; else FP32
  /// products segment by segment.
  template <class WT>
  Route route() const {
    bool const want16 = options_.products == BackwardProducts::bf16;
    bool const vendor_ok = options_.gemm_path == GemmPath::automatic || options_.gemm_path == GemmPath::vendor;
    if (auto const* t = host_table()) return want16 && t->dp[1] != nullptr ? Route::host_bf16 : Route::host_fp32;
    if (want16 && (options_.gemm_path == GemmPath::generic || (have_vendor_gemm<ExecutionSpace, bf16_t, float>() && vendor_ok)))
      return Route::segment_bf16;
    if (std::is_same<WT, float>::value && Impl::GroupedGemmVendor<ExecutionSpace, float>::available && vendor_ok)
      return Route::grouped_fp32;
    return Route::segment_fp32;
  }

  // The GEMM phases on the host micro-kernels, each one launch over every
  // segment (impl/KokkosMoE_Experts_HostGemm.hpp); expert weights (float or
  // bf16) are staged straight from their tensors. Each returns its launches.

  /// out_q (+)= in_q W_q for W [L, K, N], or in_q W_q^T for W [L, N, K]
  /// (`transposed`): rows of K in (float, or bf16 for bf16 products), N out.
  template <class IT, class WV>
  int host_rows_by_weights(ExecutionSpace const& exec, Impl::HostKernelTable const& table, std::vector<index_t> const& offs,
                           IT const* in, int K, WV const& W, float* out, int N, bool transposed, bool accumulate = false) {
    using SV = typename WV::non_const_value_type;
    std::vector<Impl::HostProductOf<SV, IT>> list;
    for (std::size_t q = 0; q + 1 < offs.size(); ++q) {
      index_t const m = offs[q + 1] - offs[q];
      if (m == 0) continue;
      Impl::HostProductOf<SV, IT> p;
      p.J = static_cast<int>(m), p.N = N, p.K = K;
      p.b = in + offs[q] * K, p.ldb = K;
      p.s = W.data() + q * static_cast<std::size_t>(K) * N;
      p.sk = transposed ? 1 : N, p.sr = transposed ? K : 1;
      p.c = out + offs[q] * N, p.cj = N, p.cr = 1;
      p.accumulate = accumulate;
      list.push_back(p);
    }
    if constexpr (Impl::is_host_exec<ExecutionSpace>()) return Impl::run_host_products(exec, table, list);
    return 0;
  }

  /// The backward through KokkosMoE::gemm, segment by segment, with the
  /// operands of the slot weights' type SW (Weights32: FP32; SlotWeights16:
  /// bf16 operands, FP32 results): X and dY rows of that type, G and U the
  /// saved activations (recomputed when `recompute`). The same order as
  /// host_backward. Returns the launches; `ran` is the GEMM path taken.
  template <class SW, class WT, class RM>
  index_t segment_backward(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                           RM const& X, RM const& dY, bool recompute, const_float_matrix G, const_float_matrix U,
                           float_matrix const& dX, ExpertGradients<MemorySpace>& grads, GemmPath& ran) {
    using OT = typename RM::non_const_value_type;
    constexpr bool b16 = std::is_same<OT, bf16_t>::value;
    index_t const n = offs.back();
    int const L = w.num_slots(), dff = w.d_ff();
    float const beta = options_.accumulate ? 1.0f : 0.0f;
    index_t launches = 0;
    SW W;
    if (recompute) {
      auto Gr = ws_.template matrix<float>(exec, "g", n, dff);
      auto Ur = ws_.template matrix<float>(exec, "u", n, dff);
      launches += segment_gate_up<SW>(exec, offs, w, X, Gr, Ur, ran);
      G = Gr;
      U = Ur;
    }
    auto dH = ws_.template matrix<float>(exec, "dh", n, dff);
    auto H = ws_.template matrix<OT>(exec, b16 ? "h16" : "h", n, dff);
    auto dU = ws_.template matrix<OT>(exec, b16 ? "du16" : "du", n, dff);
    // dG: written over dH (FP32), or into its own bf16 buffer.
    auto dG = [&]() {
      if constexpr (b16)
        return ws_.template matrix<OT>(exec, "dg16", n, dff);
      else
        return dH;
    }();
    // dH = dY W2 per segment; H, dG and dU in one kernel; then dW2 =
    // dY^T H, dX = dG W1 + dU W3, dW1 = dG^T X and dW3 = dU^T X.
    for (int q = 0; q < L; ++q) {
      auto const r = segment(offs, q);
      if (r.first == r.second) continue;
      slot_weights(exec, w, q, W);
      ran = gemm(exec, 'N', 'N', 1.0f, Kokkos::subview(dY, r, Kokkos::ALL), W.down, 0.0f, Kokkos::subview(dH, r, Kokkos::ALL),
                 options_.gemm_path);
      launches += 1;
    }
    Impl::swiglu_backward_rows(exec, G, U, dH.data(), H.data(), dG.data(), dU.data());
    launches += 1;
    for (int q = 0; q < L; ++q) {
      auto const r = segment(offs, q);
      if (r.first == r.second) continue;
      slot_weights(exec, w, q, W);
      auto dYq = Kokkos::subview(dY, r, Kokkos::ALL);
      auto dGq = Kokkos::subview(dG, r, Kokkos::ALL);
      auto dUq = Kokkos::subview(dU, r, Kokkos::ALL);
      auto dXq = Kokkos::subview(dX, r, Kokkos::ALL);
      auto Xq = Kokkos::subview(X, r, Kokkos::ALL);
      gemm(exec, 'T', 'N', 1.0f, dYq, Kokkos::subview(H, r, Kokkos::ALL), beta, Kokkos::subview(grads.down, q, Kokkos::ALL, Kokkos::ALL),
           options_.gemm_path);
      gemm(exec, 'N', 'N', 1.0f, dGq, W.gate, 0.0f, dXq, options_.gemm_path);
      gemm(exec, 'N', 'N', 1.0f, dUq, W.up, 1.0f, dXq, options_.gemm_path);
      gemm(exec, 'T', 'N', 1.0f, dGq, Xq, beta, Kokkos::subview(grads.gate, q, Kokkos::ALL, Kokkos::ALL), options_.gemm_path);
      gemm(exec, 'T', 'N', 1.0f, dUq, Xq, beta, Kokkos::subview(grads.up, q, Kokkos::ALL, Kokkos::ALL), options_.gemm_path);
      launches += 5;
    }
    return launches;
  }

  /// The backward with FP32 weights and operands as grouped vendor GEMMs
  /// (Impl::GroupedGemmVendor: cublasGemmGroupedBatchedEx on CUDA), each
  /// phase one call over every segment, in host_backward's order: [G, U],
  /// dH, the element-wise kernel, dX = dG W1, dX += dU W3, then dW2, dW1
  /// and dW3 in one call. Returns the launches.
  template <class WT>
  index_t grouped_backward(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                           const_float_matrix const& X, const_float_matrix const& dY, bool recompute, const_float_matrix G,
                           const_float_matrix U, float_matrix const& dX, ExpertGradients<MemorySpace>& grads) {
    using Vendor = Impl::GroupedGemmVendor<ExecutionSpace, float>;
    if constexpr (Vendor::available && std::is_same<WT, float>::value) {
      index_t const n = offs.back();
      int const d = w.d(), dff = w.d_ff();
      float const beta = options_.accumulate ? 1.0f : 0.0f;
      std::size_t const per = static_cast<std::size_t>(d) * static_cast<std::size_t>(dff);
      index_t launches = 0;
      auto phase = [&](char const* label, auto&& product) { launches += grouped_phase(exec, offs, label, product); };
      auto const rp = row_product;
      if (recompute) {
        auto Gr = ws_.template matrix<float>(exec, "g", n, dff);
        auto Ur = ws_.template matrix<float>(exec, "u", n, dff);
        launches += grouped_gate_up(exec, offs, w, X, Gr, Ur);
        G = Gr;
        U = Ur;
      }
      auto dH = ws_.template matrix<float>(exec, "dh", n, dff);  // dH, then dG
      auto H = ws_.template matrix<float>(exec, "h", n, dff);
      auto dU = ws_.template matrix<float>(exec, "du", n, dff);
      phase("KokkosMoE::Experts::backward[grouped,dH]", [&](auto& l, std::size_t q, std::size_t b, int m) {
        l.push_back(rp('N', 'N', m, dff, d, dY.data() + b * d, d, w.down().data() + q * per, dff, dH.data() + b * dff, dff, 0.0f));
      });
      Impl::swiglu_backward_rows(exec, G, U, dH.data(), H.data(), dH.data(), dU.data());
      launches += 1;
      phase("KokkosMoE::Experts::backward[grouped,dX]", [&](auto& l, std::size_t q, std::size_t b, int m) {
        l.push_back(rp('N', 'N', m, d, dff, dH.data() + b * dff, dff, w.gate().data() + q * per, d, dX.data() + b * d, d, 0.0f));
      });
      phase("KokkosMoE::Experts::backward[grouped,dX+]", [&](auto& l, std::size_t q, std::size_t b, int m) {
        l.push_back(rp('N', 'N', m, d, dff, dU.data() + b * dff, dff, w.up().data() + q * per, d, dX.data() + b * d, d, 1.0f));
      });
      phase("KokkosMoE::Experts::backward[grouped,dW]", [&](auto& l, std::size_t q, std::size_t b, int m) {
        l.push_back(rp('T', 'N', d, dff, m, dY.data() + b * d, d, H.data() + b * dff, dff, grads.down.data() + q * per, dff, beta));
        l.push_back(rp('T', 'N', dff, d, m, dH.data() + b * dff, dff, X.data() + b * d, d, grads.gate.data() + q * per, d, beta));
        l.push_back(rp('T', 'N', dff, d, m, dU.data() + b * dff, dff, X.data() + b * d, d, grads.up.data() + q * per, d, beta));
      });
      return launches;
    } else {
      (void)exec, (void)offs, (void)w, (void)X, (void)dY, (void)recompute, (void)G, (void)U, (void)dX, (void)grads;
      KOKKOSMOE_REQUIRE(false, "Experts::backward: no grouped vendor GEMM for FP32 weights here");
      return 0;
    }
  }

  /// One grouped vendor call over the row-major products that `product`
  /// appends per non-empty segment q of rows [b, b + m). Returns its launches.
  template <class F>
  index_t grouped_phase(ExecutionSpace const& exec, std::vector<index_t> const& offs, char const* label, F&& product) {
    std::vector<Impl::RowProduct> list;
    for (std::size_t q = 0; q + 1 < offs.size(); ++q) {
      index_t const b = offs[q], m = offs[q + 1] - offs[q];
      if (m > 0) product(list, q, static_cast<std::size_t>(b), static_cast<int>(m));
    }
    return Impl::GroupedGemmVendor<ExecutionSpace, float>::run(exec, list, ws_, label);
  }
  static Impl::RowProduct row_product(char ta, char tb, int M, int N, int K, float const* A, int lda, float const* B, int ldb,
                                      float* C, int ldc, float beta) {
    Impl::RowProduct p;
    p.ta = ta, p.tb = tb, p.M = M, p.N = N, p.K = K, p.A = A, p.lda = lda, p.B = B, p.ldb = ldb, p.C = C, p.ldc = ldc, p.beta = beta;
    return p;
  }

  // G = X W1^T and U = X W3^T (G and U [n, d_ff] FP32) on each route's
  // GEMMs; each returns its launches.

  /// One grouped vendor call over every segment (FP32 weights).
  template <class WT>
  index_t grouped_gate_up(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                          const_float_matrix const& X, float_matrix const& G, float_matrix const& U) {
    int const d = w.d(), dff = w.d_ff();
    std::size_t const per = static_cast<std::size_t>(d) * static_cast<std::size_t>(dff);
    return grouped_phase(exec, offs, "KokkosMoE::Experts::training[grouped,gate_up]", [&](auto& l, std::size_t q, std::size_t b, int m) {
      l.push_back(row_product('N', 'T', m, dff, d, X.data() + b * d, d, w.gate().data() + q * per, d, G.data() + b * dff, dff, 0.0f));
      l.push_back(row_product('N', 'T', m, dff, d, X.data() + b * d, d, w.up().data() + q * per, d, U.data() + b * dff, dff, 0.0f));
    });
  }
  /// KokkosMoE::gemm per segment with the operands of SW; `ran` the path taken.
  template <class SW, class WT, class RM>
  index_t segment_gate_up(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                          RM const& X, float_matrix const& G, float_matrix const& U, GemmPath& ran) {
    index_t launches = 0;
    SW W;
    for (int q = 0; q < w.num_slots(); ++q) {
      auto const r = segment(offs, q);
      if (r.first == r.second) continue;
      slot_weights(exec, w, q, W);
      auto Xq = Kokkos::subview(X, r, Kokkos::ALL);
      ran = gemm(exec, 'N', 'T', 1.0f, Xq, W.gate, 0.0f, Kokkos::subview(G, r, Kokkos::ALL), options_.gemm_path);
      gemm(exec, 'N', 'T', 1.0f, Xq, W.up, 0.0f, Kokkos::subview(U, r, Kokkos::ALL), options_.gemm_path);
      launches += 2;
    }
    return launches;
  }
  /// The host micro-kernels, X of type OT (float; bf16_t on the pair kernels).
  template <class WT, class OT>
  index_t host_gate_up(ExecutionSpace const& exec, Impl::HostKernelTable const& table, std::vector<index_t> const& offs,
                       ExpertWeights<WT, MemorySpace> const& w, Impl::Unmanaged2D<OT const, MemorySpace> const& X,
                       float_matrix const& G, float_matrix const& U) {
    int const d = w.d(), dff = w.d_ff();
    return host_rows_by_weights(exec, table, offs, X.data(), d, w.gate(), G.data(), dff, true) +
           host_rows_by_weights(exec, table, offs, X.data(), d, w.up(), U.data(), dff, true);
  }

  // The kept forward on each route: G and U into the saved activations,
  // H = silu(G) * U (rounded to bf16 with bf16 operands), Y = H W2^T.

  template <class WT, class OT>
  void host_forward(ExecutionSpace const& exec, Impl::HostKernelTable const& table, std::vector<index_t> const& offs,
                    ExpertWeights<WT, MemorySpace> const& w, Impl::Unmanaged2D<OT const, MemorySpace> const& X, float_matrix const& G,
                    float_matrix const& U, float_matrix const& Y) {
    constexpr bool b16 = std::is_same<OT, bf16_t>::value;
    host_gate_up(exec, table, offs, w, X, G, U);
    auto H = ws_.template matrix<OT>(exec, b16 ? "h16" : "h", offs.back(), static_cast<std::size_t>(w.d_ff()));
    Impl::swiglu_rows(exec, G, U, H);
    host_rows_by_weights(exec, table, offs, static_cast<OT const*>(H.data()), w.d_ff(), w.down(), Y.data(), w.d(), true);
  }

  template <class SW, class WT, class RM>
  void segment_forward(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                       RM const& X, float_matrix const& G, float_matrix const& U, float_matrix const& Y, GemmPath& ran) {
    using OT = typename RM::non_const_value_type;
    constexpr bool b16 = std::is_same<OT, bf16_t>::value;
    segment_gate_up<SW>(exec, offs, w, X, G, U, ran);
    auto H = ws_.template matrix<OT>(exec, b16 ? "h16" : "h", offs.back(), static_cast<std::size_t>(w.d_ff()));
    Impl::swiglu_rows(exec, G, U, H);
    SW W;
    for (int q = 0; q < w.num_slots(); ++q) {
      auto const r = segment(offs, q);
      if (r.first == r.second) continue;
      slot_weights(exec, w, q, W);
      gemm(exec, 'N', 'T', 1.0f, Kokkos::subview(H, r, Kokkos::ALL), W.down, 0.0f, Kokkos::subview(Y, r, Kokkos::ALL),
           options_.gemm_path);
    }
  }

  template <class WT>
  void grouped_forward(ExecutionSpace const& exec, std::vector<index_t> const& offs, ExpertWeights<WT, MemorySpace> const& w,
                       const_float_matrix const& X, float_matrix const& G, float_matrix const& U, float_matrix const& Y) {
    if constexpr (Impl::GroupedGemmVendor<ExecutionSpace, float>::available && std::is_same<WT, float>::value) {
      int const d = w.d(), dff = w.d_ff();
      std::size_t const per = static_cast<std::size_t>(d) * static_cast<std::size_t>(dff);
      grouped_gate_up(exec, offs, w, X, G, U);
      auto H = ws_.template matrix<float>(exec, "h", offs.back(), static_cast<std::size_t>(dff));
      Impl::swiglu_rows(exec, G, U, H);
      grouped_phase(exec, offs, "KokkosMoE::Experts::training[grouped,down]", [&](auto& l, std::size_t q, std::size_t b, int m) {
        l.push_back(row_product('N', 'T', m, d, dff, H.data() + b * dff, dff, w.down().data() + q * per, dff, Y.data() + b * d, d, 0.0f));
      });
    } else {
      (void)exec, (void)offs, (void)w, (void)X, (void)G, (void)U, (void)Y;
      KOKKOSMOE_REQUIRE(false, "Experts::forward_keep: no grouped vendor GEMM for FP32 weights here");
    }
  }

  /// The backward's GEMMs and element-wise kernel on the host micro-kernels
  /// with operands of type OT (float; bf16_t on the pair kernels): X and dY
  /// as OT rows, G and U the saved activations (recomputed when `recompute`).
  /// dH = dY W2 first, then H, dG and dU in one kernel, then dX = dG W1 +
  /// dU W3 and the weight gradients. Returns the launches.
  template <class WT, class OT>
  index_t host_backward(ExecutionSpace const& exec, Impl::HostKernelTable const& table, std::vector<index_t> const& offs,
                        ExpertWeights<WT, MemorySpace> const& w, Impl::Unmanaged2D<OT const, MemorySpace> const& X,
                        Impl::Unmanaged2D<OT const, MemorySpace> const& dY, bool recompute, const_float_matrix G,
                        const_float_matrix U, float_matrix const& dX, ExpertGradients<MemorySpace>& grads) {
    constexpr bool b16 = std::is_same<OT, bf16_t>::value;
    index_t const n = offs.back();
    int const d = w.d(), dff = w.d_ff();
    index_t launches = 0;
    if (recompute) {
      auto Gr = ws_.template matrix<float>(exec, "g", n, dff);
      auto Ur = ws_.template matrix<float>(exec, "u", n, dff);
      launches += host_gate_up(exec, table, offs, w, X, Gr, Ur);
      G = Gr;
      U = Ur;
    }
    auto dH = ws_.template matrix<float>(exec, "dh", n, dff);
    auto H = ws_.template matrix<OT>(exec, b16 ? "h16" : "h", n, dff);
    auto dU = ws_.template matrix<OT>(exec, b16 ? "du16" : "du", n, dff);
    // dG: written over dH (float), or into its own bf16 buffer.
    RowMatrix<OT, MemorySpace> dG16;
    OT* dG = nullptr;
    if constexpr (b16) {
      dG16 = ws_.template matrix<OT>(exec, "dg16", n, dff);
      dG = dG16.data();
    } else {
      dG = dH.data();
    }
    launches += host_rows_by_weights(exec, table, offs, dY.data(), d, w.down(), dH.data(), dff, false);
    host_swiglu_backward(exec, table, G, U, dH.data(), H.data(), dG, dU.data());
    launches += 1;
    launches += host_rows_by_weights(exec, table, offs, static_cast<OT const*>(dG), dff, w.gate(), dX.data(), d, false);
    launches += host_rows_by_weights(exec, table, offs, static_cast<OT const*>(dU.data()), dff, w.up(), dX.data(), d, false, true);
    launches += host_weight_gradients<OT, OT>(exec, table, offs, {{dY.data(), H.data(), grads.down.data()}}, d, dff);
    launches += host_weight_gradients<OT, OT>(exec, table, offs, {{dG, X.data(), grads.gate.data()}, {dU.data(), X.data(), grads.up.data()}},
                                              dff, d);
    return launches;
  }

  /// H, dG and dU (Impl::swiglu_backward_rows) on the table's vectorized
  /// element-wise kernel, in chunks over the threads (the portable kernel
  /// where the table has none).
  template <class OT>
  void host_swiglu_backward(ExecutionSpace const& exec, Impl::HostKernelTable const& table, const_float_matrix const& G,
                            const_float_matrix const& U, float const* dh, OT* h, OT* dg, OT* du) {
    if constexpr (Impl::is_host_exec<ExecutionSpace>()) {
      constexpr bool b16 = std::is_same<OT, bf16_t>::value;
      using P = std::conditional_t<b16, std::uint16_t, float>;
      using F = void (*)(std::size_t, float const*, float const*, float const*, P*, P*, P*);
      F const f = [&]() -> F {
        if constexpr (b16)
          return table.swiglu_backward_bf16;
        else
          return table.swiglu_backward_f32;
      }();
      if (f != nullptr) {
        constexpr std::size_t chunk = std::size_t(1) << 14;
        std::size_t const total = G.extent(0) * G.extent(1), chunks = (total + chunk - 1) / chunk;
        float const* g = G.data();
        float const* u = U.data();
        auto* hp = reinterpret_cast<P*>(h);
        auto* gp = reinterpret_cast<P*>(dg);
        auto* up = reinterpret_cast<P*>(du);
        Kokkos::parallel_for("KokkosMoE::Experts::backward[swiglu,swiglu':host]",
                             Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, chunks), [=](std::size_t c) {
                               std::size_t const b = c * chunk, m = total - b < chunk ? total - b : chunk;
                               f(m, g + b, u + b, dh + b, hp + b, gp + b, up + b);
                             });
        return;
      }
    }
    Impl::swiglu_backward_rows(exec, G, U, dh, h, dg, du);
  }

  /// One weight gradient: grad_q (+)= lhs_q^T rhs_q for lhs [n, J], rhs
  /// [n, N] and grad [L, J, N]; lhs and rhs float, or bf16 for bf16 products.
  template <class LT, class RT>
  struct GradientTerm {
    LT const* lhs;
    RT const* rhs;
    float* grad;
  };
  /// The terms' weight gradients (J x N each), all in one launch after one
  /// launch that transposes every term's segments of lhs; segments without
  /// rows are left alone (backward zeroes them unless accumulating).
  template <class LT, class RT>
  int host_weight_gradients(ExecutionSpace const& exec, Impl::HostKernelTable const& table, std::vector<index_t> const& offs,
                            std::vector<GradientTerm<LT, RT>> const& terms, int J, int N) {
    index_t const n = offs.back();
    std::vector<Impl::HostTransposeOf<LT>> transposes;
    std::vector<Impl::HostProductOf<RT, LT>> list;
    std::vector<RowMatrix<LT, MemorySpace>> scratch;
    // One label per element type and width: a workspace drops a label's free
    // buffers of another shape, and the phases' widths differ (d, d_ff).
    std::string const tag = (std::is_same<LT, float>::value ? "lhs_t" : "lhs_t16_") + std::to_string(J) + "_";
    for (std::size_t t = 0; t < terms.size(); ++t) {
      scratch.push_back(ws_.template matrix<LT>(exec, tag + std::to_string(t), n, static_cast<std::size_t>(J)));
      LT* const at = scratch.back().data();
      for (std::size_t q = 0; q + 1 < offs.size(); ++q) {
        index_t const m = offs[q + 1] - offs[q];
        if (m == 0) continue;
        // lhs_q^T [J, m] at at + offs[q] * J.
        transposes.push_back({static_cast<int>(m), J, terms[t].lhs + offs[q] * J, J, at + offs[q] * J});
        Impl::HostProductOf<RT, LT> p;
        p.J = J, p.N = N, p.K = static_cast<int>(m);
        p.b = at + offs[q] * J, p.ldb = static_cast<long>(m);
        p.s = terms[t].rhs + offs[q] * N, p.sk = N, p.sr = 1;
        p.c = terms[t].grad + q * static_cast<std::size_t>(J) * N, p.cj = N, p.cr = 1;
        p.accumulate = options_.accumulate;
        list.push_back(p);
      }
    }
    if (list.empty()) return 0;
    if constexpr (Impl::is_host_exec<ExecutionSpace>()) {
      Impl::host_transposes(exec, transposes);
      return 1 + Impl::run_host_products(exec, table, list);
    }
    return 0;
  }


  /// One slot's weights as FP32 matrices (views of fp32 weights, converted
  /// copies of bf16 ones).
  struct Weights32 {
    const_float_matrix gate, up, down;
  };
  /// One slot's weights as bf16 matrices (views of bf16 weights, rounded
  /// copies of FP32 ones).
  struct SlotWeights16 {
    const_bf16_matrix gate, up, down;
  };

  static std::pair<index_t, index_t> segment(std::vector<index_t> const& offs, int q) {
    return {offs[static_cast<std::size_t>(q)], offs[static_cast<std::size_t>(q + 1)]};
  }

  template <class WT, class XV, class OffV, class YV>
  std::vector<index_t> host_offsets(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                                    OffV const& offsets, YV const& Y, char const* call) {
    static_assert(std::is_same<typename XV::array_layout, Kokkos::LayoutRight>::value &&
                      std::is_same<typename YV::array_layout, Kokkos::LayoutRight>::value,
                  "Experts::Backward: rows must be row-major (LayoutRight)");
    KOKKOSMOE_REQUIRE(w.has_swiglu(), "Experts::" << call << ": '" << w.label() << "' holds no SwiGLU weights");
    int const L = w.num_slots(), d = w.d();
    KOKKOSMOE_REQUIRE(static_cast<int>(X.extent(1)) == d && Y.extent(0) == X.extent(0) && static_cast<int>(Y.extent(1)) == d,
                      "Experts::" << call << ": X is " << X.extent(0) << "x" << X.extent(1) << ", the output is " << Y.extent(0)
                                  << "x" << Y.extent(1) << ", the experts have d = " << d);
    KOKKOSMOE_REQUIRE(static_cast<int>(offsets.extent(0)) == L + 1,
                      "Experts::" << call << ": offsets has " << offsets.extent(0) << " entries, expected L + 1 = " << L + 1);
    std::vector<index_t> offs(static_cast<std::size_t>(L + 1));
    Kokkos::View<index_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(offs.data(), offs.size());
    Kokkos::deep_copy(exec, h, offsets);
    Compat::fence(exec, "KokkosMoE::Experts::Backward: offsets to host");
    Impl::validate_offsets(offs, static_cast<index_t>(X.extent(0)), L);
    return offs;
  }

  /// The rows as T (float or bf16_t): in place, or converted (bf16: rounded
  /// to nearest even) into a buffer.
  template <class T, class V>
  Impl::Unmanaged2D<T const, MemorySpace> as_rows(ExecutionSpace const& exec, V const& v, char const* label) {
    if constexpr (std::is_same<typename V::non_const_value_type, T>::value) {
      return Impl::Unmanaged2D<T const, MemorySpace>(v.data(), v.extent(0), v.extent(1));
    } else {
      auto buf = ws_.template matrix<T>(exec, label, static_cast<index_t>(v.extent(0)), v.extent(1));
      Impl::convert_matrix(exec, v, buf, "KokkosMoE::Experts::Backward[convert rows]");
      return buf;
    }
  }

  template <class V>
  float_matrix float_target(ExecutionSpace const& exec, V const& v, index_t n, int d) {
    if constexpr (std::is_same<typename V::non_const_value_type, float>::value) {
      return float_matrix(v.data(), v.extent(0), v.extent(1));
    } else {
      return ws_.template matrix<float>(exec, "out", n, static_cast<std::size_t>(d));
    }
  }

  template <class V>
  void finish_target(ExecutionSpace const& exec, float_matrix const& f, V const& v) {
    if constexpr (!std::is_same<typename V::non_const_value_type, float>::value)
      Impl::convert_matrix(exec, f, v, "KokkosMoE::Experts::Backward[convert out]");
  }

  /// One slot's weights in the element type of SW (Weights32: float,
  /// SlotWeights16: bf16_t): views of weights of that type, converted
  /// copies of the others.
  template <class WT, class SW>
  void slot_weights(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, int q, SW& W) {
    using T = typename decltype(W.gate)::non_const_value_type;
    using M = decltype(W.gate);
    int const d = w.d(), dff = w.d_ff();
    if constexpr (std::is_same<WT, T>::value) {
      std::size_t const per = static_cast<std::size_t>(d) * static_cast<std::size_t>(dff) * static_cast<std::size_t>(q);
      W.gate = M(w.gate().data() + per, dff, d);
      W.up = M(w.up().data() + per, dff, d);
      W.down = M(w.down().data() + per, d, dff);
    } else {
      std::string const tag = std::is_same<T, float>::value ? "" : "16";
      auto cg = ws_.template matrix<T>(exec, "wg" + tag, dff, static_cast<std::size_t>(d));
      auto cu = ws_.template matrix<T>(exec, "wu" + tag, dff, static_cast<std::size_t>(d));
      auto cd = ws_.template matrix<T>(exec, "wd" + tag, d, static_cast<std::size_t>(dff));
      char const* label = "KokkosMoE::Experts::Backward[convert W]";
      Impl::convert_matrix(exec, Kokkos::subview(w.gate(), q, Kokkos::ALL, Kokkos::ALL), cg, label);
      Impl::convert_matrix(exec, Kokkos::subview(w.up(), q, Kokkos::ALL, Kokkos::ALL), cu, label);
      Impl::convert_matrix(exec, Kokkos::subview(w.down(), q, Kokkos::ALL, Kokkos::ALL), cd, label);
      W.gate = cg;
      W.up = cu;
      W.down = cd;
    }
  }

  BackwardOptions options_;
  Workspace<MemorySpace> ws_{"KokkosMoE::Experts::Backward"};
};

}  // namespace Experts
}  // namespace KokkosMoE

#endif
