// kmoe-bench <mode> [options]: speed of each stage next to a baseline measured
// in the same run (dense BLAS GEMM, memcpy, raw MPI_Alltoallv).
//
//   kmoe-bench list            the modes
//   kmoe-bench <mode> --help   a mode's options

#include "../kmoe_app.hpp"
#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Version.hpp>

#include <cstdio>
#include <cstring>
#include <exception>

int main(int argc, char* argv[]) {
  if (!kmoe_app::start_mpi(argc, argv, "kmoe-bench")) return 1;
  int rc = 0;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    auto const& modes = kmoe_bench::registry();
    auto usage = [&] {
      if (rank != 0) return;
      std::printf("usage: kmoe-bench <mode> [options]\nmodes:\n");
      for (auto const& m : modes) std::printf("  %-10s %s\n", m.name.c_str(), m.help.c_str());
    };
    if (argc < 2 || !std::strcmp(argv[1], "list") || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
      usage();
      rc = argc < 2 ? 2 : 0;
    } else {
      bool found = false;
      for (auto const& m : modes) {
        if (m.name != argv[1]) continue;
        found = true;
        if (rank == 0) std::printf("# %s\n# mode %s\n", KokkosMoE::build_summary().c_str(), m.name.c_str());
        try {
          rc = m.run(argc - 1, argv + 1);
        } catch (std::exception const& e) {
          std::fprintf(stderr, "kmoe-bench %s (rank %d): %s\n", m.name.c_str(), rank, e.what());
          rc = 1;
        }
      }
      if (!found) {
        if (rank == 0) std::fprintf(stderr, "kmoe-bench: unknown mode '%s'\n", argv[1]);
        usage();
        rc = 2;
      }
    }
  }
  MPI_Finalize();
  return rc;
}
