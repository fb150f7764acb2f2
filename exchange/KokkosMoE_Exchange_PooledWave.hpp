#ifndef KOKKOSMOE_EXCHANGE_POOLEDWAVE_HPP
#define KOKKOSMOE_EXCHANGE_POOLEDWAVE_HPP

/// \file KokkosMoE_Exchange_PooledWave.hpp
/// \brief Pooled-wave exchange: static shapes, no count collective. Each wave
/// sends one pool per destination rank: one in-band header row carrying the
/// packed local expert ids of the pool's rows, then pool_rows payload rows.
/// The i-th assignment (in stable route order) bound for a destination goes
/// to wave i % W at pool row i / W; rows beyond a sender pool are sender
/// drops (S). The receiver compacts each wave's rows per local expert into
/// static per-expert arrays of expert_rows rows; rows beyond that are
/// receiver drops (R). Experts run per wave, results return through the same
/// static shapes (the return header flags which rows carry a result), and
/// the sender collects them in its send order; the final combine is the same
/// k-slot-ordered FP32 reduction as for the other algorithms, so without
/// drops the output is bitwise identical to the flat exchange.

#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <impl/KokkosMoE_CountingSort.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

#include <cmath>
#include <functional>

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

/// \brief The static shapes derived from a configuration.
struct PooledWaveShapes {
  index_t assignments = 0;   ///< A = tokens_per_rank * top_k
  index_t sender_pool_rows = 0;    ///< ceil(sender_cf * A / P / W)
  index_t receiver_expert_rows = 0;  ///< ceil(receiver_cf * A / L / W)
  index_t pool_rows_with_header = 0;
};

/// \brief Shapes for P ranks; throws Error for non-positive sizes or factors.
PooledWaveShapes pooled_wave_shapes(PooledWaveConfig const& c, int ranks);

/// \brief Bits per packed local expert id: enough for 0..L, where L marks an
/// empty pool row.
int pooled_wave_id_bits(int local_experts);

/// \brief Bytes of one header row holding pool_rows packed ids.
std::int64_t pooled_wave_header_bytes(index_t pool_rows, int local_experts);

namespace Impl {
/// Reads packed id j (bits wide) from a header row.
KOKKOS_INLINE_FUNCTION int read_packed_id(unsigned char const* hdr, index_t j, int bits) {
  index_t const bit = j * bits;
  std::uint32_t word = 0;
  for (int b = 0; b < 3; ++b) word |= static_cast<std::uint32_t>(hdr[bit / 8 + b]) << (8 * b);
  return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1u));
}
}  // namespace Impl

/// \brief Drop rates of a reduced ledger: S/A, R/A, (S+R)/A and R/(A-S).
struct DropRates {
  double sender = 0, receiver = 0, total = 0, conditional_receiver = 0;
};
DropRates drop_rates(std::int64_t assignments, std::int64_t sender_drops, std::int64_t receiver_drops);

/// \brief Expert callback of a wave: expert-major input rows (dispatch
/// payload) with local-slot offsets [L + 1] (host and device copies), returning
/// one output row per input row, same order, in the return payload type.
template <class MemorySpace>
using WaveExpertFn = std::function<PayloadBuffer<MemorySpace>(PayloadBuffer<MemorySpace> const& x_em,
                                                              std::vector<index_t> const& offsets,
                                                              Kokkos::View<index_t*, MemorySpace> const& offsets_d)>;

/// \brief Result of a pooled-wave forward pass.
template <class MemorySpace>
struct PooledWaveResult {
  PayloadBuffer<MemorySpace> returned;  ///< one row per dispatched route in send order (dropped: zeros)
  ByteLedger ledger;                    ///< this rank's moves and drops
  std::int64_t sender_drops = 0;
  std::int64_t receiver_drops = 0;
};

template <class Transport = Mpi, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class PooledWaveExchange {
 public:
  using memory_space = MemorySpace;
  static constexpr char const* name = "pooled_wave";

  PooledWaveExchange(Topology::CommunicatorSet const& comms, PooledWaveConfig config, TransportOptions options = {})
      : comms_(&comms), config_(config), options_(options), transport_(comms) {
    shapes_ = pooled_wave_shapes(config_, comms.ep().size());
  }

  PooledWaveShapes const& shapes() const { return shapes_; }
  PooledWaveConfig const& config() const { return config_; }
  Topology::CommunicatorSet const& communicators() const { return *comms_; }

  /// \brief Collective: moves the routes of `routes` (send order of `plan`)
  /// to their experts in W waves, runs `expert` on each wave's compacted
  /// rows, and returns the results in send order. Throws (on every rank) when
  /// a rank has more tokens than the static tokens_per_rank, more local slots
  /// than L, or a header row cannot hold a pool's ids.
  template <class Exec, class T>
  PooledWaveResult<MemorySpace> forward(Exec const& exec, Placement const& placement, RoutePlan<MemorySpace> const& routes,
                                        DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                                        PayloadType dispatch_type, PayloadType return_type,
                                        WaveExpertFn<MemorySpace> const& expert) {
    auto const& ep = comms_->ep();
    int const P = ep.size();
    int const W = config_.waves;
    index_t const Rs = shapes_.sender_pool_rows;
    index_t const Rr = shapes_.receiver_expert_rows;
    index_t const pool = Rs + 1;
    int const L = config_.local_experts;
    int const d = static_cast<int>(hidden.extent(1));
    int const me = comms_->global_rank();
    std::int64_t const header_bytes = pooled_wave_header_bytes(Rs, L);
    int const bits = pooled_wave_id_bits(L);
    agree_or_throw(ep, Impl::problem_of([&] {
                     KOKKOSMOE_REQUIRE(routes.num_tokens <= config_.tokens_per_rank,
                                       "pooled-wave exchange: rank " << me << " has " << routes.num_tokens
                                                                     << " tokens, the static shape allows " << config_.tokens_per_rank);
                     KOKKOSMOE_REQUIRE(routes.top_k == config_.top_k, "pooled-wave exchange: top_k " << routes.top_k << " but configured "
                                                                                                     << config_.top_k);
                     KOKKOSMOE_REQUIRE(placement.num_slots_of_rank(me) <= L,
                                       "pooled-wave exchange: rank " << me << " holds " << placement.num_slots_of_rank(me)
                                                                     << " expert slots, the static shape allows " << L);
                     // Reading an id touches up to 3 bytes past its first one.
                     KOKKOSMOE_REQUIRE(header_bytes + 2 <= payload_row_bytes(dispatch_type, d),
                                       "pooled-wave exchange: a header row of " << payload_row_bytes(dispatch_type, d)
                                                                                << " bytes cannot hold " << Rs << " ids ("
                                                                                << header_bytes << " bytes needed)");
                     KOKKOSMOE_REQUIRE((Rs + 7) / 8 <= payload_row_bytes(return_type, d),
                                       "pooled-wave exchange: a return header of " << payload_row_bytes(return_type, d)
                                                                                   << " bytes cannot flag " << Rs << " rows");
                     KOKKOSMOE_REQUIRE(plan.peer_order == ep.peer_order(), "pooled-wave exchange: plan for another peer order");
                   }),
                   "pooled-wave forward", options_);

    PooledWaveResult<MemorySpace> res;
    PayloadBuffer<MemorySpace> shape_of_rows;
    shape_of_rows.type = dispatch_type;
    shape_of_rows.width = d;
    res.ledger = Impl::new_ledger(name, shape_of_rows, 1);
    res.ledger.combine_payload = to_string(return_type);
    res.ledger.combine_row_bytes = payload_row_bytes(return_type, d);
    res.returned = work_.payload(exec, "pooled_returned", return_type, d, plan.rows());
    zero_fill(exec, res.returned.bytes);

    // Sender side, once per step: position of every route among the routes
    // bound for its destination, in stable route order.
    index_t const A = routes.size();
    auto ep_slot = Impl::device_vector<MemorySpace>(slot_table(), "KokkosMoE::PooledWave::ep_slot");
    auto dest = routes.dest_rank;
    auto slot = routes.slot;
    Kokkos::View<int*, MemorySpace> dkey(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::dkey"), A);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::dest_keys", Kokkos::RangePolicy<Exec>(exec, 0, A), KOKKOS_LAMBDA(index_t a) { dkey(a) = ep_slot(dest(a)); });
    Kokkos::View<index_t*, MemorySpace> by_dest(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::by_dest"), A);
    Kokkos::View<index_t*, MemorySpace> dest_off("KokkosMoE::PooledWave::dest_off", P + 1);
    KokkosMoE::Impl::stable_counting_sort(exec, dkey, P, by_dest, dest_off, "KokkosMoE::PooledWave::by_dest");
    // pool_route(w, dest, row) = route index, or -1.
    Kokkos::View<index_t***, Kokkos::LayoutRight, MemorySpace> pool_route("KokkosMoE::PooledWave::pool_route", W, P, Rs);
    Kokkos::deep_copy(exec, pool_route, -1);
    std::int64_t sender_drops = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::PooledWave::stripe", Kokkos::RangePolicy<Exec>(exec, 0, A),
        KOKKOS_LAMBDA(index_t p, std::int64_t & drops) {
          index_t const a = by_dest(p);
          int const q = dkey(a);
          index_t const i = p - dest_off(q);
          index_t const row = i / W;
          if (row < Rs)
            pool_route(static_cast<int>(i % W), q, row) = a;
          else
            ++drops;
        },
        sender_drops);
    Compat::fence(exec, "KokkosMoE::PooledWave: striped");
    res.sender_drops = sender_drops;
    res.ledger.dispatch.sender_drops = sender_drops;

    // Local expert id of every slot at its own rank.
    std::vector<int> local_of(static_cast<std::size_t>(placement.num_slots()));
    for (int s = 0; s < placement.num_slots(); ++s) local_of[s] = placement.local_index(s);
    auto local_id = Impl::device_vector<MemorySpace>(local_of, "KokkosMoE::PooledWave::local_id");
    auto token = routes.token;
    auto inv = plan.inv;
    auto const nor = Impl::node_of_rank(*comms_);
    std::vector<index_t> const uniform(static_cast<std::size_t>(P), pool);

    auto send = work_.payload(exec, "pooled_send", dispatch_type, d, P * pool);
    auto recv = work_.payload(exec, "pooled_recv", dispatch_type, d, P * pool);
    auto back = work_.payload(exec, "pooled_back", return_type, d, P * pool);
    auto got = work_.payload(exec, "pooled_got", return_type, d, P * pool);
    std::int64_t receiver_drops = 0;
    Kokkos::Timer timer;
    for (int w = 0; w < W; ++w) {
      timer.reset();
      // Build the pools: header row with packed local expert ids, then rows.
      auto sb = send.bytes;
      zero_fill(exec, sb);
      // One thread per pool packs its ids (bits wide, little-endian).
      Kokkos::parallel_for(
          "KokkosMoE::PooledWave::headers", Kokkos::RangePolicy<Exec>(exec, 0, P), KOKKOS_LAMBDA(int q) {
            unsigned char* hdr = &sb(q * pool, 0);
            std::uint32_t acc = 0;
            int filled = 0;
            index_t at = 0;
            for (index_t j = 0; j < Rs; ++j) {
              index_t const a = pool_route(w, q, j);
              std::uint32_t const id = a >= 0 ? static_cast<std::uint32_t>(local_id(slot(a))) : static_cast<std::uint32_t>(L);
              acc |= id << filled;
              filled += bits;
              while (filled >= 8) {
                hdr[at++] = static_cast<unsigned char>(acc & 0xFFu);
                acc >>= 8;
                filled -= 8;
              }
            }
            if (filled > 0) hdr[at] = static_cast<unsigned char>(acc & 0xFFu);
          });
      Compat::fence(exec, "KokkosMoE::PooledWave: headers");
      gather_encode(exec, hidden,
                    KOKKOS_LAMBDA(index_t r)->index_t {
                      index_t const j = r % pool;
                      if (j == 0) return -1;
                      index_t const a = pool_route(w, static_cast<int>(r / pool), j - 1);
                      return a >= 0 ? static_cast<index_t>(token(a)) : -1;
                    },
                    send, "KokkosMoE::PooledWave::pack");
      transport_.alltoallv(exec, ep, {RowSet<MemorySpace>{send.bytes, recv.bytes}}, uniform, uniform,
                     "pooled-wave dispatch rows", options_);
      {
        StageLedger st{"wave " + std::to_string(w), ep.name()};
        // Static shapes: every peer gets a full pool; useful rows are those
        // carrying a route, the rest is padding, plus one header row each.
        std::vector<std::int64_t> useful(static_cast<std::size_t>(P), 0);
        auto hp = Impl::host_vector_3d(pool_route, w);
        for (int q = 0; q < P; ++q)
          for (index_t j = 0; j < Rs; ++j) useful[q] += hp[static_cast<std::size_t>(q * Rs + j)] >= 0 ? 1 : 0;
        add_sends(st, useful, ep.peer_order(), me, nor, send.row_bytes(), 0);
        for (int q = 0; q < P; ++q) {
          std::int64_t const pad = Rs - useful[q];
          st.padding_rows += pad;
          st.header_rows += 1;
          auto const c = ep.global_rank(q) == me ? LinkClass::same_rank
                         : nor[static_cast<std::size_t>(ep.global_rank(q))] == nor[static_cast<std::size_t>(me)] ? LinkClass::intra_node
                                                                                                              : LinkClass::inter_node;
          st.by_class[static_cast<int>(c)].meta_bytes += send.row_bytes();
          if (useful[q] == 0) st.by_class[static_cast<int>(c)].messages += 1;  // the pool moves even when empty
        }
        res.ledger.dispatch.stages.push_back(st);
      }

      // Receiver: compact per local expert, (source, pool row) order; keep the
      // first expert_rows rows of each expert.
      index_t const n_pool = static_cast<index_t>(P) * Rs;
      Kokkos::View<int*, MemorySpace> ekey(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::ekey"), n_pool);
      auto rb = recv.bytes;
      Kokkos::parallel_for(
          "KokkosMoE::PooledWave::read_headers", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t x) {
            int const s = static_cast<int>(x / Rs);
            index_t const j = x % Rs;
            int const id = Impl::read_packed_id(&rb(s * pool, 0), j, bits);
            ekey(x) = id < L ? id : L;
          });
      Kokkos::View<index_t*, MemorySpace> by_expert(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::by_expert"), n_pool);
      auto& wave_stage = res.ledger.dispatch.stages.back();
      Kokkos::View<index_t*, MemorySpace> e_off("KokkosMoE::PooledWave::e_off", L + 2);
      KokkosMoE::Impl::stable_counting_sort(exec, ekey, L + 1, by_expert, e_off, "KokkosMoE::PooledWave::by_expert");
      auto he = Impl::host_vector(e_off);
      std::vector<index_t> offsets(static_cast<std::size_t>(L) + 1, 0);
      for (int q = 0; q < L; ++q) {
        index_t const n = he[q + 1] - he[q];
        index_t const kept = n < Rr ? n : Rr;
        receiver_drops += n - kept;
        offsets[q + 1] = offsets[q] + kept;
      }
      auto offsets_d = Impl::device_vector<MemorySpace>(offsets, "KokkosMoE::PooledWave::offsets");
      index_t const used = offsets[L];
      // The callback sees this rank's own slots: [L_me + 1] offsets (ids
      // beyond L_me never arrive here).
      int const L_me = placement.num_slots_of_rank(me);
      std::vector<index_t> const my_offsets(offsets.begin(), offsets.begin() + L_me + 1);
      auto const my_offsets_d = Kokkos::subview(offsets_d, std::pair<int, int>(0, L_me + 1));
      // compact_of(x) = compact row of pool row x, or -1 (empty or dropped).
      Kokkos::View<index_t*, MemorySpace> compact_of("KokkosMoE::PooledWave::compact_of", n_pool);
      Kokkos::View<index_t*, MemorySpace> source_of(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::source_of"), used);
      Kokkos::deep_copy(exec, compact_of, -1);
      Kokkos::parallel_for(
          "KokkosMoE::PooledWave::compact", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t p) {
            index_t const x = by_expert(p);
            int const q = ekey(x);
            if (q >= L) return;
            index_t const i = p - e_off(q);
            if (i >= Rr) return;
            index_t const c = offsets_d(q) + i;
            compact_of(x) = c;
            source_of(c) = (x / Rs) * pool + 1 + (x % Rs);
          });
      auto x_em = work_.payload(exec, "pooled_x_em", dispatch_type, d, used);
      gather_rows(exec, recv, KOKKOS_LAMBDA(index_t c)->index_t { return source_of(c); }, x_em, "KokkosMoE::PooledWave::compact_rows");
      Compat::fence(exec, "KokkosMoE::PooledWave: compacted");
      wave_stage.seconds = timer.seconds();
      // A failing expert on one rank fails the wave on every rank (the return
      // pools are static, so nobody would notice otherwise).
      PayloadBuffer<MemorySpace> y_em;
      std::string const problem = Impl::problem_of([&] {
        KOKKOSMOE_REQUIRE(used == my_offsets.back(), "pooled-wave: rows arrived for local expert ids beyond this rank's " << L_me << " slots");
        y_em = expert(x_em, my_offsets, my_offsets_d);
        KOKKOSMOE_REQUIRE(y_em.rows() == used && y_em.type == return_type && y_em.width == d,
                          "pooled-wave expert callback returned " << y_em.rows() << " rows of " << to_string(y_em.type) << "/"
                                                                  << y_em.width << " for " << used << " rows of "
                                                                  << to_string(return_type) << "/" << d);
      });
      agree_or_throw(ep, problem, "pooled-wave experts", options_);
      timer.reset();

      // Return pools: the header's bit j flags that pool row j carries a result.
      auto bb = back.bytes;
      zero_fill(exec, bb);
      index_t const flag_bytes = (Rs + 7) / 8;
      Kokkos::parallel_for(
          "KokkosMoE::PooledWave::return_headers", Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(P) * flag_bytes),
          KOKKOS_LAMBDA(index_t x) {
            index_t const s = x / flag_bytes, byte = x % flag_bytes;
            unsigned char flags = 0;
            for (int b = 0; b < 8; ++b) {
              index_t const j = byte * 8 + b;
              if (j < Rs && compact_of(s * Rs + j) >= 0) flags = static_cast<unsigned char>(flags | (1u << b));
            }
            bb(s * pool, byte) = flags;
          });
      Impl::scatter_rows(exec, y_em, KOKKOS_LAMBDA(index_t c)->index_t { return source_of(c); }, back,
                         "KokkosMoE::PooledWave::return_rows");
      transport_.alltoallv(exec, ep, {RowSet<MemorySpace>{back.bytes, got.bytes}}, uniform, uniform,
                     "pooled-wave combine rows", options_);
      {
        StageLedger st{"wave " + std::to_string(w) + " (return)", ep.name()};
        // What returns: one row per received route that was kept.
        std::vector<std::int64_t> kept_from(static_cast<std::size_t>(P), 0);
        auto hc = Impl::host_vector(compact_of);
        for (int s = 0; s < P; ++s)
          for (index_t j = 0; j < Rs; ++j) kept_from[s] += hc[static_cast<std::size_t>(s * Rs + j)] >= 0 ? 1 : 0;
        add_sends(st, kept_from, ep.peer_order(), me, nor, back.row_bytes(), 0);
        for (int s = 0; s < P; ++s) {
          st.padding_rows += Rs - kept_from[s];
          st.header_rows += 1;
          auto const c = ep.global_rank(s) == me ? LinkClass::same_rank
                         : nor[static_cast<std::size_t>(ep.global_rank(s))] == nor[static_cast<std::size_t>(me)] ? LinkClass::intra_node
                                                                                                              : LinkClass::inter_node;
          st.by_class[static_cast<int>(c)].meta_bytes += back.row_bytes();
          if (kept_from[s] == 0) st.by_class[static_cast<int>(c)].messages += 1;
        }
        res.ledger.combine.stages.push_back(st);
      }
      // Sender: results to their send positions (dropped rows stay zero).
      auto gb = got.bytes;
      auto out = res.returned.bytes;
      std::int64_t const grb = got.row_bytes();
      using policy_t = Kokkos::TeamPolicy<Exec>;
      Kokkos::parallel_for(
          "KokkosMoE::PooledWave::collect", KokkosMoE::Impl::row_policy(exec, n_pool),
          KOKKOS_LAMBDA(typename policy_t::member_type const& team) {
            index_t const x = team.league_rank();
            int const q = static_cast<int>(x / Rs);
            index_t const j = x % Rs;
            index_t const a = pool_route(w, q, j);
            if (a < 0 || ((gb(q * pool, j / 8) >> (j % 8)) & 1u) == 0) return;
            KokkosMoE::Impl::copy_row_bytes(team, &gb(q * pool + 1 + j, 0), &out(inv(a), 0), grb);
          });
      Compat::fence(exec, "KokkosMoE::PooledWave: wave collected");
      res.ledger.combine.stages.back().seconds = timer.seconds();
    }
    res.receiver_drops = receiver_drops;
    res.ledger.dispatch.receiver_drops = receiver_drops;
    // Routes delivered: what this rank sent minus what it dropped on receipt
    // (sums over ranks give the global count).
    res.ledger.dispatch.useful_rows = (A - sender_drops) - receiver_drops;
    res.ledger.combine.useful_rows = res.ledger.dispatch.useful_rows;
    return res;
  }

 private:
  std::vector<int> slot_table() const {
    std::vector<int> s(static_cast<std::size_t>(comms_->size()));
    for (int r = 0; r < comms_->size(); ++r) s[static_cast<std::size_t>(r)] = comms_->ep().slot_of(r);
    return s;
  }

  Topology::CommunicatorSet const* comms_;
  PooledWaveConfig config_;
  TransportOptions options_;
  PooledWaveShapes shapes_;
  Impl::Workspace<MemorySpace> work_;
  TransportContext<Transport, MemorySpace> transport_;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
