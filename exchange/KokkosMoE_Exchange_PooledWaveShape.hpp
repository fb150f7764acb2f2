#ifndef KOKKOSMOE_EXCHANGE_POOLEDWAVESHAPE_HPP
#define KOKKOSMOE_EXCHANGE_POOLEDWAVESHAPE_HPP

/// \file KokkosMoE_Exchange_PooledWaveShape.hpp
/// \brief The static shapes of the pooled-wave exchange (shared by the
/// exchange and the planner): sender pools, receiver arrays, header rows,
/// and the drop rates of a ledger.

#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_Types.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Static configuration of the pooled-wave exchange.
struct PooledWaveConfig {
  int waves = 1;                ///< W
  double sender_cf = 1.0;       ///< sender capacity factor
  double receiver_cf = 1.0;     ///< receiver capacity factor
  index_t tokens_per_rank = 0;  ///< static token count per rank (A = tokens_per_rank * top_k)
  int top_k = 1;
  int local_experts = 1;        ///< L: local expert slots per rank (the largest over ranks)
};

/// \brief The pooled-wave shape of an exchange configuration on a placement:
/// its waves and capacity factors, tokens per rank, top-k, and the most slots
/// on any rank (the one place this shape is derived).
PooledWaveConfig pooled_wave_config(ExchangeConfig const& config, Placement const& placement);

/// \brief The static shapes derived from a configuration.
struct PooledWaveShapes {
  index_t assignments = 0;           ///< A = tokens_per_rank * top_k
  index_t sender_pool_rows = 0;      ///< Rs = ceil(sender_cf * A / P / W), at most A
  index_t receiver_expert_rows = 0;  ///< Rr = ceil(receiver_cf * A / L / W), at most P * Rs
  index_t header_rows = 1;           ///< H: rows of a pool's in-band header (packed ids; return: flags)
  index_t pool_rows_with_header = 0; ///< H + Rs
};

/// \brief Shapes for P ranks; throws Error for non-positive or non-finite
/// sizes or factors. Factors beyond what any routing can use saturate (a
/// sender never has more than A routes for a destination, a receiver never
/// gets more than P * Rs rows of one wave), so no factor overflows a shape.
/// With the row bytes of the dispatch and return payloads, the header takes
/// as many rows as its ids (and flags) need; without them one row.
PooledWaveShapes pooled_wave_shapes(PooledWaveConfig const& c, int ranks, std::int64_t dispatch_row_bytes = 0,
                                    std::int64_t return_row_bytes = 0);

/// \brief Bits per packed local expert id: enough for 0..L, where L marks an
/// empty pool row.
int pooled_wave_id_bits(int local_experts);

/// \brief Bytes of one header row holding pool_rows packed ids.
std::int64_t pooled_wave_header_bytes(index_t pool_rows, int local_experts);

/// \brief Bytes a pool's ids span where they are read (read_packed_id reads
/// three-byte words: two bytes past the last id).
inline std::int64_t pooled_wave_id_span(index_t pool_rows, int local_experts) {
  return pooled_wave_header_bytes(pool_rows, local_experts) + 2;
}

/// \brief Bytes of a pool's return header: one flag bit per pool row.
inline std::int64_t pooled_wave_flag_bytes(index_t pool_rows) { return (pool_rows + 7) / 8; }

/// \brief The ledger stage of one wave on rank `me` (the exchange's and the
/// planner's): rows[p] pool rows carry a route to (or, back, a result for)
/// EP peer slot p (global rank peer_global[p]); the rest of each static pool
/// is padding, which never travels over MPI. The own pool is written where
/// it is read. A header travels in-band (header_bytes 0: H rows of each
/// pool, which moves even without a route), or, where rows go straight to
/// and from the expert rows, as a message of header_bytes before the rows.
/// runs[p] (where given): the runs peer p's rows travel in (see add_sends).
StageLedger pooled_wave_stage(std::string name, std::string communicator, std::vector<std::int64_t> const& rows,
                              std::vector<int> const& peer_global, int me, std::vector<int> const& node_of_rank,
                              std::int64_t row_bytes, PooledWaveShapes const& shapes, std::int64_t header_bytes,
                              std::vector<std::int64_t> const* runs = nullptr);

/// \brief Drop rates of a reduced ledger: S/A, R/A, (S+R)/A and R/(A-S).
struct DropRates {
  double sender = 0, receiver = 0, total = 0, conditional_receiver = 0;
};
DropRates drop_rates(std::int64_t assignments, std::int64_t sender_drops, std::int64_t receiver_drops);

namespace Impl {
/// Reads packed id j (bits wide) from a header row.
KOKKOS_INLINE_FUNCTION int read_packed_id(unsigned char const* hdr, index_t j, int bits) {
  index_t const bit = j * bits;
  std::uint32_t word = 0;
  for (int b = 0; b < 3; ++b) word |= static_cast<std::uint32_t>(hdr[bit / 8 + b]) << (8 * b);
  return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1u));
}
}  // namespace Impl

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
