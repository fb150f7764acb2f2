#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Exchange_Fabric.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <sstream>
#include <thread>

namespace KokkosMoE {
namespace Exchange {

std::int64_t FabricSpec::cost_ns(bool inter, std::size_t bytes) const {
  double const lat = inter ? inter_latency_us : intra_latency_us;
  double const bw = inter ? inter_bandwidth_gbps : intra_bandwidth_gbps;
  double ns = lat * 1e3;
  if (bw > 0.0) ns += static_cast<double>(bytes) / bw;  // B / (GB/s) = ns
  return static_cast<std::int64_t>(std::ceil(ns));
}

std::string FabricSpec::describe() const {
  std::ostringstream os;
  os << "inter-node link " << inter_latency_us << " us + B / " << inter_bandwidth_gbps << " GB/s per message, "
     << nics_per_node << (nics_per_node == 1 ? " NIC" : " NICs") << " per node; intra-node ";
  if (intra_enabled())
    os << intra_latency_us << " us + B / " << (intra_bandwidth_gbps > 0 ? std::to_string(intra_bandwidth_gbps) + " GB/s" : std::string("inf"))
       << " per rank port";
  else
    os << "untouched";
  return os.str();
}

void FabricSpec::validate(std::string const& where) const {
  auto finite_nonneg = [](double v) { return std::isfinite(v) && v >= 0.0; };
  KOKKOSMOE_REQUIRE(std::isfinite(inter_bandwidth_gbps) && inter_bandwidth_gbps > 0.0,
                    where << ": inter_bandwidth_gbps = " << inter_bandwidth_gbps << " must be a positive number of GB/s");
  KOKKOSMOE_REQUIRE(finite_nonneg(inter_latency_us), where << ": inter_latency_us = " << inter_latency_us << " must be >= 0");
  KOKKOSMOE_REQUIRE(nics_per_node >= 1, where << ": nics_per_node = " << nics_per_node << " must be at least 1");
  KOKKOSMOE_REQUIRE(finite_nonneg(intra_latency_us), where << ": intra_latency_us = " << intra_latency_us << " must be >= 0");
  KOKKOSMOE_REQUIRE(finite_nonneg(intra_bandwidth_gbps),
                    where << ": intra_bandwidth_gbps = " << intra_bandwidth_gbps << " must be >= 0 (0: no bandwidth limit)");
}

std::int64_t FabricEmulator::now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void FabricEmulator::wait_until(std::int64_t ns) {
  // Yield, never sleep: where ranks share cores (virtual layouts often do)
  // a sleeping rank wakes a scheduler slice late, which the emulation would
  // add to every message; a yielding one hands its core to a rank with work.
  while (now_ns() < ns) std::this_thread::yield();
}

FabricEmulator::FabricEmulator(MPI_Comm comm, std::vector<int> node_of_rank, FabricSpec const& spec)
    : spec_(spec), node_(std::move(node_of_rank)) {
  MPI_Comm_rank(comm, &me_);
  MPI_Comm_size(comm, &nranks_);
  collective(comm, "emulated fabric", [&] {
    spec_.validate("[topology.fabric]");
    KOKKOSMOE_REQUIRE(static_cast<int>(node_.size()) == nranks_,
                      "emulated fabric: node_of_rank has " << node_.size() << " entries for " << nranks_ << " ranks");
    nodes_ = node_.empty() ? 0 : *std::max_element(node_.begin(), node_.end()) + 1;
    std::vector<int> seen(static_cast<std::size_t>(nodes_), 0);
    nic_.resize(node_.size());
    for (std::size_t r = 0; r < node_.size(); ++r) {
      KOKKOSMOE_REQUIRE(node_[r] >= 0, "emulated fabric: rank " << r << " on node " << node_[r]);
      nic_[r] = seen[static_cast<std::size_t>(node_[r])]++ % spec_.nics_per_node;
    }
  });
  // Every rank must see the segment: one host.
  MPI_Comm shm;
  KOKKOSMOE_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shm), comm);
  int shm_size = 0;
  MPI_Comm_size(shm, &shm_size);
  MPI_Comm_free(&shm);
  agree(comm,
        shm_size == nranks_ ? std::string()
                            : "emulated fabric: rank " + std::to_string(me_) + " shares memory with " + std::to_string(shm_size) + " of the " +
                                  std::to_string(nranks_) + " ranks; the emulation needs every rank on one host (a virtual layout)",
        "emulated fabric");
  int const slots = 2 * nodes_ * spec_.nics_per_node + 2 * nranks_;
  shared_bytes_ = static_cast<std::size_t>(slots) * sizeof(std::int64_t);
  // Rank 0 creates the segment and tells the others its name.
  char name[64] = {0};
  std::string problem;
  int fd = -1;
  if (me_ == 0) {
    static int serial = 0;
    std::snprintf(name, sizeof name, "/kokkosmoe-fabric-%ld-%d", static_cast<long>(getpid()), serial++);
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(shared_bytes_)) != 0)
      problem = std::string("emulated fabric: shared memory segment ") + name + ": " + std::strerror(errno);
  }
  agree(comm, problem, "emulated fabric segment");
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(name, sizeof name, MPI_CHAR, 0, comm), comm);
  if (me_ != 0) {
    fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0) problem = std::string("emulated fabric: opening ") + name + ": " + std::strerror(errno);
  }
  if (problem.empty()) {
    void* p = mmap(nullptr, shared_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      problem = std::string("emulated fabric: mapping ") + name + ": " + std::strerror(errno);
    else
      shared_ = static_cast<std::int64_t*>(p);
  }
  if (fd >= 0) close(fd);
  std::string const mine = problem;
  try {
    agree(comm, mine, "emulated fabric mapping");
  } catch (...) {
    if (me_ == 0) shm_unlink(name);
    if (shared_) munmap(shared_, shared_bytes_);
    shared_ = nullptr;
    throw;
  }
  if (me_ == 0) std::memset(shared_, 0, shared_bytes_);  // zero: every NIC idle
  KOKKOSMOE_MPI_CHECK(MPI_Barrier(comm), comm);
  if (me_ == 0) shm_unlink(name);  // mapped everywhere; the name is no longer needed
}

FabricEmulator::~FabricEmulator() {
  if (shared_) munmap(shared_, shared_bytes_);
}

FabricLink FabricEmulator::link(int from, int to) const {
  if (from == to) return FabricLink::none;
  if (node_[static_cast<std::size_t>(from)] != node_[static_cast<std::size_t>(to)]) return FabricLink::inter;
  return spec_.intra_enabled() ? FabricLink::intra : FabricLink::none;
}

std::int64_t FabricEmulator::reserve(std::int64_t* busy, std::int64_t earliest, std::int64_t cost) {
  std::int64_t cur = __atomic_load_n(busy, __ATOMIC_ACQUIRE);
  for (;;) {
    std::int64_t const end = std::max(cur, earliest) + cost;
    if (__atomic_compare_exchange_n(busy, &cur, end, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return end;
  }
}

int FabricEmulator::ingress_of(int rank, bool inter) const {
  return inter ? nodes_ * spec_.nics_per_node + node_[static_cast<std::size_t>(rank)] * spec_.nics_per_node + nic_of(rank)
               : 2 * nodes_ * spec_.nics_per_node + nranks_ + rank;
}

FabricEmulator::Stamp FabricEmulator::depart(int to, std::size_t bytes) {
  FabricLink const l = link(me_, to);
  bool const inter = l == FabricLink::inter;
  std::int64_t const cost = spec_.cost_ns(inter, bytes);
  int const egress = inter ? node_[static_cast<std::size_t>(me_)] * spec_.nics_per_node + nic_of(me_)
                           : 2 * nodes_ * spec_.nics_per_node + me_;
  Stamp s;
  s.egress_end_ns = reserve(slot(egress), now_ns(), cost);
  // The receiver's ingress, reserved now, in the order messages are posted
  // (not when the receiver first looks at its message, which would let a
  // late-polling rank queue a message behind later ones). Cut-through: it
  // may serve the message from the moment its egress started.
  std::int64_t const ingress_end = reserve(slot(ingress_of(to, inter)), s.egress_end_ns - cost, cost);
  s.arrival_ns = std::max(ingress_end, s.egress_end_ns);
  ++stats_.messages[static_cast<std::size_t>(l)];
  stats_.bytes[static_cast<std::size_t>(l)] += static_cast<std::int64_t>(bytes);
  return s;
}

}  // namespace Exchange
}  // namespace KokkosMoE
