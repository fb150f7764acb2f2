#ifndef KMOE_BENCH_COMMON_HPP
#define KMOE_BENCH_COMMON_HPP

// Shared pieces of kmoe-bench: mode registry, timing, BENCH lines.
//
// Every case prints one greppable line on rank 0:
//   BENCH name=<case> key=value ... ratio=<ours/baseline>
// where the baseline is measured in the same run. Times are medians of
// repeated runs after warmup, each fenced on the execution space instance.

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <functional>
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

}  // namespace kmoe_bench

#endif
