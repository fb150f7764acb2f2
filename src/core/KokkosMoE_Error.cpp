#include <KokkosMoE_Error.hpp>

#include <cstring>

namespace KokkosMoE {
namespace Impl {

namespace {
std::string located(char const* file, int line, std::string const& message) {
  // Keep only the path below the project folders so messages stay short.
  char const* short_file = file;
  for (char const* dir : {"/src/", "/topology/", "/exchange/", "/experts/", "/apps/"}) {
    if (char const* p = std::strstr(file, dir)) {
      short_file = p + 1;
      break;
    }
  }
  std::ostringstream os;
  os << "KokkosMoE error: " << message << " [" << short_file << ":" << line << "]";
  return os.str();
}
}  // namespace

void throw_error(char const* file, int line, std::string const& message) { throw Error(located(file, line, message)); }

void throw_watchdog(char const* file, int line, std::string const& message, double limit) {
  throw WatchdogError(located(file, line, message), limit);
}

}  // namespace Impl
}  // namespace KokkosMoE
