#ifndef KOKKOSMOE_COLLECTIVE_HPP
#define KOKKOSMOE_COLLECTIVE_HPP

/// \file KokkosMoE_Collective.hpp
/// \brief Errors that reach every rank (one agreement helper), and checked
/// MPI calls.
///
/// A rank that finds an error inside a collective region must not throw
/// alone: the other ranks would wait forever in the next collective. The
/// helpers here agree on failure first and then throw the same
/// CollectiveError on every rank, naming the lowest failing rank and its
/// message.

#include <KokkosMoE_Error.hpp>

#include <mpi.h>

#include <exception>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {

/// \brief An error raised on every rank of a communicator because at least one
/// rank failed. origin_rank() is the lowest failing rank (in that
/// communicator), failed_ranks() how many ranks failed.
class CollectiveError : public Error {
 public:
  CollectiveError(int origin_rank, int failed_ranks, std::string origin_message,
                  std::string const& what)
      : Error(what),
        origin_rank_(origin_rank),
        failed_ranks_(failed_ranks),
        origin_message_(std::move(origin_message)) {}
  int origin_rank() const noexcept { return origin_rank_; }
  int failed_ranks() const noexcept { return failed_ranks_; }
  /// \brief The message of the origin rank's own error.
  std::string const& origin_message() const noexcept { return origin_message_; }

 private:
  int origin_rank_;
  int failed_ranks_;
  std::string origin_message_;
};

/// \brief The clock of every watchdog: the seconds this process has spent
/// waiting, counted while it runs. A gap between two polls longer than a
/// tenth of a second is counted as a tenth (the process was descheduled or
/// stopped, not waiting for a peer), so a rank that was itself stopped and
/// resumes does not blame peers that did nothing.
class Watchdog {
 public:
  /// \param limit_seconds how long a wait may last (0: forever).
  /// \param sleeps whether an oversubscribed wait may sleep between polls
  /// (see oversubscribed); false: it only yields, for waits whose bytes move
  /// inside this process's own MPI calls (shared memory within a host).
  explicit Watchdog(double limit_seconds, bool sleeps = true);
  /// \brief Advances the clock; true once the limit is exceeded.
  bool expired();
  /// \brief Seconds counted so far.
  double waited() const { return waited_; }
  double limit() const { return limit_; }

 private:
  double limit_;
  double waited_ = 0;
  double last_;
  double started_;
  int spins_ = 0;
  bool sleeps_ = true;
};

/// \brief True when this host runs more ranks than it has cores (the
/// launcher's local rank count, OMPI_COMM_WORLD_LOCAL_SIZE and the like,
/// against the hardware threads), or KOKKOSMOE_WAIT=sleep; false with
/// KOKKOSMOE_WAIT=spin. Waits then sleep briefly between polls once they
/// have lasted spin_before_sleep_seconds, so that the ranks they wait for
/// get the core; shorter waits only yield.
bool oversubscribed();

/// \brief How long an oversubscribed wait yields before it sleeps between
/// polls: 1 ms, longer than a synchronisation point of a step (which a
/// sleep would delay by a wake-up each) and shorter than a scheduler's time
/// slice (which a yielding poller might otherwise keep from a peer).
inline constexpr double spin_before_sleep_seconds = 1e-3;

/// \brief Polls a nonblocking MPI collective request until it completes,
/// yielding the core to oversubscribed peers; with a watchdog (limit > 0),
/// throws Error when it takes longer: "<what>: rank R (rank r of <comm>)
/// waited S s for all N ranks of <comm>; no answer from ranks [...] ..."
/// (the missing ranks found by missing_ranks()). The buffers of a request
/// given up on must outlive it (MPI cannot cancel a collective).
void wait_watched(MPI_Request& request, MPI_Comm comm, char const* what, double watchdog_seconds);

/// \brief Who is there: every rank sends a token to every other rank of comm
/// and waits up to grace_seconds for theirs; returns the ranks (of comm)
/// whose token did not arrive. Used after a watchdog expired in a
/// collective, where every rank that is alive and waits does the same, to
/// name the ranks that are missing (stopped, killed, or stuck elsewhere).
std::vector<int> missing_ranks(MPI_Comm comm, double grace_seconds);

/// \brief Records where every rank of MPI_COMM_WORLD runs ("host kmoe-h1,
/// node 1"), index = world rank, so that watchdog messages name the host
/// and node of a peer that does not answer (a stopped process, a link
/// down), and on which host (hosts, index = world rank). Topology::discover
/// records them; empty entries are unknown.
void set_rank_places(std::vector<std::string> places, std::vector<std::string> hosts = {});

/// \brief Whether rank `rank` of comm runs on this process's host (its host
/// name, see set_rank_places, is this rank's); false where unknown.
bool shares_host(MPI_Comm comm, int rank);

/// \brief " on <place>" for rank `rank` of comm, where its place is known
/// (see set_rank_places), else "".
std::string rank_place(MPI_Comm comm, int rank);

/// \brief MPI_Allreduce of count values under the watchdog (see wait_watched).
void allreduce_watched(void const* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm, char const* what,
                       double watchdog_seconds);

/// \brief Runs f and returns its exception message ("" when it returns
/// normally). The local half of an agreement: see agree().
template <class F>
std::string problem_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (std::exception const& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
  return {};
}

/// \brief The one collective agreement on failure. Collective over comm:
/// every rank passes its problem ("" when it has none). When any rank has
/// one, every rank throws the same CollectiveError naming the lowest failing
/// rank, how many failed and that rank's message; otherwise every rank
/// returns normally. The agreement is a nonblocking reduction polled under a
/// watchdog: with watchdog_seconds > 0, a rank that waits longer than that
/// for a peer that never enters the call throws Error naming the region, the
/// communicator and this rank (0: wait forever).
void agree(MPI_Comm comm, std::string const& problem, char const* region = "collective region",
           double watchdog_seconds = 0.0);

/// \brief Runs f() on every rank of comm and agrees on the outcome (see
/// agree()): an exception thrown by f on any rank becomes the same
/// CollectiveError on all ranks. f must not itself enter collectives that a
/// failed rank would skip.
template <class F>
void collective(MPI_Comm comm, char const* region, F&& f, double watchdog_seconds = 0.0) {
  agree(comm, problem_of(std::forward<F>(f)), region, watchdog_seconds);
}

/// \brief Collective over comm: every rank must hold the same named values
/// (a communicator epoch, a placement generation, ...) before it enters work
/// that assumes so. When any value differs between ranks, every rank throws
/// the same CollectiveError naming the region and each distinct set of
/// values with the ranks that hold it; otherwise every rank returns.
void agree_same(MPI_Comm comm, char const* region, std::vector<std::pair<std::string, std::uint64_t>> const& values,
                double watchdog_seconds = 0.0);

namespace Impl {
[[noreturn]] void throw_mpi_error(int code, char const* call, MPI_Comm comm, char const* file,
                                  int line);
}  // namespace Impl

/// \brief Collective: every rank contributes a string, every rank gets all
/// of them in rank order (under the watchdog when watchdog_seconds > 0).
std::vector<std::string> allgather_strings(MPI_Comm comm, std::string const& mine, double watchdog_seconds = 0.0);

/// \brief Collective: rank root's string on every rank.
std::string broadcast_string(MPI_Comm comm, std::string const& text, int root = 0);

/// \brief Rank of the calling process in comm.
int comm_rank(MPI_Comm comm);
/// \brief Number of ranks in comm.
int comm_size(MPI_Comm comm);
/// \brief The name of comm (MPI_Comm_get_name), or "unnamed communicator".
std::string comm_name(MPI_Comm comm);

}  // namespace KokkosMoE

/// \brief Checks an MPI return code; on failure throws KokkosMoE::Error naming
/// the call, the rank and the communicator. The communicator must use
/// MPI_ERRORS_RETURN for codes to come back (KokkosMoE's own communicators do).
#define KOKKOSMOE_MPI_CHECK(call, comm)                                        \
  do {                                                                         \
    int kokkosmoe_mpi_rc_ = (call);                                            \
    if (kokkosmoe_mpi_rc_ != MPI_SUCCESS)                                      \
      ::KokkosMoE::Impl::throw_mpi_error(kokkosmoe_mpi_rc_, #call, (comm),     \
                                         __FILE__, __LINE__);                  \
  } while (0)

#endif
