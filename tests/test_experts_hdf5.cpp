// Expert weight checkpoints through parallel HDF5: a round trip at any rank
// count into a different slot layout (fp32 and bf16), and every way a file
// can be wrong (flipped bytes, wrong digest attribute, wrong shape, wrong
// dtype, missing file or dataset) rejected with a clear error on every rank.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <hdf5.h>
#endif

#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>
#include <vector>

using namespace KokkosMoE;
using namespace KokkosMoE::Experts;

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;
constexpr int num_experts = 6;

/// A file name unique to this test process group (rank 0's pid).
std::string temp_path(std::string const& tag) {
  long pid = static_cast<long>(getpid());
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return "kmoe_experts_" + tag + "_" + std::to_string(pid) + ".h5";
}

void remove_file(std::string const& path) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (kmoe_test::world_rank() == 0) std::remove(path.c_str());
  MPI_Barrier(MPI_COMM_WORLD);
}

/// Rank r stores the experts e with e % size == r, plus a replica of expert
/// (r + 1) % E: every expert is stored, some twice.
std::vector<int> save_layout() {
  int const rank = kmoe_test::world_rank(), size = kmoe_test::world_size();
  // At 4 ranks the last rank stores nothing (its expert 3 is rank 2's replica).
  if (size == 4 && rank == 3) return {};
  std::vector<int> e;
  for (int x = rank; x < num_experts; x += size) e.push_back(x);
  e.push_back((rank + 1) % num_experts);
  return e;
}

/// Another layout for loading: two experts per rank, reversed order; rank 1
/// of several loads nothing.
std::vector<int> load_layout() {
  int const rank = kmoe_test::world_rank(), size = kmoe_test::world_size();
  if (size > 1 && rank == 1) return {};
  return {(num_experts - 1 - rank) % num_experts, (2 * rank + 1) % num_experts};
}

template <class T>
bool same_content(ExpertWeights<T, Mem> const& a, ExpertWeights<T, Mem> const& b) {
  auto cmp = [](auto const& x, auto const& y) {
    auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
    auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    return kmoe_test::same_bits(hx, hy);
  };
  return cmp(a.gate(), b.gate()) && cmp(a.up(), b.up()) && cmp(a.down(), b.down());
}

/// Runs f; returns the message of the CollectiveError every rank must see
/// ("" when nothing was thrown).
template <class F>
std::string collective_failure(F&& f) {
  std::string msg;
  try {
    f();
  } catch (CollectiveError const& e) {
    msg = e.what();
  }
  // Every rank got the same outcome.
  int const failed = msg.empty() ? 0 : 1;
  int total = 0;
  MPI_Allreduce(&failed, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK((total == 0 || total == kmoe_test::world_size()));
  return msg;
}

template <class T>
void round_trip(std::string const& tag) {
  std::string const path = temp_path(tag);
  ExpertWeights<T, Mem> saved("saved", save_layout(), 24, 40);
  saved.randomize(1234, 7);
  saved.save(MPI_COMM_WORLD, path, num_experts);

  ExpertWeights<T, Mem> loaded("loaded", load_layout(), 24, 40);
  loaded.load(MPI_COMM_WORLD, path);
  ExpertWeights<T, Mem> expected("expected", load_layout(), 24, 40);
  expected.randomize(1234, 7);
  CHECK(same_content(loaded, expected));
  for (int q = 0; q < loaded.num_slots(); ++q) {
    CHECK(loaded.version(q) == 7);
    CHECK(loaded.digest(q) == expected.digest(q));
  }
  remove_file(path);
}

#ifdef KOKKOSMOE_HAVE_HDF5
/// Rank 0 edits the file serially between two barriers.
template <class F>
void edit_on_rank0(std::string const& path, F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (kmoe_test::world_rank() == 0) {
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(file >= 0);
    f(file);
    H5Fclose(file);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
#endif

}  // namespace

TEST_CASE("weights round trip through parallel HDF5 (fp32)", "[experts][hdf5]") {
#ifdef KOKKOSMOE_HAVE_HDF5
  round_trip<float>("fp32");
#else
  ExpertWeights<float, Mem> w("w", save_layout(), 4, 4);
  CHECK_THAT(collective_failure([&] { w.save(MPI_COMM_WORLD, "x.h5", num_experts); }),
             Catch::Matchers::Contains("built without HDF5"));
#endif
}

TEST_CASE("weights round trip through parallel HDF5 (bf16)", "[experts][hdf5][bf16]") {
#ifdef KOKKOSMOE_HAVE_HDF5
  round_trip<bf16_t>("bf16");
#endif
}

#ifdef KOKKOSMOE_HAVE_HDF5

TEST_CASE("a rank loading for a stale communicator epoch is rejected on every rank", "[experts][hdf5][fault]") {
  std::string const path = temp_path("epoch");
  ExpertWeights<float, Mem> saved("saved", save_layout(), 8, 12);
  saved.randomize(5, 1);
  saved.save(MPI_COMM_WORLD, path, num_experts);
  // The communicator set is rebuilt; one rank kept the old one.
  auto const topo = KokkosMoE::Topology::Topology::discover(MPI_COMM_WORLD);
  KokkosMoE::Topology::CommunicatorSet old_set(MPI_COMM_WORLD, topo, KokkosMoE::Topology::CommSpec());
  KokkosMoE::Topology::CommunicatorSet new_set(MPI_COMM_WORLD, topo, KokkosMoE::Topology::CommSpec());
  REQUIRE(new_set.epoch() != old_set.epoch());
  int const stale_rank = kmoe_test::world_size() > 1 ? 1 : -1;
  auto const& mine = kmoe_test::world_rank() == stale_rank ? old_set : new_set;
  ExpertWeights<float, Mem> w("loaded", load_layout(), 8, 12);
  Kokkos::deep_copy(w.gate(), 3.0f);
  std::string const msg = collective_failure([&] { w.load(MPI_COMM_WORLD, path, LoadContext{mine.epoch(), 4}); });
  if (stale_rank < 0) {
    CHECK(msg.empty());  // one rank: nothing can differ
  } else {
    CHECK_THAT(msg, Catch::Matchers::Contains("expert weights load of '" + path + "'") &&
                        Catch::Matchers::Contains("the ranks differ in communicator epoch;") &&
                        Catch::Matchers::Contains("rank 1: the ranks differ in communicator epoch; this rank holds communicator epoch " +
                                                  std::to_string(old_set.epoch()) + ", placement generation 4"));
    // Nothing was read.
    auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w.gate());
    for (std::size_t i = 0; i < hg.size(); ++i) REQUIRE(hg.data()[i] == 3.0f);
  }
  // With the live epoch everywhere, the same load succeeds.
  CHECK(collective_failure([&] { w.load(MPI_COMM_WORLD, path, LoadContext{new_set.epoch(), 4}); }).empty());
  remove_file(path);
}

TEST_CASE("damaged or mismatched checkpoints are rejected on every rank", "[experts][hdf5][errors]") {
  std::string const path = temp_path("bad");
  ExpertWeights<float, Mem> saved("saved", save_layout(), 8, 12);
  saved.randomize(99, 3);
  auto fresh = [] {
    // Every rank loads expert 2 (and its own first expert).
    return ExpertWeights<float, Mem>("loaded", {2, kmoe_test::world_rank() % num_experts}, 8, 12);
  };

  SECTION("a flipped byte in a dataset") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    edit_on_rank0(path, [](hid_t file) {
      hid_t d = H5Dopen2(file, "/w_up", H5P_DEFAULT);
      hid_t space = H5Dget_space(d);
      hsize_t const start[3] = {2, 5, 3}, count[3] = {1, 1, 1}, one = 1;
      H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr);
      hid_t mem = H5Screate_simple(1, &one, nullptr);
      float v = 0;
      H5Dread(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &v);
      unsigned char* bytes = reinterpret_cast<unsigned char*>(&v);
      bytes[0] ^= 0x01;  // one flipped bit in the lowest mantissa byte
      H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &v);
      H5Sclose(mem);
      H5Sclose(space);
      H5Dclose(d);
    });
    auto w = fresh();
    std::string const msg = collective_failure([&] { w.load(MPI_COMM_WORLD, path); });
    CHECK_THAT(msg, Catch::Matchers::Contains(path) && Catch::Matchers::Contains("dataset /w_up") &&
                        Catch::Matchers::Contains("content digest mismatch for expert 2"));
    // The tensors were not touched.
    CHECK(w.version(0) == 0);
  }

  SECTION("a wrong digest attribute") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    edit_on_rank0(path, [](hid_t file) {
      hid_t a = H5Aopen(file, "content_digest", H5P_DEFAULT);
      std::vector<unsigned long long> v(num_experts);
      H5Aread(a, H5T_NATIVE_ULLONG, v.data());
      v[2] ^= 0x10;
      H5Awrite(a, H5T_NATIVE_ULLONG, v.data());
      H5Aclose(a);
    });
    auto w = fresh();
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains("root attribute content_digest[2]") &&
                   Catch::Matchers::Contains("content digest mismatch for expert 2"));
  }

  SECTION("a wrong shape") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    ExpertWeights<float, Mem> w("wide", {1}, 16, 12);
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains("shape mismatch: the file has d = 8, d_ff = 12; these weights have d = 16, d_ff = 12"));
  }

  SECTION("a dataset of the wrong shape") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    edit_on_rank0(path, [](hid_t file) {
      H5Ldelete(file, "/w_down", H5P_DEFAULT);
      hsize_t const dims[3] = {num_experts, 8, 13};
      hid_t space = H5Screate_simple(3, dims, nullptr);
      hid_t d = H5Dcreate2(file, "/w_down", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dclose(d);
      H5Sclose(space);
    });
    auto w = fresh();
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains("dataset /w_down: shape mismatch: the dataset has rank 3 shape [6, 8, 13], expected [6, 8, 12]"));
  }

  SECTION("a wrong dtype") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    ExpertWeights<bf16_t, Mem> w("bf16", {1}, 8, 12);
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains("dtype mismatch: the file stores float32; these weights are bfloat16"));
  }

  SECTION("a missing dataset") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    edit_on_rank0(path, [](hid_t file) { H5Ldelete(file, "/w_gate", H5P_DEFAULT); });
    auto w = fresh();
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains(path + "' has no dataset /w_gate"));
  }

  SECTION("a missing file") {
    auto w = fresh();
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path + ".missing"); }),
               Catch::Matchers::Contains(path + ".missing' does not exist"));
  }

  SECTION("an expert id beyond the file's experts") {
    saved.save(MPI_COMM_WORLD, path, num_experts);
    ExpertWeights<float, Mem> w("w", {num_experts + kmoe_test::world_rank()}, 8, 12);
    CHECK_THAT(collective_failure([&] { w.load(MPI_COMM_WORLD, path); }),
               Catch::Matchers::Contains("stores expert 6 but the file holds num_experts = 6"));
  }

  SECTION("saving needs every expert stored somewhere") {
    CHECK_THAT(collective_failure([&] { saved.save(MPI_COMM_WORLD, path, num_experts + 1); }),
               Catch::Matchers::Contains("expert 6 of num_experts = 7 is stored on no rank"));
  }

  SECTION("replicas that differ are not saved") {
    ExpertWeights<float, Mem> a("a", {0, 1, 2, 3, 4, 5}, 8, 12);
    a.randomize(kmoe_test::world_rank() == 0 ? 1 : 2, 3);
    std::string const msg = collective_failure([&] { a.save(MPI_COMM_WORLD, path, num_experts); });
    if (kmoe_test::world_size() > 1)
      CHECK_THAT(msg, Catch::Matchers::Contains("replicas of expert 0 differ"));
    else
      CHECK(msg.empty());
  }

  SECTION("scalar test experts have nothing to save") {
    auto s = ExpertWeights<float, Mem>::scalar("s", {0, 1, 2, 3, 4, 5}, 8, std::vector<float>(6, 1.0f));
    CHECK_THAT(collective_failure([&] { s.save(MPI_COMM_WORLD, path, num_experts); }),
               Catch::Matchers::Contains("scalar test experts"));
  }
  remove_file(path);
}

#endif
