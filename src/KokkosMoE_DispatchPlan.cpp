#include <KokkosMoE_DispatchPlan.hpp>

namespace KokkosMoE {

std::vector<int> peer_slot_of_rank(std::vector<int> const& peer_order, int num_ranks) {
  std::vector<int> slot(static_cast<std::size_t>(num_ranks), -1);
  for (std::size_t p = 0; p < peer_order.size(); ++p) {
    int const r = peer_order[p];
    KOKKOSMOE_REQUIRE(r >= 0 && r < num_ranks, "peer slot " << p << " names rank " << r << ", outside [0, " << num_ranks << ")");
    KOKKOSMOE_REQUIRE(slot[static_cast<std::size_t>(r)] < 0, "rank " << r << " appears twice in the peer order");
    slot[static_cast<std::size_t>(r)] = static_cast<int>(p);
  }
  return slot;
}

RowLedger row_ledger(std::vector<std::vector<index_t>> const& counts, PayloadType type, int width) {
  RowLedger l;
  index_t max_count = 0;
  std::size_t const P = counts.size();
  for (std::size_t s = 0; s < P; ++s) {
    KOKKOSMOE_REQUIRE(counts[s].size() == P, "count matrix row " << s << " has " << counts[s].size() << " entries, expected " << P);
    for (std::size_t d = 0; d < P; ++d) {
      index_t const c = counts[s][d];
      KOKKOSMOE_REQUIRE(c >= 0, "count matrix entry [" << s << "][" << d << "] is negative (" << c << ")");
      l.useful_rows += c;
      if (s == d) l.same_rank_rows += c;
      max_count = std::max(max_count, c);
    }
  }
  l.remote_rows = l.useful_rows - l.same_rank_rows;
  std::int64_t const rb = payload_row_bytes(type, width);
  l.staging_payload_bytes = l.useful_rows * rb;
  l.remote_payload_bytes = l.remote_rows * rb;
  l.uniform_padded_row_slots = static_cast<index_t>(P * P) * max_count;
  return l;
}

}  // namespace KokkosMoE
