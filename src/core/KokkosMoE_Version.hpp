#ifndef KOKKOSMOE_VERSION_HPP
#define KOKKOSMOE_VERSION_HPP

/// \file KokkosMoE_Version.hpp
/// \brief What this KokkosMoE build is: version, git hash, Kokkos and options.

#include <KokkosMoE_config.hpp>

#include <iosfwd>
#include <string>

namespace KokkosMoE {

/// \brief One line: version, git hash, Kokkos version/flavor, enabled paths.
std::string build_summary();

/// \brief Kokkos' own configuration printout (execution spaces, options).
void print_kokkos_configuration(std::ostream& os);

}  // namespace KokkosMoE

#endif
