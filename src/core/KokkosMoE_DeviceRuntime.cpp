// GPU runtime calls outside Kokkos (see KokkosMoE_DeviceRuntime.hpp): the one
// place that names the CUDA and HIP runtime APIs. Both runtimes spell the
// calls used here alike but for the prefix (cudaX / hipX), so one body
// serves both through KOKKOSMOE_GPU(X).

#include <KokkosMoE_DeviceRuntime.hpp>

#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#define KOKKOSMOE_GPU(name) cuda##name
#define KOKKOSMOE_GPU_RUNTIME "CUDA"
using gpu_pointer_attributes = cudaPointerAttributes;
#elif defined(KOKKOS_ENABLE_HIP)
#include <hip/hip_runtime.h>
#define KOKKOSMOE_GPU(name) hip##name
#define KOKKOSMOE_GPU_RUNTIME "HIP"
using gpu_pointer_attributes = hipPointerAttribute_t;
#endif

namespace KokkosMoE {

#if defined(KOKKOSMOE_GPU_RUNTIME)

char const* gpu_runtime() { return KOKKOSMOE_GPU_RUNTIME; }

int gpu_devices() {
  int devices = 0;
  if (KOKKOSMOE_GPU(GetDeviceCount)(&devices) != KOKKOSMOE_GPU(Success)) devices = 0;
  (void)KOKKOSMOE_GPU(GetLastError)();
  return devices;
}

double gpu_memory_used_mb() {
  Kokkos::fence("KokkosMoE::gpu_memory_used_mb");
  std::size_t free_bytes = 0, total_bytes = 0;
  if (KOKKOSMOE_GPU(MemGetInfo)(&free_bytes, &total_bytes) != KOKKOSMOE_GPU(Success)) return -1.0;
  return static_cast<double>(total_bytes - free_bytes) / (1024.0 * 1024.0);
}

bool is_device_pointer(void const* p) {
  gpu_pointer_attributes attributes;
  bool device = p && KOKKOSMOE_GPU(PointerGetAttributes)(&attributes, p) == KOKKOSMOE_GPU(Success);
  // ROCm before 6 names the field memoryType.
#if defined(KOKKOS_ENABLE_HIP) && HIP_VERSION_MAJOR < 6
  device = device && attributes.memoryType == hipMemoryTypeDevice;
#else
  device = device && attributes.type == KOKKOSMOE_GPU(MemoryTypeDevice);
#endif
  (void)KOKKOSMOE_GPU(GetLastError)();  // a host pointer the runtime does not know is not an error here
  return device;
}

std::string copy_device_to_host(void* dst, void const* src, std::size_t bytes) {
  Kokkos::fence("KokkosMoE::copy_device_to_host");
  auto const rc = KOKKOSMOE_GPU(Memcpy)(dst, src, bytes, KOKKOSMOE_GPU(MemcpyDeviceToHost));
  return rc == KOKKOSMOE_GPU(Success) ? std::string() : std::string(KOKKOSMOE_GPU(GetErrorString)(rc));
}

#else

char const* gpu_runtime() { return "none"; }
int gpu_devices() { return -1; }
double gpu_memory_used_mb() { return -1.0; }
bool is_device_pointer(void const*) { return false; }
std::string copy_device_to_host(void*, void const*, std::size_t) { return "copy_device_to_host: this build has no GPU runtime"; }

#endif

}  // namespace KokkosMoE
