#ifndef KOKKOSMOE_EXCHANGE_TRANSPORT_HPP
#define KOKKOSMOE_EXCHANGE_TRANSPORT_HPP

/// \file KokkosMoE_Exchange_Transport.hpp
/// \brief The transport interface (MPI here, NCCL in
/// KokkosMoE_Exchange_Nccl.hpp, chosen at run time by TransportKind) and the
/// one primitive every exchange algorithm is built from: a variable
/// all-to-all of rows over one communicator, in that communicator's peer
/// order. Rows are whole records
/// (one MPI datatype of row_bytes bytes, so counts are row counts and never
/// overflow int for realistic sizes); rows for the calling rank itself are
/// local copies, never messages. Every wait runs under a watchdog that names
/// the peers still missing instead of hanging silently.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Fabric.hpp>
#include <KokkosMoE_PayloadBuffer.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Types.hpp>
#include <KokkosMoE_Workspace.hpp>
#include <KokkosMoE_config.hpp>

#include <mpi.h>

#include <algorithm>
#include <any>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Where a peer's rows sit in a buffer: per peer slot, runs (first
/// row, rows) in the order they are sent or received. Empty: the peers'
/// segments are contiguous, in peer order, sized by the counts.
using RowRuns = std::vector<std::vector<std::pair<index_t, index_t>>>;

/// \brief Runs with rows, per peer (what a ledger needs to count messages).
inline std::vector<std::int64_t> runs_per_peer(RowRuns const& runs) {
  std::vector<std::int64_t> n(runs.size(), 0);
  for (std::size_t p = 0; p < runs.size(); ++p)
    for (auto const& r : runs[p]) n[p] += r.second > 0 ? 1 : 0;
  return n;
}

/// \brief Rows of one buffer pair moved by one all-to-all: send rows leave in
/// peer-slot order (segments by send counts), recv rows arrive grouped by
/// source peer slot (segments by recv counts). Both views are [rows, bytes].
/// With runs, a peer's rows leave from (arrive at) several places of the
/// buffer with no copy: one message per run, so the sender's runs for a
/// peer and that peer's receive runs must have the same lengths in the same
/// order (agree_counts_and_runs tells a receiver what is coming); a peer's
/// runs add up to its count. Runs on one side need runs on the other, but
/// for a receive that takes up to its count (Transport::receives_up_to): one
/// contiguous segment per peer, filled by the peer's one run.
/// With one_message, each peer's runs travel as one message whatever their
/// lengths (a derived datatype on each side; Transport::gathers_runs), so
/// the two sides' runs need only add up to the same count: rows may leave
/// from expert-major runs and land in rows of another order.
/// With self_in_place, the caller's own rows are already where it wants
/// them (written straight to the receive side, or read later from the send
/// side): the transport copies nothing for them. A started transfer keeps
/// its sets, so managed views stay allocated until it finishes; `owners`
/// does the same for the allocations under unmanaged views (record_rows).
template <class MemorySpace>
struct RowSet {
  using rows_view = Kokkos::View<unsigned char**, Kokkos::LayoutRight, MemorySpace>;
  RowSet() = default;
  RowSet(rows_view s, rows_view r, RowRuns sr = {}, RowRuns rr = {}, bool self_in_place_ = false, bool one_message_ = false)
      : send(std::move(s)),
        recv(std::move(r)),
        send_runs(std::move(sr)),
        recv_runs(std::move(rr)),
        self_in_place(self_in_place_),
        one_message(one_message_) {}
  rows_view send;
  rows_view recv;
  RowRuns send_runs;  ///< empty: contiguous segments by send counts
  RowRuns recv_runs;  ///< empty: contiguous segments by recv counts
  bool self_in_place = false;  ///< the rank's own rows need no copy
  bool one_message = false;    ///< each peer's runs travel as one message (Transport::gathers_runs)
  /// A gathered send (Transport::gathers_runs; implies one_message and
  /// self_in_place): send position i is row (*send_rows)[i] of `send`, so
  /// rows go from where they are (a token's row once per route) with no
  /// packed copy; MPI reads them through an indexed datatype. send_runs
  /// stays empty (each peer's positions are its segment by send counts).
  std::shared_ptr<std::vector<int> const> send_rows;
  std::any owners;  ///< what send and recv point into, where they are unmanaged
};

/// \brief The rows of two record views (e.g. RowMeta): their bytes, one row
/// per record; the set owns both views, so a buffer handed back to a
/// workspace is not reused while a started transfer still reads or writes it.
template <class SendRecords, class RecvRecords>
RowSet<typename SendRecords::memory_space> record_rows(SendRecords const& send, RecvRecords const& recv, RowRuns send_runs = {},
                                                       RowRuns recv_runs = {}) {
  RowSet<typename SendRecords::memory_space> s(as_rows(send), as_rows(recv), std::move(send_runs), std::move(recv_runs));
  s.owners = std::make_pair(send, recv);
  return s;
}

/// \brief True when device buffers may be passed to MPI: the configured
/// policy (KokkosMoE_CUDA_AWARE_MPI), else MPIX_Query_cuda_support() when the
/// MPI has it, else false.
bool mpi_is_cuda_aware();

/// \brief Rows of a started all-to-all (Transport::start_alltoallv): the
/// send buffers are read and the receive buffers written until finish()
/// returns; progress() advances the transfer without blocking. Empty (done)
/// when the transport moved the rows before returning. Movable only; one
/// destroyed while in flight waits for its transfer under the watchdog first,
/// so no buffer is released while MPI may still touch it. It refers to the
/// communicator it moves over and (NCCL) to its transport: finish it, or
/// let it go, before the exchange that started it is destroyed.
class RowsInFlight {
 public:
  RowsInFlight() = default;
  RowsInFlight(std::function<void()> progress, std::function<void()> wait)
      : progress_(std::move(progress)), wait_(std::move(wait)) {}
  RowsInFlight(RowsInFlight const&) = delete;
  RowsInFlight& operator=(RowsInFlight const&) = delete;
  RowsInFlight(RowsInFlight&& o) noexcept : progress_(std::move(o.progress_)), wait_(std::move(o.wait_)) {
    o.progress_ = nullptr;
    o.wait_ = nullptr;
  }
  RowsInFlight& operator=(RowsInFlight&& o) noexcept {
    if (this != &o) {
      drain();
      progress_ = std::move(o.progress_);
      wait_ = std::move(o.wait_);
      o.progress_ = nullptr;
      o.wait_ = nullptr;
    }
    return *this;
  }
  ~RowsInFlight() { drain(); }

  bool in_flight() const { return static_cast<bool>(wait_); }
  void progress() {
    if (progress_) progress_();
  }
  /// Returns with the receive rows written (throws the watchdog's error).
  void finish() {
    if (!wait_) return;
    auto w = std::move(wait_);
    wait_ = nullptr;
    progress_ = nullptr;
    w();
  }

 private:
  void drain() noexcept {
    try {
      finish();
    } catch (...) {
    }
  }
  std::function<void()> progress_;
  std::function<void()> wait_;
};

namespace Impl {

/// A pending nonblocking operation with the peer it waits for. Over an
/// emulated fabric link it also carries its stamp message (sent after the
/// data by a sender, received by a receiver) and completes only once the
/// emulated time `done_ns` has come (see KokkosMoE_Exchange_Fabric.hpp).
struct Pending {
  MPI_Request request = MPI_REQUEST_NULL;
  int peer_slot = -1;
  bool receive = false;
  MPI_Request stamp_request = MPI_REQUEST_NULL;
  std::shared_ptr<FabricEmulator::Stamp> stamp;  ///< the stamp's buffer (emulated links)
  std::int64_t done_ns = 0;                       ///< emulated completion (receives: once the stamp is in)
  bool data_done = false;
  bool stamp_done = true;
  std::int64_t exact_bytes = -1;  ///< a receive that must get exactly these bytes (pair_runs); -1: up to its size
  std::int64_t got_bytes = -1;    ///< with exact_bytes: the bytes that came (-2: more than fit)
};

/// Posts one nonblocking send or receive of `count` elements of `type` with
/// the peer in slot `peer` of comm, appending it to pending; with an emulated
/// fabric in options, also its stamp. A receive with options.pair_runs must
/// get exactly its size (the send paired with it has the same rows), else
/// wait_all, once every request is complete, throws Error naming the peer
/// and both sizes (on the receiving rank).
void post(Topology::Communicator const& comm, bool receive, void* buf, int count, MPI_Datatype type, int peer, int tag,
          std::vector<Pending>& pending, TransportOptions const& options);

/// Tests every request once (advances the transfers, never blocks).
void test_all(Topology::Communicator const& comm, std::vector<Pending>& pending);

/// Waits for every request under the watchdog. On timeout cancels what is
/// left and throws Error naming the communicator, this rank and the peer slots
/// (with their global ranks) it still waits to receive from / send to.
void wait_all(Topology::Communicator const& comm, std::vector<Pending>& pending, char const* what,
              TransportOptions const& options);

/// The runs of peer p: runs[p], or its contiguous segment [off[p], off[p+1]).
std::vector<std::pair<index_t, index_t>> runs_of(RowRuns const& runs, std::vector<index_t> const& off, int p);

/// Checks that every peer's runs add up to its count and lie in a buffer of
/// `rows` rows; throws Error naming the peer.
void check_runs(RowRuns const& runs, std::vector<index_t> const& counts, index_t rows, char const* side, char const* what);

/// Digest of the rows a rank sends to its peers (every segment but its own)
/// of a [rows, bytes] buffer, in peer order (host copy for device memory).
template <class MS>
std::uint64_t sent_rows_digest(RowSet<MS> const& set, std::vector<index_t> const& soff, int me) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), set.send);
  std::size_t const rb = set.send.extent(1);
  std::uint64_t d = 0x9E3779B97F4A7C15ULL;
  for (std::size_t p = 0; p + 1 < soff.size(); ++p)
    if (static_cast<int>(p) != me) {
      if (set.send_rows) {
        for (index_t i = soff[p]; i < soff[p + 1]; ++i)
          d = digest_bytes(h.data() + static_cast<std::size_t>((*set.send_rows)[static_cast<std::size_t>(i)]) * rb, rb, d);
        continue;
      }
      for (auto const& [first, n] : runs_of(set.send_runs, soff, static_cast<int>(p)))
        d = digest_bytes(h.data() + static_cast<std::size_t>(first) * rb, static_cast<std::size_t>(n) * rb, d);
    }
  return d;
}

/// Posts receives and sends of raw rows for one buffer pair (host-visible
/// pointers), appending to pending: one message per peer segment, or per
/// run; with send_rows (a gathered send, RowSet::send_rows), one message
/// per peer on both sides, the send an indexed datatype over the rows it
/// names. Self rows are not posted.
void post_rows(Topology::Communicator const& comm, unsigned char* recv, unsigned char const* send, std::size_t row_bytes,
               std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, RowRuns const& send_runs,
               RowRuns const& recv_runs, int tag, std::vector<Pending>& pending, TransportOptions const& options = {},
               bool one_message = false, std::vector<int> const* send_rows = nullptr);

/// The rank's own rows: its send runs copied to its receive runs, in order.
template <class Exec, class DstView, class SrcView>
void copy_self_rows(Exec const& exec, DstView const& dst, std::vector<std::pair<index_t, index_t>> const& dst_runs,
                    SrcView const& src, std::vector<std::pair<index_t, index_t>> const& src_runs) {
  std::size_t i = 0, j = 0;
  index_t di = 0, sj = 0;  // rows already used of dst_runs[i], src_runs[j]
  while (i < dst_runs.size() && j < src_runs.size()) {
    index_t const n = std::min(dst_runs[i].second - di, src_runs[j].second - sj);
    copy_row_range(exec, dst, dst_runs[i].first + di, src, src_runs[j].first + sj, n);
    di += n;
    sj += n;
    if (di == dst_runs[i].second) ++i, di = 0;
    if (sj == src_runs[j].second) ++j, sj = 0;
  }
}

/// What every transport checks before it moves rows: one count per peer
/// slot of comm on each side, buffers that hold the counted rows (or runs
/// inside them), rows of one width on both sides, and as many rows from this
/// rank to itself as it expects; with pair_runs (each run its own paired
/// message, as NCCL sends), no set whose peer runs travel as one message.
/// Returns the offsets of the peers' contiguous segments ([P + 1] send,
/// [P + 1] receive).
template <class MS>
std::pair<std::vector<index_t>, std::vector<index_t>> checked_segments(Topology::Communicator const& comm,
                                                                       std::vector<RowSet<MS>> const& sets,
                                                                       std::vector<index_t> const& send_counts,
                                                                       std::vector<index_t> const& recv_counts, char const* what,
                                                                       bool pair_runs) {
  int const P = comm.size();
  int const me = comm.my_slot();
  KOKKOSMOE_REQUIRE(static_cast<int>(send_counts.size()) == P && static_cast<int>(recv_counts.size()) == P,
                    what << ": " << send_counts.size() << " send and " << recv_counts.size() << " receive counts for "
                         << P << " peers of " << comm.name());
  std::vector<index_t> soff(static_cast<std::size_t>(P) + 1, 0), roff(static_cast<std::size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) {
    soff[p + 1] = soff[p] + send_counts[p];
    roff[p + 1] = roff[p] + recv_counts[p];
  }
  for (auto const& s : sets) {
    if (s.send_rows) {
      // A gathered send: one row index per send position, inside send.
      KOKKOSMOE_REQUIRE(s.send_runs.empty() && s.self_in_place && static_cast<index_t>(s.send_rows->size()) >= soff[P],
                        what << ": a gathered send names " << s.send_rows->size() << " rows for " << soff[P]
                             << " sent (it needs one per send position, no send runs, and the own rows in place)");
      auto const bad = std::find_if(s.send_rows->begin(), s.send_rows->end(),
                                    [&](int r) { return r < 0 || static_cast<std::size_t>(r) >= s.send.extent(0); });
      KOKKOSMOE_REQUIRE(bad == s.send_rows->end(), what << ": a gathered send names row " << *bad << " of a buffer of "
                                                        << s.send.extent(0) << " rows");
      KOKKOSMOE_REQUIRE(!pair_runs, what << ": a transport that pairs every run (NCCL, or MPI with pair_runs) cannot gather "
                                            "a peer's rows into one message (RowSet::send_rows)");
    }
    KOKKOSMOE_REQUIRE((!s.send_runs.empty() || s.send_rows || static_cast<index_t>(s.send.extent(0)) >= soff[P]) &&
                          (!s.recv_runs.empty() || static_cast<index_t>(s.recv.extent(0)) >= roff[P]) &&
                          s.send.extent(1) == s.recv.extent(1),
                      what << ": buffers of " << s.send.extent(0) << " and " << s.recv.extent(0) << " rows ("
                           << s.send.extent(1) << "/" << s.recv.extent(1) << " B) for " << soff[P] << " sent and "
                           << roff[P] << " received rows");
    check_runs(s.send_runs, send_counts, static_cast<index_t>(s.send.extent(0)), "send", what);
    check_runs(s.recv_runs, recv_counts, static_cast<index_t>(s.recv.extent(0)), "receive", what);
    KOKKOSMOE_REQUIRE(!(pair_runs && s.one_message), what << ": a transport that pairs every run (NCCL, or MPI with pair_runs) cannot "
                                                               "move a peer's runs as one message (RowSet::one_message)");
  }
  if (!sets.empty() && me >= 0 && send_counts[me] > 0)
    KOKKOSMOE_REQUIRE(send_counts[me] == recv_counts[me],
                      what << ": rank sends " << send_counts[me] << " rows to itself but expects " << recv_counts[me]);
  return {std::move(soff), std::move(roff)};
}

}  // namespace Impl

/// \brief Moves every RowSet's rows over comm with MPI. Counts are per peer
/// slot of comm and must already be agreed (see agree_counts). Fences exec
/// before posting (the send rows must be complete) and returns with the
/// receive rows written; with `start`, returns the posted transfer in flight
/// instead when MPI reads and writes the buffers directly (host memory or
/// CUDA-aware MPI; a host-staged transfer completes before returning). A
/// receive count of a contiguous segment may exceed the peer's send count
/// (Transport::receives_up_to), except with options.pair_runs.
template <class Exec, class MS>
RowsInFlight mpi_alltoallv_rows(Exec const& exec, Topology::Communicator const& comm, std::vector<RowSet<MS>> const& sets,
                                std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, char const* what,
                                TransportOptions const& options = {}, bool start = false,
                                Workspace<Kokkos::HostSpace>* staging = nullptr) {
  int const P = comm.size();
  int const me = comm.my_slot();
  auto const segments = Impl::checked_segments(comm, sets, send_counts, recv_counts, what, options.pair_runs);
  std::vector<index_t> const &soff = segments.first, &roff = segments.second;
  Compat::fence(exec, "KokkosMoE::Exchange::alltoallv_rows: send rows complete");
  // Same-rank rows: a local copy (none where the caller placed them).
  for (auto const& s : sets) {
    if (me >= 0 && send_counts[me] > 0 && !s.self_in_place)
      Impl::copy_self_rows(exec, s.recv, Impl::runs_of(s.recv_runs, roff, me), s.send, Impl::runs_of(s.send_runs, soff, me));
  }
  constexpr bool host_visible = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible;
  bool const direct = (host_visible || mpi_is_cuda_aware()) && !options.stage_through_host;
  std::vector<Impl::Pending> pending;
  if (direct) {
    Compat::fence(exec, "KokkosMoE::Exchange::alltoallv_rows: self copies");
    int tag = 7000;
    for (auto const& s : sets)
      Impl::post_rows(comm, s.recv.data(), s.send.data(), s.send.extent(1), send_counts, recv_counts, s.send_runs, s.recv_runs,
                      tag++, pending, options, s.one_message || s.send_rows, s.send_rows.get());
    if (!start) {
      Impl::wait_all(comm, pending, what, options);
      return {};
    }
    // The flight keeps the buffers (views), the requests and what the
    // watchdog's message needs until it finishes.
    auto state = std::make_shared<std::vector<Impl::Pending>>(std::move(pending));
    Topology::Communicator const* c = &comm;
    std::string const label = what;
    std::vector<std::uint64_t> digests;
    if (options.verify_send_rows)
      for (auto const& s : sets) digests.push_back(Impl::sent_rows_digest(s, soff, me));
    return RowsInFlight([state, c] { Impl::test_all(*c, *state); },
                        [state, c, sets, label, options, digests, soff, me] {
                          Impl::wait_all(*c, *state, label.c_str(), options);
                          for (std::size_t i = 0; i < digests.size(); ++i)
                            KOKKOSMOE_REQUIRE(Impl::sent_rows_digest(sets[i], soff, me) == digests[i],
                                              label << ": the send rows (buffer " << i << " of " << sets.size()
                                                    << ") changed while the transfer was in flight: a send buffer was "
                                                       "reused before its transfer completed");
                        });
  }
  // Host staging: copy send rows out, receive into host rows, copy back.
  // The receive rows start as the device rows, so that a receive of fewer
  // rows than its count (receives_up_to) leaves the rest as it was. The
  // copies are separate even for host memory (stage_through_host), and
  // come from `staging` when given (no allocation in repeated steps).
  using host_rows = Kokkos::View<unsigned char**, Kokkos::LayoutRight, Kokkos::HostSpace>;
  std::vector<host_rows> hs, hr;
  Kokkos::DefaultHostExecutionSpace const host;
  for (auto const& s : sets) {
    hs.push_back(scratch<host_rows>(staging, host, "KokkosMoE::Exchange::staged_send", static_cast<index_t>(s.send.extent(0)),
                                    s.send.extent(1)));
    hr.push_back(scratch<host_rows>(staging, host, "KokkosMoE::Exchange::staged_recv", static_cast<index_t>(s.recv.extent(0)),
                                    s.recv.extent(1)));
    Kokkos::deep_copy(exec, hs.back(), s.send);
    Kokkos::deep_copy(exec, hr.back(), s.recv);
  }
  Compat::fence(exec, "KokkosMoE::Exchange::alltoallv_rows: staged to host");
  int tag = 7000;
  for (std::size_t i = 0; i < sets.size(); ++i) {
    // Keep the self segment already written on the device: receive into the
    // host mirror, then copy only the peer segments back.
    Impl::post_rows(comm, hr[i].data(), hs[i].data(), sets[i].send.extent(1), send_counts, recv_counts, sets[i].send_runs,
                    sets[i].recv_runs, tag++, pending, options, sets[i].one_message || sets[i].send_rows, sets[i].send_rows.get());
  }
  Impl::wait_all(comm, pending, what, options);
  for (std::size_t i = 0; i < sets.size(); ++i) {
    // The peers' rows back, run by run; where runs are many (rows scattered
    // one by one), the whole buffer in one copy (the host rows started as
    // the device rows, so the rest is unchanged).
    std::size_t runs = 0;
    for (auto const& r : sets[i].recv_runs) runs += r.size();
    if (runs > 4 * static_cast<std::size_t>(P)) {
      Kokkos::deep_copy(exec, sets[i].recv, hr[i]);
      continue;
    }
    for (int p = 0; p < P; ++p)
      if (p != me && recv_counts[p] > 0)
        for (auto const& [first, n] : Impl::runs_of(sets[i].recv_runs, roff, p)) copy_row_range(exec, sets[i].recv, first, hr[i], first, n);
  }
  Compat::fence(exec, "KokkosMoE::Exchange::alltoallv_rows: staged back");
  return {};
}

/// \brief A transport: moves rows of buffer pairs over one communicator of a
/// communicator set (see mpi_alltoallv_rows for the contract). Every exchange
/// algorithm moves its rows through one, chosen by configuration
/// (make_transport in KokkosMoE_Exchange_Nccl.hpp).
template <class Exec, class MemorySpace>
class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  /// True when a receive count may be an upper bound: a peer sending fewer
  /// rows (its send count) completes the receive, and the rest of that
  /// peer's segment is left as it was. Only for contiguous receive segments
  /// (no receive runs; a peer sends one run). MPI receives work so (not
  /// with pair_runs); NCCL pairs sends and receives of equal sizes only.
  virtual bool receives_up_to() const { return false; }
  /// Bytes of the buffers the transport keeps between calls (host staging).
  virtual std::int64_t held_bytes() const { return 0; }
  /// True when a peer's runs may travel as one message whose two sides cut
  /// it into different runs (RowSet::one_message): MPI's derived datatypes
  /// do (not with pair_runs); NCCL pairs sends and receives of equal
  /// contiguous sizes only.
  virtual bool gathers_runs() const { return false; }
  /// Counts per peer slot of comm, already agreed; returns with the receive
  /// rows written (blocking on exec).
  virtual void alltoallv(Exec const& exec, Topology::Communicator const& comm, std::vector<RowSet<MemorySpace>> const& sets,
                         std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, char const* what,
                         TransportOptions const& options) = 0;
  /// The same transfer, started: the rows are moved when the returned flight
  /// finishes (the caller keeps exec's earlier work complete and may compute
  /// meanwhile). A transport that cannot overlap moves them before returning.
  virtual RowsInFlight start_alltoallv(Exec const& exec, Topology::Communicator const& comm, std::vector<RowSet<MemorySpace>> const& sets,
                                       std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts,
                                       char const* what, TransportOptions const& options) {
    alltoallv(exec, comm, sets, send_counts, recv_counts, what, options);
    return {};
  }
};

/// \brief The MPI transport (every build). With pair_runs it pairs sends
/// and receives the way the NCCL transport must (TransportOptions::pair_runs),
/// so that host builds run the exchanges' NCCL paths.
template <class Exec, class MemorySpace>
class MpiTransport final : public Transport<Exec, MemorySpace> {
 public:
  explicit MpiTransport(bool pair_runs = false) : pair_runs_(pair_runs) {}
  TransportKind kind() const override { return TransportKind::mpi; }
  bool receives_up_to() const override { return !pair_runs_; }
  bool gathers_runs() const override { return !pair_runs_; }
  void alltoallv(Exec const& exec, Topology::Communicator const& comm, std::vector<RowSet<MemorySpace>> const& sets,
                 std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, char const* what,
                 TransportOptions const& options) override {
    mpi_alltoallv_rows(exec, comm, sets, send_counts, recv_counts, what, paired(options), /*start=*/false, &staging_);
  }
  RowsInFlight start_alltoallv(Exec const& exec, Topology::Communicator const& comm, std::vector<RowSet<MemorySpace>> const& sets,
                               std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, char const* what,
                               TransportOptions const& options) override {
    return mpi_alltoallv_rows(exec, comm, sets, send_counts, recv_counts, what, paired(options), /*start=*/true, &staging_);
  }

  std::int64_t held_bytes() const override { return staging_.held_bytes(); }

 private:
  TransportOptions paired(TransportOptions const& options) const {
    if (!pair_runs_ || options.pair_runs) return options;
    TransportOptions o = options;
    o.pair_runs = true;
    return o;
  }
  bool pair_runs_;
  Workspace<Kokkos::HostSpace> staging_{"KokkosMoE::Exchange::MpiTransport"};  ///< host rows of staged transfers
};

/// \brief Runs that place each peer's runs of the given lengths one after
/// the other (peer order), from row 0: where rows announced by
/// agree_counts_and_runs land in a contiguous receive buffer.
RowRuns consecutive_runs(std::vector<std::vector<index_t>> const& lengths);

/// \brief Counts agreed by a sender and its receivers.
struct AgreedCounts {
  std::vector<index_t> send;  ///< rows this rank sends to each peer slot
  std::vector<index_t> recv;  ///< rows each peer slot says it sends to this rank
  /// With runs (agree_counts_and_runs): the lengths of the runs each peer
  /// slot will send this rank, in order (the rank's own runs for itself).
  std::vector<std::vector<index_t>> recv_run_lengths;
};

/// \brief Collective over comm: every rank tells each peer how many rows it
/// will send it (point to point, under the watchdog), then all ranks check
/// together: the receive split equals `expected_recv` where one is given
/// (e.g. the reverse of a dispatch), and the send split adds up to the rows
/// the caller has. Any mismatch throws the same CollectiveError on every rank,
/// naming the ranks and counts; no payload moves before this returns.
AgreedCounts agree_counts(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                          index_t rows_available, std::vector<index_t> const* expected_recv, char const* what,
                          TransportOptions const& options = {}, std::string const& local_problem = {});

/// \brief agree_counts that also announces runs: each peer gets one
/// message holding the count and the lengths of the runs this rank will
/// send it (RowSet::send_runs), in order (at most max_runs runs per peer, a bound every rank knows, so the
/// messages have one fixed size and a receiver needs no second round). A
/// rank with more runs for a peer, runs that do not add up to its count, or
/// a receiver that finds either in what arrived, fails the agreement on every
/// rank, naming the ranks; no payload moves before this returns.
AgreedCounts agree_counts_and_runs(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                                   index_t rows_available, RowRuns const& send_runs, int max_runs, char const* what,
                                   TransportOptions const& options = {});

/// \brief agree_counts_and_runs where runs are positions, not only lengths:
/// every run listed for a peer is announced, empty ones too (at most
/// max_runs), and every peer must announce exactly expected_runs runs to
/// this rank, so that the k-th announced run means the same thing to both
/// (the flat exchange's run k of a peer is its k-th local expert slot).
/// A local_problem (or any mismatch) fails the agreement on every rank.
AgreedCounts agree_counts_and_every_run(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                                        index_t rows_available, RowRuns const& send_runs, int max_runs, int expected_runs,
                                        char const* what, TransportOptions const& options = {},
                                        std::string const& local_problem = {});

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
