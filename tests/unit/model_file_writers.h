// Test helpers that write small GGUF and safetensors files, and ggml reference quantizers.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kvflow/status.h"
#include "model/byte_level.h"

namespace kvflow::test {

// ---- bytes and numbers ------------------------------------------------------------------------

using Bytes = std::vector<uint8_t>;

template <typename T>
void Append(Bytes* out, const T& value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out->insert(out->end(), p, p + sizeof(T));
}

template <typename T>
Bytes ToBytes(const std::vector<T>& values) {
  Bytes out(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// The compiler's own _Float16 conversions, independent of the code under test.
inline uint16_t FloatToHalfBits(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}
inline float HalfBitsToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(bits));
  return static_cast<float>(h);
}
inline uint16_t FloatToBf16Bits(float f) {  // round to nearest even; inputs are finite
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}
inline float Bf16BitsToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// Uniform in ±[0.05, scale]: random and never zero, so a forgotten write cannot pass.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 2.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.05f, scale);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = negative(rng) ? -magnitude(rng) : magnitude(rng);
  return v;
}

// ---- ggml reference quantizers (ggml-quants.c, quantize_row_*_ref) -----------------------------

inline Bytes QuantizeQ8_0(const std::vector<float>& x) {
  Bytes out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[b * 32];
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    Append(&out, FloatToHalfBits(d));
    for (int j = 0; j < 32; ++j) Append(&out, static_cast<int8_t>(std::lround(v[j] * id)));
  }
  return out;
}

inline Bytes QuantizeQ4_0(const std::vector<float>& x) {
  Bytes out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[b * 32];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(v[j]) > amax) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    Append(&out, FloatToHalfBits(d));
    for (int j = 0; j < 16; ++j) {
      uint8_t lo = std::min<uint8_t>(15, static_cast<int8_t>(v[j] * id + 8.5f));
      uint8_t hi = std::min<uint8_t>(15, static_cast<int8_t>(v[j + 16] * id + 8.5f));
      Append(&out, static_cast<uint8_t>(lo | (hi << 4)));
    }
  }
  return out;
}

inline Bytes QuantizeQ4_1(const std::vector<float>& x) {
  Bytes out;
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const float* v = &x[b * 32];
    float min = v[0], max = v[0];
    for (int j = 1; j < 32; ++j) {
      min = std::min(min, v[j]);
      max = std::max(max, v[j]);
    }
    const float d = (max - min) / 15;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    Append(&out, FloatToHalfBits(d));
    Append(&out, FloatToHalfBits(min));
    for (int j = 0; j < 16; ++j) {
      uint8_t lo = std::min<uint8_t>(15, static_cast<int8_t>((v[j] - min) * id + 0.5f));
      uint8_t hi = std::min<uint8_t>(15, static_cast<int8_t>((v[j + 16] - min) * id + 0.5f));
      Append(&out, static_cast<uint8_t>(lo | (hi << 4)));
    }
  }
  return out;
}

// ---- K-quants (super-blocks of 256) ------------------------------------------------------------

inline constexpr int kQK_K = 256;
inline constexpr size_t kQ2_KBytes = 84, kQ3_KBytes = 110, kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;

// Byte offsets of the f16 super-block scales (d, and dmin where the type has one) in each block.
struct KQuantLayout {
  size_t block_bytes;
  std::vector<size_t> f16_fields;
};
inline KQuantLayout KQuantLayoutOf(uint32_t ggml_type) {
  switch (ggml_type) {
    case 10: return {kQ2_KBytes, {80, 82}};
    case 11: return {kQ3_KBytes, {108}};
    case 12: return {kQ4_KBytes, {0, 2}};
    case 13: return {kQ5_KBytes, {0, 2}};
    case 14: return {kQ6_KBytes, {208}};
  }
  ADD_FAILURE() << "not a K-quant ggml type: " << ggml_type;
  return {0, {}};
}

// `blocks` random K-quant blocks: random quants and sub-block scales, finite f16 super-block scales
// (what a real file holds: NaN or infinite scales would make every comparison meaningless).
inline Bytes RandomKQuantBlocks(uint32_t ggml_type, size_t blocks, uint32_t seed) {
  const KQuantLayout layout = KQuantLayoutOf(ggml_type);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  Bytes out(blocks * layout.block_bytes);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t field : layout.f16_fields) {
      const uint16_t bits = FloatToHalfBits(scale(rng));
      std::memcpy(&out[b * layout.block_bytes + field], &bits, 2);
    }
  }
  return out;
}

// ggml's 12-byte packing of eight 6-bit (scale, min) pairs (Q4_K, Q5_K), written from the layout
// rather than from ggml's code: the low 6 bits of scales/mins 0..3 in bytes 0..3/4..7; the low 4 bits
// of scales/mins 4..7 in the nibbles of bytes 8..11, their top 2 bits in the top of bytes 0..7.
inline void PackScaleMin6(const int scale[8], const int min[8], uint8_t packed[12]) {
  std::memset(packed, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      packed[j] |= static_cast<uint8_t>(scale[j]);
      packed[j + 4] |= static_cast<uint8_t>(min[j]);
    } else {
      packed[j + 4] = static_cast<uint8_t>((scale[j] & 0x0f) | ((min[j] & 0x0f) << 4));
      packed[j - 4] |= static_cast<uint8_t>((scale[j] >> 4) << 6);
      packed[j] |= static_cast<uint8_t>((min[j] >> 4) << 6);
    }
  }
}

// A simple Q4_K (levels 15) or Q5_K (levels 31) quantizer: per 32-element sub-block an affine map
// from its range (which always includes 0), 6-bit sub-scales relative to the largest. Less careful
// than llama.cpp's search, which does not matter to the tests: they compare against what the blocks
// dequantize to.
inline Bytes QuantizeQ4_KOrQ5_K(const std::vector<float>& x, bool five_bits) {
  const int levels = five_bits ? 31 : 15;
  Bytes out;
  for (size_t b = 0; b < x.size() / kQK_K; ++b) {
    const float* v = &x[b * kQK_K];
    float sub_scale[8], sub_min[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      float lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo = std::min(lo, v[32 * j + l]);
        hi = std::max(hi, v[32 * j + l]);
      }
      sub_scale[j] = (hi - lo) / levels;
      sub_min[j] = -lo;
      max_scale = std::max(max_scale, sub_scale[j]);
      max_min = std::max(max_min, sub_min[j]);
    }
    const uint16_t d_bits = FloatToHalfBits(max_scale / 63), dmin_bits = FloatToHalfBits(max_min / 63);
    const float d = HalfBitsToFloat(d_bits), dmin = HalfBitsToFloat(dmin_bits);
    int scale[8], min[8];
    uint8_t q[kQK_K];
    for (int j = 0; j < 8; ++j) {
      // Round the scale up so the sub-block's range still fits in `levels` steps.
      scale[j] = d > 0 ? std::min(63, static_cast<int>(std::ceil(sub_scale[j] / d))) : 0;
      min[j] = dmin > 0 ? std::min(63, static_cast<int>(std::lround(sub_min[j] / dmin))) : 0;
      const float dl = d * scale[j], ml = dmin * min[j];
      for (int l = 0; l < 32; ++l) {
        const long level = dl > 0 ? std::lround((v[32 * j + l] + ml) / dl) : 0;
        q[32 * j + l] = static_cast<uint8_t>(std::clamp<long>(level, 0, levels));
      }
    }
    uint8_t packed[12];
    PackScaleMin6(scale, min, packed);
    Append(&out, d_bits);
    Append(&out, dmin_bits);
    out.insert(out.end(), packed, packed + 12);
    if (five_bits) {  // qh[l]: bit j is the 16s bit of element 32j + l
      for (int l = 0; l < 32; ++l) {
        uint8_t bits = 0;
        for (int j = 0; j < 8; ++j) bits |= static_cast<uint8_t>(((q[32 * j + l] >> 4) & 1) << j);
        out.push_back(bits);
      }
    }
    for (int c = 0; c < 4; ++c) {  // nibble t of byte 32c + l holds element 64c + 32t + l
      for (int l = 0; l < 32; ++l) {
        out.push_back(static_cast<uint8_t>((q[64 * c + l] & 0x0f) | ((q[64 * c + 32 + l] & 0x0f) << 4)));
      }
    }
  }
  return out;
}
inline Bytes QuantizeQ4_K(const std::vector<float>& x) { return QuantizeQ4_KOrQ5_K(x, false); }
inline Bytes QuantizeQ5_K(const std::vector<float>& x) { return QuantizeQ4_KOrQ5_K(x, true); }

// A simple Q6_K quantizer: per 16-element sub-block a symmetric scale (levels -31..31), 8-bit signed
// sub-scales relative to the largest.
inline Bytes QuantizeQ6_K(const std::vector<float>& x) {
  Bytes out;
  for (size_t b = 0; b < x.size() / kQK_K; ++b) {
    const float* v = &x[b * kQK_K];
    float sub_scale[16], max_scale = 0;
    for (int j = 0; j < 16; ++j) {
      float amax = 0;
      for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(v[16 * j + l]));
      sub_scale[j] = amax / 31;
      max_scale = std::max(max_scale, sub_scale[j]);
    }
    const uint16_t d_bits = FloatToHalfBits(max_scale / 127);
    const float d = HalfBitsToFloat(d_bits);
    int8_t scale[16];
    uint8_t q[kQK_K];  // biased by 32
    for (int j = 0; j < 16; ++j) {
      scale[j] = static_cast<int8_t>(d > 0 ? std::min(127, static_cast<int>(std::ceil(sub_scale[j] / d))) : 0);
      const float dl = d * scale[j];
      for (int l = 0; l < 16; ++l) {
        const long level = dl > 0 ? std::lround(v[16 * j + l] / dl) : 0;
        q[16 * j + l] = static_cast<uint8_t>(std::clamp<long>(level, -32, 31) + 32);
      }
    }
    // Element 128h + 32k + l: low nibble in nibble k/2 of ql[64h + 32(k%2) + l], top 2 bits at
    // bits 2k of qh[32h + l].
    uint8_t ql[128] = {}, qh[64] = {};
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t level = q[128 * h + 32 * k + l];
          ql[64 * h + 32 * (k % 2) + l] |= static_cast<uint8_t>((level & 0x0f) << (4 * (k / 2)));
          qh[32 * h + l] |= static_cast<uint8_t>((level >> 4) << (2 * k));
        }
      }
    }
    out.insert(out.end(), ql, ql + 128);
    out.insert(out.end(), qh, qh + 64);
    for (int8_t s : scale) Append(&out, s);
    Append(&out, d_bits);
  }
  return out;
}

// ---- files ------------------------------------------------------------------------------------

inline void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}
inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Opening `path` with `open` (returning a Result) must fail with `code` and a message that names
// the file; returns the message.
template <typename OpenFn>
std::string ExpectOpenFailure(const std::string& path, StatusCode code, OpenFn open) {
  auto opened = open(path);
  if (opened.ok()) {
    ADD_FAILURE() << "opened a broken file";
    return "";
  }
  EXPECT_EQ(opened.status().code(), code) << opened.status().ToString();
  EXPECT_NE(opened.status().message().find(path), std::string::npos) << opened.status().ToString();
  return opened.status().message();
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("kvflow_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// ---- GGUF -------------------------------------------------------------------------------------

// ggml type ids used by the tests.
enum GgmlTypeId : uint32_t {
  kGgmlF32 = 0,
  kGgmlF16 = 1,
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ8_0 = 8,
  kGgmlQ2_K = 10,
  kGgmlQ3_K = 11,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
  kGgmlQ8_K = 15,  // not supported: only an activation format in ggml
  kGgmlIQ4_XS = 23,
  kGgmlBF16 = 30
};

// Value type ids of the GGUF spec.
enum GgufTypeId : uint32_t {
  kU8 = 0,
  kI8,
  kU16,
  kI16,
  kU32,
  kI32,
  kF32,
  kBool,
  kString,
  kArray,
  kU64,
  kI64,
  kF64
};

class GgufWriter {
 public:
  // Payload encoders, also usable to build nested arrays by hand.
  static Bytes Str(const std::string& s) {
    Bytes out;
    Append(&out, static_cast<uint64_t>(s.size()));
    out.insert(out.end(), s.begin(), s.end());
    return out;
  }
  template <typename T>
  static Bytes ArrayOf(uint32_t element_type, const std::vector<T>& values) {
    Bytes out;
    Append(&out, element_type);
    Append(&out, static_cast<uint64_t>(values.size()));
    for (const T& v : values) Append(&out, v);
    return out;
  }
  static Bytes StrArray(const std::vector<std::string>& values) {
    Bytes out;
    Append(&out, static_cast<uint32_t>(kString));
    Append(&out, static_cast<uint64_t>(values.size()));
    for (const std::string& s : values) {
      Bytes one = Str(s);
      out.insert(out.end(), one.begin(), one.end());
    }
    return out;
  }

  // `payload` is the encoded value without its type id.
  void AddRaw(const std::string& key, uint32_t type, Bytes payload) {
    kvs_.push_back({key, type, std::move(payload)});
  }
  template <typename T>
  void Add(const std::string& key, uint32_t type, T value) {
    Bytes payload;
    Append(&payload, value);
    AddRaw(key, type, std::move(payload));
  }
  void AddString(const std::string& key, const std::string& value) {
    AddRaw(key, kString, Str(value));
  }
  void AddStringArray(const std::string& key, const std::vector<std::string>& values) {
    AddRaw(key, kArray, StrArray(values));
  }
  // Declares `alignment` and lays the data out by it (0, which no reader accepts, keeps 32).
  void SetAlignment(uint32_t alignment) {
    if (alignment != 0) alignment_ = alignment;
    Add("general.alignment", kU32, alignment);
  }

  // `shape` is row-major, outermost first, as TensorInfo reports it. `offset` overrides the
  // recorded data offset (the data is still laid out in order) to fake broken files.
  void AddTensor(const std::string& name, uint32_t ggml_type, std::vector<int64_t> shape,
                 Bytes data, std::optional<uint64_t> offset = std::nullopt) {
    tensors_.push_back({name, ggml_type, std::move(shape), std::move(data), offset});
  }

  Bytes Build(uint32_t version = 3) const {
    Bytes out;
    Append(&out, static_cast<uint32_t>(0x46554747));
    Append(&out, version);
    Append(&out, static_cast<uint64_t>(tensors_.size()));
    Append(&out, static_cast<uint64_t>(kvs_.size()));
    for (const Kv& kv : kvs_) {
      Bytes key = Str(kv.key);
      out.insert(out.end(), key.begin(), key.end());
      Append(&out, kv.type);
      out.insert(out.end(), kv.payload.begin(), kv.payload.end());
    }
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const Tensor& t : tensors_) {
      offsets.push_back(offset);
      offset = AlignUp(offset + t.data.size());
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      Bytes name = Str(t.name);
      out.insert(out.end(), name.begin(), name.end());
      Append(&out, static_cast<uint32_t>(t.shape.size()));
      for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) {
        Append(&out, static_cast<uint64_t>(*it));
      }
      Append(&out, t.type);
      Append(&out, t.offset.value_or(offsets[i]));
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(AlignUp(out.size()), 0);
      out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    }
    return out;
  }

 private:
  struct Kv {
    std::string key;
    uint32_t type;
    Bytes payload;
  };
  struct Tensor {
    std::string name;
    uint32_t type;
    std::vector<int64_t> shape;
    Bytes data;
    std::optional<uint64_t> offset;
  };
  uint64_t AlignUp(uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  uint32_t alignment_ = 32;
  std::vector<Kv> kvs_;
  std::vector<Tensor> tensors_;
};

// ---- safetensors ------------------------------------------------------------------------------

class SafetensorsWriter {
 public:
  void AddTensor(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                 Bytes data) {
    header_[name] = {{"dtype", dtype},
                     {"shape", shape},
                     {"data_offsets", {data_.size(), data_.size() + data.size()}}};
    data_.insert(data_.end(), data.begin(), data.end());
  }
  void SetMetadata(const std::string& key, const std::string& value) {
    header_["__metadata__"][key] = value;
  }

  // The header to tamper with before BuildWith().
  nlohmann::json& header() { return header_; }
  Bytes Build() const { return BuildWith(header_.dump()); }
  Bytes BuildWith(const std::string& header_text) const {
    Bytes out;
    Append(&out, static_cast<uint64_t>(header_text.size()));
    out.insert(out.end(), header_text.begin(), header_text.end());
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

 private:
  nlohmann::json header_ = nlohmann::json::object();
  Bytes data_;
};

// A GGUF writer holding a small Llama's metadata and a byte-level tokenizer (256 byte tokens, then
// <|endoftext|> <|im_start|> <|im_end|>; BOS = EOS = 256), so the engine can run the file once the
// caller adds tensors.
inline GgufWriter TinyLlamaGgufMetadata(const std::string& name, int layers, int hidden, int ffn, int heads,
                                        int kv_heads, float rope_theta = 10000.0f, float rms_norm_eps = 1e-5f) {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("general.name", name);
  w.Add("llama.block_count", kU32, static_cast<uint32_t>(layers));
  w.Add("llama.context_length", kU32, uint32_t{256});
  w.Add("llama.embedding_length", kU32, static_cast<uint32_t>(hidden));
  w.Add("llama.feed_forward_length", kU32, static_cast<uint32_t>(ffn));
  w.Add("llama.attention.head_count", kU32, static_cast<uint32_t>(heads));
  w.Add("llama.attention.head_count_kv", kU32, static_cast<uint32_t>(kv_heads));
  w.Add("llama.rope.freq_base", kF32, rope_theta);
  w.Add("llama.attention.layer_norm_rms_epsilon", kF32, rms_norm_eps);
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteLevelSpelling(static_cast<uint8_t>(b)));
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) tokens.push_back(special);
  std::vector<int32_t> types(256, 1);
  types.insert(types.end(), 3, 3);
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "gpt2");
  w.AddStringArray("tokenizer.ggml.tokens", tokens);
  w.AddRaw("tokenizer.ggml.token_type", kArray, GgufWriter::ArrayOf<int32_t>(kI32, types));
  w.Add("tokenizer.ggml.bos_token_id", kU32, uint32_t{256});
  w.Add("tokenizer.ggml.eos_token_id", kU32, uint32_t{256});
  return w;
}

}  // namespace kvflow::test
