#ifndef KOKKOSMOE_HDF5_HPP
#define KOKKOSMOE_HDF5_HPP

/// \file KokkosMoE_Hdf5.hpp
/// \brief Small HDF5 helpers shared by the library's readers and writers:
/// an owning identifier and a guard that turns off HDF5's error printer while
/// its calls are checked by the caller. Include only with KOKKOSMOE_HAVE_HDF5.

#include <hdf5.h>

namespace KokkosMoE {
namespace Hdf5 {

/// \brief Silences the HDF5 error stack printer while alive (the caller turns
/// failures into exceptions) and restores the previous printer after.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }
  QuietHdf5(QuietHdf5 const&) = delete;
  QuietHdf5& operator=(QuietHdf5 const&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

/// \brief Owning HDF5 identifier: closed with its close function when it
/// goes out of scope (negative identifiers are never closed).
class Hid {
 public:
  Hid() = default;
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Hid() { reset(); }
  Hid(Hid&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      close_ = o.close_;
      o.id_ = -1;
    }
    return *this;
  }
  Hid(Hid const&) = delete;
  Hid& operator=(Hid const&) = delete;
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = -1;
  }
  /// \brief Closes now and reports whether the close function succeeded
  /// (the identifier is given up either way, never closed twice).
  bool close() {
    hid_t const id = id_;
    id_ = -1;
    return id < 0 || !close_ || close_(id) >= 0;
  }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

}  // namespace Hdf5
}  // namespace KokkosMoE

#endif
