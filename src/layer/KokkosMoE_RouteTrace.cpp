#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_RouteTrace.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <KokkosMoE_Hdf5.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace KokkosMoE {

namespace {

bool is_hdf5_path(std::string const& path) {
  auto ends = [&](std::string const& s) { return path.size() >= s.size() && path.compare(path.size() - s.size(), s.size(), s) == 0; };
  return ends(".h5") || ends(".hdf5");
}

/// One array read from a file: its shape and its values as double.
struct Array {
  std::vector<std::size_t> shape;
  std::vector<double> values;
};

// ---- NumPy .npy (version 1.0 / 2.0, little-endian, C order) ----

std::string npy_header(char const* descr, std::vector<std::size_t> const& shape) {
  std::ostringstream d;
  d << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) d << shape[i] << (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  d << "), }";
  std::string h = d.str();
  std::size_t const total = 10 + h.size() + 1;
  h.append((64 - total % 64) % 64, ' ');
  h.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(h.size() & 0xff));
  out.push_back(static_cast<char>((h.size() >> 8) & 0xff));
  return out + h;
}

template <class T>
std::string npy_bytes(char const* descr, std::vector<std::size_t> const& shape, std::vector<T> const& v) {
  std::string out = npy_header(descr, shape);
  out.append(reinterpret_cast<char const*>(v.data()), v.size() * sizeof(T));
  return out;
}

Array read_npy(std::string const& file, std::vector<std::string> const& dtypes) {
  std::ifstream in(file, std::ios::binary);
  KOKKOSMOE_REQUIRE(in, file << ": cannot open (a NumPy trace is a directory holding experts.npy and gates.npy, logits.npy, or all three)");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KOKKOSMOE_REQUIRE(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0, file << ": not a NumPy .npy file");
  int const major = static_cast<unsigned char>(bytes[6]);
  std::size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = static_cast<unsigned char>(bytes[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    hstart = 10;
  } else {
    KOKKOSMOE_REQUIRE(major == 2 || major == 3, file << ": NumPy format version " << major << " is not read");
    KOKKOSMOE_REQUIRE(bytes.size() >= 12, file << ": truncated header");
    for (int i = 0; i < 4; ++i) hlen |= static_cast<std::size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    hstart = 12;
  }
  KOKKOSMOE_REQUIRE(bytes.size() >= hstart + hlen, file << ": truncated header");
  std::string const h = bytes.substr(hstart, hlen);
  auto field = [&](std::string const& key) {
    auto const at = h.find("'" + key + "'");
    KOKKOSMOE_REQUIRE(at != std::string::npos, file << ": header has no '" << key << "'");
    return h.substr(h.find(':', at) + 1);
  };
  std::string descr = field("descr");
  descr = descr.substr(descr.find('\'') + 1);
  descr = descr.substr(0, descr.find('\''));
  KOKKOSMOE_REQUIRE(std::find(dtypes.begin(), dtypes.end(), descr) != dtypes.end(),
                    file << ": dtype '" << descr << "' (expected one of " << [&] {
                      std::string s;
                      for (auto const& d : dtypes) s += (s.empty() ? "" : ", ") + d;
                      return s;
                    }() << ")");
  KOKKOSMOE_REQUIRE(field("fortran_order").find("False") != std::string::npos, file << ": Fortran-ordered arrays are not read (save C order)");
  std::string shape = field("shape");
  shape = shape.substr(shape.find('(') + 1);
  shape = shape.substr(0, shape.find(')'));
  Array a;
  std::stringstream ss(shape);
  for (std::string part; std::getline(ss, part, ',');) {
    part.erase(std::remove(part.begin(), part.end(), ' '), part.end());
    if (!part.empty()) a.shape.push_back(static_cast<std::size_t>(std::stoull(part)));
  }
  std::size_t n = 1;
  for (auto x : a.shape) n *= x;
  std::size_t const w = descr.back() == '8' ? 8 : 4;
  KOKKOSMOE_REQUIRE(bytes.size() - hstart - hlen == n * w,
                    file << ": " << (bytes.size() - hstart - hlen) << " data bytes for " << n << " elements of " << w << " B");
  char const* p = bytes.data() + hstart + hlen;
  a.values.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (descr == "<i4") {
      std::int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      a.values[i] = v;
    } else if (descr == "<i8") {
      std::int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      a.values[i] = static_cast<double>(v);
    } else if (descr == "<f4") {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      a.values[i] = v;
    } else {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      a.values[i] = v;
    }
  }
  return a;
}

#ifdef KOKKOSMOE_HAVE_HDF5
Array read_h5(Hdf5::Hid const& file, std::string const& path, char const* name, bool integer) {
  Hdf5::QuietHdf5 quiet;
  Hdf5::Hid ds(H5Dopen2(file.get(), name, H5P_DEFAULT), H5Dclose);
  KOKKOSMOE_REQUIRE(ds.valid(), path << ": no dataset '/" << name << "'");
  Hdf5::Hid space(H5Dget_space(ds.get()), H5Sclose);
  int const rank = H5Sget_simple_extent_ndims(space.get());
  KOKKOSMOE_REQUIRE(rank >= 0 && rank <= 8, path << ": dataset '/" << name << "' has rank " << rank);
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  Array a;
  std::size_t n = 1;
  for (auto d : dims) {
    a.shape.push_back(static_cast<std::size_t>(d));
    n *= static_cast<std::size_t>(d);
  }
  Hdf5::Hid type(H5Dget_type(ds.get()), H5Tclose);
  KOKKOSMOE_REQUIRE(H5Tget_class(type.get()) == (integer ? H5T_INTEGER : H5T_FLOAT),
                    path << ": dataset '/" << name << "' is not " << (integer ? "an integer" : "a floating-point") << " array");
  a.values.resize(n);
  KOKKOSMOE_REQUIRE(n == 0 || H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, a.values.data()) >= 0,
                    path << ": reading dataset '/" << name << "' failed");
  return a;
}
#endif

/// The arrays read from a file; a missing one has an empty shape.
struct Arrays {
  Array experts, gates, logits;
};

RouteTrace trace_of(std::string const& path, Arrays const& a) {
  bool const routes = !a.experts.shape.empty() || !a.gates.shape.empty();
  bool const logits = !a.logits.shape.empty();
  KOKKOSMOE_REQUIRE(routes || logits, path << ": no routes (experts and gates) and no logits");
  RouteTrace t;
  if (routes) {
    auto const& ex = a.experts;
    KOKKOSMOE_REQUIRE(!ex.shape.empty(), path << ": gates without experts (a trace's routes are both arrays)");
    KOKKOSMOE_REQUIRE(!a.gates.shape.empty(), path << ": experts without gates (a trace's routes are both arrays)");
    KOKKOSMOE_REQUIRE(ex.shape.size() == 4, path << ": experts has " << ex.shape.size() << " dimensions, expected [steps, ranks, tokens, top_k]");
    KOKKOSMOE_REQUIRE(a.gates.shape == ex.shape, path << ": gates and experts have different shapes");
    t.steps = static_cast<int>(ex.shape[0]);
    t.ranks = static_cast<int>(ex.shape[1]);
    t.tokens = static_cast<index_t>(ex.shape[2]);
    t.top_k = static_cast<int>(ex.shape[3]);
    KOKKOSMOE_REQUIRE(t.steps > 0 && t.ranks > 0 && t.top_k > 0, path << ": an empty trace (shape " << t.steps << " x " << t.ranks << " x "
                                                                      << t.tokens << " x " << t.top_k << ")");
    t.experts.resize(ex.values.size());
    t.gates.resize(a.gates.values.size());
    for (std::size_t i = 0; i < ex.values.size(); ++i) {
      double const v = ex.values[i];
      KOKKOSMOE_REQUIRE(v >= -1 && v < 2147483647.0 && v == static_cast<double>(static_cast<std::int64_t>(v)),
                        path << ": experts element " << i << " = " << v << " is not an expert id (or -1)");
      t.experts[i] = static_cast<std::int32_t>(v);
      t.gates[i] = static_cast<float>(a.gates.values[i]);
    }
  }
  if (logits) {
    auto const& z = a.logits;
    KOKKOSMOE_REQUIRE(z.shape.size() == 4, path << ": logits has " << z.shape.size() << " dimensions, expected [steps, ranks, tokens, experts]");
    KOKKOSMOE_REQUIRE(!routes || (static_cast<int>(z.shape[0]) == t.steps && static_cast<int>(z.shape[1]) == t.ranks &&
                                  static_cast<index_t>(z.shape[2]) == t.tokens),
                      path << ": logits are for " << z.shape[0] << " steps x " << z.shape[1] << " ranks x " << z.shape[2]
                           << " tokens, the routes for " << t.steps << " x " << t.ranks << " x " << t.tokens);
    t.steps = static_cast<int>(z.shape[0]);
    t.ranks = static_cast<int>(z.shape[1]);
    t.tokens = static_cast<index_t>(z.shape[2]);
    t.num_experts = static_cast<int>(z.shape[3]);
    KOKKOSMOE_REQUIRE(t.steps > 0 && t.ranks > 0 && t.num_experts > 0,
                      path << ": empty logits (shape " << t.steps << " x " << t.ranks << " x " << t.tokens << " x " << t.num_experts << ")");
    t.logits.resize(z.values.size());
    for (std::size_t i = 0; i < z.values.size(); ++i) {
      KOKKOSMOE_REQUIRE(std::isfinite(z.values[i]), path << ": logits element " << i << " = " << z.values[i] << " is not finite");
      t.logits[i] = static_cast<float>(z.values[i]);
    }
  }
  return t;
}

bool file_exists(std::string const& file) { return std::ifstream(file).good(); }

RouteTrace read_local(std::string const& path) {
  Arrays a;
  if (is_hdf5_path(path)) {
#ifdef KOKKOSMOE_HAVE_HDF5
    Hdf5::QuietHdf5 quiet;
    Hdf5::Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    KOKKOSMOE_REQUIRE(file.valid(), path << ": cannot open as HDF5");
    auto has = [&](char const* name) { return H5Lexists(file.get(), name, H5P_DEFAULT) > 0; };
    KOKKOSMOE_REQUIRE(has("experts") || has("gates") || has("logits"),
                      path << ": no dataset '/experts' (with '/gates') and no '/logits': not a routing trace");
    if (has("experts") || !has("logits")) a.experts = read_h5(file, path, "experts", true);
    if (has("gates") || !has("logits")) a.gates = read_h5(file, path, "gates", false);
    if (has("logits")) a.logits = read_h5(file, path, "logits", false);
    return trace_of(path, a);
#else
    KOKKOSMOE_THROW(path << ": HDF5 traces need a KokkosMoE built with HDF5 (KokkosMoE_ENABLE_HDF5); use the NumPy layout instead");
#endif
  }
  bool const logits = file_exists(path + "/logits.npy");
  if (!logits || file_exists(path + "/experts.npy")) a.experts = read_npy(path + "/experts.npy", {"<i4", "<i8"});
  if (!logits || file_exists(path + "/gates.npy")) a.gates = read_npy(path + "/gates.npy", {"<f4", "<f8"});
  if (logits) a.logits = read_npy(path + "/logits.npy", {"<f4", "<f8"});
  return trace_of(path, a);
}

}  // namespace

int RouteTrace::max_expert() const {
  int m = -1;
  for (auto e : experts) m = std::max(m, static_cast<int>(e));
  return m;
}

std::vector<double> RouteTrace::step_load(int step, int num_experts) const {
  KOKKOSMOE_REQUIRE(has_routes(), "RouteTrace::step_load: the trace holds logits only, no routes");
  std::vector<double> load(static_cast<std::size_t>(num_experts), 0.0);
  std::size_t const a = offset(step, 0), b = offset(step + 1, 0);
  for (std::size_t i = a; i < b; ++i)
    if (experts[i] >= 0 && experts[i] < num_experts) load[static_cast<std::size_t>(experts[i])] += 1.0;
  return load;
}

RouteTrace read_route_trace(MPI_Comm comm, std::string const& path) {
  RouteTrace t;
  std::string problem;
  if (comm_rank(comm) == 0) problem = problem_of([&] { t = read_local(path); });
  agree(comm, problem, "route trace");
  std::int64_t shape[5] = {t.steps, t.ranks, static_cast<std::int64_t>(t.tokens), t.top_k, t.num_experts};
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(shape, 5, MPI_INT64_T, 0, comm), comm);
  t.steps = static_cast<int>(shape[0]);
  t.ranks = static_cast<int>(shape[1]);
  t.tokens = static_cast<index_t>(shape[2]);
  t.top_k = static_cast<int>(shape[3]);
  t.num_experts = static_cast<int>(shape[4]);
  std::size_t const n = t.offset(t.steps, 0), nz = t.logit_offset(t.steps, 0);
  t.experts.resize(n);
  t.gates.resize(n);
  t.logits.resize(nz);
  // In pieces below 2^31 elements.
  auto bcast = [&](void* data, std::size_t count, MPI_Datatype type, std::size_t bytes) {
    for (std::size_t at = 0; at < count; at += (std::size_t(1) << 30)) {
      int const c = static_cast<int>(std::min(count - at, std::size_t(1) << 30));
      KOKKOSMOE_MPI_CHECK(MPI_Bcast(static_cast<char*>(data) + at * bytes, c, type, 0, comm), comm);
    }
  };
  bcast(t.experts.data(), n, MPI_INT32_T, sizeof(std::int32_t));
  bcast(t.gates.data(), n, MPI_FLOAT, sizeof(float));
  bcast(t.logits.data(), nz, MPI_FLOAT, sizeof(float));
  return t;
}

void write_route_trace(std::string const& path, RouteTrace const& t, int num_experts) {
  std::vector<std::size_t> const shape = {static_cast<std::size_t>(t.steps), static_cast<std::size_t>(t.ranks),
                                          static_cast<std::size_t>(t.tokens), static_cast<std::size_t>(t.top_k)};
  std::vector<std::size_t> const zshape = {shape[0], shape[1], shape[2], static_cast<std::size_t>(t.num_experts)};
  KOKKOSMOE_REQUIRE(t.has_routes() || t.has_logits(), path << ": the trace holds neither routes nor logits");
  KOKKOSMOE_REQUIRE(t.experts.size() == t.offset(t.steps, 0) && t.gates.size() == t.experts.size(),
                    path << ": trace arrays hold " << t.experts.size() << " and " << t.gates.size() << " routes for its shape");
  KOKKOSMOE_REQUIRE(t.logits.size() == t.logit_offset(t.steps, 0),
                    path << ": the trace holds " << t.logits.size() << " logits for its shape");
  if (is_hdf5_path(path)) {
#ifdef KOKKOSMOE_HAVE_HDF5
    // Written under a temporary name, renamed once complete: a failed write
    // leaves no half-written trace (and the previous one, if any).
    std::string const partial = path + ".partial";
    try {
      Hdf5::QuietHdf5 quiet;
      write_text_file(partial, "");  // parent directories, and a clear error when the path cannot be written
      Hdf5::Hid file(H5Fcreate(partial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
      KOKKOSMOE_REQUIRE(file.valid(), path << ": cannot create HDF5 file");
      auto put = [&](char const* name, hid_t type, void const* data) {
        auto const& s = std::string(name) == "logits" ? zshape : shape;
        hsize_t dims[4] = {s[0], s[1], s[2], s[3]};
        Hdf5::Hid space(H5Screate_simple(4, dims, nullptr), H5Sclose);
        Hdf5::Hid ds(H5Dcreate2(file.get(), name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
        KOKKOSMOE_REQUIRE(ds.valid() && H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0,
                          path << ": writing dataset '/" << name << "' failed");
      };
      if (t.has_routes()) {
        put("experts", H5T_NATIVE_INT32, t.experts.data());
        put("gates", H5T_NATIVE_FLOAT, t.gates.data());
      }
      if (t.has_logits()) put("logits", H5T_NATIVE_FLOAT, t.logits.data());
      Hdf5::Hid aspace(H5Screate(H5S_SCALAR), H5Sclose);
      Hdf5::Hid attr(H5Acreate2(file.get(), "num_experts", H5T_NATIVE_INT, aspace.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      KOKKOSMOE_REQUIRE(attr.valid() && H5Awrite(attr.get(), H5T_NATIVE_INT, &num_experts) >= 0, path << ": writing num_experts failed");
      attr.reset();
      aspace.reset();
      KOKKOSMOE_REQUIRE(file.close(), path << ": closing the HDF5 file failed");
      KOKKOSMOE_REQUIRE(std::rename(partial.c_str(), path.c_str()) == 0, path << ": cannot rename " << partial << ": " << std::strerror(errno));
    } catch (...) {
      std::remove(partial.c_str());
      throw;
    }
    return;
#else
    (void)num_experts;
    KOKKOSMOE_THROW(path << ": HDF5 traces need a KokkosMoE built with HDF5 (KokkosMoE_ENABLE_HDF5); give a directory for the NumPy layout");
#endif
  }
  if (t.has_routes()) {
    write_text_file(path + "/experts.npy", npy_bytes("<i4", shape, t.experts));
    write_text_file(path + "/gates.npy", npy_bytes("<f4", shape, t.gates));
  }
  if (t.has_logits()) write_text_file(path + "/logits.npy", npy_bytes("<f4", zshape, t.logits));
}

std::string to_string(TraceReplay r) {
  switch (r) {
    case TraceReplay::automatic: return "auto";
    case TraceReplay::routes: return "routes";
    case TraceReplay::logits: return "logits";
  }
  return "?";
}

TraceReplay trace_replay(RouteTrace const& t, TraceReplay requested, std::string const& where) {
  if (requested == TraceReplay::automatic) return t.has_routes() ? TraceReplay::routes : TraceReplay::logits;
  KOKKOSMOE_REQUIRE(requested != TraceReplay::routes || t.has_routes(),
                    where << ": replaying routes, but the trace holds logits only (replay them: tokens.replay = \"logits\")");
  KOKKOSMOE_REQUIRE(requested != TraceReplay::logits || t.has_logits(),
                    where << ": replaying logits, but the trace holds no logits (record them with run.record_logits, or "
                             "make_trace.py --logits)");
  return requested;
}

void check_route_trace(RouteTrace const& t, std::string const& where, int ranks, int top_k, int num_experts, index_t tokens,
                       TraceReplay replay) {
  replay = trace_replay(t, replay, where);
  KOKKOSMOE_REQUIRE(t.ranks == ranks, where << ": the trace holds " << t.ranks << " ranks' routes; this run has " << ranks << " ranks");
  if (replay == TraceReplay::routes) {
    KOKKOSMOE_REQUIRE(t.top_k == top_k, where << ": the trace has top_k " << t.top_k << "; the deck's model.top_k is " << top_k);
    KOKKOSMOE_REQUIRE(t.max_expert() < num_experts,
                      where << ": the trace routes to expert " << t.max_expert() << "; the deck has " << num_experts << " experts");
  } else {
    KOKKOSMOE_REQUIRE(t.num_experts == num_experts,
                      where << ": the trace holds logits of " << t.num_experts << " experts; the deck has " << num_experts << " experts");
  }
  KOKKOSMOE_REQUIRE(tokens == 0 || t.tokens == tokens,
                    where << ": the trace has " << t.tokens << " tokens per rank; the deck's tokens.per_rank is " << tokens);
}

namespace Impl {

void gather_trace_step(MPI_Comm comm, std::vector<std::int32_t> const& experts, std::vector<float> const& gates,
                       std::vector<float> const& logits, index_t tokens, int top_k, int num_experts, RouteTrace& trace,
                       double watchdog_seconds) {
  std::string mine(reinterpret_cast<char const*>(experts.data()), experts.size() * sizeof(std::int32_t));
  mine.append(reinterpret_cast<char const*>(gates.data()), gates.size() * sizeof(float));
  mine.append(reinterpret_cast<char const*>(logits.data()), logits.size() * sizeof(float));
  auto const all = allgather_strings(comm, mine, watchdog_seconds);
  std::string problem;
  if (trace.steps == 0) {
    trace.ranks = static_cast<int>(all.size());
    trace.tokens = tokens;
    trace.top_k = top_k;
    trace.num_experts = num_experts;
  }
  for (auto const& s : all)
    if (s.size() != mine.size()) problem = "recording routes: ranks have different token counts (a trace needs equal counts)";
  if (trace.tokens != tokens || trace.top_k != top_k || trace.num_experts != num_experts)
    problem = "recording routes: the step's shape differs from the trace's (every step records logits, or none)";
  agree(comm, problem, "route trace", watchdog_seconds);
  // Appended as step trace.steps: for every rank its experts, gates, logits.
  std::size_t const n = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(top_k);
  std::size_t const nz = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_experts);
  std::size_t const at = trace.experts.size(), atz = trace.logits.size();
  trace.experts.resize(at + n * all.size());
  trace.gates.resize(at + n * all.size());
  trace.logits.resize(atz + nz * all.size());
  // (memcpy only where there is something to copy: an empty array has no data pointer)
  for (std::size_t r = 0; r < all.size(); ++r) {
    char const* p = all[r].data();
    if (n > 0) {
      std::memcpy(trace.experts.data() + at + r * n, p, n * sizeof(std::int32_t));
      std::memcpy(trace.gates.data() + at + r * n, p + n * sizeof(std::int32_t), n * sizeof(float));
    }
    if (nz > 0)
      std::memcpy(trace.logits.data() + atz + r * nz, p + n * (sizeof(std::int32_t) + sizeof(float)), nz * sizeof(float));
  }
  ++trace.steps;
}

}  // namespace Impl

}  // namespace KokkosMoE
