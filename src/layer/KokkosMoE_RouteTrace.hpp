#ifndef KOKKOSMOE_ROUTETRACE_HPP
#define KOKKOSMOE_ROUTETRACE_HPP

/// \file KokkosMoE_RouteTrace.hpp
/// \brief Routing traces: the routes of a run, per step and rank, recorded
/// by kmoe-layer ([run] record_routes) or made by scripts/make_trace.py, and
/// replayed as a token source ([tokens] source = "trace").
///
/// Layout (both formats): arrays in C order,
///   experts  int32 (int64 accepted on read), [steps, ranks, tokens, top_k]:
///            the expert id of every route, -1 for a route that was not
///            accepted (dropped by admission)
///   gates    float32 (float64 accepted on read), same shape: its gate
///   logits   float32 (float64 accepted on read), [steps, ranks, tokens,
///            experts], optional: the router logits the routes came from
/// stored either as the HDF5 datasets "/experts", "/gates" and "/logits" of
/// a file whose name ends in .h5 or .hdf5 (attribute "num_experts"
/// optional), or as NumPy files experts.npy, gates.npy and logits.npy in a
/// directory (any other path). A trace holds routes (experts and gates),
/// logits, or both; routes replay as they are, logits through the replaying
/// layer's own router (score function, correction bias, group and domain
/// limits, admission), so one logit trace serves router experiments (another
/// top_k, capacity or bias rule). Step s of a replay reads trace step s mod
/// steps; rank r reads rank r, so a trace replays on as many ranks as it was
/// recorded with.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Types.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

struct RouteTrace {
  int steps = 0;
  int ranks = 0;
  index_t tokens = 0;
  int top_k = 0;                      ///< 0: the trace holds no routes
  int num_experts = 0;                ///< width of the logits; 0: no logits
  std::vector<std::int32_t> experts;  ///< [steps][ranks][tokens][top_k]
  std::vector<float> gates;           ///< same shape
  std::vector<float> logits;          ///< [steps][ranks][tokens][num_experts], or empty

  bool has_routes() const { return top_k > 0; }
  bool has_logits() const { return num_experts > 0; }
  /// First route of (step, rank) in experts / gates.
  std::size_t offset(int step, int rank) const { return row(step, rank) * static_cast<std::size_t>(top_k); }
  /// First logit of (step, rank) in logits.
  std::size_t logit_offset(int step, int rank) const { return row(step, rank) * static_cast<std::size_t>(num_experts); }
  /// Largest expert id in the trace (-1: none).
  int max_expert() const;
  /// Accepted routes per expert of one step over every rank ([experts]).
  std::vector<double> step_load(int step, int num_experts) const;

 private:
  std::size_t row(int step, int rank) const {
    return (static_cast<std::size_t>(step) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(rank)) *
           static_cast<std::size_t>(tokens);
  }
};

/// \brief Collective over comm: rank 0 reads the trace (format by path, see
/// the file comment) and every rank receives it. Any problem (missing file,
/// wrong dtype or shape, arrays that disagree) is the same error on every
/// rank, naming the file and the array.
RouteTrace read_route_trace(MPI_Comm comm, std::string const& path);

/// \brief Writes a trace (this rank alone; HDF5 needs a build with HDF5).
/// The directory of the NumPy format is created when missing.
void write_route_trace(std::string const& path, RouteTrace const& trace, int num_experts);

/// \brief What a replay reads from a trace.
enum class TraceReplay {
  automatic,  ///< routes where the trace has them, else logits
  routes,     ///< the recorded expert ids and gates
  logits,     ///< the recorded logits, through the replaying router
};
std::string to_string(TraceReplay r);

/// \brief The replay a trace gets: `requested`, with automatic resolved.
/// Throws Error (naming `where`) when the trace lacks that array.
TraceReplay trace_replay(RouteTrace const& trace, TraceReplay requested, std::string const& where);

/// \brief Throws Error unless the trace fits a run: `ranks` ranks,
/// `tokens` tokens per rank (0: any), and for the arrays a replay of kind
/// `replay` reads: top_k and expert ids below num_experts (routes), or
/// num_experts logits per token (logits).
void check_route_trace(RouteTrace const& trace, std::string const& where, int ranks, int top_k, int num_experts, index_t tokens,
                       TraceReplay replay = TraceReplay::routes);

/// \brief The routes of one step and rank as a route table (accepted where
/// the expert id is >= 0, expert counts filled).
template <class MemorySpace>
RouteTable<MemorySpace> trace_routes(RouteTrace const& trace, int step, int rank, int num_experts) {
  KOKKOSMOE_REQUIRE(trace.has_routes(), "trace_routes: the trace holds logits only (replay them through a router: trace_logits)");
  RouteTable<MemorySpace> t("trace_routes", trace.tokens, trace.top_k, num_experts);
  auto e = Kokkos::create_mirror_view(t.expert);
  auto g = Kokkos::create_mirror_view(t.gate);
  auto a = Kokkos::create_mirror_view(t.accepted);
  auto c = Kokkos::create_mirror_view(t.expert_counts);
  Kokkos::deep_copy(c, 0);
  std::size_t const at = trace.offset(step % trace.steps, rank);
  index_t accepted = 0;
  for (index_t i = 0; i < trace.tokens; ++i)
    for (int j = 0; j < trace.top_k; ++j) {
      std::size_t const q = at + static_cast<std::size_t>(i) * static_cast<std::size_t>(trace.top_k) + static_cast<std::size_t>(j);
      int const x = trace.experts[q];
      e(i, j) = x >= 0 ? x : 0;
      g(i, j) = trace.gates[q];
      a(i, j) = x >= 0 ? 1 : 0;
      if (x >= 0) {
        ++c(x);
        ++accepted;
      }
    }
  t.counts.attempted = trace.tokens * trace.top_k;
  t.counts.accepted = accepted;
  t.counts.dropped = t.counts.attempted - accepted;
  Kokkos::deep_copy(t.expert, e);
  Kokkos::deep_copy(t.gate, g);
  Kokkos::deep_copy(t.accepted, a);
  Kokkos::deep_copy(t.expert_counts, c);
  return t;
}

/// \brief The logits of one step and rank, [tokens, num_experts] FP32, for
/// Router::route_logits.
template <class MemorySpace>
Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> trace_logits(RouteTrace const& trace, int step, int rank) {
  KOKKOSMOE_REQUIRE(trace.has_logits(), "trace_logits: the trace holds no logits (replay its routes: trace_routes)");
  Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> z(Kokkos::view_alloc(Kokkos::WithoutInitializing, "trace_logits"),
                                                             trace.tokens, trace.num_experts);
  Kokkos::View<float const**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> src(
      trace.logits.data() + trace.logit_offset(step % trace.steps, rank), trace.tokens, trace.num_experts);
  Kokkos::deep_copy(z, src);
  return z;
}

/// \brief Appends one step's routes of this rank to a trace being recorded
/// on rank 0 (collective over comm: every rank's table gathered in rank
/// order; all ranks must have the same token count). With `logits`
/// ([tokens, E], the router's logits of the step; every step of a trace
/// alike) the step's logits are recorded too.
template <class MemorySpace>
void record_routes(MPI_Comm comm, RouteTable<MemorySpace> const& table, RouteTrace& trace, double watchdog_seconds,
                   Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> const& logits = {});

namespace Impl {
void gather_trace_step(MPI_Comm comm, std::vector<std::int32_t> const& experts, std::vector<float> const& gates,
                       std::vector<float> const& logits, index_t tokens, int top_k, int num_experts, RouteTrace& trace,
                       double watchdog_seconds);
}  // namespace Impl

template <class MemorySpace>
void record_routes(MPI_Comm comm, RouteTable<MemorySpace> const& table, RouteTrace& trace, double watchdog_seconds,
                   Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> const& logits) {
  auto e = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.expert);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.gate);
  auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.accepted);
  index_t const T = table.num_tokens();
  int const k = table.top_k();
  std::vector<std::int32_t> ex(static_cast<std::size_t>(T) * static_cast<std::size_t>(k));
  std::vector<float> ga(ex.size());
  for (index_t i = 0; i < T; ++i)
    for (int j = 0; j < k; ++j) {
      std::size_t const q = static_cast<std::size_t>(i) * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
      ex[q] = a(i, j) ? e(i, j) : -1;
      ga[q] = g(i, j);
    }
  std::vector<float> z;
  int E = 0;
  if (logits.data() != nullptr) {
    E = static_cast<int>(logits.extent(1));
    KOKKOSMOE_REQUIRE(static_cast<index_t>(logits.extent(0)) == T,
                      "record_routes: " << logits.extent(0) << " tokens' logits for " << T << " tokens' routes");
    z.resize(static_cast<std::size_t>(T) * static_cast<std::size_t>(E));
    Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> dst(z.data(), T, E);
    Kokkos::deep_copy(dst, logits);
  }
  Impl::gather_trace_step(comm, ex, ga, z, T, k, E, trace, watchdog_seconds);
}

}  // namespace KokkosMoE

#endif
