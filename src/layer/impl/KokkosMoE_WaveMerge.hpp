#ifndef KOKKOSMOE_LAYER_WAVEMERGE_HPP
#define KOKKOSMOE_LAYER_WAVEMERGE_HPP

/// \file impl/KokkosMoE_WaveMerge.hpp
/// \brief The expert rows of a pooled-wave step's waves merged into the
/// order the flat exchange delivers them in: per local slot, by source peer
/// slot, then by the route's position among that source's routes to this
/// rank (DispatchHandle::arrival_key). An expert then sees one segment with
/// the flat exchange's rows in the flat exchange's order, so its backward
/// (weight gradients summed over the segment's rows, input gradients of
/// every row) gives the flat exchange's bits.

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Impl {

template <class MemorySpace>
struct WaveMerge {
  std::vector<index_t> offsets;                    ///< [L + 1] merged segments per local slot
  Kokkos::View<index_t*, MemorySpace> offsets_d;   ///< device copy
  /// Per wave: the merged row of its expert row c (rows move with
  /// scatter_rows into the merged order and gather_rows back).
  std::vector<Kokkos::View<index_t*, MemorySpace>> merged_of;
  index_t rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

/// \brief The merge of handles' expert rows (one handle per wave, each with
/// its arrival keys; their slots must agree). Its device tables come from
/// ws when one is given.
template <class Exec, class T, class MemorySpace>
WaveMerge<MemorySpace> merge_waves(Exec const& exec, std::vector<Exchange::DispatchHandle<T, MemorySpace>> const& waves,
                                   Workspace<MemorySpace>* ws = nullptr) {
  WaveMerge<MemorySpace> m;
  KOKKOSMOE_REQUIRE(!waves.empty(), "wave merge: no waves");
  std::size_t const L = waves.front().expert_counts.size();
  struct Entry {
    std::int64_t key;
    int wave;
    index_t row;
  };
  std::vector<std::vector<Entry>> per_slot(L);
  std::vector<std::int64_t> key;
  for (std::size_t w = 0; w < waves.size(); ++w) {
    auto const& h = waves[w];
    KOKKOSMOE_REQUIRE(h.expert_counts.size() == L && h.expert_offsets.size() == L + 1,
                      "wave merge: wave " << w << " has " << h.expert_counts.size() << " local slots, wave 0 has " << L);
    KOKKOSMOE_REQUIRE(static_cast<index_t>(h.arrival_key.extent(0)) == h.rows(),
                      "wave merge: wave " << w << " has " << h.arrival_key.extent(0) << " arrival keys for " << h.rows() << " rows");
    copy_to_host(exec, h.arrival_key, key);
    for (std::size_t q = 0; q < L; ++q)
      for (index_t c = h.expert_offsets[q]; c < h.expert_offsets[q + 1]; ++c)
        per_slot[q].push_back(Entry{key[static_cast<std::size_t>(c)], static_cast<int>(w), c});
  }
  m.offsets.assign(L + 1, 0);
  std::vector<std::vector<index_t>> merged(waves.size());
  for (std::size_t w = 0; w < waves.size(); ++w) merged[w].assign(static_cast<std::size_t>(waves[w].rows()), -1);
  for (std::size_t q = 0; q < L; ++q) {
    auto& e = per_slot[q];
    std::sort(e.begin(), e.end(), [](Entry const& a, Entry const& b) { return a.key < b.key; });
    for (std::size_t i = 1; i < e.size(); ++i)
      KOKKOSMOE_REQUIRE(e[i].key != e[i - 1].key, "wave merge: local slot " << q << " received two rows with arrival key " << e[i].key);
    m.offsets[q + 1] = m.offsets[q] + static_cast<index_t>(e.size());
    for (std::size_t i = 0; i < e.size(); ++i)
      merged[static_cast<std::size_t>(e[i].wave)][static_cast<std::size_t>(e[i].row)] = m.offsets[q] + static_cast<index_t>(i);
  }
  m.offsets_d = scratch_copy(ws, exec, "KokkosMoE::WaveMerge::offsets", m.offsets);
  for (std::size_t w = 0; w < waves.size(); ++w) m.merged_of.push_back(scratch_copy(ws, exec, "KokkosMoE::WaveMerge::merged_of", merged[w]));
  return m;
}

}  // namespace Impl
}  // namespace KokkosMoE

#endif
