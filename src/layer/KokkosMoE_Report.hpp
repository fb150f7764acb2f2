#ifndef KOKKOSMOE_REPORT_HPP
#define KOKKOSMOE_REPORT_HPP

/// \file KokkosMoE_Report.hpp
/// \brief Per-step time series of a run (scalars and per-expert rows) and
/// their HDF5 file: one dataset per series under /steps, string attributes
/// on the root group. Written by one rank.

#include <mpi.h>

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Named per-step series: scalars (one value per step) and rows (one
/// vector per step, e.g. load per expert).
class StepSeries {
 public:
  void add(std::string const& name, double value) { scalars_[name].push_back(value); }
  void add_row(std::string const& name, std::vector<double> row) { rows_[name].push_back(std::move(row)); }
  std::map<std::string, std::vector<double>> const& scalars() const { return scalars_; }
  std::map<std::string, std::vector<std::vector<double>>> const& rows() const { return rows_; }
  /// \brief Steps recorded (the longest series).
  std::size_t steps() const;

 private:
  std::map<std::string, std::vector<double>> scalars_;
  std::map<std::string, std::vector<std::vector<double>>> rows_;
};

/// \brief True when this build writes HDF5.
bool report_has_hdf5();

/// \brief Writes the series to an HDF5 file (overwritten): /steps/<name> as
/// float64 [steps] or [steps, width]; attributes (strings) on "/". The file
/// is built in memory and written like write_text_file (temporary name, then
/// renamed), so it is complete or absent. Throws Error naming the file when
/// it cannot be written, or when this build has no HDF5. Not collective:
/// call it on one rank.
void write_series_hdf5(std::string const& path, StepSeries const& series, std::map<std::string, std::string> const& attributes);

/// \brief Writes text (any bytes) to path, creating missing parent
/// directories: to a temporary name beside it, renamed over path once
/// complete, so a reader never sees a half-written file and a failure leaves
/// the previous one. Throws Error naming the path on failure.
void write_text_file(std::string const& path, std::string const& text);

/// \brief Collective over comm: a content digest (16 hex digits) of every
/// rank's `bytes` bytes at `data`, in rank order; the same on every rank (the
/// output_digest of reports: equal digests, bitwise equal outputs).
std::string ranks_digest(MPI_Comm comm, void const* data, std::size_t bytes, double watchdog_seconds);

}  // namespace KokkosMoE

#endif
