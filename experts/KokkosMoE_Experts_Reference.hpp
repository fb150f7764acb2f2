#ifndef KOKKOSMOE_EXPERTS_REFERENCE_HPP
#define KOKKOSMOE_EXPERTS_REFERENCE_HPP

/// \file KokkosMoE_Experts_Reference.hpp
/// \brief fp64 host reference of the expert function, for tests and
/// validation of the runners (and of whole layers built on them).

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>

#include <cmath>
#include <vector>

namespace KokkosMoE {
namespace Experts {

/// \brief Y [n * d] (row-major, fp64) = the expert of each row's segment
/// applied to X in double precision, from the stored (possibly bf16) weights
/// and inputs: SwiGLU when the weights have SwiGLU tensors, else the scalar
/// test experts. Copies everything to the host; O(n d d_ff).
/// \param weights local experts.
/// \param X [n, d] rows (float or bf16_t).
/// \param offsets [L + 1] segment offsets (validated).
/// \param down_magnitude optional out [n * d]: sum over j of |h_j| |down[c][j]|
///        (SwiGLU; 0 for scalar experts), the scale of the error that rounding
///        the intermediate rows h (e.g. to bf16) contributes to output c.
template <class WT, class MemorySpace, class XV, class OffV>
std::vector<double> reference_run(ExpertWeights<WT, MemorySpace> const& weights, XV const& X, OffV const& offsets,
                                  std::vector<double>* down_magnitude = nullptr) {
  int const L = weights.num_slots(), d = weights.d(), dff = weights.d_ff();
  auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), X);
  auto ho = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), offsets);
  std::size_t const n = X.extent(0);
  KOKKOSMOE_REQUIRE(static_cast<int>(X.extent(1)) == d && static_cast<int>(offsets.extent(0)) == L + 1 &&
                        ho(0) == 0 && static_cast<std::size_t>(ho(L)) == n,
                    "Experts::reference_run: X is " << X.extent(0) << "x" << X.extent(1) << ", offsets has "
                                                    << offsets.extent(0) << " entries, d = " << d << ", L = " << L);
  std::vector<double> Y(n * static_cast<std::size_t>(d), 0.0);
  if (down_magnitude) down_magnitude->assign(Y.size(), 0.0);
  if (!weights.has_swiglu()) {
    std::vector<float> const& s = weights.scalar_scale_host();
    for (int q = 0; q < L; ++q)
      for (index_t r = ho(q); r < ho(q + 1); ++r)
        for (int c = 0; c < d; ++c)
          Y[static_cast<std::size_t>(r) * d + c] = s[static_cast<std::size_t>(q)] * static_cast<double>(to_float(hx(r, c)));
    return Y;
  }
  auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), weights.gate());
  auto hu = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), weights.up());
  auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), weights.down());
  std::vector<double> h(static_cast<std::size_t>(dff));
  for (int q = 0; q < L; ++q)
    for (index_t r = ho(q); r < ho(q + 1); ++r) {
      for (int j = 0; j < dff; ++j) {
        double g = 0, u = 0;
        for (int k = 0; k < d; ++k) {
          double const x = to_float(hx(r, k));
          g += x * static_cast<double>(to_float(hg(q, j, k)));
          u += x * static_cast<double>(to_float(hu(q, j, k)));
        }
        h[static_cast<std::size_t>(j)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int c = 0; c < d; ++c) {
        double y = 0, m = 0;
        for (int j = 0; j < dff; ++j) {
          double const w = static_cast<double>(to_float(hd(q, c, j)));
          y += h[static_cast<std::size_t>(j)] * w;
          m += std::fabs(h[static_cast<std::size_t>(j)] * w);
        }
        Y[static_cast<std::size_t>(r) * d + c] = y;
        if (down_magnitude) (*down_magnitude)[static_cast<std::size_t>(r) * d + c] = m;
      }
    }
  return Y;
}

}  // namespace Experts
}  // namespace KokkosMoE

#endif
