#ifndef KOKKOSMOE_TYPES_HPP
#define KOKKOSMOE_TYPES_HPP

/// \file KokkosMoE_Types.hpp
/// \brief View aliases and small value types shared by every stage.
///
/// Row-major ([rows, width], LayoutRight) is used for every payload matrix so
/// that a row is contiguous: gathers, transports and BLAS all rely on it.

#include <KokkosMoE_KokkosCompat.hpp>

#include <cstdint>

namespace KokkosMoE {

/// \brief Row counts, offsets and route ids (64-bit: T*k can exceed 2^31).
using index_t = std::int64_t;

template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using default_memory_space_t = MemorySpace;

/// \brief [rows, width] row-major matrix.
template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using RowMatrix = Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace>;

/// \brief Vector.
template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using Vector = Kokkos::View<T*, MemorySpace>;

/// \brief Attempted, accepted and dropped route counts of one admission.
/// Invariant: accepted + dropped == attempted.
struct RouteCounts {
  index_t attempted = 0;
  index_t accepted = 0;
  index_t dropped = 0;
};

/// \brief The router's output for T tokens and top-k: per (token, k-slot) the
/// logical expert id, the FP32 gate and whether the route was admitted, plus
/// accepted routes per logical expert. k-slot order is selection order
/// (descending selection score, ties to the lower expert id). A dropped route
/// keeps its expert and gate for diagnostics; nothing downstream uses it.
template <class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
struct RouteTable {
  using memory_space = MemorySpace;
  Kokkos::View<int**, Kokkos::LayoutRight, MemorySpace> expert;              ///< [T, k]
  Kokkos::View<float**, Kokkos::LayoutRight, MemorySpace> gate;              ///< [T, k]
  Kokkos::View<std::uint8_t**, Kokkos::LayoutRight, MemorySpace> accepted;   ///< [T, k]
  Kokkos::View<index_t*, MemorySpace> expert_counts;                         ///< [E]
  RouteCounts counts;

  RouteTable() = default;
  /// \brief Allocates T x k routes for E experts (all accepted, counts zero).
  RouteTable(std::string const& label, index_t tokens, int top_k, int experts)
      : expert(Kokkos::view_alloc(Kokkos::WithoutInitializing, label + "::expert"), tokens, top_k),
        gate(Kokkos::view_alloc(Kokkos::WithoutInitializing, label + "::gate"), tokens, top_k),
        accepted(label + "::accepted", tokens, top_k),
        expert_counts(label + "::expert_counts", experts) {}

  index_t num_tokens() const { return static_cast<index_t>(expert.extent(0)); }
  int top_k() const { return static_cast<int>(expert.extent(1)); }
  int num_experts() const { return static_cast<int>(expert_counts.extent(0)); }
};

}  // namespace KokkosMoE

#endif
