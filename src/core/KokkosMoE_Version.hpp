#ifndef KOKKOSMOE_VERSION_HPP
#define KOKKOSMOE_VERSION_HPP

/// \file KokkosMoE_Version.hpp
/// \brief What this KokkosMoE build is: version, git hash, Kokkos and options.

#include <KokkosMoE_config.hpp>

#include <iosfwd>
#include <string>

namespace KokkosMoE {

/// \brief The source tree's git revision this library was built from (12 hex
/// digits, "-dirty" with uncommitted changes; "unknown" outside a git
/// checkout), refreshed at every build.
char const* git_hash();

/// \brief One line: version, git hash, Kokkos version/flavor, enabled paths.
std::string build_summary();

/// \brief Kokkos' own configuration printout (execution spaces, options).
void print_kokkos_configuration(std::ostream& os);

}  // namespace KokkosMoE

#endif
