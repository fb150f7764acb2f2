#include "kmoe_bench_common.hpp"

#include <KokkosMoE_Collective.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace kmoe_bench {

std::vector<Mode>& registry() {
  static std::vector<Mode> modes;
  return modes;
}

Register::Register(std::string name, std::string help, std::function<int(int, char**)> run) {
  registry().push_back(Mode{std::move(name), std::move(help), std::move(run)});
}

double median_seconds(int warmup, int reps, std::function<void()> const& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(reps));
  for (int i = 0; i < std::max(1, reps); ++i) {
    Kokkos::Timer timer;
    f();
    t.push_back(timer.seconds());
  }
  return median(std::move(t));
}

double slowest_rank(double mine, MPI_Comm comm, double watchdog, char const* what) {
  double s = 0;
  KokkosMoE::allreduce_watched(&mine, &s, 1, MPI_DOUBLE, MPI_MAX, comm, what, watchdog);
  return s;
}

bool on_every_rank(bool mine, MPI_Comm comm, double watchdog, char const* what) {
  int local = mine ? 1 : 0, all = 0;
  KokkosMoE::allreduce_watched(&local, &all, 1, MPI_INT, MPI_MIN, comm, what, watchdog);
  return all != 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmt(double value, int digits) {
  std::ostringstream os;
  os.precision(digits);
  os << value;
  return os.str();
}

void print_bench(std::string const& name, std::vector<std::pair<std::string, std::string>> const& fields,
                 double ratio) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) return;
  std::ostringstream os;
  os << "BENCH name=" << name;
  for (auto const& kv : fields) os << " " << kv.first << "=" << kv.second;
  os << " ratio=" << fmt(ratio, 4);
  std::printf("%s\n", os.str().c_str());
  std::fflush(stdout);
}

int set_blas_threads(int threads) {
  using setter_t = void (*)(int);
  using getter_t = int (*)();
  auto set = reinterpret_cast<setter_t>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  auto get = reinterpret_cast<getter_t>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (!set) return -1;
  set(threads);
  return get ? get() : threads;
}

int host_threads() { return Kokkos::DefaultHostExecutionSpace().concurrency(); }

}  // namespace kmoe_bench
