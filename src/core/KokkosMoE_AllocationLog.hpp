#ifndef KOKKOSMOE_ALLOCATIONLOG_HPP
#define KOKKOSMOE_ALLOCATIONLOG_HPP

/// \file KokkosMoE_AllocationLog.hpp
/// \brief The Kokkos allocations (every memory space) made while a log
/// lives, seen through the Kokkos Tools allocation callback.
///
/// On a GPU every allocation is a cudaMalloc and every release a
/// device-wide synchronisation (a host view's release fences too), so a
/// step that allocates cannot overlap anything. Repeated layer steps
/// allocate nothing once their workspaces have their sizes; this is how
/// tests and benchmarks see it. One log at a time; a profiling tool's own
/// allocation callback (KOKKOS_TOOLS_LIBS) still sees every allocation and
/// gets its callback back when the log goes.

#include <KokkosMoE_Error.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace KokkosMoE {

class AllocationLog {
 public:
  struct Entry {
    std::string label;
    std::string space;
    std::uint64_t bytes = 0;
  };

  AllocationLog() {
    KOKKOSMOE_REQUIRE(current_ == nullptr, "AllocationLog: another log is recording; one at a time");
    previous_ = Kokkos::Tools::Experimental::get_callbacks().allocate_data;
    current_ = this;
    Kokkos::Tools::Experimental::set_allocate_data_callback(&record);
  }
  ~AllocationLog() {
    Kokkos::Tools::Experimental::set_allocate_data_callback(previous_);
    current_ = nullptr;
  }
  AllocationLog(AllocationLog const&) = delete;
  AllocationLog& operator=(AllocationLog const&) = delete;

  std::vector<Entry> const& entries() const { return entries_; }
  std::size_t count() const { return entries_.size(); }
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (auto const& e : entries_) b += e.bytes;
    return b;
  }
  /// "label (space, bytes)" per allocation, one per line.
  std::string text() const {
    std::ostringstream os;
    for (auto const& e : entries_) os << e.label << " (" << e.space << ", " << e.bytes << " bytes)\n";
    return os.str();
  }

 private:
  static void record(Kokkos_Profiling_SpaceHandle space, char const* label, void const* ptr, std::uint64_t bytes) {
    if (current_ == nullptr) return;
    current_->entries_.push_back(Entry{label, space.name, bytes});
    if (current_->previous_ != nullptr) current_->previous_(space, label, ptr, bytes);
  }

  static inline AllocationLog* current_ = nullptr;
  Kokkos_Profiling_allocateDataFunction previous_ = nullptr;
  std::vector<Entry> entries_;
};

}  // namespace KokkosMoE

#endif
