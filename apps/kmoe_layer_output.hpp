#ifndef KMOE_LAYER_OUTPUT_HPP
#define KMOE_LAYER_OUTPUT_HPP

// What every kmoe-layer run mode (forward, train, serve) shares: the
// execution and memory space of its layer, and how its report and time
// series are written.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <iostream>
#include <map>
#include <string>

namespace kmoe_layer {

using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using json = nlohmann::json;

/// Collective over comm: rank 0 writes the JSON report to report_path and
/// the time series to h5_path (either "" for none; the series file gets the
/// deck, the build and `attributes`) and says where; a failure is an error
/// on every rank. Both files are written whole or not at all
/// (write_text_file, write_series_hdf5).
inline void write_outputs(MPI_Comm comm, double watchdog, std::string const& deck_path, json const& report, std::string const& report_path,
                          KokkosMoE::StepSeries const* series = nullptr, std::string const& h5_path = "",
                          std::map<std::string, std::string> attributes = {}) {
  KokkosMoE::collective(comm, "writing the report", [&] {
    if (KokkosMoE::comm_rank(comm) != 0) return;
    if (!report_path.empty()) {
      KokkosMoE::write_text_file(report_path, report.dump(2) + "\n");
      std::cout << "report: " << report_path << "\n";
    }
    if (series != nullptr && !h5_path.empty()) {
      attributes["deck"] = deck_path;
      attributes["build"] = KokkosMoE::build_summary();
      KokkosMoE::write_series_hdf5(h5_path, *series, attributes);
      std::cout << "time series: " << h5_path << "\n";
    }
  }, watchdog);
}

}  // namespace kmoe_layer

#endif
