// Conversion of every stored dtype to fp32, following ggml's block layouts.
#include <cstring>
#include <functional>
#include <string>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "model/tensor_source.h"
#include "util/thread_pool.h"

namespace kvflow {

namespace {

constexpr int64_t kQuantBlock = 32;
// Below this many blocks/elements threads cost more than they save.
constexpr int64_t kParallelThreshold = 1 << 14;

// IEEE half -> float, including subnormals, infinities and NaN.
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction where the build targets x86-64-v3
#else
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal: value = mantissa * 2^-24, exact in float.
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Parallel on the current thread pool when there is one (util/thread_pool.h), else serial; below
// this many elements threads cost more than they save.
void ForChunks(int64_t n, int64_t elements_per_item, const std::function<void(int64_t, int64_t)>& fn) {
  ParallelFor(n, fn, 0, n * elements_per_item > kParallelThreshold ? 2 : n + 1);
}

void ConvertF16(const uint8_t* src, int64_t n, float* out) {
  ForChunks(n, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) out[i] = HalfToFloat(LoadU16(src + 2 * i));
  });
}

void ConvertBF16(const uint8_t* src, int64_t n, float* out) {
  ForChunks(n, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      uint32_t bits = static_cast<uint32_t>(LoadU16(src + 2 * i)) << 16;
      std::memcpy(&out[i], &bits, sizeof(float));
    }
  });
}

// block_q8_0 {f16 d; int8 qs[32]}: x = q * d.
void DequantQ8_0(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kQuantBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * 34;
      const float d = HalfToFloat(LoadU16(block));
      const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
      float* y = out + b * kQuantBlock;
      for (int j = 0; j < kQuantBlock; ++j) y[j] = qs[j] * d;
    }
  });
}

// block_q4_0 {f16 d; uint8 qs[16]}: low nibbles are elements 0..15, high nibbles 16..31;
// x = (nibble - 8) * d.
void DequantQ4_0(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kQuantBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * 18;
      const float d = HalfToFloat(LoadU16(block));
      const uint8_t* qs = block + 2;
      float* y = out + b * kQuantBlock;
      for (int j = 0; j < 16; ++j) {
        y[j] = (static_cast<int>(qs[j] & 0x0f) - 8) * d;
        y[j + 16] = (static_cast<int>(qs[j] >> 4) - 8) * d;
      }
    }
  });
}

// block_q4_1 {f16 d; f16 m; uint8 qs[16]}: same nibble order; x = nibble * d + m.
void DequantQ4_1(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kQuantBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * 20;
      const float d = HalfToFloat(LoadU16(block));
      const float m = HalfToFloat(LoadU16(block + 2));
      const uint8_t* qs = block + 4;
      float* y = out + b * kQuantBlock;
      for (int j = 0; j < 16; ++j) {
        y[j] = (qs[j] & 0x0f) * d + m;
        y[j + 16] = (qs[j] >> 4) * d + m;
      }
    }
  });
}

}  // namespace

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kQ8_0: return "Q8_0";
    case DType::kQ4_0: return "Q4_0";
    case DType::kQ4_1: return "Q4_1";
  }
  return "?";
}

int64_t DTypeBlockElements(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16: return 1;
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1: return kQuantBlock;
  }
  return 1;
}

size_t DTypeBlockBytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kQ8_0: return 34;
    case DType::kQ4_0: return 18;
    case DType::kQ4_1: return 20;
  }
  return 0;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

Status DequantizeToF32(const TensorInfo& info, float* out) {
  const int64_t n = info.numel();
  const int64_t block = DTypeBlockElements(info.dtype);
  const std::string where = info.file + ": tensor '" + info.name + "'";
  if (n < 0 || (!info.shape.empty() && info.shape.back() % block != 0)) {
    return Status::InvalidArgument(where + ": shape does not fit " + DTypeName(info.dtype) +
                                   " blocks");
  }
  const int64_t blocks = n / block;
  if (info.nbytes != static_cast<size_t>(blocks) * DTypeBlockBytes(info.dtype)) {
    return Status::InvalidArgument(where + ": " + std::to_string(info.nbytes) + " bytes for " +
                                   std::to_string(n) + " " + DTypeName(info.dtype) + " elements");
  }
  if (n == 0) return Status::Ok();
  if (info.data == nullptr || out == nullptr) {
    return Status::InvalidArgument(where + ": null data or output buffer");
  }

  switch (info.dtype) {
    case DType::kF32: std::memcpy(out, info.data, n * sizeof(float)); break;
    case DType::kF16: ConvertF16(info.data, n, out); break;
    case DType::kBF16: ConvertBF16(info.data, n, out); break;
    case DType::kQ8_0: DequantQ8_0(info.data, blocks, out); break;
    case DType::kQ4_0: DequantQ4_0(info.data, blocks, out); break;
    case DType::kQ4_1: DequantQ4_1(info.data, blocks, out); break;
  }
  return Status::Ok();
}

}  // namespace kvflow
