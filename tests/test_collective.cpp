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

TEST_CASE("agree: problems of several ranks, none, and a rank that never arrives", "[collective]") {
  int const rank = kmoe_test::world_rank();
  int const size = kmoe_test::world_size();
  REQUIRE_NOTHROW(agree(MPI_COMM_WORLD, "", "nothing wrong", 5.0));
  CHECK(problem_of([] {}).empty());
  CHECK(problem_of([] { KOKKOSMOE_THROW("bad " << 3); }).find("bad 3") != std::string::npos);
  try {
    agree(MPI_COMM_WORLD, rank == size - 1 ? "last rank's problem" : "", "agreement test", 5.0);
    FAIL("no error raised");
  } catch (CollectiveError const& e) {
    CHECK(e.origin_rank() == size - 1);
    CHECK(e.failed_ranks() == 1);
    CHECK(e.origin_message() == "last rank's problem");
    CHECK(std::string(e.what()).find("agreement test failed on rank " + std::to_string(size - 1)) != std::string::npos);
  }
  if (size < 2) return;
  // Rank 0 never enters: the others report it within the watchdog instead
  // of waiting forever, naming the region and the communicator.
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MPI_Comm_set_name(dup, "kmoe-test-agree");
  if (rank != 0) {
    bool caught = false;
    try {
      agree(dup, "", "step 7 agreement", 0.5);
    } catch (CollectiveError const&) {
      FAIL("a collective error without the missing rank");
    } catch (Error const& e) {
      caught = true;
      std::string const what = e.what();
      CHECK(what.find("step 7 agreement") != std::string::npos);
      CHECK(what.find("kmoe-test-agree") != std::string::npos);
      CHECK(what.find("did not enter this call") != std::string::npos);
    }
    CHECK(caught);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // The abandoned reduction completes once rank 0 joins; the communicator is
  // kept (a collective cannot be cancelled, and the others' requests are
  // still progressed by MPI after the watchdog gave up on them).
  if (rank == 0) {
    int mine = size, lowest = 0;
    MPI_Request req;
    MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, dup, &req);
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  }
  MPI_Barrier(MPI_COMM_WORLD);
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
