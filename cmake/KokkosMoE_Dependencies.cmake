# KokkosMoE_Dependencies.cmake
#
# Finds every dependency of KokkosMoE and defines the KokkosMoEDeps:: imported
# targets. Used by the build and, unchanged, by the installed package config so
# that a consumer sees the same targets.

include_guard(GLOBAL)
include(FeatureSummary)
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

include(${CMAKE_CURRENT_LIST_DIR}/KokkosMoE_FindKokkos.cmake)
add_feature_info(Kokkos ON "Kokkos ${KokkosMoE_KOKKOS_VERSION} (${KokkosMoE_KOKKOS_FLAVOR}, devices: ${KokkosMoE_KOKKOS_DEVICES})")
add_feature_info(Kokkos-Kernels KokkosMoE_HAVE_KOKKOSKERNELS "BLAS/cuBLAS path of the router logits and expert runners")

# --- MPI (required) ---------------------------------------------------------
find_package(MPI REQUIRED COMPONENTS C)
if(NOT TARGET KokkosMoEDeps::MPI)
  # C API only: keep the deprecated C++ bindings out of every translation unit.
  add_library(KokkosMoEDeps::MPI INTERFACE IMPORTED)
  set_target_properties(KokkosMoEDeps::MPI PROPERTIES
    INTERFACE_LINK_LIBRARIES MPI::MPI_C
    INTERFACE_COMPILE_DEFINITIONS "OMPI_SKIP_MPICXX=1;MPICH_SKIP_MPICXX=1")
endif()
add_feature_info(MPI ON "MPI ${MPI_C_VERSION} (${MPIEXEC_EXECUTABLE})")

# --- hwloc (required) -------------------------------------------------------
find_package(PkgConfig REQUIRED)
pkg_check_modules(KOKKOSMOE_HWLOC REQUIRED IMPORTED_TARGET GLOBAL hwloc>=2.0)
if(NOT TARGET KokkosMoEDeps::hwloc)
  add_library(KokkosMoEDeps::hwloc INTERFACE IMPORTED)
  set_target_properties(KokkosMoEDeps::hwloc PROPERTIES INTERFACE_LINK_LIBRARIES PkgConfig::KOKKOSMOE_HWLOC)
endif()
add_feature_info(hwloc ON "hwloc ${KOKKOSMOE_HWLOC_VERSION} topology discovery")

# --- deck and report formats (required) -------------------------------------
find_package(tomlplusplus REQUIRED)
find_package(nlohmann_json 3.9 REQUIRED)
add_feature_info(tomlplusplus ON "TOML input decks")
add_feature_info(nlohmann_json ON "JSON reports and fixtures")

# --- parallel HDF5 (option, default ON) -------------------------------------
set(KokkosMoE_HAVE_HDF5 OFF)
if(KokkosMoE_ENABLE_HDF5)
  set(HDF5_PREFER_PARALLEL TRUE)
  find_package(HDF5 COMPONENTS C)
  if(NOT HDF5_FOUND OR NOT HDF5_IS_PARALLEL)
    message(FATAL_ERROR "KokkosMoE: KokkosMoE_ENABLE_HDF5=ON needs a parallel HDF5 (Debian: libhdf5-openmpi-dev); "
                        "found: ${HDF5_FOUND}, parallel: ${HDF5_IS_PARALLEL}. Configure with -DKokkosMoE_ENABLE_HDF5=OFF to build without it.")
  endif()
  if(NOT TARGET KokkosMoEDeps::HDF5)
    add_library(KokkosMoEDeps::HDF5 INTERFACE IMPORTED)
    set_target_properties(KokkosMoEDeps::HDF5 PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${HDF5_C_INCLUDE_DIRS}"
      INTERFACE_LINK_LIBRARIES "${HDF5_C_LIBRARIES}"
      INTERFACE_COMPILE_DEFINITIONS "${HDF5_C_DEFINITIONS}")
  endif()
  set(KokkosMoE_HAVE_HDF5 ON)
endif()
add_feature_info(HDF5 KokkosMoE_HAVE_HDF5 "parallel HDF5 ${HDF5_VERSION}: expert weights and per-step reports")

# --- NCCL (option, default AUTO: on when Kokkos has CUDA and NCCL is found) --
if(NOT DEFINED KokkosMoE_ENABLE_NCCL)
  set(KokkosMoE_ENABLE_NCCL AUTO)
endif()
set(KokkosMoE_HAVE_NCCL OFF)
if(NOT KokkosMoE_ENABLE_NCCL STREQUAL "OFF")
  find_path(KOKKOSMOE_NCCL_INCLUDE_DIR nccl.h
            HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} /usr/local/cuda
            PATH_SUFFIXES include)
  find_library(KOKKOSMOE_NCCL_LIBRARY nccl
               HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} /usr/local/cuda
               PATH_SUFFIXES lib64 lib)
  set(_kmoe_nccl_found OFF)
  if(KOKKOSMOE_NCCL_INCLUDE_DIR AND KOKKOSMOE_NCCL_LIBRARY)
    set(_kmoe_nccl_found ON)
  endif()
  if(KokkosMoE_ENABLE_NCCL STREQUAL "ON" AND NOT KokkosMoE_KOKKOS_HAS_CUDA)
    message(FATAL_ERROR "KokkosMoE: KokkosMoE_ENABLE_NCCL=ON needs a Kokkos with the CUDA backend (devices: ${KokkosMoE_KOKKOS_DEVICES})")
  endif()
  if(KokkosMoE_ENABLE_NCCL STREQUAL "ON" AND NOT _kmoe_nccl_found)
    message(FATAL_ERROR "KokkosMoE: KokkosMoE_ENABLE_NCCL=ON but nccl.h/libnccl were not found (set NCCL_ROOT)")
  endif()
  if(KokkosMoE_KOKKOS_HAS_CUDA AND _kmoe_nccl_found)
    set(KokkosMoE_HAVE_NCCL ON)
    if(NOT TARGET KokkosMoEDeps::NCCL)
      add_library(KokkosMoEDeps::NCCL INTERFACE IMPORTED)
      set_target_properties(KokkosMoEDeps::NCCL PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${KOKKOSMOE_NCCL_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "${KOKKOSMOE_NCCL_LIBRARY}")
    endif()
  endif()
endif()
add_feature_info(NCCL KokkosMoE_HAVE_NCCL "NCCL transport (grouped ncclSend/ncclRecv on the execution space's stream)")

# --- cuBLAS (CUDA builds: the grouped runner's tensor-core path) ------------
# cublasGemmGroupedBatchedEx needs CUDA >= 12.5; older toolkits keep the
# portable kernel only.
set(KokkosMoE_HAVE_CUBLAS OFF)
if(KokkosMoE_KOKKOS_HAS_CUDA AND NOT KokkosMoE_ENABLE_CUBLAS STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND AND TARGET CUDA::cublas AND CUDAToolkit_VERSION VERSION_GREATER_EQUAL 12.5)
    set(KokkosMoE_HAVE_CUBLAS ON)
    if(NOT TARGET KokkosMoEDeps::cuBLAS)
      add_library(KokkosMoEDeps::cuBLAS INTERFACE IMPORTED)
      set_target_properties(KokkosMoEDeps::cuBLAS PROPERTIES INTERFACE_LINK_LIBRARIES CUDA::cublas)
    endif()
  elseif(KokkosMoE_ENABLE_CUBLAS STREQUAL "ON")
    message(FATAL_ERROR "KokkosMoE: KokkosMoE_ENABLE_CUBLAS=ON needs cuBLAS from a CUDA toolkit >= 12.5 "
                        "(found: ${CUDAToolkit_FOUND}, version ${CUDAToolkit_VERSION})")
  endif()
endif()
add_feature_info(cuBLAS KokkosMoE_HAVE_CUBLAS "grouped expert GEMM on tensor cores (cublasGemmGroupedBatchedEx)")

# --- CUDA-aware MPI (AUTO: ask the MPI at run time where it can tell) --------
if(NOT DEFINED KokkosMoE_CUDA_AWARE_MPI)
  set(KokkosMoE_CUDA_AWARE_MPI AUTO)
endif()
cmake_push_check_state(RESET)
set(CMAKE_REQUIRED_LIBRARIES KokkosMoEDeps::MPI)
check_cxx_source_compiles([[
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
int main() { return MPIX_Query_cuda_support(); }
]] KOKKOSMOE_HAVE_MPIX_QUERY_CUDA_SUPPORT)
cmake_pop_check_state()
set(KokkosMoE_CUDA_AWARE_MPI_MODE ${KokkosMoE_CUDA_AWARE_MPI})
if(KokkosMoE_KOKKOS_HAS_HIP)
  if(KokkosMoE_CUDA_AWARE_MPI STREQUAL "ON")
    set(KokkosMoE_CUDA_AWARE_MPI_MODE "ON (HIP device buffers straight to a GPU-aware MPI)")
  else()
    set(KokkosMoE_CUDA_AWARE_MPI_MODE "OFF (HIP: host staging)")
  endif()
elseif(NOT KokkosMoE_KOKKOS_HAS_CUDA)
  set(KokkosMoE_CUDA_AWARE_MPI_MODE "OFF (no CUDA backend)")
elseif(KokkosMoE_CUDA_AWARE_MPI STREQUAL "AUTO")
  if(KOKKOSMOE_HAVE_MPIX_QUERY_CUDA_SUPPORT)
    set(KokkosMoE_CUDA_AWARE_MPI_MODE "AUTO (MPIX_Query_cuda_support at run time)")
  else()
    set(KokkosMoE_CUDA_AWARE_MPI_MODE "AUTO (no MPIX_Query_cuda_support: host staging)")
  endif()
endif()
add_feature_info(CUDA-aware-MPI KokkosMoE_KOKKOS_HAS_GPU "device buffers to MPI: ${KokkosMoE_CUDA_AWARE_MPI_MODE}")
