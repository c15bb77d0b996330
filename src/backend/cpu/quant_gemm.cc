// Products of GGUF block-quantized weights with 8-bit block-quantized activations, after ggml's
// ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 and llamafile's tiled tinyBLAS_Q0 kernels; the
// K-quants' row kernels (Q8_K activations) are in kquant_dot.cc and share the tiling here.
//
// The whole library is compiled for x86-64-v3, but the AVX-512 kernels are built with function
// target attributes and only reached through the run-time dispatch below, so a CPU without AVX-512
// never executes one of their instructions.
#include "backend/cpu/quant_gemm.h"

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kquant_dot.h"
#include "util/half.h"
#include "util/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstring>
#include <iterator>
#include <utility>

// GCC 12's AVX-512 intrinsics build "undefined" vectors from self-initialized locals, which its
// uninitialized-use warnings flag once inlined into target functions (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define KVFLOW_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVFLOW_TARGET_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KVFLOW_ALWAYS_INLINE inline __attribute__((always_inline))

namespace kvflow::cpu {

namespace {

constexpr int64_t kBlock = 32;
// ggml block layouts. Weights:
//   Q4_0 {f16 d; uint8 qs[16]}         element j < 16: low nibble of qs[j], j >= 16: high nibble of
//                                      qs[j - 16]; value (nibble - 8) * d
//   Q4_1 {f16 d; f16 m; uint8 qs[16]}  same nibble order; value nibble * d + m
//   Q8_0 {f16 d; int8 qs[32]}          value q * d
// Activations: Q8_0 (as above) for Q4_0 and Q8_0 weights, Q8_1 {float d; float s; int8 qs[32]} with
// s = d * sum(qs) for Q4_1 weights.
constexpr size_t kQ4_0Bytes = 18;
constexpr size_t kQ4_1Bytes = 20;
constexpr size_t kQ8_0Bytes = 34;
constexpr size_t kQ8_1Bytes = 40;
constexpr float kQ8Max = 127.0f;

using kquant::IsKQuant;

constexpr size_t WeightBlockBytes(DType w) {
  switch (w) {
    case DType::kQ4_0: return kQ4_0Bytes;
    case DType::kQ4_1: return kQ4_1Bytes;
    case DType::kQ2_K: return 84;
    case DType::kQ3_K: return 110;
    case DType::kQ4_K: return 144;
    case DType::kQ5_K: return 176;
    case DType::kQ6_K: return 210;
    default: return kQ8_0Bytes;
  }
}
// Elements per weight block and per activation block (the same for each type).
constexpr int64_t BlockElements(DType w) { return IsKQuant(w) ? kquant::kSuperBlock : kBlock; }
constexpr size_t ActBlockBytes(DType w) {
  return IsKQuant(w) ? kquant::kQ8_KBytes : w == DType::kQ4_1 ? kQ8_1Bytes : kQ8_0Bytes;
}
// Where the quants start inside a block.
constexpr size_t WeightQuantOffset(DType w) { return w == DType::kQ4_1 ? 4 : 2; }
constexpr size_t ActQuantOffset(DType w) { return w == DType::kQ4_1 ? 8 : 2; }

constexpr bool IsQuantWeightType(DType t) {
  return t == DType::kQ4_0 || t == DType::kQ4_1 || t == DType::kQ8_0 || IsKQuant(t);
}

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
inline void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }
inline void StoreF32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof(v)); }

// Portable half conversions (util/half.h), bit-exact with F16C's.
inline float HalfToFloat(uint16_t h) { return HalfBitsToFloat(h); }
inline uint16_t FloatToHalf(float f) { return FloatToHalfBits(f); }

// ---- activation quantization ------------------------------------------------------------------
// d = amax / 127 and q = round(x * (1 / d)) with round-half-even, as ggml's SIMD quantize_row_q8_0:
// both paths compute the same float operations, so they agree bit for bit.

void QuantizeBlockPortable(const float* x, uint8_t* out, bool q8_1) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / kQ8Max;
  const float inv_d = d != 0.0f ? 1.0f / d : 0.0f;
  int8_t* qs = reinterpret_cast<int8_t*>(out + (q8_1 ? 8 : 2));
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int q = static_cast<int>(std::nearbyint(x[j] * inv_d));
    qs[j] = static_cast<int8_t>(q);
    sum += q;
  }
  if (q8_1) {
    StoreF32(out, d);
    StoreF32(out + 4, d * static_cast<float>(sum));
  } else {
    StoreU16(out, FloatToHalf(d));
  }
}

KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE int HorizontalSumI32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVFLOW_TARGET_AVX2 void QuantizeBlockAvx2(const float* x, uint8_t* out, bool q8_1) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign_bit, v[0]), _mm256_andnot_ps(sign_bit, v[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign_bit, v[2]), _mm256_andnot_ps(sign_bit, v[3])));
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
  const float d = _mm_cvtss_f32(amax4) / kQ8Max;
  const __m256 inv_d = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv_d));  // round half even
  // Pack to int8: the packs interleave 128-bit lanes, the permute restores element order.
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q8_1 ? 8 : 2)), packed);
  if (q8_1) {
    const int sum = HorizontalSumI32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    StoreF32(out, d);
    StoreF32(out + 4, d * static_cast<float>(sum));
  } else {
    StoreU16(out, static_cast<uint16_t>(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT)));
  }
}

KVFLOW_TARGET_AVX2 void QuantizeRowAvx2(const float* x, int64_t blocks, uint8_t* out, bool q8_1, size_t block_bytes) {
  for (int64_t b = 0; b < blocks; ++b) QuantizeBlockAvx2(x + b * kBlock, out + b * block_bytes, q8_1);
}

void QuantizeRowPortable(const float* x, int64_t blocks, uint8_t* out, bool q8_1, size_t block_bytes) {
  for (int64_t b = 0; b < blocks; ++b) QuantizeBlockPortable(x + b * kBlock, out + b * block_bytes, q8_1);
}

// ---- tiles --------------------------------------------------------------------------------------
// A tile computes RW weight rows x RA activation rows over all blocks of the rows and writes
// y[a * ldy + r]. The weight blocks of a tile stay in L1 while the driver walks the activation rows.

struct TileArgs {
  const uint8_t* w;  // first weight row of the tile
  size_t w_stride;   // bytes per weight row
  const uint8_t* x;  // first activation row of the tile
  size_t x_stride;   // bytes per activation row
  int64_t blocks;    // blocks per row
  float* y;          // y[a * ldy + r] for the tile's rows
  int64_t ldy;
  bool accumulate;
  // Weight bytes to prefetch while the tile runs (the tiles ahead), nullptr for none: the tile
  // touches its rows in parallel streams, which the hardware prefetchers follow poorly.
  const uint8_t* prefetch;
};

// While a tile works on blocks [b, b + kBlocks), prefetches as many bytes of the weights ahead as
// it consumes, so the prefetch keeps pace. The addresses may run past the last row (prefetches
// never fault), hence integer arithmetic rather than pointers past the end.
template <DType W, int RW, int kBlocks>
KVFLOW_ALWAYS_INLINE void PrefetchAhead(const TileArgs& t, int64_t b) {
  if (t.prefetch == nullptr) return;
  constexpr uintptr_t kBytes = kBlocks * RW * WeightBlockBytes(W);
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.prefetch) + b * RW * WeightBlockBytes(W);
  for (uintptr_t offset = 0; offset < kBytes + 64; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(start + offset), 0, 3);
  }
}

template <int RW, int RA>
KVFLOW_ALWAYS_INLINE void StoreTile(const TileArgs& t, const float (&sums)[RW][RA]) {
  for (int a = 0; a < RA; ++a) {
    float* out = t.y + a * t.ldy;
    for (int r = 0; r < RW; ++r) out[r] = t.accumulate ? out[r] + sums[r][a] : sums[r][a];
  }
}

// Portable: one block's integer dot product, then scaled in float as the SIMD paths do.
template <DType W>
KVFLOW_ALWAYS_INLINE int32_t BlockDotPortable(const uint8_t* wq, const int8_t* xq) {
  int32_t sum = 0;
  if constexpr (W == DType::kQ8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(wq);
    for (int j = 0; j < kBlock; ++j) sum += w[j] * xq[j];
  } else {
    constexpr int kOffset = W == DType::kQ4_0 ? 8 : 0;
    for (int j = 0; j < kBlock / 2; ++j) {
      sum += ((wq[j] & 0x0f) - kOffset) * xq[j] + ((wq[j] >> 4) - kOffset) * xq[j + kBlock / 2];
    }
  }
  return sum;
}

template <DType W, int RW, int RA>
void TilePortable(const TileArgs& t) {
  constexpr size_t kWB = WeightBlockBytes(W), kXB = ActBlockBytes(W);
  float sums[RW][RA] = {};
  for (int64_t b = 0; b < t.blocks; ++b) {
    PrefetchAhead<W, RW, 1>(t, b);
    for (int a = 0; a < RA; ++a) {
      const uint8_t* xb = t.x + a * t.x_stride + b * kXB;
      const int8_t* xq = reinterpret_cast<const int8_t*>(xb + ActQuantOffset(W));
      const float xd = W == DType::kQ4_1 ? LoadF32(xb) : HalfToFloat(LoadU16(xb));
      for (int r = 0; r < RW; ++r) {
        const uint8_t* wb = t.w + r * t.w_stride + b * kWB;
        const int32_t dot = BlockDotPortable<W>(wb + WeightQuantOffset(W), xq);
        sums[r][a] += HalfToFloat(LoadU16(wb)) * xd * static_cast<float>(dot);
        if constexpr (W == DType::kQ4_1) sums[r][a] += HalfToFloat(LoadU16(wb + 2)) * LoadF32(xb + 4);
      }
    }
  }
  StoreTile<RW, RA>(t, sums);
}

// AVX2, one block (32 elements, one ymm) per step, as ggml's AVX2 vec_dot kernels:
//   Q4_0: maddubs(nibbles, x) - maddubs(8, x) (the -8 of the nibbles, once per activation block)
//   Q4_1: maddubs(nibbles, x), plus m * s in float
//   Q8_0: maddubs(|w|, sign(x, w)) (maddubs wants one unsigned operand)
// then madd with ones to int32, to float, fma with d_w * d_x. No int16 saturation: pairs stay
// below 2 * 128 * 127.
template <DType W>
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE __m256i LoadWeightQuantsAvx2(const uint8_t* block) {
  if constexpr (W == DType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    // Both halves hold the 16 bytes; shifting the upper half by 4 puts high nibbles there.
    const __m256i both = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + WeightQuantOffset(W))));
    return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
  }
}

template <DType W, int RW, int RA>
KVFLOW_TARGET_AVX2 void TileAvx2(const TileArgs& t) {
  constexpr size_t kWB = WeightBlockBytes(W), kXB = ActBlockBytes(W);
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 acc[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.blocks; ++b) {
    PrefetchAhead<W, RW, 1>(t, b);
    __m256i wq[RW], w_abs[RW];
    __m256 wd[RW], wm[RW];
#pragma GCC unroll 4
    for (int r = 0; r < RW; ++r) {
      const uint8_t* wb = t.w + r * t.w_stride + b * kWB;
      wq[r] = LoadWeightQuantsAvx2<W>(wb);
      if constexpr (W == DType::kQ8_0) w_abs[r] = _mm256_abs_epi8(wq[r]);
      wd[r] = _mm256_set1_ps(_cvtsh_ss(LoadU16(wb)));
      // m in lane 0 only: the final lane sum then adds m * s once per block.
      if constexpr (W == DType::kQ4_1) wm[r] = _mm256_zextps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(LoadU16(wb + 2))));
    }
#pragma GCC unroll 4
    for (int a = 0; a < RA; ++a) {
      const uint8_t* xb = t.x + a * t.x_stride + b * kXB;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + ActQuantOffset(W)));
      const __m256 xd = W == DType::kQ4_1 ? _mm256_set1_ps(LoadF32(xb)) : _mm256_set1_ps(_cvtsh_ss(LoadU16(xb)));
      __m256i x_offset;
      if constexpr (W == DType::kQ4_0) x_offset = _mm256_maddubs_epi16(_mm256_set1_epi8(8), xq);
#pragma GCC unroll 4
      for (int r = 0; r < RW; ++r) {
        __m256i pairs;
        if constexpr (W == DType::kQ8_0) {
          pairs = _mm256_maddubs_epi16(w_abs[r], _mm256_sign_epi8(xq, wq[r]));
        } else {
          pairs = _mm256_maddubs_epi16(wq[r], xq);
          if constexpr (W == DType::kQ4_0) pairs = _mm256_sub_epi16(pairs, x_offset);
        }
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones16));
        acc[r][a] = _mm256_fmadd_ps(dot, _mm256_mul_ps(wd[r], xd), acc[r][a]);
        if constexpr (W == DType::kQ4_1) acc[r][a] = _mm256_fmadd_ps(wm[r], _mm256_set1_ps(LoadF32(xb + 4)), acc[r][a]);
      }
    }
  }
  float sums[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) sums[r][a] = HorizontalSum(acc[r][a]);
  StoreTile<RW, RA>(t, sums);
}

// AVX-512 VNNI, two blocks per zmm (one per 256-bit half). vpdpbusd multiplies unsigned by signed
// bytes and sums groups of four into int32 without saturation, so the weights go in unsigned:
// nibbles for Q4_0 / Q4_1, w + 128 (w ^ 0x80) for Q8_0, and the offset (8 or 128) times the sum
// of x, computed once per activation block, is subtracted by starting the accumulation from it.
template <bool kPair>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 BroadcastHalves(const uint8_t* first, const uint8_t* second) {
  const __m128i lo = _mm_set1_epi16(static_cast<short>(LoadU16(first)));
  const __m128i hi = kPair ? _mm_set1_epi16(static_cast<short>(LoadU16(second))) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_set_m128i(hi, lo));
}

template <bool kPair>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 BroadcastFloats(const uint8_t* first, const uint8_t* second) {
  const __m256 lo = _mm256_set1_ps(LoadF32(first));
  const __m256 hi = kPair ? _mm256_set1_ps(LoadF32(second)) : _mm256_setzero_ps();
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// The halves in lanes 0 and 8 only, zeros elsewhere (Q4_1's m: added once per block by the lane sum).
template <bool kPair>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 FirstLaneHalves(const uint8_t* first, const uint8_t* second) {
  const __m128i lo = _mm_cvtsi32_si128(LoadU16(first));
  const __m128i hi = kPair ? _mm_cvtsi32_si128(LoadU16(second)) : _mm_setzero_si128();
  return _mm512_cvtph_ps(_mm256_set_m128i(hi, lo));
}

template <DType W, bool kPair>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512i LoadWeightQuantsAvx512(const uint8_t* block) {
  constexpr size_t kWB = WeightBlockBytes(W), kOff = WeightQuantOffset(W);
  if constexpr (W == DType::kQ8_0) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kOff));
    const __m256i hi = kPair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kWB + kOff))
                             : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8(-128));
  } else {
    // Each block's 16 bytes in both 128-bit lanes of its half; the upper lane shifted by 4 holds
    // the high nibbles, so each half is the block's elements in order.
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kOff)));
    const __m256i hi = kPair ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kWB + kOff)))
                             : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_and_si512(_mm512_srlv_epi64(both, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0f));
  }
}

template <DType W, int RW, int RA, bool kPair>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE void StepAvx512(const TileArgs& t, int64_t b, __m512 (&acc)[RW][RA]) {
  constexpr size_t kWB = WeightBlockBytes(W), kXB = ActBlockBytes(W), kXOff = ActQuantOffset(W);
  PrefetchAhead<W, RW, 2>(t, b);
  __m512i wq[RW];
  __m512 wd[RW], wm[RW];
#pragma GCC unroll 4
  for (int r = 0; r < RW; ++r) {
    const uint8_t* wb = t.w + r * t.w_stride + b * kWB;
    wq[r] = LoadWeightQuantsAvx512<W, kPair>(wb);
    wd[r] = BroadcastHalves<kPair>(wb, wb + kWB);
    if constexpr (W == DType::kQ4_1) wm[r] = FirstLaneHalves<kPair>(wb + 2, wb + kWB + 2);
  }
#pragma GCC unroll 4
  for (int a = 0; a < RA; ++a) {
    const uint8_t* xb = t.x + a * t.x_stride + b * kXB;
    const __m256i xq_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + kXOff));
    const __m256i xq_hi = kPair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + kXB + kXOff))
                                : _mm256_setzero_si256();
    const __m512i xq = _mm512_inserti64x4(_mm512_castsi256_si512(xq_lo), xq_hi, 1);
    const __m512 xd = W == DType::kQ4_1 ? BroadcastFloats<kPair>(xb, xb + kXB) : BroadcastHalves<kPair>(xb, xb + kXB);
    __m512i start = _mm512_setzero_si512();
    if constexpr (W != DType::kQ4_1) {
      const __m512i offset = _mm512_set1_epi8(static_cast<char>(W == DType::kQ8_0 ? 128 : 8));
      start = _mm512_sub_epi32(start, _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xq));
    }
    __m512 xs;
    if constexpr (W == DType::kQ4_1) xs = BroadcastFloats<kPair>(xb + 4, xb + kXB + 4);
#pragma GCC unroll 4
    for (int r = 0; r < RW; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wq[r], xq));
      acc[r][a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(wd[r], xd), acc[r][a]);
      if constexpr (W == DType::kQ4_1) acc[r][a] = _mm512_fmadd_ps(wm[r], xs, acc[r][a]);
    }
  }
}

template <DType W, int RW, int RA>
KVFLOW_TARGET_AVX512 void TileAvx512(const TileArgs& t) {
  __m512 acc[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= t.blocks; b += 2) StepAvx512<W, RW, RA, true>(t, b, acc);
  if (b < t.blocks) StepAvx512<W, RW, RA, false>(t, b, acc);  // odd block count: upper half zero
  float sums[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) sums[r][a] = _mm512_reduce_add_ps(acc[r][a]);
  StoreTile<RW, RA>(t, sums);
}

// K-quants: the kernels (kquant_dot.cc) over chunks of a few super-blocks, each weight row's chunk
// unpacked once for all the tile's activation rows; the tile's weight chunk (at most 4 rows x 8 x
// 210 bytes) and activation chunk (4 x 8 x 292) stay in L1.
template <int I, DType W, int RW, int RA>
void TileKQuant(const TileArgs& t) {
  static_assert(RA <= kquant::kMaxDotRows);
  constexpr int64_t kChunk = 8;
  constexpr size_t kWB = WeightBlockBytes(W), kXB = kquant::kQ8_KBytes;
  const kquant::DotRowsFn dot = kquant::DotRowsFor(W, I);
  float sums[RW][RA] = {};
  for (int64_t b = 0; b < t.blocks; b += kChunk) {
    const int64_t n = std::min(kChunk, t.blocks - b);
    for (int r = 0; r < RW; ++r) {
      // On the tile's first activation rows (t.prefetch set), prefetch what this row needs next: its
      // next chunk, or after its last one the first chunk of the matching row of the tile ahead; a
      // row at a time, so the prefetches spread over the work instead of coming in one burst.
      const bool last = b + kChunk >= t.blocks;
      if (t.prefetch != nullptr) {
        const uintptr_t start = last ? reinterpret_cast<uintptr_t>(t.prefetch) + r * t.w_stride
                                     : reinterpret_cast<uintptr_t>(t.w) + r * t.w_stride + (b + kChunk) * kWB;
        const int64_t next = last ? std::min(kChunk, t.blocks) : std::min(kChunk, t.blocks - b - kChunk);
        for (uintptr_t offset = 0; offset < next * kWB + 64; offset += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(start + offset), 0, 3);
        }
      }
      float part[RA];
      dot(t.w + r * t.w_stride + b * kWB, t.x + b * kXB, t.x_stride, RA, n, part);
      for (int a = 0; a < RA; ++a) sums[r][a] += part[a];
    }
  }
  StoreTile<RW, RA>(t, sums);
}

// ---- dispatch -----------------------------------------------------------------------------------

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };
constexpr const char* kIsaNames[] = {"portable", "avx2", "avx512vnni"};

// Tile shapes (weight rows x activation rows), sized to the vector registers: 16 AVX2 ymm, 32 zmm.
constexpr int kMaxTile = 4;
constexpr int TileRowsW(Isa) { return 4; }
constexpr int TileRowsA(Isa isa) { return isa == Isa::kAvx2 ? 2 : 4; }

using TileFn = void (*)(const TileArgs&);
struct TileTable {
  int rows_w, rows_a;
  std::array<std::array<TileFn, kMaxTile>, kMaxTile> tiles;  // [rw - 1][ra - 1]
};

template <Isa I, DType W, int RW, int RA>
constexpr TileFn TileFor() {
  if constexpr (RW > TileRowsW(I) || RA > TileRowsA(I)) {
    return nullptr;
  } else if constexpr (IsKQuant(W)) {
    return &TileKQuant<static_cast<int>(I), W, RW, RA>;
  } else if constexpr (I == Isa::kAvx512Vnni) {
    return &TileAvx512<W, RW, RA>;
  } else if constexpr (I == Isa::kAvx2) {
    return &TileAvx2<W, RW, RA>;
  } else {
    return &TilePortable<W, RW, RA>;
  }
}

template <Isa I, DType W, int RW, size_t... A>
constexpr std::array<TileFn, kMaxTile> TileRow(std::index_sequence<A...>) {
  return {TileFor<I, W, RW, static_cast<int>(A) + 1>()...};
}

template <Isa I, DType W, size_t... R>
constexpr TileTable MakeTable(std::index_sequence<R...>) {
  return {TileRowsW(I), TileRowsA(I), {TileRow<I, W, static_cast<int>(R) + 1>(std::make_index_sequence<kMaxTile>())...}};
}

// Weight types in table order.
constexpr DType kWeightTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kQ2_K,
                                  DType::kQ3_K, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};
constexpr size_t kNumWeightTypes = std::size(kWeightTypes);

template <Isa I, size_t... T>
constexpr std::array<TileTable, kNumWeightTypes> MakeTables(std::index_sequence<T...>) {
  return {MakeTable<I, kWeightTypes[T]>(std::make_index_sequence<kMaxTile>())...};
}

constexpr auto kTypeSeq = std::make_index_sequence<kNumWeightTypes>();
constexpr std::array<std::array<TileTable, kNumWeightTypes>, 3> kTables = {
    MakeTables<Isa::kPortable>(kTypeSeq), MakeTables<Isa::kAvx2>(kTypeSeq), MakeTables<Isa::kAvx512Vnni>(kTypeSeq)};

constexpr int TypeIndex(DType t) {
  for (size_t i = 0; i < kNumWeightTypes; ++i) {
    if (kWeightTypes[i] == t) return static_cast<int>(i);
  }
  return 0;
}

Isa DetectIsa() {
  const CpuFeatures& f = DetectedCpuFeatures();
  return f.avx512_vnni ? Isa::kAvx512Vnni : f.avx2 ? Isa::kAvx2 : Isa::kPortable;
}

Isa DetectedIsa() {
  static const Isa detected = DetectIsa();
  return detected;
}

std::atomic<bool> force_portable{false};
std::atomic<int> isa_cap{static_cast<int>(Isa::kAvx512Vnni)};

Isa ActiveIsa() {
  if (force_portable.load(std::memory_order_relaxed)) return Isa::kPortable;
  return static_cast<Isa>(std::min(static_cast<int>(DetectedIsa()), isa_cap.load(std::memory_order_relaxed)));
}

const TileTable& TableFor(DType w) { return kTables[static_cast<int>(ActiveIsa())][TypeIndex(w)]; }

// Below this many block products per call a parallel region costs more than it saves.
constexpr int64_t kMinParallelBlockProducts = 4096;
constexpr int64_t kMinParallelQuantizeBlocks = 1024;
// How far ahead (in tiles of weight rows) the tiles prefetch.
constexpr int64_t kPrefetchTiles = 1;

}  // namespace

size_t QuantizedActivations::row_bytes() const {
  return static_cast<size_t>(cols / BlockElements(weight_type)) * ActBlockBytes(weight_type);
}

bool SameActivationFormat(DType a, DType b) {
  if (IsKQuant(a) || IsKQuant(b)) return IsKQuant(a) && IsKQuant(b);
  return ActBlockBytes(a) == ActBlockBytes(b);  // Q8_0 (34 bytes) or Q8_1 (40)
}

void QuantizeActivations(const float* x, int64_t rows, int64_t cols, DType weight_type, QuantizedActivations& out) {
  assert(IsQuantWeightType(weight_type) && "QuantizeActivations: weight type has no kernels");
  assert(cols % BlockElements(weight_type) == 0 && "QuantizeActivations: cols must be a multiple of the block");
  out.weight_type = weight_type;
  out.rows = rows;
  out.cols = cols;
  const size_t row_bytes = out.row_bytes();
  if (out.data.size() < rows * row_bytes) out.data.resize(rows * row_bytes);
  const int64_t blocks = cols / BlockElements(weight_type);
  const bool q8_k = IsKQuant(weight_type);
  const bool q8_1 = weight_type == DType::kQ4_1;
  const size_t block_bytes = ActBlockBytes(weight_type);
  const bool simd = ActiveIsa() != Isa::kPortable;
  // Thresholds count 32-element blocks (a K-quant super-block is 8 of them).
  const int64_t blocks32 = blocks * (BlockElements(weight_type) / kBlock);
  const bool parallel = rows > 1 && rows * blocks32 >= kMinParallelQuantizeBlocks;
  ParallelFor(
      rows,
      [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
          uint8_t* dst = out.data.data() + r * row_bytes;
          if (q8_k) {
            kquant::QuantizeRowQ8K(x + r * cols, blocks, dst);
          } else if (simd) {
            QuantizeRowAvx2(x + r * cols, blocks, dst, q8_1, block_bytes);
          } else {
            QuantizeRowPortable(x + r * cols, blocks, dst, q8_1, block_bytes);
          }
        }
      },
      0, parallel ? 2 : rows + 1);
}

void QuantizedMatmul(const QuantizedActivations& x, const uint8_t* w, int64_t n_rows, float* y, int64_t ldy,
                     bool accumulate) {
  assert(IsQuantWeightType(x.weight_type));
  const int64_t m_rows = x.rows, blocks = x.cols / BlockElements(x.weight_type);
  if (m_rows <= 0 || n_rows <= 0) return;
  const TileTable& table = TableFor(x.weight_type);
  const size_t w_stride = static_cast<size_t>(blocks) * WeightBlockBytes(x.weight_type);
  const size_t x_stride = x.row_bytes();
  // Each thread takes a contiguous run of weight rows (whole tiles), so it streams its part of
  // the weights once; within it, a tile of weight rows meets every tile of activation rows.
  const int64_t threads = CurrentThreads();
  const int64_t rows_per_thread = (n_rows + threads - 1) / threads;
  const int64_t chunk = (rows_per_thread + table.rows_w - 1) / table.rows_w * table.rows_w;
  const int64_t blocks32 = blocks * (BlockElements(x.weight_type) / kBlock);
  const bool parallel = threads > 1 && n_rows > table.rows_w && n_rows * m_rows * blocks32 >= kMinParallelBlockProducts;
  ParallelFor(
      n_rows,
      [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; n += table.rows_w) {
      const int64_t tile_w = std::min<int64_t>(table.rows_w, n_end - n);
      for (int64_t m = 0; m < m_rows; m += table.rows_a) {
        const int64_t tile_a = std::min<int64_t>(table.rows_a, m_rows - m);
        // The first activation tile brings the weights in; the others find them in L1.
        const int64_t ahead = n + kPrefetchTiles * table.rows_w;
        const uint8_t* prefetch = m == 0 && ahead < n_rows ? w + ahead * w_stride : nullptr;
        const TileArgs args{w + n * w_stride, w_stride, x.row(m),   x_stride,  blocks,
                            y + m * ldy + n,  ldy,      accumulate, prefetch};
        table.tiles[tile_w - 1][tile_a - 1](args);
      }
    }
      },
      chunk, parallel ? 2 : n_rows + 1);
}

float QuantizedDot(DType w_type, const uint8_t* w_row, const uint8_t* x_row, int64_t cols) {
  assert(IsQuantWeightType(w_type) && cols % BlockElements(w_type) == 0);
  float result = 0.0f;
  const int64_t blocks = cols / BlockElements(w_type);
  const TileArgs args{w_row, 0, x_row, 0, blocks, &result, 1, false, nullptr};
  TableFor(w_type).tiles[0][0](args);
  return result;
}

const char* QuantKernelIsa() { return kIsaNames[static_cast<int>(ActiveIsa())]; }

bool ForcePortableQuantKernels(bool on) { return force_portable.exchange(on); }

const char* LimitQuantKernelIsa(const char* isa) {
  int cap = static_cast<int>(Isa::kAvx512Vnni);
  if (isa != nullptr) {
    for (int i = 0; i < 3; ++i) {
      if (std::strcmp(isa, kIsaNames[i]) == 0) cap = i;
    }
  }
  const int previous = isa_cap.exchange(cap);
  return previous == static_cast<int>(Isa::kAvx512Vnni) ? nullptr : kIsaNames[previous];
}

}  // namespace kvflow::cpu
