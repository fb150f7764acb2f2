#ifndef KOKKOSMOE_ENUMNAMES_HPP
#define KOKKOSMOE_ENUMNAMES_HPP

/// \file KokkosMoE_EnumNames.hpp
/// \brief The one mapping between option enums and their names (decks,
/// command lines, reports, error messages).
///
/// An enum E takes part by declaring, in its own namespace, a function found
/// by argument-dependent lookup that returns its table:
///
///     inline EnumTable<Color> const& names_of(Color) {
///       static EnumTable<Color> const t{"color", {{Color::red, "red"}, {Color::blue, "blue"}}};
///       return t;
///     }
///
/// Then to_string(Color::red) == "red", from_string<Color>("blue") ==
/// Color::blue, and from_string<Color>("green") throws Error "unknown color
/// 'green' (expected 'red' or 'blue')". enum_names<Color>() lists the names in
/// table order for deck readers and command-line validators.

#include <KokkosMoE_Error.hpp>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace KokkosMoE {

/// \brief Names of the values of one option enum, and what the option is.
template <class E>
struct EnumTable {
  static_assert(std::is_enum<E>::value, "EnumTable: E must be an enum");
  std::string what;                               ///< e.g. "exchange algorithm"
  std::vector<std::pair<E, std::string>> values;  ///< every value once, in display order
};

namespace Impl {
template <class E, class = void>
struct has_enum_names : std::false_type {};
template <class E>
struct has_enum_names<E, std::void_t<decltype(names_of(std::declval<E>()))>> : std::true_type {};
}  // namespace Impl

/// \brief True when E has a names_of() table.
template <class E>
constexpr bool has_enum_names = Impl::has_enum_names<E>::value;

/// \brief The table of E.
template <class E>
EnumTable<E> const& enum_table() {
  static_assert(has_enum_names<E>, "enum_table: the enum declares no names_of() table");
  return names_of(E{});
}

/// \brief The names of E in table order.
template <class E>
std::vector<std::string> enum_names() {
  std::vector<std::string> names;
  for (auto const& v : enum_table<E>().values) names.push_back(v.second);
  return names;
}

/// \brief "'a', 'b' or 'c'": the accepted names, for messages.
inline std::string quoted_alternatives(std::vector<std::string> const& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += "'" + names[i] + "'";
  }
  return s;
}

/// \brief The name of e ("<what> #<value>" for a value outside the table).
template <class E, std::enable_if_t<has_enum_names<E>, int> = 0>
std::string to_string(E e) {
  auto const& t = enum_table<E>();
  for (auto const& v : t.values)
    if (v.first == e) return v.second;
  return t.what + " #" + std::to_string(static_cast<long long>(e));
}

/// \brief The value named `name`; throws Error naming what was expected.
template <class E>
E from_string(std::string const& name) {
  auto const& t = enum_table<E>();
  for (auto const& v : t.values)
    if (v.second == name) return v.first;
  KOKKOSMOE_THROW("unknown " << t.what << " '" << name << "' (expected " << quoted_alternatives(enum_names<E>()) << ")");
}

}  // namespace KokkosMoE

#endif
