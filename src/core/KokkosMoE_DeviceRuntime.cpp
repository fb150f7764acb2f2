// GPU runtime calls outside Kokkos (see KokkosMoE_DeviceRuntime.hpp): the one
// place that names the CUDA and HIP runtime APIs.

#include <KokkosMoE_DeviceRuntime.hpp>

#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#elif defined(KOKKOS_ENABLE_HIP)
#include <hip/hip_runtime.h>
#endif

namespace KokkosMoE {

#if defined(KOKKOS_ENABLE_CUDA)

char const* gpu_runtime() { return "CUDA"; }

int gpu_devices() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  (void)cudaGetLastError();
  return devices;
}

double gpu_memory_used_mb() {
  Kokkos::fence("KokkosMoE::gpu_memory_used_mb");
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return -1.0;
  return static_cast<double>(total_bytes - free_bytes) / (1024.0 * 1024.0);
}

bool is_device_pointer(void const* p) {
  cudaPointerAttributes attributes;
  bool const device = p && cudaPointerGetAttributes(&attributes, p) == cudaSuccess && attributes.type == cudaMemoryTypeDevice;
  (void)cudaGetLastError();  // a host pointer the runtime does not know is not an error here
  return device;
}

std::string copy_device_to_host(void* dst, void const* src, std::size_t bytes) {
  Kokkos::fence("KokkosMoE::copy_device_to_host");
  cudaError_t const rc = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  return rc == cudaSuccess ? std::string() : std::string(cudaGetErrorString(rc));
}

#elif defined(KOKKOS_ENABLE_HIP)

char const* gpu_runtime() { return "HIP"; }

int gpu_devices() {
  int devices = 0;
  if (hipGetDeviceCount(&devices) != hipSuccess) devices = 0;
  (void)hipGetLastError();
  return devices;
}

double gpu_memory_used_mb() {
  Kokkos::fence("KokkosMoE::gpu_memory_used_mb");
  std::size_t free_bytes = 0, total_bytes = 0;
  if (hipMemGetInfo(&free_bytes, &total_bytes) != hipSuccess) return -1.0;
  return static_cast<double>(total_bytes - free_bytes) / (1024.0 * 1024.0);
}

bool is_device_pointer(void const* p) {
  hipPointerAttribute_t attributes;
  bool device = p && hipPointerGetAttributes(&attributes, p) == hipSuccess;
  // ROCm 6 renamed the field (memoryType -> type).
#if HIP_VERSION_MAJOR >= 6
  device = device && attributes.type == hipMemoryTypeDevice;
#else
  device = device && attributes.memoryType == hipMemoryTypeDevice;
#endif
  (void)hipGetLastError();  // a host pointer the runtime does not know is not an error here
  return device;
}

std::string copy_device_to_host(void* dst, void const* src, std::size_t bytes) {
  Kokkos::fence("KokkosMoE::copy_device_to_host");
  hipError_t const rc = hipMemcpy(dst, src, bytes, hipMemcpyDeviceToHost);
  return rc == hipSuccess ? std::string() : std::string(hipGetErrorString(rc));
}

#else

char const* gpu_runtime() { return "none"; }
int gpu_devices() { return -1; }
double gpu_memory_used_mb() { return -1.0; }
bool is_device_pointer(void const*) { return false; }
std::string copy_device_to_host(void*, void const*, std::size_t) { return "copy_device_to_host: this build has no GPU runtime"; }

#endif

}  // namespace KokkosMoE
