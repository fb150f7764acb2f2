#include <KokkosMoE_DeviceRuntime.hpp>
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
  // What a GPU build runs: the expert and router GEMMs, and how device
  // buffers reach MPI.
  std::string const gpu = gpu_runtime();
  if (gpu != "none") {
    os << " GPU=" << gpu << " GEMM="
#if defined(KOKKOSMOE_HAVE_CUBLAS)
       << "cuBLAS"
#elif defined(KOKKOSMOE_HAVE_KOKKOSKERNELS)
       << "KokkosKernels"
#else
       << "portable (no vendor BLAS)"
#endif
       << " MPI device buffers="
#if KOKKOSMOE_CUDA_AWARE_MPI_POLICY == 1
       << "direct (forced)"
#elif KOKKOSMOE_CUDA_AWARE_MPI_POLICY == 0
       << "host staging"
#else
       << "run-time query"
#endif
        ;
  }
  return os.str();
}

void print_kokkos_configuration(std::ostream& os) { Kokkos::print_configuration(os, false); }

}  // namespace KokkosMoE
