#ifndef KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP
#define KOKKOSMOE_IMPL_EXCHANGE_COMMON_HPP

/// \file impl/KokkosMoE_Exchange_Common.hpp
/// \brief What every exchange algorithm shares: the communicator set, its
/// placement generation, the configuration, the transport chosen by it, a
/// workspace, handle creation and the local checks of dispatch and combine.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Handle.hpp>
#include <KokkosMoE_Exchange_Nccl.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <algorithm>
#include <climits>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Algorithm class of an enum value: each algorithm header specializes
/// it (template <class Exec, class MS> using type = TheExchange<Exec, MS>),
/// which is all the factory (KokkosMoE_Exchange.hpp) needs to know of it.
template <Algorithm A>
struct AlgorithmClass;

namespace Impl {

/// Stage stopwatch: lap() fences the instance and returns the seconds since
/// the previous lap (or construction).
template <class Exec>
class Lap {
 public:
  explicit Lap(Exec const& exec) : exec_(exec) {}
  double operator()() {
    Compat::fence(exec_, "KokkosMoE::Exchange: stage end");
    double const t = timer_.seconds();
    timer_.reset();
    return t;
  }

 private:
  Exec exec_;
  Kokkos::Timer timer_;
};

inline std::vector<index_t> offsets_of(std::vector<index_t> const& counts) {
  std::vector<index_t> off(counts.size() + 1, 0);
  for (std::size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

/// Segment of row p given segment offsets off[0..n] (n segments): the last
/// s with off(s) <= p (empty segments are skipped over).
template <class Off>
KOKKOS_INLINE_FUNCTION int segment_of(Off const& off, int n, index_t p) {
  int lo = 0, hi = n;  // off(lo) <= p < off(hi)
  while (hi - lo > 1) {
    int const mid = (lo + hi) / 2;
    if (off(mid) <= p)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

inline index_t total(std::vector<index_t> const& v) {
  index_t t = 0;
  for (auto x : v) t += x;
  return t;
}

inline std::vector<int> node_of_rank(Topology::CommunicatorSet const& comms) {
  std::vector<int> n(static_cast<std::size_t>(comms.topology().size()));
  for (int r = 0; r < comms.topology().size(); ++r) n[static_cast<std::size_t>(r)] = comms.topology().node_of(r);
  return n;
}

/// Host copy of a device vector, ordered after exec's work (fenced; no
/// host mirror is allocated).
template <class Exec, class V>
std::vector<typename V::non_const_value_type> host_vector(Exec const& exec, V const& v) {
  return copy_to_host(exec, v);
}

/// Device copy of a host vector (a fresh view; see scratch_copy).
template <class MS, class T>
Kokkos::View<T*, MS> device_vector(std::vector<T> const& v, char const* label) {
  return scratch_copy(static_cast<Workspace<MS>*>(nullptr), typename MS::execution_space(), label, v);
}

/// Rows i of [0, n) whose inverse repack position inv(i) is not where the
/// runs put them: run k holds arrivals [af(k), af(k + 1)) at expert rows
/// from ef(k) on (K runs). A free function: CUDA forbids extended device
/// lambdas in protected member functions.
template <class Exec, class MS, class Inv>
index_t misplaced_rows(Exec const& exec, Kokkos::View<index_t*, MS> const& af, Kokkos::View<index_t*, MS> const& ef, int K,
                       Inv const& inv, index_t n) {
  index_t misplaced = 0;
  Kokkos::parallel_reduce(
      "KokkosMoE::Exchange::check_runs", Kokkos::RangePolicy<Exec>(exec, 0, n),
      KOKKOS_LAMBDA(index_t i, index_t & bad) {
        int const k = segment_of(af, K, i);
        if (inv(i) != ef(k) + (i - af(k))) ++bad;
      },
      misplaced);
  return misplaced;
}

/// The base of every exchange algorithm (shared state and checks; not a
/// polymorphic interface: see AnyExchange for that).
template <class Exec, class MemorySpace>
class ExchangeBase {
 public:
  using execution_space = Exec;
  using memory_space = MemorySpace;

  Topology::CommunicatorSet const& communicators() const { return *comms_; }
  Placement const& placement() const { return placement_; }
  ExchangeConfig const& config() const { return config_; }
  TransportKind transport() const { return transport_->kind(); }
  TransportOptions options() const { return config_.transport_options(); }

  /// Rows of plan positions runs[i] packed from hidden straight into rows
  /// places[i] of dst (runs and places pairwise of one length), in one pass.
  template <class T>
  void pack_straight(Exec const& exec, RoutePlan<MemorySpace> const& routes, DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden,
                     std::vector<std::pair<index_t, index_t>> const& runs, std::vector<std::pair<index_t, index_t>> const& places,
                     typename RowSet<MemorySpace>::rows_view const& dst, char const* label) {
    // Non-empty pieces by place: first place row, then first plan position.
    std::vector<index_t> at, from;
    for (std::size_t i = 0; i < runs.size(); ++i)
      if (runs[i].second > 0) {
        at.push_back(places[i].first);
        from.push_back(runs[i].first);
        at.push_back(places[i].first + runs[i].second);
        from.push_back(-1);
      }
    if (at.empty()) return;
    // Places of one rank's pieces ascend except across slots; sort the
    // boundaries so a binary search finds each row's piece.
    std::vector<std::size_t> order(at.size());
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return at[a] < at[b] || (at[a] == at[b] && from[a] < 0 && from[b] >= 0);
    });
    std::vector<index_t> a2, f2;
    for (auto i : order) {
      a2.push_back(at[i]);
      f2.push_back(from[i]);
    }
    auto piece_at = scratch_copy(&this->work_, exec, "KokkosMoE::Exchange::piece_at", a2);
    auto piece_from = scratch_copy(&this->work_, exec, "KokkosMoE::Exchange::piece_from", f2);
    int const K = static_cast<int>(a2.size());
    index_t const lo = a2.front(), hi = a2.back();
    auto perm = plan.perm;
    auto token = routes.token;
    PayloadBuffer<MemorySpace> rows;
    rows.type = this->config_.payload;
    rows.width = static_cast<int>(hidden.extent(1));
    rows.bytes = Kokkos::subview(dst, std::pair<index_t, index_t>(lo, hi), Kokkos::ALL);
    gather_rows(
        exec, hidden,
        KOKKOS_LAMBDA(index_t q)->index_t {
          index_t const x = q + lo;
          int const k = Impl::segment_of(piece_at, K, x);
          index_t const f = piece_from(k);
          return f < 0 ? index_t(-1) : index_t(token(perm(f + (x - piece_at(k)))));
        },
        rows, label);
  }

  /// \brief Whether rows of type T go straight to and from the expert rows
  /// (ExchangeConfig::receive_into_experts, both payloads T's own
  /// representation; the flat and hierarchical exchanges, and pooled-wave
  /// over MPI).
  template <class T>
  bool receives_into_experts() const {
    return config_.receive_into_experts && KokkosMoE::Impl::same_representation<T>(config_.payload) &&
           KokkosMoE::Impl::same_representation<T>(config_.return_payload);
  }

  /// Bytes of the buffers this exchange keeps between steps (its
  /// workspace and its transport's staging).
  std::int64_t held_bytes() const { return work_.held_bytes() + transport_->held_bytes(); }

  /// \brief pack_local for a send from the hidden rows (sends_from_hidden):
  /// the same checks and metadata, no packed rows. `send` becomes hidden's
  /// rows as bytes (a contiguous copy only where hidden's rows have gaps)
  /// and `rows` the hidden row of every send position (its token). (Public:
  /// CUDA forbids extended lambdas in protected members.)
  template <class T>
  std::string gather_local(Exec const& exec, DispatchHandle<T, MemorySpace>& h, RoutePlan<MemorySpace> const& routes,
                           DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden, int waves,
                           typename RowSet<MemorySpace>::rows_view& send, Kokkos::View<RowMeta*, MemorySpace>& meta,
                           std::shared_ptr<std::vector<int> const>& rows) {
    return problem_of([&] {
      check_dispatch(h, hidden, waves, /*slot_runs=*/true);
      KOKKOSMOE_REQUIRE(static_cast<index_t>(hidden.extent(0)) == routes.num_tokens && hidden.extent(0) <= INT_MAX,
                        "pack: hidden has " << hidden.extent(0) << " rows for " << routes.num_tokens << " tokens");
      auto const source = contiguous_rows(exec, hidden);
      send = row_bytes_of(source);
      meta = work_.template vector<RowMeta>(exec, "send_meta", plan.rows());
      pack_meta(exec, routes, plan, meta);
      auto token_of = work_.template vector<int>(exec, "send_tokens", plan.rows());
      auto perm = plan.perm;
      auto token = routes.token;
      Kokkos::parallel_for(
          "KokkosMoE::Exchange::send_tokens", Kokkos::RangePolicy<Exec>(exec, 0, plan.rows()),
          KOKKOS_LAMBDA(index_t p) { token_of(p) = token(perm(p)); });
      Compat::fence(exec, "KokkosMoE::Exchange::send_tokens");
      // Host memory (sends_from_hidden): the indices are read where they are.
      rows = std::make_shared<std::vector<int> const>(token_of.data(), token_of.data() + plan.rows());
    });
  }

 protected:
  /// Keeps a reference to comms (which must outlive the exchange) and a copy
  /// of the placement generation it moves rows for. With a registry, every
  /// dispatch takes a reference to the registry's active generation (which
  /// must be this placement's) and combine validates it.
  ExchangeBase(Algorithm algorithm, Topology::CommunicatorSet const& comms, Placement placement, ExchangeConfig const& config,
               PlacementRegistry const* registry)
      : comms_(&comms),
        placement_(std::move(placement)),
        config_(config),
        registry_(registry),
        work_("KokkosMoE::Exchange::" + to_string(algorithm)),
        algorithm_(algorithm) {
    config_.algorithm = algorithm;
    // The transport is a configuration choice; every rank makes the same one,
    // so an unavailable transport fails every rank alike.
    transport_ = make_transport<Exec, MemorySpace>(config_.transport, config_.pair_runs);
    node_of_rank_ = node_of_rank(comms);
    me_ = comms.global_rank();
    KOKKOSMOE_REQUIRE(placement_.num_ranks() == comms.size(), to_string(algorithm) << " exchange: the placement spans "
                                                                                  << placement_.num_ranks() << " ranks, the EP group "
                                                                                  << comms.size());
  }

  /// A handle for routes/plan with the exchange's identity.
  template <class T>
  DispatchHandle<T, MemorySpace> new_handle(RoutePlan<MemorySpace> const& routes, DispatchPlan<MemorySpace> const& plan,
                                            int wave) const {
    DispatchHandle<T, MemorySpace> h;
    h.algorithm = algorithm_;
    h.wave = wave;
    h.generation = placement_.generation();
    h.epoch = comms_->epoch();
    h.routes = routes;
    h.plan = plan;
    return h;
  }

  /// Local checks of a dispatch's inputs (the caller agrees on the result):
  /// the plans belong to this rank, this placement and the EP peer order, and
  /// hidden holds the routes' tokens in the configured width; with
  /// slot_runs, the plan has every peer's slot runs.
  template <class T>
  void check_dispatch(DispatchHandle<T, MemorySpace>& h, RowMatrix<T, MemorySpace> const& hidden, int waves,
                      bool slot_runs = false) const {
    auto const& ep = comms_->ep();
    std::string const name = to_string(algorithm_);
    KOKKOSMOE_REQUIRE(h.wave >= 0 && h.wave < waves, name << " dispatch: wave " << h.wave << " of " << waves);
    KOKKOSMOE_REQUIRE(h.plan.peer_order == ep.peer_order(), name << " dispatch: the dispatch plan was built for another peer order");
    KOKKOSMOE_REQUIRE(h.routes.origin_rank == me_, name << " dispatch: rank " << me_ << " got the route plan of rank " << h.routes.origin_rank);
    KOKKOSMOE_REQUIRE(h.routes.generation == placement_.generation(),
                      name << " dispatch: routes of placement generation " << h.routes.generation << " given to the exchange of generation "
                           << placement_.generation());
    KOKKOSMOE_REQUIRE(h.plan.rows() == h.routes.size(), name << " dispatch: the dispatch plan has " << h.plan.rows()
                                                             << " rows for " << h.routes.size() << " routes");
    KOKKOSMOE_REQUIRE(!slot_runs || static_cast<int>(h.plan.slot_runs.size()) == ep.size(),
                      name << " dispatch: the dispatch plan has slot runs for " << h.plan.slot_runs.size() << " of " << ep.size()
                           << " peers");
    KOKKOSMOE_REQUIRE(static_cast<index_t>(hidden.extent(0)) == h.routes.num_tokens,
                      name << " dispatch: hidden has " << hidden.extent(0) << " rows for " << h.routes.num_tokens << " tokens");
    if (registry_) {
      h.generation_ref = registry_->acquire();
      KOKKOSMOE_REQUIRE(h.generation_ref.generation() == placement_.generation(),
                        name << " dispatch: the registry's active placement generation is " << h.generation_ref.generation()
                             << ", this exchange moves rows for generation " << placement_.generation());
    }
  }

  /// Local checks of a handle before its combine: this algorithm, this
  /// communicator epoch, a live placement generation, one output row per
  /// expert row, a return buffer of one row per dispatched route, not
  /// combined before. Returns the problem ("" when fine).
  template <class T>
  std::string combine_problem(DispatchHandle<T, MemorySpace> const& h, RowMatrix<T, MemorySpace> const& expert_out,
                              PayloadBuffer<MemorySpace> const& returned) const {
    return problem_of([&] {
      std::string const name = to_string(algorithm_);
      KOKKOSMOE_REQUIRE(h.algorithm == algorithm_, "a " << to_string(h.algorithm) << " dispatch handle was given to the " << name << " combine");
      comms_->check_epoch(h.epoch, "dispatch handle");
      if (registry_) {
        registry_->check_handle(h.generation_ref, h.generation);
      } else {
        KOKKOSMOE_REQUIRE(h.generation == placement_.generation(), "dispatch handle of placement generation "
                                                                       << h.generation << " does not match the generation "
                                                                       << placement_.generation() << " this exchange moves rows for");
      }
      KOKKOSMOE_REQUIRE(h.delivered, "the combine got a dispatch handle whose dispatch has not finished (dispatch_finish "
                                     "delivers the rows the experts read)");
      KOKKOSMOE_REQUIRE(!h.combined && !h.combine_started, "the dispatch handle was already combined");
      KOKKOSMOE_REQUIRE(static_cast<index_t>(expert_out.extent(0)) == h.rows() && expert_out.extent(1) == h.expert_rows.extent(1),
                        name << " combine got " << expert_out.extent(0) << "x" << expert_out.extent(1) << " expert outputs for "
                             << h.rows() << "x" << h.expert_rows.extent(1) << " dispatched rows");
      KOKKOSMOE_REQUIRE(returned.rows() == h.plan.rows() && returned.type == config_.return_payload &&
                            returned.width == static_cast<int>(h.expert_rows.extent(1)),
                        name << " combine: the return buffer holds " << returned.rows() << " rows of " << to_string(returned.type)
                             << "/" << returned.width << ", expected " << h.plan.rows() << " rows of "
                             << to_string(config_.return_payload) << "/" << h.expert_rows.extent(1));
    });
  }

  /// The expert-major receive side of a handle from per-slot counts; with
  /// spare_rows, rows past the expert rows in the same allocation (where
  /// rows received but not kept land). Returns expert rows and spare rows.
  template <class T, class Exec2>
  RowMatrix<T, MemorySpace> set_expert_rows(Exec2 const& exec, DispatchHandle<T, MemorySpace>& h, std::vector<index_t> counts, int width,
                                            index_t spare_rows = 0) {
    h.expert_counts = std::move(counts);
    h.expert_offsets = offsets_of(h.expert_counts);
    h.expert_offsets_d = scratch_copy(&work_, exec, "expert_offsets", h.expert_offsets);
    index_t const n = h.expert_offsets.back();
    auto all = work_.template matrix<T>(exec, "expert_rows", n + spare_rows, static_cast<std::size_t>(width));
    h.expert_rows = Kokkos::subview(all, std::make_pair(index_t(0), n), Kokkos::ALL);
    return all;
  }

  /// \brief A dispatch's local work first (checks, rows and metadata packed
  /// in the plan's send order); the problem it returns rides on the count
  /// agreement (point to point under the watchdog), so a problem fails every
  /// rank. slot_runs: the plan must have every peer's slot runs. skip_own:
  /// the rank's own rows are not packed (the caller places them).
  template <class T>
  std::string pack_local(Exec const& exec, DispatchHandle<T, MemorySpace>& h, RoutePlan<MemorySpace> const& routes,
                         DispatchPlan<MemorySpace> const& plan, RowMatrix<T, MemorySpace> const& hidden, int waves, bool slot_runs,
                         PayloadBuffer<MemorySpace>& send, Kokkos::View<RowMeta*, MemorySpace>& meta, bool skip_own = false) {
    return problem_of([&] {
      check_dispatch(h, hidden, waves, slot_runs);
      send = payload_buffer(work_, exec, "send", config_.payload, static_cast<int>(hidden.extent(1)), plan.rows());
      meta = work_.template vector<RowMeta>(exec, "send_meta", plan.rows());
      int const me = plan.my_peer_slot;
      bool const skip = skip_own && me >= 0;
      pack(exec, routes, plan, hidden, send, meta, skip ? plan.offsets[me] : 0, skip ? plan.counts[me] : 0);
    });
  }

  /// \brief Whether a direct dispatch sends its rows from the hidden rows
  /// themselves (RowSet::send_rows: MPI reads each route's token row through
  /// an indexed datatype, and no packed copy is made). Where the transport
  /// gathers runs (MPI, not NCCL or pair_runs) and MPI reads the memory
  /// space directly as host memory; device rows are packed by a kernel,
  /// which is faster there than MPI's datatype engine. Only where every rank
  /// runs on one host: shared memory copies a gathered row once, while a
  /// network transport packs it into its fragments anyway and a contiguous
  /// send goes from the packed rows directly (measured slower across hosts).
  /// The same on every rank of a run (build, configuration and topology).
  bool sends_from_hidden() const {
    return transport_->gathers_runs() && Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemorySpace>::accessible &&
           comms_->topology().single_host();
  }

  /// \brief The expert-major places of a dispatch whose rows go straight
  /// there: per source EP peer slot, one run of expert rows per local slot
  /// of this rank (expert rows of a slot are by source, then send position:
  /// the repack's order), and the same runs by (source, slot) as first
  /// arrival position (one more entry: the arrivals) and first expert row,
  /// to check the repack plan against.
  struct DirectRuns {
    RowRuns expert_runs;
    std::vector<index_t> arrival_first, expert_first;
  };

  /// The most slots any rank holds (a bound every rank knows).
  int max_slots_per_rank() const {
    int m = 0;
    for (int r = 0; r < placement_.num_ranks(); ++r) m = std::max(m, placement_.num_slots_of_rank(r));
    return m;
  }

  /// Sets h's expert rows from every source's announced slot runs
  /// (run_lengths[p][l]: rows source EP slot p sends for local slot l) and
  /// returns where each (source, slot) run goes.
  template <class T>
  DirectRuns direct_layout(Exec const& exec, DispatchHandle<T, MemorySpace>& h, std::vector<std::vector<index_t>> const& run_lengths,
                           int width) {
    int const P = static_cast<int>(run_lengths.size());
    int const L = placement_.num_slots_of_rank(me_);
    std::vector<index_t> per_slot(static_cast<std::size_t>(L), 0);
    for (auto const& lengths : run_lengths)
      for (int l = 0; l < L; ++l) per_slot[static_cast<std::size_t>(l)] += lengths[static_cast<std::size_t>(l)];
    set_expert_rows(exec, h, per_slot, width);
    DirectRuns direct;
    direct.expert_runs.assign(static_cast<std::size_t>(P), {});
    std::vector<index_t> at(h.expert_offsets.begin(), h.expert_offsets.end() - 1);
    index_t arrival = 0;
    for (int p = 0; p < P; ++p)
      for (int l = 0; l < L; ++l) {
        index_t const n = run_lengths[static_cast<std::size_t>(p)][static_cast<std::size_t>(l)];
        direct.expert_runs[static_cast<std::size_t>(p)].push_back({at[static_cast<std::size_t>(l)], n});
        direct.arrival_first.push_back(arrival);
        direct.expert_first.push_back(at[static_cast<std::size_t>(l)]);
        at[static_cast<std::size_t>(l)] += n;
        arrival += n;
      }
    direct.arrival_first.push_back(arrival);
    return direct;
  }

  /// Collective over EP: builds h.repack from h.arrived_meta (flat arrival
  /// order) and checks that it puts every row where its run put it; a row
  /// for another slot than its sender announced fails every rank.
  template <class T>
  void check_direct_repack(Exec const& exec, DispatchHandle<T, MemorySpace>& h, DirectRuns const& direct) {
    agree(comms_->ep().comm(), problem_of([&] {
            h.repack = make_repack_plan(exec, h.arrived_meta, placement_, me_, &work_);
            index_t misplaced = 0;
            int const K = static_cast<int>(direct.expert_first.size());
            if (K > 0 && h.repack.rows() > 0) {
              auto af = scratch_copy(&work_, exec, "KokkosMoE::Exchange::arrival_first", direct.arrival_first);
              auto ef = scratch_copy(&work_, exec, "KokkosMoE::Exchange::expert_first", direct.expert_first);
              misplaced = misplaced_rows(exec, af, ef, K, h.repack.inv, h.repack.rows());
            }
            KOKKOSMOE_REQUIRE(h.repack.slot_counts == h.expert_counts && misplaced == 0,
                              to_string(algorithm_) << " dispatch: " << misplaced << " rows that arrived at rank " << me_
                                                    << " are for other slots than their senders announced");
          }),
          (to_string(algorithm_) + " dispatch repack").c_str(), config_.watchdog_seconds);
  }

  /// The bytes of a matrix whose rows are contiguous.
  template <class T>
  static typename RowSet<MemorySpace>::rows_view row_bytes_of(RowMatrix<T, MemorySpace> const& m) {
    return typename RowSet<MemorySpace>::rows_view(reinterpret_cast<unsigned char*>(m.data()), m.extent(0), m.extent(1) * sizeof(T));
  }

  /// m itself where its rows are contiguous, else a contiguous copy to send
  /// from (rows with gaps between them).
  template <class T>
  RowMatrix<T, MemorySpace> contiguous_rows(Exec const& exec, RowMatrix<T, MemorySpace> const& m) {
    if (m.extent(0) <= 1 || static_cast<std::size_t>(m.stride(0)) == m.extent(1)) return m;
    auto out = work_.template matrix<T>(exec, "expert_out", static_cast<index_t>(m.extent(0)), m.extent(1));
    Kokkos::deep_copy(exec, out, m);
    return out;
  }

  /// Ledger header of one call.
  ByteLedger new_ledger(int width) const {
    ByteLedger l;
    l.algorithm = to_string(algorithm_);
    l.payload = to_string(config_.payload);
    l.width = width;
    l.row_bytes = payload_row_bytes(config_.payload, width);
    l.meta_row_bytes = sizeof(RowMeta);
    l.ranks = 1;
    return l;
  }

  void set_combine_format(ByteLedger& l, int width) const {
    l.combine_payload = to_string(config_.return_payload);
    l.combine_row_bytes = payload_row_bytes(config_.return_payload, width);
  }

  Topology::CommunicatorSet const* comms_;
  Placement placement_;
  ExchangeConfig config_;
  PlacementRegistry const* registry_;
  std::unique_ptr<Transport<Exec, MemorySpace>> transport_;
  Workspace<MemorySpace> work_;
  std::vector<int> node_of_rank_;
  int me_ = -1;
  Algorithm algorithm_;
};

}  // namespace Impl
}  // namespace Exchange
}  // namespace KokkosMoE

#endif
