// Safetensors checkpoints: F32 / BF16 / F16 / F8_E4M3 (128 x 128 block
// scales) read back as FP32, sharded checkpoints opening only the shards
// asked for, every way a file can be wrong named with its file and tensor,
// and config.json of DeepSeek-V3, DeepSeek-V2, Qwen3-MoE and Mixtral mapped
// to a layer.

#include "kmoe_catch.hpp"

#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Safetensors.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace KokkosMoE;
using namespace KokkosMoE::Checkpoint;

namespace {

std::string temp_dir(std::string const& tag) {
  std::string d = "kmoe_safetensors_" + tag + "_" + std::to_string(static_cast<long>(getpid()));
  ::mkdir(d.c_str(), 0755);
  return d;
}

template <class T>
std::vector<unsigned char> bytes_of(std::vector<T> const& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TensorBytes f32(std::string name, std::vector<std::int64_t> shape, std::vector<float> const& v) {
  return {std::move(name), "F32", std::move(shape), bytes_of(v)};
}

void write_text(std::string const& path, std::string const& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

/// A raw file: 8-byte length, header text, data bytes.
void write_raw(std::string const& path, std::uint64_t length, std::string const& header, std::size_t data_bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((length >> (8 * i)) & 0xFFu);
  out.write(reinterpret_cast<char const*>(len), 8);
  out << header;
  std::string zeros(data_bytes, '\0');
  out << zeros;
}

std::string error_of(std::function<void()> const& f) {
  try {
    f();
  } catch (Error const& e) {
    return e.what();
  }
  return "no error";
}

std::uint16_t to_half(float x) {
  // Exact for the values used (normal halves and zero).
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  std::uint32_t const sign = (u >> 16) & 0x8000u;
  if ((u & 0x7FFFFFFFu) == 0) return static_cast<std::uint16_t>(sign);
  int const e = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (static_cast<std::uint32_t>(e) << 10) | ((u >> 13) & 0x3FFu));
}

}  // namespace

TEST_CASE("safetensors: F32, BF16 and F16 tensors read back exactly as FP32", "[checkpoint][safetensors]") {
  auto const dir = temp_dir("dtypes");
  std::vector<float> const a = {1.0f, -2.5f, 0.15625f, 3.0e-5f, 65504.0f, -0.0f};
  std::vector<std::uint16_t> bf, hf;
  std::vector<float> hv = {1.0f, -2.5f, 0.15625f, 0.5f, 1024.0f, -0.0f};
  for (float x : a) bf.push_back(to_bf16(x).bits);
  for (float x : hv) hf.push_back(to_half(x));
  std::string const path = dir + "/model.safetensors";
  write_safetensors(path,
                    {f32("a", {2, 3}, a), {"b", "BF16", {3, 2}, bytes_of(bf)}, {"h", "F16", {6}, bytes_of(hf)}, {"empty", "F32", {0, 4}, {}}},
                    {{"format", "pt"}});
  SafetensorsCheckpoint ck(dir);
  CHECK(ck.has("a"));
  CHECK_FALSE(ck.has("z"));
  CHECK(ck.read_f32("a", {2, 3}) == a);
  auto const b = ck.read_f32("b", {3, 2});
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(b[i] == to_float(to_bf16(a[i])));
  CHECK(ck.read_f32("h", {6}) == hv);
  CHECK(ck.read_f32("empty", {0, 4}).empty());
  SafetensorsFile f(path);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.info("b").dtype == "BF16");
  CHECK(f.info("b").begin == 24);
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("safetensors: F8_E4M3 weights dequantized with 128 x 128 block scales", "[checkpoint][safetensors][fp8]") {
  auto const dir = temp_dir("fp8");
  int const rows = 130, cols = 200;  // a 2 x 2 grid of scale blocks, the last ones partial
  std::vector<std::uint8_t> q(static_cast<std::size_t>(rows * cols));
  std::vector<float> want(q.size());
  std::vector<float> const scales = {0.5f, 2.0f, 0.125f, 4.0f};
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      float const v = static_cast<float>(((r * 7 + c * 3) % 33) - 16) * 0.25f;  // exact in e4m3
      q[static_cast<std::size_t>(r * cols + c)] = to_fp8_e4m3(v).bits;
      want[static_cast<std::size_t>(r * cols + c)] = v * scales[static_cast<std::size_t>((r / 128) * 2 + c / 128)];
    }
  std::string const path = dir + "/w.safetensors";
  write_safetensors(path, {{"w.weight", "F8_E4M3", {rows, cols}, bytes_of(q)}, f32("w.weight_scale_inv", {2, 2}, scales),
                           {"v.weight", "F8_E4M3", {rows, cols}, bytes_of(q)}});
  SafetensorsCheckpoint ck(path);
  CHECK(ck.read_f32("w.weight", {rows, cols}) == want);
  auto const e = error_of([&] { ck.read_f32("v.weight", {rows, cols}); });
  CHECK_THAT(e, Catch::Matchers::Contains("tensor 'v.weight'") && Catch::Matchers::Contains("without its block scales 'v.weight_scale_inv'"));
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("safetensors: a sharded checkpoint opens only the shards of the tensors read", "[checkpoint][safetensors]") {
  auto const dir = temp_dir("sharded");
  write_safetensors(dir + "/model-00001-of-00002.safetensors", {f32("x", {2}, {1, 2}), f32("y", {1}, {3})});
  write_safetensors(dir + "/model-00002-of-00002.safetensors", {f32("z", {3}, {4, 5, 6})});
  write_text(dir + "/model.safetensors.index.json",
             R"({"metadata": {"total_size": 24}, "weight_map": {"x": "model-00001-of-00002.safetensors",
                 "y": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors",
                 "gone": "model-00002-of-00002.safetensors"}})");
  SafetensorsCheckpoint ck(dir);
  CHECK(ck.opened_files().empty());
  CHECK(ck.read_f32("z", {3}) == std::vector<float>{4, 5, 6});
  REQUIRE(ck.opened_files().size() == 1);
  CHECK(ck.opened_files()[0].find("00002-of-00002") != std::string::npos);
  CHECK(ck.read_f32("x", {2}) == std::vector<float>{1, 2});
  CHECK(ck.opened_files().size() == 2);
  CHECK_THAT(error_of([&] { ck.read_f32("w", {1}); }), Catch::Matchers::Contains("no tensor 'w' in the index's weight_map"));
  CHECK_THAT(error_of([&] { ck.read_f32("gone", {1}); }),
             Catch::Matchers::Contains("puts tensor 'gone' in") && Catch::Matchers::Contains("which does not hold it"));
  CHECK_THAT(error_of([&] { ck.read_f32("x", {3}); }),
             Catch::Matchers::Contains("tensor 'x'") && Catch::Matchers::Contains("shape [2], expected [3]"));
  for (auto f : {"/model-00001-of-00002.safetensors", "/model-00002-of-00002.safetensors", "/model.safetensors.index.json"})
    std::remove((dir + f).c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("safetensors: bad files are refused naming the file and the tensor", "[checkpoint][safetensors][errors]") {
  auto const dir = temp_dir("bad");
  std::string const p = dir + "/bad.safetensors";
  auto err = [&] { return error_of([&] { SafetensorsFile f(p); }); };
  write_raw(p, 4096, "{}", 0);
  CHECK_THAT(err(), Catch::Matchers::Contains("bad.safetensors") && Catch::Matchers::Contains("header length 4096 runs past the file"));
  std::string h = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  write_raw(p, h.size(), h, 12);
  CHECK_THAT(err(), Catch::Matchers::Contains("tensors 'a' [0, 8) and 'b' [4, 12) overlap"));
  h = R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})";
  write_raw(p, h.size(), h, 8);
  CHECK_THAT(err(), Catch::Matchers::Contains("tensor 'a'") && Catch::Matchers::Contains("lie outside the 8 data bytes"));
  h = R"({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})";
  write_raw(p, h.size(), h, 8);
  CHECK_THAT(err(), Catch::Matchers::Contains("tensor 'a'") && Catch::Matchers::Contains("BF16 [3] needs 6 bytes, data_offsets give 8"));
  h = R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}})";
  write_raw(p, h.size(), h, 2);
  CHECK_THAT(err(), Catch::Matchers::Contains("unknown dtype 'Q4'"));
  h = R"({"a": {"dtype": "F32", "shape": [2]}})";
  write_raw(p, h.size(), h, 0);
  CHECK_THAT(err(), Catch::Matchers::Contains("tensor 'a'") && Catch::Matchers::Contains("needs dtype, shape and data_offsets"));
  h = R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}})";
  write_raw(p, h.size(), h, 0);
  CHECK_THAT(err(), Catch::Matchers::Contains("not a non-negative integer"));
  write_raw(p, 5, "{nope", 0);
  CHECK_THAT(err(), Catch::Matchers::Contains("header is not JSON"));
  write_text(p, "abc");
  CHECK_THAT(err(), Catch::Matchers::Contains("fewer than its 8-byte header length"));
  CHECK_THAT(error_of([&] { SafetensorsFile f(dir + "/missing.safetensors"); }),
             Catch::Matchers::Contains("missing.safetensors' cannot be opened"));
  // Non-finite values, found when read.
  write_safetensors(p, {f32("n", {3}, {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f})});
  SafetensorsCheckpoint ck(p);
  CHECK_THAT(error_of([&] { ck.read_f32("n", {3}); }), Catch::Matchers::Contains("tensor 'n'") && Catch::Matchers::Contains("element 1 is not finite"));
  CHECK_THAT(error_of([&] { ck.read_f32("m", {3}); }), Catch::Matchers::Contains("has no tensor 'm'"));
  CHECK_THAT(error_of([&] { SafetensorsCheckpoint c(dir); }), Catch::Matchers::Contains("holds neither model.safetensors"));
  std::remove(p.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("config.json: DeepSeek-V3, DeepSeek-V2, Qwen3-MoE and Mixtral MoE layers", "[checkpoint][config]") {
  auto const dir = temp_dir("config");
  std::string const c = dir + "/config.json";
  write_text(c, R"({"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 64, "n_routed_experts": 16,
    "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc"})");
  auto m = hf_moe_layer(dir, 2);
  CHECK(m.family == "deepseek");
  CHECK(m.hidden == 64);
  CHECK(m.experts == 16);
  CHECK(m.top_k == 4);
  CHECK(m.ffn == 32);
  CHECK(m.shared_ffn == 64);
  CHECK(m.score == "sigmoid");
  CHECK(m.normalize);
  CHECK(m.route_scale == 2.5);
  CHECK(m.groups == 4);
  CHECK(m.topk_groups == 2);
  CHECK(m.group_score == "top2_sum");
  CHECK(m.correction_bias);
  CHECK(m.router_weight == "model.layers.2.mlp.gate.weight");
  CHECK(m.router_bias == "model.layers.2.mlp.gate.e_score_correction_bias");
  CHECK(m.expert_up(7) == "model.layers.2.mlp.experts.7.up_proj.weight");
  CHECK(m.shared_down == "model.layers.2.mlp.shared_experts.down_proj.weight");
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 0); }), Catch::Matchers::Contains("layer 0 is a dense layer (first_k_dense_replace = 1"));
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 4); }), Catch::Matchers::Contains("layer 4 is outside the model's 4 layers"));

  write_text(c, R"({"model_type": "deepseek_v2", "num_hidden_layers": 2, "hidden_size": 64, "n_routed_experts": 16,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 1, "scoring_func": "softmax",
    "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.0})");
  m = hf_moe_layer(c, 1);
  CHECK(m.score == "softmax");
  CHECK_FALSE(m.normalize);
  CHECK(m.group_score == "max");
  CHECK_FALSE(m.correction_bias);
  CHECK(m.shared_ffn == 0);

  write_text(c, R"({"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 48, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [3]})");
  m = hf_moe_layer(c, 1);
  CHECK(m.family == "qwen3_moe");
  CHECK(m.experts == 8);
  CHECK(m.normalize);
  CHECK(m.groups == 1);
  CHECK(m.expert_gate(3) == "model.layers.1.mlp.experts.3.gate_proj.weight");
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 3); }), Catch::Matchers::Contains("layer 3 is a dense layer"));

  write_text(c, R"({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 32, "num_local_experts": 8,
    "num_experts_per_tok": 2, "intermediate_size": 56})");
  m = hf_moe_layer(c, 0);
  CHECK(m.family == "mixtral");
  CHECK(m.ffn == 56);
  CHECK(m.normalize);
  CHECK(m.router_weight == "model.layers.0.block_sparse_moe.gate.weight");
  CHECK(m.expert_gate(5) == "model.layers.0.block_sparse_moe.experts.5.w1.weight");
  CHECK(m.expert_up(5) == "model.layers.0.block_sparse_moe.experts.5.w3.weight");
  CHECK(m.expert_down(5) == "model.layers.0.block_sparse_moe.experts.5.w2.weight");

  write_text(c, R"({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32})");
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 0); }), Catch::Matchers::Contains("model_type 'llama' is not a supported MoE family"));
  write_text(c, R"({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": "wide"})");
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 0); }), Catch::Matchers::Contains("key 'hidden_size' is not an integer"));
  write_text(c, R"({"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 32, "num_experts_per_tok": 2, "intermediate_size": 56})");
  CHECK_THAT(error_of([&] { hf_moe_layer(c, 0); }), Catch::Matchers::Contains("key 'num_local_experts' is missing"));
  std::remove(c.c_str());
  ::rmdir(dir.c_str());
}
