#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Safetensors.hpp>

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

namespace KokkosMoE {
namespace Checkpoint {

using json = nlohmann::json;

namespace {

bool is_directory(std::string const& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool exists(std::string const& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}
std::string parent_of(std::string const& p) {
  auto const slash = p.find_last_of('/');
  return slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : p.substr(0, slash);
}
std::string join(std::string const& dir, std::string const& name) { return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name; }

std::string read_text(std::string const& path, char const* what) {
  std::ifstream in(path, std::ios::binary);
  KOKKOSMOE_REQUIRE(in.good(), what << " '" << path << "' cannot be opened: " << std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

float half_to_float(std::uint16_t h) {
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1Fu;
  std::uint32_t m = h & 0x3FFu;
  std::uint32_t bits;
  if (e == 0x1Fu) {
    bits = sign | 0x7F800000u | (m << 13);  // Inf / NaN
  } else if (e == 0) {
    if (m == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int shift = 0;
      while ((m & 0x400u) == 0) {
        m <<= 1;
        ++shift;
      }
      m &= 0x3FFu;
      bits = sign | (static_cast<std::uint32_t>(127 - 15 + 1 - shift) << 23) | (m << 13);
    }
  } else {
    bits = sign | ((e - 15u + 127u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

std::string shape_text(std::vector<std::int64_t> const& s) {
  std::ostringstream o;
  o << "[";
  for (std::size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

}  // namespace

std::int64_t TensorInfo::elements() const {
  std::int64_t n = 1;
  for (auto v : shape) n *= v;
  return n;
}

int dtype_bytes(std::string const& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F8_E4M3" || dtype == "F8_E5M2" || dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  int const fd = ::open(path_.c_str(), O_RDONLY);
  KOKKOSMOE_REQUIRE(fd >= 0, "safetensors file '" << path_ << "' cannot be opened: " << std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    KOKKOSMOE_THROW("safetensors file '" << path_ << "' is not a regular file");
  }
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  if (map_bytes_ < 8) {
    ::close(fd);
    KOKKOSMOE_THROW("safetensors file '" << path_ << "' has " << map_bytes_ << " bytes, fewer than its 8-byte header length");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  KOKKOSMOE_REQUIRE(map_ != MAP_FAILED, "safetensors file '" << path_ << "' cannot be mapped: " << std::strerror(errno));
  auto const* bytes = static_cast<unsigned char const*>(map_);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  try {
    KOKKOSMOE_REQUIRE(n <= map_bytes_ - 8, "safetensors file '" << path_ << "': header length " << n << " runs past the file's "
                                                                << map_bytes_ << " bytes");
    data_ = bytes + 8 + n;
    std::uint64_t const data_bytes = map_bytes_ - 8 - n;
    json h;
    try {
      h = json::parse(bytes + 8, bytes + 8 + n);
    } catch (json::exception const& e) {
      KOKKOSMOE_THROW("safetensors file '" << path_ << "': header is not JSON (" << e.what() << ")");
    }
    KOKKOSMOE_REQUIRE(h.is_object(), "safetensors file '" << path_ << "': header is not a JSON object");
    std::vector<TensorInfo const*> order;
    for (auto const& [name, v] : h.items()) {
      if (name == "__metadata__") {
        KOKKOSMOE_REQUIRE(v.is_object(), "safetensors file '" << path_ << "': __metadata__ is not an object");
        for (auto const& [k, m] : v.items())
          if (m.is_string()) metadata_[k] = m.get<std::string>();
        continue;
      }
      std::string const where = "safetensors file '" + path_ + "', tensor '" + name + "'";
      KOKKOSMOE_REQUIRE(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
                        where << ": needs dtype, shape and data_offsets");
      TensorInfo t;
      t.name = name;
      t.file = path_;
      KOKKOSMOE_REQUIRE(v.at("dtype").is_string(), where << ": dtype is not a string");
      t.dtype = v.at("dtype").get<std::string>();
      KOKKOSMOE_REQUIRE(v.at("shape").is_array(), where << ": shape is not an array");
      for (auto const& d : v.at("shape")) {
        KOKKOSMOE_REQUIRE(d.is_number_integer() && d.get<std::int64_t>() >= 0, where << ": shape " << v.at("shape").dump()
                                                                                  << " holds a value that is not a non-negative integer");
        t.shape.push_back(d.get<std::int64_t>());
      }
      auto const& off = v.at("data_offsets");
      KOKKOSMOE_REQUIRE(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                        where << ": data_offsets " << off.dump() << " is not [begin, end]");
      t.begin = off[0].get<std::uint64_t>();
      t.end = off[1].get<std::uint64_t>();
      KOKKOSMOE_REQUIRE(t.begin <= t.end && t.end <= data_bytes, where << ": data_offsets [" << t.begin << ", " << t.end
                                                                       << "] lie outside the " << data_bytes << " data bytes");
      int const eb = dtype_bytes(t.dtype);
      KOKKOSMOE_REQUIRE(eb > 0, where << ": unknown dtype '" << t.dtype << "'");
      KOKKOSMOE_REQUIRE(static_cast<std::uint64_t>(t.elements()) * static_cast<std::uint64_t>(eb) == t.end - t.begin,
                        where << ": " << t.dtype << " " << shape_text(t.shape) << " needs " << t.elements() * eb << " bytes, data_offsets give "
                              << t.end - t.begin);
      order.push_back(&(tensors_[name] = std::move(t)));
    }
    std::sort(order.begin(), order.end(), [](TensorInfo const* a, TensorInfo const* b) { return a->begin < b->begin; });
    for (std::size_t i = 1; i < order.size(); ++i)
      KOKKOSMOE_REQUIRE(order[i]->begin >= order[i - 1]->end || order[i]->begin == order[i]->end || order[i - 1]->begin == order[i - 1]->end,
                        "safetensors file '" << path_ << "': tensors '" << order[i - 1]->name << "' [" << order[i - 1]->begin << ", "
                                             << order[i - 1]->end << ") and '" << order[i]->name << "' [" << order[i]->begin << ", "
                                             << order[i]->end << ") overlap");
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
}

TensorInfo const& SafetensorsFile::info(std::string const& name) const {
  auto const it = tensors_.find(name);
  KOKKOSMOE_REQUIRE(it != tensors_.end(), "safetensors file '" << path_ << "' has no tensor '" << name << "'");
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> n;
  for (auto const& kv : tensors_) n.push_back(kv.first);
  return n;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(std::string path) : path_(std::move(path)) {
  std::string index;
  if (is_directory(path_)) {
    dir_ = path_;
    if (exists(join(path_, "model.safetensors.index.json")))
      index = join(path_, "model.safetensors.index.json");
    else if (exists(join(path_, "model.safetensors")))
      files_[join(path_, "model.safetensors")] = std::make_unique<SafetensorsFile>(join(path_, "model.safetensors"));
    else
      KOKKOSMOE_THROW("checkpoint directory '" << path_ << "' holds neither model.safetensors nor model.safetensors.index.json");
  } else {
    dir_ = parent_of(path_);
    if (path_.size() > 5 && path_.compare(path_.size() - 5, 5, ".json") == 0)
      index = path_;
    else
      files_[path_] = std::make_unique<SafetensorsFile>(path_);
  }
  if (!index.empty()) {
    json j;
    try {
      j = json::parse(read_text(index, "checkpoint index"));
    } catch (json::exception const& e) {
      KOKKOSMOE_THROW("checkpoint index '" << index << "' is not JSON (" << e.what() << ")");
    }
    KOKKOSMOE_REQUIRE(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(),
                      "checkpoint index '" << index << "' has no \"weight_map\" object");
    for (auto const& [name, file] : j.at("weight_map").items()) {
      KOKKOSMOE_REQUIRE(file.is_string(), "checkpoint index '" << index << "': weight_map entry '" << name << "' is not a file name");
      auto const f = file.get<std::string>();
      KOKKOSMOE_REQUIRE(f.find('/') == std::string::npos && f != ".." && !f.empty(),
                        "checkpoint index '" << index << "': weight_map entry '" << name << "' names '" << f
                                             << "', not a file of the checkpoint's directory");
      weight_map_[name] = join(dir_, f);
    }
  }
}

SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

SafetensorsFile const& SafetensorsCheckpoint::file_of(std::string const& name) const {
  if (weight_map_.empty()) {
    auto const& f = *files_.begin()->second;
    (void)f.info(name);  // names the file and the tensor when absent
    return f;
  }
  auto const it = weight_map_.find(name);
  KOKKOSMOE_REQUIRE(it != weight_map_.end(), "checkpoint '" << path_ << "': no tensor '" << name << "' in the index's weight_map");
  auto& slot = files_[it->second];
  if (!slot) slot = std::make_unique<SafetensorsFile>(it->second);
  KOKKOSMOE_REQUIRE(slot->has(name), "checkpoint '" << path_ << "': the index puts tensor '" << name << "' in '" << it->second
                                                    << "', which does not hold it");
  return *slot;
}

bool SafetensorsCheckpoint::has(std::string const& name) const {
  if (!weight_map_.empty()) return weight_map_.count(name) != 0;
  return files_.begin()->second->has(name);
}

TensorInfo const& SafetensorsCheckpoint::info(std::string const& name) const { return file_of(name).info(name); }

std::vector<std::string> SafetensorsCheckpoint::opened_files() const {
  std::vector<std::string> f;
  for (auto const& kv : files_)
    if (kv.second) f.push_back(kv.first);
  return f;
}

std::vector<float> SafetensorsCheckpoint::read_f32(std::string const& name, std::vector<std::int64_t> const& shape) const {
  auto const& file = file_of(name);
  auto const& t = file.info(name);
  std::string const where = "safetensors file '" + t.file + "', tensor '" + name + "'";
  KOKKOSMOE_REQUIRE(t.shape == shape, where << ": shape " << shape_text(t.shape) << ", expected " << shape_text(shape));
  std::size_t const n = static_cast<std::size_t>(t.elements());
  std::vector<float> out(n);
  unsigned char const* p = file.data(t);
  if (n == 0) return out;  // an empty tensor has no bytes (data() may be null)
  if (t.dtype == "F32") {
    std::memcpy(out.data(), p, n * sizeof(float));
  } else if (t.dtype == "BF16") {
    for (std::size_t i = 0; i < n; ++i) {
      bf16_t b;
      std::memcpy(&b.bits, p + 2 * i, 2);
      out[i] = to_float(b);
    }
  } else if (t.dtype == "F16") {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      out[i] = half_to_float(h);
    }
  } else if (t.dtype == "F8_E4M3") {
    KOKKOSMOE_REQUIRE(shape.size() == 2, where << ": F8_E4M3 tensors are read as 2-D weights with block scales, this one is "
                                               << shape_text(shape));
    std::string const scale_name = name + "_scale_inv";
    KOKKOSMOE_REQUIRE(has(scale_name), where << ": F8_E4M3 without its block scales '" << scale_name << "'");
    std::int64_t const rows = shape[0], cols = shape[1];
    std::int64_t const br = (rows + 127) / 128, bc = (cols + 127) / 128;
    auto const scales = read_f32(scale_name, {br, bc});
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        fp8_e4m3_t v{p[r * cols + c]};
        out[static_cast<std::size_t>(r * cols + c)] = to_float(v) * scales[static_cast<std::size_t>((r / 128) * bc + c / 128)];
      }
  } else {
    KOKKOSMOE_THROW(where << ": dtype " << t.dtype << " cannot be read as weights (F32, BF16, F16 or F8_E4M3)");
  }
  for (std::size_t i = 0; i < n; ++i)
    KOKKOSMOE_REQUIRE(std::isfinite(out[i]), where << ": element " << i << " is not finite (" << out[i] << ")");
  return out;
}

void write_safetensors(std::string const& path, std::vector<TensorBytes> const& tensors, std::map<std::string, std::string> const& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t at = 0;
  for (auto const& t : tensors) {
    int const eb = dtype_bytes(t.dtype);
    KOKKOSMOE_REQUIRE(eb > 0, "write_safetensors '" << path << "': tensor '" << t.name << "' has unknown dtype '" << t.dtype << "'");
    std::int64_t n = 1;
    for (auto v : t.shape) n *= v;
    KOKKOSMOE_REQUIRE(static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(eb) == t.bytes.size(),
                      "write_safetensors '" << path << "': tensor '" << t.name << "' " << shape_text(t.shape) << " " << t.dtype << " needs "
                                            << n * eb << " bytes, got " << t.bytes.size());
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string header = h.dump();
  while (header.size() % 8 != 0) header += ' ';  // data 8-byte aligned, as the format's writers do
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KOKKOSMOE_REQUIRE(out.good(), "write_safetensors: cannot create '" << path << "': " << std::strerror(errno));
  std::uint64_t const n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xFFu);
  out.write(reinterpret_cast<char const*>(len), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (auto const& t : tensors) out.write(reinterpret_cast<char const*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  out.close();
  KOKKOSMOE_REQUIRE(out.good(), "write_safetensors: writing '" << path << "' failed");
}

std::string HFMoELayer::expert_gate(int e) const { return expert_prefix + std::to_string(e) + "." + gate_name; }
std::string HFMoELayer::expert_up(int e) const { return expert_prefix + std::to_string(e) + "." + up_name; }
std::string HFMoELayer::expert_down(int e) const { return expert_prefix + std::to_string(e) + "." + down_name; }

namespace {

struct ConfigReader {
  std::string path;
  json const& j;
  bool has(char const* key) const { return j.contains(key) && !j.at(key).is_null(); }
  long long integer(char const* key) const {
    KOKKOSMOE_REQUIRE(has(key), "config '" << path << "': key '" << key << "' is missing");
    KOKKOSMOE_REQUIRE(j.at(key).is_number_integer(), "config '" << path << "': key '" << key << "' is not an integer (" << j.at(key).dump() << ")");
    return j.at(key).get<long long>();
  }
  long long integer(char const* key, long long fallback) const { return has(key) ? integer(key) : fallback; }
  double real(char const* key, double fallback) const {
    if (!has(key)) return fallback;
    KOKKOSMOE_REQUIRE(j.at(key).is_number(), "config '" << path << "': key '" << key << "' is not a number (" << j.at(key).dump() << ")");
    return j.at(key).get<double>();
  }
  bool boolean(char const* key, bool fallback) const {
    if (!has(key)) return fallback;
    KOKKOSMOE_REQUIRE(j.at(key).is_boolean(), "config '" << path << "': key '" << key << "' is not a boolean (" << j.at(key).dump() << ")");
    return j.at(key).get<bool>();
  }
  std::string text(char const* key, std::string const& fallback) const {
    if (!has(key)) return fallback;
    KOKKOSMOE_REQUIRE(j.at(key).is_string(), "config '" << path << "': key '" << key << "' is not a string (" << j.at(key).dump() << ")");
    return j.at(key).get<std::string>();
  }
  int positive(char const* key) const {
    long long const v = integer(key);
    KOKKOSMOE_REQUIRE(v >= 1 && v <= (1 << 30), "config '" << path << "': key '" << key << "' = " << v << " is not a positive size");
    return static_cast<int>(v);
  }
};

}  // namespace

HFMoELayer hf_moe_layer(std::string const& config_path, int layer) {
  KOKKOSMOE_REQUIRE(exists(config_path), "checkpoint '" << config_path << "' does not exist");
  // A checkpoint directory, its config.json, or a safetensors / index file next to it.
  auto const ends_with = [&](std::string const& tail) {
    return config_path.size() >= tail.size() && config_path.compare(config_path.size() - tail.size(), tail.size(), tail) == 0;
  };
  std::string const path = is_directory(config_path) ? join(config_path, "config.json")
                           : ends_with("config.json") ? config_path
                                                      : join(parent_of(config_path), "config.json");
  json j;
  try {
    j = json::parse(read_text(path, "model config"));
  } catch (json::exception const& e) {
    KOKKOSMOE_THROW("config '" << path << "' is not JSON (" << e.what() << ")");
  }
  KOKKOSMOE_REQUIRE(j.is_object(), "config '" << path << "' is not a JSON object");
  ConfigReader r{path, j};
  HFMoELayer m;
  m.model_type = r.text("model_type", "");
  m.layer = layer;
  int const layers = r.positive("num_hidden_layers");
  KOKKOSMOE_REQUIRE(layer >= 0 && layer < layers, "config '" << path << "': layer " << layer << " is outside the model's " << layers
                                                             << " layers (num_hidden_layers)");
  m.hidden = r.positive("hidden_size");
  std::string const L = "model.layers." + std::to_string(layer) + ".";
  if (m.model_type == "deepseek_v2" || m.model_type == "deepseek_v3") {
    m.family = "deepseek";
    m.experts = r.positive("n_routed_experts");
    m.top_k = r.positive("num_experts_per_tok");
    m.ffn = r.positive("moe_intermediate_size");
    long long const first_dense = r.integer("first_k_dense_replace", 0);
    long long const freq = r.integer("moe_layer_freq", 1);
    KOKKOSMOE_REQUIRE(freq >= 1, "config '" << path << "': moe_layer_freq = " << freq << " must be >= 1");
    KOKKOSMOE_REQUIRE(layer >= first_dense && layer % freq == 0,
                      "config '" << path << "': layer " << layer << " is a dense layer (first_k_dense_replace = " << first_dense
                                 << ", moe_layer_freq = " << freq << "), not an MoE layer");
    int const shared = static_cast<int>(r.integer("n_shared_experts", 0));
    KOKKOSMOE_REQUIRE(shared >= 0, "config '" << path << "': n_shared_experts = " << shared << " is negative");
    m.shared_ffn = shared * m.ffn;
    m.score = r.text("scoring_func", "softmax");
    KOKKOSMOE_REQUIRE(m.score == "softmax" || m.score == "sigmoid", "config '" << path << "': scoring_func '" << m.score
                                                                                << "' is neither softmax nor sigmoid");
    m.normalize = r.boolean("norm_topk_prob", false);
    m.route_scale = r.real("routed_scaling_factor", 1.0);
    std::string const method = r.text("topk_method", m.model_type == "deepseek_v3" ? "noaux_tc" : "greedy");
    if (method == "group_limited_greedy" || method == "noaux_tc") {
      m.groups = r.positive("n_group");
      m.topk_groups = r.positive("topk_group");
      KOKKOSMOE_REQUIRE(m.experts % m.groups == 0 && m.topk_groups <= m.groups,
                        "config '" << path << "': n_group = " << m.groups << " must divide n_routed_experts = " << m.experts
                                   << " and be >= topk_group = " << m.topk_groups);
      m.group_score = method == "noaux_tc" ? "top2_sum" : "max";
      m.correction_bias = method == "noaux_tc";
    } else {
      KOKKOSMOE_REQUIRE(method == "greedy", "config '" << path << "': topk_method '" << method
                                                       << "' is not greedy, group_limited_greedy or noaux_tc");
    }
    m.router_weight = L + "mlp.gate.weight";
    if (m.correction_bias) m.router_bias = L + "mlp.gate.e_score_correction_bias";
    m.expert_prefix = L + "mlp.experts.";
    m.gate_name = "gate_proj.weight";
    m.up_name = "up_proj.weight";
    m.down_name = "down_proj.weight";
    if (m.shared_ffn > 0) {
      m.shared_gate = L + "mlp.shared_experts.gate_proj.weight";
      m.shared_up = L + "mlp.shared_experts.up_proj.weight";
      m.shared_down = L + "mlp.shared_experts.down_proj.weight";
    }
  } else if (m.model_type == "qwen3_moe") {
    m.family = "qwen3_moe";
    m.experts = r.positive("num_experts");
    m.top_k = r.positive("num_experts_per_tok");
    m.ffn = r.positive("moe_intermediate_size");
    long long const step = r.integer("decoder_sparse_step", 1);
    KOKKOSMOE_REQUIRE(step >= 1, "config '" << path << "': decoder_sparse_step = " << step << " must be >= 1");
    bool dense = (layer + 1) % step != 0;
    if (r.has("mlp_only_layers")) {
      KOKKOSMOE_REQUIRE(j.at("mlp_only_layers").is_array(), "config '" << path << "': key 'mlp_only_layers' is not an array");
      for (auto const& v : j.at("mlp_only_layers")) dense = dense || (v.is_number_integer() && v.get<int>() == layer);
    }
    KOKKOSMOE_REQUIRE(!dense, "config '" << path << "': layer " << layer << " is a dense layer (decoder_sparse_step = " << step
                                         << ", mlp_only_layers), not an MoE layer");
    m.score = "softmax";
    m.normalize = r.boolean("norm_topk_prob", false);
    m.router_weight = L + "mlp.gate.weight";
    m.expert_prefix = L + "mlp.experts.";
    m.gate_name = "gate_proj.weight";
    m.up_name = "up_proj.weight";
    m.down_name = "down_proj.weight";
  } else if (m.model_type == "mixtral") {
    m.family = "mixtral";
    m.experts = r.positive("num_local_experts");
    m.top_k = r.positive("num_experts_per_tok");
    m.ffn = r.positive("intermediate_size");
    m.score = "softmax";
    m.normalize = true;  // softmax over all experts, top-k, renormalized over the k
    m.router_weight = L + "block_sparse_moe.gate.weight";
    m.expert_prefix = L + "block_sparse_moe.experts.";
    m.gate_name = "w1.weight";
    m.up_name = "w3.weight";
    m.down_name = "w2.weight";
  } else {
    KOKKOSMOE_THROW("config '" << path << "': model_type '" << m.model_type
                               << "' is not a supported MoE family (deepseek_v2, deepseek_v3, qwen3_moe, mixtral)");
  }
  KOKKOSMOE_REQUIRE(m.top_k <= m.experts, "config '" << path << "': num_experts_per_tok = " << m.top_k << " exceeds the " << m.experts
                                                     << " experts");
  return m;
}

}  // namespace Checkpoint
}  // namespace KokkosMoE
