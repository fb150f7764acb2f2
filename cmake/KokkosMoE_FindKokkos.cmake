# KokkosMoE_FindKokkos.cmake
#
# Finds Kokkos (and Kokkos Kernels) in either of two shapes and defines the same
# imported targets for both, so that nothing else in the build (or in a consumer
# of the installed package) depends on which one was found:
#
#   KokkosMoEDeps::Kokkos         Kokkos core, containers, algorithms
#   KokkosMoEDeps::KokkosKernels  Kokkos Kernels (only when found and enabled)
#
# 1. A standalone Kokkos >= 4 (given with -DKokkos_ROOT=...): its Kokkos::kokkos
#    and Kokkos::kokkoskernels targets are wrapped.
# 2. Trilinos' TriBITS export (Debian's libtrilinos-kokkos-dev, Kokkos 3.4.1):
#    the variables Kokkos_INCLUDE_DIRS / Kokkos_LIBRARIES and
#    KokkosKernels_LIBRARIES / KokkosKernels_TPL_LIBRARIES are used. Its
#    Kokkos::kokkos target points at a non-existent include path and is never
#    linked.
#
# Results: KokkosMoE_KOKKOS_VERSION, KokkosMoE_KOKKOS_FLAVOR (standalone|trilinos),
# KokkosMoE_KOKKOS_DEVICES, KokkosMoE_KOKKOS_HAS_CUDA, KokkosMoE_KOKKOS_HAS_HIP,
# KokkosMoE_KOKKOS_HAS_GPU (CUDA or HIP), KokkosMoE_KOKKOS_HAS_OPENMP,
# KokkosMoE_HAVE_KOKKOSKERNELS.
#
# Input: KokkosMoE_ENABLE_KOKKOSKERNELS (AUTO|ON|OFF).

include_guard(GLOBAL)

find_package(Kokkos REQUIRED)

if(TARGET Kokkos::kokkoscore AND NOT DEFINED Kokkos_LIBRARIES)
  set(KokkosMoE_KOKKOS_FLAVOR standalone)
  if(Kokkos_VERSION VERSION_LESS 4.0)
    message(FATAL_ERROR "KokkosMoE: a standalone Kokkos must be 4.0 or newer (found ${Kokkos_VERSION} at ${Kokkos_DIR})")
  endif()
elseif(DEFINED Kokkos_LIBRARIES AND DEFINED Kokkos_INCLUDE_DIRS)
  set(KokkosMoE_KOKKOS_FLAVOR trilinos)
else()
  message(FATAL_ERROR "KokkosMoE: Kokkos at ${Kokkos_DIR} defines neither Kokkos::kokkoscore nor the TriBITS variables Kokkos_LIBRARIES/Kokkos_INCLUDE_DIRS")
endif()
set(KokkosMoE_KOKKOS_VERSION ${Kokkos_VERSION})
# Shared Kokkos libraries (Trilinos' are; a standalone build's when built so):
# what a shared library or Python module linking KokkosMoE needs.
set(KokkosMoE_KOKKOS_SHARED ON)
if(KokkosMoE_KOKKOS_FLAVOR STREQUAL "standalone")
  get_target_property(_kmoe_kokkos_type Kokkos::kokkoscore TYPE)
  if(NOT _kmoe_kokkos_type STREQUAL "SHARED_LIBRARY")
    set(KokkosMoE_KOKKOS_SHARED OFF)
  endif()
endif()
set(KokkosMoE_KOKKOS_DEVICES ${Kokkos_DEVICES})

set(KokkosMoE_KOKKOS_HAS_CUDA OFF)
set(KokkosMoE_KOKKOS_HAS_HIP OFF)
set(KokkosMoE_KOKKOS_HAS_OPENMP OFF)
if(CUDA IN_LIST Kokkos_DEVICES OR Kokkos_ENABLE_CUDA)
  set(KokkosMoE_KOKKOS_HAS_CUDA ON)
endif()
if(HIP IN_LIST Kokkos_DEVICES OR Kokkos_ENABLE_HIP)
  set(KokkosMoE_KOKKOS_HAS_HIP ON)
endif()
set(KokkosMoE_KOKKOS_HAS_GPU OFF)
if(KokkosMoE_KOKKOS_HAS_CUDA OR KokkosMoE_KOKKOS_HAS_HIP)
  set(KokkosMoE_KOKKOS_HAS_GPU ON)
endif()
if(OPENMP IN_LIST Kokkos_DEVICES OR Kokkos_ENABLE_OPENMP)
  set(KokkosMoE_KOKKOS_HAS_OPENMP ON)
endif()

if(NOT TARGET KokkosMoEDeps::Kokkos)
  add_library(KokkosMoEDeps::Kokkos INTERFACE IMPORTED)
  if(KokkosMoE_KOKKOS_FLAVOR STREQUAL "standalone")
    set_target_properties(KokkosMoEDeps::Kokkos PROPERTIES INTERFACE_LINK_LIBRARIES Kokkos::kokkos)
  else()
    set(_kmoe_kokkos_libs)
    foreach(_lib IN LISTS Kokkos_LIBRARIES)
      if(TARGET ${_lib})
        list(APPEND _kmoe_kokkos_libs ${_lib})
      else()
        find_library(_kmoe_lib_${_lib} NAMES ${_lib} HINTS ${Kokkos_LIBRARY_DIRS} REQUIRED)
        list(APPEND _kmoe_kokkos_libs ${_kmoe_lib_${_lib}})
      endif()
    endforeach()
    set_target_properties(KokkosMoEDeps::Kokkos PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${Kokkos_INCLUDE_DIRS}"
      INTERFACE_LINK_LIBRARIES "${_kmoe_kokkos_libs};${Kokkos_TPL_LIBRARIES}")
  endif()
endif()

# Kokkos Kernels
if(NOT DEFINED KokkosMoE_ENABLE_KOKKOSKERNELS)
  set(KokkosMoE_ENABLE_KOKKOSKERNELS AUTO)
endif()
set(KokkosMoE_HAVE_KOKKOSKERNELS OFF)
if(NOT KokkosMoE_ENABLE_KOKKOSKERNELS STREQUAL "OFF")
  # A standalone Kokkos: look for Kokkos Kernels in the same install prefix
  # first, before any system copy (e.g. Debian's Trilinos one).
  set(_kmoe_kk_hints)
  if(KokkosMoE_KOKKOS_FLAVOR STREQUAL "standalone" AND Kokkos_DIR)
    get_filename_component(_kmoe_kk_cmakedir "${Kokkos_DIR}/.." ABSOLUTE)
    get_filename_component(_kmoe_kk_prefix "${Kokkos_DIR}/../../.." ABSOLUTE)
    set(_kmoe_kk_hints HINTS "${_kmoe_kk_cmakedir}" "${_kmoe_kk_prefix}")
  endif()
  if(KokkosMoE_ENABLE_KOKKOSKERNELS STREQUAL "ON")
    find_package(KokkosKernels REQUIRED ${_kmoe_kk_hints})
  else()
    find_package(KokkosKernels QUIET ${_kmoe_kk_hints})
  endif()
  # Kokkos Kernels must come from the same distribution as Kokkos: a
  # standalone Kokkos takes Kokkos::kokkoskernels, Trilinos' Kokkos takes the
  # TriBITS variables. Anything else would mix two Kokkos builds.
  set(_kmoe_kk_ok OFF)
  if(KokkosKernels_FOUND)
    if(KokkosMoE_KOKKOS_FLAVOR STREQUAL "standalone" AND TARGET Kokkos::kokkoskernels AND NOT DEFINED KokkosKernels_LIBRARIES)
      set(_kmoe_kk_ok ON)
    elseif(KokkosMoE_KOKKOS_FLAVOR STREQUAL "trilinos" AND DEFINED KokkosKernels_LIBRARIES)
      set(_kmoe_kk_ok ON)
    else()
      set(_kmoe_kk_msg "Kokkos Kernels at ${KokkosKernels_DIR} does not belong to the ${KokkosMoE_KOKKOS_FLAVOR} Kokkos at ${Kokkos_DIR}")
      if(KokkosMoE_ENABLE_KOKKOSKERNELS STREQUAL "ON")
        message(FATAL_ERROR "KokkosMoE: ${_kmoe_kk_msg}; give -DKokkosKernels_ROOT")
      endif()
      message(STATUS "KokkosMoE: ${_kmoe_kk_msg}; building without Kokkos Kernels")
    endif()
  endif()
  if(_kmoe_kk_ok)
    if(NOT TARGET KokkosMoEDeps::KokkosKernels)
      add_library(KokkosMoEDeps::KokkosKernels INTERFACE IMPORTED)
      if(KokkosMoE_KOKKOS_FLAVOR STREQUAL "standalone")
        set_target_properties(KokkosMoEDeps::KokkosKernels PROPERTIES
          INTERFACE_LINK_LIBRARIES Kokkos::kokkoskernels)
      else()
        set(_kmoe_kk_libs)
        foreach(_lib IN LISTS KokkosKernels_LIBRARIES)
          if(TARGET ${_lib})
            list(APPEND _kmoe_kk_libs ${_lib})
          endif()
        endforeach()
        set_target_properties(KokkosMoEDeps::KokkosKernels PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${KokkosKernels_INCLUDE_DIRS}"
          INTERFACE_LINK_LIBRARIES "${_kmoe_kk_libs};${KokkosKernels_TPL_LIBRARIES};KokkosMoEDeps::Kokkos")
      endif()
    endif()
    set(KokkosMoE_HAVE_KOKKOSKERNELS ON)
  endif()
endif()
