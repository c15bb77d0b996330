// Conversion of every stored dtype to fp32, following ggml's block layouts (ggml-common.h).
#include <cstring>
#include <functional>
#include <string>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "model/ggml_kquant.h"
#include "model/tensor_source.h"
#include "util/half.h"
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
  return HalfBitsToFloat(h);
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

// ---- K-quants (ggml's QK_K = 256 super-blocks) --------------------------------------------------
// Each follows ggml's dequantize_row_*_K: the sub-block scale times the super-block's f16 scale
// (d * sc), times the quant, minus the min (dmin * m). An f16 scale has 11 significant bits, so for
// Q2_K..Q5_K both products are exact in float and only the subtraction rounds (Q6_K, without a min,
// rounds its second product once): the result is bit-identical to ggml's and gguf-py's whether or
// not the compiler fuses the multiply-subtract into an FMA.

constexpr int64_t kSuperBlock = 256;
constexpr size_t kQ2_KBytes = 84, kQ3_KBytes = 110, kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;

// block_q2_K {uint8 scales[16]; uint8 qs[64]; f16 d; f16 dmin}: 16 sub-blocks of 16, each with a
// 4-bit scale (low nibble) and 4-bit min (high nibble). Element 128h + 32s + l is bits 2s..2s+1 of
// qs[32h + l] and lies in sub-block 8h + 2s + l/16; x = (d * scale) * q - dmin * min.
void DequantQ2_K(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kSuperBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * kQ2_KBytes;
      const uint8_t* scales = block;
      const uint8_t* qs = block + 16;
      const float d = HalfToFloat(LoadU16(block + 80));
      const float dmin = HalfToFloat(LoadU16(block + 82));
      float* y = out + b * kSuperBlock;
      for (int sub = 0; sub < 16; ++sub) {
        const int half = sub / 8, shift = 2 * ((sub % 8) / 2), first_byte = 32 * half + 16 * (sub % 2);
        const float dl = d * static_cast<float>(scales[sub] & 0x0f);
        const float ml = dmin * static_cast<float>(scales[sub] >> 4);
        for (int l = 0; l < 16; ++l) {
          y[16 * sub + l] = dl * static_cast<float>((qs[first_byte + l] >> shift) & 3) - ml;
        }
      }
    }
  });
}

// block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d}: 16 sub-blocks of 16 with
// 6-bit scales biased by 32 (low 4 bits in the nibbles of bytes 0..7, sub-blocks 8..15 in the high
// nibbles; top 2 bits at bit 2*(j/4) of byte 8 + j%4). Element 128h + 32s + l has the 2 low bits
// of its quant at bits 2s of qs[32h + l] and its high bit at bit 4h + s of hmask[l]; a clear high
// bit means -4. x = (d * (scale - 32)) * q, q in -4..3.
void DequantQ3_K(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kSuperBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * kQ3_KBytes;
      const uint8_t* hmask = block;
      const uint8_t* qs = block + 32;
      const uint8_t* scales = block + 96;
      const float d = HalfToFloat(LoadU16(block + 108));
      float* y = out + b * kSuperBlock;
      for (int sub = 0; sub < 16; ++sub) {
        const float dl = d * static_cast<float>(UnpackQ3Scale(scales, sub));
        const int half = sub / 8, s = (sub % 8) / 2, l0 = 16 * (sub % 2);
        const uint8_t high_bit = static_cast<uint8_t>(1u << (4 * half + s));
        for (int l = l0; l < l0 + 16; ++l) {
          const int q = ((qs[32 * half + l] >> (2 * s)) & 3) - ((hmask[l] & high_bit) ? 0 : 4);
          y[128 * half + 32 * s + l] = dl * static_cast<float>(q);
        }
      }
    }
  });
}

// block_q4_K {f16 d; f16 dmin; uint8 scales[12]; uint8 qs[128]}: 8 sub-blocks of 32 with 6-bit
// scales and mins (UnpackScaleMin6, model/ggml_kquant.h). Element 64c + 32t + l is nibble t of
// qs[32c + l], in sub-block 2c + t; x = (d * scale) * q - dmin * min.
void DequantQ4_K(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kSuperBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * kQ4_KBytes;
      const float d = HalfToFloat(LoadU16(block));
      const float dmin = HalfToFloat(LoadU16(block + 2));
      const uint8_t* scales = block + 4;
      const uint8_t* qs = block + 16;
      float* y = out + b * kSuperBlock;
      for (int sub = 0; sub < 8; ++sub) {
        int scale, min;
        UnpackScaleMin6(scales, sub, &scale, &min);
        const float dl = d * static_cast<float>(scale);
        const float ml = dmin * static_cast<float>(min);
        const uint8_t* q = qs + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
        for (int l = 0; l < 32; ++l) y[32 * sub + l] = dl * static_cast<float>((q[l] >> shift) & 0x0f) - ml;
      }
    }
  });
}

// block_q5_K {f16 d; f16 dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: Q4_K plus a fifth
// bit: element 32*sub + l (sub-block sub) takes bit `sub` of qh[l] as its 16s.
void DequantQ5_K(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kSuperBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * kQ5_KBytes;
      const float d = HalfToFloat(LoadU16(block));
      const float dmin = HalfToFloat(LoadU16(block + 2));
      const uint8_t* scales = block + 4;
      const uint8_t* qh = block + 16;
      const uint8_t* qs = block + 48;
      float* y = out + b * kSuperBlock;
      for (int sub = 0; sub < 8; ++sub) {
        int scale, min;
        UnpackScaleMin6(scales, sub, &scale, &min);
        const float dl = d * static_cast<float>(scale);
        const float ml = dmin * static_cast<float>(min);
        const uint8_t* q = qs + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
        for (int l = 0; l < 32; ++l) {
          const int value = ((q[l] >> shift) & 0x0f) | (((qh[l] >> sub) & 1) << 4);
          y[32 * sub + l] = dl * static_cast<float>(value) - ml;
        }
      }
    }
  });
}

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; f16 d}: 16 sub-blocks of 16 with
// signed 8-bit scales. Element 128h + 32k + l (k = 0..3) has its low 4 bits in nibble k/2 of
// ql[64h + 32(k%2) + l] and its top 2 bits at bits 2k of qh[32h + l]; it lies in sub-block
// 8h + 2k + l/16. x = (d * scale) * (q - 32).
void DequantQ6_K(const uint8_t* src, int64_t blocks, float* out) {
  ForChunks(blocks, kSuperBlock, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* block = src + b * kQ6_KBytes;
      const uint8_t* ql = block;
      const uint8_t* qh = block + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
      const float d = HalfToFloat(LoadU16(block + 208));
      float* y = out + b * kSuperBlock;
      for (int sub = 0; sub < 16; ++sub) {
        const int half = sub / 8, k = (sub % 8) / 2, l0 = 16 * (sub % 2);
        const float dl = d * static_cast<float>(scales[sub]);
        for (int l = l0; l < l0 + 16; ++l) {
          const int low = (ql[64 * half + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
          const int high = (qh[32 * half + l] >> (2 * k)) & 3;
          y[128 * half + 32 * k + l] = dl * static_cast<float>((low | (high << 4)) - 32);
        }
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
    case DType::kQ2_K: return "Q2_K";
    case DType::kQ3_K: return "Q3_K";
    case DType::kQ4_K: return "Q4_K";
    case DType::kQ5_K: return "Q5_K";
    case DType::kQ6_K: return "Q6_K";
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
    case DType::kQ2_K:
    case DType::kQ3_K:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K: return kSuperBlock;
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
    case DType::kQ2_K: return kQ2_KBytes;
    case DType::kQ3_K: return kQ3_KBytes;
    case DType::kQ4_K: return kQ4_KBytes;
    case DType::kQ5_K: return kQ5_KBytes;
    case DType::kQ6_K: return kQ6_KBytes;
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
    case DType::kQ2_K: DequantQ2_K(info.data, blocks, out); break;
    case DType::kQ3_K: DequantQ3_K(info.data, blocks, out); break;
    case DType::kQ4_K: DequantQ4_K(info.data, blocks, out); break;
    case DType::kQ5_K: DequantQ5_K(info.data, blocks, out); break;
    case DType::kQ6_K: DequantQ6_K(info.data, blocks, out); break;
  }
  return Status::Ok();
}

}  // namespace kvflow
