#ifndef KMOE_BENCH_COMMON_HPP
#define KMOE_BENCH_COMMON_HPP

// Shared pieces of kmoe-bench: mode registry, timing, BENCH lines.
//
// Every case prints one greppable line on rank 0:
//   BENCH name=<case> key=value ... ratio=<ours/baseline>
// where the baseline is measured in the same run. Times are medians of
// repeated runs after warmup, each fenced on the execution space instance.

#include <KokkosMoE_Types.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kmoe_bench {

/// A mode: `kmoe-bench <name> [options]`. run() gets the mode's own arguments
/// (argv[0] is the mode name) and returns the exit code.
struct Mode {
  std::string name;
  std::string help;
  std::function<int(int argc, char** argv)> run;
};

std::vector<Mode>& registry();

/// Registers a mode at static-initialization time (one per bench_*.cpp).
struct Register {
  Register(std::string name, std::string help, std::function<int(int, char**)> run);
};

/// Median wall time in seconds of reps calls of f after warmup calls. f must
/// fence what it launches (the helpers below fence the default instance).
double median_seconds(int warmup, int reps, std::function<void()> const& f);

/// The median of v (the mean of the middle two for an even count; 0 when empty).
double median(std::vector<double> v);

/// The largest of every rank's `mine` over comm (the slowest rank's time),
/// under the watchdog.
double slowest_rank(double mine, MPI_Comm comm, double watchdog, char const* what);

/// True when `mine` holds on every rank of comm, under the watchdog.
bool on_every_rank(bool mine, MPI_Comm comm, double watchdog, char const* what);

/// One BENCH line on rank 0 of MPI_COMM_WORLD (and flushed).
void print_bench(std::string const& name, std::vector<std::pair<std::string, std::string>> const& fields,
                 double ratio);

/// Formats a double with a fixed number of significant digits.
std::string fmt(double value, int digits = 4);

/// Sets the BLAS library's thread count when it exposes a setter (OpenBLAS);
/// returns the count in effect, or -1 when it cannot be controlled.
int set_blas_threads(int threads);

/// Threads of the default host execution space.
int host_threads();

/// Uniform routing: k distinct experts per token drawn from a generator seeded
/// with `seed`, gates 1/k, every route accepted.
template <class MemorySpace>
void fill_uniform_routes(KokkosMoE::RouteTable<MemorySpace> const& table, unsigned seed) {
  auto e = Kokkos::create_mirror_view(table.expert);
  auto g = Kokkos::create_mirror_view(table.gate);
  auto a = Kokkos::create_mirror_view(table.accepted);
  int const tokens = static_cast<int>(table.expert.extent(0));
  int const top_k = static_cast<int>(table.expert.extent(1));
  int const experts = static_cast<int>(table.expert_counts.extent(0));
  std::mt19937 rng(seed);
  std::vector<int> ids(static_cast<std::size_t>(experts));
  for (int t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int j = 0; j < top_k; ++j) {
      int const pick = j + static_cast<int>(rng() % static_cast<unsigned>(experts - j));
      std::swap(ids[static_cast<std::size_t>(j)], ids[static_cast<std::size_t>(pick)]);
      e(t, j) = ids[static_cast<std::size_t>(j)];
      g(t, j) = 1.0f / static_cast<float>(top_k);
      a(t, j) = 1;
    }
  }
  Kokkos::deep_copy(table.expert, e);
  Kokkos::deep_copy(table.gate, g);
  Kokkos::deep_copy(table.accepted, a);
}

}  // namespace kmoe_bench

#endif
