// Consumer of the installed KokkosMoE package: initializes MPI and Kokkos,
// converts a payload value and raises a collective error, then says so.
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Version.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  MPI_Init(&argc, &argv);
  int ok = 1;
  {
    Kokkos::ScopeGuard guard(argc, argv);
    int const rank = KokkosMoE::comm_rank(MPI_COMM_WORLD);
    if (KokkosMoE::to_float(KokkosMoE::to_bf16(1.5f)) != 1.5f) ok = 0;
    try {
      KokkosMoE::collective(MPI_COMM_WORLD, "consumer check", [&] {
        KOKKOSMOE_REQUIRE(rank != 0, "rank 0 refuses");
      });
      ok = 0;
    } catch (KokkosMoE::CollectiveError const& e) {
      if (e.origin_rank() != 0) ok = 0;
    }
    if (rank == 0) std::printf("%s\n", KokkosMoE::build_summary().c_str());
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all && KokkosMoE::comm_rank(MPI_COMM_WORLD) == 0) std::printf("consumer ok\n");
  MPI_Finalize();
  return all ? 0 : 1;
}
