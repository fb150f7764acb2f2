#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_Exchange_Transport.hpp>

#if KOKKOSMOE_HAVE_MPIX_QUERY_CUDA_SUPPORT && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <mutex>
#include <set>
#include <climits>
#include <sstream>
#include <thread>

namespace KokkosMoE {
namespace Exchange {

bool mpi_is_cuda_aware() {
#if KOKKOSMOE_CUDA_AWARE_MPI_POLICY == 1
  return true;
#elif KOKKOSMOE_CUDA_AWARE_MPI_POLICY == 0
  return false;
#elif KOKKOSMOE_HAVE_MPIX_QUERY_CUDA_SUPPORT
  static int const aware = MPIX_Query_cuda_support();
  return aware == 1;
#else
  return false;
#endif
}

namespace Impl {

std::vector<std::pair<index_t, index_t>> runs_of(RowRuns const& runs, std::vector<index_t> const& off, int p) {
  if (!runs.empty()) return runs[static_cast<std::size_t>(p)];
  return {{off[static_cast<std::size_t>(p)], off[static_cast<std::size_t>(p) + 1] - off[static_cast<std::size_t>(p)]}};
}

void check_runs(RowRuns const& runs, std::vector<index_t> const& counts, index_t rows, char const* side, char const* what) {
  if (runs.empty()) return;
  KOKKOSMOE_REQUIRE(runs.size() == counts.size(),
                    what << ": " << side << " runs for " << runs.size() << " peers, counts for " << counts.size());
  for (std::size_t p = 0; p < runs.size(); ++p) {
    index_t total = 0;
    for (auto const& [first, n] : runs[p]) {
      KOKKOSMOE_REQUIRE(first >= 0 && n >= 0 && first + n <= rows,
                        what << ": " << side << " run [" << first << ", " << first + n << ") of peer slot " << p
                             << " outside the buffer's " << rows << " rows");
      total += n;
    }
    KOKKOSMOE_REQUIRE(total == counts[p], what << ": " << side << " runs of peer slot " << p << " hold " << total
                                               << " rows, its count is " << counts[p]);
  }
}

void post_rows(Topology::Communicator const& comm, unsigned char* recv, unsigned char const* send, std::size_t row_bytes,
               std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, RowRuns const& send_runs,
               RowRuns const& recv_runs, int tag, std::vector<Pending>& pending, TransportOptions const& options, bool one_message,
               std::vector<int> const* send_rows) {
  int const P = comm.size();
  int const me = comm.my_slot();
  if (row_bytes == 0) return;
  MPI_Datatype row;
  KOKKOSMOE_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row), comm.comm());
  KOKKOSMOE_MPI_CHECK(MPI_Type_commit(&row), comm.comm());
  std::vector<index_t> roff(static_cast<std::size_t>(P) + 1, 0), soff(static_cast<std::size_t>(P) + 1, 0);
  for (int p = 0; p < P; ++p) {
    roff[p + 1] = roff[p] + recv_counts[p];
    soff[p + 1] = soff[p] + send_counts[p];
  }
  // Runs of a peer travel as transfer_messages says: one contiguous message
  // per run (MPI keeps the order of messages between two ranks with one
  // tag), or one message of an indexed datatype. Both sides see the same
  // run lengths, so they choose alike; with one_message both sides take one
  // message (MPI matches the row counts, not the runs). pair_runs: one
  // message per run always, as NCCL pairs them.
  auto post = [&](bool receive, unsigned char* base, std::vector<std::pair<index_t, index_t>> const& runs, int p) {
    std::size_t rows = 0, count = 0;
    for (auto const& [first, n] : runs)
      if (n > 0) {
        rows += static_cast<std::size_t>(n);
        ++count;
      }
    auto issue = [&](void* buf, int n, MPI_Datatype type) { Impl::post(comm, receive, buf, n, type, p, tag, pending, options); };
    if (count > 1 && !options.pair_runs && (one_message || transfer_messages(static_cast<std::int64_t>(count), static_cast<std::int64_t>(rows),
                                       static_cast<std::int64_t>(row_bytes)) == 1)) {
      std::vector<int> lengths, displs;
      for (auto const& [first, n] : runs)
        if (n > 0) {
          KOKKOSMOE_REQUIRE(first <= INT_MAX && n <= INT_MAX, "run of " << n << " rows at row " << first << " with peer " << p << " exceeds int");
          lengths.push_back(static_cast<int>(n));
          displs.push_back(static_cast<int>(first));
        }
      MPI_Datatype type;
      KOKKOSMOE_MPI_CHECK(MPI_Type_indexed(static_cast<int>(lengths.size()), lengths.data(), displs.data(), row, &type), comm.comm());
      KOKKOSMOE_MPI_CHECK(MPI_Type_commit(&type), comm.comm());
      issue(base, 1, type);
      MPI_Type_free(&type);  // deferred by MPI until the operation completes
      return;
    }
    for (auto const& [first, n] : runs) {
      if (n == 0) continue;
      KOKKOSMOE_REQUIRE(n <= INT_MAX, (receive ? "receive of " : "send of ") << n << " rows with peer " << p << " exceeds int");
      issue(base + static_cast<std::size_t>(first) * row_bytes, static_cast<int>(n), row);
    }
  };
  for (int p = 0; p < P; ++p)
    if (p != me && recv_counts[p] > 0) post(true, recv, runs_of(recv_runs, roff, p), p);
  // A gathered send: peer p's send positions [soff[p], soff[p + 1]) name
  // their rows of send, one block of one row each.
  auto post_gathered = [&](int p) {
    index_t const n = send_counts[p];
    KOKKOSMOE_REQUIRE(n <= INT_MAX, "gathered send of " << n << " rows to peer " << p << " exceeds int");
    MPI_Datatype type;
    KOKKOSMOE_MPI_CHECK(MPI_Type_create_indexed_block(static_cast<int>(n), 1, send_rows->data() + soff[p], row, &type), comm.comm());
    KOKKOSMOE_MPI_CHECK(MPI_Type_commit(&type), comm.comm());
    Impl::post(comm, false, const_cast<unsigned char*>(send), 1, type, p, tag, pending, options);
    MPI_Type_free(&type);  // deferred by MPI until the operation completes
  };
  for (int p = 0; p < P; ++p)
    if (p != me && send_counts[p] > 0) {
      if (send_rows)
        post_gathered(p);
      else
        post(false, const_cast<unsigned char*>(send), runs_of(send_runs, soff, p), p);
    }
  MPI_Type_free(&row);  // deferred by MPI until the operations complete
}

namespace {

/// Stamps travel with their own tags, clear of the data tags (6997..7999).
constexpr int stamp_tag_offset = 16384;

/// Advances one operation; true once it is complete (its data, its stamp
/// and, over an emulated link, its emulated time).
bool advance(Topology::Communicator const& comm, Pending& p) {
  if (!p.data_done) {
    int flag = 0;
    MPI_Status status;
    int const rc = MPI_Test(&p.request, &flag, &status);
    // A paired receive (pair_runs) records what came, for wait_all to report
    // once every request is complete; a message larger than the receive
    // completes it with a truncation error.
    int error_class = MPI_SUCCESS;
    if (rc != MPI_SUCCESS) MPI_Error_class(rc, &error_class);
    bool const truncated = p.exact_bytes >= 0 && error_class == MPI_ERR_TRUNCATE;
    if (!truncated) KOKKOSMOE_MPI_CHECK(rc, comm.comm());
    p.data_done = flag != 0 || truncated;
    if (truncated) {
      p.got_bytes = -2;
    } else if (p.data_done && p.exact_bytes >= 0) {
      // Counted in bytes: the received type is contiguous bytes.
      MPI_Count got = 0;
      KOKKOSMOE_MPI_CHECK(MPI_Get_elements_x(&status, MPI_BYTE, &got), comm.comm());
      p.got_bytes = static_cast<std::int64_t>(got);
    }
  }
  if (!p.stamp_done) {
    int flag = 0;
    KOKKOSMOE_MPI_CHECK(MPI_Test(&p.stamp_request, &flag, MPI_STATUS_IGNORE), comm.comm());
    if (flag) {
      p.stamp_done = true;
      if (p.receive) p.done_ns = p.stamp->arrival_ns;
    }
  }
  return p.data_done && p.stamp_done && (p.done_ns == 0 || FabricEmulator::now_ns() >= p.done_ns);
}

}  // namespace

void post(Topology::Communicator const& comm, bool receive, void* buf, int count, MPI_Datatype type, int peer, int tag,
          std::vector<Pending>& pending, TransportOptions const& options) {
  Pending op;
  op.request = MPI_REQUEST_NULL;
  op.peer_slot = peer;
  op.receive = receive;
  FabricEmulator* fabric = options.fabric.get();
  int const me = comm.global_rank(comm.my_slot());
  bool const emulated = fabric && fabric->link(receive ? comm.global_rank(peer) : me, receive ? me : comm.global_rank(peer)) != FabricLink::none;
  if (receive) {
    if (options.pair_runs) {
      int size = 0;
      KOKKOSMOE_MPI_CHECK(MPI_Type_size(type, &size), comm.comm());
      op.exact_bytes = static_cast<std::int64_t>(size) * count;
    }
    KOKKOSMOE_MPI_CHECK(MPI_Irecv(buf, count, type, peer, tag, comm.comm(), &op.request), comm.comm());
    if (emulated) {
      op.stamp = std::make_shared<FabricEmulator::Stamp>();
      op.stamp_done = false;
      KOKKOSMOE_MPI_CHECK(MPI_Irecv(op.stamp.get(), 2, MPI_INT64_T, peer, tag + stamp_tag_offset, comm.comm(), &op.stamp_request), comm.comm());
    }
  } else {
    if (emulated) {
      int size = 0;
      KOKKOSMOE_MPI_CHECK(MPI_Type_size(type, &size), comm.comm());
      op.stamp = std::make_shared<FabricEmulator::Stamp>(
          fabric->depart(comm.global_rank(peer), static_cast<std::size_t>(size) * static_cast<std::size_t>(count)));
      op.done_ns = op.stamp->egress_end_ns;
    }
    KOKKOSMOE_MPI_CHECK(MPI_Isend(buf, count, type, peer, tag, comm.comm(), &op.request), comm.comm());
    if (emulated) {
      op.stamp_done = false;
      KOKKOSMOE_MPI_CHECK(MPI_Isend(op.stamp.get(), 2, MPI_INT64_T, peer, tag + stamp_tag_offset, comm.comm(), &op.stamp_request), comm.comm());
    }
  }
  pending.push_back(std::move(op));
}

void test_all(Topology::Communicator const& comm, std::vector<Pending>& pending) {
  for (auto& p : pending) advance(comm, p);
}

void wait_all(Topology::Communicator const& comm, std::vector<Pending>& pending, char const* what,
              TransportOptions const& options) {
  // Rows between ranks of one host move inside MPI's calls (shared memory:
  // each poll copies the next fragments), so a wait among them polls
  // without sleeping when oversubscribed (it yields); rows from another
  // host move through the kernel's network stack, which a sleeping poll
  // leaves the core to. KOKKOSMOE_WAIT=sleep makes every wait sleep.
  static bool const sleep_always = [] {
    char const* w = std::getenv("KOKKOSMOE_WAIT");
    return w && std::string(w) == "sleep";
  }();
  bool const one_host = !sleep_always && oversubscribed() && std::all_of(pending.begin(), pending.end(), [&](Pending const& p) {
                          return shares_host(comm.comm(), p.peer_slot);
                        });
  Watchdog dog(options.watchdog_seconds, /*sleeps=*/!one_host);
  std::size_t done = 0;
  std::vector<char> complete(pending.size(), 0);
  FabricEmulator* fabric = options.fabric.get();
  std::int64_t const entered = fabric ? FabricEmulator::now_ns() : 0;
  while (done < pending.size()) {
    std::int64_t next_ns = 0;  // earliest emulated completion still ahead (0: none)
    for (std::size_t i = 0; i < pending.size(); ++i) {
      if (complete[i]) continue;
      if (advance(comm, pending[i])) {
        complete[i] = 1;
        ++done;
      } else if (pending[i].data_done && pending[i].stamp_done && pending[i].done_ns > 0) {
        next_ns = next_ns == 0 ? pending[i].done_ns : std::min(next_ns, pending[i].done_ns);
      }
    }
    if (done == pending.size()) break;
    // Only emulated time left for some: hold until the first of them (never
    // past the watchdog's next look).
    if (next_ns > 0) FabricEmulator::wait_until(std::min(next_ns, FabricEmulator::now_ns() + 10000000));
    if (dog.expired()) {
      // Each missing peer once per direction, in peer-slot order.
      std::set<int> recv_from, send_to;
      for (std::size_t i = 0; i < pending.size(); ++i) {
        if (complete[i]) continue;
        (pending[i].receive ? recv_from : send_to).insert(pending[i].peer_slot);
        for (MPI_Request* r : {&pending[i].request, &pending[i].stamp_request}) {
          if (*r == MPI_REQUEST_NULL) continue;
          if (pending[i].receive) MPI_Cancel(r);
          MPI_Request_free(r);
        }
        // A freed send may still read its stamp: the stamp outlives it.
        if (pending[i].stamp) {
          static std::mutex orphans_mutex;
          static std::vector<std::shared_ptr<FabricEmulator::Stamp>> orphans;
          std::lock_guard<std::mutex> lock(orphans_mutex);
          orphans.push_back(pending[i].stamp);
        }
      }
      pending.clear();
      auto list = [&](std::set<int> const& slots) {
        std::ostringstream os;
        for (int p : slots) os << (os.tellp() > 0 ? ", " : "") << "slot " << p << " (rank " << comm.global_rank(p) << ")" << rank_place(comm.comm(), p);
        return os.str();
      };
      int world = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &world);
      KOKKOSMOE_THROW_WATCHDOG(what << ": rank " << world << " (slot " << comm.my_slot() << " of " << comm.name() << ") waited "
                                    << dog.waited() << " s; still waiting to receive from [" << list(recv_from) << "]"
                                    << (send_to.empty() ? std::string() : " and to send to [" + list(send_to) + "]")
                                    << " - did those ranks skip this call?",
                               dog.limit());
    }
  }
  for (auto const& p : pending)
    if (p.exact_bytes >= 0 && p.got_bytes != p.exact_bytes) {
      std::ostringstream os;
      os << what << ": " << comm.name() << ": a message of " << (p.got_bytes == -2 ? "more than " : "")
         << (p.got_bytes == -2 ? p.exact_bytes : p.got_bytes) << " bytes from peer slot " << p.peer_slot << " (rank "
         << comm.global_rank(p.peer_slot) << ") where its paired receive takes " << p.exact_bytes
         << " (pair_runs: sender and receiver must cut the rows into the same runs, as NCCL needs)";
      pending.clear();
      KOKKOSMOE_THROW(os.str());
    }
  if (fabric) {
    // The time this wait was held back by the emulation beyond the real transfers.
    double const waited = 1e-9 * static_cast<double>(FabricEmulator::now_ns() - entered);
    std::int64_t latest = 0;
    for (auto const& p : pending) latest = std::max(latest, p.done_ns);
    if (latest > entered) fabric->add_held(std::min(waited, 1e-9 * static_cast<double>(latest - entered)));
  }
  pending.clear();
}

}  // namespace Impl

namespace {

/// The agreement behind agree_counts and agree_counts_and_runs. Every peer
/// gets one message of `width` int64: the count, then (width > 1) the number
/// of runs and their lengths, zero-padded.
AgreedCounts agree_counts_impl(Topology::Communicator const& comm, std::vector<index_t> const& send_split, index_t rows_available,
                               std::vector<index_t> const* expected_recv, RowRuns const* send_runs, int max_runs, char const* what,
                               TransportOptions const& options, std::string const& local_problem, int exact_runs = -1) {
  bool const every_run = exact_runs >= 0;  // empty runs announced too
  int const P = comm.size();
  int const me = comm.my_slot();
  std::size_t const width = send_runs ? 2 + static_cast<std::size_t>(max_runs) : 1;
  AgreedCounts agreed;
  agreed.send = send_split;
  agreed.recv.assign(static_cast<std::size_t>(P), 0);
  std::string problem = local_problem;
  if (problem.empty() && static_cast<int>(send_split.size()) != P) {
    problem = "send split has " + std::to_string(send_split.size()) + " entries for " + std::to_string(P) + " peers";
  }
  if (problem.empty() && send_runs) {
    std::ostringstream os;
    if (max_runs < 0) os << "a bound of " << max_runs << " runs per peer; ";
    if (static_cast<int>(send_runs->size()) != P) os << "runs for " << send_runs->size() << " peers of " << P << "; ";
    for (std::size_t p = 0; os.tellp() == 0 && p < send_runs->size(); ++p) {
      index_t total = 0, n = 0;
      for (auto const& [first, len] : (*send_runs)[p])
        if (len > 0 || every_run) {
          total += len;
          ++n;
        }
      if (n > max_runs) os << n << " runs for peer slot " << p << ", at most " << max_runs << " may be announced; ";
      if (total != send_split[p]) os << "the runs for peer slot " << p << " hold " << total << " rows, its count is " << send_split[p] << "; ";
    }
    problem = os.str();
  }
  // One message to every peer (zero counts included), point to point, so the
  // watchdog can name a peer that never arrives.
  std::vector<std::int64_t> out(static_cast<std::size_t>(P) * width, 0), in(static_cast<std::size_t>(P) * width, 0);
  if (problem.empty())
    for (int p = 0; p < P; ++p) {
      auto* o = &out[static_cast<std::size_t>(p) * width];
      o[0] = send_split[p];
      if (!send_runs) continue;
      for (auto const& [first, len] : (*send_runs)[p])
        if (len > 0 || every_run) o[2 + o[1]++] = len;
    }
  std::vector<Impl::Pending> pending;
  int const n = static_cast<int>(width);
  for (int p = 0; p < P; ++p)
    if (p != me) Impl::post(comm, true, &in[static_cast<std::size_t>(p) * width], n, MPI_INT64_T, p, 6999, pending, options);
  for (int p = 0; p < P; ++p)
    if (p != me) Impl::post(comm, false, &out[static_cast<std::size_t>(p) * width], n, MPI_INT64_T, p, 6999, pending, options);
  std::copy_n(&out[static_cast<std::size_t>(me) * width], width, &in[static_cast<std::size_t>(me) * width]);
  Impl::wait_all(comm, pending, what, options);

  if (problem.empty()) {
    std::ostringstream os;
    index_t total = 0;
    for (int p = 0; p < P; ++p) {
      auto const* i = &in[static_cast<std::size_t>(p) * width];
      agreed.recv[p] = i[0];
      if (send_split[p] < 0) os << "negative count " << send_split[p] << " for peer slot " << p << "; ";
      total += send_split[p];
      if (!send_runs) continue;
      std::vector<index_t> lengths;
      index_t sum = 0;
      bool ok = i[1] >= 0 && i[1] <= max_runs;
      for (std::int64_t k = 0; ok && k < i[1]; ++k) {
        ok = i[2 + k] > 0 || (every_run && i[2 + k] == 0);
        lengths.push_back(i[2 + k]);
        sum += i[2 + k];
      }
      if (!ok || sum != i[0])
        os << "rank " << comm.global_rank(p) << " (slot " << p << ") announced " << i[0] << " rows in " << i[1]
           << " runs that do not add up; ";
      else if (every_run && i[1] != exact_runs)
        os << "rank " << comm.global_rank(p) << " (slot " << p << ") announced " << i[1] << " runs, this rank expects "
           << exact_runs << "; ";
      agreed.recv_run_lengths.push_back(std::move(lengths));
    }
    if (total != rows_available)
      os << "send split adds up to " << total << " rows but " << rows_available << " rows are ready to send; ";
    if (expected_recv) {
      for (int p = 0; p < P; ++p)
        if (static_cast<std::size_t>(p) < expected_recv->size() && (*expected_recv)[p] != agreed.recv[p])
          os << "rank " << comm.global_rank(p) << " (slot " << p << ") says it sends " << agreed.recv[p]
             << " rows, this rank expects " << (*expected_recv)[p] << "; ";
      if (static_cast<int>(expected_recv->size()) != P)
        os << "expected receive split has " << expected_recv->size() << " entries for " << P << " peers; ";
    }
    problem = os.str();
  }
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  // Every peer has entered this call (its counts arrived), so a blocking
  // agreement cannot hang here.
  agree(comm.comm(), problem.empty() ? problem : std::string(what) + ": count agreement failed on rank " + std::to_string(world) + ": " + problem,
        "count agreement", options.watchdog_seconds);
  return agreed;
}

}  // namespace

AgreedCounts agree_counts(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                          index_t rows_available, std::vector<index_t> const* expected_recv, char const* what,
                          TransportOptions const& options, std::string const& local_problem) {
  return agree_counts_impl(comm, send_split, rows_available, expected_recv, nullptr, 0, what, options, local_problem);
}

AgreedCounts agree_counts_and_runs(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                                   index_t rows_available, RowRuns const& send_runs, int max_runs, char const* what,
                                   TransportOptions const& options) {
  return agree_counts_impl(comm, send_split, rows_available, nullptr, &send_runs, max_runs, what, options, {});
}

AgreedCounts agree_counts_and_every_run(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                                        index_t rows_available, RowRuns const& send_runs, int max_runs, int expected_runs,
                                        char const* what, TransportOptions const& options, std::string const& local_problem) {
  KOKKOSMOE_REQUIRE(expected_runs >= 0, what << ": " << expected_runs << " runs expected from every peer");
  return agree_counts_impl(comm, send_split, rows_available, nullptr, &send_runs, max_runs, what, options, local_problem,
                           expected_runs);
}

bool transport_available(TransportKind kind) { return transport_unavailable_reason(kind).empty(); }

std::string transport_unavailable_reason(TransportKind kind) {
  if (kind == TransportKind::mpi) return {};
#if defined(KOKKOSMOE_HAVE_NCCL)
  return {};
#else
  return "exchange transport 'nccl' is not available: this KokkosMoE was built without NCCL (build option "
         "KokkosMoE_ENABLE_NCCL=ON, which needs a Kokkos with the CUDA backend and NCCL, found through NCCL_ROOT)";
#endif
}

RowRuns consecutive_runs(std::vector<std::vector<index_t>> const& lengths) {
  RowRuns runs(lengths.size());
  index_t at = 0;
  for (std::size_t p = 0; p < lengths.size(); ++p)
    for (index_t n : lengths[p]) {
      runs[p].push_back({at, n});
      at += n;
    }
  return runs;
}

}  // namespace Exchange
}  // namespace KokkosMoE
