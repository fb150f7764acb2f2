#ifndef KOKKOSMOE_EXPERTS_RUNNER_HPP
#define KOKKOSMOE_EXPERTS_RUNNER_HPP

/// \file KokkosMoE_Experts_Runner.hpp
/// \brief Expert runners: execute the expert-major rows a rank received
/// through its local experts, with a row and FLOP ledger.
///
/// Input: X [n, d] (row-major, float or bf16_t), offsets [L + 1] (index_t):
/// rows [offsets[q], offsets[q+1]) belong to local slot q; offsets[0] == 0,
/// non-decreasing, offsets[L] == n. Output: Y [n, d] (float or bf16_t),
/// row r of Y is the expert of r's segment applied to row r of X:
///
///     Y_q = (SiLU(X_q Wg_q^T) * (X_q Wu_q^T)) Wd_q^T     (FP32 accumulation,
///                                                         H kept in FP32 except
///                                                         on the bf16 paths below)
///
/// Runners (RunnerKind), selectable at run time, compute the same function:
///
/// - grouped: one launch per GEMM phase over all segments (TeamPolicy over
///   segment x row tile x column range, team scratch; SiLU and the product
///   fused into the first phase). On host execution spaces it uses
///   register-blocked micro-kernels for the CPU's ISA (AVX-512, AVX2 or the
///   baseline, chosen at run time; with bf16 rows and weights on a CPU with
///   AVX512-BF16 both phases use pair dot products and H is stored as bf16,
///   rounded once after the SwiGLU, like the vendor path); elsewhere the
///   portable team kernel
///   (register-tiled, float or bf16 rows and weights). Where a vendor grouped
///   GEMM applies (cuBLAS cublasGemmGroupedBatchedEx on CUDA, tensor cores
///   for bf16; tpls/KokkosMoE_Experts_Grouped_cuBLAS.hpp) it is the default:
///   two grouped calls and a SwiGLU kernel, GU, H and the output rounded to
///   the weights' type (cuBLAS grouped GEMM writes C in the operands' type).
///   GroupedKernel forces one mapping. Empty segments cost nothing; a 1-row
///   segment costs one tile.
/// - blas: per non-empty segment, KokkosMoE::gemm (Kokkos Kernels: BLAS on
///   CPU, cuBLAS on CUDA, when available and operands are float; the portable
///   GEMM otherwise) for gate and up, a fused SiLU * up kernel, then gemm for
///   down. bf16 operands go through FP32 conversion buffers (X and Y once,
///   each slot's weights once per run) so the vendor path still applies.
/// - padded: capacity-padded dense batches. C = options.capacity (0: the
///   largest segment) rounded up to options.alignment a, C_a = ceil(C/a)*a
///   rows for every one of the L slots, empty slots included; rows are
///   gathered into an [L * C_a, d] batch (padding rows zero), the batch runs
///   through the blas chain, and only the useful rows are scattered back.
///   Executed rows = L * C_a; capacity rows = L * C. A segment longer than C
///   is an error (admission enforces capacities; runners never drop rows).
///   Example: C = 3, a = 2, L = 6: C_a = 4, 18 capacity rows, 24 executed.
/// - block: MegaBlocks-style; every segment is rounded up to a multiple of
///   options.block_size B, gathered into a block-aligned batch (fringe rows
///   zero) that runs through the grouped kernel; fringe rows are never
///   returned. Executed rows = sum_q ceil(count_q / B) * B.
/// - scalar: test experts x -> s_q * x (ExpertWeights::scalar or
///   set_scalar_scales); no matmul FLOPs.
///
/// Executed rows count the rows a runner hands to its kernels; SIMD-lane or
/// GEMM-internal padding inside a kernel is not counted. Matmul FLOPs are
/// analytical: 6 * rows * d * d_ff (three GEMMs of 2 * rows * d * d_ff).

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <impl/KokkosMoE_Experts_Grouped.hpp>
#include <impl/KokkosMoE_Experts_HostKernels.hpp>
#include <tpls/KokkosMoE_Experts_Grouped_cuBLAS.hpp>
#include <KokkosMoE_Gemm.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace KokkosMoE {
namespace Experts {

/// \brief How the expert rows are executed (see the file comment).
enum class RunnerKind : int { grouped = 0, blas = 1, padded = 2, block = 3, scalar = 4 };

/// \brief "grouped", "blas", "padded", "block", "scalar".
inline EnumTable<RunnerKind> const& names_of(RunnerKind) {
  static EnumTable<RunnerKind> const t{"runner",
                                       {{RunnerKind::grouped, "grouped"},
                                        {RunnerKind::blas, "blas"},
                                        {RunnerKind::padded, "padded"},
                                        {RunnerKind::block, "block"},
                                        {RunnerKind::scalar, "scalar"}}};
  return t;
}

/// \brief Which grouped kernel mapping runs (grouped and block runners).
enum class GroupedKernel : int {
  automatic = 0,  ///< vendor where available, else host_simd on host execution spaces, portable elsewhere
  host_simd = 1,  ///< host micro-kernels (host execution spaces only)
  portable = 2,   ///< the team/vector kernel used on GPUs (any space)
  vendor = 3,     ///< vendor grouped GEMM (cuBLAS on CUDA); an error where unavailable
};
inline EnumTable<GroupedKernel> const& names_of(GroupedKernel) {
  static EnumTable<GroupedKernel> const t{"grouped kernel",
                                          {{GroupedKernel::automatic, "auto"},
                                           {GroupedKernel::host_simd, "host_simd"},
                                           {GroupedKernel::portable, "portable"},
                                           {GroupedKernel::vendor, "vendor"}}};
  return t;
}

/// \brief Runner selection and its parameters.
struct RunnerOptions {
  RunnerKind kind = RunnerKind::grouped;
  index_t capacity = 0;       ///< padded: rows per slot C (0: the largest segment)
  index_t alignment = 1;      ///< padded: C rounded up to a multiple of this (>= 1)
  index_t block_size = 128;   ///< block: B (>= 1)
  GemmPath gemm_path = GemmPath::automatic;          ///< blas and padded
  GroupedKernel grouped_kernel = GroupedKernel::automatic;  ///< grouped and block
  std::string host_isa = "auto";  ///< host_simd: "auto", "avx512", "avx2", "generic"
  int host_column_groups = 0;     ///< host_simd: column ranges per row tile (0: from the concurrency)
  /// host_simd: row tiles of at most this many rows (a segment of few rows,
  /// or a segment's last rows) run through the decode kernel, which reads
  /// each weight block once for all of them; the results are the same bits
  /// either way. -1: default_decode_rows; 0: never; at most
  /// Impl::host_decode_max_rows.
  int decode_rows = -1;
};

/// \brief Rows up to which the decode kernel is faster than the tiled one
/// (measured with kmoe-bench experts on AVX-512 and AVX2 hosts).
constexpr int default_decode_rows = 8;
/// \brief Largest RunnerOptions::decode_rows.
constexpr int max_decode_rows = Impl::host_decode_max_rows;

/// \brief What one run executed. Row counts are rows of the runner's batch;
/// FLOPs are analytical matmul FLOPs (6 * rows * d * d_ff).
struct RunLedger {
  RunnerKind kind = RunnerKind::grouped;
  std::string path;               ///< what ran, e.g. "grouped[host:avx512]", "blas[KokkosKernels]"
  int num_slots = 0;              ///< L
  int d = 0, d_ff = 0;
  index_t useful_rows = 0;        ///< rows with a route identity (offsets[L])
  index_t executed_rows = 0;      ///< rows handed to the kernels, padding included
  index_t capacity_rows = 0;      ///< padded: L * C before alignment; otherwise executed_rows
  index_t padding_rows = 0;       ///< executed_rows - useful_rows
  index_t nonempty_slots = 0;     ///< segments with at least one useful row
  double utilization = 1.0;       ///< useful_rows / executed_rows (1 when nothing ran)
  index_t matmul_flops = 0;       ///< 6 * executed_rows * d * d_ff (0 for scalar experts)
  index_t useful_flops = 0;       ///< 6 * useful_rows * d * d_ff
  index_t descriptor_bytes = 0;   ///< offsets + tile tables + row maps the runner built
  index_t kernel_launches = 0;    ///< parallel kernels and GEMM calls issued
  index_t decode_rows = 0;        ///< rows that went through the decode kernel (grouped on hosts)
};

/// \brief The ledger a run with these options would produce for segment
/// counts `counts` (host), without running anything; validates like run().
RunLedger plan_ledger(RunnerOptions const& options, std::vector<index_t> const& counts, int d, int d_ff,
                      bool scalar_weights = false);

namespace Impl {

/// Shape checks shared by run() and plan_ledger(); throws Error.
void validate_offsets(std::vector<index_t> const& offs, index_t rows, int num_slots);
void validate_options(RunnerOptions const& o);

/// Row map of a padded/blocked batch: for every batch row the source row or
/// -1; and the batch's segment offsets.
struct PaddedLayout {
  std::vector<index_t> row_map;
  std::vector<index_t> offsets;
  index_t capacity = 0;  ///< padded: C (before alignment)
};
PaddedLayout padded_layout(std::vector<index_t> const& offs, RunnerOptions const& o);
PaddedLayout block_layout(std::vector<index_t> const& offs, index_t block);

template <class T, class MemorySpace>
using Unmanaged2D = Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// Copy-converts src into dst elementwise on exec.
/// Both views hold contiguous row-major rows of the same shape, so the copy
/// is one flat loop (vectorized on hosts, coalesced on devices).
template <class ExecutionSpace, class Src, class Dst>
void convert_matrix(ExecutionSpace const& exec, Src const& src, Dst const& dst, char const* label) {
  using out_t = typename Dst::non_const_value_type;
  std::size_t const total = src.extent(0) * src.extent(1);
  KOKKOSMOE_REQUIRE(src.span_is_contiguous() && dst.span_is_contiguous() && dst.extent(0) * dst.extent(1) == total,
                    "Experts: convert_matrix needs contiguous views of one shape (" << src.extent(0) << "x" << src.extent(1)
                                                                                    << " into " << dst.extent(0) << "x"
                                                                                    << dst.extent(1) << ")");
  auto const* in = src.data();
  out_t* out = dst.data();
  Kokkos::parallel_for(label, Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, total),
                       KOKKOS_LAMBDA(std::size_t i) { out[i] = from_float<out_t>(to_float(in[i])); });
}

/// Scalar test experts: Y(r, :) = scale(q) * X(r, :) for r in segment q.
/// One team per row: the row's segment is found once (binary search over
/// the offsets), then the team's threads sweep its columns (contiguous,
/// coalesced on GPUs, a plain vectorizable loop on hosts).
template <class ExecutionSpace, class Scale, class XV, class OffV, class YV>
void scalar_experts(ExecutionSpace const& exec, Scale const& scale, XV const& X, OffV const& offsets, YV const& Y) {
  using yt = typename YV::non_const_value_type;
  using policy_t = Kokkos::TeamPolicy<ExecutionSpace>;
  int const L = static_cast<int>(offsets.extent(0)) - 1;
  int const cols = static_cast<int>(X.extent(1));
  Kokkos::parallel_for("KokkosMoE::Experts::Runner::scalar", policy_t(exec, static_cast<int>(X.extent(0)), Kokkos::AUTO),
                       KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
                         index_t const r = team.league_rank();
                         // Segment of row r: the last q with offsets(q) <= r.
                         int lo = 0, hi = L;
                         while (hi - lo > 1) {
                           int const mid = (lo + hi) / 2;
                           if (offsets(mid) <= r)
                             lo = mid;
                           else
                             hi = mid;
                         }
                         float const s = scale(lo);
                         Kokkos::parallel_for(Kokkos::TeamThreadRange(team, cols),
                                              [&](int c) { Y(r, c) = from_float<yt>(s * to_float(X(r, c))); });
                       });
}

/// G = SiLU(G) * U elementwise (the activation between the blas phases).
template <class ExecutionSpace, class GV, class UV>
void silu_mul(ExecutionSpace const& exec, GV const& G, UV const& U) {
  std::size_t const cols = G.extent(1);
  std::size_t const total = G.extent(0) * cols;
  Kokkos::parallel_for("KokkosMoE::Experts::Runner::blas[silu*up]",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, total),
                       KOKKOS_LAMBDA(std::size_t idx) {
                         std::size_t const r = idx / cols, c = idx - r * cols;
                         G(r, c) = silu(G(r, c)) * U(r, c);
                       });
}

}  // namespace Impl

/// \brief Executes expert-major rows through local experts; keeps reusable
/// buffers between runs. Not thread-safe (one run at a time per object).
///
/// \tparam ExecutionSpace where the kernels run.
/// \tparam MemorySpace where weights, rows and buffers live (accessible from
/// ExecutionSpace).
template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class Runner {
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "Experts::Runner: the execution space cannot access the memory space");

 public:
  explicit Runner(RunnerOptions options = RunnerOptions()) : options_(std::move(options)) {
    Impl::validate_options(options_);
  }

  RunnerOptions const& options() const { return options_; }

  /// \brief Y = experts(X) per segment (see the file comment) on exec.
  /// \param exec execution space instance; every kernel is launched on it and
  ///   it is fenced before returning (the ledger and host-side tile tables
  ///   need the offsets on the host).
  /// \param weights local experts (L slots, width d).
  /// \param X [n, d] row-major input rows, float or bf16_t (const allowed).
  /// \param offsets [L + 1] index_t segment offsets.
  /// \param Y [n, d] row-major output, float or bf16_t; not aliasing X.
  /// \return the ledger. Throws Error (every value named) on mismatched
  ///   extents, malformed offsets, a segment above the padded capacity, or
  ///   experts without what the runner needs, before any kernel runs.
  template <class WT, class XV, class OffV, class YV>
  RunLedger run(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& weights, XV const& X,
                OffV const& offsets, YV const& Y) {
    static_assert(Compat::view_rank<XV> == 2 && Compat::view_rank<YV> == 2 && Compat::view_rank<OffV> == 1,
                  "Experts::Runner::run: X and Y must be rank-2 views, offsets rank-1");
    static_assert(std::is_same<typename XV::array_layout, Kokkos::LayoutRight>::value &&
                      std::is_same<typename YV::array_layout, Kokkos::LayoutRight>::value,
                  "Experts::Runner::run: X and Y must be row-major (LayoutRight)");
    static_assert(std::is_same<typename OffV::non_const_value_type, index_t>::value,
                  "Experts::Runner::run: offsets must hold index_t");
    using xt = typename XV::non_const_value_type;
    using yt = typename YV::non_const_value_type;
    static_assert((std::is_same<xt, float>::value || std::is_same<xt, bf16_t>::value) &&
                      (std::is_same<yt, float>::value || std::is_same<yt, bf16_t>::value),
                  "Experts::Runner::run: X and Y hold float or bf16_t");
    static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, typename XV::memory_space>::accessible &&
                      Kokkos::SpaceAccessibility<ExecutionSpace, typename YV::memory_space>::accessible &&
                      Kokkos::SpaceAccessibility<ExecutionSpace, typename OffV::memory_space>::accessible,
                  "Experts::Runner::run: X, Y and offsets must be accessible from the execution space");

    int const L = weights.num_slots(), d = weights.d();
    index_t const n = static_cast<index_t>(X.extent(0));
    KOKKOSMOE_REQUIRE(static_cast<index_t>(X.extent(1)) == d && Y.extent(0) == X.extent(0) &&
                          static_cast<index_t>(Y.extent(1)) == d,
                      "Experts::Runner::run: X is " << X.extent(0) << "x" << X.extent(1) << ", Y is " << Y.extent(0)
                                                    << "x" << Y.extent(1) << ", the experts have d = " << d);
    KOKKOSMOE_REQUIRE(static_cast<int>(offsets.extent(0)) == L + 1,
                      "Experts::Runner::run: offsets has " << offsets.extent(0) << " entries, expected L + 1 = " << L + 1);
    std::vector<index_t> offs(static_cast<std::size_t>(L + 1));
    {
      Kokkos::View<index_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(offs.data(), offs.size());
      Kokkos::deep_copy(exec, h, offsets);
      Compat::fence(exec, "KokkosMoE::Experts::Runner::run: offsets to host");
    }
    Impl::validate_offsets(offs, n, L);
    RunnerKind const kind = options_.kind;
    if (kind == RunnerKind::scalar) {
      KOKKOSMOE_REQUIRE(weights.has_scalar(), "Experts::Runner::run: runner 'scalar' needs scalar test-expert scales "
                                              "(ExpertWeights::scalar or set_scalar_scales) on '"
                                                  << weights.label() << "'");
    } else {
      KOKKOSMOE_REQUIRE(weights.has_swiglu(), "Experts::Runner::run: runner '" << to_string(kind) << "' needs SwiGLU weights; '"
                                                                               << weights.label()
                                                                               << "' holds scalar test experts only");
    }
    if (kind == RunnerKind::grouped || kind == RunnerKind::block) {
      if (use_host_simd()) (void)Impl::host_kernel_table(options_.host_isa);  // throws for an unavailable ISA
      using vendor = Impl::GroupedVendor<ExecutionSpace, WT, xt, yt>;
      KOKKOSMOE_REQUIRE(vendor::available || options_.grouped_kernel != GroupedKernel::vendor,
                        "Experts::Runner: grouped kernel 'vendor' is not available for "
                            << ExecutionSpace::name() << " with " << (std::is_same<WT, float>::value ? "fp32" : "bf16")
                            << " weights, " << (std::is_same<xt, float>::value ? "fp32" : "bf16") << " rows in and "
                            << (std::is_same<yt, float>::value ? "fp32" : "bf16")
                            << " rows out in this build (cuBLAS grouped GEMM on CUDA, KokkosMoE_ENABLE_CUBLAS, with rows "
                               "in the weights' type)");
    }
    std::vector<index_t> counts(static_cast<std::size_t>(L));
    for (int q = 0; q < L; ++q) counts[static_cast<std::size_t>(q)] = offs[static_cast<std::size_t>(q + 1)] - offs[static_cast<std::size_t>(q)];
    RunLedger ledger = plan_ledger(options_, counts, d, weights.d_ff(), kind == RunnerKind::scalar);
    ledger.kernel_launches = 0;
    ledger.descriptor_bytes = static_cast<index_t>(sizeof(index_t)) * (L + 1);

    Compat::ScopedRegion region("KokkosMoE::Experts::Runner::run[" + to_string(kind) + "]");
    if (n > 0) {
      switch (kind) {
        case RunnerKind::scalar: run_scalar(exec, weights, X, offsets, Y, ledger); break;
        case RunnerKind::grouped: run_grouped(exec, weights, X, offs, Y, ledger); break;
        case RunnerKind::blas: run_blas(exec, weights, X, offs, Y, ledger); break;
        case RunnerKind::padded: {
          Impl::PaddedLayout const lay = Impl::padded_layout(offs, options_);
          run_batched(exec, weights, X, offs, lay, Y, ledger, false);
          break;
        }
        case RunnerKind::block: {
          Impl::PaddedLayout const lay = Impl::block_layout(offs, options_.block_size);
          run_batched(exec, weights, X, offs, lay, Y, ledger, true);
          break;
        }
      }
    }
    if (ledger.path.empty()) ledger.path = to_string(kind);
    Compat::fence(exec, "KokkosMoE::Experts::Runner::run");
    return ledger;
  }

  /// \brief run() on a default-constructed execution space instance.
  template <class WT, class XV, class OffV, class YV>
  RunLedger run(ExpertWeights<WT, MemorySpace> const& weights, XV const& X, OffV const& offsets, YV const& Y) {
    return run(ExecutionSpace(), weights, X, offsets, Y);
  }

  /// Bytes of the buffers kept between calls.
  std::int64_t held_bytes() const { return ws_.held_bytes(); }

 private:
  using offsets_view = Kokkos::View<index_t*, MemorySpace>;

  template <class WT, class XV, class OffV, class YV>
  void run_scalar(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X, OffV const& offsets,
                  YV const& Y, RunLedger& ledger) {
    Impl::scalar_experts(exec, w.scalar_scale(), X, offsets, Y);
    ledger.kernel_launches += 1;
    ledger.path = "scalar";
  }

  bool use_host_simd() const {
    if (options_.grouped_kernel == GroupedKernel::portable || options_.grouped_kernel == GroupedKernel::vendor) return false;
    KOKKOSMOE_REQUIRE(options_.grouped_kernel != GroupedKernel::host_simd || Impl::is_host_exec<ExecutionSpace>(),
                      "Experts::Runner: grouped kernel 'host_simd' needs a host execution space (got "
                          << ExecutionSpace::name() << ")");
    return Impl::is_host_exec<ExecutionSpace>();
  }

  /// The grouped runner's host SIMD phases (gate/up -> H, H -> down) with
  /// intermediate rows H.
  template <class WT, class XV, class YV, class HV>
  void run_host_grouped(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                        std::vector<index_t> const& offs, YV const& Y, HV const& H, Impl::HostKernelTable const& table,
                        RunLedger& ledger) {
    int const d = w.d(), dff = w.d_ff();
    index_t const n = offs.back();
    using weights_view = typename ExpertWeights<WT, MemorySpace>::tensor_type;
    int const tile_rows = table.max_vectors * table.vector_length;
    std::vector<Impl::Tile> tiles = Impl::make_tiles(offs, tile_rows);
    // The host kernels read the tile table where it is (fenced below).
    Kokkos::View<Impl::Tile*, Kokkos::HostSpace> const tv(tiles.data(), tiles.size());
    int groups = options_.host_column_groups;
    if (groups <= 0) {
      int const conc = exec.concurrency();
      groups = conc <= 1 || tiles.empty() ? 1 : static_cast<int>((2 * static_cast<std::size_t>(conc) + tiles.size() - 1) / tiles.size());
    }
    Impl::HostGroupedPhase<ExecutionSpace, XV, weights_view, HV, 1> p1;
    p1.in = X;
    p1.w0 = w.gate();
    p1.w1 = w.up();
    p1.out = H;
    p1.tiles = tv;
    p1.table = table;
    p1.K = d;
    p1.N = dff;
    p1.groups = Compat::max(1, Compat::min(groups, (dff + 1) / 2));
    int const decode = options_.decode_rows < 0 ? default_decode_rows : options_.decode_rows;
    p1.decode_rows = decode;
    index_t decoded = 0;
    for (Impl::Tile const& t : tiles) decoded += t.rows <= decode ? t.rows : 0;
    ledger.decode_rows += decoded;
    launch_host(exec, p1, tiles.size(), "KokkosMoE::Experts::Runner::grouped[phase1]");
    Impl::HostGroupedPhase<ExecutionSpace, HV, weights_view, YV, 2> p2;
    p2.in = H;
    p2.w0 = w.down();
    p2.out = Y;
    p2.tiles = tv;
    p2.table = table;
    p2.K = dff;
    p2.N = d;
    p2.groups = Compat::max(1, Compat::min(groups, d));
    p2.decode_rows = decode;
    launch_host(exec, p2, tiles.size(), "KokkosMoE::Experts::Runner::grouped[phase2]");
    ledger.kernel_launches += 2;
    ledger.descriptor_bytes += static_cast<index_t>(tiles.size() * sizeof(Impl::Tile));
    bool const dot = decltype(p1)::dp_types && table.dp[1] != nullptr;
    ledger.path = std::string("grouped[host:") + table.isa + (dot ? ",bf16dot" : "") +
                  (decoded == n ? ",decode" : decoded > 0 ? ",tiled+decode" : "") + "]";
    Compat::fence(exec, "KokkosMoE::Experts::Runner::grouped: tile table");
  }

  /// Grouped kernel over segments `offs` of rows X -> Y.
  template <class WT, class XV, class YV>
  void run_grouped(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                   std::vector<index_t> const& offs, YV const& Y, RunLedger& ledger) {
    using xt = typename XV::non_const_value_type;
    using yt = typename YV::non_const_value_type;
    using vendor = Impl::GroupedVendor<ExecutionSpace, WT, xt, yt>;
    GroupedKernel const choice = options_.grouped_kernel;
    if constexpr (vendor::available) {
      if (choice == GroupedKernel::automatic || choice == GroupedKernel::vendor) {
        Compat::ScopedRegion region(std::string("KokkosMoE::Experts::Runner::grouped[") + vendor::name + "]");
        ledger.kernel_launches += vendor::run(exec, w.gate(), w.up(), w.down(), X, offs, Y, ws_);
        ledger.path = std::string("grouped[") + vendor::name + "]";
        return;
      }
    }
    int const d = w.d(), dff = w.d_ff();
    index_t const n = offs.back();
    using weights_view = typename ExpertWeights<WT, MemorySpace>::tensor_type;
    if (use_host_simd()) {
      if constexpr (Impl::is_host_exec<ExecutionSpace>()) {
        Impl::HostKernelTable const& table = Impl::host_kernel_table(options_.host_isa);
        if constexpr (std::is_same<WT, bf16_t>::value && std::is_same<xt, bf16_t>::value) {
          // bf16 rows and weights with the pair dot-product kernels: the
          // intermediate rows are bf16 too (rounded once after the SwiGLU),
          // so that the down projection runs on pair dot products as well.
          if (table.dp[1] != nullptr) {
            run_host_grouped(exec, w, X, offs, Y, ws_.template matrix<bf16_t>(exec, "h_bf16", n, dff), table, ledger);
            return;
          }
        }
        run_host_grouped(exec, w, X, offs, Y, ws_.template matrix<float>(exec, "h", n, dff), table, ledger);
        return;
      }
    }
    auto H = ws_.template matrix<float>(exec, "h", n, dff);
    using tile_view = Kokkos::View<Impl::Tile*, MemorySpace>;
    constexpr int MT = Impl::PortableGroupedPhase<ExecutionSpace, XV, weights_view, decltype(H), tile_view, 1>::MT;
    std::vector<Impl::Tile> const tiles = Impl::make_tiles(offs, MT);
    auto const tv = ws_.template get<tile_view>(exec, "tiles", static_cast<index_t>(tiles.size()));
    copy_from_host(exec, tiles, tv);
    Impl::PortableGroupedPhase<ExecutionSpace, XV, weights_view, decltype(H), tile_view, 1> p1;
    p1.in = X;
    p1.w0 = w.gate();
    p1.w1 = w.up();
    p1.out = H;
    p1.tiles = tv;
    p1.K = d;
    p1.N = dff;
    p1.col_tiles = (dff + p1.NT - 1) / p1.NT;
    launch_portable(exec, p1, tiles.size(), "KokkosMoE::Experts::Runner::grouped[portable,phase1]");
    Impl::PortableGroupedPhase<ExecutionSpace, decltype(H), weights_view, YV, tile_view, 2> p2;
    p2.in = H;
    p2.w0 = w.down();
    p2.out = Y;
    p2.tiles = tv;
    p2.K = dff;
    p2.N = d;
    p2.col_tiles = (d + p2.NT - 1) / p2.NT;
    launch_portable(exec, p2, tiles.size(), "KokkosMoE::Experts::Runner::grouped[portable,phase2]");
    ledger.kernel_launches += 2;
    ledger.descriptor_bytes += static_cast<index_t>(tiles.size() * sizeof(Impl::Tile));
    ledger.path = "grouped[portable]";
  }

  template <class Phase>
  static void launch_host(ExecutionSpace const& exec, Phase const& p, std::size_t tiles, char const* label) {
    if (tiles == 0) return;
    std::size_t const bytes = p.scratch_bytes();
    KOKKOSMOE_REQUIRE(bytes <= static_cast<std::size_t>(Phase::policy_type::scratch_size_max(1)),
                      "Experts::Runner: the grouped kernel needs " << bytes << " bytes of team scratch for K = " << p.K
                                                                   << " but the execution space allows "
                                                                   << Phase::policy_type::scratch_size_max(1));
    typename Phase::policy_type policy(exec, static_cast<int>(tiles) * p.groups, 1);
    policy.set_chunk_size(1);
    Kokkos::parallel_for(label, policy.set_scratch_size(1, Kokkos::PerTeam(bytes)), p);
  }

  template <class Phase>
  static void launch_portable(ExecutionSpace const& exec, Phase const& p, std::size_t tiles, char const* label) {
    if (tiles == 0) return;
    int const league = static_cast<int>(tiles) * p.col_tiles;
    typename Phase::policy_type policy(exec, league, Phase::team_size(), 1);
    Kokkos::parallel_for(label, policy.set_scratch_size(0, Kokkos::PerTeam(Phase::scratch_bytes())), p);
  }

  /// Per-segment GEMM chain over segments `offs` (bf16 through FP32 buffers).
  template <class WT, class XV, class YV>
  void run_blas(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                std::vector<index_t> const& offs, YV const& Y, RunLedger& ledger) {
    using xt = typename XV::non_const_value_type;
    using yt = typename YV::non_const_value_type;
    int const d = w.d(), dff = w.d_ff(), L = w.num_slots();
    index_t const n = offs.back();
    auto G = ws_.template matrix<float>(exec, "h", n, dff);
    auto U = ws_.template matrix<float>(exec, "u", n, dff);
    auto Xf = Impl::Unmanaged2D<float const, MemorySpace>();
    if constexpr (std::is_same<xt, float>::value) {
      Xf = Impl::Unmanaged2D<float const, MemorySpace>(X.data(), X.extent(0), X.extent(1));
    } else {
      auto buf = ws_.template matrix<float>(exec, "x", n, d);
      Impl::convert_matrix(exec, X, buf, "KokkosMoE::Experts::Runner::blas[convert X]");
      ledger.kernel_launches += 1;
      Xf = buf;
    }
    auto Yf = Impl::Unmanaged2D<float, MemorySpace>();
    if constexpr (std::is_same<yt, float>::value) {
      Yf = Impl::Unmanaged2D<float, MemorySpace>(Y.data(), Y.extent(0), Y.extent(1));
    } else {
      Yf = ws_.template matrix<float>(exec, "y", n, d);
    }
    GemmPath path = options_.gemm_path;
    GemmPath ran = GemmPath::generic;
    for (int q = 0; q < L; ++q) {
      index_t const b = offs[static_cast<std::size_t>(q)], e = offs[static_cast<std::size_t>(q + 1)];
      if (e == b) continue;
      auto wg = Impl::Unmanaged2D<float const, MemorySpace>(), wu = wg, wd = wg;
      if constexpr (std::is_same<WT, float>::value) {
        std::size_t const per = static_cast<std::size_t>(d) * static_cast<std::size_t>(dff) * static_cast<std::size_t>(q);
        wg = Impl::Unmanaged2D<float const, MemorySpace>(w.gate().data() + per, dff, d);
        wu = Impl::Unmanaged2D<float const, MemorySpace>(w.up().data() + per, dff, d);
        wd = Impl::Unmanaged2D<float const, MemorySpace>(w.down().data() + per, d, dff);
      } else {
        auto cg = ws_.template matrix<float>(exec, "wg", dff, d);
        auto cu = ws_.template matrix<float>(exec, "wu", dff, d);
        auto cd = ws_.template matrix<float>(exec, "wd", d, dff);
        Impl::convert_matrix(exec, Kokkos::subview(w.gate(), q, Kokkos::ALL, Kokkos::ALL), cg,
                             "KokkosMoE::Experts::Runner::blas[convert W]");
        Impl::convert_matrix(exec, Kokkos::subview(w.up(), q, Kokkos::ALL, Kokkos::ALL), cu,
                             "KokkosMoE::Experts::Runner::blas[convert W]");
        Impl::convert_matrix(exec, Kokkos::subview(w.down(), q, Kokkos::ALL, Kokkos::ALL), cd,
                             "KokkosMoE::Experts::Runner::blas[convert W]");
        ledger.kernel_launches += 3;
        wg = cg;
        wu = cu;
        wd = cd;
      }
      auto rows = std::make_pair(b, e);
      auto Xq = Kokkos::subview(Xf, rows, Kokkos::ALL);
      auto Gq = Kokkos::subview(G, rows, Kokkos::ALL);
      auto Uq = Kokkos::subview(U, rows, Kokkos::ALL);
      ran = gemm(exec, 'N', 'T', 1.0f, Xq, wg, 0.0f, Gq, path);
      gemm(exec, 'N', 'T', 1.0f, Xq, wu, 0.0f, Uq, path);
      Impl::silu_mul(exec, Gq, Uq);
      auto Hq = Impl::Unmanaged2D<float const, MemorySpace>(Gq.data(), Gq.extent(0), Gq.extent(1));
      auto Yq = Kokkos::subview(Yf, rows, Kokkos::ALL);
      gemm(exec, 'N', 'T', 1.0f, Hq, wd, 0.0f, Yq, path);
      ledger.kernel_launches += 4;
    }
    if constexpr (!std::is_same<yt, float>::value) {
      Impl::convert_matrix(exec, Yf, Y, "KokkosMoE::Experts::Runner::blas[convert Y]");
      ledger.kernel_launches += 1;
    }
    ledger.path = std::string("blas[") +
                  (ran == GemmPath::kokkos_kernels ? "KokkosKernels" : ran == GemmPath::vendor ? "cublas" : "generic") + "]";
  }

  /// Padded (blocked = false) or block (blocked = true) runner: gather into
  /// the batch layout, run blas / grouped on it, scatter the useful rows.
  template <class WT, class XV, class YV>
  void run_batched(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& w, XV const& X,
                   std::vector<index_t> const& offs, Impl::PaddedLayout const& lay, YV const& Y, RunLedger& ledger,
                   bool blocked) {
    (void)offs;
    using xt = typename XV::non_const_value_type;
    using yt = typename YV::non_const_value_type;
    index_t const rows = static_cast<index_t>(lay.row_map.size());
    if (rows == 0) {
      ledger.path = blocked ? "block" : "padded";
      return;
    }
    int const d = w.d();
    Kokkos::View<index_t*, MemorySpace> map(Kokkos::view_alloc(Kokkos::WithoutInitializing, "KokkosMoE::Experts::Runner::row_map"),
                                            lay.row_map.size());
    {
      Kokkos::View<index_t const*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(lay.row_map.data(),
                                                                                                lay.row_map.size());
      Kokkos::deep_copy(exec, map, h);
    }
    ledger.descriptor_bytes += static_cast<index_t>(lay.row_map.size() * sizeof(index_t));
    // The batch: input rows in X's type, output rows in Y's type (separate buffers).
    auto Xb = ws_.template matrix<xt>(exec, "batch", rows, d);
    gather_rows(exec, X, map, Xb, "KokkosMoE::Experts::Runner::gather", MissingRow::zero);
    auto Yb = ws_.template matrix<yt>(exec, "batch_out", rows, d);
    auto Xbc = Impl::Unmanaged2D<xt const, MemorySpace>(Xb.data(), Xb.extent(0), Xb.extent(1));
    if (blocked) {
      run_grouped(exec, w, Xbc, lay.offsets, Yb, ledger);
      ledger.path = "block/" + ledger.path;
    } else {
      run_blas(exec, w, Xbc, lay.offsets, Yb, ledger);
      ledger.path = "padded/" + ledger.path;
    }
    scatter_rows(exec, Yb, map, Y, "KokkosMoE::Experts::Runner::scatter");
    ledger.kernel_launches += 2;
  }

  RunnerOptions options_;
  Workspace<MemorySpace> ws_{"KokkosMoE::Experts::Runner"};
};

/// \brief One run with a temporary Runner (no buffer reuse); see Runner::run.
template <class ExecutionSpace, class WT, class MemorySpace, class XV, class OffV, class YV>
RunLedger run(ExecutionSpace const& exec, RunnerOptions const& options, ExpertWeights<WT, MemorySpace> const& weights,
              XV const& X, OffV const& offsets, YV const& Y) {
  Runner<ExecutionSpace, MemorySpace> runner(options);
  return runner.run(exec, weights, X, offsets, Y);
}

/// \brief run() on the default execution space instance.
template <class WT, class MemorySpace, class XV, class OffV, class YV>
RunLedger run(RunnerOptions const& options, ExpertWeights<WT, MemorySpace> const& weights, XV const& X,
              OffV const& offsets, YV const& Y) {
  return run(typename MemorySpace::execution_space(), options, weights, X, offsets, Y);
}

}  // namespace Experts
}  // namespace KokkosMoE

#endif
