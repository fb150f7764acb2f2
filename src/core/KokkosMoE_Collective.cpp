#include <KokkosMoE_Collective.hpp>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace KokkosMoE {

namespace {

/// Buffers of nonblocking MPI operations: when the watchdog gives up on one,
/// the operation is still in flight (MPI cannot cancel a collective, nor a
/// send to a dead rank) and may complete into its buffers later, so they are
/// kept until the process ends instead of being freed under it.
class InFlight {
 public:
  template <class T, class... Args>
  T& make(Args&&... args) {
    auto p = std::make_shared<T>(std::forward<Args>(args)...);
    held_.push_back(p);
    return *p;
  }
  /// Every operation on the buffers completed: they are freed with this.
  void completed() { held_.clear(); }
  ~InFlight() {
    if (held_.empty()) return;
    static std::mutex mutex;
    static std::vector<std::shared_ptr<void>> abandoned;
    std::lock_guard<std::mutex> lock(mutex);
    abandoned.insert(abandoned.end(), held_.begin(), held_.end());
  }

 private:
  std::vector<std::shared_ptr<void>> held_;
};

}  // namespace

int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

int comm_size(MPI_Comm comm) {
  int s = 0;
  MPI_Comm_size(comm, &s);
  return s;
}

std::vector<std::string> allgather_strings(MPI_Comm comm, std::string const& mine, double watchdog_seconds) {
  int const size = comm_size(comm);
  InFlight inflight;
  auto& lengths = inflight.make<std::vector<int>>(static_cast<std::size_t>(size) + 1);
  lengths[static_cast<std::size_t>(size)] = static_cast<int>(mine.size());
  MPI_Request req;
  KOKKOSMOE_MPI_CHECK(MPI_Iallgather(&lengths[static_cast<std::size_t>(size)], 1, MPI_INT, lengths.data(), 1, MPI_INT, comm, &req), comm);
  wait_watched(req, comm, "string gather (lengths)", watchdog_seconds);
  auto& displs = inflight.make<std::vector<int>>(static_cast<std::size_t>(size) + 1, 0);
  for (int r = 0; r < size; ++r) displs[r + 1] = displs[r] + lengths[r];
  auto& all = inflight.make<std::string>(static_cast<std::size_t>(displs[size]), '\0');
  auto& text = inflight.make<std::string>(mine);
  KOKKOSMOE_MPI_CHECK(MPI_Iallgatherv(text.data(), static_cast<int>(text.size()), MPI_CHAR, &all[0], lengths.data(), displs.data(),
                                      MPI_CHAR, comm, &req),
                      comm);
  wait_watched(req, comm, "string gather", watchdog_seconds);
  std::vector<std::string> out(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) out[r] = all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(lengths[r]));
  inflight.completed();
  return out;
}

std::string broadcast_string(MPI_Comm comm, std::string const& text, int root) {
  long long length = comm_rank(comm) == root ? static_cast<long long>(text.size()) : 0;
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(&length, 1, MPI_LONG_LONG, root, comm), comm);
  std::string out = comm_rank(comm) == root ? text : std::string(static_cast<std::size_t>(length), '\0');
  if (length > 0) KOKKOSMOE_MPI_CHECK(MPI_Bcast(&out[0], static_cast<int>(length), MPI_CHAR, root, comm), comm);
  return out;
}

std::string comm_name(MPI_Comm comm) {
  char name[MPI_MAX_OBJECT_NAME] = "";
  int length = 0;
  if (comm != MPI_COMM_NULL) MPI_Comm_get_name(comm, name, &length);
  return length > 0 ? std::string(name, static_cast<std::size_t>(length)) : std::string("unnamed communicator");
}

Watchdog::Watchdog(double limit_seconds, bool sleeps) : limit_(limit_seconds), sleeps_(sleeps) {
  last_ = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  started_ = last_;
}

bool oversubscribed() {
  static bool const value = [] {
    if (char const* w = std::getenv("KOKKOSMOE_WAIT")) {
      std::string const v = w;
      if (v == "sleep") return true;
      if (v == "spin") return false;
    }
    // Ranks on this host, as the launcher tells them (no collective here).
    long ranks = 0;
    for (char const* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"})
      if (char const* v = std::getenv(name)) {
        ranks = std::atol(v);
        if (ranks > 0) break;
      }
    unsigned const cores = std::thread::hardware_concurrency();
    return ranks > 0 && cores > 0 && ranks > static_cast<long>(cores);
  }();
  return value;
}

bool Watchdog::expired() {
  double const now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (sleeps_ && oversubscribed() && now - started_ > spin_before_sleep_seconds) {
    // More ranks than cores: a rank that has waited a while hands its core
    // over for a moment (a yield need not: a scheduler may run the yielder
    // again at once, and its peer waits a whole time slice). Short waits
    // (a count round, an agreement, a small message) end within the
    // yielding spin; sleeping from their start would add a wake-up to each.
    static thread_local bool const slack = [] {
#ifdef __linux__
      prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // wake within ~1 us of the request, not the default 50 us
#endif
      return true;
    }();
    (void)slack;
    // The longer a wait has lasted, the longer it sleeps between polls (a
    // 64th of the wait so far, 5 to 250 us): a rank waiting on a network
    // transfer of tenths of a second polls a few thousand times a second,
    // not a hundred thousand (each poll a system call that takes the core
    // the kernel moves the bytes with), and notices the end within 1/64 of
    // its wait.
    double const sleep_us = std::clamp((now - started_) * 1e6 / 64.0, 5.0, 250.0);
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us));
  } else if (++spins_ > 64) {
    std::this_thread::yield();  // oversubscribed ranks must let their peers run
    spins_ = 0;
  }
  waited_ += std::min(now - last_, 0.1);
  last_ = now;
  return limit_ > 0 && waited_ > limit_;
}

std::vector<int> missing_ranks(MPI_Comm comm, double grace_seconds) {
  int const size = comm_size(comm);
  int const me = comm_rank(comm);
  constexpr int tag = 32017;  // reserved for this census
  // Sends to dead ranks never complete, and a cancelled receive may still
  // land: the buffers are kept for them.
  static int const token = 1;
  InFlight inflight;
  auto& in = inflight.make<std::vector<int>>(static_cast<std::size_t>(size), 0);
  std::vector<MPI_Request> recv(static_cast<std::size_t>(size), MPI_REQUEST_NULL), send(recv);
  for (int p = 0; p < size; ++p) {
    if (p == me) continue;
    MPI_Irecv(&in[static_cast<std::size_t>(p)], 1, MPI_INT, p, tag, comm, &recv[static_cast<std::size_t>(p)]);
    MPI_Isend(&token, 1, MPI_INT, p, tag, comm, &send[static_cast<std::size_t>(p)]);
  }
  Watchdog dog(grace_seconds);
  std::vector<char> heard(static_cast<std::size_t>(size), 0);
  heard[static_cast<std::size_t>(me)] = 1;
  int left = size - 1;
  while (left > 0 && !dog.expired()) {
    for (int p = 0; p < size; ++p) {
      if (heard[static_cast<std::size_t>(p)]) continue;
      int flag = 0;
      MPI_Test(&recv[static_cast<std::size_t>(p)], &flag, MPI_STATUS_IGNORE);
      if (flag) {
        heard[static_cast<std::size_t>(p)] = 1;
        --left;
      }
    }
  }
  std::vector<int> missing;
  for (int p = 0; p < size; ++p)
    if (!heard[static_cast<std::size_t>(p)]) {
      missing.push_back(p);
      MPI_Cancel(&recv[static_cast<std::size_t>(p)]);
      MPI_Request_free(&recv[static_cast<std::size_t>(p)]);
    }
  for (auto& r : send)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  if (missing.empty()) inflight.completed();  // every receive completed; the sends read only the static token
  return missing;
}

namespace {
std::mutex places_mutex;
std::vector<std::string>& places() {
  static std::vector<std::string> p;
  return p;
}
std::vector<std::string>& hosts() {
  static std::vector<std::string> h;
  return h;
}
/// World rank of rank `rank` of comm (-1 where it has none).
int world_rank_of(MPI_Comm comm, int rank) {
  if (comm == MPI_COMM_WORLD || comm == MPI_COMM_NULL) return rank;
  int world = -1;
  MPI_Group group, world_group;
  if (MPI_Comm_group(comm, &group) != MPI_SUCCESS) return -1;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(group, 1, &rank, world_group, &world);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return world == MPI_UNDEFINED ? -1 : world;
}
}  // namespace

void set_rank_places(std::vector<std::string> p, std::vector<std::string> h) {
  std::lock_guard<std::mutex> lock(places_mutex);
  places() = std::move(p);
  hosts() = std::move(h);
}

std::string rank_place(MPI_Comm comm, int rank) {
  int const world = world_rank_of(comm, rank);
  std::lock_guard<std::mutex> lock(places_mutex);
  auto const& p = places();
  if (world < 0 || world >= static_cast<int>(p.size()) || p[static_cast<std::size_t>(world)].empty()) return {};
  return " on " + p[static_cast<std::size_t>(world)];
}

bool shares_host(MPI_Comm comm, int rank) {
  int const world = world_rank_of(comm, rank);
  int me = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  std::lock_guard<std::mutex> lock(places_mutex);
  auto const& h = hosts();
  auto known = [&](int r) { return r >= 0 && r < static_cast<int>(h.size()) && !h[static_cast<std::size_t>(r)].empty(); };
  return known(world) && known(me) && h[static_cast<std::size_t>(world)] == h[static_cast<std::size_t>(me)];
}

void wait_watched(MPI_Request& request, MPI_Comm comm, char const* what, double watchdog_seconds) {
  Watchdog dog(watchdog_seconds);
  while (true) {
    int flag = 0;
    KOKKOSMOE_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), comm);
    if (flag) return;
    if (dog.expired()) {
      int world = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &world);
      double const grace = std::min(10.0, std::max(2.0, 0.5 * watchdog_seconds));
      auto const missing = missing_ranks(comm, grace);
      // Their ranks in MPI_COMM_WORLD too (communicators may reorder ranks).
      std::vector<int> world_ranks(missing.size(), -1);
      MPI_Group group, world_group;
      MPI_Comm_group(comm, &group);
      MPI_Comm_group(MPI_COMM_WORLD, &world_group);
      if (!missing.empty())
        MPI_Group_translate_ranks(group, static_cast<int>(missing.size()), missing.data(), world_group, world_ranks.data());
      MPI_Group_free(&group);
      MPI_Group_free(&world_group);
      std::ostringstream who;
      for (std::size_t i = 0; i < missing.size() && i < 32; ++i)
        who << (i ? ", " : "") << missing[i] << (world_ranks[i] != missing[i] ? " (world rank " + std::to_string(world_ranks[i]) + ")" : "")
            << rank_place(comm, missing[i]);
      if (missing.size() > 32) who << ", ... (" << missing.size() << " ranks)";
      KOKKOSMOE_THROW_WATCHDOG(what << ": rank " << world << " (rank " << comm_rank(comm) << " of " << comm_name(comm) << ") waited "
                           << dog.waited() << " s for all " << comm_size(comm) << " ranks of " << comm_name(comm) << "; "
                           << (missing.empty() ? std::string("every rank answered a census after it, so one of them is stuck in another call")
                                               : "no answer from rank" + std::string(missing.size() > 1 ? "s [" : " [") + who.str() + "] of " +
                                                     comm_name(comm) + " within " + std::to_string(static_cast<int>(grace)) +
                                                     " s (stopped, killed, or stuck elsewhere): at least one of them did not enter this call"),
                               dog.limit());
    }
  }
}

void allreduce_watched(void const* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm, char const* what,
                       double watchdog_seconds) {
  int size = 0;
  MPI_Type_size(type, &size);
  std::size_t const bytes = static_cast<std::size_t>(count) * static_cast<std::size_t>(size);
  InFlight inflight;
  auto& buf = inflight.make<std::vector<unsigned char>>(2 * bytes);
  if (bytes > 0) std::memcpy(buf.data(), in, bytes);
  MPI_Request req;
  KOKKOSMOE_MPI_CHECK(MPI_Iallreduce(buf.data(), buf.data() + bytes, count, type, op, comm, &req), comm);
  wait_watched(req, comm, what, watchdog_seconds);
  if (bytes > 0) std::memcpy(out, buf.data() + bytes, bytes);
  inflight.completed();
}

void agree(MPI_Comm comm, std::string const& problem, char const* region, double watchdog_seconds) {
  int const rank = comm_rank(comm);
  int const size = comm_size(comm);
  // Lowest failing rank (size when none), as a reduction polled under the
  // watchdog so that a peer which never arrives is reported, not waited for.
  InFlight inflight;
  auto& buf = inflight.make<std::array<int, 2>>(std::array<int, 2>{problem.empty() ? size : rank, size});
  MPI_Request req;
  KOKKOSMOE_MPI_CHECK(MPI_Iallreduce(&buf[0], &buf[1], 1, MPI_INT, MPI_MIN, comm, &req), comm);
  wait_watched(req, comm, region, watchdog_seconds);
  int const origin = buf[1];
  inflight.completed();
  if (origin == size) return;
  // Everybody is here: every rank's problem, so that each distinct message
  // is shown with the ranks that had it (the lowest rank's first).
  auto const all = allgather_strings(comm, problem, watchdog_seconds);
  std::vector<std::pair<std::string, std::vector<int>>> distinct;
  for (int r = 0; r < size; ++r) {
    auto const& m = all[static_cast<std::size_t>(r)];
    if (m.empty()) continue;
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](auto const& d) { return d.first == m; });
    if (it == distinct.end()) distinct.emplace_back(m, std::vector<int>{r});
    else it->second.push_back(r);
  }
  int failed = 0;
  for (auto const& d : distinct) failed += static_cast<int>(d.second.size());
  auto shortened = [](std::string const& m) { return m.size() <= 2000 ? m : m.substr(0, 2000) + " ... (" + std::to_string(m.size()) + " characters)"; };
  std::string const text = all[static_cast<std::size_t>(origin)];
  std::ostringstream os;
  os << "KokkosMoE: " << region << " failed on rank " << origin;
  if (failed > 1) os << " (and " << failed - 1 << " other rank" << (failed > 2 ? "s" : "") << ")";
  os << " [seen on rank " << rank << " of " << size << "]: " << shortened(text);
  for (std::size_t i = 1; i < distinct.size(); ++i) {
    os << " | rank" << (distinct[i].second.size() > 1 ? "s " : " ");
    for (std::size_t j = 0; j < distinct[i].second.size() && j < 16; ++j) os << (j ? ", " : "") << distinct[i].second[j];
    if (distinct[i].second.size() > 16) os << ", ...";
    os << ": " << shortened(distinct[i].first);
  }
  throw CollectiveError(origin, failed, text, os.str());
}

void agree_same(MPI_Comm comm, char const* region, std::vector<std::pair<std::string, std::uint64_t>> const& values,
                double watchdog_seconds) {
  // One reduction: the maximum of every value and of its complement (the
  // complement's maximum is the complement of the minimum).
  std::size_t const n = values.size();
  std::vector<std::uint64_t> mine(2 * n), top(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    mine[i] = values[i].second;
    mine[n + i] = ~values[i].second;
  }
  allreduce_watched(mine.data(), top.data(), static_cast<int>(2 * n), MPI_UINT64_T, MPI_MAX, comm, region, watchdog_seconds);
  bool same = true;
  for (std::size_t i = 0; i < n; ++i) same = same && top[i] == ~top[n + i];
  if (same) return;
  // Every rank states what it holds; agree() groups the ranks by it.
  std::ostringstream os;
  os << "the ranks differ in";
  for (std::size_t i = 0; i < n; ++i)
    if (top[i] != ~top[n + i]) os << (os.tellp() > 19 ? "," : "") << " " << values[i].first;
  os << "; this rank holds";
  for (std::size_t i = 0; i < n; ++i) os << (i ? "," : "") << " " << values[i].first << " " << values[i].second;
  agree(comm, os.str(), region, watchdog_seconds);
}

namespace Impl {

void throw_mpi_error(int code, char const* call, MPI_Comm comm, char const* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  int world_rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  std::ostringstream os;
  os << call << " failed on world rank " << world_rank << " (communicator '" << comm_name(comm) << "'): " << std::string(text, static_cast<std::size_t>(length));
  throw_error(file, line, os.str());
}

}  // namespace Impl
}  // namespace KokkosMoE
