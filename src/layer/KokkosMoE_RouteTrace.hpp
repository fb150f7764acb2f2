#ifndef KOKKOSMOE_ROUTETRACE_HPP
#define KOKKOSMOE_ROUTETRACE_HPP

/// \file KokkosMoE_RouteTrace.hpp
/// \brief Routing traces: the routes of a run, per step and rank, recorded
/// by kmoe-layer ([run] record_routes) or made by scripts/make_trace.py, and
/// replayed as a token source ([tokens] source = "trace").
///
/// Layout (both formats): two arrays of shape [steps, ranks, tokens, top_k]
/// in C order,
///   experts  int32 (int64 accepted on read): the expert id of every route,
///            -1 for a route that was not accepted (dropped by admission)
///   gates    float32 (float64 accepted on read): its gate
/// stored either as the HDF5 datasets "/experts" and "/gates" of a file
/// whose name ends in .h5 or .hdf5 (attribute "num_experts" optional), or as
/// NumPy files experts.npy and gates.npy in a directory (any other path).
/// Step s of a replay reads trace step s mod steps; rank r reads rank r, so
/// a trace replays on as many ranks as it was recorded with.

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
  int top_k = 0;
  std::vector<std::int32_t> experts;  ///< [steps][ranks][tokens][top_k]
  std::vector<float> gates;           ///< same shape

  std::size_t offset(int step, int rank) const {
    return ((static_cast<std::size_t>(step) * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(rank)) *
            static_cast<std::size_t>(tokens)) *
           static_cast<std::size_t>(top_k);
  }
  /// Largest expert id in the trace (-1: none).
  int max_expert() const;
  /// Accepted routes per expert of one step over every rank ([experts]).
  std::vector<double> step_load(int step, int num_experts) const;
};

/// \brief Collective over comm: rank 0 reads the trace (format by path, see
/// the file comment) and every rank receives it. Any problem (missing file,
/// wrong dtype or shape, arrays that disagree) is the same error on every
/// rank, naming the file and the array.
RouteTrace read_route_trace(MPI_Comm comm, std::string const& path);

/// \brief Writes a trace (this rank alone; HDF5 needs a build with HDF5).
/// The directory of the NumPy format is created when missing.
void write_route_trace(std::string const& path, RouteTrace const& trace, int num_experts);

/// \brief Throws Error unless the trace fits a run: `ranks` ranks, top_k,
/// expert ids below num_experts, `tokens` tokens per rank (0: any).
void check_route_trace(RouteTrace const& trace, std::string const& where, int ranks, int top_k, int num_experts, index_t tokens);

/// \brief The routes of one step and rank as a route table (accepted where
/// the expert id is >= 0, expert counts filled).
template <class MemorySpace>
RouteTable<MemorySpace> trace_routes(RouteTrace const& trace, int step, int rank, int num_experts) {
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

/// \brief Appends one step's routes of this rank to a trace being recorded
/// on rank 0 (collective over comm: every rank's table gathered in rank
/// order; all ranks must have the same token count).
template <class MemorySpace>
void record_routes(MPI_Comm comm, RouteTable<MemorySpace> const& table, RouteTrace& trace, double watchdog_seconds);

namespace Impl {
void gather_trace_step(MPI_Comm comm, std::vector<std::int32_t> const& experts, std::vector<float> const& gates, index_t tokens,
                       int top_k, RouteTrace& trace, double watchdog_seconds);
}  // namespace Impl

template <class MemorySpace>
void record_routes(MPI_Comm comm, RouteTable<MemorySpace> const& table, RouteTrace& trace, double watchdog_seconds) {
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
  Impl::gather_trace_step(comm, ex, ga, T, k, trace, watchdog_seconds);
}

}  // namespace KokkosMoE

#endif
