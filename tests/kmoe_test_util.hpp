#ifndef KMOE_TEST_UTIL_HPP
#define KMOE_TEST_UTIL_HPP

// Small helpers shared by the tests: fixture loading and MPI facts.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Eplb.hpp>

#include <nlohmann/json.hpp>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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

/// The labels of the Kokkos allocations (every memory space) made while
/// it lives, through the Kokkos Tools allocation callback (one at a time).
class AllocationLog {
 public:
  AllocationLog() {
    if (current_ != nullptr) throw std::logic_error("AllocationLog: one at a time");
    current_ = this;
    Kokkos::Tools::Experimental::set_allocate_data_callback(&record);
  }
  ~AllocationLog() {
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    current_ = nullptr;
  }
  AllocationLog(AllocationLog const&) = delete;
  AllocationLog& operator=(AllocationLog const&) = delete;

  std::vector<std::string> const& labels() const { return labels_; }
  /// "label (space, bytes)" per allocation, one per line.
  std::string text() const {
    std::ostringstream os;
    for (std::size_t i = 0; i < labels_.size(); ++i) os << labels_[i] << " (" << spaces_[i] << ", " << bytes_[i] << " bytes)\n";
    return os.str();
  }

 private:
  static void record(Kokkos_Profiling_SpaceHandle space, char const* label, void const*, std::uint64_t bytes) {
    if (current_ == nullptr) return;
    current_->labels_.emplace_back(label);
    current_->spaces_.emplace_back(space.name);
    current_->bytes_.push_back(bytes);
  }
  static inline AllocationLog* current_ = nullptr;
  std::vector<std::string> labels_, spaces_;
  std::vector<std::uint64_t> bytes_;
};

}  // namespace kmoe_test

#endif
