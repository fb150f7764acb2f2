// Replays a fuzz target over files and folders of inputs (the seed corpus
// and every input that ever made it fail): each input must be refused or
// accepted cleanly. Prints how many inputs ran.
//   replay_<target> DIR_OR_FILE...

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size);

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    std::filesystem::path const p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (auto const& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file() && e.path().filename().string()[0] != '.' && e.path().extension() != ".md") files.push_back(e.path());
    } else if (std::filesystem::is_regular_file(p)) {
      files.push_back(p);
    } else {
      std::fprintf(stderr, "replay: '%s' is neither a file nor a folder\n", argv[i]);
      return 2;
    }
  }
  for (auto const& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string const bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<std::uint8_t const*>(bytes.data()), bytes.size());
  }
  std::printf("replay: %zu inputs, every one refused or accepted cleanly\n", files.size());
  return files.empty() ? 1 : 0;
}
