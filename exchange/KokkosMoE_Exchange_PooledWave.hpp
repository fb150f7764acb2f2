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
    index_view source_of;   ///< [rows] receiver: received row of expert row c
    std::vector<index_t> sent_rows;      ///< [P] rows with a route in the pool for each destination slot (a prefix)
    std::vector<index_t> received_rows;  ///< [P] receiver: rows with a route in each source slot's pool (a prefix)
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
    std::int64_t const wave_routes = stripe(exec, st, routes, wave, h.ledger);
    auto send = payload_buffer(this->work_, exec, "send", this->config_.payload, d, pool_buffer_rows(st));
    auto recv = payload_buffer(this->work_, exec, "recv", this->config_.payload, d, pool_buffer_rows(st));
    build_pools(exec, st, routes, hidden, send, recv);
    move_pools(exec, st, send, recv, st.sent_rows, "pooled-wave dispatch rows");
    h.ledger.dispatch.stages.push_back(wave_stage(st, wave, send.row_bytes(), false));
    std::int64_t const receiver_drops = compact(exec, st, h, recv);
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
    auto back = payload_buffer(this->work_, exec, "back", this->config_.return_payload, d, pool_buffer_rows(*st));
    auto got = payload_buffer(this->work_, exec, "got", this->config_.return_payload, d, pool_buffer_rows(*st));
    return_pools(exec, *st, expert_out, back, got);
    move_pools(exec, *st, back, got, st->received_rows, "pooled-wave combine rows");
    h.ledger.combine.stages.push_back(wave_stage(*st, h.wave, back.row_bytes(), true));
    collect(exec, *st, h, got, returned);
    Compat::fence(exec, "KokkosMoE::PooledWave: wave collected");
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
    index_view dest_off("KokkosMoE::PooledWave::dest_off", P + 1);
    stable_counting_sort(exec, dkey, P, by_dest, dest_off, "KokkosMoE::PooledWave::by_dest");
    st.pool_route = Kokkos::View<index_t**, Kokkos::LayoutRight, MS>(
        Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::pool_route"), P, Rs);
    Kokkos::deep_copy(exec, st.pool_route, -1);
    st.position = index_view(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::position"), A);
    auto pool_route = st.pool_route;
    auto position = st.position;
    Kokkos::View<std::int64_t[2], MS> counts("KokkosMoE::PooledWave::wave_counts");  // routes of the wave, sender drops
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
    auto hc = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), counts);
    ledger.dispatch.sender_drops = hc(1);
    // Pool rows with a route per destination: positions wave, wave + W, ...
    // of its routes, up to the pool.
    auto const ho = Impl::host_vector(dest_off);
    st.sent_rows.assign(static_cast<std::size_t>(P), 0);
    for (int q = 0; q < P; ++q) {
      index_t const n = ho[static_cast<std::size_t>(q) + 1] - ho[static_cast<std::size_t>(q)];
      index_t const in_wave = n > wave ? (n - wave + W - 1) / W : 0;
      st.sent_rows[static_cast<std::size_t>(q)] = in_wave < Rs ? in_wave : Rs;
    }
    return hc(0);
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
    int const P = this->comms_->ep().size();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const H = st.shapes.header_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    int const L = shape_.local_experts;
    int const bits = pooled_wave_id_bits(L);
    auto sb = send.bytes;
    auto rb = recv.bytes;
    int const me = this->comms_->ep().my_slot();
    auto pool_route = st.pool_route;
    auto local_id = local_id_;
    auto slot = routes.slot;
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
    // One thread per pool packs its ids (bits wide, little-endian).
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::headers", Kokkos::RangePolicy<Exec>(exec, 0, P), KOKKOS_LAMBDA(int q) {
          unsigned char* hdr = q == me ? &rb(q * pool, 0) : &sb(q * pool, 0);
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

  /// Ledger stage of one wave's pools: every peer gets a full pool; useful
  /// rows carry a route, the rest is padding, plus one header row each.
  StageLedger wave_stage(State const& st, int wave, std::int64_t row_bytes, bool back) const {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const H = st.shapes.header_rows;
    int const me = this->me_;
    auto const& nor = this->node_of_rank_;
    std::vector<std::int64_t> useful(static_cast<std::size_t>(P), 0);
    if (!back) {
      auto const hp = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.pool_route);
      for (int q = 0; q < P; ++q)
        for (index_t j = 0; j < Rs; ++j) useful[static_cast<std::size_t>(q)] += hp(q, j) >= 0 ? 1 : 0;
    } else {
      // What returns: one row per received route that was kept.
      auto const hc = Impl::host_vector(st.compact_of);
      for (int s = 0; s < P; ++s)
        for (index_t j = 0; j < Rs; ++j) useful[static_cast<std::size_t>(s)] += hc[static_cast<std::size_t>(s * Rs + j)] >= 0 ? 1 : 0;
    }
    StageLedger sl{"wave " + std::to_string(wave) + (back ? " (return)" : ""), ep.name()};
    sl.self_in_place = true;  // the own pool is written into the receive buffer
    add_sends(sl, useful, ep.peer_order(), me, nor, row_bytes, 0);
    for (int q = 0; q < P; ++q) {
      sl.padding_rows += Rs - useful[static_cast<std::size_t>(q)];
      sl.header_rows += H;
      int const g = ep.global_rank(q);
      auto const c = g == me ? LinkClass::same_rank
                     : nor[static_cast<std::size_t>(g)] == nor[static_cast<std::size_t>(me)] ? LinkClass::intra_node
                                                                                              : LinkClass::inter_node;
      sl.by_class[static_cast<int>(c)].meta_bytes += H * row_bytes;
      if (useful[static_cast<std::size_t>(q)] == 0) sl.by_class[static_cast<int>(c)].messages += 1;  // the pool moves even when empty
    }
    return sl;
  }

  /// Receiver: the wave's rows compacted per local expert in (source, pool
  /// row) order, the first expert_rows rows of each expert kept and decoded
  /// into the handle's expert rows. Returns the receiver drops.
  template <class T>
  std::int64_t compact(Exec const& exec, State& st, DispatchHandle<T, MS>& h, PayloadBuffer<MS> const& recv) {
    auto const& ep = this->comms_->ep();
    int const P = ep.size();
    int const L = shape_.local_experts;
    int const bits = pooled_wave_id_bits(L);
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const Rr = st.shapes.receiver_expert_rows;
    index_t const H = st.shapes.header_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    index_t const n_pool = static_cast<index_t>(P) * Rs;
    auto ekey = this->work_.template vector<int>(exec, "expert_key", n_pool);
    auto rb = recv.bytes;
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::read_headers", Kokkos::RangePolicy<Exec>(exec, 0, n_pool), KOKKOS_LAMBDA(index_t x) {
          int const s = static_cast<int>(x / Rs);
          index_t const j = x % Rs;
          int const id = Impl::read_packed_id(&rb(s * pool, 0), j, bits);
          ekey(x) = id < L ? id : L;
        });
    // Rows with a route per source pool: the prefix before the first empty id.
    index_view carried("KokkosMoE::PooledWave::received_rows", P);
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::received_rows", Kokkos::RangePolicy<Exec>(exec, 0, P), KOKKOS_LAMBDA(int src) {
          index_t j = 0;
          while (j < Rs && ekey(src * Rs + j) < L) ++j;
          carried(src) = j;
        });
    st.received_rows = Impl::host_vector(carried);
    auto by_expert = this->work_.template vector<index_t>(exec, "by_expert", n_pool);
    index_view e_off("KokkosMoE::PooledWave::e_off", L + 2);
    stable_counting_sort(exec, ekey, L + 1, by_expert, e_off, "KokkosMoE::PooledWave::by_expert");
    auto const he = Impl::host_vector(e_off);
    std::vector<index_t> offsets(static_cast<std::size_t>(L) + 1, 0);
    std::int64_t receiver_drops = 0;
    for (int q = 0; q < L; ++q) {
      index_t const n = he[q + 1] - he[q];
      index_t const kept = n < Rr ? n : Rr;
      receiver_drops += n - kept;
      offsets[q + 1] = offsets[q] + kept;
    }
    auto offsets_d = Impl::device_vector<MS>(offsets, "KokkosMoE::PooledWave::offsets");
    index_t const used = offsets[static_cast<std::size_t>(L)];
    st.compact_of = index_view("KokkosMoE::PooledWave::compact_of", n_pool);
    st.source_of = index_view(Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::source_of"), used);
    h.arrival_key = Kokkos::View<std::int64_t*, MS>(
        Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "KokkosMoE::PooledWave::arrival_key"), used);
    Kokkos::deep_copy(exec, st.compact_of, -1);
    auto compact_of = st.compact_of;
    auto source_of = st.source_of;
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
          source_of(c) = (x / Rs) * pool + H + (x % Rs);
          // Pool row j of a source holds its route j * W + wave to this rank.
          arrival_key(c) = static_cast<std::int64_t>(x / Rs) << 32 | static_cast<std::int64_t>((x % Rs) * W + wave);
        });
    // This rank's own slots (ids beyond them never arrive here).
    int const L_me = this->placement_.num_slots_of_rank(this->me_);
    agree(ep.comm(), problem_of([&] {
            KOKKOSMOE_REQUIRE(used == offsets[static_cast<std::size_t>(L_me)],
                              "pooled-wave: rows arrived for local expert ids beyond this rank's " << L_me << " slots");
            std::vector<index_t> counts(static_cast<std::size_t>(L_me));
            for (int q = 0; q < L_me; ++q) counts[static_cast<std::size_t>(q)] = offsets[q + 1] - offsets[q];
            this->set_expert_rows(exec, h, counts, recv.width);
            gather_rows(exec, recv, source_of, h.expert_rows, "KokkosMoE::PooledWave::compact_rows");
          }),
          "pooled-wave compaction", this->config_.watchdog_seconds);
    Compat::fence(exec, "KokkosMoE::PooledWave: compacted");
    return receiver_drops;
  }

  /// Return pools: the header's bit j flags that pool row j carries a
  /// result. The own pool is written straight into its place in got.
  template <class T>
  void return_pools(Exec const& exec, State const& st, RowMatrix<T, MS> const& expert_out, PayloadBuffer<MS> const& back,
                    PayloadBuffer<MS> const& got) {
    int const P = this->comms_->ep().size();
    int const me = this->comms_->ep().my_slot();
    index_t const Rs = st.shapes.sender_pool_rows;
    index_t const pool = st.shapes.pool_rows_with_header;
    index_t const H = st.shapes.header_rows;
    auto bb = back.bytes;
    auto gb = got.bytes;
    index_t const flag_bytes = (Rs + 7) / 8;
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
    Kokkos::parallel_for(
        "KokkosMoE::PooledWave::return_headers", Kokkos::RangePolicy<Exec>(exec, 0, static_cast<index_t>(P) * flag_bytes),
        KOKKOS_LAMBDA(index_t x) {
          index_t const s = x / flag_bytes, byte = x % flag_bytes;
          unsigned char flags = 0;
          for (int b = 0; b < 8; ++b) {
            index_t const j = byte * 8 + b;
            if (j < Rs && compact_of(s * Rs + j) >= 0) flags = static_cast<unsigned char>(flags | (1u << b));
          }
          (s == me ? &gb(s * pool, 0) : &bb(s * pool, 0))[byte] = flags;  // the header spans the pool's first rows
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
