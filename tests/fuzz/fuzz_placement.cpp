// Fuzz target: expert load files and placement (slot list) files, JSON.
// Any input may be refused, but only with a KokkosMoE::Error; anything else
// is a finding. Built as a libFuzzer target by scripts/fuzz, replayed over
// its corpus by ctest (fuzz_replay_placement).

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_PlacementIO.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::string const text(reinterpret_cast<char const*>(data), size);
  try {
    (void)KokkosMoE::load_matrix_from_json(text, "fuzz.json");
  } catch (KokkosMoE::Error const&) {
  } catch (std::exception const& e) {
    std::fprintf(stderr, "fuzz_placement: load file, not a KokkosMoE::Error: %s\n", e.what());
    std::abort();
  }
  try {
    (void)KokkosMoE::placements_from_json(text, "fuzz.json");
  } catch (KokkosMoE::Error const&) {
  } catch (std::exception const& e) {
    std::fprintf(stderr, "fuzz_placement: placement file, not a KokkosMoE::Error: %s\n", e.what());
    std::abort();
  }
  return 0;
}
