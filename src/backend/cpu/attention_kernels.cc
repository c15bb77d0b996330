// The library is compiled for x86-64-v3 (the sanitizer build for plain x86-64), so every vector
// kernel carries a target attribute and is only reached through the run-time choice below.
#include "backend/cpu/attention_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backend/cpu/cpu_features.h"
#include "util/half.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors from self-initialized locals, which its
// uninitialized-use warnings flag once inlined into target functions (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define KVFLOW_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVFLOW_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
#define KVFLOW_ALWAYS_INLINE inline __attribute__((always_inline))

namespace kvflow::cpu {

namespace {

// exp(x) for x <= 0 (softmax arguments), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for e^r, scaled by 2^n; within 2 ulp. Below ln(FLT_MIN) the result is 0 (masked keys).
constexpr float kExpLow = -87.33654f;  // ln(FLT_MIN): 2^n stays a normal number above it
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln2 split so n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// ---- portable ----

constexpr int kChunk = kAttentionChunkKeys;

template <typename T>
float Widen(T x) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return HalfBitsToFloat(x);
  } else {
    return x;
  }
}

template <typename T>
void PackKeysPortable(const T* const* rows, int D, float* kt) {
  for (int j = 0; j < kChunk; ++j) {
    for (int d = 0; d < D; ++d) kt[d * kChunk + j] = Widen(rows[j][d]);
  }
}

void ScoresPortable(const float* q, int rows, const float* kt, int D, float scale, float* s, int ld) {
  for (int r = 0; r < rows; ++r) {
    float acc[kChunk] = {};
    for (int d = 0; d < D; ++d) {
      const float x = q[r * D + d];
      for (int j = 0; j < kChunk; ++j) acc[j] = std::fma(x, kt[d * kChunk + j], acc[j]);
    }
    for (int j = 0; j < kChunk; ++j) s[r * ld + j] = acc[j] * scale;
  }
}

float RowMaxPortable(const float* s, int n) {
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

float ExpAndSumPortable(float* s, int n, float max) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float x = s[j] - max;
    s[j] = x < kExpLow ? 0.0f : std::exp(x);
    sum += s[j];
  }
  return sum;
}

template <typename T>
void AccumulatePortable(const float* p, int rows, int ld, const T* const* v, int n, int D, float* o) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < n; ++j) {
      const float w = p[r * ld + j];
      for (int d = 0; d < D; ++d) o[r * D + d] = std::fma(w, Widen(v[j][d]), o[r * D + d]);
    }
  }
}

void HalfToFloatPortable(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]);
}

// ---- AVX2 (8 lanes) ----

KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE float HorizontalSum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Eight elements of a K or V row as fp32.
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

// r[i] (row i of an 8 x 8 block) becomes column i.
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE void Transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4 * half + k]: element 4 * lane + k of rows 4 * half .. 4 * half + 3, in each 128-bit lane.
  for (int half = 0; half < 2; ++half) {
    const __m256d a = _mm256_castps_pd(t[4 * half]), b = _mm256_castps_pd(t[4 * half + 1]);
    const __m256d c = _mm256_castps_pd(t[4 * half + 2]), d = _mm256_castps_pd(t[4 * half + 3]);
    u[4 * half + 0] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
    u[4 * half + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
    u[4 * half + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
    u[4 * half + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

template <typename T>
KVFLOW_TARGET_AVX2 void PackKeysAvx2(const T* const* rows, int D, float* kt) {
  for (int j = 0; j < kChunk; j += 8) {
    for (int d = 0; d < D; d += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = Load8(rows[j + i] + d);
      Transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d + i) * kChunk + j, r[i]);
    }
  }
}

// RB query rows x 32 keys per pass (RB * 4 accumulators, each one key group's FMA chain over d).
template <int RB>
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE void ScoreRowsAvx2(const float* q, const float* kt, int D, float scale,
                                                           float* s, int ld) {
  for (int half = 0; half < kChunk; half += 32) {
    __m256 a[RB][4];
    for (int i = 0; i < RB; ++i) {
      for (int t = 0; t < 4; ++t) a[i][t] = _mm256_setzero_ps();
    }
    for (int d = 0; d < D; ++d) {
      const float* k = kt + d * kChunk + half;
      const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      const __m256 k2 = _mm256_loadu_ps(k + 16), k3 = _mm256_loadu_ps(k + 24);
      for (int i = 0; i < RB; ++i) {
        const __m256 x = _mm256_broadcast_ss(q + i * D + d);
        a[i][0] = _mm256_fmadd_ps(x, k0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(x, k1, a[i][1]);
        a[i][2] = _mm256_fmadd_ps(x, k2, a[i][2]);
        a[i][3] = _mm256_fmadd_ps(x, k3, a[i][3]);
      }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < RB; ++i) {
      for (int t = 0; t < 4; ++t) _mm256_storeu_ps(s + i * ld + half + 8 * t, _mm256_mul_ps(a[i][t], sc));
    }
  }
}

KVFLOW_TARGET_AVX2 void ScoresAvx2(const float* q, int rows, const float* kt, int D, float scale, float* s, int ld) {
  int r = 0;
  for (; r + 2 <= rows; r += 2) ScoreRowsAvx2<2>(q + r * D, kt, D, scale, s + r * ld, ld);
  if (r < rows) ScoreRowsAvx2<1>(q + r * D, kt, D, scale, s + r * ld, ld);
}

KVFLOW_TARGET_AVX2 float RowMaxAvx2(const float* s, int n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float result = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) result = std::max(result, s[j]);
  return result;
}

KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE __m256 ExpAvx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kP5));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)), keep);
}

KVFLOW_TARGET_AVX2 float ExpAndSumAvx2(float* s, int n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    const __m256 e = ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  return HorizontalSum(acc);
}

// RB rows x 16 columns of the output in registers per pass over the keys: RB * 2 independent FMA
// chains, so a decode tile (one token's group of query heads) is not bound by FMA latency. Value
// rows are widened as they are loaded.
template <int RB, typename T>
KVFLOW_TARGET_AVX2 KVFLOW_ALWAYS_INLINE void AccumulateRowsAvx2(const float* p, int ld, const T* const* v, int n,
                                                                int D, float* o) {
  for (int d = 0; d < D; d += 16) {
    const bool two = d + 16 <= D;
    __m256 c[RB][2];
    for (int i = 0; i < RB; ++i) {
      c[i][0] = _mm256_loadu_ps(o + i * D + d);
      c[i][1] = two ? _mm256_loadu_ps(o + i * D + d + 8) : _mm256_setzero_ps();
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = Load8(v[j] + d);
      const __m256 v1 = two ? Load8(v[j] + d + 8) : _mm256_setzero_ps();
      for (int i = 0; i < RB; ++i) {
        const __m256 w = _mm256_broadcast_ss(p + i * ld + j);
        c[i][0] = _mm256_fmadd_ps(w, v0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(w, v1, c[i][1]);
      }
    }
    for (int i = 0; i < RB; ++i) {
      _mm256_storeu_ps(o + i * D + d, c[i][0]);
      if (two) _mm256_storeu_ps(o + i * D + d + 8, c[i][1]);
    }
  }
}

template <typename T>
KVFLOW_TARGET_AVX2 void AccumulateAvx2(const float* p, int rows, int ld, const T* const* v, int n, int D, float* o) {
  for (int r = 0; r < rows; r += 4) {
    const float* pr = p + r * ld;
    float* orow = o + r * D;
    switch (std::min(4, rows - r)) {
      case 4: AccumulateRowsAvx2<4>(pr, ld, v, n, D, orow); break;
      case 3: AccumulateRowsAvx2<3>(pr, ld, v, n, D, orow); break;
      case 2: AccumulateRowsAvx2<2>(pr, ld, v, n, D, orow); break;
      default: AccumulateRowsAvx2<1>(pr, ld, v, n, D, orow); break;
    }
  }
}

KVFLOW_TARGET_AVX2 void HalfToFloatAvx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]);
}

// ---- AVX-512 (16 lanes) ----

// Sixteen elements of a K or V row as fp32.
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 Load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

// r[i] (row i of a 16 x 16 block) becomes column i.
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE void Transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4 * quad + k]: element 4 * lane + k of rows 4 * quad .. 4 * quad + 3, in each 128-bit lane.
  for (int quad = 0; quad < 4; ++quad) {
    const __m512d a = _mm512_castps_pd(t[4 * quad]), b = _mm512_castps_pd(t[4 * quad + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * quad + 2]), d = _mm512_castps_pd(t[4 * quad + 3]);
    u[4 * quad + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * quad + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * quad + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * quad + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {
    // Lanes 0 and 2 (0x88) or 1 and 3 (0xdd) of rows 0-7, then of rows 8-15.
    const __m512 even_lo = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);
    const __m512 even_hi = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 odd_hi = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
    r[k] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xdd);
    r[4 + k] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xdd);
  }
}

template <typename T>
KVFLOW_TARGET_AVX512 void PackKeysAvx512(const T* const* rows, int D, float* kt) {
  for (int j = 0; j < kChunk; j += 16) {
    for (int d = 0; d < D; d += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = Load16(rows[j + i] + d);
      Transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d + i) * kChunk + j, r[i]);
    }
  }
}

// RB query rows x 64 keys of the packed chunk (RB * 4 accumulators, each a key group's FMA chain
// over d): each packed key vector is loaded once for all RB rows.
template <int RB>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE void ScoreRows64Avx512(const float* q, const float* kt, int D, float scale,
                                                                 float* s, int ld) {
  __m512 a[RB][4];
  for (int i = 0; i < RB; ++i) {
    for (int t = 0; t < 4; ++t) a[i][t] = _mm512_setzero_ps();
  }
  for (int d = 0; d < D; ++d) {
    const float* k = kt + d * kChunk;
    const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16);
    const __m512 k2 = _mm512_loadu_ps(k + 32), k3 = _mm512_loadu_ps(k + 48);
    for (int i = 0; i < RB; ++i) {
      const __m512 x = _mm512_set1_ps(q[i * D + d]);
      a[i][0] = _mm512_fmadd_ps(x, k0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(x, k1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(x, k2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(x, k3, a[i][3]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + i * ld + 16 * t, _mm512_mul_ps(a[i][t], sc));
  }
}

template <int RB>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE void ScoreRowsAvx512(const float* q, const float* kt, int D, float scale,
                                                               float* s, int ld) {
  static_assert(kChunk % 64 == 0);
  for (int first = 0; first < kChunk; first += 64) ScoreRows64Avx512<RB>(q, kt + first, D, scale, s + first, ld);
}

KVFLOW_TARGET_AVX512 void ScoresAvx512(const float* q, int rows, const float* kt, int D, float scale, float* s,
                                       int ld) {
  for (int r = 0; r < rows; r += 6) {
    const float* qr = q + r * D;
    float* sr = s + r * ld;
    switch (std::min(6, rows - r)) {
      case 6: ScoreRowsAvx512<6>(qr, kt, D, scale, sr, ld); break;
      case 5: ScoreRowsAvx512<5>(qr, kt, D, scale, sr, ld); break;
      case 4: ScoreRowsAvx512<4>(qr, kt, D, scale, sr, ld); break;
      case 3: ScoreRowsAvx512<3>(qr, kt, D, scale, sr, ld); break;
      case 2: ScoreRowsAvx512<2>(qr, kt, D, scale, sr, ld); break;
      default: ScoreRowsAvx512<1>(qr, kt, D, scale, sr, ld); break;
    }
  }
}

KVFLOW_TARGET_AVX512 float RowMaxAvx512(const float* s, int n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  float result = _mm512_reduce_max_ps(m);
  for (; j < n; ++j) result = std::max(result, s[j]);
  return result;
}

KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE __m512 ExpAvx512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kP0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kP5));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

KVFLOW_TARGET_AVX512 float ExpAndSumAvx512(float* s, int n, float max) {
  const __m512 m = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __m512 e = ExpAvx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// RB rows x 64 columns of the output in registers (RB * 4 accumulators, independent FMA chains)
// per pass over the keys; value rows widened as they are loaded.
template <int RB, typename T>
KVFLOW_TARGET_AVX512 KVFLOW_ALWAYS_INLINE void AccumulateRowsAvx512(const float* p, int ld, const T* const* v, int n,
                                                                    int D, float* o) {
  for (int d = 0; d < D; d += 64) {
    const int width = std::min(4, (D - d) / 16);
    __m512 c[RB][4];
    for (int i = 0; i < RB; ++i) {
      for (int w = 0; w < 4; ++w) c[i][w] = w < width ? _mm512_loadu_ps(o + i * D + d + 16 * w) : _mm512_setzero_ps();
    }
    if (width == 4) {
      for (int j = 0; j < n; ++j) {
        const T* vj = v[j] + d;
        const __m512 v0 = Load16(vj), v1 = Load16(vj + 16), v2 = Load16(vj + 32), v3 = Load16(vj + 48);
        for (int i = 0; i < RB; ++i) {
          const __m512 w = _mm512_set1_ps(p[i * ld + j]);
          c[i][0] = _mm512_fmadd_ps(w, v0, c[i][0]);
          c[i][1] = _mm512_fmadd_ps(w, v1, c[i][1]);
          c[i][2] = _mm512_fmadd_ps(w, v2, c[i][2]);
          c[i][3] = _mm512_fmadd_ps(w, v3, c[i][3]);
        }
      }
    } else {
      for (int j = 0; j < n; ++j) {
        for (int w = 0; w < width; ++w) {
          const __m512 vw = Load16(v[j] + d + 16 * w);
          for (int i = 0; i < RB; ++i) c[i][w] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * ld + j]), vw, c[i][w]);
        }
      }
    }
    for (int i = 0; i < RB; ++i) {
      for (int w = 0; w < width; ++w) _mm512_storeu_ps(o + i * D + d + 16 * w, c[i][w]);
    }
  }
}

template <typename T>
KVFLOW_TARGET_AVX512 void AccumulateAvx512(const float* p, int rows, int ld, const T* const* v, int n, int D,
                                           float* o) {
  for (int r = 0; r < rows; r += 6) {
    const float* pr = p + r * ld;
    float* orow = o + r * D;
    switch (std::min(6, rows - r)) {
      case 6: AccumulateRowsAvx512<6>(pr, ld, v, n, D, orow); break;
      case 5: AccumulateRowsAvx512<5>(pr, ld, v, n, D, orow); break;
      case 4: AccumulateRowsAvx512<4>(pr, ld, v, n, D, orow); break;
      case 3: AccumulateRowsAvx512<3>(pr, ld, v, n, D, orow); break;
      case 2: AccumulateRowsAvx512<2>(pr, ld, v, n, D, orow); break;
      default: AccumulateRowsAvx512<1>(pr, ld, v, n, D, orow); break;
    }
  }
}

KVFLOW_TARGET_AVX512 void HalfToFloatAvx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]);
}

constexpr AttentionKernels kPortable{"portable",
                                     PackKeysPortable<uint16_t>,
                                     PackKeysPortable<float>,
                                     ScoresPortable,
                                     RowMaxPortable,
                                     ExpAndSumPortable,
                                     AccumulatePortable<uint16_t>,
                                     AccumulatePortable<float>,
                                     HalfToFloatPortable};
constexpr AttentionKernels kAvx2{"avx2",          PackKeysAvx2<uint16_t>,   PackKeysAvx2<float>,
                                 ScoresAvx2,      RowMaxAvx2,               ExpAndSumAvx2,
                                 AccumulateAvx2<uint16_t>, AccumulateAvx2<float>, HalfToFloatAvx2};
constexpr AttentionKernels kAvx512{"avx512",          PackKeysAvx512<uint16_t>,   PackKeysAvx512<float>,
                                   ScoresAvx512,      RowMaxAvx512,               ExpAndSumAvx512,
                                   AccumulateAvx512<uint16_t>, AccumulateAvx512<float>, HalfToFloatAvx512};

enum class Level { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

Level DetectLevel() {
  const CpuFeatures& f = DetectedCpuFeatures();
  return f.avx512 ? Level::kAvx512 : f.avx2 ? Level::kAvx2 : Level::kPortable;
}

std::atomic<int> level_cap{static_cast<int>(Level::kAvx512)};

}  // namespace

const AttentionKernels& SelectAttentionKernels(int head_dim) {
  static const Level detected = DetectLevel();
  const int level = std::min(static_cast<int>(detected), level_cap.load(std::memory_order_relaxed));
  if (level >= static_cast<int>(Level::kAvx512) && head_dim % 16 == 0) return kAvx512;
  if (level >= static_cast<int>(Level::kAvx2) && head_dim % 8 == 0) return kAvx2;
  return kPortable;
}

const char* LimitAttentionIsa(const char* isa) {
  const Level cap = isa == nullptr                              ? Level::kAvx512
                    : std::strcmp(isa, "portable") == 0         ? Level::kPortable
                    : std::strcmp(isa, "avx2") == 0             ? Level::kAvx2
                                                                : Level::kAvx512;
  const int previous = level_cap.exchange(static_cast<int>(cap));
  return previous == static_cast<int>(Level::kAvx512)   ? nullptr
         : previous == static_cast<int>(Level::kAvx2) ? "avx2"
                                                        : "portable";
}

}  // namespace kvflow::cpu
