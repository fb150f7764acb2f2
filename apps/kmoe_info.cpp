// kmoe-info: what this build is and where every rank runs.
//
//   mpiexec -n 4 kmoe-info [--kokkos-...]
//   kmoe-info --build
//
// Rank 0 prints the build, the Kokkos configuration and the MPI size; then one
// line per rank (host, node, local rank, hwloc binding, NUMA, GPU, NIC).
// --build prints only the build line, without starting MPI or Kokkos: it
// works where the build's GPU is absent (a login node, a compile host).

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Topology.hpp>
#include <KokkosMoE_Version.hpp>

#include "kmoe_app.hpp"

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>

int main(int argc, char* argv[]) {
  if (argc == 2 && std::strcmp(argv[1], "--build") == 0) {
    std::cout << KokkosMoE::build_summary() << std::endl;
    return 0;
  }
  return kmoe_app::run(argc, argv, "kmoe-info", [&](int rank) {
    int const size = KokkosMoE::comm_size(MPI_COMM_WORLD);
    if (rank == 0) {
      std::cout << KokkosMoE::build_summary() << "\n";
      KokkosMoE::print_kokkos_configuration(std::cout);
      std::cout << "MPI: " << size << " rank" << (size > 1 ? "s" : "") << "\n";
    }
    auto const topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD);
    if (rank == 0) {
      auto const& hw = topo.node_hardware(0);
      std::cout << "nodes: " << topo.num_nodes() << "; node 0 hardware: " << hw.packages << " package(s), " << hw.numa_nodes
                << " NUMA node(s), " << hw.cores << " cores, " << hw.pus << " PUs, " << hw.gpus.size() << " GPU(s), "
                << hw.nics.size() << " NIC(s)\n";
      for (int r = 0; r < topo.size(); ++r) {
        auto const& rec = topo.rank(r);
        std::printf("rank %d/%d host=%s node=%d local_rank=%d/%d binding=%s%s cores=%d pus=%d numa=%d package=%d gpu=%s nic=%s\n", r,
                    size, rec.host.c_str(), rec.node, rec.local_rank, rec.local_size, rec.cpuset.c_str(),
                    rec.bound ? "" : " (unbound)", rec.bound_cores, rec.bound_pus, rec.numa, rec.package,
                    rec.gpu.empty() ? "-" : rec.gpu.c_str(), rec.nic.empty() ? "-" : rec.nic.c_str());
      }
      std::fflush(stdout);
    }
    return 0;
  });
}
