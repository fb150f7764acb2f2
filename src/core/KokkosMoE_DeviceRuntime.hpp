#ifndef KOKKOSMOE_DEVICERUNTIME_HPP
#define KOKKOSMOE_DEVICERUNTIME_HPP

/// \file KokkosMoE_DeviceRuntime.hpp
/// \brief The few GPU runtime calls the library makes outside Kokkos, for
/// CUDA and HIP builds alike: how many GPUs a process sees, how much of its
/// GPU's memory is in use, whether a raw pointer is device memory and a copy
/// of device bytes to the host. In a host-only build there is no GPU
/// runtime: no device, no device pointer.

#include <cstddef>
#include <string>

namespace KokkosMoE {

/// \brief "CUDA", "HIP" or "none": the GPU runtime this build calls.
char const* gpu_runtime();

/// \brief GPUs this process sees (0 when the runtime finds none or fails);
/// -1 in a build without a GPU backend. Needs no Kokkos initialization.
int gpu_devices();

/// \brief Memory in use on the process's current GPU, MiB (every process on
/// that GPU counts); -1 without a GPU backend or when the runtime fails.
/// Fences the default execution space first.
double gpu_memory_used_mb();

/// \brief True when p points into memory of the GPU runtime that the host
/// cannot read directly (device memory); false for host and unknown
/// pointers, and always in a host-only build.
bool is_device_pointer(void const* p);

/// \brief Copies bytes from device memory to host memory; returns an empty
/// string, or the runtime's error.
std::string copy_device_to_host(void* dst, void const* src, std::size_t bytes);

}  // namespace KokkosMoE

#endif
