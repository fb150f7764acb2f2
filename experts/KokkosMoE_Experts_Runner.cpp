// Expert runners: names, validation, batch layouts and ledgers.

#include <KokkosMoE_Experts_Runner.hpp>

#include <algorithm>

namespace KokkosMoE {
namespace Experts {

namespace Impl {

void validate_offsets(std::vector<index_t> const& offs, index_t rows, int num_slots) {
  KOKKOSMOE_REQUIRE(static_cast<int>(offs.size()) == num_slots + 1,
                    "Experts: offsets has " << offs.size() << " entries, expected L + 1 = " << num_slots + 1);
  KOKKOSMOE_REQUIRE(offs.front() == 0, "Experts: offsets[0] = " << offs.front() << ", expected 0");
  for (int q = 0; q < num_slots; ++q)
    KOKKOSMOE_REQUIRE(offs[static_cast<std::size_t>(q + 1)] >= offs[static_cast<std::size_t>(q)],
                      "Experts: offsets decrease at slot " << q << ": offsets[" << q << "] = " << offs[static_cast<std::size_t>(q)]
                                                           << ", offsets[" << q + 1
                                                           << "] = " << offs[static_cast<std::size_t>(q + 1)]);
  KOKKOSMOE_REQUIRE(offs.back() == rows,
                    "Experts: offsets[L = " << num_slots << "] = " << offs.back() << " but there are " << rows << " rows");
}

void validate_options(RunnerOptions const& o) {
  KOKKOSMOE_REQUIRE(o.capacity >= 0, "Experts: padded capacity " << o.capacity << " must be >= 0 (0: the largest segment)");
  KOKKOSMOE_REQUIRE(o.alignment >= 1, "Experts: padded alignment " << o.alignment << " must be >= 1");
  KOKKOSMOE_REQUIRE(o.block_size >= 1, "Experts: block size " << o.block_size << " must be >= 1");
  KOKKOSMOE_REQUIRE(o.host_column_groups >= 0, "Experts: host_column_groups " << o.host_column_groups << " must be >= 0");
  KOKKOSMOE_REQUIRE(o.decode_rows >= -1 && o.decode_rows <= host_decode_max_rows,
                    "Experts: decode_rows " << o.decode_rows << " must be in [-1, " << host_decode_max_rows
                                            << "] (-1: the default, 0: never)");
}

namespace {
index_t round_up(index_t n, index_t a) { return (n + a - 1) / a * a; }
}  // namespace

PaddedLayout padded_layout(std::vector<index_t> const& offs, RunnerOptions const& o) {
  std::size_t const L = offs.size() - 1;
  index_t largest = 0;
  for (std::size_t q = 0; q < L; ++q) largest = std::max(largest, offs[q + 1] - offs[q]);
  index_t const C = o.capacity > 0 ? o.capacity : largest;
  for (std::size_t q = 0; q < L; ++q)
    KOKKOSMOE_REQUIRE(offs[q + 1] - offs[q] <= C, "Experts: padded runner: slot " << q << " has " << offs[q + 1] - offs[q]
                                                                                 << " rows, above the capacity C = " << C
                                                                                 << " (runners never drop rows; admission enforces capacities)");
  index_t const Ca = round_up(C, o.alignment);
  // The batch is L * C_a rows of the experts' width: say which settings
  // made it too large instead of failing inside an allocation.
  constexpr index_t most = index_t(1) << 31;
  KOKKOSMOE_REQUIRE(Ca <= most / std::max<index_t>(1, static_cast<index_t>(L)),
                    "Experts: padded runner: capacity " << C << " rounded up to alignment " << o.alignment << " gives " << Ca
                                                        << " rows for each of " << L << " slots, more than " << most
                                                        << " batch rows (experts.capacity / experts.alignment)");
  PaddedLayout lay;
  lay.capacity = C;
  lay.row_map.assign(static_cast<std::size_t>(Ca) * L, -1);
  lay.offsets.resize(L + 1);
  for (std::size_t q = 0; q <= L; ++q) lay.offsets[q] = static_cast<index_t>(q) * Ca;
  for (std::size_t q = 0; q < L; ++q)
    for (index_t r = offs[q]; r < offs[q + 1]; ++r) lay.row_map[static_cast<std::size_t>(lay.offsets[q] + (r - offs[q]))] = r;
  return lay;
}

PaddedLayout block_layout(std::vector<index_t> const& offs, index_t block) {
  std::size_t const L = offs.size() - 1;
  PaddedLayout lay;
  lay.offsets.assign(L + 1, 0);
  for (std::size_t q = 0; q < L; ++q) lay.offsets[q + 1] = lay.offsets[q] + round_up(offs[q + 1] - offs[q], block);
  KOKKOSMOE_REQUIRE(lay.offsets[L] <= index_t(1) << 31, "Experts: block runner: block size " << block << " gives a batch of "
                                                                                         << lay.offsets[L]
                                                                                         << " rows, more than 2^31 (experts.block_size)");
  lay.row_map.assign(static_cast<std::size_t>(lay.offsets[L]), -1);
  for (std::size_t q = 0; q < L; ++q)
    for (index_t r = offs[q]; r < offs[q + 1]; ++r) lay.row_map[static_cast<std::size_t>(lay.offsets[q] + (r - offs[q]))] = r;
  lay.capacity = lay.offsets[L];
  return lay;
}

}  // namespace Impl

RunLedger plan_ledger(RunnerOptions const& options, std::vector<index_t> const& counts, int d, int d_ff, bool scalar_weights) {
  Impl::validate_options(options);
  KOKKOSMOE_REQUIRE(d >= 1 && d_ff >= 0, "Experts::plan_ledger: d = " << d << ", d_ff = " << d_ff);
  int const L = static_cast<int>(counts.size());
  std::vector<index_t> offs(static_cast<std::size_t>(L + 1), 0);
  for (int q = 0; q < L; ++q) {
    KOKKOSMOE_REQUIRE(counts[static_cast<std::size_t>(q)] >= 0,
                      "Experts::plan_ledger: slot " << q << " has " << counts[static_cast<std::size_t>(q)] << " rows");
    offs[static_cast<std::size_t>(q + 1)] = offs[static_cast<std::size_t>(q)] + counts[static_cast<std::size_t>(q)];
  }
  RunLedger l;
  l.kind = options.kind;
  l.num_slots = L;
  l.d = d;
  l.d_ff = d_ff;
  l.useful_rows = offs.back();
  for (index_t c : counts) l.nonempty_slots += c > 0 ? 1 : 0;
  l.descriptor_bytes = static_cast<index_t>(sizeof(index_t)) * (L + 1);
  switch (options.kind) {
    case RunnerKind::grouped:
    case RunnerKind::blas:
    case RunnerKind::scalar:
      l.executed_rows = l.capacity_rows = l.useful_rows;
      break;
    case RunnerKind::padded: {
      Impl::PaddedLayout const lay = Impl::padded_layout(offs, options);
      l.executed_rows = static_cast<index_t>(lay.row_map.size());
      l.capacity_rows = lay.capacity * L;
      if (l.executed_rows > 0) l.descriptor_bytes += l.executed_rows * static_cast<index_t>(sizeof(index_t));
      break;
    }
    case RunnerKind::block: {
      Impl::PaddedLayout const lay = Impl::block_layout(offs, options.block_size);
      l.executed_rows = l.capacity_rows = static_cast<index_t>(lay.row_map.size());
      if (l.executed_rows > 0) l.descriptor_bytes += l.executed_rows * static_cast<index_t>(sizeof(index_t));
      break;
    }
  }
  l.padding_rows = l.executed_rows - l.useful_rows;
  l.utilization = l.executed_rows > 0 ? static_cast<double>(l.useful_rows) / static_cast<double>(l.executed_rows) : 1.0;
  index_t const per_row = scalar_weights || options.kind == RunnerKind::scalar ? 0 : 6 * static_cast<index_t>(d) * d_ff;
  l.matmul_flops = per_row * l.executed_rows;
  l.useful_flops = per_row * l.useful_rows;
  return l;
}

}  // namespace Experts
}  // namespace KokkosMoE
