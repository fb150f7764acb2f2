#ifndef KOKKOSMOE_EXCHANGE_POOLEDWAVE_HPP
#define KOKKOSMOE_EXCHANGE_POOLEDWAVE_HPP

/// \file KokkosMoE_Exchange_PooledWave.hpp
/// \brief Pooled-wave exchange: static shapes, no count collective. Each wave
/// sends one pool per destination rank: in-band header rows carrying the
/// packed local expert ids of the pool's rows (as many rows as the ids need:
/// one, but for the narrowest rows), then pool_rows payload rows.
/// The i-th assignment (in stable route order) bound for a destination goes
/// to wave i % W at pool row i / W; rows beyond a sender pool are sender
/// drops (S). The receiver compacts each wave's rows per local expert into
/// static per-expert arrays of expert_rows rows; rows beyond that are
/// receiver drops (R). Results return through the same static shapes (the
/// return header flags which rows carry a result).
///
/// The waves are the caller's loop over the contract's two verbs: dispatch
/// wave w -> experts on its rows -> combine wave w, for w in [0, waves()).
/// Combine of wave w writes the return row of every route of wave w (the
/// expert's output, or zeros for a dropped route), so after the last wave
/// every row of the return buffer is written once and the final combine is
/// the same k-slot-ordered FP32 reduction as for the other algorithms:
/// without drops the output is bitwise identical to the flat exchange's.
///
/// dispatch = stripe (this wave's pool rows) -> build_pools -> all-to-all ->
/// compact (expert rows). combine = return_pools -> all-to-all -> collect.
/// Pools are written row by row in one pass each (routes' rows and zeroed
/// header rows, then the header bytes): no clearing pass, and the padding
/// rows, never read, are never written. The rows of a pool that carry
/// routes are a prefix, so over a transport whose receives take up to their
/// count (MPI) a pool travels as its header rows and that prefix, into a
/// receive of the whole static pool: still no count collective, and no
/// padding on the wire. NCCL, which pairs equal sizes only, moves whole
/// pools. A rank's pool for itself is written straight into its receive
/// buffer (the shapes are uniform, so it lands where it is sent from): no
/// self copy.
///
/// Over MPI, where both payloads are the rows' own type (direct_rows), no
/// row is copied but the pack: a pool's header travels first, as a message
/// of its own; from the headers a receiver knows where every row of the
/// wave goes. A pool's rows that carry routes are packed by local expert
/// (stably), so a source's rows of one expert travel as one run straight
/// into their expert rows (with receiver drops into spare rows past them,
/// whose kept prefix is moved into place after; the own pool is packed
/// straight into its expert rows from hidden). A wave's headers travel
/// while its rows are packed. The results leave from the expert outputs as
/// one message per peer straight into the return rows of their routes (rows
/// of routes without a result are zeroed), after their flags, which are
/// known once the dispatch has arranged its rows and travel from then until
/// the combine. The static shapes, the waves, which routes are dropped, and
/// the bits are the same as with in-band headers.
/// A message whose two sides cut it into different runs is what MPI's
/// derived datatypes allow (RowSet::one_message); NCCL, and MPI with
/// pair_runs, keep in-band headers.

#include <KokkosMoE_CountingSort.hpp>
#include <KokkosMoE_Exchange_Planner.hpp>
#include <KokkosMoE_Exchange_PooledWaveShape.hpp>
#include <impl/KokkosMoE_Exchange_Common.hpp>

namespace KokkosMoE {
namespace Exchange {

template <class ExecutionSpace = Kokkos::DefaultExecutionSpace, class MemorySpace = typename ExecutionSpace::memory_space>
class PooledWaveExchange : public Impl::ExchangeBase<ExecutionSpace, MemorySpace> {
  using base = Impl::ExchangeBase<ExecutionSpace, MemorySpace>;
  using Exec = ExecutionSpace;
  using MS = MemorySpace;
  using index_view = Kokkos::View<index_t*, MS>;

 public:
  static constexpr Algorithm algorithm = Algorithm::pooled_wave;

  /// \brief One wave, kept for its return.
  struct State {
    PooledWaveShapes shapes;  ///< of this step's row width (header rows included)
    Kokkos::View<index_t**, Kokkos::LayoutRight, MS> pool_route;  ///< [P, Rs] route at (destination slot, pool row), or -1
    index_view position;    ///< [A] route's position among the routes to its destination
    index_view compact_of;  ///< [P * Rs] receiver: expert row of received pool row x, or -1 (empty or dropped)
    std::vector<index_t> sent_rows;      ///< [P] rows with a route in the pool for each destination slot (a prefix)
    std::vector<index_t> received_rows;  ///< [P] receiver: rows with a route in each source slot's pool (a prefix)
    bool direct = false;                 ///< rows went straight to the expert rows (direct_rows)
    std::vector<index_t> compact_host;   ///< direct: host copy of compact_of
    std::vector<std::int64_t> sent_runs; ///< direct: [P] runs (local experts) of the rows for each destination slot
    /// direct: the return flags (bit j of destination slot q's: its pool row
    /// j comes back), in flight from the dispatch until the combine.
    Kokkos::View<unsigned char**, Kokkos::LayoutRight, MS> flags_in;
    std::shared_ptr<RowsInFlight> flags;
  };

  PooledWaveExchange(Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config = {},
                     PlacementRegistry const* registry = nullptr)
      : base(algorithm, comms, std::move(placement), config, registry) {
    shape_ = pooled_wave_config(this->config_, this->placement_);
    shapes_ = pooled_wave_shapes(shape_, comms.ep().size());
    std::vector<int> ep_slot(static_cast<std::size_t>(comms.size()));
    for (int r = 0; r < comms.size(); ++r) ep_slot[static_cast<std::size_t>(r)] = comms.ep().slot_of(r);
    ep_slot_ = Impl::device_vector<MS>(ep_slot, "KokkosMoE::PooledWave::ep_slot");
    std::vector<int> local_of(static_cast<std::size_t>(this->placement_.num_slots()));
    for (int s = 0; s < this->placement_.num_slots(); ++s) local_of[static_cast<std::size_t>(s)] = this->placement_.local_index(s);
    local_id_ = Impl::device_vector<MS>(local_of, "KokkosMoE::PooledWave::local_id");
  }

  int waves() const { return shape_.waves; }
  /// \brief Pool and receiver rows (one header row; see shapes_for).
  PooledWaveShapes const& shapes() const { return shapes_; }
  /// \brief The shapes for rows of width d: the header takes as many rows of
  /// the dispatch (and return) payload as the pool's packed ids (and flags) need.
  PooledWaveShapes shapes_for(int d) const {
    return pooled_wave_shapes(shape_, this->comms_->ep().size(), payload_row_bytes(this->config_.payload, d),
                              payload_row_bytes(this->config_.return_payload, d));
  }
  PooledWaveConfig const& shape() const { return shape_; }

  /// \brief Whether rows of type T go straight to and from the expert rows:
  /// both payloads T's own (ExchangeConfig::receive_into_experts) over a
  /// transport that moves a peer's runs as one message (MPI without
  /// pair_runs).
  template <class T>
  bool direct_rows() const {
    return this->template receives_into_experts<T>() && this->transport_->gathers_runs();
  }

  /// \brief Collective over the EP communicator: wave `wave` of the routes.
  /// Throws (on every rank) when a rank has more tokens than the static
  /// tokens_per_rank, more local slots than L, a header row cannot hold a
  /// pool's ids, or the wave is outside [0, waves()).
  template <class T>
  DispatchHandle<T, MS> dispatch(Exec const& exec, RoutePlan<MS> const& routes, DispatchPlan<MS> const& plan,
                                 RowMatrix<T, MS> const& hidden, int wave = 0) {
    auto const& ep = this->comms_->ep();
    int const d = static_cast<int>(hidden.extent(1));
    auto h = this->template new_handle<T>(routes, plan, wave);
    agree(ep.comm(), problem_of([&] {
            this->check_dispatch(h, hidden, waves());
            check_shape(routes);
          }),
          "pooled-wave dispatch", this->config_.watchdog_seconds);
    Kokkos::Timer timer;
    h.ledger = this->new_ledger(d);
    State st;
    st.shapes = shapes_for(d);
    st.direct = direct_rows<T>();
    std::int64_t const wave_routes = stripe(exec, st, routes, wave, h.ledger);
    std::int64_t receiver_drops = 0;
    if (st.direct) {
      receiver_drops = dispatch_direct(exec, st, h, routes, hidden);
    } else {
      auto send = payload_buffer(this->work_, exec, "send", this->config_.payload, d, pool_buffer_rows(st));
      auto recv = payload_buffer(this->work_, exec, "recv", this->config_.payload, d, pool_buffer_rows(st));
      build_pools(exec, st, routes, hidden, send, recv);
      move_pools(exec, st, send, recv, st.sent_rows, "pooled-wave dispatch rows");
      receiver_drops = compact(exec, st, h, recv);
    }
    h.ledger.dispatch.stages.push_back(wave_stage(exec, st, wave, payload_row_bytes(this->config_.payload, d), false));
    h.ledger.dispatch.rows_in_place = st.direct;
    h.ledger.dispatch.stages.back().seconds = timer.seconds();
    h.ledger.dispatch.receiver_drops = receiver_drops;
    // Routes delivered: what this rank sent minus what it dropped on receipt
    // (sums over ranks and waves give the global count).
    h.ledger.dispatch.useful_rows = (wave_routes - h.ledger.dispatch.sender_drops) - receiver_drops;
    h.ledger.combine.useful_rows = h.ledger.dispatch.useful_rows;
    h.state = std::move(st);
    h.delivered = true;
    return h;
  }

  /// \brief Collective: the wave's results back to their senders; writes the
  /// return row of every route of this wave (zeros for dropped routes). A
  /// failing expert on one rank (local_problem) fails every rank: the return
  /// pools are static, so nobody would notice otherwise.
  template <class T>
  void combine(Exec const& exec, DispatchHandle<T, MS>& h, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& returned,
               std::string const& local_problem = {}) {
    auto const& ep = this->comms_->ep();
    State const* st = std::any_cast<State>(&h.state);
    std::string problem = local_problem.empty() ? this->combine_problem(h, expert_out, returned) : local_problem;
    if (problem.empty() && !st) problem = "pooled-wave combine: the handle carries no pooled-wave state";
    agree(ep.comm(), problem, "pooled-wave experts", this->config_.watchdog_seconds);
    Kokkos::Timer timer;
    int const d = static_cast<int>(h.expert_rows.extent(1));
    this->set_combine_format(h.ledger, d);
    if (st->direct) {
      combine_direct(exec, *st, h, expert_out, returned);
    } else {
      auto back = payload_buffer(this->work_, exec, "back", this->config_.return_payload, d, pool_buffer_rows(*st));
      auto got = payload_buffer(this->work_, exec, "got", this->config_.return_payload, d, pool_buffer_rows(*st));
      return_pools(exec, *st, expert_out, back, got);
      move_pools(exec, *st, back, got, st->received_rows, "pooled-wave combine rows");
      collect(exec, *st, h, got, returned);
    }
    Compat::fence(exec, "KokkosMoE::PooledWave: wave collected");
    h.ledger.combine.stages.push_back(wave_stage(exec, *st, h.wave, returned.row_bytes(), true));
    h.ledger.combine.rows_in_place = st->direct;
    h.ledger.combine.stages.back().seconds = timer.seconds();
    h.combined = true;
  }

  static std::vector<ByteLedger> plan(PlanInput const& in) { return plan_pooled_wave(in); }

  // Stages. They are public only because CUDA forbids extended device
  // lambdas inside private member functions; they are not part of the
  // interface.

  index_t pool_buffer_rows(State const& st) const {
    return static_cast<index_t>(this->comms_->ep().size()) * st.shapes.pool_rows_with_header;
  }

  /// Moves the pools of `from` (one per peer slot, at its static place) into
  /// the static places of `to`: whole pools, or where the transport's
  /// receives take up to their count, each pool's header rows and the prefix
  /// of `carried` rows that carry routes (the own pool is in place already).
  void move_pools(Exec const& exec, State const& st, PayloadBuffer<MS> const& from, PayloadBuffer<MS> const& to,
                  std::vector<index_t> const& carried, char const* what) {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    index_t const pool = st.shapes.pool_rows_with_header;
    std::vector<index_t> const whole(static_cast<std::size_t>(P), pool);
    if (!this->transport_->receives_up_to()) {
      this->transport_->alltoallv(exec, ep, {RowSet<MS>{from.bytes, to.bytes, {}, {}, /*self_in_place=*/true}}, whole, whole, what,
                                  this->options());
      return;
    }
    std::vector<index_t> sent(whole);
    RowRuns runs(static_cast<std::size_t>(P));
    for (int q = 0; q < P; ++q) {
      auto const k = static_cast<std::size_t>(q);
      if (q != ep.my_slot()) sent[k] = st.shapes.header_rows + carried[k];
      runs[k] = {{q * pool, sent[k]}};
    }
    this->transport_->alltoallv(exec, ep, {RowSet<MS>{from.bytes, to.bytes, std::move(runs), {}, /*self_in_place=*/true}}, sent, whole,
                                what, this->options());
  }

  /// The static shape admits this rank's routes.
  void check_shape(RoutePlan<MS> const& routes) const {
    int const me = this->me_;
    int const L = shape_.local_experts;
    KOKKOSMOE_REQUIRE(routes.num_tokens <= shape_.tokens_per_rank, "pooled-wave exchange: rank " << me << " has " << routes.num_tokens
                                                                                                 << " tokens, the static shape allows "
                                                                                                 << shape_.tokens_per_rank);
    KOKKOSMOE_REQUIRE(routes.top_k == shape_.top_k, "pooled-wave exchange: top_k " << routes.top_k << " but configured " << shape_.top_k);
    KOKKOSMOE_REQUIRE(this->placement_.num_slots_of_rank(me) <= L, "pooled-wave exchange: rank " << me << " holds "
                                                                                                 << this->placement_.num_slots_of_rank(me)
                                                                                                 << " expert slots, the static shape allows " << L);
  }

  /// Sender side: the position of every route among the routes bound for its
  /// destination, in stable route order; this wave's pool rows and sender
  /// drops. Returns the routes of this wave (placed or dropped).
  std::int64_t stripe(Exec const& exec, State& st, RoutePlan<MS> const& routes, int wave, ByteLedger& ledger) {
    int const P = this->comms_->ep().size();
    int const W = shape_.waves;
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const A = routes.size();
    auto ep_slot = ep_slot_;
    auto dest = routes.dest_rank;
    auto dkey = this->work_.template vector<int>(exec, "dest_key", A);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::dest_keys", Kokkos::RangePolicy<Exec>(exec, 0, A), KOKKOS_LAMBDA(index_t a) { dkey(a) = ep_slot(dest(a)); });
    auto by_dest = this->work_.template vector<index_t>(exec, "by_dest", A);
    auto const dest_off = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::dest_off", P + 1);
    stable_counting_sort(exec, dkey, P, by_dest, dest_off, "KokkosMoE::PooledWave::by_dest", &this->work_);
    st.pool_route = scratch<Kokkos::View<index_t**, Kokkos::LayoutRight, MS>>(&this->work_, exec, "KokkosMoE::PooledWave::pool_route", P,
                                                                              static_cast<std::size_t>(Rs));
    Kokkos::deep_copy(exec, st.pool_route, -1);
    st.position = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::position", A);
    auto pool_route = st.pool_route;
    auto position = st.position;
    // Routes of the wave, sender drops.
    auto const counts = scratch<Kokkos::View<std::int64_t*, MS>>(&this->work_, exec, "KokkosMoE::PooledWave::wave_counts", 2);
    Kokkos::deep_copy(exec, counts, std::int64_t(0));
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::stripe", Kokkos::RangePolicy<Exec>(exec, 0, A), KOKKOS_LAMBDA(index_t p) {
          index_t const a = by_dest(p);
          int const q = dkey(a);
          index_t const i = p - dest_off(q);
          position(a) = i;
          if (i % W != wave) return;
          Kokkos::atomic_add(&counts(0), std::int64_t(1));
          index_t const row = i / W;
          if (row < Rs)
            pool_route(q, row) = a;
          else
            Kokkos::atomic_add(&counts(1), std::int64_t(1));
        });
    auto const hc = copy_to_host(exec, counts);
    ledger.dispatch.sender_drops = hc[1];
    // Pool rows with a route per destination: positions wave, wave + W, ...
    // of its routes, up to the pool.
    auto const ho = Impl::host_vector(exec, dest_off);
    st.sent_rows.assign(static_cast<std::size_t>(P), 0);
    for (int q = 0; q < P; ++q) {
      index_t const n = ho[static_cast<std::size_t>(q) + 1] - ho[static_cast<std::size_t>(q)];
      index_t const in_wave = n > wave ? (n - wave + W - 1) / W : 0;
      st.sent_rows[static_cast<std::size_t>(q)] = in_wave < Rs ? in_wave : Rs;
    }
    return hc[0];
  }

  /// Pool row r of a send buffer, or of the receive buffer for this rank's
  /// own pool (pools are uniform: the own pool lands where it would be sent
  /// from), as a PayloadParts row of {send, recv}.
  static KOKKOS_INLINE_FUNCTION index_t pool_target(index_t r, index_t pool, int me) {
    return r / pool == me ? part_row(1, r) : r;
  }

  /// The pools of this wave: a header row with the packed local expert ids,
  /// then the rows (encoded from hidden), per destination; the own pool is
  /// written straight into its place in recv (no self copy).
  template <class T>
  void build_pools(Exec const& exec, State const& st, RoutePlan<MS> const& routes, RowMatrix<T, MS> const& hidden,
                   PayloadBuffer<MS> const& send, PayloadBuffer<MS> const& recv) {
    index_t const H = st.shapes.header_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    int const me = this->comms_->ep().my_slot();
    auto pool_route = st.pool_route;
    auto token = routes.token;
    // Every row once: a route's row encoded from hidden, header rows zero
    // (no separate clearing pass); padding rows (never read) are left as
    // they are. Then the headers.
    KokkosMoE::Impl::move_rows(
        exec, send.rows(), KokkosMoE::Impl::row_access(hidden),
        KOKKOS_LAMBDA(index_t r)->index_t {
          index_t const j = r % pool;
          if (j < H) return -1;
          index_t const a = pool_route(static_cast<int>(r / pool), j - H);
          return a >= 0 ? static_cast<index_t>(token(a)) : -1;
        },
        KokkosMoE::Impl::row_access(PayloadParts<MS>{send, recv, {}, {}}),
        KOKKOS_LAMBDA(index_t r)->index_t {
          index_t const j = r % pool;
          if (j >= H && pool_route(static_cast<int>(r / pool), j - H) < 0) return -1;  // padding
          return pool_target(r, pool, me);
        },
        MissingRow::zero, "KokkosMoE::PooledWave::pack");
    write_ids(exec, st, routes, send.bytes, recv.bytes, pool);
  }

  /// The pools' headers: for each destination slot q, the packed local ids
  /// of its pool rows (bits wide, little-endian; L marks an empty row) at
  /// row q * stride of `to` (of `own` for this rank's pool, which is read
  /// where it is written), over the bytes the ids span.
  void write_ids(Exec const& exec, State const& st, RoutePlan<MS> const& routes, typename RowSet<MS>::rows_view const& to,
                 typename RowSet<MS>::rows_view const& own, index_t stride) {
    int const P = this->comms_->ep().size();
    int const me = this->comms_->ep().my_slot();
    index_t const Rs = st.shapes.sender_pool_rows;
    int const L = shape_.local_experts;
    int const bits = pooled_wave_id_bits(L);
    index_t const span = pooled_wave_id_span(Rs, L);
    auto pool_route = st.pool_route;
    auto local_id = local_id_;
    auto slot = routes.slot;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::headers", Kokkos::RangePolicy<Exec>(exec, 0, P), KOKKOS_LAMBDA(int q) {
          unsigned char* hdr = q == me ? &own(q * stride, 0) : &to(q * stride, 0);
          for (index_t b = 0; b < span; ++b) hdr[b] = 0;
          std::uint32_t acc = 0;
          int filled = 0;
          index_t at = 0;
          for (index_t j = 0; j < Rs; ++j) {
            index_t const a = pool_route(q, j);
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
  }

  /// Ledger stage of one wave's pools: useful rows carry a route (back: a
  /// result), the rest of a pool is padding (pooled_wave_stage).
  StageLedger wave_stage(ExecutionSpace const& exec, State const& st, int wave, std::int64_t row_bytes, bool back) const {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    index_t const Rs = st.shapes.sender_pool_rows;
    std::vector<std::int64_t> useful(static_cast<std::size_t>(P), 0);
    if (!back) {
      // pool_route is contiguous (a leading-extent range of a row-major buffer).
      auto const hp = Impl::host_vector(exec, st.pool_route);
      for (int q = 0; q < P; ++q)
        for (index_t j = 0; j < Rs; ++j) useful[static_cast<std::size_t>(q)] += hp[static_cast<std::size_t>(q * Rs + j)] >= 0 ? 1 : 0;
    } else {
      // What returns: one row per received route that was kept.
      auto const hc = Impl::host_vector(exec, st.compact_of);
      for (int s = 0; s < P; ++s)
        for (index_t j = 0; j < Rs; ++j) useful[static_cast<std::size_t>(s)] += hc[static_cast<std::size_t>(s * Rs + j)] >= 0 ? 1 : 0;
    }
    std::int64_t const header_bytes =
        !st.direct ? 0 : back ? pooled_wave_flag_bytes(Rs) : pooled_wave_id_span(Rs, shape_.local_experts);
    // Direct rows leave in one run per local expert (results: one message).
    bool const runs = st.direct && !back;
    return pooled_wave_stage("wave " + std::to_string(wave) + (back ? " (return)" : ""), ep.name(), useful, ep.peer_order(), this->me_,
                             this->node_of_rank_, row_bytes, st.shapes, header_bytes, runs ? &st.sent_runs : nullptr);
  }

  /// The receiver's arrangement of a wave (arrange).
  struct Arrivals {
    std::vector<index_t> offsets;  ///< [L + 1] kept rows per local expert id, as offsets
    std::int64_t drops = 0;        ///< receiver drops
    Kokkos::View<int*, MS> ids;    ///< [P * Rs] local expert id of each source's pool row (L: none)
  };

  /// Receiver: the wave's layout from the pools' headers (source slot s's at
  /// row s * stride of hdr). Per local expert, its rows in (source, pool row)
  /// order, the first expert_rows of them kept: sets st.received_rows,
  /// st.compact_of (expert row of each pool row, or -1) and h.arrival_key.
  template <class T>
  Arrivals arrange(Exec const& exec, State& st, DispatchHandle<T, MS>& h, typename RowSet<MS>::rows_view const& hdr, index_t stride) {
    int const P = this->comms_->ep().size();
    int const L = shape_.local_experts;
    int const bits = pooled_wave_id_bits(L);
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const Rr = st.shapes.receiver_expert_rows;
    index_t const n_pool = static_cast<index_t>(P) * Rs;
    auto ekey = this->work_.template vector<int>(exec, "expert_key", n_pool);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::read_headers", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t x) {
          int const s = static_cast<int>(x / Rs);
          index_t const j = x % Rs;
          int const id = Impl::read_packed_id(&hdr(s * stride, 0), j, bits);
          ekey(x) = id < L ? id : L;
        });
    // Rows with a route per source pool: the prefix before the first empty id.
    auto const carried = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::received_rows", P);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::received_rows", Kokkos::RangePolicy<Exec>(exec, 0, P), KOKKOS_LAMBDA(int src) {
          index_t j = 0;
          while (j < Rs && ekey(src * Rs + j) < L) ++j;
          carried(src) = j;
        });
    st.received_rows = Impl::host_vector(exec, carried);
    auto by_expert = this->work_.template vector<index_t>(exec, "by_expert", n_pool);
    auto const e_off = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::e_off", L + 2);
    stable_counting_sort(exec, ekey, L + 1, by_expert, e_off, "KokkosMoE::PooledWave::by_expert", &this->work_);
    auto const he = Impl::host_vector(exec, e_off);
    Arrivals out;
    out.ids = ekey;
    out.offsets.assign(static_cast<std::size_t>(L) + 1, 0);
    for (int q = 0; q < L; ++q) {
      index_t const n = he[q + 1] - he[q];
      index_t const kept = n < Rr ? n : Rr;
      out.drops += n - kept;
      out.offsets[q + 1] = out.offsets[q] + kept;
    }
    auto offsets_d = scratch_copy(&this->work_, exec, "KokkosMoE::PooledWave::offsets", out.offsets);
    index_t const used = out.offsets[static_cast<std::size_t>(L)];
    st.compact_of = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::compact_of", n_pool);
    h.arrival_key = scratch<Kokkos::View<std::int64_t*, MS>>(&this->work_, exec, "KokkosMoE::PooledWave::arrival_key", used);
    Kokkos::deep_copy(exec, st.compact_of, -1);
    auto compact_of = st.compact_of;
    auto arrival_key = h.arrival_key;
    index_t const W = shape_.waves, wave = h.wave;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::compact", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t p) {
          index_t const x = by_expert(p);
          int const q = ekey(x);
          if (q >= L) return;
          index_t const i = p - e_off(q);
          if (i >= Rr) return;
          index_t const c = offsets_d(q) + i;
          compact_of(x) = c;
          // Pool row j of a source holds its route j * W + wave to this rank.
          arrival_key(c) = static_cast<std::int64_t>(x / Rs) << 32 | static_cast<std::int64_t>((x % Rs) * W + wave);
        });
    Compat::fence(exec, "KokkosMoE::PooledWave: arranged");
    return out;
  }

  /// Rows kept per slot of this rank (ids beyond its slots never arrive
  /// here: throws when some did).
  std::vector<index_t> kept_per_slot(Arrivals const& arrivals) const {
    int const L_me = this->placement_.num_slots_of_rank(this->me_);
    auto const& off = arrivals.offsets;
    KOKKOSMOE_REQUIRE(off.back() == off[static_cast<std::size_t>(L_me)],
                      "pooled-wave: rows arrived for local expert ids beyond this rank's " << L_me << " slots");
    std::vector<index_t> counts(static_cast<std::size_t>(L_me));
    for (int q = 0; q < L_me; ++q) counts[static_cast<std::size_t>(q)] = off[q + 1] - off[q];
    return counts;
  }

  /// Receiver: the wave's rows compacted per local expert in (source, pool
  /// row) order, the first expert_rows rows of each expert kept and decoded
  /// into the handle's expert rows. Returns the receiver drops.
  template <class T>
  std::int64_t compact(Exec const& exec, State& st, DispatchHandle<T, MS>& h, PayloadBuffer<MS> const& recv) {
    auto const arrivals = arrange(exec, st, h, recv.bytes, st.shapes.pool_rows_with_header);
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const H = st.shapes.header_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    index_t const n_pool = static_cast<index_t>(this->comms_->ep().size()) * Rs;
    // The received row of each expert row.
    auto source_of = this->work_.template vector<index_t>(exec, "source_of", arrivals.offsets.back());
    auto compact_of = st.compact_of;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::source_of", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t x) {
          index_t const c = compact_of(x);
          if (c >= 0) source_of(c) = (x / Rs) * pool + H + (x % Rs);
        });
    agree(this->comms_->ep().comm(), problem_of([&] {
            this->set_expert_rows(exec, h, kept_per_slot(arrivals), recv.width);
            gather_rows(exec, recv, source_of, h.expert_rows, "KokkosMoE::PooledWave::compact_rows");
          }),
          "pooled-wave compaction", this->config_.watchdog_seconds);
    Compat::fence(exec, "KokkosMoE::PooledWave: compacted");
    return arrivals.drops;
  }

  /// Headers, started: one message of `out`'s row bytes per peer, row q of
  /// `out` to peer slot q (the own one is in place in `in`, at row me); `in`
  /// is written when the returned flight finishes.
  RowsInFlight start_headers(Exec const& exec, typename RowSet<MS>::rows_view const& out, typename RowSet<MS>::rows_view const& in,
                             char const* what) {
    auto const& ep = this->comms_->ep();
    std::vector<index_t> const one(static_cast<std::size_t>(ep.size()), 1);
    return this->transport_->start_alltoallv(exec, ep, {RowSet<MS>{out, in, {}, {}, /*self_in_place=*/true}}, one, one, what,
                                             this->options());
  }

  /// Appends one row to a peer's runs (extending the last run where adjacent).
  static void add_row(std::vector<std::pair<index_t, index_t>>& runs, index_t row) {
    if (!runs.empty() && runs.back().first + runs.back().second == row)
      ++runs.back().second;
    else
      runs.push_back({row, 1});
  }

  /// Dispatch of a wave whose rows go straight to the expert rows (see the
  /// file's description): pack, headers, layout, rows. Returns the receiver
  /// drops.
  template <class T>
  std::int64_t dispatch_direct(Exec const& exec, State& st, DispatchHandle<T, MS>& h, RoutePlan<MS> const& routes,
                               RowMatrix<T, MS> const& hidden) {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    int const me = ep.my_slot();
    int const d = static_cast<int>(hidden.extent(1));
    index_t const Rs = st.shapes.sender_pool_rows;
    int const L = shape_.local_experts;
    index_t const n_pool = static_cast<index_t>(P) * Rs;
    // Each pool's rows by local expert (stable): a receiver takes a source's
    // rows of one expert, which are consecutive expert rows, as one run.
    auto pool_route = st.pool_route;
    auto token = routes.token;
    auto local_id = local_id_;
    auto slot = routes.slot;
    auto key = this->work_.template vector<int>(exec, "pool_key", n_pool);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::pool_keys", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t x) {
          int const q = static_cast<int>(x / Rs);
          index_t const a = pool_route(q, x % Rs);
          key(x) = q * (L + 1) + (a >= 0 ? local_id(slot(a)) : L);
        });
    auto by_id = this->work_.template vector<index_t>(exec, "by_id", n_pool);
    auto const id_off = scratch<index_view>(&this->work_, exec, "KokkosMoE::PooledWave::id_off", static_cast<index_t>(P) * (L + 1) + 1);
    stable_counting_sort(exec, key, P * (L + 1), by_id, id_off, "KokkosMoE::PooledWave::by_id", &this->work_);
    // The headers first (they travel while the rows are packed); from them
    // a receiver knows where every row of the wave goes.
    index_t const span = pooled_wave_id_span(Rs, L);
    auto ids_out = this->work_.template matrix<unsigned char>(exec, "ids_send", P, static_cast<std::size_t>(span));
    auto ids_in = this->work_.template matrix<unsigned char>(exec, "ids_recv", P, static_cast<std::size_t>(span));
    write_ids(exec, st, routes, ids_out, ids_in, 1);
    auto headers = start_headers(exec, ids_out, ids_in, "pooled-wave dispatch headers");
    // The other ranks' pools in that order (no header rows), packed from
    // hidden: pool q's rows are send rows [q * Rs, q * Rs + sent_rows[q]).
    auto send = payload_buffer(this->work_, exec, "send", this->config_.payload, d, n_pool);
    KokkosMoE::Impl::move_rows(
        exec, n_pool, KokkosMoE::Impl::row_access(hidden),
        KOKKOS_LAMBDA(index_t p)->index_t {
          index_t const x = by_id(p);
          index_t const a = pool_route(static_cast<int>(x / Rs), x % Rs);
          return a >= 0 ? static_cast<index_t>(token(a)) : -1;
        },
        KokkosMoE::Impl::row_access(send),
        KOKKOS_LAMBDA(index_t p)->index_t {
          index_t const x = by_id(p);
          return x / Rs == me || pool_route(static_cast<int>(x / Rs), x % Rs) < 0 ? -1 : p;
        },
        MissingRow::skip, "KokkosMoE::PooledWave::pack");
    headers.finish();
    auto const arrivals = arrange(exec, st, h, ids_in, 1);
    st.compact_host = Impl::host_vector(exec, st.compact_of);
    auto const ids = Impl::host_vector(exec, arrivals.ids);
    auto const sent_off = Impl::host_vector(exec, id_off);
    // One run per (peer, local expert) on both sides. A source's rows of an
    // expert land in their expert rows when all are kept, else in spare rows
    // past them (the kept ones, a prefix, are moved into place after).
    index_t const used = arrivals.offsets.back();
    std::vector<index_t> send_counts(static_cast<std::size_t>(P), 0), recv_counts(static_cast<std::size_t>(P), 0);
    RowRuns send_runs(static_cast<std::size_t>(P)), recv_runs(static_cast<std::size_t>(P));
    struct Move {
      index_t from, to, rows;
    };
    std::vector<Move> straddling;
    index_t spare = 0;
    st.sent_runs.assign(static_cast<std::size_t>(P), 0);
    std::vector<index_t> n(static_cast<std::size_t>(L)), kept(static_cast<std::size_t>(L)), first(static_cast<std::size_t>(L));
    for (int q = 0; q < P; ++q) {
      auto const k = static_cast<std::size_t>(q);
      for (int e = 0; e < L; ++e) {
        auto const b = sent_off[k * static_cast<std::size_t>(L + 1) + static_cast<std::size_t>(e)];
        auto const rows = sent_off[k * static_cast<std::size_t>(L + 1) + static_cast<std::size_t>(e) + 1] - b;
        if (rows == 0) continue;
        ++st.sent_runs[k];
        if (q != me) send_runs[k].push_back({b, rows});
      }
      if (q == me) continue;
      send_counts[k] = st.sent_rows[k];
      recv_counts[k] = st.received_rows[k];
      std::fill(n.begin(), n.end(), 0);
      std::fill(kept.begin(), kept.end(), 0);
      for (index_t j = 0; j < recv_counts[k]; ++j) {
        auto const x = static_cast<std::size_t>(q * Rs + j);
        auto const e = static_cast<std::size_t>(ids[x]);
        ++n[e];
        if (st.compact_host[x] >= 0 && kept[e]++ == 0) first[e] = st.compact_host[x];
      }
      for (std::size_t e = 0; e < n.size(); ++e) {
        if (n[e] == 0) continue;
        if (kept[e] == n[e]) {
          recv_runs[k].push_back({first[e], n[e]});
          continue;
        }
        recv_runs[k].push_back({used + spare, n[e]});
        if (kept[e] > 0) straddling.push_back({used + spare, first[e], kept[e]});
        spare += n[e];
      }
    }
    RowMatrix<T, MS> landing;
    agree(ep.comm(), problem_of([&] { landing = this->set_expert_rows(exec, h, kept_per_slot(arrivals), d, spare); }),
          "pooled-wave compaction", this->config_.watchdog_seconds);
    // The return flags are known now: they travel while the experts work
    // (combine_direct finishes them).
    index_t const fb = pooled_wave_flag_bytes(Rs);
    st.flags_in = this->work_.template matrix<unsigned char>(exec, "flags_recv", P, static_cast<std::size_t>(fb));
    auto flags_out = this->work_.template matrix<unsigned char>(exec, "flags_send", P, static_cast<std::size_t>(fb));
    write_flags(exec, st, flags_out, st.flags_in, 1);
    st.flags = std::make_shared<RowsInFlight>(start_headers(exec, flags_out, st.flags_in, "pooled-wave combine headers"));
    // The own pool, from hidden straight into its expert rows.
    auto compact_of = st.compact_of;
    KokkosMoE::Impl::move_rows(
        exec, st.sent_rows[static_cast<std::size_t>(me)], KokkosMoE::Impl::row_access(hidden),
        KOKKOS_LAMBDA(index_t r)->index_t { return static_cast<index_t>(token(pool_route(me, r))); },
        KokkosMoE::Impl::row_access(h.expert_rows), KOKKOS_LAMBDA(index_t r)->index_t { return compact_of(me * Rs + r); },
        MissingRow::skip, "KokkosMoE::PooledWave::own_rows");
    RowSet<MS> rows{send.bytes, this->row_bytes_of(landing), std::move(send_runs), std::move(recv_runs), /*self_in_place=*/true};
    rows.owners = landing;
    this->transport_->alltoallv(exec, ep, {rows}, send_counts, recv_counts, "pooled-wave dispatch rows", this->options());
    for (auto const& m : straddling) copy_row_range(exec, landing, m.to, landing, m.from, m.rows);
    Compat::fence(exec, "KokkosMoE::PooledWave: rows in place");
    return arrivals.drops;
  }

  /// Combine of a wave dispatched by dispatch_direct: once its flags (sent
  /// by the dispatch) are in, the results from the expert outputs straight
  /// into the return rows of their routes; every other route of the wave
  /// gets zeros.
  template <class T>
  void combine_direct(Exec const& exec, State const& st, DispatchHandle<T, MS> const& h, RowMatrix<T, MS> const& expert_out,
                      PayloadBuffer<MS> const& returned) {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    int const me = ep.my_slot();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const W = shape_.waves, wave = h.wave;
    // The flags, sent at dispatch: bit j of a destination's says its pool
    // row j comes back.
    KOKKOSMOE_REQUIRE(st.flags, "pooled-wave combine: the dispatch sent no return flags");
    st.flags->finish();
    auto flags_in = st.flags_in;
    // The return row of each flagged pool row of every destination.
    auto pool_route = st.pool_route;
    auto inv = h.plan.inv;
    auto back_row = this->work_.template vector<index_t>(exec, "back_row", static_cast<index_t>(P) * Rs);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::back_rows", Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(P) * Rs), KOKKOS_LAMBDA(index_t x) {
          int const q = static_cast<int>(x / Rs);
          index_t const j = x % Rs;
          index_t const a = pool_route(q, j);
          back_row(x) = a >= 0 && ((flags_in(q, j / 8) >> (j % 8)) & 1u) != 0 ? static_cast<index_t>(inv(a)) : -1;
        });
    // This wave's routes to this rank take their results from the expert
    // outputs; routes without a result (sender or receiver drops) zeros.
    auto out = this->contiguous_rows(exec, expert_out);
    auto compact_of = st.compact_of;
    auto position = st.position;
    auto dest = h.routes.dest_rank;
    auto ep_slot = ep_slot_;
    KokkosMoE::Impl::move_rows(
        exec, h.routes.size(), KokkosMoE::Impl::row_access(out),
        KOKKOS_LAMBDA(index_t a)->index_t {
          index_t const j = position(a) / W;
          return ep_slot(dest(a)) == me && j < Rs ? compact_of(me * Rs + j) : -1;
        },
        KokkosMoE::Impl::row_access(returned),
        KOKKOS_LAMBDA(index_t a)->index_t {
          index_t const i = position(a);
          if (i % W != wave) return -1;
          int const q = ep_slot(dest(a));
          index_t const j = i / W;
          bool const arrives = q != me && j < Rs && ((flags_in(q, j / 8) >> (j % 8)) & 1u) != 0;
          return arrives ? -1 : static_cast<index_t>(inv(a));
        },
        MissingRow::zero, "KokkosMoE::PooledWave::own_results");
    auto const back_h = Impl::host_vector(exec, back_row);
    std::vector<index_t> send_counts(static_cast<std::size_t>(P), 0), recv_counts(static_cast<std::size_t>(P), 0);
    RowRuns send_runs(static_cast<std::size_t>(P)), recv_runs(static_cast<std::size_t>(P));
    for (int q = 0; q < P; ++q) {
      auto const k = static_cast<std::size_t>(q);
      if (q == me) continue;
      for (index_t j = 0; j < st.received_rows[k]; ++j) {
        index_t const c = st.compact_host[static_cast<std::size_t>(q * Rs + j)];
        if (c < 0) continue;
        add_row(send_runs[k], c);
        ++send_counts[k];
      }
      for (index_t j = 0; j < st.sent_rows[k]; ++j) {
        index_t const r = back_h[static_cast<std::size_t>(q * Rs + j)];
        if (r < 0) continue;
        add_row(recv_runs[k], r);
        ++recv_counts[k];
      }
    }
    RowSet<MS> rows{this->row_bytes_of(out), returned.bytes, std::move(send_runs), std::move(recv_runs), /*self_in_place=*/true,
                    /*one_message=*/true};
    rows.owners = out;
    this->transport_->alltoallv(exec, ep, {rows}, send_counts, recv_counts, "pooled-wave combine rows", this->options());
  }

  /// Return pools: the header's bit j flags that pool row j carries a
  /// result. The own pool is written straight into its place in got.
  template <class T>
  void return_pools(Exec const& exec, State const& st, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& back,
                    PayloadBuffer<MS> const& got) {
    int const me = this->comms_->ep().my_slot();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    index_t const H = st.shapes.header_rows;
    auto compact_of = st.compact_of;
    // Every row once: a kept route's result, header rows zero; rows without
    // a result (never read: their flag is clear) are left as they are. Then
    // the headers' flags.
    KokkosMoE::Impl::move_rows(
        exec, back.rows(), KokkosMoE::Impl::row_access(expert_out),
        KOKKOS_LAMBDA(index_t r)->index_t {
          index_t const j = r % pool;
          return j < H ? -1 : compact_of((r / pool) * Rs + (j - H));
        },
        KokkosMoE::Impl::row_access(PayloadParts<MS>{back, got, {}, {}}),
        KOKKOS_LAMBDA(index_t r)->index_t {
          index_t const j = r % pool;
          if (j >= H && compact_of((r / pool) * Rs + (j - H)) < 0) return -1;
          return pool_target(r, pool, me);
        },
        MissingRow::zero, "KokkosMoE::PooledWave::return_rows");
    write_flags(exec, st, back.bytes, got.bytes, pool);
  }

  /// The return headers: bit j of source slot s's flags says its pool row j
  /// carries a result; at row s * stride of `to` (of `own` for this rank's
  /// own pool, read where it is written).
  void write_flags(Exec const& exec, State const& st, typename RowSet<MS>::rows_view const& to,
                   typename RowSet<MS>::rows_view const& own, index_t stride) {
    int const P = this->comms_->ep().size();
    int const me = this->comms_->ep().my_slot();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const fb = pooled_wave_flag_bytes(Rs);
    auto compact_of = st.compact_of;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::return_headers", Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(P) * fb),
        KOKKOS_LAMBDA(index_t x) {
          index_t const s = x / fb, byte = x % fb;
          unsigned char flags = 0;
          for (int b = 0; b < 8; ++b) {
            index_t const j = byte * 8 + b;
            if (j < Rs && compact_of(s * Rs + j) >= 0) flags = static_cast<unsigned char>(flags | (1u << b));
          }
          unsigned char* hdr = s == me ? &own(s * stride, 0) : &to(s * stride, 0);
          hdr[byte] = flags;
        });
  }

  /// Sender: the return row of every route of this wave, at its send
  /// position: the result when its pool row came back flagged, else zeros
  /// (a sender drop has no pool row, a receiver drop no flag).
  template <class T>
  void collect(Exec const& exec, State const& st, DispatchHandle<T, MS> const& h, PayloadBuffer<MS> const& got,
               PayloadBuffer<MS> const& returned) {
    int const W = shape_.waves;
    int const wave = h.wave;
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const H = st.shapes.header_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    auto gb = got.bytes;
    auto out = returned.bytes;
    std::int64_t const rb = got.row_bytes();
    auto position = st.position;
    auto dest = h.routes.dest_rank;
    auto inv = h.plan.inv;
    auto ep_slot = ep_slot_;
    using member_t = typename Kokkos::TeamPolicy<Exec>::member_type;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::collect", KokkosMoE::Impl::row_policy(exec, h.routes.size()), KOKKOS_LAMBDA(member_t const& team) {
          index_t const a = team.league_rank();
          index_t const i = position(a);
          if (i % W != wave) return;
          index_t const j = i / W;
          int const q = ep_slot(dest(a));
          unsigned char* dst = &out(inv(a), 0);
          if (j < Rs && (((&gb(q * pool, 0))[j / 8] >> (j % 8)) & 1u) != 0) {
            KokkosMoE::Impl::copy_row_bytes(team, &gb(q * pool + H + j, 0), dst, rb);
          } else {
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, static_cast<int>(rb)), [&](int b) { dst[b] = 0; });
          }
        });
  }

 private:
  PooledWaveConfig shape_;
  PooledWaveShapes shapes_;
  Kokkos::View<int*, MS> ep_slot_;
  Kokkos::View<int*, MS> local_id_;
};

template <>
struct AlgorithmClass<Algorithm::pooled_wave> {
  template <class Exec, class MS>
  using type = PooledWaveExchange<Exec, MS>;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
