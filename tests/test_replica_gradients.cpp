// Replica gradients: experts that EPLB replicates sum their weight gradients
// over their copies (on one rank or several); afterwards every copy holds
// bitwise the same sum (digest check), single-copy experts are untouched, a
// tampered copy is named on every rank, and gradients of another placement
// generation are refused.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Experts_ReplicaGradients.hpp>

#include <vector>

using namespace KokkosMoE;
using namespace KokkosMoE::Experts;

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

/// Gradient element i of tensor t of global slot s: a value exact in fp32
/// sums (small integers times a power of two), distinct per slot.
float value(int s, int t, std::size_t i) { return static_cast<float>((s * 7 + t * 3 + static_cast<int>(i % 11)) % 17 - 8) * 0.25f; }

void fill(ExpertGradients<MS>& g, Placement const& p, int rank) {
  auto hg = Kokkos::create_mirror_view(g.gate);
  auto hu = Kokkos::create_mirror_view(g.up);
  auto hd = Kokkos::create_mirror_view(g.down);
  std::vector<int> const& mine = p.slots_of_rank(rank);
  std::size_t const n = hg.extent(1) * hg.extent(2);
  for (std::size_t q = 0; q < mine.size(); ++q)
    for (std::size_t i = 0; i < n; ++i) {
      hg.data()[q * n + i] = value(mine[q], 0, i);
      hu.data()[q * n + i] = value(mine[q], 1, i);
      hd.data()[q * n + i] = value(mine[q], 2, i);
    }
  Kokkos::deep_copy(g.gate, hg);
  Kokkos::deep_copy(g.up, hu);
  Kokkos::deep_copy(g.down, hd);
}

}  // namespace

TEST_CASE("replicated experts sum their gradients over every copy", "[experts][backward][replicas][mpi]") {
  int const rank = kmoe_test::world_rank(), size = kmoe_test::world_size();
  int const E = 4, slots = size * ((E + 2 + size - 1) / size);  // at least two extra copies
  PlacementSpec spec;
  spec.physical_slots = slots;
  spec.ranks = size;
  spec.generation = 3;
  Placement const p = eplb_layer({40.0, 5.0, 3.0, 1.0}, spec).placement;
  int const local = p.num_slots_of_rank(rank);
  int const d = 3, dff = 5;
  ExpertGradients<MS> g("g", local, d, dff);
  fill(g, p, rank);
  ReplicaGradients rg(MPI_COMM_WORLD, p);
  bool replicated = false;
  for (auto const& set : rg.sets()) replicated = replicated || !set.experts.empty();
  CHECK(replicated);  // the hot expert has copies
  rg.reduce(Exec(), g, 3);
  CHECK_NOTHROW(rg.verify(MPI_COMM_WORLD, g));

  // Every local slot holds the sum over its expert's copies.
  auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g.gate);
  auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g.down);
  std::size_t const n = static_cast<std::size_t>(d * dff);
  std::vector<int> const& mine = p.slots_of_rank(rank);
  int wrong = 0;
  for (std::size_t q = 0; q < mine.size(); ++q) {
    int const e = p.slot(mine[q]).expert;
    for (std::size_t i = 0; i < n; ++i) {
      float want_g = 0, want_d = 0;
      for (int s : p.log2phy()[static_cast<std::size_t>(e)]) {
        if (s < 0) continue;  // padding of experts with fewer copies
        want_g += value(s, 0, i);
        want_d += value(s, 2, i);
      }
      wrong += hg.data()[q * n + i] != want_g || hd.data()[q * n + i] != want_d;
    }
  }
  CHECK(wrong == 0);

  SECTION("a tampered copy is named on every rank") {
    // The last rank changes one element of its first replicated slot.
    int tamper_slot = -1;
    for (std::size_t q = 0; q < mine.size() && tamper_slot < 0; ++q)
      if (p.logcnt()[static_cast<std::size_t>(p.slot(mine[q]).expert)] > 1) tamper_slot = static_cast<int>(q);
    int any = tamper_slot >= 0 && rank == size - 1 ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any) {
      if (tamper_slot >= 0 && rank == size - 1) {
        auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g.up);
        h.data()[static_cast<std::size_t>(tamper_slot) * n] += 1.0f;
        Kokkos::deep_copy(g.up, h);
      }
      CHECK_THROWS_WITH(rg.verify(MPI_COMM_WORLD, g), Catch::Matchers::Contains("expert"));
    }
  }
  SECTION("gradients of another generation are refused") {
    CHECK_THROWS_WITH(rg.reduce(Exec(), g, 4), Catch::Matchers::Contains("generation 4, the replica sets are of generation 3"));
  }
}
