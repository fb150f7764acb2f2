#ifndef KOKKOSMOE_EXCHANGE_NCCL_HPP
#define KOKKOSMOE_EXCHANGE_NCCL_HPP

/// \file KokkosMoE_Exchange_Nccl.hpp
/// \brief NCCL transport and make_transport(), the run-time choice of a
/// transport by TransportKind.
///
/// NCCL: rows move with grouped ncclSend/ncclRecv on the transport's own
/// CUDA stream, after an event recorded on the Kokkos::Cuda instance's
/// stream (the send rows are complete there); a second event marks their
/// completion, and finish() waits for that event only, so kernels the caller
/// enqueues on its instance meanwhile run alongside the transfer. Same-rank
/// rows are device copies on the instance's stream.
/// Counts are still agreed over MPI (host integers) before any payload moves.
/// NCCL communicators are created from the MPI communicators (unique id
/// broadcast over MPI) on first use and destroyed with the transport. Built
/// when KokkosMoE has NCCL and Kokkos has CUDA; elsewhere asking for it
/// fails with transport_unavailable_reason().

#include <KokkosMoE_Exchange_Transport.hpp>
#include <KokkosMoE_config.hpp>

#include <memory>
#include <type_traits>

#if defined(KOKKOSMOE_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace KokkosMoE {
namespace Exchange {

/// \brief Throws Error naming the call and its result when a CUDA (NCCL)
/// call does not return cudaSuccess (ncclSuccess).
#define KOKKOSMOE_LIB_CHECK(call, success, describe)                                 \
  do {                                                                              \
    auto const kokkosmoe_rc_ = (call);                                              \
    KOKKOSMOE_REQUIRE(kokkosmoe_rc_ == success, #call << " failed: " << describe(kokkosmoe_rc_)); \
  } while (0)
#define KOKKOSMOE_CUDA_CHECK(call) KOKKOSMOE_LIB_CHECK(call, cudaSuccess, cudaGetErrorString)
#define KOKKOSMOE_NCCL_CHECK(call) KOKKOSMOE_LIB_CHECK(call, ncclSuccess, ncclGetErrorString)

/// \brief Collective over c: empty when every rank of c drives its own GPU
/// (the CUDA device current on it, by host name and PCI bus id), else the
/// same description of the first two ranks that share one, on every rank.
/// NCCL refuses two ranks of a communicator on one GPU.
inline std::string nccl_device_conflict(Topology::Communicator const& c) {
  constexpr int name_bytes = MPI_MAX_PROCESSOR_NAME + 32;
  std::vector<char> mine(name_bytes, '\0'), all(static_cast<std::size_t>(name_bytes) * c.size(), '\0');
  int device = 0, length = 0;
  char bus[32] = {0};
  KOKKOSMOE_CUDA_CHECK(cudaGetDevice(&device));
  KOKKOSMOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device));
  KOKKOSMOE_MPI_CHECK(MPI_Get_processor_name(mine.data(), &length), c.comm());
  std::snprintf(mine.data() + MPI_MAX_PROCESSOR_NAME, 32, "%s", bus);
  KOKKOSMOE_MPI_CHECK(MPI_Allgather(mine.data(), name_bytes, MPI_CHAR, all.data(), name_bytes, MPI_CHAR, c.comm()), c.comm());
  auto host = [&](int r) { return std::string(all.data() + static_cast<std::size_t>(r) * name_bytes); };
  auto pci = [&](int r) { return std::string(all.data() + static_cast<std::size_t>(r) * name_bytes + MPI_MAX_PROCESSOR_NAME); };
  for (int b = 1; b < c.size(); ++b)
    for (int a = 0; a < b; ++a)
      if (host(a) == host(b) && pci(a) == pci(b)) {
        std::ostringstream os;
        os << "NCCL over " << c.name() << ": peer slots " << a << " and " << b << " (ranks " << c.global_rank(a) << " and "
           << c.global_rank(b) << ") share the GPU at PCI " << pci(a) << " on host " << host(a)
           << "; NCCL needs one GPU per rank (start at most one rank per GPU, or use [exchange] transport = \"mpi\")";
        return os.str();
      }
  return {};
}

/// \brief An NCCL communicator over the ranks of one MPI communicator, in its
/// peer order (NCCL rank = peer slot). Collective over that communicator;
/// throws the same Error on every rank when two of them share a GPU.
class NcclCommunicator {
 public:
  explicit NcclCommunicator(Topology::Communicator const& c) {
    std::string const conflict = nccl_device_conflict(c);
    KOKKOSMOE_REQUIRE(conflict.empty(), conflict);
    // Slot 0's id travels with its result, so that a failure there fails
    // every rank alike instead of leaving the others in the broadcast.
    struct {
      int result;
      ncclUniqueId id;
    } root{};
    if (c.my_slot() == 0) root.result = static_cast<int>(ncclGetUniqueId(&root.id));
    KOKKOSMOE_MPI_CHECK(MPI_Bcast(&root, static_cast<int>(sizeof root), MPI_BYTE, 0, c.comm()), c.comm());
    KOKKOSMOE_REQUIRE(root.result == static_cast<int>(ncclSuccess),
                      "ncclGetUniqueId on peer slot 0 of " << c.name() << " (rank " << c.global_rank(0)
                                                           << ") failed: " << ncclGetErrorString(static_cast<ncclResult_t>(root.result)));
    KOKKOSMOE_NCCL_CHECK(ncclCommInitRank(&comm_, c.size(), root.id, c.my_slot()));
  }
  ~NcclCommunicator() {
    if (comm_) ncclCommDestroy(comm_);
  }
  NcclCommunicator(NcclCommunicator const&) = delete;
  NcclCommunicator& operator=(NcclCommunicator const&) = delete;
  ncclComm_t get() const { return comm_; }
  /// \brief Aborts outstanding operations (after a watchdog timeout).
  void abort() {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  ncclComm_t comm_ = nullptr;
};

/// \brief Rows over NCCL for device memory spaces.
template <class MemorySpace>
class NcclTransport final : public Transport<Kokkos::Cuda, MemorySpace> {
 public:
  TransportKind kind() const override { return TransportKind::nccl; }

  void alltoallv(Kokkos::Cuda const& exec, Topology::Communicator const& comm, std::vector<RowSet<MemorySpace>> const& sets,
                 std::vector<index_t> const& send_counts, std::vector<index_t> const& recv_counts, char const* what,
                 TransportOptions const& options) override {
    start_alltoallv(exec, comm, sets, send_counts, recv_counts, what, options).finish();
  }

  /// Enqueues the transfers on the transport's stream, ordered after the
  /// work already on exec's stream, and returns; finish() polls their
  /// completion event under the watchdog and orders exec's later work after
  /// it (the rows are written when it returns).
  RowsInFlight start_alltoallv(Kokkos::Cuda const& exec, Topology::Communicator const& comm,
                               std::vector<RowSet<MemorySpace>> const& sets, std::vector<index_t> const& send_counts,
                               std::vector<index_t> const& recv_counts, char const* what, TransportOptions const& options) override {
    int const P = comm.size();
    int const me = comm.my_slot();
    // NCCL and the transport's stream on exec's GPU, whichever thread calls.
    KOKKOSMOE_CUDA_CHECK(cudaSetDevice(exec.cuda_device()));
    // The communicator first (collective on first use: every rank gets
    // there), then the checks every transport makes before NCCL is handed a
    // pointer; a rank that fails them leaves its peers to the watchdog.
    auto& nc = communicator(comm);
    auto const segments = Impl::checked_segments(comm, sets, send_counts, recv_counts, what, /*pair_runs=*/true);
    std::vector<index_t> const &soff = segments.first, &roff = segments.second;
    cudaStream_t const stream = comm_stream();
    for (auto const& s : sets)
      if (me >= 0 && send_counts[me] > 0 && !s.self_in_place)
        Impl::copy_self_rows(exec, s.recv, Impl::runs_of(s.recv_runs, roff, me), s.send, Impl::runs_of(s.send_runs, soff, me));
    // The transfers start once the send rows (and the self copies) on
    // exec's stream are complete.
    auto ready = std::make_shared<Event>();
    auto done = std::make_shared<Event>();
    KOKKOSMOE_CUDA_CHECK(cudaEventRecord(ready->get(), exec.cuda_stream()));
    KOKKOSMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ready->get(), 0));
    // One send (receive) per peer segment, or per run: NCCL pairs them in
    // order, so both sides' runs must have the same lengths.
    // A throw inside the group (a refused send or receive, or no memory)
    // must not leave the group open, nor launch the part already enqueued
    // unpaired: the group ends and the communicator is aborted.
    KOKKOSMOE_NCCL_CHECK(ncclGroupStart());
    try {
      for (auto const& s : sets) {
        std::size_t const rb = s.send.extent(1);
        for (int p = 0; p < P; ++p) {
          if (p == me) continue;
          if (send_counts[p] > 0)
            for (auto const& [first, n] : Impl::runs_of(s.send_runs, soff, p))
              if (n > 0)
                KOKKOSMOE_NCCL_CHECK(ncclSend(s.send.data() + static_cast<std::size_t>(first) * rb, static_cast<std::size_t>(n) * rb,
                                              ncclUint8, p, nc.get(), stream));
          if (recv_counts[p] > 0)
            for (auto const& [first, n] : Impl::runs_of(s.recv_runs, roff, p))
              if (n > 0)
                KOKKOSMOE_NCCL_CHECK(ncclRecv(s.recv.data() + static_cast<std::size_t>(first) * rb, static_cast<std::size_t>(n) * rb,
                                              ncclUint8, p, nc.get(), stream));
        }
      }
    } catch (...) {
      ncclGroupEnd();
      nc.abort();
      comms_.erase(comm.comm());
      throw;
    }
    KOKKOSMOE_NCCL_CHECK(ncclGroupEnd());
    KOKKOSMOE_CUDA_CHECK(cudaEventRecord(done->get(), stream));
    Topology::Communicator const* c = &comm;
    std::string const label = what;
    // The flight keeps the sets (the buffers) and both events until finish.
    return RowsInFlight({}, [this, exec, c, sets, send_counts, recv_counts, label, options, ready, done] {
      // The communicator may have been aborted meanwhile (the watchdog
      // expired on another transfer over it).
      auto it = comms_.find(c->comm());
      KOKKOSMOE_REQUIRE(it != comms_.end() && it->second,
                        label << ": the NCCL communicator of " << c->name() << " was aborted while these rows were in flight");
      wait(done->get(), *it->second, *c, send_counts, recv_counts, label.c_str(), options);
      KOKKOSMOE_CUDA_CHECK(cudaStreamWaitEvent(exec.cuda_stream(), done->get(), 0));
    });
  }

  NcclTransport() = default;
  NcclTransport(NcclTransport const&) = delete;
  NcclTransport& operator=(NcclTransport const&) = delete;
  ~NcclTransport() override {
    // ncclCommDestroy is collective within a node: every rank destroys its
    // communicators in the reverse of the order they were created in, which
    // is the same on every rank (creation is collective), not in the order
    // of the MPI handles' values.
    for (auto it = created_.rbegin(); it != created_.rend(); ++it) comms_.erase(*it);
    comms_.clear();
    if (stream_) cudaStreamDestroy(stream_);
  }

 private:
  NcclCommunicator& communicator(Topology::Communicator const& comm) {
    auto& slot = comms_[comm.comm()];
    if (!slot) {
      slot = std::make_unique<NcclCommunicator>(comm);
      created_.push_back(comm.comm());
    }
    return *slot;
  }

  /// A CUDA event without timing, destroyed with its owner.
  class Event {
   public:
    Event() { KOKKOSMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
    ~Event() { cudaEventDestroy(e_); }
    Event(Event const&) = delete;
    Event& operator=(Event const&) = delete;
    cudaEvent_t get() const { return e_; }

   private:
    cudaEvent_t e_ = nullptr;
  };

  /// The transport's stream (created on first use, non-blocking with
  /// respect to the legacy default stream).
  cudaStream_t comm_stream() {
    if (!stream_) KOKKOSMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return stream_;
  }

  /// Polls the completion event under the watchdog; on timeout aborts the
  /// NCCL communicator and names the peers with outstanding transfers.
  void wait(cudaEvent_t done, NcclCommunicator& nc, Topology::Communicator const& comm, std::vector<index_t> const& send_counts,
            std::vector<index_t> const& recv_counts, char const* what, TransportOptions const& options) {
    Watchdog dog(options.watchdog_seconds);
    while (true) {
      cudaError_t const st = cudaEventQuery(done);
      if (st == cudaSuccess) return;
      KOKKOSMOE_REQUIRE(st == cudaErrorNotReady, what << ": CUDA error " << cudaGetErrorString(st));
      ncclResult_t async = ncclSuccess;
      KOKKOSMOE_NCCL_CHECK(ncclCommGetAsyncError(nc.get(), &async));
      KOKKOSMOE_REQUIRE(async == ncclSuccess, what << ": NCCL asynchronous error " << ncclGetErrorString(async));
      if (dog.expired()) {
        double const waited = dog.waited();
        std::ostringstream peers;
        for (int p = 0; p < comm.size(); ++p)
          if (p != comm.my_slot() && (send_counts[p] > 0 || recv_counts[p] > 0))
            peers << (peers.tellp() > 0 ? ", " : "") << "slot " << p << " (rank " << comm.global_rank(p) << ")";
        nc.abort();
        comms_.erase(comm.comm());
        KOKKOSMOE_THROW_WATCHDOG(what << ": NCCL transfers on " << comm.name() << " did not complete within " << waited
                                      << " s; peers with outstanding rows: [" << peers.str() << "]",
                                 options.watchdog_seconds);
      }
    }
  }

  std::map<MPI_Comm, std::unique_ptr<NcclCommunicator>> comms_;
  std::vector<MPI_Comm> created_;  ///< the communicators' creation order
  cudaStream_t stream_ = nullptr;
};

}  // namespace Exchange
}  // namespace KokkosMoE

#endif

namespace KokkosMoE {
namespace Exchange {

/// \brief The transport of `kind` for exchanges on Exec / MemorySpace
/// (MPI: pairing sends and receives as NCCL does with pair_runs; NCCL always
/// does). Throws Error (the same on every rank) when this build or this
/// execution space cannot run it: NCCL needs a build with NCCL and
/// Kokkos::Cuda.
template <class Exec, class MemorySpace>
std::unique_ptr<Transport<Exec, MemorySpace>> make_transport(TransportKind kind, bool pair_runs = false) {
  if (kind == TransportKind::mpi) return std::make_unique<MpiTransport<Exec, MemorySpace>>(pair_runs);
  KOKKOSMOE_REQUIRE(transport_available(kind), transport_unavailable_reason(kind));
#if defined(KOKKOSMOE_HAVE_NCCL) && defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same<Exec, Kokkos::Cuda>::value) {
    return std::make_unique<NcclTransport<MemorySpace>>();
  } else
#endif
  {
    KOKKOSMOE_THROW("exchange transport '" << to_string(kind) << "' needs the Kokkos::Cuda execution space; this exchange runs on "
                                           << Exec::name());
  }
}

}  // namespace Exchange
}  // namespace KokkosMoE

#endif
