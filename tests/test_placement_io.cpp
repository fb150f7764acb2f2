// Load files (JSON, HDF5 via the parallel HDF5 C API) and placement files:
// formats, round trips, and errors that every rank raises identically.

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_LoadEstimate.hpp>
#include <KokkosMoE_PlacementIO.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <hdf5.h>
#endif

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using namespace KokkosMoE;

namespace {

using Matrix = std::vector<std::vector<double>>;

std::string error_of_json(std::string const& text) {
  try {
    load_matrix_from_json(text, "x.json");
  } catch (Error const& e) {
    return e.what();
  }
  return "";
}

// A file name private to this rank count (np1 and np2 may run concurrently).
std::string temp_name(std::string const& stem) {
  return "test_placement_io_np" + std::to_string(kmoe_test::world_size()) + "_" + stem;
}

void write_text_rank0(std::string const& path, std::string const& text) {
  if (kmoe_test::world_rank() == 0) {
    std::ofstream out(path, std::ios::binary);
    out << text;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Every rank must get the same error (for a CollectiveError: the same origin
// message; what() also says which rank saw it).
template <class F>
std::string same_error_everywhere(F&& f) {
  std::string msg;
  try {
    f();
  } catch (CollectiveError const& e) {
    msg = e.origin_message();
  } catch (Error const& e) {
    msg = e.what();
  }
  auto const all = allgather_strings(MPI_COMM_WORLD, msg);
  for (auto const& m : all) CHECK(m == msg);
  return msg;
}

}  // namespace

TEST_CASE("Load JSON: formats and errors", "[placement][io]") {
  CHECK(load_matrix_from_json(R"({"layers": [{"load": [4, 2, 1, 1]}, {"load": [0.5, 1, 2, 3]}]})", "x") ==
        Matrix{{4, 2, 1, 1}, {0.5, 1, 2, 3}});
  CHECK(load_matrix_from_json(R"({"load": [4, 2, 1, 1]})", "x") == Matrix{{4, 2, 1, 1}});
  CHECK(load_matrix_from_json(R"({"provenance": {"phase": "decode"}, "load": [1, 2]})", "x") == Matrix{{1, 2}});

  CHECK(error_of_json("{\"load\": [1, 2,") .find("malformed load file 'x.json'") != std::string::npos);
  // A number beyond double's range is a malformed file, not an escaped parser exception.
  CHECK(error_of_json(R"({"load": [1, 6e6666]})").find("malformed load file 'x.json'") != std::string::npos);
  CHECK(error_of_json("[1, 2]").find("expected a JSON object with \"layers\" or \"load\", got array") != std::string::npos);
  CHECK(error_of_json(R"({"loads": [1]})").find("no \"layers\" or \"load\" key") != std::string::npos);
  CHECK(error_of_json(R"({"load": [1], "extra": 2})").find("unknown key \"extra\"") != std::string::npos);
  CHECK(error_of_json(R"({"load": [1, "a"]})").find("load[1] is \"a\", not a number") != std::string::npos);
  CHECK(error_of_json(R"({"load": [1, -3]})").find("load[1] = -3 (must be finite and >= 0)") != std::string::npos);
  CHECK(error_of_json(R"({"load": []})").find("\"load\" is empty") != std::string::npos);
  CHECK(error_of_json(R"({"load": 5})").find("\"load\" must be an array of numbers") != std::string::npos);
  CHECK(error_of_json(R"({"layers": []})").find("\"layers\" must be a non-empty array") != std::string::npos);
  CHECK(error_of_json(R"({"layers": [{"load": [1, 2]}, {"load": [1]}]})").find("layer 1: 1 experts, layer 0 has 2") !=
        std::string::npos);
  CHECK(error_of_json(R"({"layers": [{"lod": [1]}]})").find("layer 0: expected an object with \"load\"") !=
        std::string::npos);

  // Strict JSON: a key given twice, or a NUL byte (and whatever follows it).
  CHECK(error_of_json(R"({"load": [1, 2], "load": [3, 4]})").find("key \"load\" appears twice in one object") != std::string::npos);
  CHECK(error_of_json(R"({"layers": [{"load": [1], "load": [2]}]})").find("appears twice") != std::string::npos);
  CHECK(error_of_json(std::string("{\"load\": [1, 2]}\0garbage", 24)).find("a NUL byte at offset 16") != std::string::npos);

  // A load estimate writes the same format.
  auto est = LoadEstimate::cumulative(2, 3, "prefill", 1);
  est.observe(0, {{1, 2, 3}, {4, 5, 6}});
  CHECK(load_matrix_from_json(est.to_json(), "estimate") == est.loads());
}

TEST_CASE("Load files: collective reads, missing and malformed files", "[placement][io][mpi]") {
  std::string const json_path = temp_name("loads.json");
  write_text_rank0(json_path, R"({"layers": [{"load": [4, 2, 1, 1]}, {"load": [1, 1, 2, 4]}]})");
  CHECK(read_load_matrix(MPI_COMM_WORLD, json_path) == Matrix{{4, 2, 1, 1}, {1, 1, 2, 4}});

  std::string const missing = same_error_everywhere([&] { read_load_matrix(MPI_COMM_WORLD, "no/such/loads.json"); });
  CHECK(missing.find("cannot open load file 'no/such/loads.json'") != std::string::npos);

  std::string const bad_path = temp_name("bad.json");
  write_text_rank0(bad_path, "{\"load\": [4, 2,,]}");
  std::string const bad = same_error_everywhere([&] { read_load_matrix(MPI_COMM_WORLD, bad_path); });
  CHECK(bad.find("malformed load file '" + bad_path + "'") != std::string::npos);

  if (kmoe_test::world_rank() == 0) {
    std::remove(json_path.c_str());
    std::remove(bad_path.c_str());
  }
}

#ifdef KOKKOSMOE_HAVE_HDF5
TEST_CASE("Load files: HDF5 [L, E] and [E] datasets", "[placement][io][mpi][hdf5]") {
  REQUIRE(have_hdf5());
  std::string const path = temp_name("loads.h5");
  Matrix const m = {{4, 2, 1, 1}, {0.25, 1, 2, 4}, {0, 0, 0, 7}};
  write_load_matrix_hdf5(MPI_COMM_WORLD, path, m);
  CHECK(read_load_matrix(MPI_COMM_WORLD, path) == m);

  // A one-layer [E] dataset of int64 written with the plain HDF5 C API.
  std::string const path1 = temp_name("loads1d.h5");
  std::string const path_none = temp_name("noload.h5");
  if (kmoe_test::world_rank() == 0) {
    long long const counts[5] = {5, 0, 3, 9, 1};
    hsize_t dims[1] = {5};
    // The counts as the one dataset of a new file: "/load", and "/counts"
    // for a file without "/load".
    for (auto const& [path, name] : {std::pair{path1, "/load"}, std::pair{path_none, "/counts"}}) {
      hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
      hid_t sp = H5Screate_simple(1, dims, nullptr);
      hid_t d = H5Dcreate2(f, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(d, H5T_NATIVE_LLONG, H5S_ALL, H5S_ALL, H5P_DEFAULT, counts);
      H5Dclose(d);
      H5Sclose(sp);
      H5Fclose(f);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(read_load_matrix(MPI_COMM_WORLD, path1) == Matrix{{5, 0, 3, 9, 1}});
  std::string const none = same_error_everywhere([&] { read_load_matrix(MPI_COMM_WORLD, path_none); });
  CHECK(none.find("has no dataset \"/load\"") != std::string::npos);
  MPI_Barrier(MPI_COMM_WORLD);
  if (kmoe_test::world_rank() == 0) {
    std::remove(path.c_str());
    std::remove(path1.c_str());
    std::remove(path_none.c_str());
  }
}
#endif

TEST_CASE("Placement files: round trip and errors", "[placement][io]") {
  PlacementSpec spec = kmoe_test::eplb_spec(8, 2, 2, 4);
  spec.generation = 5;
  spec.version = 2;
  auto const layers = build_placements({{4, 2, 1, 1}, {1, 1, 2, 4}}, spec);
  std::vector<Placement> ps;
  for (auto const& l : layers) ps.push_back(l.placement.with_expert_digests({0xabc, 0xdef, 0x123, 0xfedcba9876543210ULL}, 2));
  auto const back = placements_from_json(placements_to_json(ps), "mem");
  REQUIRE(back.size() == 2);
  for (std::size_t l = 0; l < 2; ++l) {
    CHECK(back[l].generation() == 5);
    CHECK(back[l].phy2log() == ps[l].phy2log());
    CHECK(back[l].replica_rank() == ps[l].replica_rank());
    CHECK(back[l].log2phy() == ps[l].log2phy());
    for (int s = 0; s < ps[l].num_slots(); ++s) {
      CHECK(back[l].slot(s).rank == ps[l].slot(s).rank);
      CHECK(back[l].slot(s).node == ps[l].slot(s).node);
      CHECK(back[l].slot(s).digest == ps[l].slot(s).digest);
      CHECK(back[l].slot(s).version == 2);
    }
  }
  // Single-layer form, nodes from a rank -> node map.
  auto const one = placements_from_json(R"({"experts": 2, "ranks": 2, "slots": [{"expert": 1, "rank": 0}, {"expert": 0, "rank": 1}]})",
                                        "mem", {0, 1});
  REQUIRE(one.size() == 1);
  CHECK(one[0].slot(1).node == 1);
  CHECK(one[0].phy2log() == std::vector<int>{1, 0});

  auto err = [](std::string const& text) {
    try {
      placements_from_json(text, "p.json");
    } catch (Error const& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(err("{").find("malformed placement file 'p.json'") != std::string::npos);
  CHECK(err(R"({"ranks": 2, "slots": []})").find("missing \"experts\"") != std::string::npos);
  CHECK(err(R"({"experts": 1, "ranks": 1, "slots": [{"expert": 0}]})").find("slot 0: missing \"rank\"") != std::string::npos);
  CHECK(err(R"({"experts": 1, "ranks": 1, "slots": [{"expert": 0, "rank": 0, "digest": "xyz"}]})")
            .find("\"digest\" \"xyz\" is not 1-16 hex digits") != std::string::npos);
  CHECK(err(R"({"experts": 2, "ranks": 1, "slots": [{"expert": 0, "rank": 0}]})").find("expert 1 has no physical slot") !=
        std::string::npos);
  CHECK(err(R"({"experts": 1, "ranks": 1, "slots": [{"expert": 0, "rank": 0, "gpu": 1}]})").find("unknown key \"gpu\"") !=
        std::string::npos);
  CHECK(err(R"({"format": "other", "experts": 1, "ranks": 1, "slots": [{"expert": 0, "rank": 0}]})")
            .find("expected \"kokkosmoe-placement\"") != std::string::npos);
}
