#ifndef KMOE_APP_HPP
#define KMOE_APP_HPP

// The frame every kmoe-* app shares: MPI, then Kokkos, then the app body;
// an exception becomes one line "<app> (rank r): <message>" on stderr and a
// non-zero exit code. Library errors raised collectively (CollectiveError)
// reach every rank, so every rank prints and finalizes; any other error is
// this rank's alone (a watchdog that gave up on a missing peer, a local
// failure): its peers may be waiting for it, so it aborts the job instead of
// finalizing, and every rank ends. A GPU build on a process that sees no
// GPU says so and exits 1 before Kokkos starts.
//
// Fault injection for tests (no special build): KOKKOSMOE_FAULT=<kind>:<rank>:<step>
// makes world rank <rank> fail at the start of step <step> of a stepping app
// (kmoe-layer): stop (SIGSTOP, never resumed), kill (SIGKILL) or throw (a
// local error on that rank only).

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_DeviceRuntime.hpp>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace kmoe_app {

/// Collective over MPI_COMM_WORLD (after MPI_Init, before Kokkos starts):
/// false, with one line per rank on stderr, where this is a GPU build and
/// some rank's process sees no GPU (Kokkos would abort there); true in a
/// host build.
inline bool every_rank_has_gpu(char const* name) {
  int fewest = 0, devices = KokkosMoE::gpu_devices();  // -1: a host build
  MPI_Allreduce(&devices, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (fewest != 0) return true;
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  std::fprintf(stderr, "%s (rank %d): this is a %s build and %s; run it where every rank has a GPU\n", name, world,
               KokkosMoE::gpu_runtime(), devices == 0 ? "this process sees no GPU" : "another rank sees no GPU");
  return false;
}

/// MPI_Init, then every_rank_has_gpu: false (MPI finalized, exit 1) where
/// a rank has no GPU to run on. Every app starts here.
inline bool start_mpi(int& argc, char**& argv, char const* name) {
  MPI_Init(&argc, &argv);
  if (every_rank_has_gpu(name)) return true;
  MPI_Finalize();
  return false;
}

/// Slowest rank's time of every stage (same key set on every rank).
inline std::map<std::string, double> slowest(std::map<std::string, double> const& local, MPI_Comm comm, double watchdog) {
  std::vector<std::string> keys;
  for (auto const& kv : local) keys.push_back(kv.first);
  std::vector<double> v, out;
  for (auto const& k : keys) v.push_back(local.at(k));
  int n = static_cast<int>(v.size()), nmax = 0;
  KokkosMoE::allreduce_watched(&n, &nmax, 1, MPI_INT, MPI_MAX, comm, "stage time reduction", watchdog);
  KOKKOSMOE_REQUIRE(n == nmax, "ranks timed different stages (" << n << " vs " << nmax << ")");
  out.resize(v.size());
  KokkosMoE::allreduce_watched(v.data(), out.data(), n, MPI_DOUBLE, MPI_MAX, comm, "stage time reduction", watchdog);
  std::map<std::string, double> r;
  for (std::size_t i = 0; i < keys.size(); ++i) r[keys[i]] = out[i];
  return r;
}


/// Collective: every rank was started with the same arguments (a job whose
/// ranks run different steps or decks would wait in different calls). Throws
/// the same error on every rank, naming the ranks that differ from rank 0.
inline void same_command_line(int argc, char* argv[]) {
  std::string mine;
  for (int i = 1; i < argc; ++i) mine += std::string(argv[i]) + '\n';
  auto const all = KokkosMoE::allgather_strings(MPI_COMM_WORLD, mine, 300.0);
  std::string differ;
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  KokkosMoE::agree(MPI_COMM_WORLD,
                   differ.empty() || KokkosMoE::comm_rank(MPI_COMM_WORLD) != 0
                       ? std::string()
                       : "ranks [" + differ + "] were started with other arguments than rank 0; every rank must run the same command",
                   "checking the command line", 300.0);
}

/// Runs body(rank) between MPI_Init/Kokkos initialization and finalization;
/// returns the exit code.
template <class Body>
int run(int argc, char* argv[], char const* name, Body&& body) {
  if (!start_mpi(argc, argv, name)) return 1;
  int rc = 0;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    int const rank = KokkosMoE::comm_rank(MPI_COMM_WORLD);
    try {
      same_command_line(argc, argv);
      rc = body(rank);
    } catch (KokkosMoE::CollectiveError const& e) {
      std::fprintf(stderr, "%s (rank %d): %s\n", name, rank, e.what());
      rc = 1;
    } catch (KokkosMoE::WatchdogError const& e) {
      // A peer did not answer. The other surviving ranks wait in the same
      // call; their watchdogs expire about as long after they entered it.
      // Give them that moment to report before ending the job.
      double const grace = std::min(10.0, std::max(2.0, e.limit()));
      std::fprintf(stderr, "%s (rank %d): %s\n%s (rank %d): aborting the job in %.0f s (a peer did not answer)\n", name, rank,
                   e.what(), name, rank, grace);
      std::fflush(stderr);
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::duration<double>(grace));
      MPI_Abort(MPI_COMM_WORLD, 1);
    } catch (std::exception const& e) {
      std::fprintf(stderr, "%s (rank %d): %s\n%s (rank %d): aborting the job (an error of this rank alone)\n", name, rank, e.what(),
                   name, rank);
      std::fflush(stderr);
      std::fflush(stdout);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  MPI_Finalize();
  return rc;
}

/// The fault of KOKKOSMOE_FAULT for this rank and step, if any (see above).
inline void fault_point(int rank, int step) {
  char const* spec = std::getenv("KOKKOSMOE_FAULT");
  if (!spec) return;
  std::string const s(spec);
  auto const a = s.find(':'), b = s.find(':', a == std::string::npos ? a : a + 1);
  if (a == std::string::npos || b == std::string::npos) return;
  std::string const kind = s.substr(0, a);
  if (std::atoi(s.substr(a + 1, b - a - 1).c_str()) != rank || std::atoi(s.substr(b + 1).c_str()) != step) return;
  std::fprintf(stderr, "fault injection: %s on rank %d at step %d\n", kind.c_str(), rank, step);
  std::fflush(stderr);
  if (kind == "stop") std::raise(SIGSTOP);
  if (kind == "kill") std::raise(SIGKILL);
  if (kind == "throw") throw KokkosMoE::Error("fault injection: rank " + std::to_string(rank) + " fails alone at step " + std::to_string(step));
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
