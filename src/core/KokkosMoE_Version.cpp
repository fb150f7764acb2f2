#include <KokkosMoE_GitHash.hpp>  // generated at build time
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Version.hpp>

#include <ostream>
#include <sstream>

namespace KokkosMoE {

char const* git_hash() { return KOKKOSMOE_GIT_HASH; }

std::string build_summary() {
  std::ostringstream os;
  os << "KokkosMoE " << KOKKOSMOE_VERSION_STRING << " (git " << git_hash() << ")"
     << " Kokkos " << KOKKOS_VERSION / 10000 << "." << KOKKOS_VERSION / 100 % 100 << "."
     << KOKKOS_VERSION % 100 << " [" << KOKKOSMOE_KOKKOS_FLAVOR << ", default exec "
     << Kokkos::DefaultExecutionSpace::name() << "]"
     << " KokkosKernels=" <<
#ifdef KOKKOSMOE_HAVE_KOKKOSKERNELS
      "on"
#else
      "off"
#endif
     << " HDF5=" <<
#ifdef KOKKOSMOE_HAVE_HDF5
      "on"
#else
      "off"
#endif
     << " NCCL=" <<
#ifdef KOKKOSMOE_HAVE_NCCL
      "on"
#else
      "off"
#endif
      ;
  return os.str();
}

void print_kokkos_configuration(std::ostream& os) { Kokkos::print_configuration(os, false); }

}  // namespace KokkosMoE
