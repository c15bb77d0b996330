// K-quant row dot products with Q8_K activations: portable C++ here, the AVX2 and AVX-512 VNNI
// paths from one source (kquant_dot_x86.inc, included once per instruction set so each copy's
// functions carry their own target attribute; the library's code outside them stays plain).
#include "backend/cpu/kquant_dot.h"

#include "model/ggml_kquant.h"
#include "util/half.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

// GCC 12's AVX-512 intrinsics build "undefined" vectors from self-initialized locals (GCC bug
// 105593), as in quant_gemm.cc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define KVFLOW_ALWAYS_INLINE inline __attribute__((always_inline))

namespace kvflow::cpu::kquant {

namespace {

// Weight block sizes (ggml-common.h) and where the Q8_K fields sit.
constexpr size_t kQ2_KBytes = 84, kQ3_KBytes = 110, kQ4_KBytes = 144, kQ5_KBytes = 176, kQ6_KBytes = 210;
constexpr size_t kQ8_KQuants = 4, kQ8_KBsums = 4 + 256;

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline float LoadF32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void LoadBsums(const uint8_t* xb, int16_t (&bsums)[16]) { std::memcpy(bsums, xb + kQ8_KBsums, sizeof(bsums)); }
inline float HalfAt(const uint8_t* p) { return HalfBitsToFloat(LoadU16(p)); }

// Q4_K / Q5_K scales and mins of the 8 sub-blocks.
inline void UnpackScalesMins(const uint8_t* packed, int (&scales)[8], int (&mins)[8]) {
  for (int j = 0; j < 8; ++j) UnpackScaleMin6(packed, j, &scales[j], &mins[j]);
}

// sum over sub-blocks of min_j * sum(x in sub-block j); Q4_K / Q5_K sub-blocks of 32 span two
// 16-element bsums.
inline int MinTerm32(const int (&mins)[8], const int16_t (&bsums)[16]) {
  int sum = 0;
  for (int j = 0; j < 8; ++j) sum += mins[j] * (bsums[2 * j] + bsums[2 * j + 1]);
  return sum;
}

// ---- portable -----------------------------------------------------------------------------------
// Per super-block: the integer sums of each sub-block times its integer scale, exact in int32
// (at most 16 * 63 * 127 * 128 per Q6_K sub-block sum), then d_w * d_x in float.

inline int Dot16(const int8_t* q, const int8_t* x) {
  int sum = 0;
  for (int l = 0; l < 16; ++l) sum += q[l] * x[l];
  return sum;
}

float DotRowQ2_KPortable(const uint8_t* w, const uint8_t* x, int64_t blocks) {
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQ2_KBytes;
    const uint8_t* xb = x + b * kQ8_KBytes;
    const int8_t* xq = reinterpret_cast<const int8_t*>(xb + kQ8_KQuants);
    int16_t bsums[16];
    LoadBsums(xb, bsums);
    const uint8_t* scales = wb;
    const uint8_t* qs = wb + 16;
    int sumi = 0, summ = 0;
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        // Element 128h + 32s + l: bits 2s of qs[32h + l]; sub-block 8h + 2s + l / 16.
        int8_t q[32];
        for (int l = 0; l < 32; ++l) q[l] = static_cast<int8_t>((qs[32 * h + l] >> (2 * s)) & 3);
        const int sub = 8 * h + 2 * s;
        const int8_t* xs = xq + 128 * h + 32 * s;
        sumi += (scales[sub] & 0x0f) * Dot16(q, xs) + (scales[sub + 1] & 0x0f) * Dot16(q + 16, xs + 16);
      }
    }
    for (int j = 0; j < 16; ++j) summ += (scales[j] >> 4) * bsums[j];
    const float xd = LoadF32(xb);
    sum += xd * HalfAt(wb + 80) * static_cast<float>(sumi) - xd * HalfAt(wb + 82) * static_cast<float>(summ);
  }
  return sum;
}

float DotRowQ3_KPortable(const uint8_t* w, const uint8_t* x, int64_t blocks) {
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQ3_KBytes;
    const uint8_t* xb = x + b * kQ8_KBytes;
    const int8_t* xq = reinterpret_cast<const int8_t*>(xb + kQ8_KQuants);
    const uint8_t* hmask = wb;
    const uint8_t* qs = wb + 32;
    int sumi = 0;
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        // Low 2 bits at bits 2s of qs[32h + l], high bit at bit 4h + s of hmask[l]; clear means -4.
        int8_t q[32];
        const uint8_t high_bit = static_cast<uint8_t>(1u << (4 * h + s));
        for (int l = 0; l < 32; ++l) {
          q[l] = static_cast<int8_t>(((qs[32 * h + l] >> (2 * s)) & 3) - ((hmask[l] & high_bit) ? 0 : 4));
        }
        const int sub = 8 * h + 2 * s;
        const int8_t* xs = xq + 128 * h + 32 * s;
        sumi += UnpackQ3Scale(wb + 96, sub) * Dot16(q, xs) + UnpackQ3Scale(wb + 96, sub + 1) * Dot16(q + 16, xs + 16);
      }
    }
    sum += LoadF32(xb) * HalfAt(wb + 108) * static_cast<float>(sumi);
  }
  return sum;
}

// Q4_K and Q5_K share the layout of scales and nibbles; Q5_K adds a fifth bit from qh.
template <bool kQ5>
float DotRowQ45_KPortable(const uint8_t* w, const uint8_t* x, int64_t blocks) {
  constexpr size_t kBytes = kQ5 ? kQ5_KBytes : kQ4_KBytes;
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBytes;
    const uint8_t* xb = x + b * kQ8_KBytes;
    const int8_t* xq = reinterpret_cast<const int8_t*>(xb + kQ8_KQuants);
    int16_t bsums[16];
    LoadBsums(xb, bsums);
    int scales[8], mins[8];
    UnpackScalesMins(wb + 4, scales, mins);
    const uint8_t* qh = wb + 16;
    const uint8_t* qs = wb + (kQ5 ? 48 : 16);
    int sumi = 0;
    for (int sub = 0; sub < 8; ++sub) {
      // Element 32 sub + l: nibble sub % 2 of qs[32 (sub / 2) + l] (+ 16 * bit sub of qh[l]).
      const uint8_t* q = qs + 32 * (sub / 2);
      const int shift = 4 * (sub % 2);
      const int8_t* xs = xq + 32 * sub;
      int dot = 0;
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0x0f;
        if constexpr (kQ5) v |= ((qh[l] >> sub) & 1) << 4;
        dot += v * xs[l];
      }
      sumi += scales[sub] * dot;
    }
    const float xd = LoadF32(xb);
    sum += xd * HalfAt(wb) * static_cast<float>(sumi) -
           xd * HalfAt(wb + 2) * static_cast<float>(MinTerm32(mins, bsums));
  }
  return sum;
}

float DotRowQ6_KPortable(const uint8_t* w, const uint8_t* x, int64_t blocks) {
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQ6_KBytes;
    const uint8_t* xb = x + b * kQ8_KBytes;
    const int8_t* xq = reinterpret_cast<const int8_t*>(xb + kQ8_KQuants);
    const uint8_t* ql = wb;
    const uint8_t* qh = wb + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(wb + 192);
    int sumi = 0;
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        // Element 128h + 32k + l: nibble k / 2 of ql[64h + 32(k % 2) + l], bits 2k of qh[32h + l].
        int8_t q[32];
        for (int l = 0; l < 32; ++l) {
          const int low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
          const int high = (qh[32 * h + l] >> (2 * k)) & 3;
          q[l] = static_cast<int8_t>((low | (high << 4)) - 32);
        }
        const int sub = 8 * h + 2 * k;
        const int8_t* xs = xq + 128 * h + 32 * k;
        sumi += scales[sub] * Dot16(q, xs) + scales[sub + 1] * Dot16(q + 16, xs + 16);
      }
    }
    sum += LoadF32(xb) * HalfAt(wb + 208) * static_cast<float>(sumi);
  }
  return sum;
}

}  // namespace

// ---- x86 -----------------------------------------------------------------------------------------
// The SIMD helpers below are all inline; each copy of the .inc defines a namespace of kernels
// whose functions carry KQ_TARGET.

#define KQ_TARGET __attribute__((target("avx2,fma,f16c")))
#define KQ_VNNI 0
namespace avx2 {
#include "backend/cpu/kquant_dot_x86.inc"
}  // namespace avx2
#undef KQ_TARGET
#undef KQ_VNNI

#define KQ_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KQ_VNNI 1
namespace avx512 {
#include "backend/cpu/kquant_dot_x86.inc"
}  // namespace avx512
#undef KQ_TARGET
#undef KQ_VNNI

void QuantizeRowQ8K(const float* x, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b, x += kSuperBlock, out += kQ8_KBytes) {
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < kSuperBlock; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    int8_t* qs = reinterpret_cast<int8_t*>(out + kQ8_KQuants);
    int16_t bsums[16] = {};
    float d = 0.0f;
    if (amax == 0.0f) {
      std::memset(qs, 0, kSuperBlock);
    } else {
      // ggml's scale: -127 / max; its nearest_int is round-half-even through the float adder
      // (1.5 * 2^23 pushes the fraction out), valid for |v| < 2^22 (here |v| <= 127).
      const float iscale = -127.0f / max;
      for (int j = 0; j < kSuperBlock; ++j) {
        const float shifted = iscale * x[j] + 12582912.0f;
        int32_t bits;
        std::memcpy(&bits, &shifted, sizeof(bits));
        const int v = (bits & 0x007fffff) - 0x00400000;
        qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
      }
      for (int j = 0; j < 16; ++j) {
        int sum = 0;
        for (int l = 0; l < 16; ++l) sum += qs[16 * j + l];
        bsums[j] = static_cast<int16_t>(sum);
      }
      d = 1.0f / iscale;
    }
    std::memcpy(out, &d, sizeof(d));
    std::memcpy(out + kQ8_KBsums, bsums, sizeof(bsums));
  }
}

namespace {

// The portable kernels take one activation row at a time.
template <float (*Row)(const uint8_t*, const uint8_t*, int64_t)>
void RowsPortable(const uint8_t* w, const uint8_t* x, size_t x_stride, int nx, int64_t blocks, float* out) {
  for (int a = 0; a < nx; ++a) out[a] = Row(w, x + a * x_stride, blocks);
}

}  // namespace

DotRowsFn DotRowsFor(DType w, int isa) {
  switch (w) {
    case DType::kQ2_K:
      return isa == 2 ? &avx512::DotRowsQ2_K : isa == 1 ? &avx2::DotRowsQ2_K : &RowsPortable<DotRowQ2_KPortable>;
    case DType::kQ3_K:
      return isa == 2 ? &avx512::DotRowsQ3_K : isa == 1 ? &avx2::DotRowsQ3_K : &RowsPortable<DotRowQ3_KPortable>;
    case DType::kQ4_K:
      return isa == 2 ? &avx512::DotRowsQ4_K : isa == 1 ? &avx2::DotRowsQ4_K : &RowsPortable<DotRowQ45_KPortable<false>>;
    case DType::kQ5_K:
      return isa == 2 ? &avx512::DotRowsQ5_K : isa == 1 ? &avx2::DotRowsQ5_K : &RowsPortable<DotRowQ45_KPortable<true>>;
    case DType::kQ6_K:
      return isa == 2 ? &avx512::DotRowsQ6_K : isa == 1 ? &avx2::DotRowsQ6_K : &RowsPortable<DotRowQ6_KPortable>;
    default: return nullptr;
  }
}

}  // namespace kvflow::cpu::kquant
