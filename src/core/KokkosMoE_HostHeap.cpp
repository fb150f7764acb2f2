#include <KokkosMoE_HostHeap.hpp>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace KokkosMoE {

HostHeapStats host_heap_stats() {
  HostHeapStats s;
#if defined(__GLIBC__)
  malloc_trim(0);
#if __GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)
  struct mallinfo2 const mi = mallinfo2();
  double const mib = 1024.0 * 1024.0;
  s.in_use_mb = static_cast<double>(mi.uordblks + mi.hblkhd) / mib;
  s.arena_mb = static_cast<double>(mi.arena) / mib;
  s.mapped_mb = static_cast<double>(mi.hblkhd) / mib;
#endif
#endif
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = -1, shared = -1;
  double const page_mb = static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
  if (in >> pages >> resident) s.resident_mb = static_cast<double>(resident) * page_mb;
  if (in >> shared) s.shared_mb = static_cast<double>(shared) * page_mb;
  return s;
}

std::string stable_host_heap(std::size_t bytes) {
  if (char const* env = std::getenv("MALLOC_MMAP_THRESHOLD_")) return std::string("mmap_threshold=") + env + " (environment)";
#if defined(__GLIBC__)
  if (bytes > static_cast<std::size_t>(INT_MAX)) return "unchanged (threshold " + std::to_string(bytes) + " exceeds int)";
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1) return "mmap_threshold=" + std::to_string(bytes);
  return "unchanged (mallopt refused M_MMAP_THRESHOLD " + std::to_string(bytes) + ")";
#else
  return "unchanged (not glibc)";
#endif
}

}  // namespace KokkosMoE
