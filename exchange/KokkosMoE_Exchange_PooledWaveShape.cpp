#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_PooledWaveShape.hpp>

#include <algorithm>

#include <cmath>

namespace KokkosMoE {
namespace Exchange {

namespace {
// ceil(x) for a product of decimal factors, at most `most`: a tiny relative
// tolerance keeps exact integers (e.g. 1.0 * 8 / 2) from rounding up through
// binary error; larger values saturate instead of overflowing index_t.
index_t ceil_tolerant(double x, index_t most) {
  double const c = std::ceil(x * (1.0 - 1e-12));
  return c >= static_cast<double>(most) ? most : static_cast<index_t>(c);
}
}  // namespace

PooledWaveConfig pooled_wave_config(ExchangeConfig const& config, Placement const& placement) {
  PooledWaveConfig pc;
  pc.waves = config.waves;
  pc.sender_cf = config.sender_cf;
  pc.receiver_cf = config.receiver_cf;
  pc.tokens_per_rank = config.tokens_per_rank;
  pc.top_k = config.top_k;
  int most = 0;
  for (int r = 0; r < placement.num_ranks(); ++r) most = std::max(most, placement.num_slots_of_rank(r));
  pc.local_experts = std::max(1, most);
  return pc;
}

PooledWaveShapes pooled_wave_shapes(PooledWaveConfig const& c, int ranks, std::int64_t dispatch_row_bytes,
                                    std::int64_t return_row_bytes) {
  KOKKOSMOE_REQUIRE(c.waves >= 1, "pooled-wave: waves must be at least 1 (got " << c.waves << ")");
  KOKKOSMOE_REQUIRE(c.sender_cf > 0 && c.receiver_cf > 0 && std::isfinite(c.sender_cf) && std::isfinite(c.receiver_cf),
                    "pooled-wave: capacity factors must be positive and finite (sender " << c.sender_cf << ", receiver "
                                                                                          << c.receiver_cf << ")");
  KOKKOSMOE_REQUIRE(c.tokens_per_rank >= 0 && c.top_k >= 1 && c.local_experts >= 1 && ranks >= 1,
                    "pooled-wave: tokens_per_rank " << c.tokens_per_rank << ", top_k " << c.top_k << ", local experts "
                                                    << c.local_experts << ", ranks " << ranks);
  PooledWaveShapes s;
  s.assignments = c.tokens_per_rank * c.top_k;
  double const A = static_cast<double>(s.assignments);
  s.sender_pool_rows = ceil_tolerant(c.sender_cf * A / ranks / c.waves, s.assignments);
  s.receiver_expert_rows = ceil_tolerant(c.receiver_cf * A / c.local_experts / c.waves, static_cast<index_t>(ranks) * s.sender_pool_rows);
  if (dispatch_row_bytes > 0 && return_row_bytes > 0) {
    // Reading an id touches up to 3 bytes from its first one.
    std::int64_t const ids = pooled_wave_id_span(s.sender_pool_rows, c.local_experts);
    std::int64_t const flags = pooled_wave_flag_bytes(s.sender_pool_rows);
    s.header_rows = std::max<std::int64_t>({1, (ids + dispatch_row_bytes - 1) / dispatch_row_bytes,
                                            (flags + return_row_bytes - 1) / return_row_bytes});
  }
  s.pool_rows_with_header = s.sender_pool_rows + s.header_rows;
  return s;
}

int pooled_wave_id_bits(int local_experts) {
  int bits = 1;
  while ((1 << bits) < local_experts + 1) ++bits;
  KOKKOSMOE_REQUIRE(bits <= 16, "pooled-wave: " << local_experts << " local experts need " << bits << "-bit ids (at most 16)");
  return bits;
}

std::int64_t pooled_wave_header_bytes(index_t pool_rows, int local_experts) {
  return (pool_rows * pooled_wave_id_bits(local_experts) + 7) / 8;
}

StageLedger pooled_wave_stage(std::string name, std::string communicator, std::vector<std::int64_t> const& rows,
                              std::vector<int> const& peer_global, int me, std::vector<int> const& node_of_rank,
                              std::int64_t row_bytes, PooledWaveShapes const& shapes, std::int64_t header_bytes,
                              std::vector<std::int64_t> const* runs) {
  StageLedger st{std::move(name), std::move(communicator)};
  st.self_in_place = true;
  add_sends(st, rows, peer_global, me, node_of_rank, row_bytes, 0, runs);
  for (std::size_t p = 0; p < rows.size(); ++p) {
    int const g = peer_global[p];
    auto const c = g == me ? LinkClass::same_rank
                   : node_of_rank[static_cast<std::size_t>(g)] == node_of_rank[static_cast<std::size_t>(me)] ? LinkClass::intra_node
                                                                                                            : LinkClass::inter_node;
    auto& x = st.by_class[static_cast<int>(c)];
    st.padding_rows += shapes.sender_pool_rows - rows[p];
    if (header_bytes == 0) {
      st.header_rows += shapes.header_rows;
      x.meta_bytes += shapes.header_rows * row_bytes;
      if (rows[p] == 0) x.messages += 1;  // the pool moves even when empty
    } else {
      x.meta_bytes += header_bytes;
      if (g != me) x.messages += 1;  // the header's own message
    }
  }
  return st;
}

DropRates drop_rates(std::int64_t A, std::int64_t S, std::int64_t R) {
  DropRates d;
  if (A <= 0) return d;
  d.sender = static_cast<double>(S) / static_cast<double>(A);
  d.receiver = static_cast<double>(R) / static_cast<double>(A);
  d.total = d.sender + d.receiver;
  d.conditional_receiver = A > S ? static_cast<double>(R) / static_cast<double>(A - S) : 0.0;
  return d;
}

}  // namespace Exchange
}  // namespace KokkosMoE
