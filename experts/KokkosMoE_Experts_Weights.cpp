// Expert weights: digests and the parallel HDF5 checkpoint format.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Experts_Weights.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <KokkosMoE_Hdf5.hpp>
#endif

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <sys/stat.h>

namespace KokkosMoE {
namespace Experts {

namespace Impl {

namespace {

std::size_t elem_bytes(WeightDType t) { return t == WeightDType::fp32 ? 4 : 2; }

// Tensor t of one expert: 0 gate [d_ff, d], 1 up [d_ff, d], 2 down [d, d_ff].
char const* const tensor_names[3] = {"/w_gate", "/w_up", "/w_down"};

std::size_t tensor_elems(HostWeightsRef const& w) {
  return static_cast<std::size_t>(w.d) * static_cast<std::size_t>(w.d_ff);
}

unsigned char* tensor_slot(HostWeightsRef const& w, int t, int q) {
  void* base = t == 0 ? w.gate : (t == 1 ? w.up : w.down);
  return static_cast<unsigned char*>(base) + static_cast<std::size_t>(q) * tensor_elems(w) * elem_bytes(w.dtype);
}

SlotDigests digests_of(unsigned char const* const rows[3], std::size_t bytes) {
  SlotDigests s;
  for (int t = 0; t < 3; ++t) s.tensor[t] = digest_bytes(rows[t], bytes);
  // gate, then up seeded with gate's digest, then down seeded with that.
  s.slot = digest_bytes(rows[2], bytes, digest_bytes(rows[1], bytes, s.tensor[0]));
  return s;
}

std::string hex(std::uint64_t v) { return "0x" + digest_hex(v); }

}  // namespace

SlotDigests slot_digests(HostWeightsRef const& w, int q) {
  unsigned char const* rows[3] = {tensor_slot(w, 0, q), tensor_slot(w, 1, q), tensor_slot(w, 2, q)};
  return digests_of(rows, tensor_elems(w) * elem_bytes(w.dtype));
}

#ifdef KOKKOSMOE_HAVE_HDF5

namespace {

constexpr char const* format_name = "KokkosMoE.ExpertWeights";
constexpr std::int64_t format_version = 1;

using KokkosMoE::Hdf5::Hid;
using KokkosMoE::Hdf5::QuietHdf5;

// bfloat16 as an HDF5 float: sign bit 15, 8 exponent bits at 7, 7 mantissa
// bits, bias 127, little endian.
Hid make_bf16_type() {
  Hid t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  KOKKOSMOE_REQUIRE(t.valid(), "ExpertWeights: H5Tcopy failed");
  bool ok = H5Tset_fields(t.get(), 15, 7, 8, 0, 7) >= 0 && H5Tset_precision(t.get(), 16) >= 0 &&
            H5Tset_size(t.get(), 2) >= 0 && H5Tset_ebias(t.get(), 127) >= 0;
  KOKKOSMOE_REQUIRE(ok, "ExpertWeights: building the HDF5 bfloat16 type failed");
  return t;
}

Hid make_weight_type(WeightDType dt) {
  if (dt == WeightDType::fp32) return Hid(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  return make_bf16_type();
}

// "float32", "bfloat16", or a description of any other HDF5 type.
std::string describe_type(hid_t type) {
  std::ostringstream os;
  H5T_class_t const cls = H5Tget_class(type);
  std::size_t const size = H5Tget_size(type);
  if (cls == H5T_FLOAT) {
    std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
    H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize);
    if (size == 4 && esize == 8 && msize == 23) return "float32";
    if (size == 2 && esize == 8 && msize == 7) return "bfloat16";
    os << "a " << size * 8 << "-bit float (" << esize << " exponent, " << msize << " mantissa bits)";
  } else if (cls == H5T_INTEGER) {
    os << "a " << size * 8 << "-bit integer";
  } else {
    os << "HDF5 type class " << static_cast<int>(cls) << " of " << size << " bytes";
  }
  return os.str();
}

void write_string_attr(hid_t obj, char const* name, std::string const& value) {
  Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<std::size_t>(1, value.size()));
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KOKKOSMOE_REQUIRE(attr.valid() && H5Awrite(attr.get(), type.get(), value.c_str()) >= 0,
                    "writing string attribute \"" << name << "\" failed");
}

template <class V>
void write_array_attr(hid_t obj, char const* name, hid_t file_type, hid_t mem_type, std::vector<V> const& values) {
  hsize_t const n = values.size();
  Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Hid attr(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KOKKOSMOE_REQUIRE(attr.valid() && H5Awrite(attr.get(), mem_type, values.data()) >= 0,
                    "writing attribute \"" << name << "\" (" << n << " values) failed");
}

void write_int_attr(hid_t obj, char const* name, std::int64_t v) {
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KOKKOSMOE_REQUIRE(attr.valid() && H5Awrite(attr.get(), H5T_NATIVE_INT64, &v) >= 0,
                    "writing attribute \"" << name << "\" failed");
}

// Readers: `where` prefixes every message (file and object).
Hid open_attr(hid_t obj, char const* name, std::string const& where) {
  KOKKOSMOE_REQUIRE(H5Aexists(obj, name) > 0, where << " has no attribute \"" << name << "\"");
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  KOKKOSMOE_REQUIRE(attr.valid(), where << ": cannot open attribute \"" << name << "\"");
  return attr;
}

std::string read_string_attr(hid_t obj, char const* name, std::string const& where) {
  Hid attr = open_attr(obj, name, where);
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  KOKKOSMOE_REQUIRE(H5Tget_class(type.get()) == H5T_STRING, where << ": attribute \"" << name << "\" is not a string");
  if (H5Tis_variable_str(type.get()) > 0) {
    char* s = nullptr;
    Hid mem(H5Tget_native_type(type.get(), H5T_DIR_ASCEND), H5Tclose);
    KOKKOSMOE_REQUIRE(H5Aread(attr.get(), mem.get(), &s) >= 0, where << ": reading attribute \"" << name << "\" failed");
    std::string out = s ? s : "";
    if (s) H5free_memory(s);
    return out;
  }
  std::size_t const size = H5Tget_size(type.get());
  std::string buf(size, '\0');
  KOKKOSMOE_REQUIRE(H5Aread(attr.get(), type.get(), &buf[0]) >= 0, where << ": reading attribute \"" << name << "\" failed");
  return std::string(buf.c_str());
}

std::int64_t read_int_attr(hid_t obj, char const* name, std::string const& where) {
  Hid attr = open_attr(obj, name, where);
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  KOKKOSMOE_REQUIRE(H5Sget_simple_extent_npoints(space.get()) == 1 && H5Tget_class(type.get()) == H5T_INTEGER,
                    where << ": attribute \"" << name << "\" is not one integer");
  std::int64_t v = 0;
  KOKKOSMOE_REQUIRE(H5Aread(attr.get(), H5T_NATIVE_INT64, &v) >= 0, where << ": reading attribute \"" << name << "\" failed");
  return v;
}

std::vector<std::uint64_t> read_u64_array_attr(hid_t obj, char const* name, std::size_t expected, std::string const& where) {
  Hid attr = open_attr(obj, name, where);
  Hid space(H5Aget_space(attr.get()), H5Sclose);
  Hid type(H5Aget_type(attr.get()), H5Tclose);
  hssize_t const n = H5Sget_simple_extent_npoints(space.get());
  KOKKOSMOE_REQUIRE(H5Tget_class(type.get()) == H5T_INTEGER && n == static_cast<hssize_t>(expected),
                    where << ": attribute \"" << name << "\" has " << n << " values of " << describe_type(type.get())
                          << ", expected " << expected << " integers (one per expert)");
  std::vector<std::uint64_t> v(expected);
  KOKKOSMOE_REQUIRE(H5Aread(attr.get(), H5T_NATIVE_UINT64, v.data()) >= 0,
                    where << ": reading attribute \"" << name << "\" failed");
  return v;
}

std::string shape_str(hsize_t const* dims, int n) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

// Selects rows `rows` (sorted, distinct) of a [E, r, c] dataset, or none.
void select_rows(hid_t fspace, std::vector<int> const& rows, hsize_t r, hsize_t c) {
  if (rows.empty()) {
    H5Sselect_none(fspace);
    return;
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    hsize_t const start[3] = {static_cast<hsize_t>(rows[i]), 0, 0};
    hsize_t const count[3] = {1, r, c};
    H5Sselect_hyperslab(fspace, i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, start, nullptr, count, nullptr);
  }
}

Hid mem_space_for(std::size_t rows, std::size_t per) {
  hsize_t const n = static_cast<hsize_t>(std::max<std::size_t>(rows, 1) * per);
  Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  if (rows == 0) H5Sselect_none(space.get());
  return space;
}

Hid mpio_fapl(MPI_Comm comm) {
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  KOKKOSMOE_REQUIRE(fapl.valid() && H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) >= 0,
                    "ExpertWeights: setting up the MPI-IO file access property list failed");
  // 1.8 object headers and later: dense attribute storage for many experts.
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST);
  return fapl;
}

Hid collective_dxpl() {
  Hid dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  KOKKOSMOE_REQUIRE(dxpl.valid() && H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE) >= 0,
                    "ExpertWeights: setting up the collective transfer property list failed");
  return dxpl;
}

// One gathered slot record: expert, version, slot digest, 3 tensor digests, rank, local slot.
constexpr int rec_len = 8;

}  // namespace

void save_weights_hdf5(MPI_Comm comm, std::string const& path, int num_experts, HostWeightsRef const& w,
                       std::vector<std::uint64_t> const& versions) {
  QuietHdf5 quiet;
  std::string const where = "ExpertWeights::save: file '" + path + "'";
  int const rank = comm_rank(comm), size = comm_size(comm);
  std::vector<int> const& slot_expert = *w.slot_expert;
  int const L = static_cast<int>(slot_expert.size());

  // Local checks and records.
  std::vector<std::uint64_t> recs;
  collective(comm, "ExpertWeights::save (arguments)", [&] {
    KOKKOSMOE_REQUIRE(w.d_ff > 0, where << ": these are scalar test experts (no SwiGLU tensors to save)");
    KOKKOSMOE_REQUIRE(num_experts >= 1, where << ": num_experts = " << num_experts << " must be >= 1");
    for (int q = 0; q < L; ++q) {
      int const e = slot_expert[static_cast<std::size_t>(q)];
      KOKKOSMOE_REQUIRE(e < num_experts, where << ": rank " << rank << " local slot " << q << " stores expert " << e
                                               << ", outside [0, num_experts = " << num_experts << ")");
      SlotDigests const s = slot_digests(w, q);
      std::uint64_t const r[rec_len] = {static_cast<std::uint64_t>(e), versions[static_cast<std::size_t>(q)], s.slot,
                                        s.tensor[0], s.tensor[1], s.tensor[2], static_cast<std::uint64_t>(rank),
                                        static_cast<std::uint64_t>(q)};
      recs.insert(recs.end(), r, r + rec_len);
    }
  });

  // Agreement on shape/dtype/num_experts and on the owner of every expert.
  std::int64_t const mine[4] = {w.d, w.d_ff, static_cast<std::int64_t>(w.dtype), num_experts};
  std::vector<std::int64_t> all_meta(static_cast<std::size_t>(4 * size));
  KOKKOSMOE_MPI_CHECK(MPI_Allgather(mine, 4, MPI_INT64_T, all_meta.data(), 4, MPI_INT64_T, comm), comm);
  int const my_count = static_cast<int>(recs.size());
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size), 0);
  KOKKOSMOE_MPI_CHECK(MPI_Allgather(&my_count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm), comm);
  for (int r = 1; r < size; ++r) displs[static_cast<std::size_t>(r)] = displs[static_cast<std::size_t>(r - 1)] + counts[static_cast<std::size_t>(r - 1)];
  std::vector<std::uint64_t> all(static_cast<std::size_t>(displs.back() + counts.back()));
  KOKKOSMOE_MPI_CHECK(MPI_Allgatherv(recs.data(), my_count, MPI_UINT64_T, all.data(), counts.data(), displs.data(),
                                     MPI_UINT64_T, comm),
                      comm);
  std::size_t const E = static_cast<std::size_t>(std::max(num_experts, 1));
  std::vector<std::int64_t> owner(E, -1);  // record index
  collective(comm, "ExpertWeights::save (agreement)", [&] {
    for (int r = 0; r < size; ++r)
      for (int i = 0; i < 4; ++i)
        KOKKOSMOE_REQUIRE(all_meta[static_cast<std::size_t>(4 * r + i)] == mine[i],
                          where << ": ranks disagree: rank " << r << " has d = " << all_meta[static_cast<std::size_t>(4 * r)]
                                << ", d_ff = " << all_meta[static_cast<std::size_t>(4 * r + 1)] << ", dtype "
                                << to_string(static_cast<WeightDType>(all_meta[static_cast<std::size_t>(4 * r + 2)]))
                                << ", num_experts = " << all_meta[static_cast<std::size_t>(4 * r + 3)] << "; rank " << rank
                                << " has d = " << mine[0] << ", d_ff = " << mine[1] << ", dtype " << to_string(w.dtype)
                                << ", num_experts = " << mine[3]);
    std::size_t const nrec = all.size() / rec_len;
    for (std::size_t i = 0; i < nrec; ++i) {
      std::uint64_t const* r = &all[i * rec_len];
      std::size_t const e = static_cast<std::size_t>(r[0]);
      if (owner[e] < 0) {
        owner[e] = static_cast<std::int64_t>(i);
        continue;
      }
      std::uint64_t const* o = &all[static_cast<std::size_t>(owner[e]) * rec_len];
      KOKKOSMOE_REQUIRE(o[2] == r[2] && o[1] == r[1],
                        where << ": replicas of expert " << e << " differ: rank " << o[6] << " slot " << o[7] << " has digest "
                              << hex(o[2]) << " version " << o[1] << ", rank " << r[6] << " slot " << r[7] << " has digest "
                              << hex(r[2]) << " version " << r[1]);
    }
    for (std::size_t e = 0; e < E; ++e)
      KOKKOSMOE_REQUIRE(owner[e] >= 0, where << ": expert " << e << " of num_experts = " << num_experts
                                             << " is stored on no rank");
  });

  std::vector<std::uint64_t> ver(E), dig(E), tdig[3];
  for (auto& t : tdig) t.resize(E);
  for (std::size_t e = 0; e < E; ++e) {
    std::uint64_t const* r = &all[static_cast<std::size_t>(owner[e]) * rec_len];
    ver[e] = r[1];
    dig[e] = r[2];
    for (int t = 0; t < 3; ++t) tdig[t][e] = r[3 + t];
  }
  // Experts this rank writes (sorted by expert id) and the slot holding each.
  std::vector<int> own_experts, own_slots;
  for (std::size_t e = 0; e < E; ++e) {
    std::uint64_t const* r = &all[static_cast<std::size_t>(owner[e]) * rec_len];
    if (static_cast<int>(r[6]) != rank) continue;
    own_experts.push_back(static_cast<int>(e));
    own_slots.push_back(static_cast<int>(r[7]));
  }

  Hid file;
  collective(comm, "ExpertWeights::save (create)", [&] {
    Hid fapl = mpio_fapl(comm);
    file = Hid(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
    KOKKOSMOE_REQUIRE(file.valid(), where << ": cannot create the file (does its directory exist and is it writable?)");
  });

  // Every collective HDF5 call is followed by an agreement, so that after a
  // failure on any rank (a full disk, say) all ranks stop at the same call
  // and close the file together; no rank is ever left in an HDF5 collective
  // the others skipped.
  std::size_t const per = tensor_elems(w), bytes = per * elem_bytes(w.dtype);
  hid_t const root = file.get();
  collective(comm, "ExpertWeights::save (attributes)", [&] {
    write_string_attr(root, "format", format_name);
    write_int_attr(root, "format_version", format_version);
    write_int_attr(root, "num_experts", num_experts);
    write_int_attr(root, "d", w.d);
    write_int_attr(root, "d_ff", w.d_ff);
    write_string_attr(root, "dtype", to_string(w.dtype));
    write_array_attr(root, "checkpoint_version", H5T_STD_U64LE, H5T_NATIVE_UINT64, ver);
    write_array_attr(root, "content_digest", H5T_STD_U64LE, H5T_NATIVE_UINT64, dig);
  });
  Hid ftype = make_weight_type(w.dtype);
  Hid mtype = make_weight_type(w.dtype);
  Hid dxpl = collective_dxpl();
  std::vector<unsigned char> buf(std::max<std::size_t>(own_experts.size(), 1) * bytes);
  for (int t = 0; t < 3; ++t) {
    hsize_t const r = static_cast<hsize_t>(t == 2 ? w.d : w.d_ff), c = static_cast<hsize_t>(t == 2 ? w.d_ff : w.d);
    hsize_t const dims[3] = {static_cast<hsize_t>(num_experts), r, c};
    Hid fspace(H5Screate_simple(3, dims, nullptr), H5Sclose);
    Hid dset;
    collective(comm, "ExpertWeights::save (dataset)", [&] {
      dset = Hid(H5Dcreate2(root, tensor_names[t], ftype.get(), fspace.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
      KOKKOSMOE_REQUIRE(dset.valid(), where << ": creating dataset " << tensor_names[t] << " " << shape_str(dims, 3) << " failed");
      write_string_attr(dset.get(), "dtype", to_string(w.dtype));
      std::vector<std::int64_t> const shape = {static_cast<std::int64_t>(dims[0]), static_cast<std::int64_t>(r),
                                               static_cast<std::int64_t>(c)};
      write_array_attr(dset.get(), "shape", H5T_STD_I64LE, H5T_NATIVE_INT64, shape);
      write_array_attr(dset.get(), "content_digest", H5T_STD_U64LE, H5T_NATIVE_UINT64, tdig[t]);
    });
    for (std::size_t i = 0; i < own_experts.size(); ++i) std::memcpy(buf.data() + i * bytes, tensor_slot(w, t, own_slots[i]), bytes);
    select_rows(fspace.get(), own_experts, r, c);
    Hid mspace = mem_space_for(own_experts.size(), per);
    collective(comm, "ExpertWeights::save (write)", [&] {
      KOKKOSMOE_REQUIRE(H5Dwrite(dset.get(), mtype.get(), mspace.get(), fspace.get(), dxpl.get(), buf.data()) >= 0,
                        where << ": writing dataset " << tensor_names[t] << " (" << own_experts.size() << " experts from rank " << rank
                              << ") failed");
    });
  }
  // Every rank closes (a collective call); the outcome is agreed after.
  bool const closed = file.close();
  collective(comm, "ExpertWeights::save (close)", [&] { KOKKOSMOE_REQUIRE(closed, where << ": closing the file failed"); });
}

void load_weights_hdf5(MPI_Comm comm, std::string const& path, HostWeightsRef const& w,
                       std::vector<std::uint64_t>& versions, std::vector<std::uint64_t>& digests) {
  QuietHdf5 quiet;
  std::string const where = "ExpertWeights::load: file '" + path + "'";
  int const rank = comm_rank(comm);
  std::vector<int> const& slot_expert = *w.slot_expert;
  int const L = static_cast<int>(slot_expert.size());

  Hid file;
  collective(comm, "ExpertWeights::load (open)", [&] {
    struct stat st;
    KOKKOSMOE_REQUIRE(::stat(path.c_str(), &st) == 0, where << " does not exist (or is not accessible)");
    Hid fapl = mpio_fapl(comm);
    file = Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
    KOKKOSMOE_REQUIRE(file.valid(), where << " cannot be opened as HDF5");
  });

  std::size_t E = 0;
  std::vector<std::uint64_t> file_ver, file_dig, file_tdig[3];
  Hid dsets[3];
  Hid mtype;
  collective(comm, "ExpertWeights::load (metadata)", [&] {
    KOKKOSMOE_REQUIRE(w.d_ff > 0, where << ": these are scalar test experts (no SwiGLU tensors to load)");
    hid_t const root = file.get();
    std::string const format = read_string_attr(root, "format", where);
    KOKKOSMOE_REQUIRE(format == format_name, where << ": attribute \"format\" is \"" << format << "\", expected \""
                                                   << format_name << "\"");
    std::int64_t const fv = read_int_attr(root, "format_version", where);
    KOKKOSMOE_REQUIRE(fv == format_version, where << ": format_version " << fv << " is not supported (this build reads "
                                                  << format_version << ")");
    std::int64_t const ne = read_int_attr(root, "num_experts", where);
    std::int64_t const fd = read_int_attr(root, "d", where);
    std::int64_t const fdff = read_int_attr(root, "d_ff", where);
    std::string const fdtype = read_string_attr(root, "dtype", where);
    KOKKOSMOE_REQUIRE(ne >= 1, where << ": num_experts = " << ne);
    KOKKOSMOE_REQUIRE(fd == w.d && fdff == w.d_ff, where << ": shape mismatch: the file has d = " << fd << ", d_ff = " << fdff
                                                         << "; these weights have d = " << w.d << ", d_ff = " << w.d_ff);
    KOKKOSMOE_REQUIRE(fdtype == to_string(w.dtype), where << ": dtype mismatch: the file stores " << fdtype
                                                          << "; these weights are " << to_string(w.dtype));
    E = static_cast<std::size_t>(ne);
    file_ver = read_u64_array_attr(root, "checkpoint_version", E, where);
    file_dig = read_u64_array_attr(root, "content_digest", E, where);
    for (int q = 0; q < L; ++q) {
      int const e = slot_expert[static_cast<std::size_t>(q)];
      KOKKOSMOE_REQUIRE(static_cast<std::size_t>(e) < E, where << ": rank " << rank << " local slot " << q << " stores expert "
                                                              << e << " but the file holds num_experts = " << E);
    }
    mtype = make_weight_type(w.dtype);
    for (int t = 0; t < 3; ++t) {
      std::string const dwhere = where + " dataset " + tensor_names[t];
      KOKKOSMOE_REQUIRE(H5Lexists(root, tensor_names[t] + 1, H5P_DEFAULT) > 0,
                        where << " has no dataset " << tensor_names[t]);
      dsets[t] = Hid(H5Dopen2(root, tensor_names[t], H5P_DEFAULT), H5Dclose);
      KOKKOSMOE_REQUIRE(dsets[t].valid(), dwhere << " cannot be opened as a dataset");
      Hid space(H5Dget_space(dsets[t].get()), H5Sclose);
      int const nd = H5Sget_simple_extent_ndims(space.get());
      hsize_t dims[3] = {0, 0, 0};
      hsize_t const want[3] = {static_cast<hsize_t>(E), static_cast<hsize_t>(t == 2 ? w.d : w.d_ff),
                               static_cast<hsize_t>(t == 2 ? w.d_ff : w.d)};
      if (nd == 3) H5Sget_simple_extent_dims(space.get(), dims, nullptr);
      KOKKOSMOE_REQUIRE(nd == 3 && dims[0] == want[0] && dims[1] == want[1] && dims[2] == want[2],
                        dwhere << ": shape mismatch: the dataset has rank " << nd << " shape "
                               << (nd == 3 ? shape_str(dims, 3) : std::string("(not 3-D)")) << ", expected "
                               << shape_str(want, 3) << " (num_experts = " << E << ", d = " << w.d << ", d_ff = " << w.d_ff
                               << ")");
      Hid ftype(H5Dget_type(dsets[t].get()), H5Tclose);
      std::string const stored = describe_type(ftype.get());
      KOKKOSMOE_REQUIRE(stored == to_string(w.dtype),
                        dwhere << ": dtype mismatch: the dataset stores " << stored << "; these weights are " << to_string(w.dtype));
      std::string const attr_dtype = read_string_attr(dsets[t].get(), "dtype", dwhere);
      KOKKOSMOE_REQUIRE(attr_dtype == stored,
                        dwhere << ": attribute \"dtype\" says " << attr_dtype << " but the dataset stores " << stored);
      file_tdig[t] = read_u64_array_attr(dsets[t].get(), "content_digest", E, dwhere);
    }
  });

  // Distinct experts of this rank, ascending, and their position in the buffer.
  std::vector<int> experts(slot_expert);
  std::sort(experts.begin(), experts.end());
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  std::map<int, std::size_t> pos;
  for (std::size_t i = 0; i < experts.size(); ++i) pos[experts[i]] = i;
  std::size_t const per = tensor_elems(w), bytes = per * elem_bytes(w.dtype);
  std::vector<unsigned char> buf[3];
  collective(comm, "ExpertWeights::load (read)", [&] {
    Hid dxpl = collective_dxpl();
    for (int t = 0; t < 3; ++t) {
      buf[t].resize(std::max<std::size_t>(experts.size(), 1) * bytes);
      Hid fspace(H5Dget_space(dsets[t].get()), H5Sclose);
      hsize_t const r = static_cast<hsize_t>(t == 2 ? w.d : w.d_ff), c = static_cast<hsize_t>(t == 2 ? w.d_ff : w.d);
      select_rows(fspace.get(), experts, r, c);
      Hid mspace = mem_space_for(experts.size(), per);
      KOKKOSMOE_REQUIRE(H5Dread(dsets[t].get(), mtype.get(), mspace.get(), fspace.get(), dxpl.get(), buf[t].data()) >= 0,
                        where << " dataset " << tensor_names[t] << ": reading " << experts.size() << " experts on rank "
                              << rank << " failed");
    }
  });

  collective(comm, "ExpertWeights::load (verify)", [&] {
    for (std::size_t i = 0; i < experts.size(); ++i) {
      int const e = experts[i];
      unsigned char const* rows[3] = {buf[0].data() + i * bytes, buf[1].data() + i * bytes, buf[2].data() + i * bytes};
      SlotDigests const s = digests_of(rows, bytes);
      for (int t = 0; t < 3; ++t)
        KOKKOSMOE_REQUIRE(s.tensor[t] == file_tdig[t][static_cast<std::size_t>(e)],
                          where << " dataset " << tensor_names[t] << ": content digest mismatch for expert " << e
                                << ": the bytes read hash to " << hex(s.tensor[t]) << " but attribute content_digest[" << e
                                << "] = " << hex(file_tdig[t][static_cast<std::size_t>(e)]) << " (corrupted file?)");
      KOKKOSMOE_REQUIRE(s.slot == file_dig[static_cast<std::size_t>(e)],
                        where << ": content digest mismatch for expert " << e << ": datasets /w_gate, /w_up, /w_down hash to "
                              << hex(s.slot) << " but the root attribute content_digest[" << e
                              << "] = " << hex(file_dig[static_cast<std::size_t>(e)]) << " (corrupted file?)");
    }
    for (int q = 0; q < L; ++q) {
      int const e = slot_expert[static_cast<std::size_t>(q)];
      std::size_t const i = pos[e];
      for (int t = 0; t < 3; ++t) std::memcpy(tensor_slot(w, t, q), buf[t].data() + i * bytes, bytes);
      versions[static_cast<std::size_t>(q)] = file_ver[static_cast<std::size_t>(e)];
      digests[static_cast<std::size_t>(q)] = file_dig[static_cast<std::size_t>(e)];
    }
  });
  for (auto& ds : dsets) ds.reset();
  mtype.reset();
  bool const closed = file.close();
  collective(comm, "ExpertWeights::load (close)", [&] { KOKKOSMOE_REQUIRE(closed, where << ": closing the file failed"); });
}

#else

void save_weights_hdf5(MPI_Comm comm, std::string const& path, int, HostWeightsRef const&,
                       std::vector<std::uint64_t> const&) {
  collective(comm, "ExpertWeights::save", [&] {
    KOKKOSMOE_THROW("ExpertWeights::save: file '" << path << "': this KokkosMoE was built without HDF5");
  });
}

void load_weights_hdf5(MPI_Comm comm, std::string const& path, HostWeightsRef const&, std::vector<std::uint64_t>&,
                       std::vector<std::uint64_t>&) {
  collective(comm, "ExpertWeights::load", [&] {
    KOKKOSMOE_THROW("ExpertWeights::load: file '" << path << "': this KokkosMoE was built without HDF5");
  });
}

#endif

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE
