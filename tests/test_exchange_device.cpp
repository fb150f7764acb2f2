// Device transports (built with Kokkos CUDA or HIP): the NCCL transport (CUDA)
// and the MPI transport on device buffers (GPU-aware or staged through host
// mirrors, and staged on request) give the same rows as the host reference, for the
// flat, hierarchical and pooled-wave exchanges alike. Ranks
// that share a GPU get NCCL's refusal in words on every rank. Skipped (exit
// code 77) when no GPU is visible.

#include "kmoe_catch.hpp"
#include "kmoe_exchange_util.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Exchange.hpp>

#include <cstring>

using namespace KokkosMoE;
using namespace KokkosMoE::Exchange;

namespace {

std::vector<float> device_step(Topology::CommunicatorSet const& comms, Placement const& placement, int rank, TransportKind transport,
                               Algorithm algorithm, bool stage_through_host = false) {
  using DMS = Kokkos::DefaultExecutionSpace::memory_space;
  Kokkos::DefaultExecutionSpace exec;
  int const T = 6, k = 2, d = 8;
  RouteTable<DMS> table("t", T, k, placement.num_experts());
  auto he = Kokkos::create_mirror_view(table.expert);
  auto hg = Kokkos::create_mirror_view(table.gate);
  auto ha = Kokkos::create_mirror_view(table.accepted);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      he(t, j) = (t + 3 * j + rank) % placement.num_experts();
      hg(t, j) = 0.25f * (j + 1);
      ha(t, j) = 1;
    }
  Kokkos::deep_copy(table.expert, he);
  Kokkos::deep_copy(table.gate, hg);
  Kokkos::deep_copy(table.accepted, ha);
  RowMatrix<float, DMS> hidden("hidden", T, d);
  Kokkos::parallel_for("fill", Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {T, d}),
                       KOKKOS_LAMBDA(int t, int c) { hidden(t, c) = 0.5f * t - 0.25f * c + rank; });
  auto dp = make_device_placement<DMS>(placement);
  auto choice = make_replica_choice<DMS>(placement, rank, -1);
  auto rp = make_route_plan(exec, table, dp, choice, rank);
  auto plan = make_dispatch_plan(exec, rp, placement, comms.ep().peer_order());
  ExchangeConfig config;
  config.payload = PayloadType::fp32;
  config.return_payload = PayloadType::fp32;
  config.transport = transport;
  config.stage_through_host = stage_through_host;
  config.algorithm = algorithm;
  // Pooled waves: two, with static shapes too large for any drop.
  config.waves = 2;
  config.tokens_per_rank = T;
  config.top_k = k;
  config.sender_cf = 2.0 * comms.size();
  config.receiver_cf = 4.0 * comms.size();
  // Through the contract, as a layer holds it: the algorithm and the
  // transport chosen by configuration.
  auto x = make_exchange<float, Kokkos::DefaultExecutionSpace, DMS>(comms, placement, config);
  CHECK(x->transport() == transport);
  CHECK(x->algorithm() == algorithm);
  PayloadBuffer<DMS> returned(exec, "returned", PayloadType::fp32, d, plan.rows());
  for (int w = 0; w < x->waves(); ++w) {
    auto h = x->dispatch(exec, rp, plan, hidden, w);
    x->combine(exec, h, h.expert_rows, returned, {});  // identity experts
  }
  RowMatrix<float, DMS> out("out", T, d);
  combine(exec, rp, plan, returned, out);
  auto ho = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  return std::vector<float>(ho.data(), ho.data() + ho.size());
}

}  // namespace

TEST_CASE("device buffers: MPI (CUDA-aware or staged) and NCCL match", "[exchange][device]") {
  int const size = kmoe_test::world_size();
  int const rank = kmoe_test::world_rank();
  Topology::LayoutSpec s;
  s.kind = Topology::LayoutKind::virtual_nodes;
  s.ranks_per_node = 1;
  auto topo = Topology::Topology::discover(MPI_COMM_WORLD, s);
  Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, Topology::CommSpec{});
  Placement placement = Placement::round_robin(3 * size, size);
  std::vector<float> reference;
  for (Algorithm algorithm : {Algorithm::flat, Algorithm::hierarchical, Algorithm::pooled_wave}) {
    INFO("algorithm " << to_string(algorithm));
    auto mpi = device_step(comms, placement, rank, TransportKind::mpi, algorithm);
    // Identity experts: out = sum of gates * hidden = 0.75 * hidden.
    for (std::size_t i = 0; i < mpi.size(); ++i) {
      int const t = static_cast<int>(i) / 8, c = static_cast<int>(i) % 8;
      CHECK(mpi[i] == Approx(0.75 * (0.5 * t - 0.25 * c + rank)).margin(1e-5));
    }
    if (reference.empty()) reference = mpi;
    CHECK(kmoe_test::same_bits(mpi, reference));  // every algorithm gives the flat exchange's bits
    CHECK(kmoe_test::same_bits(device_step(comms, placement, rank, TransportKind::mpi, algorithm, /*stage_through_host=*/true), mpi));
#if defined(KOKKOSMOE_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
    std::string const conflict = nccl_device_conflict(comms.ep());
    if (conflict.empty()) {
      auto nccl = device_step(comms, placement, rank, TransportKind::nccl, algorithm);
      CHECK(kmoe_test::same_bits(nccl, mpi));
    } else {
      // Ranks sharing one GPU (a one-GPU machine at np 2): the same error on every rank.
      INFO(conflict);
      CHECK_THROWS_WITH(device_step(comms, placement, rank, TransportKind::nccl, algorithm),
                        Catch::Matchers::Contains("NCCL needs one GPU per rank"));
    }
#endif
  }
  INFO("CUDA-aware MPI: " << mpi_is_cuda_aware());
}
