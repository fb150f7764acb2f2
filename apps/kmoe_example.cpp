// kmoe-example: the smallest host code that uses the KokkosMoE layer API
// without a deck. Every rank owns its tokens; experts are placed round-robin
// over the ranks; one forward through router, exchange, experts and combine.
//
//   mpiexec -n 4 kmoe-example

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Layer.hpp>

#include "kmoe_app.hpp"

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  return kmoe_app::run(argc, argv, "kmoe-example", [&](int rank) {
    using namespace KokkosMoE;
    using Exec = Kokkos::DefaultExecutionSpace;
    using MS = Exec::memory_space;
    int const size = comm_size(MPI_COMM_WORLD);
    {
      int const d = 64, experts = 4 * size, top_k = 2, ffn = 128, tokens = 32;
      // 1. Where every rank runs, and the expert-parallel communicators.
      auto topo = Topology::Topology::discover(MPI_COMM_WORLD);
      Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
      // 2. Which rank holds which expert.
      std::vector<int> nodes;
      for (int r = 0; r < size; ++r) nodes.push_back(topo.node_of(r));
      Placement placement = Placement::round_robin(experts, size, nodes);
      // 3. The layer: router (softmax top-2), SwiGLU experts of this rank's slots.
      LayerConfig config;
      config.hidden = d;
      config.router.num_experts = experts;
      config.router.top_k = top_k;
      config.router.normalize = true;
      config.exchange.algorithm = Exchange::Algorithm::flat;  // transport: MPI (the default)
      std::vector<int> mine;
      for (int s : placement.slots_of_rank(rank)) mine.push_back(placement.slot(s).expert);
      Experts::ExpertWeights<float, MS> weights("example::experts", mine, d, ffn);
      weights.randomize(Exec(), /*seed=*/42);
      RowMatrix<float, MS> router_weight("example::router", experts, d);
      Kokkos::parallel_for(
          "example::router_init", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {experts, d}),
          KOKKOS_LAMBDA(int e, int c) { router_weight(e, c) = 0.01f * static_cast<float>((e * 7 + c * 13) % 17 - 8); });
      MoELayer<float> layer(config, comms, placement, router_weight, weights);
      // 4. One forward on this rank's tokens.
      RowMatrix<float, MS> hidden("example::hidden", tokens, d), out("example::out", tokens, d);
      Kokkos::parallel_for(
          "example::hidden_init", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {tokens, d}),
          KOKKOS_LAMBDA(int t, int c) { hidden(t, c) = 0.1f * static_cast<float>((t * 3 + c + rank) % 11 - 5); });
      StepRecord rec = layer.forward(Exec(), hidden, out);
      auto total = rec.ledger.reduced(MPI_COMM_WORLD);
      double sum = 0;
      Kokkos::parallel_reduce(
          "example::checksum", Kokkos::MDRangePolicy<Exec, Kokkos::Rank<2>>({0, 0}, {tokens, d}),
          KOKKOS_LAMBDA(int t, int c, double& s) { s += out(t, c) * out(t, c); }, sum);
      if (rank == 0)
        std::printf("kmoe-example: %d ranks, %d tokens each, %lld routes accepted on rank 0, %lld rows moved in total, "
                    "%.3f ms per forward on rank 0, |out|^2 on rank 0 = %.6g\n",
                    size, tokens, static_cast<long long>(rec.routes.accepted), static_cast<long long>(total.dispatch.useful_rows),
                    1e3 * rec.seconds.at("total"), sum);
    }
    return 0;
  });
}
