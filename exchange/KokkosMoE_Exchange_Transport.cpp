#include <KokkosMoE_Exchange_Transport.hpp>

#if KOKKOSMOE_HAVE_MPIX_QUERY_CUDA_SUPPORT && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <chrono>
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

void post_rows(Topology::Communicator const& comm, unsigned char* recv, unsigned char const* send, std::size_t row_bytes,
               std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, int tag,
               std::vector<Pending>& pending) {
  int const P = comm.size();
  int const me = comm.my_slot();
  if (row_bytes == 0) return;
  MPI_Datatype row;
  KOKKOSMOE_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row), comm.comm());
  KOKKOSMOE_MPI_CHECK(MPI_Type_commit(&row), comm.comm());
  std::size_t roff = 0, soff = 0;
  for (int p = 0; p < P; ++p) {
    if (p != me && recv_counts[p] > 0) {
      KOKKOSMOE_REQUIRE(recv_counts[p] <= INT_MAX, "receive of " << recv_counts[p] << " rows from peer " << p << " exceeds int");
      MPI_Request r;
      KOKKOSMOE_MPI_CHECK(MPI_Irecv(recv + roff * row_bytes, static_cast<int>(recv_counts[p]), row, p, tag, comm.comm(), &r),
                          comm.comm());
      pending.push_back(Pending{r, p, true});
    }
    roff += static_cast<std::size_t>(recv_counts[p]);
  }
  for (int p = 0; p < P; ++p) {
    if (p != me && send_counts[p] > 0) {
      KOKKOSMOE_REQUIRE(send_counts[p] <= INT_MAX, "send of " << send_counts[p] << " rows to peer " << p << " exceeds int");
      MPI_Request r;
      KOKKOSMOE_MPI_CHECK(MPI_Isend(send + soff * row_bytes, static_cast<int>(send_counts[p]), row, p, tag, comm.comm(), &r),
                          comm.comm());
      pending.push_back(Pending{r, p, false});
    }
    soff += static_cast<std::size_t>(send_counts[p]);
  }
  MPI_Type_free(&row);  // deferred by MPI until the operations complete
}

void test_all(Topology::Communicator const& comm, std::vector<Pending>& pending) {
  for (auto& p : pending) {
    int flag = 0;
    KOKKOSMOE_MPI_CHECK(MPI_Test(&p.request, &flag, MPI_STATUS_IGNORE), comm.comm());
  }
}

void wait_all(Topology::Communicator const& comm, std::vector<Pending>& pending, char const* what,
              TransportOptions const& options) {
  Watchdog dog(options.watchdog_seconds);
  std::size_t done = 0;
  std::vector<char> complete(pending.size(), 0);
  while (done < pending.size()) {
    for (std::size_t i = 0; i < pending.size(); ++i) {
      if (complete[i]) continue;
      int flag = 0;
      KOKKOSMOE_MPI_CHECK(MPI_Test(&pending[i].request, &flag, MPI_STATUS_IGNORE), comm.comm());
      if (flag) {
        complete[i] = 1;
        ++done;
      }
    }
    if (done == pending.size()) break;
    if (dog.expired()) {
      // Each missing peer once per direction, in peer-slot order.
      std::set<int> recv_from, send_to;
      for (std::size_t i = 0; i < pending.size(); ++i) {
        if (complete[i]) continue;
        (pending[i].receive ? recv_from : send_to).insert(pending[i].peer_slot);
        if (pending[i].receive) MPI_Cancel(&pending[i].request);
        MPI_Request_free(&pending[i].request);
      }
      pending.clear();
      auto list = [&](std::set<int> const& slots) {
        std::ostringstream os;
        for (int p : slots) os << (os.tellp() > 0 ? ", " : "") << "slot " << p << " (rank " << comm.global_rank(p) << ")";
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
  pending.clear();
}

}  // namespace Impl

AgreedCounts agree_counts(Topology::Communicator const& comm, std::vector<index_t> const& send_split,
                          index_t rows_available, std::vector<index_t> const* expected_recv, char const* what,
                          TransportOptions const& options, std::string const& local_problem) {
  int const P = comm.size();
  int const me = comm.my_slot();
  AgreedCounts agreed;
  agreed.send = send_split;
  agreed.recv.assign(static_cast<std::size_t>(P), 0);
  std::string problem = local_problem;
  if (problem.empty() && static_cast<int>(send_split.size()) != P) {
    problem = "send split has " + std::to_string(send_split.size()) + " entries for " + std::to_string(P) + " peers";
  }
  // Exchange the counts point to point (every peer, zero counts included), so
  // the watchdog can name a peer that never arrives.
  std::vector<index_t> out(static_cast<std::size_t>(P), 0);
  if (problem.empty()) out = send_split;
  std::vector<Impl::Pending> pending;
  for (int p = 0; p < P; ++p) {
    if (p == me) {
      agreed.recv[p] = out[p];
      continue;
    }
    MPI_Request r;
    KOKKOSMOE_MPI_CHECK(MPI_Irecv(&agreed.recv[p], 1, MPI_INT64_T, p, 6999, comm.comm(), &r), comm.comm());
    pending.push_back(Impl::Pending{r, p, true});
  }
  for (int p = 0; p < P; ++p) {
    if (p == me) continue;
    MPI_Request r;
    KOKKOSMOE_MPI_CHECK(MPI_Isend(&out[p], 1, MPI_INT64_T, p, 6999, comm.comm(), &r), comm.comm());
    pending.push_back(Impl::Pending{r, p, false});
  }
  Impl::wait_all(comm, pending, what, options);

  if (problem.empty()) {
    std::ostringstream os;
    index_t total = 0;
    for (int p = 0; p < P; ++p) {
      if (send_split[p] < 0) os << "negative count " << send_split[p] << " for peer slot " << p << "; ";
      total += send_split[p];
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

}  // namespace Exchange
}  // namespace KokkosMoE
