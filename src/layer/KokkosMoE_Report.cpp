#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <KokkosMoE_Hdf5.hpp>
#endif

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace KokkosMoE {

std::size_t StepSeries::steps() const {
  std::size_t n = 0;
  for (auto const& kv : scalars_) n = std::max(n, kv.second.size());
  for (auto const& kv : rows_) n = std::max(n, kv.second.size());
  return n;
}

bool report_has_hdf5() {
#ifdef KOKKOSMOE_HAVE_HDF5
  return true;
#else
  return false;
#endif
}

namespace {
void make_parents(std::string const& path) {
  for (std::size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1)) {
    std::string const dir = path.substr(0, pos);
    if (mkdir(dir.c_str(), 0755) == 0) continue;
    int const err = errno;
    struct stat st;
    if (err == EEXIST && stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) continue;
    KOKKOSMOE_THROW("cannot create directory '" << dir << "' for '" << path << "': "
                                                << (err == EEXIST ? "a file of that name exists" : std::strerror(err)));
  }
}
}  // namespace

std::string ranks_digest(MPI_Comm comm, void const* data, std::size_t bytes, double watchdog_seconds) {
  std::string const mine(static_cast<char const*>(data), bytes);
  std::uint64_t d = 0x9E3779B97F4A7C15ULL;
  for (auto const& rows : allgather_strings(comm, mine, watchdog_seconds)) d = digest_bytes(rows.data(), rows.size(), d);
  return digest_hex(d);
}

void write_text_file(std::string const& path, std::string const& text) {
  make_parents(path);
  // A temporary name next to the file, renamed over it once complete: a
  // reader never sees a half-written report, and a failure leaves the old one.
  std::string const tmp = path + ".tmp." + std::to_string(static_cast<long>(getpid()));
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  KOKKOSMOE_REQUIRE(out, "cannot write '" << path << "': " << std::strerror(errno));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) {
    int const err = errno;
    std::remove(tmp.c_str());
    KOKKOSMOE_THROW("writing '" << path << "' failed: " << std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int const err = errno;
    std::remove(tmp.c_str());
    KOKKOSMOE_THROW("cannot move the complete '" << path << "' into place: " << std::strerror(err));
  }
}

#ifdef KOKKOSMOE_HAVE_HDF5
namespace {
using Hdf5::Hid;
void write_dataset(hid_t group, std::string const& path, std::string const& name, std::vector<double> const& data,
                   std::vector<hsize_t> const& dims) {
  Hid space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  KOKKOSMOE_REQUIRE(space.get() >= 0, "HDF5: cannot create a dataspace for '" << name << "' in '" << path << "'");
  // Names with '/' (e.g. "flat/seconds_total") create their groups.
  Hid lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  Hid set(H5Dcreate2(group, name.c_str(), H5T_IEEE_F64LE, space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  KOKKOSMOE_REQUIRE(set.get() >= 0, "HDF5: cannot create dataset '" << name << "' in '" << path << "'");
  if (!data.empty())
    KOKKOSMOE_REQUIRE(H5Dwrite(set.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0,
                      "HDF5: cannot write dataset '" << name << "' in '" << path << "'");
}
}  // namespace
#endif

void write_series_hdf5(std::string const& path, StepSeries const& series, std::map<std::string, std::string> const& attributes) {
#ifdef KOKKOSMOE_HAVE_HDF5
  // The file is built in memory (HDF5's core driver, no backing store) and
  // written like every report: to a temporary name, then renamed. HDF5 never
  // touches the disk, so a full disk is an ordinary write error.
  std::vector<char> image;
  {
    Hdf5::QuietHdf5 quiet;  // errors are reported by the exceptions below
    Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    KOKKOSMOE_REQUIRE(fapl.get() >= 0 && H5Pset_fapl_core(fapl.get(), 1 << 20, 0) >= 0,
                      "HDF5: cannot set up an in-memory file for '" << path << "'");
    Hid file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
    KOKKOSMOE_REQUIRE(file.get() >= 0, "cannot create HDF5 file '" << path << "'");
    Hid steps(H5Gcreate2(file.get(), "steps", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    KOKKOSMOE_REQUIRE(steps.get() >= 0, "HDF5: cannot create group /steps in '" << path << "'");
    for (auto const& kv : series.scalars())
      write_dataset(steps.get(), path, kv.first, kv.second, {static_cast<hsize_t>(kv.second.size())});
    for (auto const& kv : series.rows()) {
      std::size_t width = 0;
      for (auto const& r : kv.second) width = std::max(width, r.size());
      std::vector<double> flat(kv.second.size() * width, 0.0);
      for (std::size_t i = 0; i < kv.second.size(); ++i)
        std::copy(kv.second[i].begin(), kv.second[i].end(), flat.begin() + static_cast<std::ptrdiff_t>(i * width));
      write_dataset(steps.get(), path, kv.first, flat, {static_cast<hsize_t>(kv.second.size()), static_cast<hsize_t>(width)});
    }
    for (auto const& kv : attributes) {
      Hid type(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(type.get(), std::max<std::size_t>(1, kv.second.size()));
      Hid space(H5Screate(H5S_SCALAR), H5Sclose);
      Hid attr(H5Acreate2(file.get(), kv.first.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      KOKKOSMOE_REQUIRE(attr.get() >= 0 && H5Awrite(attr.get(), type.get(), kv.second.c_str()) >= 0,
                        "HDF5: cannot write attribute '" << kv.first << "' in '" << path << "'");
    }
    KOKKOSMOE_REQUIRE(H5Fflush(file.get(), H5F_SCOPE_GLOBAL) >= 0, "HDF5: cannot finish '" << path << "' in memory");
    ssize_t const size = H5Fget_file_image(file.get(), nullptr, 0);
    KOKKOSMOE_REQUIRE(size > 0, "HDF5: cannot size the image of '" << path << "'");
    image.resize(static_cast<std::size_t>(size));
    KOKKOSMOE_REQUIRE(H5Fget_file_image(file.get(), image.data(), image.size()) == size, "HDF5: cannot copy the image of '" << path << "'");
  }
  write_text_file(path, std::string(image.data(), image.size()));
#else
  (void)series;
  (void)attributes;
  KOKKOSMOE_THROW("cannot write '" << path << "': this KokkosMoE was built without HDF5 (KokkosMoE_ENABLE_HDF5=OFF)");
#endif
}

}  // namespace KokkosMoE
