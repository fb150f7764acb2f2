#ifndef KMOE_APP_HPP
#define KMOE_APP_HPP

// The frame every kmoe-* app shares: MPI, then Kokkos, then the app body;
// an exception becomes one line "<app> (rank r): <message>" on stderr and a
// non-zero exit code on that rank (library errors raised collectively reach
// every rank, so every rank prints and exits non-zero).

#include <KokkosMoE_Collective.hpp>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>
#include <exception>

namespace kmoe_app {

/// Runs body(rank) between MPI_Init/Kokkos initialization and finalization;
/// returns the exit code.
template <class Body>
int run(int argc, char* argv[], char const* name, Body&& body) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    int const rank = KokkosMoE::comm_rank(MPI_COMM_WORLD);
    try {
      rc = body(rank);
    } catch (std::exception const& e) {
      std::fprintf(stderr, "%s (rank %d): %s\n", name, rank, e.what());
      rc = 1;
    }
  }
  MPI_Finalize();
  return rc;
}

/// Parses the command line; returns -1 to go on, or the exit code (help: 0,
/// bad arguments: non-zero; rank 0 prints).
inline int parse(CLI::App& app, int argc, char* argv[], int rank) {
  try {
    app.parse(argc, argv);
  } catch (CLI::ParseError const& e) {
    return rank == 0 ? app.exit(e) : (e.get_exit_code() != 0 ? 2 : 0);
  }
  return -1;
}

}  // namespace kmoe_app

#endif
