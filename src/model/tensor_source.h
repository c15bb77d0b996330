// Read-only view of the tensors of a model file (GGUF or safetensors), memory-mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"
#include "kvflow/tokenizer.h"

namespace kvflow {

// kQ2_K..kQ6_K are llama.cpp's K-quants: super-blocks of 256 elements (QK_K) with per-16 or per-32
// sub-block scales. kvflow dequantizes them to fp32 on load (no quantized kernels for them yet).
enum class DType { kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K };
const char* DTypeName(DType t);
// Storage is in blocks: 1 element for the float types, 32 for the ggml quantizations and 256 for
// the K-quants, whose blocks run along the innermost dimension (so it must be a multiple of that).
int64_t DTypeBlockElements(DType t);
size_t DTypeBlockBytes(DType t);

struct TensorInfo {
  std::string name;           // as stored in the file
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major, outermost first (HF order: [out_features, in_features])
  const uint8_t* data = nullptr;  // into the mapping; valid while the source lives
  size_t nbytes = 0;
  std::string file;           // file the tensor lives in (for error messages)

  int64_t numel() const;
};

// Dequantizes/converts any supported dtype to fp32. `out` holds info.numel() floats.
Status DequantizeToF32(const TensorInfo& info, float* out);

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual const TensorInfo* Find(const std::string& name) const = 0;  // nullptr if absent
  virtual std::vector<std::string> Names() const = 0;
  virtual std::string Describe() const = 0;  // "GGUF v3 file x.gguf, 272 tensors" etc.
};

// Everything a model directory or file offers.
struct ModelFiles {
  std::unique_ptr<TensorSource> tensors;
  ModelConfig config;
  // Filled for GGUF (from metadata) and for HF dirs that have tokenizer.json.
  std::unique_ptr<Tokenizer> tokenizer;
  bool gguf_rope_permuted = false;  // GGUF llama Q/K rows are in llama.cpp's interleaved order
  // A built-in random:<shape> model (model/random_shape_model.h): no host weights; the CUDA backend
  // generates them from `random_seed`.
  bool random_weights = false;
  uint64_t random_seed = 0;
};

// Logs "<what>: 40% (120 / 300 MB)" at every 10% of `total_bytes` when that exceeds 256 MB, so a
// slow first touch of a big mapping (dequantizing it, uploading it) visibly progresses.
class LoadProgress {
 public:
  LoadProgress(std::string what, uint64_t total_bytes);
  void Advance(uint64_t bytes);  // call after each tensor with its nbytes

 private:
  static constexpr uint64_t kLogThresholdBytes = 256ull << 20;
  std::string what_;
  uint64_t total_bytes_;
  uint64_t done_bytes_ = 0;
  int last_logged_decile_ = 0;
};

// `path` is a .gguf file, a .safetensors file, a `model.safetensors.index.json`, or a directory
// holding config.json plus one of those, or a built-in model's name (model/tiny_random.h).
// Progress is logged for big files.
Result<ModelFiles> OpenModelFiles(const std::string& path);

// The tokenizer alone, without reading weights: from a .gguf file (a vocabulary-only one is
// enough), a tokenizer.json, a directory holding one, or a built-in model's name. Unlike
// OpenModelFiles, a tokenizer kvflow cannot run is an error.
Result<std::unique_ptr<Tokenizer>> OpenTokenizer(const std::string& path);

}  // namespace kvflow
