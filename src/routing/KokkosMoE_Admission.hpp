#ifndef KOKKOSMOE_ADMISSION_HPP
#define KOKKOSMOE_ADMISSION_HPP

/// \file KokkosMoE_Admission.hpp
/// \brief Route admission: which of the selected routes of a RouteTable are
/// executed. Dropless admits everything; the capacity policies drop the
/// lowest-priority units deterministically. Surviving gates are never
/// renormalized.
///
/// Priority order (both capacity policies), highest first:
///   1. routes / destination rows of protected tokens,
///   2. larger priority value (for a route: its priority entry; for a
///      destination row (token, device): the largest priority entry among
///      that token's routes on that device),
///   3. lower token index.
/// NaN priorities count as -infinity. The order is total (a token appears at
/// most once per expert and once per device), so the admitted set does not
/// depend on the backend, the thread count or the run.

#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <impl/KokkosMoE_OrderKeys.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace KokkosMoE {

/// \brief How routes are admitted.
enum class AdmissionPolicy {
  dropless,         ///< every selected route is executed
  expert_capacity,  ///< at most ceil(capacity_factor * T * k / E) routes per expert
  device_capacity,  ///< at most ceil(capacity_factor * rows / devices) destination rows per device
};

/// \brief "dropless", "expert_capacity", "device_capacity".
inline EnumTable<AdmissionPolicy> const& names_of(AdmissionPolicy) {
  static EnumTable<AdmissionPolicy> const t{"admission policy",
                                            {{AdmissionPolicy::dropless, "dropless"},
                                             {AdmissionPolicy::expert_capacity, "expert_capacity"},
                                             {AdmissionPolicy::device_capacity, "device_capacity"}}};
  return t;
}

/// \brief Admission settings.
///
/// device_capacity: a destination row is one (token, device) pair carrying
/// all of that token's selected experts stored on that device; the capacity
/// of every device is ceil(capacity_factor * R / num_devices) rows, R = the
/// total number of destination rows of the call. A dropped row drops that
/// token's routes to that device only.
struct AdmissionConfig {
  AdmissionPolicy policy = AdmissionPolicy::dropless;
  double capacity_factor = 1.0;    ///< > 0 for the capacity policies
  int num_devices = 0;             ///< device_capacity: number of devices (ranks)
  std::vector<int> expert_device;  ///< device_capacity: [E] device of every logical expert

  /// \brief Throws Error (every offending value named) unless the settings are
  /// usable for num_experts experts.
  void validate(int num_experts) const;
};

/// \brief What one admission did. Units are routes per expert (dropless,
/// expert_capacity) or destination rows per device (device_capacity).
struct AdmissionStats {
  AdmissionPolicy policy = AdmissionPolicy::dropless;
  index_t capacity = -1;               ///< units per bucket; -1: unlimited (dropless)
  std::vector<index_t> units;          ///< attempted units per bucket (expert or device)
  std::vector<index_t> dropped_units;  ///< dropped units per bucket
  RouteCounts routes;                  ///< attempted / accepted / dropped routes
};

namespace Impl {
/// ceil(factor * share) rows, saturated at 2^62 (far above any row count):
/// a huge factor admits everything instead of wrapping to a negative capacity.
inline index_t capacity_rows(double factor, double share) {
  constexpr index_t most = index_t(1) << 62;
  double const c = std::ceil(factor * share);
  return c >= static_cast<double>(most) ? most : static_cast<index_t>(c);
}
}  // namespace Impl

namespace Impl {

template <class T>
struct type_identity {
  using type = T;
};
template <class T>
using type_identity_t = typename type_identity<T>::type;

/// True when kernels of Exec can use per-chunk private histograms (host
/// backends); otherwise integer atomics are used. Both are exact.
template <class Exec>
constexpr bool host_histogram() {
  return Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;  // Exec's kernels run on the host
}

/// Total priority key: protected first, then priority value, then lower token.
KOKKOS_INLINE_FUNCTION std::uint64_t admission_key(bool is_protected, float priority, index_t token) {
  return (is_protected ? (std::uint64_t(1) << 63) : std::uint64_t(0)) |
         (static_cast<std::uint64_t>(float_order_bits(priority)) << 31) |
         static_cast<std::uint64_t>(0x7FFFFFFF - token);
}

/// Bin of a route (t, j) for a histogram, or -1 for none.
template <class M>
struct ExpertBin {
  Kokkos::View<const int**, Kokkos::LayoutRight, M> expert;
  KOKKOS_INLINE_FUNCTION int operator()(index_t t, int j) const { return expert(t, j); }
};
template <class M>
struct AcceptedExpertBin {
  Kokkos::View<const int**, Kokkos::LayoutRight, M> expert;
  Kokkos::View<const std::uint8_t**, Kokkos::LayoutRight, M> accepted;
  KOKKOS_INLINE_FUNCTION int operator()(index_t t, int j) const { return accepted(t, j) ? expert(t, j) : -1; }
};
/// Device of (t, j) when j is the first route of token t to that device.
template <class M>
struct LeaderDeviceBin {
  Kokkos::View<const int**, Kokkos::LayoutRight, M> expert;
  Kokkos::View<const int*, M> device_of;
  KOKKOS_INLINE_FUNCTION int operator()(index_t t, int j) const {
    int const d = device_of(expert(t, j));
    for (int i = 0; i < j; ++i)
      if (device_of(expert(t, i)) == d) return -1;
    return d;
  }
};

/// out[b] = number of routes (t, j), t < T, j < k, with bin_of(t, j) == b.
/// Exact and deterministic: private per-chunk histograms summed in chunk
/// order on host backends, integer atomics elsewhere.
template <class Exec, class M, class BinOf>
void route_histogram(Exec const& exec, index_t T, int k, BinOf const& bin_of, Kokkos::View<index_t*, M> const& out) {
  int const nbins = static_cast<int>(out.extent(0));
  if (nbins == 0) return;
  if (T == 0 || k == 0) {
    Kokkos::deep_copy(exec, out, index_t(0));
    return;
  }
  if constexpr (host_histogram<Exec>()) {
    index_t const chunks = Compat::min<index_t>(T, Compat::max(1, static_cast<int>(exec.concurrency())));
    // Host memory (host backends only), not a Kokkos allocation: nothing
    // to track or fence for a few counters per step.
    std::vector<index_t> cells(static_cast<std::size_t>(chunks) * static_cast<std::size_t>(nbins), 0);
    Kokkos::View<index_t**, Kokkos::LayoutRight, M, Kokkos::MemoryTraits<Kokkos::Unmanaged>> part(cells.data(), chunks, nbins);
    Kokkos::parallel_for(
        "KokkosMoE::Admission::histogram_chunks", Kokkos::RangePolicy<Exec>(exec, 0, chunks), KOKKOS_LAMBDA(index_t c) {
          index_t const t0 = T * c / chunks, t1 = T * (c + 1) / chunks;
          for (index_t t = t0; t < t1; ++t)
            for (int j = 0; j < k; ++j) {
              int const b = bin_of(t, j);
              if (b >= 0) ++part(c, b);
            }
        });
    Kokkos::parallel_for(
        "KokkosMoE::Admission::histogram_sum", Kokkos::RangePolicy<Exec>(exec, 0, nbins), KOKKOS_LAMBDA(int b) {
          index_t s = 0;
          for (index_t c = 0; c < chunks; ++c) s += part(c, b);
          out(b) = s;
        });
  } else {
    Kokkos::deep_copy(exec, out, index_t(0));
    Kokkos::parallel_for(
        "KokkosMoE::Admission::histogram_atomic", Kokkos::RangePolicy<Exec>(exec, 0, T * k), KOKKOS_LAMBDA(index_t r) {
          int const b = bin_of(r / k, static_cast<int>(r % k));
          if (b >= 0) Kokkos::atomic_add(&out(b), index_t(1));
        });
  }
}

/// For every bucket b with units(b) > capacity: threshold(b) = the
/// capacity-th largest key of the bucket (keys are unique), so exactly
/// `capacity` keys are >= threshold(b). Buckets within capacity get 0 (keep
/// all). keys holds the bucket members contiguously from offsets(b).
template <class Exec, class M>
void bucket_thresholds(Exec const& exec, Kokkos::View<const index_t*, M> const& offsets,
                       Kokkos::View<const std::uint64_t*, M> const& keys, index_t capacity,
                       Kokkos::View<std::uint64_t*, M> const& threshold) {
  using policy_t = Kokkos::TeamPolicy<Exec>;
  using member_t = typename policy_t::member_type;
  int const nb = static_cast<int>(threshold.extent(0));
  Kokkos::parallel_for(
      "KokkosMoE::Admission::thresholds", policy_t(exec, nb, Kokkos::AUTO), KOKKOS_LAMBDA(member_t const& team) {
        int const b = team.league_rank();
        index_t const lo_i = offsets(b), hi_i = offsets(b + 1);
        if (hi_i - lo_i <= capacity) {
          Kokkos::single(Kokkos::PerTeam(team), [&]() { threshold(b) = 0; });
          return;
        }
        if (capacity <= 0) {
          Kokkos::single(Kokkos::PerTeam(team), [&]() { threshold(b) = ~std::uint64_t(0); });
          return;
        }
        // Largest thr with count(key >= thr) >= capacity.
        std::uint64_t lo = 0, hi = ~std::uint64_t(0);
        while (lo < hi) {
          std::uint64_t const mid = lo + (hi - lo) / 2 + 1;
          index_t n = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, lo_i, hi_i), [&](index_t i, index_t& acc) { acc += keys(i) >= mid ? 1 : 0; },
              n);
          if (n >= capacity)
            lo = mid;
          else
            hi = mid - 1;
        }
        Kokkos::single(Kokkos::PerTeam(team), [&]() { threshold(b) = lo; });
      });
}

/// Host copy of a small device vector (fenced).
template <class Exec, class View>
std::vector<index_t> to_host_vector(Exec const& exec, View const& v) {
  auto const h = copy_to_host(exec, v);
  return std::vector<index_t>(h.begin(), h.end());
}

/// Device copy of a host vector of ints.
template <class M, class Exec>
Kokkos::View<int*, M> to_device_ints(Exec const& exec, std::vector<int> const& v, std::string const& label) {
  return scratch_copy(static_cast<Workspace<M>*>(nullptr), exec, label, v);
}

inline std::vector<index_t> exclusive_offsets(std::vector<index_t> const& units) {
  std::vector<index_t> off(units.size() + 1, 0);
  for (std::size_t i = 0; i < units.size(); ++i) off[i + 1] = off[i] + units[i];
  return off;
}

}  // namespace Impl

/// \brief Admits the routes of `table` under `config` on `exec`.
///
/// Overwrites table.accepted (1 = executed), table.expert_counts (accepted
/// routes per logical expert) and table.counts; expert ids and gates are
/// left unchanged (gates of surviving routes are never renormalized).
/// Every expert id in the table must lie in [0, table.num_experts()).
/// \param exec execution space instance all kernels run on; fenced before return
/// \param config admission settings (validated first, before any kernel)
/// \param table routes to admit (its accepted mask is recomputed from scratch)
/// \param priority [T, k] priority of every route; empty: the gates are used
/// \param protected_tokens [T] nonzero marks a token whose units go first; empty: none
/// \param ws workspace of the scratch arrays (none: fresh allocations)
/// \return per-bucket units, capacity and drops, and the route counts
template <class ExecutionSpace, class MemorySpace>
AdmissionStats admit(ExecutionSpace const& exec, AdmissionConfig const& config, RouteTable<MemorySpace>& table,
                     Impl::type_identity_t<Kokkos::View<const float**, Kokkos::LayoutRight, MemorySpace>> priority = {},
                     Impl::type_identity_t<Kokkos::View<const std::uint8_t*, MemorySpace>> protected_tokens = {},
                     Workspace<MemorySpace>* ws = nullptr) {
  using M = MemorySpace;
  int const E = table.num_experts();
  index_t const T = table.num_tokens();
  int const k = table.top_k();
  config.validate(E);
  KOKKOSMOE_REQUIRE(static_cast<index_t>(table.gate.extent(0)) == T && static_cast<int>(table.gate.extent(1)) == k &&
                        static_cast<index_t>(table.accepted.extent(0)) == T &&
                        static_cast<int>(table.accepted.extent(1)) == k,
                    "admit: route table views disagree: expert " << T << "x" << k << ", gate " << table.gate.extent(0)
                                                                 << "x" << table.gate.extent(1) << ", accepted "
                                                                 << table.accepted.extent(0) << "x"
                                                                 << table.accepted.extent(1));
  KOKKOSMOE_REQUIRE(priority.size() == 0 ||
                        (static_cast<index_t>(priority.extent(0)) == T && static_cast<int>(priority.extent(1)) == k),
                    "admit: priority is " << priority.extent(0) << "x" << priority.extent(1) << ", routes are " << T
                                          << "x" << k);
  KOKKOSMOE_REQUIRE(protected_tokens.size() == 0 || static_cast<index_t>(protected_tokens.extent(0)) == T,
                    "admit: protected_tokens has " << protected_tokens.extent(0) << " entries for " << T << " tokens");
  KOKKOSMOE_REQUIRE(T <= index_t(0x7FFFFFFF), "admit: at most 2^31-1 tokens per call (got " << T << ")");

  Kokkos::View<const float**, Kokkos::LayoutRight, M> prio = priority.size() ? priority : table.gate;
  Kokkos::View<const int**, Kokkos::LayoutRight, M> expert = table.expert;
  auto accepted = table.accepted;
  bool const have_prot = protected_tokens.size() != 0;
  auto prot = protected_tokens;
  using range_t = Kokkos::RangePolicy<ExecutionSpace>;

  AdmissionStats stats;
  stats.policy = config.policy;
  stats.routes.attempted = T * k;
  Kokkos::deep_copy(exec, accepted, std::uint8_t(1));

  auto key_of_route = KOKKOS_LAMBDA(index_t t, int j) {
    return Impl::admission_key(have_prot && prot(t) != 0, prio(t, j), t);
  };

  if (config.policy == AdmissionPolicy::dropless) {
    Impl::route_histogram(exec, T, k, Impl::ExpertBin<M>{expert}, table.expert_counts);
    stats.units = Impl::to_host_vector(exec, table.expert_counts);
    stats.dropped_units.assign(stats.units.size(), 0);
  } else if (config.policy == AdmissionPolicy::expert_capacity) {
    auto const units = scratch<Kokkos::View<index_t*, M>>(ws, exec, "KokkosMoE::Admission::units", E);
    Impl::route_histogram(exec, T, k, Impl::ExpertBin<M>{expert}, units);
    stats.units = Impl::to_host_vector(exec, units);
    index_t const cap = Impl::capacity_rows(config.capacity_factor, static_cast<double>(T) * k / E);
    stats.capacity = cap;
    stats.dropped_units.resize(stats.units.size());
    bool over = false;
    for (std::size_t e = 0; e < stats.units.size(); ++e) {
      stats.dropped_units[e] = stats.units[e] > cap ? stats.units[e] - cap : 0;
      over = over || stats.units[e] > cap;
    }
    if (over) {
      auto const off_h = Impl::exclusive_offsets(stats.units);
      auto offsets = scratch_copy(ws, exec, "KokkosMoE::Admission::offsets", off_h);
      auto const cursor = scratch<Kokkos::View<index_t*, M>>(ws, exec, "KokkosMoE::Admission::cursor", E);
      Kokkos::deep_copy(exec, cursor, index_t(0));
      auto const keys = scratch<Kokkos::View<std::uint64_t*, M>>(ws, exec, "KokkosMoE::Admission::keys", T * k);
      Kokkos::parallel_for(
          "KokkosMoE::Admission::bucket_routes", range_t(exec, 0, T), KOKKOS_LAMBDA(index_t t) {
            for (int j = 0; j < k; ++j) {
              int const e = expert(t, j);
              index_t const pos = Kokkos::atomic_fetch_add(&cursor(e), index_t(1));
              keys(offsets(e) + pos) = key_of_route(t, j);
            }
          });
      auto const thr = scratch<Kokkos::View<std::uint64_t*, M>>(ws, exec, "KokkosMoE::Admission::threshold", E);
      Impl::bucket_thresholds<ExecutionSpace, M>(exec, offsets, keys, cap, thr);
      Kokkos::parallel_for(
          "KokkosMoE::Admission::mark_routes", range_t(exec, 0, T), KOKKOS_LAMBDA(index_t t) {
            for (int j = 0; j < k; ++j) accepted(t, j) = key_of_route(t, j) >= thr(expert(t, j)) ? 1 : 0;
          });
    }
    Impl::route_histogram(exec, T, k, Impl::AcceptedExpertBin<M>{expert, accepted}, table.expert_counts);
  } else {
    int const D = config.num_devices;
    auto device_of = scratch_copy(ws, exec, "KokkosMoE::Admission::expert_device", config.expert_device);
    auto const units = scratch<Kokkos::View<index_t*, M>>(ws, exec, "KokkosMoE::Admission::units", D);
    Impl::route_histogram(exec, T, k, Impl::LeaderDeviceBin<M>{expert, device_of}, units);
    stats.units = Impl::to_host_vector(exec, units);
    index_t rows = 0;
    for (index_t u : stats.units) rows += u;
    index_t const cap = Impl::capacity_rows(config.capacity_factor, static_cast<double>(rows) / D);
    stats.capacity = cap;
    stats.dropped_units.resize(stats.units.size());
    bool over = false;
    for (std::size_t d = 0; d < stats.units.size(); ++d) {
      stats.dropped_units[d] = stats.units[d] > cap ? stats.units[d] - cap : 0;
      over = over || stats.units[d] > cap;
    }
    if (over) {
      // Key of the destination row (t, device of route j).
      auto row_key = KOKKOS_LAMBDA(index_t t, int j) {
        int const d = device_of(expert(t, j));
        float p = prio(t, j);
        for (int i = 0; i < k; ++i)
          if (i != j && device_of(expert(t, i)) == d) p = Compat::max(p, prio(t, i));
        return Impl::admission_key(have_prot && prot(t) != 0, p, t);
      };
      auto const off_h = Impl::exclusive_offsets(stats.units);
      auto offsets = scratch_copy(ws, exec, "KokkosMoE::Admission::offsets", off_h);
      auto const cursor = scratch<Kokkos::View<index_t*, M>>(ws, exec, "KokkosMoE::Admission::cursor", D);
      Kokkos::deep_copy(exec, cursor, index_t(0));
      auto const keys = scratch<Kokkos::View<std::uint64_t*, M>>(ws, exec, "KokkosMoE::Admission::keys", rows);
      Impl::LeaderDeviceBin<M> leader{expert, device_of};
      Kokkos::parallel_for(
          "KokkosMoE::Admission::bucket_rows", range_t(exec, 0, T), KOKKOS_LAMBDA(index_t t) {
            for (int j = 0; j < k; ++j) {
              int const d = leader(t, j);
              if (d < 0) continue;
              index_t const pos = Kokkos::atomic_fetch_add(&cursor(d), index_t(1));
              keys(offsets(d) + pos) = row_key(t, j);
            }
          });
      auto const thr = scratch<Kokkos::View<std::uint64_t*, M>>(ws, exec, "KokkosMoE::Admission::threshold", D);
      Impl::bucket_thresholds<ExecutionSpace, M>(exec, offsets, keys, cap, thr);
      Kokkos::parallel_for(
          "KokkosMoE::Admission::mark_rows", range_t(exec, 0, T), KOKKOS_LAMBDA(index_t t) {
            for (int j = 0; j < k; ++j) accepted(t, j) = row_key(t, j) >= thr(device_of(expert(t, j))) ? 1 : 0;
          });
    }
    Impl::route_histogram(exec, T, k, Impl::AcceptedExpertBin<M>{expert, accepted}, table.expert_counts);
  }
  auto const counts = Impl::to_host_vector(exec, table.expert_counts);
  index_t acc = 0;
  for (index_t c : counts) acc += c;
  stats.routes.accepted = acc;
  stats.routes.dropped = stats.routes.attempted - acc;
  table.counts = stats.routes;
  Compat::fence(exec, "KokkosMoE::Admission::admit");
  return stats;
}

/// \brief admit() on a default-constructed ExecutionSpace instance.
template <class MemorySpace>
AdmissionStats admit(AdmissionConfig const& config, RouteTable<MemorySpace>& table) {
  return admit(typename MemorySpace::execution_space(), config, table);
}

}  // namespace KokkosMoE

#endif
