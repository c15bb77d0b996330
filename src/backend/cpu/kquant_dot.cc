// K-quant row dot products with Q8_K activations: portable C++ here, the 256-bit AVX2 and AVX-512
// VNNI paths from one source (kquant_dot_x86.inc, included once per instruction set so each copy's
// functions carry their own target attribute; the library's code outside them stays plain), and
// zmm kernels for Q4_K, Q5_K and Q6_K (the types of Q4_K_M / Q5_K_M files), which on AVX-512
// replace the 256-bit ones.
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

// ---- AVX-512 on zmm: Q4_K, Q5_K, Q6_K -------------------------------------------------------------
// The 256-bit kernels above on twice the width: each zmm holds 64 consecutive elements (Q4_K/Q5_K:
// one 32-byte run of qs broadcast to both halves, low nibbles below, high nibbles above; Q6_K: a
// 64-byte run of ql with its high nibbles in a second zmm), so the Q8_K activations load in order,
// and vpermw spreads the int16 sub-block scales over the matching parts. Q2_K and Q3_K keep the
// 256-bit VNNI kernels.

#define KQ_TARGET_ZMM __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace avx512 {

// Int16 index vectors for vpermw: a in the low 256 bits and b in the high (Q4_K/Q5_K's two
// 32-element sub-blocks), or v0..v3 one per 128-bit lane (Q6_K's 16-element sub-blocks).
constexpr uint64_t kWords = 0x0001000100010001ull, kBytes = 0x0101010101010101ull;
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE __m512i HalvesOf(uint64_t a, uint64_t b, uint64_t unit) {
  const long long lo = static_cast<long long>(a * unit), hi = static_cast<long long>(b * unit);
  return _mm512_setr_epi64(lo, lo, lo, lo, hi, hi, hi, hi);
}
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE __m512i LanesOf(int v0) {
  auto w = [](int v) { return static_cast<long long>(static_cast<uint64_t>(v) * kWords); };
  return _mm512_setr_epi64(w(v0), w(v0), w(v0 + 1), w(v0 + 1), w(v0 + 2), w(v0 + 2), w(v0 + 3), w(v0 + 3));
}

KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE __m512i Load512(const uint8_t* p) { return _mm512_loadu_si512(p); }

template <bool kQ5, int NX>
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE void DotQ45_KZmm(const uint8_t* w, const uint8_t* x, size_t x_stride, int64_t blocks,
                                                    float* out) {
  constexpr size_t kBytesPerBlock = kQ5 ? kQ5_KBytes : kQ4_KBytes;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i high_half_by_4 = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  __m512 acc[NX];
  __m128 acc_min[NX];
  for (int a = 0; a < NX; ++a) {
    acc[a] = _mm512_setzero_ps();
    acc_min[a] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kBytesPerBlock;
    const uint8_t* xb[NX];
    for (int a = 0; a < NX; ++a) xb[a] = x + a * x_stride + b * kQ8_KBytes;
    const __m256i scales_mins = UnpackScalesMins45(wb + 4);
    const __m512i scales = _mm512_zextsi256_si512(scales_mins);
    const __m128i mins = _mm256_extracti128_si256(scales_mins, 1);
    const uint8_t* qs = wb + (kQ5 ? 48 : 16);
    __m512i qh;
    if constexpr (kQ5) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16)));
    __m512i sumi[NX];
    for (int a = 0; a < NX; ++a) sumi[a] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      // Elements 64c .. 64c + 63: sub-block 2c (low nibbles) then 2c + 1 (high nibbles).
      const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c)));
      __m512i q = _mm512_and_si512(_mm512_srlv_epi64(both, high_half_by_4), m4);
      if constexpr (kQ5) {
        const __mmask64 fifth = _mm512_test_epi8_mask(qh, HalvesOf(1u << (2 * c), 1u << (2 * c + 1), kBytes));
        q = _mm512_mask_add_epi8(q, fifth, q, _mm512_set1_epi8(16));
      }
      const __m512i sc = _mm512_permutexvar_epi16(HalvesOf(2 * c, 2 * c + 1, kWords), scales);
      for (int a = 0; a < NX; ++a) {
        sumi[a] = _mm512_dpwssd_epi32(sumi[a], sc, _mm512_maddubs_epi16(q, Load512(xb[a] + kQ8_KQuants + 64 * c)));
      }
    }
    const float d = _cvtsh_ss(LoadU16(wb)), dmin = _cvtsh_ss(LoadU16(wb + 2));
    for (int a = 0; a < NX; ++a) {
      const float xd = LoadF32(xb[a]);
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[a] + kQ8_KBsums));
      const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
      acc_min[a] = _mm_fmadd_ps(_mm_set1_ps(xd * dmin), _mm_cvtepi32_ps(_mm_madd_epi16(mins, sums32)), acc_min[a]);
      acc[a] = _mm512_fmadd_ps(_mm512_set1_ps(xd * d), _mm512_cvtepi32_ps(sumi[a]), acc[a]);
    }
  }
  for (int a = 0; a < NX; ++a) {
    __m128 m = _mm_add_ps(acc_min[a], _mm_movehl_ps(acc_min[a], acc_min[a]));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    out[a] = _mm512_reduce_add_ps(acc[a]) - _mm_cvtss_f32(m);
  }
}

template <int NX>
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE void DotQ6_KZmm(const uint8_t* w, const uint8_t* x, size_t x_stride, int64_t blocks,
                                                   float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(3);
  // qh's 2-bit fields for the parts of a zmm: bits 0-1 and 2-3 (elements 0..63 of a half
  // super-block), bits 4-5 and 6-7 (elements 64..127).
  const __m512i shift_first = HalvesOf(0, 2, kWords), shift_second = HalvesOf(4, 6, kWords);
  __m512 acc[NX];
  for (int a = 0; a < NX; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQ6_KBytes;
    const uint8_t* xb[NX];
    for (int a = 0; a < NX; ++a) xb[a] = x + a * x_stride + b * kQ8_KBytes;
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192)));
    const __m512i scales = _mm512_zextsi256_si512(scales16);
    __m512i sumi[NX];
    for (int a = 0; a < NX; ++a) sumi[a] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = Load512(wb + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * h)));
      const __m512i first = _mm512_or_si512(
          _mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_first), m3), 4));
      const __m512i second =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift_second), m3), 4));
      const __m512i sc_first = _mm512_permutexvar_epi16(LanesOf(8 * h), scales);
      const __m512i sc_second = _mm512_permutexvar_epi16(LanesOf(8 * h + 4), scales);
      for (int a = 0; a < NX; ++a) {
        const uint8_t* xq = xb[a] + kQ8_KQuants + 128 * h;
        sumi[a] = _mm512_dpwssd_epi32(sumi[a], sc_first, _mm512_maddubs_epi16(first, Load512(xq)));
        sumi[a] = _mm512_dpwssd_epi32(sumi[a], sc_second, _mm512_maddubs_epi16(second, Load512(xq + 64)));
      }
    }
    const float d = _cvtsh_ss(LoadU16(wb + 208));
    for (int a = 0; a < NX; ++a) {
      const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[a] + kQ8_KBsums));
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales16, bsums), 5);
      const __m512i total = _mm512_sub_epi32(sumi[a], _mm512_zextsi256_si512(offset));
      acc[a] = _mm512_fmadd_ps(_mm512_set1_ps(LoadF32(xb[a]) * d), _mm512_cvtepi32_ps(total), acc[a]);
    }
  }
  for (int a = 0; a < NX; ++a) out[a] = _mm512_reduce_add_ps(acc[a]);
}

#define KQ_DOT_ROWS_ZMM(NAME, ...)                                                                            \
  KQ_TARGET_ZMM void NAME(const uint8_t* w, const uint8_t* x, size_t x_stride, int nx, int64_t blocks, float* out) { \
    switch (nx) {                                                                                            \
      case 1: __VA_ARGS__<1>(w, x, x_stride, blocks, out); break;                                            \
      case 2: __VA_ARGS__<2>(w, x, x_stride, blocks, out); break;                                            \
      case 3: __VA_ARGS__<3>(w, x, x_stride, blocks, out); break;                                            \
      default: __VA_ARGS__<4>(w, x, x_stride, blocks, out); break;                                           \
    }                                                                                                        \
  }
template <int NX>
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE void DotQ4_KZmm(const uint8_t* w, const uint8_t* x, size_t s, int64_t n, float* out) {
  DotQ45_KZmm<false, NX>(w, x, s, n, out);
}
template <int NX>
KQ_TARGET_ZMM KVFLOW_ALWAYS_INLINE void DotQ5_KZmm(const uint8_t* w, const uint8_t* x, size_t s, int64_t n, float* out) {
  DotQ45_KZmm<true, NX>(w, x, s, n, out);
}
KQ_DOT_ROWS_ZMM(DotRowsQ4_KZmm, DotQ4_KZmm)
KQ_DOT_ROWS_ZMM(DotRowsQ5_KZmm, DotQ5_KZmm)
KQ_DOT_ROWS_ZMM(DotRowsQ6_KZmm, DotQ6_KZmm)
#undef KQ_DOT_ROWS_ZMM

}  // namespace avx512

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
      return isa == 2 ? &avx512::DotRowsQ4_KZmm : isa == 1 ? &avx2::DotRowsQ4_K : &RowsPortable<DotRowQ45_KPortable<false>>;
    case DType::kQ5_K:
      return isa == 2 ? &avx512::DotRowsQ5_KZmm : isa == 1 ? &avx2::DotRowsQ5_K : &RowsPortable<DotRowQ45_KPortable<true>>;
    case DType::kQ6_K:
      return isa == 2 ? &avx512::DotRowsQ6_KZmm : isa == 1 ? &avx2::DotRowsQ6_K : &RowsPortable<DotRowQ6_KPortable>;
    default: return nullptr;
  }
}

}  // namespace kvflow::cpu::kquant
