// Fuzz target: TOML input decks. Any input may be refused, but only with a
// KokkosMoE::Error (a located message); anything else (another exception, a
// crash, a sanitizer report) is a finding. Built as a libFuzzer target by
// scripts/fuzz, and replayed over its corpus by ctest (fuzz_replay_deck).

#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Error.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string const text(reinterpret_cast<char const*>(data), size);
  for (int ranks : {1, 4}) {
    std::string resolved;
    try {
      resolved = KokkosMoE::parse_layer_deck("fuzz.toml", text, ranks).resolved();
    } catch (KokkosMoE::Error const&) {
      continue;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "fuzz_deck: not a KokkosMoE::Error: %s\n", e.what());
      std::abort();
    }
    // A deck that parses echoes a configuration that parses again, the same.
    try {
      auto const again = KokkosMoE::parse_layer_deck("fuzz.toml", resolved, ranks).resolved();
      if (again != resolved) {
        std::fprintf(stderr, "fuzz_deck: the resolved deck does not echo itself:\n%s\n---\n%s\n", resolved.c_str(), again.c_str());
        std::abort();
      }
    } catch (std::exception const& e) {
      std::fprintf(stderr, "fuzz_deck: the resolved deck does not parse: %s\n%s\n", e.what(), resolved.c_str());
      std::abort();
    }
  }
  return 0;
}
