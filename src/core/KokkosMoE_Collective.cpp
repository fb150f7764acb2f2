#include <KokkosMoE_Collective.hpp>

#include <chrono>
#include <sstream>
#include <thread>
#include <vector>

namespace KokkosMoE {

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

std::vector<std::string> allgather_strings(MPI_Comm comm, std::string const& mine) {
  int const size = comm_size(comm);
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<std::size_t>(size));
  KOKKOSMOE_MPI_CHECK(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm), comm);
  std::vector<int> displs(static_cast<std::size_t>(size) + 1, 0);
  for (int r = 0; r < size; ++r) displs[r + 1] = displs[r] + lengths[r];
  std::string all(static_cast<std::size_t>(displs[size]), '\0');
  KOKKOSMOE_MPI_CHECK(MPI_Allgatherv(mine.data(), length, MPI_CHAR, &all[0], lengths.data(), displs.data(),
                                     MPI_CHAR, comm),
                      comm);
  std::vector<std::string> out(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) out[r] = all.substr(static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(lengths[r]));
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

void agree(MPI_Comm comm, std::string const& problem, char const* region, double watchdog_seconds) {
  using clock = std::chrono::steady_clock;
  int const rank = comm_rank(comm);
  int const size = comm_size(comm);
  // Lowest failing rank (size when none), as a reduction polled under the
  // watchdog so that a peer which never arrives is reported, not waited for.
  // The reduction's buffers live on the heap: when the watchdog gives up, the
  // operation is still in flight (MPI cannot cancel a collective) and may
  // complete later, so they are left to it rather than freed under it.
  auto* buf = new int[2]{problem.empty() ? size : rank, size};
  MPI_Request req;
  KOKKOSMOE_MPI_CHECK(MPI_Iallreduce(&buf[0], &buf[1], 1, MPI_INT, MPI_MIN, comm, &req), comm);
  auto const start = clock::now();
  int spins = 0;
  while (true) {
    int flag = 0;
    KOKKOSMOE_MPI_CHECK(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), comm);
    if (flag) break;
    if (++spins > 64) {
      std::this_thread::yield();  // oversubscribed ranks must let their peers run
      spins = 0;
    }
    double const waited = std::chrono::duration<double>(clock::now() - start).count();
    if (watchdog_seconds > 0 && waited > watchdog_seconds) {
      int world = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &world);
      KOKKOSMOE_THROW(region << ": rank " << world << " (rank " << rank << " of " << comm_name(comm) << ") waited " << waited
                             << " s in the agreement over all " << size << " ranks of " << comm_name(comm)
                             << "; at least one of them did not enter this call");
    }
  }
  int const origin = buf[1];
  delete[] buf;
  if (origin == size) return;
  // Everybody is here: count the failures and send the origin's message.
  int const failed_here = problem.empty() ? 0 : 1;
  int failed = 0;
  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(&failed_here, &failed, 1, MPI_INT, MPI_SUM, comm), comm);
  int length = rank == origin ? static_cast<int>(problem.size()) : 0;
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT, origin, comm), comm);
  std::string text = rank == origin ? problem : std::string(static_cast<std::size_t>(length), '\0');
  if (length > 0) KOKKOSMOE_MPI_CHECK(MPI_Bcast(&text[0], length, MPI_CHAR, origin, comm), comm);
  std::ostringstream os;
  os << "KokkosMoE: " << region << " failed on rank " << origin;
  if (failed > 1) os << " (and " << failed - 1 << " other rank" << (failed > 2 ? "s" : "") << ")";
  os << " [seen on rank " << rank << " of " << size << "]: " << text;
  throw CollectiveError(origin, failed, text, os.str());
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
