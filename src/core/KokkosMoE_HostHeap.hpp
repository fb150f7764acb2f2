#ifndef KOKKOSMOE_HOSTHEAP_HPP
#define KOKKOSMOE_HOSTHEAP_HPP

/// \file KokkosMoE_HostHeap.hpp
/// \brief The host heap of a long run: what it holds, and a fixed threshold
/// above which allocations are mapped pages of their own.
///
/// glibc maps large allocations (Kokkos host views among them) with mmap and
/// unmaps them when freed, but it raises that threshold to the size of every
/// mapped block freed, up to 32 MiB. After the first placement generation is
/// released, the next generation's weights and buffers come from the heap
/// arena instead, whose free pieces between live blocks stay resident: the
/// soak grew by about 8 MB over five generations while the bytes in use
/// stayed the same. A fixed threshold keeps the large buffers out of the
/// arena, so releasing them returns their pages. Call
/// stable_host_heap() once, early, in a process that rebuilds layers or
/// serves for a long time (kmoe-layer and `kmoe-bench soak` do).

#include <cstddef>
#include <string>

namespace KokkosMoE {

/// The process's host memory, in MiB; -1 where the platform does not say.
struct HostHeapStats {
  double resident_mb = -1;  ///< resident set (after free heap pages are returned)
  double shared_mb = -1;    ///< of which file-backed or shared pages (MPI's shared-memory segments, libraries)
  double in_use_mb = -1;    ///< heap bytes in use: arena blocks plus mapped blocks
  double arena_mb = -1;     ///< heap arena size (in use and free pieces)
  double mapped_mb = -1;    ///< blocks mapped by mmap on their own
};

/// The figures now; with glibc, free heap pages are returned to the system
/// first (malloc_trim), so that the resident figure is what the process
/// holds rather than what the allocator keeps.
HostHeapStats host_heap_stats();

/// Default threshold of stable_host_heap(): 1 MiB. Smaller blocks (step
/// metadata, MPI's own buffers) stay in the arena, where reuse is cheap.
inline constexpr std::size_t stable_mmap_threshold_bytes = std::size_t(1) << 20;

/// Fixes glibc's mmap threshold at `bytes` (which stops its sliding) unless
/// MALLOC_MMAP_THRESHOLD_ is set in the environment, which then wins.
/// Returns what holds, for reports: "mmap_threshold=2097152",
/// "mmap_threshold=<n> (environment)", or "unchanged (...)" where the C
/// library is not glibc or refuses.
std::string stable_host_heap(std::size_t bytes = stable_mmap_threshold_bytes);

}  // namespace KokkosMoE

#endif
