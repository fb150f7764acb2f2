#ifndef KOKKOSMOE_IMPL_DECKREADER_HPP
#define KOKKOSMOE_IMPL_DECKREADER_HPP

/// \file impl/KokkosMoE_DeckReader.hpp
/// \brief Typed, located reads out of a TOML deck. The TOML library stays
/// inside KokkosMoE_DeckReader.cpp, which includes no Kokkos header, so that
/// it can be compiled by the host compiler alone in CUDA builds (nvcc cannot
/// compile the TOML headers).

#include <KokkosMoE_EnumNames.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Impl {

/// \brief Reads typed values out of one TOML table, remembers which keys were
/// read and reports everything else as unknown. Every error is a
/// KokkosMoE::Error naming file, line, column and the dotted key. Keys are
/// "name" or "table.name".
class DeckReader {
 public:
  /// \brief Parses TOML text. A syntax error throws Error
  /// "<path>:<line>:<column>: TOML syntax error: <description>".
  static DeckReader parse(std::string const& path, std::string const& text);

  DeckReader(DeckReader&&) noexcept;
  DeckReader& operator=(DeckReader&&) noexcept;
  DeckReader(DeckReader const&) = delete;
  DeckReader& operator=(DeckReader const&) = delete;
  ~DeckReader();

  /// \brief The dotted key as shown in messages (prefixed inside an array of tables).
  std::string full(std::string const& key) const;
  /// \brief Whether the key is present.
  bool has(std::string const& key) const;
  /// \brief "file:line:column" of a key (or of its table, or the file).
  std::string where(std::string const& key) const;
  /// \brief Throws Error "<where>: key '<full key>': <problem>".
  [[noreturn]] void fail(std::string const& key, std::string const& problem) const;

  /// \brief An integer in [lo, hi] (def when absent).
  std::int64_t integer(std::string const& key, std::int64_t def, std::int64_t lo, std::int64_t hi);
  /// \brief A finite number in [lo, hi], or in (lo, hi] when lo_open (def when absent).
  double real(std::string const& key, double def, double lo, double hi, bool lo_open = false);
  /// \brief A boolean (def when absent).
  bool boolean(std::string const& key, bool def);
  /// \brief A string (def when absent).
  std::string string(std::string const& key, std::string const& def);
  /// \brief A string that must be one of choices (def when absent).
  std::string choice(std::string const& key, std::string const& def, std::vector<std::string> const& choices);
  /// \brief v, or Error "<where>: key '<key>': 'v' is not one of 'a' 'b' ...".
  std::string const& check_choice(std::string const& key, std::string const& v, std::vector<std::string> const& choices) const;
  /// \brief An option enum by its name (KokkosMoE_EnumNames.hpp), def when absent.
  template <class E>
  E option(std::string const& key, E def) {
    return from_string<E>(choice(key, to_string(def), enum_names<E>()));
  }
  /// \brief An array of option names (empty when absent).
  template <class E>
  std::vector<E> options(std::string const& key) {
    std::vector<E> out;
    for (auto const& n : strings(key)) out.push_back(from_string<E>(check_choice(key, n, enum_names<E>())));
    return out;
  }
  /// \brief An array of integers in [lo, hi] (empty when absent).
  std::vector<std::int64_t> integers(std::string const& key, std::int64_t lo, std::int64_t hi);
  /// \brief An array of finite numbers in [lo, hi] (empty when absent).
  std::vector<double> reals(std::string const& key, double lo, double hi);
  /// \brief An array of strings (empty when absent).
  std::vector<std::string> strings(std::string const& key);
  /// \brief An array of arrays of numbers (integers converted to double):
  /// f(row, values) runs on every row, in order, as soon as it is read
  /// (nothing when absent).
  void number_rows(std::string const& key, std::function<void(std::size_t, std::vector<double> const&)> const& f);
  /// \brief Runs f on a reader for every table of an array of tables, then
  /// checks that f read every key of that table.
  void tables(std::string const& key, std::function<void(DeckReader&, std::size_t)> const& f);
  /// \brief Every key of the table (and of its sub-tables) must have been read.
  void finish() const;

 private:
  struct State;
  explicit DeckReader(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

}  // namespace Impl
}  // namespace KokkosMoE

#endif
