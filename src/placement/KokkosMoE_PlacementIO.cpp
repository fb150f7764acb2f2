#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_PlacementIO.hpp>
#include <KokkosMoE_config.hpp>

#include <nlohmann/json.hpp>

#ifdef KOKKOSMOE_HAVE_HDF5
#include <KokkosMoE_Hdf5.hpp>
#endif

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

namespace KokkosMoE {

using json = nlohmann::json;

namespace {

/// Strict JSON: no NUL byte anywhere (nothing is read past one), and no key
/// twice in an object (a later value would silently replace the first).
json parse_json(std::string const& text, std::string const& origin, char const* what) {
  auto const nul = text.find('\0');
  KOKKOSMOE_REQUIRE(nul == std::string::npos, "malformed " << what << " '" << origin << "': a NUL byte at offset " << nul);
  std::vector<std::set<std::string>> keys;  // per open object
  std::string duplicate;
  auto check = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty() && duplicate.empty()) {
      std::string const k = parsed.get<std::string>();
      if (!keys.back().insert(k).second) duplicate = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, check);
  } catch (json::exception const& e) {
    // Syntax errors, and numbers out of range (e.g. 1e999) as well.
    KOKKOSMOE_THROW("malformed " << what << " '" << origin << "': " << e.what());
  }
  KOKKOSMOE_REQUIRE(duplicate.empty(), "malformed " << what << " '" << origin << "': key \"" << duplicate
                                                    << "\" appears twice in one object");
  return j;
}

void require_keys(json const& obj, std::set<std::string> const& allowed, std::string const& where) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (allowed.count(it.key())) continue;
    std::ostringstream os;
    for (auto const& k : allowed) os << (os.tellp() > 0 ? ", " : "") << "\"" << k << "\"";
    KOKKOSMOE_THROW(where << ": unknown key \"" << it.key() << "\" (allowed: " << os.str() << ")");
  }
}

std::vector<double> load_row(json const& v, std::string const& where) {
  KOKKOSMOE_REQUIRE(v.is_array(), where << ": \"load\" must be an array of numbers, got " << v.type_name());
  KOKKOSMOE_REQUIRE(!v.empty(), where << ": \"load\" is empty");
  std::vector<double> row;
  row.reserve(v.size());
  for (std::size_t e = 0; e < v.size(); ++e) {
    KOKKOSMOE_REQUIRE(v[e].is_number(), where << ": load[" << e << "] is " << v[e].dump() << ", not a number");
    double const x = v[e].get<double>();
    KOKKOSMOE_REQUIRE(std::isfinite(x) && x >= 0, where << ": load[" << e << "] = " << x << " (must be finite and >= 0)");
    row.push_back(x);
  }
  return row;
}

bool is_hdf5_signature(std::string const& head) {
  static char const sig[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  return head.size() >= 8 && std::memcmp(head.data(), sig, 8) == 0;
}

#ifdef KOKKOSMOE_HAVE_HDF5
using Hdf5::Hid;
using Hdf5::QuietHdf5;

std::vector<std::vector<double>> read_hdf5_load(MPI_Comm comm, std::string const& path) {
  QuietHdf5 quiet;
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  KOKKOSMOE_REQUIRE(fapl.get() >= 0, "load file '" << path << "': H5Pcreate failed");
  KOKKOSMOE_REQUIRE(H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) >= 0,
                    "load file '" << path << "': H5Pset_fapl_mpio failed");
  Hid file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  KOKKOSMOE_REQUIRE(file.get() >= 0, "cannot open load file '" << path << "' as HDF5");
  KOKKOSMOE_REQUIRE(H5Lexists(file.get(), "load", H5P_DEFAULT) > 0,
                    "load file '" << path << "' (HDF5) has no dataset \"/load\"");
  Hid dset(H5Dopen2(file.get(), "/load", H5P_DEFAULT), H5Dclose);
  KOKKOSMOE_REQUIRE(dset.get() >= 0, "load file '" << path << "': \"/load\" is not a dataset");
  Hid type(H5Dget_type(dset.get()), H5Tclose);
  H5T_class_t const cls = H5Tget_class(type.get());
  KOKKOSMOE_REQUIRE(cls == H5T_INTEGER || cls == H5T_FLOAT,
                    "load file '" << path << "': dataset \"/load\" is not numeric (HDF5 type class " << static_cast<int>(cls) << ")");
  Hid space(H5Dget_space(dset.get()), H5Sclose);
  int const ndims = H5Sget_simple_extent_ndims(space.get());
  KOKKOSMOE_REQUIRE(ndims == 1 || ndims == 2,
                    "load file '" << path << "': dataset \"/load\" has rank " << ndims << " (expected [L, E] or [E])");
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space.get(), dims, nullptr);
  std::size_t const L = ndims == 2 ? static_cast<std::size_t>(dims[0]) : 1;
  std::size_t const E = static_cast<std::size_t>(ndims == 2 ? dims[1] : dims[0]);
  KOKKOSMOE_REQUIRE(L > 0 && E > 0, "load file '" << path << "': dataset \"/load\" is empty (" << L << " x " << E << ")");
  std::vector<double> flat(L * E);
  KOKKOSMOE_REQUIRE(H5Dread(dset.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, flat.data()) >= 0,
                    "load file '" << path << "': reading dataset \"/load\" failed");
  std::vector<std::vector<double>> out(L, std::vector<double>(E));
  for (std::size_t l = 0; l < L; ++l)
    for (std::size_t e = 0; e < E; ++e) {
      double const x = flat[l * E + e];
      KOKKOSMOE_REQUIRE(std::isfinite(x) && x >= 0,
                        "load file '" << path << "': layer " << l << ", load[" << e << "] = " << x << " (must be finite and >= 0)");
      out[l][e] = x;
    }
  return out;
}
#endif

}  // namespace

bool have_hdf5() {
#ifdef KOKKOSMOE_HAVE_HDF5
  return true;
#else
  return false;
#endif
}

std::vector<std::vector<double>> load_matrix_from_json(std::string const& text, std::string const& origin) {
  json const j = parse_json(text, origin, "load file");
  std::string const where = "load file '" + origin + "'";
  KOKKOSMOE_REQUIRE(j.is_object(), where << ": expected a JSON object with \"layers\" or \"load\", got " << j.type_name());
  std::vector<std::vector<double>> out;
  if (j.contains("layers")) {
    require_keys(j, {"layers", "provenance"}, where);
    auto const& layers = j.at("layers");
    KOKKOSMOE_REQUIRE(layers.is_array() && !layers.empty(), where << ": \"layers\" must be a non-empty array");
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::string const lw = where + ", layer " + std::to_string(l);
      KOKKOSMOE_REQUIRE(layers[l].is_object() && layers[l].contains("load"), lw << ": expected an object with \"load\"");
      require_keys(layers[l], {"load"}, lw);
      out.push_back(load_row(layers[l].at("load"), lw));
      KOKKOSMOE_REQUIRE(out.back().size() == out.front().size(),
                        lw << ": " << out.back().size() << " experts, layer 0 has " << out.front().size());
    }
  } else {
    KOKKOSMOE_REQUIRE(j.contains("load"), where << ": no \"layers\" or \"load\" key");
    require_keys(j, {"load", "provenance"}, where);
    out.push_back(load_row(j.at("load"), where));
  }
  return out;
}

std::string read_text_file(MPI_Comm comm, std::string const& path, char const* what) {
  int ok = 1;
  std::string text;
  if (comm_rank(comm) == 0) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      ok = 0;
    } else {
      std::ostringstream os;
      os << in.rdbuf();
      text = os.str();
    }
  }
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(&ok, 1, MPI_INT, 0, comm), comm);
  KOKKOSMOE_REQUIRE(ok, "cannot open " << what << " '" << path << "'");
  return broadcast_string(comm, text, 0);
}

std::vector<std::vector<double>> read_load_matrix(MPI_Comm comm, std::string const& path) {
  int ok = 1, hdf5 = 0;
  if (comm_rank(comm) == 0) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      ok = 0;
    } else {
      std::string head(8, '\0');
      in.read(&head[0], 8);
      head.resize(static_cast<std::size_t>(in.gcount()));
      hdf5 = is_hdf5_signature(head) ? 1 : 0;
    }
  }
  int flags[2] = {ok, hdf5};
  KOKKOSMOE_MPI_CHECK(MPI_Bcast(flags, 2, MPI_INT, 0, comm), comm);
  KOKKOSMOE_REQUIRE(flags[0], "cannot open load file '" << path << "'");
  if (flags[1]) {
#ifdef KOKKOSMOE_HAVE_HDF5
    std::vector<std::vector<double>> out;
    collective(comm, "reading an HDF5 load file", [&] { out = read_hdf5_load(comm, path); });
    return out;
#else
    KOKKOSMOE_THROW("load file '" << path << "' is HDF5 but this KokkosMoE was built without HDF5");
#endif
  }
  std::string const text = read_text_file(comm, path, "load file");
  return load_matrix_from_json(text, path);
}

void write_load_matrix_hdf5(MPI_Comm comm, std::string const& path, std::vector<std::vector<double>> const& load) {
#ifdef KOKKOSMOE_HAVE_HDF5
  KOKKOSMOE_REQUIRE(!load.empty() && !load.front().empty(), "write_load_matrix_hdf5: empty load matrix");
  std::size_t const L = load.size(), E = load.front().size();
  for (std::size_t l = 0; l < L; ++l)
    KOKKOSMOE_REQUIRE(load[l].size() == E, "write_load_matrix_hdf5: layer " << l << " has " << load[l].size()
                                                                            << " loads, layer 0 has " << E);
  std::vector<double> flat;
  flat.reserve(L * E);
  for (auto const& row : load) flat.insert(flat.end(), row.begin(), row.end());
  collective(comm, "writing an HDF5 load file", [&] {
    QuietHdf5 quiet;
    Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    KOKKOSMOE_REQUIRE(fapl.get() >= 0 && H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) >= 0,
                      "write '" << path << "': cannot set up the MPI-IO driver");
    Hid file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
    KOKKOSMOE_REQUIRE(file.get() >= 0, "cannot create HDF5 file '" << path << "'");
    hsize_t dims[2] = {static_cast<hsize_t>(L), static_cast<hsize_t>(E)};
    Hid space(H5Screate_simple(2, dims, nullptr), H5Sclose);
    Hid dset(H5Dcreate2(file.get(), "/load", H5T_IEEE_F64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    KOKKOSMOE_REQUIRE(dset.get() >= 0, "'" << path << "': cannot create dataset \"/load\"");
    // Rank 0 writes the whole dataset; the others take part with an empty selection.
    Hid mem(H5Screate_simple(2, dims, nullptr), H5Sclose);
    if (comm_rank(comm) != 0) {
      H5Sselect_none(mem.get());
      H5Sselect_none(space.get());
    }
    KOKKOSMOE_REQUIRE(H5Dwrite(dset.get(), H5T_NATIVE_DOUBLE, mem.get(), space.get(), H5P_DEFAULT, flat.data()) >= 0,
                      "'" << path << "': writing dataset \"/load\" failed");
  });
#else
  (void)comm;
  (void)load;
  KOKKOSMOE_THROW("cannot write '" << path << "': this KokkosMoE was built without HDF5");
#endif
}

std::string placements_to_json(std::vector<Placement> const& layers, int indent) {
  KOKKOSMOE_REQUIRE(!layers.empty(), "placements_to_json: no layers");
  json j;
  j["format"] = "kokkosmoe-placement";
  j["experts"] = layers.front().num_experts();
  j["ranks"] = layers.front().num_ranks();
  j["generation"] = layers.front().generation();
  j["layers"] = json::array();
  for (std::size_t l = 0; l < layers.size(); ++l) {
    auto const& p = layers[l];
    KOKKOSMOE_REQUIRE(p.num_experts() == layers.front().num_experts() && p.num_ranks() == layers.front().num_ranks(),
                      "placements_to_json: layer " << l << " has " << p.num_experts() << " experts on " << p.num_ranks()
                                                   << " ranks, layer 0 " << layers.front().num_experts() << " on "
                                                   << layers.front().num_ranks());
    json slots = json::array();
    for (int s = 0; s < p.num_slots(); ++s) {
      auto const& sl = p.slot(s);
      slots.push_back({{"expert", sl.expert},
                       {"rank", sl.rank},
                       {"node", sl.node},
                       {"replica", p.replica_rank()[static_cast<std::size_t>(s)]},
                       {"version", sl.version},
                       {"digest", digest_hex(sl.digest)}});
    }
    j["layers"].push_back({{"slots", slots}});
  }
  return j.dump(indent);
}

namespace {

int get_int(json const& obj, char const* key, std::string const& where, bool required, int fallback) {
  if (!obj.contains(key)) {
    KOKKOSMOE_REQUIRE(!required, where << ": missing \"" << key << "\"");
    return fallback;
  }
  auto const& v = obj.at(key);
  KOKKOSMOE_REQUIRE(v.is_number_integer(), where << ": \"" << key << "\" must be an integer, got " << v.dump());
  return v.get<int>();
}

std::uint64_t get_digest(json const& obj, std::string const& where) {
  if (!obj.contains("digest")) return 0;
  auto const& v = obj.at("digest");
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  KOKKOSMOE_REQUIRE(v.is_string(), where << ": \"digest\" must be a hex string or an unsigned integer, got " << v.dump());
  std::string const s = v.get<std::string>();
  KOKKOSMOE_REQUIRE(!s.empty() && s.size() <= 16 && s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
                    where << ": \"digest\" \"" << s << "\" is not 1-16 hex digits");
  return std::stoull(s, nullptr, 16);
}

}  // namespace

std::vector<Placement> placements_from_json(std::string const& text, std::string const& origin,
                                            std::vector<int> const& node_of_rank) {
  json const j = parse_json(text, origin, "placement file");
  std::string const where = "placement file '" + origin + "'";
  KOKKOSMOE_REQUIRE(j.is_object(), where << ": expected a JSON object, got " << j.type_name());
  int const E = get_int(j, "experts", where, true, 0);
  int const R = get_int(j, "ranks", where, true, 0);
  std::uint64_t generation = 0;
  if (j.contains("generation")) {
    KOKKOSMOE_REQUIRE(j.at("generation").is_number_unsigned(), where << ": \"generation\" must be an unsigned integer");
    generation = j.at("generation").get<std::uint64_t>();
  }
  if (j.contains("format"))
    KOKKOSMOE_REQUIRE(j.at("format") == "kokkosmoe-placement",
                      where << ": \"format\" is " << j.at("format").dump() << ", expected \"kokkosmoe-placement\"");
  std::vector<json> layer_slots;
  if (j.contains("layers")) {
    require_keys(j, {"format", "experts", "ranks", "generation", "layers"}, where);
    auto const& layers = j.at("layers");
    KOKKOSMOE_REQUIRE(layers.is_array() && !layers.empty(), where << ": \"layers\" must be a non-empty array");
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::string const lw = where + ", layer " + std::to_string(l);
      KOKKOSMOE_REQUIRE(layers[l].is_object() && layers[l].contains("slots"), lw << ": expected an object with \"slots\"");
      require_keys(layers[l], {"slots"}, lw);
      layer_slots.push_back(layers[l].at("slots"));
    }
  } else {
    KOKKOSMOE_REQUIRE(j.contains("slots"), where << ": no \"layers\" or \"slots\" key");
    require_keys(j, {"format", "experts", "ranks", "generation", "slots"}, where);
    layer_slots.push_back(j.at("slots"));
  }
  std::vector<Placement> out;
  for (std::size_t l = 0; l < layer_slots.size(); ++l) {
    std::string const lw = where + (layer_slots.size() > 1 || j.contains("layers") ? ", layer " + std::to_string(l) : "");
    auto const& arr = layer_slots[l];
    KOKKOSMOE_REQUIRE(arr.is_array() && !arr.empty(), lw << ": \"slots\" must be a non-empty array");
    std::vector<SlotInfo> slots;
    for (std::size_t s = 0; s < arr.size(); ++s) {
      std::string const sw = lw + ", slot " + std::to_string(s);
      KOKKOSMOE_REQUIRE(arr[s].is_object(), sw << ": expected an object");
      require_keys(arr[s], {"expert", "rank", "node", "replica", "version", "digest"}, sw);
      SlotInfo sl;
      sl.expert = get_int(arr[s], "expert", sw, true, -1);
      sl.rank = get_int(arr[s], "rank", sw, true, -1);
      sl.node = get_int(arr[s], "node", sw, false, -1);
      sl.replica = get_int(arr[s], "replica", sw, false, -1);
      if (arr[s].contains("version")) {
        KOKKOSMOE_REQUIRE(arr[s].at("version").is_number_unsigned(), sw << ": \"version\" must be an unsigned integer");
        sl.version = arr[s].at("version").get<std::uint64_t>();
      }
      sl.digest = get_digest(arr[s], sw);
      slots.push_back(sl);
    }
    try {
      out.emplace_back(E, R, std::move(slots), node_of_rank, generation);
    } catch (Error const& e) {
      throw Error(lw + ": " + e.what());
    }
  }
  return out;
}

}  // namespace KokkosMoE
