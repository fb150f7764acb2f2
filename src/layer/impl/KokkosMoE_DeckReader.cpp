// No Kokkos header may be included here: in CUDA builds this file is compiled
// by the host compiler alone (see src/CMakeLists.txt).
#include <impl/KokkosMoE_DeckReader.hpp>

#include <KokkosMoE_Error.hpp>

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

namespace KokkosMoE {
namespace Impl {

struct DeckReader::State {
  std::string path;
  std::shared_ptr<toml::table const> root;  ///< keeps the document alive for sub-readers
  toml::table const* table = nullptr;
  std::string prefix;
  std::set<std::string> used;
};

namespace {

/// A user's string as shown in a message: at most 120 characters.
std::string shown(std::string const& s) {
  return s.size() <= 120 ? s : s.substr(0, 120) + "... (" + std::to_string(s.size()) + " characters)";
}

constexpr std::int64_t big = std::numeric_limits<std::int32_t>::max();

toml::node const* find_node(toml::table const& table, std::string const& key) {
  auto const dot = key.find('.');
  if (dot == std::string::npos) return table.get(key);
  auto const* sub = table.get(key.substr(0, dot));
  if (!sub || !sub->is_table()) return nullptr;
  return find_node(*sub->as_table(), key.substr(dot + 1));
}

char const* type_name(toml::node const& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    default: return "a date/time";
  }
}

}  // namespace

DeckReader::DeckReader(std::unique_ptr<State> state) : s_(std::move(state)) {}
DeckReader::DeckReader(DeckReader&&) noexcept = default;
DeckReader& DeckReader::operator=(DeckReader&&) noexcept = default;
DeckReader::~DeckReader() = default;

DeckReader DeckReader::parse(std::string const& path, std::string const& text) {
  auto root = std::make_shared<toml::table>();
  try {
    *root = toml::parse(text, path);
  } catch (toml::parse_error const& e) {
    KOKKOSMOE_THROW(path << ":" << e.source().begin.line << ":" << e.source().begin.column << ": TOML syntax error: "
                         << e.description());
  }
  auto s = std::make_unique<State>();
  s->path = path;
  s->table = root.get();
  s->root = std::move(root);
  return DeckReader(std::move(s));
}

std::string DeckReader::full(std::string const& key) const {
  return s_->prefix.empty() ? key : s_->prefix + "." + key;
}

bool DeckReader::has(std::string const& key) const { return find_node(*s_->table, key) != nullptr; }

std::string DeckReader::where(std::string const& key) const {
  toml::table const& table = *s_->table;
  toml::node const* n = find_node(table, key);
  if (!n) {
    auto const dot = key.find('.');
    if (dot != std::string::npos) n = table.get(key.substr(0, dot));
  }
  std::ostringstream os;
  os << s_->path;
  if (n && n->source().begin.line > 0) os << ":" << n->source().begin.line << ":" << n->source().begin.column;
  else if (table.source().begin.line > 0)
    os << ":" << table.source().begin.line << ":" << table.source().begin.column;
  return os.str();
}

void DeckReader::fail(std::string const& key, std::string const& problem) const {
  KOKKOSMOE_THROW(where(key) << ": key '" << full(key) << "': " << problem);
}

std::int64_t DeckReader::integer(std::string const& key, std::int64_t def, std::int64_t lo, std::int64_t hi) {
  s_->used.insert(key);
  auto const* n = find_node(*s_->table, key);
  if (!n) return def;
  if (!n->is_integer()) fail(key, std::string("expected an integer, got ") + type_name(*n));
  std::int64_t const v = n->as_integer()->get();
  if (v < lo || v > hi) {
    std::ostringstream os;
    os << "= " << v << " is out of range";
    if (hi >= big)
      os << " (must be >= " << lo << ")";
    else
      os << " [" << lo << ", " << hi << "]";
    fail(key, os.str());
  }
  return v;
}

double DeckReader::real(std::string const& key, double def, double lo, double hi, bool lo_open) {
  s_->used.insert(key);
  auto const* n = find_node(*s_->table, key);
  if (!n) return def;
  double v;
  if (n->is_floating_point())
    v = n->as_floating_point()->get();
  else if (n->is_integer())
    v = static_cast<double>(n->as_integer()->get());
  else
    fail(key, std::string("expected a number, got ") + type_name(*n));
  if (!std::isfinite(v)) fail(key, "must be finite");
  if (lo_open && !(v > lo)) {
    std::ostringstream os;
    os << "= " << v << " is out of range (must be > " << lo << ")";
    fail(key, os.str());
  }
  if (v < lo || v > hi) {
    std::ostringstream os;
    os << "= " << v << " is out of range";
    if (hi >= 1e300)
      os << " (must be >= " << lo << ")";
    else
      os << " [" << lo << ", " << hi << "]";
    fail(key, os.str());
  }
  return v;
}

bool DeckReader::boolean(std::string const& key, bool def) {
  s_->used.insert(key);
  auto const* n = find_node(*s_->table, key);
  if (!n) return def;
  if (!n->is_boolean()) fail(key, std::string("expected a boolean, got ") + type_name(*n));
  return n->as_boolean()->get();
}

std::string DeckReader::string(std::string const& key, std::string const& def) {
  s_->used.insert(key);
  auto const* n = find_node(*s_->table, key);
  if (!n) return def;
  if (!n->is_string()) fail(key, std::string("expected a string, got ") + type_name(*n));
  return n->as_string()->get();
}

std::string const& DeckReader::check_choice(std::string const& key, std::string const& v, std::vector<std::string> const& choices) const {
  if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
    std::ostringstream os;
    os << "'" << shown(v) << "' is not one of";
    for (auto const& c : choices) os << " '" << c << "'";
    fail(key, os.str());
  }
  return v;
}

std::string DeckReader::choice(std::string const& key, std::string const& def, std::vector<std::string> const& choices) {
  std::string const v = string(key, def);
  check_choice(key, v, choices);
  return v;
}

namespace {

/// The array under key (nullptr when absent); marks the key as read.
toml::array const* array_of(DeckReader& r, std::set<std::string>& used, toml::table const& table,
                            std::string const& key) {
  used.insert(key);
  auto const* n = find_node(table, key);
  if (!n) return nullptr;
  if (!n->is_array()) r.fail(key, std::string("expected an array, got ") + type_name(*n));
  return n->as_array();
}

}  // namespace

std::vector<std::int64_t> DeckReader::integers(std::string const& key, std::int64_t lo, std::int64_t hi) {
  std::vector<std::int64_t> out;
  if (auto const* a = array_of(*this, s_->used, *s_->table, key)) {
    for (std::size_t i = 0; i < a->size(); ++i) {
      auto const& e = *a->get(i);
      if (!e.is_integer()) fail(key, "element " + std::to_string(i) + ": expected an integer, got " + type_name(e));
      std::int64_t const v = e.as_integer()->get();
      if (v < lo || v > hi)
        fail(key, "element " + std::to_string(i) + " = " + std::to_string(v) + " is out of range [" + std::to_string(lo) +
                      ", " + std::to_string(hi) + "]");
      out.push_back(v);
    }
  }
  return out;
}

std::vector<double> DeckReader::reals(std::string const& key, double lo, double hi) {
  std::vector<double> out;
  if (auto const* a = array_of(*this, s_->used, *s_->table, key)) {
    for (std::size_t i = 0; i < a->size(); ++i) {
      auto const& e = *a->get(i);
      double v;
      if (e.is_floating_point())
        v = e.as_floating_point()->get();
      else if (e.is_integer())
        v = static_cast<double>(e.as_integer()->get());
      else
        fail(key, "element " + std::to_string(i) + ": expected a number, got " + type_name(e));
      if (!std::isfinite(v) || v < lo || v > hi) {
        std::ostringstream os;
        os << "element " << i << " = " << v << " is out of range [" << lo << ", " << hi << "]";
        fail(key, os.str());
      }
      out.push_back(v);
    }
  }
  return out;
}

std::vector<std::string> DeckReader::strings(std::string const& key) {
  std::vector<std::string> out;
  if (auto const* a = array_of(*this, s_->used, *s_->table, key)) {
    for (std::size_t i = 0; i < a->size(); ++i) {
      auto const& e = *a->get(i);
      if (!e.is_string()) fail(key, "element " + std::to_string(i) + ": expected a string, got " + type_name(e));
      out.push_back(e.as_string()->get());
    }
  }
  return out;
}

void DeckReader::number_rows(std::string const& key,
                             std::function<void(std::size_t, std::vector<double> const&)> const& f) {
  if (auto const* rows = array_of(*this, s_->used, *s_->table, key)) {
    for (std::size_t row = 0; row < rows->size(); ++row) {
      auto const& e = *rows->get(row);
      if (!e.is_array()) fail(key, "row " + std::to_string(row) + ": expected an array of numbers");
      std::vector<double> v;
      for (std::size_t c = 0; c < e.as_array()->size(); ++c) {
        auto const& x = *e.as_array()->get(c);
        if (!x.is_number()) fail(key, "row " + std::to_string(row) + " element " + std::to_string(c) + ": expected a number");
        v.push_back(x.is_integer() ? static_cast<double>(x.as_integer()->get()) : x.as_floating_point()->get());
      }
      f(row, v);
    }
  }
}

void DeckReader::tables(std::string const& key, std::function<void(DeckReader&, std::size_t)> const& f) {
  if (auto const* a = array_of(*this, s_->used, *s_->table, key)) {
    for (std::size_t i = 0; i < a->size(); ++i) {
      auto const& e = *a->get(i);
      if (!e.is_table()) fail(key, "element " + std::to_string(i) + ": expected a table, got " + type_name(e));
      auto s = std::make_unique<State>();
      s->path = s_->path;
      s->root = s_->root;
      s->table = e.as_table();
      s->prefix = full(key) + "[" + std::to_string(i) + "]";
      DeckReader sub(std::move(s));
      f(sub, i);
      sub.finish();
    }
  }
}

namespace {

void check_unused(DeckReader const& r, std::string const& path, std::set<std::string> const& used,
                  toml::table const& t, std::string const& at) {
  for (auto const& kv : t) {
    std::string const key = at.empty() ? std::string(kv.first.str()) : at + "." + std::string(kv.first.str());
    if (used.count(key)) continue;
    if (kv.second.is_table()) {
      check_unused(r, path, used, *kv.second.as_table(), key);
      continue;
    }
    std::ostringstream os;
    os << path;
    if (kv.first.source().begin.line > 0) os << ":" << kv.first.source().begin.line << ":" << kv.first.source().begin.column;
    KOKKOSMOE_THROW(os.str() << ": unknown key '" << shown(r.full(key)) << "'");
  }
}

}  // namespace

void DeckReader::finish() const { check_unused(*this, s_->path, s_->used, *s_->table, ""); }

}  // namespace Impl
}  // namespace KokkosMoE
