#ifndef KOKKOSMOE_KOKKOSCOMPAT_HPP
#define KOKKOSMOE_KOKKOSCOMPAT_HPP

/// \file KokkosMoE_KokkosCompat.hpp
/// \brief The one place where Kokkos 3.4 (Debian/Trilinos) and Kokkos 4.x/5.x
/// differ for this project. Everything else uses the neutral names below.

#include <Kokkos_Core.hpp>

#include <cmath>
#include <string>

#if !defined(KOKKOS_VERSION)
#error "KokkosMoE needs KOKKOS_VERSION"
#endif

#if KOKKOS_VERSION >= 40000
#define KOKKOSMOE_KOKKOS_MODERN 1
#else
#define KOKKOSMOE_KOKKOS_MODERN 0
#endif

/// \brief 1 while compiling device code (CUDA/HIP/SYCL device pass), 0 on
/// host passes: host-only fast paths inside KOKKOS_INLINE_FUNCTIONs use
/// `#if !KOKKOSMOE_DEVICE_PASS` (Kokkos 3.4 has no KOKKOS_IF_ON_HOST). Inside
/// a lambda both branches must name the same captured variables: nvcc requires
/// the host and device passes to agree on the capture list.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
#define KOKKOSMOE_DEVICE_PASS 1
#else
#define KOKKOSMOE_DEVICE_PASS 0
#endif

namespace KokkosMoE {
namespace Compat {

// ---- math in kernels ------------------------------------------------------
#if KOKKOSMOE_KOKKOS_MODERN
KOKKOS_INLINE_FUNCTION float exp(float x) { return Kokkos::exp(x); }
KOKKOS_INLINE_FUNCTION double exp(double x) { return Kokkos::exp(x); }
KOKKOS_INLINE_FUNCTION float log(float x) { return Kokkos::log(x); }
KOKKOS_INLINE_FUNCTION float fabs(float x) { return Kokkos::fabs(x); }
KOKKOS_INLINE_FUNCTION double fabs(double x) { return Kokkos::fabs(x); }
KOKKOS_INLINE_FUNCTION float sqrt(float x) { return Kokkos::sqrt(x); }
KOKKOS_INLINE_FUNCTION float ceil(float x) { return Kokkos::ceil(x); }
KOKKOS_INLINE_FUNCTION float floor(float x) { return Kokkos::floor(x); }
KOKKOS_INLINE_FUNCTION bool isnan(float x) { return Kokkos::isnan(x); }
KOKKOS_INLINE_FUNCTION bool isinf(float x) { return Kokkos::isinf(x); }
KOKKOS_INLINE_FUNCTION bool isfinite(double x) { return Kokkos::isfinite(x); }
KOKKOS_INLINE_FUNCTION double nearbyint(double x) { return Kokkos::nearbyint(x); }
#else
KOKKOS_INLINE_FUNCTION float exp(float x) { return Kokkos::Experimental::exp(x); }
KOKKOS_INLINE_FUNCTION double exp(double x) { return Kokkos::Experimental::exp(x); }
KOKKOS_INLINE_FUNCTION float log(float x) { return Kokkos::Experimental::log(x); }
KOKKOS_INLINE_FUNCTION float fabs(float x) { return Kokkos::Experimental::fabs(x); }
KOKKOS_INLINE_FUNCTION double fabs(double x) { return Kokkos::Experimental::fabs(x); }
KOKKOS_INLINE_FUNCTION float sqrt(float x) { return Kokkos::Experimental::sqrt(x); }
KOKKOS_INLINE_FUNCTION float ceil(float x) { return Kokkos::Experimental::ceil(x); }
KOKKOS_INLINE_FUNCTION float floor(float x) { return Kokkos::Experimental::floor(x); }
KOKKOS_INLINE_FUNCTION bool isnan(float x) { return Kokkos::Experimental::isnan(x); }
KOKKOS_INLINE_FUNCTION bool isinf(float x) { return Kokkos::Experimental::isinf(x); }
KOKKOS_INLINE_FUNCTION bool isfinite(double x) { return Kokkos::Experimental::isfinite(x); }
KOKKOS_INLINE_FUNCTION double nearbyint(double x) { return Kokkos::Experimental::nearbyint(x); }
#endif

/// \brief a * b rounded on its own: never fused with a following add into one
/// FMA. Device compilers contract a * b + c by default (nvcc --fmad=true), the
/// host build does not; kernels whose bits must match the host's (the
/// combine's weighted sums, the router's exp polynomial) multiply with this.
KOKKOS_INLINE_FUNCTION float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

/// \brief min/max/clamp for kernels (Kokkos 3.4 has no Kokkos::min/max).
template <class T>
KOKKOS_INLINE_FUNCTION constexpr T min(T a, T b) { return b < a ? b : a; }
template <class T>
KOKKOS_INLINE_FUNCTION constexpr T max(T a, T b) { return a < b ? b : a; }
template <class T>
KOKKOS_INLINE_FUNCTION constexpr T clamp(T x, T lo, T hi) { return x < lo ? lo : (hi < x ? hi : x); }

/// \brief Fences one execution space instance; the label shows in Kokkos Tools
/// where the Kokkos version supports labelled fences.
template <class ExecutionSpace>
inline void fence(ExecutionSpace const& space, char const* label) {
#if KOKKOSMOE_KOKKOS_MODERN
  space.fence(label);
#else
  (void)label;
  space.fence();
#endif
}

/// \brief Fences every execution space instance (Kokkos::fence), labelled
/// where the Kokkos version supports it.
inline void fence_all(char const* label) {
#if KOKKOSMOE_KOKKOS_MODERN
  Kokkos::fence(label);
#else
  (void)label;
  Kokkos::fence();
#endif
}

/// \brief Kokkos profiling region as RAII (Kokkos 3.4 has no ScopedRegion).
class ScopedRegion {
 public:
  explicit ScopedRegion(std::string const& name) { Kokkos::Profiling::pushRegion(name); }
  ~ScopedRegion() { Kokkos::Profiling::popRegion(); }
  ScopedRegion(ScopedRegion const&) = delete;
  ScopedRegion& operator=(ScopedRegion const&) = delete;
};

/// \brief Rank of a View type (3.4 has no view.rank()).
template <class View>
inline constexpr int view_rank = static_cast<int>(View::rank);

/// \brief Default team size for a TeamPolicy (Kokkos::AUTO in both versions).
using Kokkos::AUTO;

}  // namespace Compat
}  // namespace KokkosMoE

#endif
