// Collective errors reach every rank with the origin rank and message, and
// nothing hangs; checked MPI calls name the call and the communicator.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>

#include <string>

using namespace KokkosMoE;

TEST_CASE("an error on one rank is raised on every rank", "[collective]") {
  int const rank = kmoe_test::world_rank();
  int const size = kmoe_test::world_size();
  int const culprit = size > 1 ? 1 : 0;
  bool caught = false;
  try {
    collective(MPI_COMM_WORLD, "test region", [&] {
      KOKKOSMOE_REQUIRE(rank != culprit, "rank " << rank << " found a bad count");
    });
  } catch (CollectiveError const& e) {
    caught = true;
    CHECK(e.origin_rank() == culprit);
    CHECK(e.failed_ranks() == 1);
    CHECK(e.origin_message().find("rank " + std::to_string(culprit) + " found a bad count") != std::string::npos);
    std::string const what = e.what();
    CHECK(what.find("test region failed on rank " + std::to_string(culprit)) != std::string::npos);
  }
  CHECK(caught);
  // The communicator is still usable: nobody is stuck in a collective.
  int one = 1, total = 0;
  MPI_Allreduce(&one, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(total == size);
}

TEST_CASE("several failing ranks: the lowest one is named, all are counted", "[collective]") {
  int const rank = kmoe_test::world_rank();
  int const size = kmoe_test::world_size();
  try {
    collective(MPI_COMM_WORLD, "many", [&] {
      if (rank >= size / 2) throw std::runtime_error("bad on " + std::to_string(rank));
    });
    FAIL("no error raised");
  } catch (CollectiveError const& e) {
    CHECK(e.origin_rank() == size / 2);
    CHECK(e.failed_ranks() == size - size / 2);
    CHECK(e.origin_message() == "bad on " + std::to_string(size / 2));
  }
}

TEST_CASE("no error: the region returns normally on every rank", "[collective]") {
  int calls = 0;
  REQUIRE_NOTHROW(collective(MPI_COMM_WORLD, "quiet", [&] { ++calls; }));
  CHECK(calls == 1);
}

TEST_CASE("checked MPI calls name the call and the communicator", "[collective][mpi]") {
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(dup, "kmoe-test-dup");
  int const size = kmoe_test::world_size();
  int value = 0;
  try {
    KOKKOSMOE_MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT, size + 3, dup), dup);
    FAIL("invalid root accepted");
  } catch (Error const& e) {
    std::string const what = e.what();
    CHECK(what.find("MPI_Bcast") != std::string::npos);
    CHECK(what.find("kmoe-test-dup") != std::string::npos);
  }
  MPI_Comm_free(&dup);
}

TEST_CASE("string gather and broadcast", "[collective]") {
  int const rank = kmoe_test::world_rank();
  auto const all = allgather_strings(MPI_COMM_WORLD, std::string(static_cast<std::size_t>(rank), 'x') + std::to_string(rank));
  REQUIRE(static_cast<int>(all.size()) == kmoe_test::world_size());
  for (int r = 0; r < kmoe_test::world_size(); ++r)
    CHECK(all[r] == std::string(static_cast<std::size_t>(r), 'x') + std::to_string(r));
  CHECK(broadcast_string(MPI_COMM_WORLD, rank == 0 ? "deck text" : "") == "deck text");
}
