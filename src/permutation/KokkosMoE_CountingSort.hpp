#ifndef KOKKOSMOE_COUNTINGSORT_HPP
#define KOKKOSMOE_COUNTINGSORT_HPP

/// \file KokkosMoE_CountingSort.hpp
/// \brief Stable, deterministic counting sort of small integer keys on any
/// backend, without atomics: the input is cut into chunks, each chunk is
/// histogrammed and scattered sequentially by one thread, and a scan over
/// (key, chunk) gives every chunk its stable base per key.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>

namespace KokkosMoE {

/// \brief Sorts indices 0..n-1 by keys[i] in [0, num_keys), stably.
/// perm[p] = original index at sorted position p; offsets[k] = first sorted
/// position of key k (num_keys + 1 entries, offsets[num_keys] = n).
/// A key outside [0, num_keys) is an error reported after the sort (checked
/// in the histogram pass; nothing is scattered then). Its two scratch
/// arrays come from ws when one is given.
template <class Exec, class KeyView, class PermView, class OffsetView>
void stable_counting_sort(Exec const& exec, KeyView const& keys, int num_keys, PermView const& perm,
                          OffsetView const& offsets, char const* label = "KokkosMoE::counting_sort",
                          Workspace<typename Exec::memory_space>* ws = nullptr) {
  using MS = typename Exec::memory_space;
  index_t const n = static_cast<index_t>(keys.extent(0));
  KOKKOSMOE_REQUIRE(num_keys >= 0, label << ": negative key count " << num_keys);
  KOKKOSMOE_REQUIRE(static_cast<index_t>(perm.extent(0)) == n,
                    label << ": perm has " << perm.extent(0) << " entries for " << n << " keys");
  KOKKOSMOE_REQUIRE(static_cast<index_t>(offsets.extent(0)) == num_keys + 1,
                    label << ": offsets has " << offsets.extent(0) << " entries, expected " << num_keys + 1);
  // Chunks: enough for every thread (x4 for balance), at least 64 rows each,
  // and no more (key, chunk) cells than max(n, 2^20): a GPU's concurrency
  // (~10^5 threads) with many keys would otherwise take n * num_keys / 64
  // cells, far more memory than the sort's output.
  index_t const conc = static_cast<index_t>(exec.concurrency());
  index_t const max_cells = Compat::max<index_t>(n, index_t(1) << 20);
  index_t chunks = Compat::max<index_t>(
      1, Compat::min<index_t>(Compat::min<index_t>(n / 64, conc * 4), max_cells / Compat::max<index_t>(1, num_keys)));
  if (n == 0) chunks = 1;
  index_t const chunk_len = (n + chunks - 1) / chunks;
  int const K = num_keys;
  auto const base = scratch<Kokkos::View<index_t**, Kokkos::LayoutRight, MS>>(ws, exec, std::string(label) + "::base", chunks,
                                                                              static_cast<std::size_t>(K > 0 ? K : 1));
  auto const bad = Kokkos::subview(scratch<Kokkos::View<index_t*, MS>>(ws, exec, std::string(label) + "::bad_keys", 1), 0);
  Kokkos::deep_copy(exec, bad, index_t(0));
  Kokkos::parallel_for(
      std::string(label) + "::histogram", Kokkos::RangePolicy<Exec>(exec, 0, chunks), KOKKOS_LAMBDA(index_t c) {
        for (int k = 0; k < K; ++k) base(c, k) = 0;
        index_t const lo = c * chunk_len, hi = Compat::min(n, lo + chunk_len);
        index_t invalid = 0;
        for (index_t i = lo; i < hi; ++i) {
          int const k = keys(i);
          if (k < 0 || k >= K)
            ++invalid;
          else
            ++base(c, k);
        }
        if (invalid) Kokkos::atomic_add(&bad(), invalid);
      });
  index_t n_bad = 0;
  Compat::fence(exec, "KokkosMoE::counting_sort: key check");
  Kokkos::deep_copy(n_bad, bad);
  KOKKOSMOE_REQUIRE(n_bad == 0, label << ": " << n_bad << " keys outside [0, " << num_keys << ")");
  // Exclusive scan in (key, chunk) order: base(c, k) becomes the first sorted
  // position of key k within chunk c.
  index_t const cells = chunks * K;
  Kokkos::parallel_scan(
      std::string(label) + "::scan", Kokkos::RangePolicy<Exec>(exec, 0, cells),
      KOKKOS_LAMBDA(index_t x, index_t & running, bool final) {
        index_t const k = x / chunks, c = x % chunks;
        index_t const v = base(c, k);
        if (final) {
          base(c, k) = running;
          if (c == 0) offsets(k) = running;
        }
        running += v;
      });
  Kokkos::parallel_for(
      std::string(label) + "::scatter", Kokkos::RangePolicy<Exec>(exec, 0, chunks), KOKKOS_LAMBDA(index_t c) {
        index_t const lo = c * chunk_len, hi = Compat::min(n, lo + chunk_len);
        for (index_t i = lo; i < hi; ++i) perm(base(c, keys(i))++) = i;
        if (c == 0) offsets(K) = n;
      });
}

/// \brief inv[perm[p]] = p.
template <class Exec, class PermView, class InvView>
void invert_permutation(Exec const& exec, PermView const& perm, InvView const& inv,
                        char const* label = "KokkosMoE::invert_permutation") {
  KOKKOSMOE_REQUIRE(perm.extent(0) == inv.extent(0),
                    label << ": permutation has " << perm.extent(0) << " entries, inverse " << inv.extent(0));
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(perm.extent(0))),
      KOKKOS_LAMBDA(index_t p) { inv(perm(p)) = p; });
}

}  // namespace KokkosMoE

#endif
