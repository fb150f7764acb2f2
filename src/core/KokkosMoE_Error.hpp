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

/// \brief A wait that a watchdog ended: a peer did not answer within
/// `limit` seconds (stopped, killed, or stuck in another call). Every
/// surviving peer's own watchdog ends its wait about as long after it
/// entered, so an application that aborts on this error gives them a moment
/// to report first (see apps/kmoe_app.hpp).
class WatchdogError : public Error {
 public:
  WatchdogError(std::string const& message, double limit) : Error(message), limit_(limit) {}
  double limit() const { return limit_; }

 private:
  double limit_;
};

namespace Impl {
[[noreturn]] void throw_error(char const* file, int line, std::string const& message);
[[noreturn]] void throw_watchdog(char const* file, int line, std::string const& message, double limit);
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

/// \brief Throws KokkosMoE::WatchdogError (a wait of `limit` seconds expired).
#define KOKKOSMOE_THROW_WATCHDOG(msg, limit)                                                        \
  do {                                                                                              \
    std::ostringstream kokkosmoe_watchdog_os_;                                                      \
    kokkosmoe_watchdog_os_ << msg;                                                                  \
    ::KokkosMoE::Impl::throw_watchdog(__FILE__, __LINE__, kokkosmoe_watchdog_os_.str(), (limit));   \
  } while (0)

#endif
