#include <KokkosMoE_Collective.hpp>

#include <sstream>
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

void raise_if_any(MPI_Comm comm, bool failed, std::string const& message, char const* region) {
  int const rank = comm_rank(comm);
  int const size = comm_size(comm);
  int mine[2] = {failed ? rank : size, failed ? 1 : 0};
  int agreed[2] = {size, 0};
  // One reduction gives both the lowest failing rank and the number of
  // failures (MPI_2INT would need MINLOC semantics; two ops keep it plain).
  MPI_Allreduce(&mine[0], &agreed[0], 1, MPI_INT, MPI_MIN, comm);
  MPI_Allreduce(&mine[1], &agreed[1], 1, MPI_INT, MPI_SUM, comm);
  int const origin = agreed[0];
  if (origin == size) return;

  int length = rank == origin ? static_cast<int>(message.size()) : 0;
  MPI_Bcast(&length, 1, MPI_INT, origin, comm);
  std::string text(static_cast<std::size_t>(length), '\0');
  if (rank == origin) text = message;
  if (length > 0) MPI_Bcast(&text[0], length, MPI_CHAR, origin, comm);

  std::ostringstream os;
  os << "KokkosMoE: " << region << " failed on rank " << origin;
  if (agreed[1] > 1) os << " (and " << agreed[1] - 1 << " other rank" << (agreed[1] > 2 ? "s" : "") << ")";
  os << " [seen on rank " << rank << " of " << size << "]: " << text;
  throw CollectiveError(origin, agreed[1], text, os.str());
}

namespace Impl {

void throw_mpi_error(int code, char const* call, MPI_Comm comm, char const* file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  char name[MPI_MAX_OBJECT_NAME] = "";
  int name_length = 0;
  if (comm != MPI_COMM_NULL) MPI_Comm_get_name(comm, name, &name_length);
  int world_rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  std::ostringstream os;
  os << call << " failed on world rank " << world_rank << " (communicator '"
     << (name_length > 0 ? name : "unnamed") << "'): " << std::string(text, static_cast<std::size_t>(length));
  throw_error(file, line, os.str());
}

}  // namespace Impl
}  // namespace KokkosMoE
