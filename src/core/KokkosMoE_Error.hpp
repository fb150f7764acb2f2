#ifndef KOKKOSMOE_ERROR_HPP
#define KOKKOSMOE_ERROR_HPP

/// \file KokkosMoE_Error.hpp
/// \brief The project exception type and the checks that throw it.

#include <sstream>
#include <stdexcept>
#include <string>

namespace KokkosMoE {

/// \brief Every error KokkosMoE raises. what() names what failed and where
/// (source location, and for collective errors the origin rank).
class Error : public std::runtime_error {
 public:
  explicit Error(std::string const& message) : std::runtime_error(message) {}
};

namespace Impl {
[[noreturn]] void throw_error(char const* file, int line, std::string const& message);
}  // namespace Impl

}  // namespace KokkosMoE

/// \brief Throws KokkosMoE::Error built from a stream expression unless cond
/// holds: `KOKKOSMOE_REQUIRE(k <= E, "top_k " << k << " > experts " << E);`
#define KOKKOSMOE_REQUIRE(cond, msg)                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream kokkosmoe_require_os_;                               \
      kokkosmoe_require_os_ << msg;                                           \
      ::KokkosMoE::Impl::throw_error(__FILE__, __LINE__,                      \
                                     kokkosmoe_require_os_.str());            \
    }                                                                         \
  } while (0)

/// \brief Throws KokkosMoE::Error with a message built from a stream expression.
#define KOKKOSMOE_THROW(msg) KOKKOSMOE_REQUIRE(false, msg)

#endif
