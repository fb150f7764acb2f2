// MPI test main: MPI first, then Kokkos, then Catch2. Every rank runs the same
// tests; the exit code is the maximum over ranks so all ranks agree. A CUDA
// build on a machine without a GPU skips (exit code 77, ctest's
// SKIP_RETURN_CODE) instead of failing in Kokkos' initialization.

#if KMOE_CATCH2_MAJOR >= 3
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <KokkosMoE_DeviceRuntime.hpp>

#include <cstdio>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
// The tests check that a failed allocation is reported and leaves the library
// usable; AddressSanitizer's allocator aborts on an impossible size unless it
// is told to return null as the plain allocator does.
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif

int main(int argc, char* argv[]) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // A GPU build's tests need a GPU on every rank (-1: a host build).
  int const devices = KokkosMoE::gpu_devices();
  int fewest = 0;
  MPI_Allreduce(&devices, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest == 0) {
    if (rank == 0) std::printf("kmoe test: no %s device on some rank: skipped\n", KokkosMoE::gpu_runtime());
    MPI_Finalize();
    return 77;
  }
  int result = 0;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    Catch::Session session;
    // Ranks other than 0 report only failures, so the log stays readable.
    std::vector<char*> args(argv, argv + argc);
    std::string const quiet = "--reporter=compact";
    if (rank != 0) args.push_back(const_cast<char*>(quiet.c_str()));
    int rc = session.applyCommandLine(static_cast<int>(args.size()), args.data());
    if (rc == 0) rc = session.run();
    MPI_Allreduce(&rc, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0 && result != rc) std::fprintf(stderr, "kmoe test: another rank failed (exit %d)\n", result);
  }
  MPI_Finalize();
  return result;
}
