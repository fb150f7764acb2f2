#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_config.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <KokkosMoE_Hdf5.hpp>
#endif

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sys/stat.h>

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
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
      KOKKOSMOE_THROW("cannot create directory '" << dir << "' for '" << path << "': " << std::strerror(errno));
  }
}
}  // namespace

void write_text_file(std::string const& path, std::string const& text) {
  make_parents(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KOKKOSMOE_REQUIRE(out, "cannot write '" << path << "': " << std::strerror(errno));
  out << text;
  out.close();
  KOKKOSMOE_REQUIRE(out, "writing '" << path << "' failed: " << std::strerror(errno));
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
  make_parents(path);
  Hdf5::QuietHdf5 quiet;  // errors are reported by the exceptions below
  Hid file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
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
#else
  (void)series;
  (void)attributes;
  KOKKOSMOE_THROW("cannot write '" << path << "': this KokkosMoE was built without HDF5 (KokkosMoE_ENABLE_HDF5=OFF)");
#endif
}

}  // namespace KokkosMoE
