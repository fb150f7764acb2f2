#ifndef KMOE_TEST_UTIL_HPP
#define KMOE_TEST_UTIL_HPP

// Small helpers shared by the tests: fixture loading and MPI facts.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Eplb.hpp>

#include <nlohmann/json.hpp>
#include <mpi.h>

#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kmoe_test {

/// The message of the CollectiveError that f throws (empty when it throws
/// none); then a barrier, so every rank is still in step.
template <class F>
std::string collective_error_of(F&& f) {
  std::string message;
  try {
    f();
  } catch (KokkosMoE::CollectiveError const& e) {
    message = e.what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return message;
}

/// Reads tests/data/fixtures/<name> (identical copies of the shared fixtures).
inline nlohmann::json fixture(std::string const& name) {
  std::string const path = std::string(KMOE_TEST_DATA_DIR) + "/fixtures/" + name;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open fixture " + path);
  return nlohmann::json::parse(in);
}

/// An EPLB placement spec: S physical slots, G expert groups, N nodes, R ranks.
inline KokkosMoE::PlacementSpec eplb_spec(int slots, int groups, int nodes, int ranks) {
  KokkosMoE::PlacementSpec spec;
  spec.physical_slots = slots;
  spec.groups = groups;
  spec.nodes = nodes;
  spec.ranks = ranks;
  return spec;
}

/// Same element count and the same bits (NaN payloads included); empty
/// sequences (a rank without tokens) are equal without touching their data.
template <class A, class B>
bool same_bits(A const& a, B const& b) {
  static_assert(sizeof(*a.data()) == sizeof(*b.data()), "same_bits compares sequences of equally sized elements");
  if (static_cast<std::size_t>(a.size()) != static_cast<std::size_t>(b.size())) return false;
  return a.size() == 0 || std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(*a.data())) == 0;
}

inline std::string data_path(std::string const& name) { return std::string(KMOE_TEST_DATA_DIR) + "/" + name; }

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace kmoe_test

#endif
