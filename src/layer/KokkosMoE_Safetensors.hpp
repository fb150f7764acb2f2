#ifndef KOKKOSMOE_SAFETENSORS_HPP
#define KOKKOSMOE_SAFETENSORS_HPP

/// \file KokkosMoE_Safetensors.hpp
/// \brief Reading Hugging Face checkpoints: safetensors files (single or
/// sharded through model.safetensors.index.json) and the MoE layer of a
/// model's config.json (DeepSeek-V2/V3, Qwen3-MoE, Mixtral).
///
/// A safetensors file is an 8-byte little-endian header length N, N bytes
/// of JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
/// optional "__metadata__"}), then the data; offsets are relative to the
/// data's start. Files are memory-mapped: only the tensors read are paged
/// in, so a rank that reads its own experts reads only their bytes. Every
/// problem (header length past the file, bad JSON, offsets outside the data
/// or overlapping, a size that does not match dtype x shape, a missing
/// tensor or scale, a shape other than expected, non-finite values) is an
/// Error naming the file and the tensor.
///
/// Tensors are read as FP32, row-major: F32, BF16 and F16 convert exactly;
/// F8_E4M3 weights are dequantized with their `<name>_scale_inv` block
/// scales (FP32, one per 128 x 128 block of a 2-D weight: a grid of
/// ceil(rows / 128) x ceil(cols / 128)), value = fp8 * scale.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace KokkosMoE {
namespace Checkpoint {

/// \brief Where one tensor's bytes are.
struct TensorInfo {
  std::string name;
  std::string file;    ///< path of the safetensors file holding it
  std::string dtype;   ///< safetensors dtype name (F32, BF16, F16, F8_E4M3, ...)
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  ///< byte range in the file's data section
  std::int64_t elements() const;
};

/// \brief Bytes per element of a safetensors dtype name; 0 for a name this
/// reader does not know.
int dtype_bytes(std::string const& dtype);

/// \brief One memory-mapped safetensors file, its header checked.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile const&) = delete;
  SafetensorsFile& operator=(SafetensorsFile const&) = delete;

  std::string const& path() const { return path_; }
  bool has(std::string const& name) const { return tensors_.count(name) != 0; }
  /// Throws Error naming the file and the tensor when it is absent.
  TensorInfo const& info(std::string const& name) const;
  std::vector<std::string> names() const;
  std::map<std::string, std::string> const& metadata() const { return metadata_; }
  /// The first byte of a tensor of this file.
  unsigned char const* data(TensorInfo const& t) const { return data_ + t.begin; }

 private:
  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  unsigned char const* data_ = nullptr;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// \brief A checkpoint: one .safetensors file, a directory holding
/// model.safetensors, or a sharded one (model.safetensors.index.json and
/// its weight_map, given as the index file or its directory). Shards are
/// opened when a tensor of theirs is first asked for.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(std::string path);
  ~SafetensorsCheckpoint();
  SafetensorsCheckpoint(SafetensorsCheckpoint const&) = delete;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint const&) = delete;

  std::string const& path() const { return path_; }
  /// The directory of the checkpoint (where config.json is).
  std::string const& directory() const { return dir_; }
  bool has(std::string const& name) const;
  TensorInfo const& info(std::string const& name) const;
  /// Files opened so far (a rank reading only its experts opens only the
  /// shards that hold them).
  std::vector<std::string> opened_files() const;
  /// The tensor as FP32, row-major, after checking its shape against
  /// `shape`; F8_E4M3 tensors dequantized with `<name>_scale_inv`.
  /// Non-finite values fail, naming the first one's index.
  std::vector<float> read_f32(std::string const& name, std::vector<std::int64_t> const& shape) const;

 private:
  SafetensorsFile const& file_of(std::string const& name) const;
  std::string path_, dir_;
  std::map<std::string, std::string> weight_map_;  ///< tensor -> shard file (sharded checkpoints)
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

/// \brief Writes a safetensors file (tensors in the order given, F32, BF16,
/// F16 or F8_E4M3 bytes as they are): for tests, tools and checkpoints of
/// trained layers.
struct TensorBytes {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;
};
void write_safetensors(std::string const& path, std::vector<TensorBytes> const& tensors,
                       std::map<std::string, std::string> const& metadata = {});

/// \brief The MoE layer `layer` of a Hugging Face model, from its
/// config.json: sizes, routing, and the names of its tensors.
struct HFMoELayer {
  std::string family;  ///< "deepseek" (DeepSeek-V2/V3), "qwen3_moe", "mixtral"
  std::string model_type;
  int layer = 0;
  int hidden = 0, experts = 0, top_k = 0, ffn = 0;
  int shared_ffn = 0;  ///< width of the shared experts' one MLP (0: none)
  std::string score;   ///< "softmax" or "sigmoid"
  bool normalize = false;
  double route_scale = 1.0;
  int groups = 1, topk_groups = 1;  ///< group-limited routing (groups > topk_groups)
  std::string group_score;          ///< "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3); "" without groups
  bool correction_bias = false;     ///< e_score_correction_bias (DeepSeek-V3 noaux_tc)
  // Tensor names.
  std::string router_weight, router_bias;
  std::string expert_gate(int e) const;
  std::string expert_up(int e) const;
  std::string expert_down(int e) const;
  std::string shared_gate, shared_up, shared_down;
  std::string expert_prefix, gate_name, up_name, down_name;
};

/// \brief Reads config.json (the file, the directory holding it, or a
/// safetensors or index file next to it) and
/// maps its MoE layer `layer`; throws Error naming the file and key when a
/// key is missing or has the wrong type, the model type is not one of the
/// families above, or the layer is out of range or dense.
HFMoELayer hf_moe_layer(std::string const& config_path, int layer);

}  // namespace Checkpoint
}  // namespace KokkosMoE

#endif
