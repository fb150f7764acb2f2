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

}  // namespace KokkosMoE
