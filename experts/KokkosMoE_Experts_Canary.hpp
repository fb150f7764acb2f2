#ifndef KOKKOSMOE_EXPERTS_CANARY_HPP
#define KOKKOSMOE_EXPERTS_CANARY_HPP

/// \file KokkosMoE_Experts_Canary.hpp
/// \brief Runner parity on a canary batch: a candidate runner serves only
/// after its output on a canary batch matched the reference runner's within
/// its tolerance; a candidate that differs (or throws) is blocked and the
/// reference keeps serving.
///
/// Element (r, c) of the candidate's output y passes against the reference's
/// y_ref when |y - y_ref| <= abs + rel * |y_ref|; a NaN or infinity passes
/// only where the reference holds the same (NaN where NaN, the same infinity).
/// The canary batch is the caller's (expert-major rows and their offsets,
/// like Runner::run); both runners see the same weights, rows and offsets.
///
/// Typical use: construct with the reference runner's options (the one known
/// good, e.g. blas on the vendor BLAS), then admit() the faster candidate on
/// the first batch of a run; run() executes whichever runner serves.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Types.hpp>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {
namespace Experts {

/// \brief Per-element tolerance of a candidate against the reference.
struct ParityTolerance {
  double abs = 1e-4;  ///< absolute part
  double rel = 1e-3;  ///< relative part (times |reference|)
};

/// \brief The outcome of one canary comparison.
struct ParityResult {
  bool passed = false;
  std::string reference;      ///< the reference runner as it ran (ledger path)
  std::string candidate;      ///< the candidate runner as it ran (or its name when it threw)
  index_t rows = 0;           ///< canary rows
  int d = 0;                  ///< row width
  index_t violations = 0;     ///< elements outside the tolerance
  double max_abs_error = 0;   ///< largest |y - y_ref| (infinite where one side is not finite)
  index_t worst_row = -1;     ///< the first element with the largest error (-1: none)
  int worst_col = -1;
  double worst_value = 0, worst_reference = 0;
  std::string error;          ///< what the candidate threw ("" when it ran)

  /// \brief One line: "runner 'x' matches 'y' on 12x64 canary rows (max |error| 3e-07)" or why not.
  std::string summary() const {
    std::ostringstream os;
    os << "runner '" << candidate << "' ";
    if (!error.empty()) {
      os << "failed on the canary batch (" << rows << "x" << d << " rows): " << error;
    } else if (passed) {
      os << "matches '" << reference << "' on " << rows << "x" << d << " canary rows (max |error| " << max_abs_error << ")";
    } else {
      os << "differs from '" << reference << "' on " << violations << " of " << rows * d << " elements of " << rows << "x" << d
         << " canary rows; worst at row " << worst_row << ", column " << worst_col << ": " << worst_value << " vs "
         << worst_reference << " (|error| " << max_abs_error << ")";
    }
    return os.str();
  }
};

/// \brief Compares two host rows-by-d outputs element by element.
inline ParityResult compare_outputs(std::vector<float> const& y, std::vector<float> const& ref, index_t rows, int d,
                                    ParityTolerance const& tol) {
  ParityResult r;
  r.rows = rows;
  r.d = d;
  KOKKOSMOE_REQUIRE(y.size() == ref.size() && static_cast<index_t>(y.size()) == rows * d,
                    "compare_outputs: " << y.size() << " and " << ref.size() << " values for " << rows << "x" << d << " rows");
  double worst = -1.0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    double const a = y[i], b = ref[i];
    bool ok;
    double err;
    if (std::isfinite(a) && std::isfinite(b)) {
      err = std::fabs(a - b);
      ok = err <= tol.abs + tol.rel * std::fabs(b);
    } else {
      ok = (std::isnan(a) && std::isnan(b)) || (std::isinf(a) && a == b);
      err = ok ? 0.0 : HUGE_VAL;
    }
    r.max_abs_error = std::max(r.max_abs_error, err);
    // The worst element: the first with the largest error among the
    // violations (among all elements when none violates).
    bool const first_violation = !ok && r.violations == 0;
    if (!ok) ++r.violations;
    bool const take = ok ? r.violations == 0 && err > worst : first_violation || err > worst;
    if (take) {
      worst = err;
      r.worst_row = static_cast<index_t>(i / static_cast<std::size_t>(d));
      r.worst_col = static_cast<int>(i % static_cast<std::size_t>(d));
      r.worst_value = a;
      r.worst_reference = b;
    }
  }
  r.passed = r.violations == 0;
  return r;
}

/// \brief The serving runner of one layer's experts, guarded by a parity
/// canary (see the file comment). Not thread-safe.
template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class RunnerGate {
 public:
  explicit RunnerGate(RunnerOptions reference, ParityTolerance tolerance = ParityTolerance())
      : reference_(std::move(reference)), tolerance_(tolerance), serving_(reference_) {
    KOKKOSMOE_REQUIRE(tolerance_.abs >= 0 && tolerance_.rel >= 0 && std::isfinite(tolerance_.abs) && std::isfinite(tolerance_.rel),
                      "RunnerGate: tolerance abs " << tolerance_.abs << ", rel " << tolerance_.rel
                                                   << " (both must be finite and >= 0)");
  }

  /// \brief Runs the reference and the candidate on the canary batch (X,
  /// offsets) with `weights` and compares the outputs. When they match, the
  /// candidate serves from now on; otherwise (or when the candidate throws)
  /// it is blocked, the serving runner is unchanged, and a later admit() of
  /// the same options throws Error naming the earlier result. Errors of the
  /// reference itself (bad shapes, offsets) propagate: nothing is compared.
  template <class WT, class XV, class OffV>
  ParityResult admit(ExecutionSpace const& exec, RunnerOptions const& candidate, ExpertWeights<WT, MemorySpace> const& weights,
                     XV const& X, OffV const& offsets) {
    std::string const name = describe(candidate);
    for (auto const& b : blocked_)
      KOKKOSMOE_REQUIRE(b.first != name, "RunnerGate: runner " << name << " is blocked: " << b.second.summary());
    index_t const n = static_cast<index_t>(X.extent(0));
    int const d = weights.d();
    RowMatrix<float, MemorySpace> y_ref("KokkosMoE::Experts::RunnerGate::reference", n, d);
    RowMatrix<float, MemorySpace> y("KokkosMoE::Experts::RunnerGate::candidate", n, d);
    RunLedger const ref_ledger = reference_runner_.run(exec, weights, X, offsets, y_ref);
    ParityResult result;
    try {
      Runner<ExecutionSpace, MemorySpace> cand(candidate);
      RunLedger const ledger = cand.run(exec, weights, X, offsets, y);
      result = compare_outputs(host_values(y), host_values(y_ref), n, d, tolerance_);
      result.candidate = ledger.path;
    } catch (std::exception const& e) {
      result = ParityResult();
      result.rows = n;
      result.d = d;
      result.candidate = name;
      result.error = e.what();
    }
    result.reference = ref_ledger.path;
    if (result.passed) {
      serving_ = candidate;
      serving_runner_ = Runner<ExecutionSpace, MemorySpace>(candidate);
    } else {
      blocked_.emplace_back(name, result);
    }
    return result;
  }

  /// \brief Y = experts(X) through the serving runner (Runner::run).
  template <class WT, class XV, class OffV, class YV>
  RunLedger run(ExecutionSpace const& exec, ExpertWeights<WT, MemorySpace> const& weights, XV const& X, OffV const& offsets,
                YV const& Y) {
    return serving_runner_.run(exec, weights, X, offsets, Y);
  }

  RunnerOptions const& reference() const { return reference_; }
  RunnerOptions const& serving() const { return serving_; }
  bool reference_serves() const { return describe(serving_) == describe(reference_); }
  ParityTolerance const& tolerance() const { return tolerance_; }
  /// \brief Blocked candidates (their description and the failed result), in order.
  std::vector<std::pair<std::string, ParityResult>> const& blocked() const { return blocked_; }

  /// \brief The runner and every option its kernels depend on, e.g. "padded(capacity=0, alignment=8)".
  static std::string describe(RunnerOptions const& o) {
    std::ostringstream os;
    os << to_string(o.kind);
    switch (o.kind) {
      case RunnerKind::padded: os << "(capacity=" << o.capacity << ", alignment=" << o.alignment << ", gemm=" << to_string(o.gemm_path) << ")"; break;
      case RunnerKind::blas: os << "(gemm=" << to_string(o.gemm_path) << ")"; break;
      case RunnerKind::block:
      case RunnerKind::grouped:
        if (o.kind == RunnerKind::block) os << "(block=" << o.block_size << ", ";
        else os << "(";
        os << "kernel=" << to_string(o.grouped_kernel) << ", isa=" << o.host_isa << ", column_groups=" << o.host_column_groups << ")";
        break;
      case RunnerKind::scalar: break;
    }
    return os.str();
  }

 private:
  template <class V>
  static std::vector<float> host_values(V const& v) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    return std::vector<float>(h.data(), h.data() + h.size());
  }

  RunnerOptions reference_;
  ParityTolerance tolerance_;
  RunnerOptions serving_;
  Runner<ExecutionSpace, MemorySpace> reference_runner_{reference_};
  Runner<ExecutionSpace, MemorySpace> serving_runner_{reference_};
  std::vector<std::pair<std::string, ParityResult>> blocked_;
};

}  // namespace Experts
}  // namespace KokkosMoE

#endif
