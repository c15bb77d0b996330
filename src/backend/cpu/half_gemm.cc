// fp16 / bf16 weight x fp32 activation products (see half_gemm.h).
//
// The whole library is compiled for x86-64-v3 (the sanitizer build for plain x86-64), so every
// intrinsic lives in a function with a target attribute and is only reached through the run-time
// dispatch below: a CPU without AVX-512 (or AVX2) never executes one of those instructions.
//
// Choices, measured with bench/half_gemm_bench.cc on a 2-core AMD EPYC (AVX-512) VM shared with other
// jobs, one thread (rough figures):
//  - Decode (M = 1) is bound by memory: ~16 GB/s of weights on 4096 x 4096 (the machine's read
//    bandwidth), ~10 on 576 x 1536. Software prefetch of the next tile's rows helps short rows only.
//  - Prefill: the direct 4 x 4 AVX-512 tiles run at 50-105 GFLOP/s for M = 64..256; widening tiles
//    of weights to fp32 for OpenBLAS sgemm got 20-57 and fp32 sgemm itself 40-83, so sgemm is off
//    by default (SetHalfSgemmMinRows).
//  - bf16: exact widening (a 16-bit shift, then fp32 FMA) at 51-105 GFLOP/s vs AVX512_BF16
//    vdpbf16ps on activations rounded to bf16 at 33-78, and the same GB/s at M = 1: widening is the
//    default, vdpbf16ps opt-in (SetHalfBf16DotProducts).
#include "backend/cpu/half_gemm.h"

#include "backend/cpu/cpu_features.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cstring>
#include <utility>
#include <vector>

#include "util/half.h"
#include "util/thread_pool.h"

// GCC 12's AVX-512 intrinsics build "undefined" vectors from self-initialized locals, which its
// uninitialized-use warnings flag once inlined into target functions (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define KVFLOW_HALF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVFLOW_HALF_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define KVFLOW_HALF_AVX512BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define KVFLOW_HALF_INLINE inline __attribute__((always_inline))

namespace kvflow::cpu {

namespace {

inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <bool kBf16>
KVFLOW_HALF_INLINE float Widen(uint16_t h) {
  return kBf16 ? Bf16ToFloat(h) : HalfBitsToFloat(h);
}

// A tile: RW weight rows x RA activation rows over the whole of K; writes y[a * ldy + r].
struct TileArgs {
  const uint8_t* w;  // first weight row of the tile
  size_t w_stride;   // bytes per weight row (2 * K)
  const float* x;    // first activation row of the tile
  int64_t ldx;       // floats per activation row
  const uint16_t* xh;  // the bf16-dot path: x rounded to bf16, rows of ldxh (a multiple of 32, zero-padded)
  int64_t ldxh;
  int64_t K;
  float* y;
  int64_t ldy;
  // Prefetch the weight rows this far (bytes) past the tile's while it runs, 0: none (a GEMV tile's
  // rows are parallel streams, which the hardware prefetchers follow poorly).
  size_t prefetch_distance;
};

// Prefetches the 64-byte line at byte `offset` of each of the tile's rows, `distance` bytes ahead.
// The addresses may run past the last row (prefetches never fault), hence integer arithmetic.
template <int RW>
KVFLOW_HALF_INLINE void PrefetchRows(const TileArgs& t, int64_t offset) {
  if (t.prefetch_distance == 0) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.w) + t.prefetch_distance + static_cast<uintptr_t>(offset);
  for (int r = 0; r < RW; ++r) __builtin_prefetch(reinterpret_cast<const void*>(base + r * t.w_stride), 0, 3);
}

template <int RW, int RA>
KVFLOW_HALF_INLINE void StoreTile(const TileArgs& t, const float (&sums)[RW][RA]) {
  for (int a = 0; a < RA; ++a) {
    for (int r = 0; r < RW; ++r) t.y[a * t.ldy + r] = sums[r][a];
  }
}

// ---- portable -----------------------------------------------------------------------------------

template <bool kBf16, int RW, int RA>
void TilePortable(const TileArgs& t) {
  float sums[RW][RA] = {};
  for (int64_t k = 0; k < t.K; ++k) {
    float w[RW];
    for (int r = 0; r < RW; ++r) w[r] = Widen<kBf16>(Load16(t.w + r * t.w_stride + 2 * k));
    for (int a = 0; a < RA; ++a) {
      const float xv = t.x[a * t.ldx + k];
      for (int r = 0; r < RW; ++r) sums[r][a] += w[r] * xv;
    }
  }
  StoreTile<RW, RA>(t, sums);
}

void WidenRowPortable(bool bf16, const uint8_t* src, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? Bf16ToFloat(Load16(src + 2 * i)) : HalfBitsToFloat(Load16(src + 2 * i));
}

// ---- AVX2 + F16C + FMA: 8 elements per step -------------------------------------------------------

template <bool kBf16>
KVFLOW_HALF_AVX2 KVFLOW_HALF_INLINE __m256 Widen8(__m128i h) {
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

KVFLOW_HALF_AVX2 KVFLOW_HALF_INLINE float HorizontalSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <bool kBf16, int RW, int RA>
KVFLOW_HALF_AVX2 void TileAvx2(const TileArgs& t) {
  __m256 acc[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) acc[r][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= t.K; k += 8) {
    if ((k & 31) == 0) PrefetchRows<RW>(t, 2 * k);
    __m256 xv[RA];
#pragma GCC unroll 4
    for (int a = 0; a < RA; ++a) xv[a] = _mm256_loadu_ps(t.x + a * t.ldx + k);
#pragma GCC unroll 4
    for (int r = 0; r < RW; ++r) {
      const __m256 wv =
          Widen8<kBf16>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t.w + r * t.w_stride + 2 * k)));
#pragma GCC unroll 4
      for (int a = 0; a < RA; ++a) acc[r][a] = _mm256_fmadd_ps(wv, xv[a], acc[r][a]);
    }
  }
  if (k < t.K) {  // the last K % 8 elements, zero-padded to a vector
    const int64_t rest = t.K - k;
    __m256 xv[RA];
    for (int a = 0; a < RA; ++a) {
      float buf[8] = {};
      std::memcpy(buf, t.x + a * t.ldx + k, sizeof(float) * rest);
      xv[a] = _mm256_loadu_ps(buf);
    }
    for (int r = 0; r < RW; ++r) {
      uint16_t buf[8] = {};
      std::memcpy(buf, t.w + r * t.w_stride + 2 * k, 2 * rest);
      const __m256 wv = Widen8<kBf16>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf)));
      for (int a = 0; a < RA; ++a) acc[r][a] = _mm256_fmadd_ps(wv, xv[a], acc[r][a]);
    }
  }
  float sums[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) sums[r][a] = HorizontalSum8(acc[r][a]);
  StoreTile<RW, RA>(t, sums);
}

KVFLOW_HALF_AVX2 void WidenRowAvx2(bool bf16, const uint8_t* src, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(out + i, bf16 ? Widen8<true>(h) : Widen8<false>(h));
  }
  WidenRowPortable(bf16, src + 2 * i, n - i, out + i);
}

// ---- AVX-512 (F, BW, VL): 16 elements per step, masked loads for the tail --------------------------

template <bool kBf16>
KVFLOW_HALF_AVX512 KVFLOW_HALF_INLINE __m512 Widen16(__m256i h) {
  if constexpr (kBf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(h);
  }
}

template <bool kBf16, int RW, int RA>
KVFLOW_HALF_AVX512 void TileAvx512(const TileArgs& t) {
  __m512 acc[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= t.K; k += 16) {
    if ((k & 31) == 0) PrefetchRows<RW>(t, 2 * k);
    __m512 xv[RA];
#pragma GCC unroll 4
    for (int a = 0; a < RA; ++a) xv[a] = _mm512_loadu_ps(t.x + a * t.ldx + k);
#pragma GCC unroll 4
    for (int r = 0; r < RW; ++r) {
      const __m512 wv =
          Widen16<kBf16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + r * t.w_stride + 2 * k)));
#pragma GCC unroll 4
      for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_fmadd_ps(wv, xv[a], acc[r][a]);
    }
  }
  if (k < t.K) {  // masked loads never touch (or fault on) the elements past K
    const __mmask16 mask = static_cast<__mmask16>((1u << (t.K - k)) - 1);
    __m512 xv[RA];
    for (int a = 0; a < RA; ++a) xv[a] = _mm512_maskz_loadu_ps(mask, t.x + a * t.ldx + k);
    for (int r = 0; r < RW; ++r) {
      const __m512 wv = Widen16<kBf16>(_mm256_maskz_loadu_epi16(mask, t.w + r * t.w_stride + 2 * k));
      for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_fmadd_ps(wv, xv[a], acc[r][a]);
    }
  }
  float sums[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) sums[r][a] = _mm512_reduce_add_ps(acc[r][a]);
  StoreTile<RW, RA>(t, sums);
}

KVFLOW_HALF_AVX512 void WidenRowAvx512(bool bf16, const uint8_t* src, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
    _mm512_storeu_ps(out + i, bf16 ? Widen16<true>(h) : Widen16<false>(h));
  }
  WidenRowPortable(bf16, src + 2 * i, n - i, out + i);
}

// ---- AVX512_BF16 (opt-in, SetHalfBf16DotProducts): activations rounded to bf16, vdpbf16ps ------------
// llama.cpp's way: 32 elements per instruction, pairs of bf16 products summed into fp32. The
// products lose the activations' low mantissa bits (bf16 keeps 8), so this is not the default.

KVFLOW_HALF_AVX512BF16 void RoundRowsToBf16(const float* x, int64_t rows, int64_t K, uint16_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * K;
    uint16_t* dst = out + r * ldo;
    for (int64_t k = 0; k < ldo; k += 16) {
      const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, K - k));
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));  // zeros past K
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)h);
    }
  }
}

template <int RW, int RA>
KVFLOW_HALF_AVX512BF16 void TileAvx512Bf16Dot(const TileArgs& t) {
  __m512 acc[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_setzero_ps();
  for (int64_t k = 0; k < t.K; k += 32) {
    PrefetchRows<RW>(t, 2 * k);
    const int64_t n = std::min<int64_t>(32, t.K - k);
    const __mmask32 mask = n == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
    __m512i xv[RA];
#pragma GCC unroll 4
    for (int a = 0; a < RA; ++a) xv[a] = _mm512_loadu_si512(t.xh + a * t.ldxh + k);
#pragma GCC unroll 4
    for (int r = 0; r < RW; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, t.w + r * t.w_stride + 2 * k);
#pragma GCC unroll 4
      for (int a = 0; a < RA; ++a) acc[r][a] = _mm512_dpbf16_ps(acc[r][a], (__m512bh)wv, (__m512bh)xv[a]);
    }
  }
  float sums[RW][RA];
  for (int r = 0; r < RW; ++r)
    for (int a = 0; a < RA; ++a) sums[r][a] = _mm512_reduce_add_ps(acc[r][a]);
  StoreTile<RW, RA>(t, sums);
}

// ---- dispatch -----------------------------------------------------------------------------------

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"portable", "avx2", "avx512"};

// Tile shapes (weight rows x activation rows), sized to the vector registers: RW * RA accumulators
// plus RA activation vectors and one weight vector: 11 of AVX2's 16 ymm, 21 of AVX-512's 32 zmm.
constexpr int kMaxTile = 4;
constexpr int TileRowsW(Isa) { return 4; }
constexpr int TileRowsA(Isa isa) { return isa == Isa::kAvx2 ? 2 : 4; }

using TileFn = void (*)(const TileArgs&);
struct TileTable {
  int rows_w, rows_a;
  std::array<std::array<TileFn, kMaxTile>, kMaxTile> tiles;  // [rw - 1][ra - 1]
};

template <Isa I, bool B, int RW, int RA>
constexpr TileFn TileFor() {
  if constexpr (RW > TileRowsW(I) || RA > TileRowsA(I)) {
    return nullptr;
  } else if constexpr (I == Isa::kAvx512) {
    return &TileAvx512<B, RW, RA>;
  } else if constexpr (I == Isa::kAvx2) {
    return &TileAvx2<B, RW, RA>;
  } else {
    return &TilePortable<B, RW, RA>;
  }
}

template <Isa I, bool B, int RW, size_t... A>
constexpr std::array<TileFn, kMaxTile> TileRow(std::index_sequence<A...>) {
  return {TileFor<I, B, RW, static_cast<int>(A) + 1>()...};
}

template <Isa I, bool B, size_t... R>
constexpr TileTable MakeTable(std::index_sequence<R...>) {
  return {TileRowsW(I), TileRowsA(I), {TileRow<I, B, static_cast<int>(R) + 1>(std::make_index_sequence<kMaxTile>())...}};
}

template <Isa I>
constexpr std::array<TileTable, 2> MakeTables() {
  constexpr auto seq = std::make_index_sequence<kMaxTile>();
  return {MakeTable<I, false>(seq), MakeTable<I, true>(seq)};
}

// [isa][bf16]
constexpr std::array<std::array<TileTable, 2>, 3> kTables = {MakeTables<Isa::kPortable>(), MakeTables<Isa::kAvx2>(),
                                                             MakeTables<Isa::kAvx512>()};

template <int RW, size_t... A>
constexpr std::array<TileFn, kMaxTile> Bf16DotRow(std::index_sequence<A...>) {
  return {&TileAvx512Bf16Dot<RW, static_cast<int>(A) + 1>...};
}
template <size_t... R>
constexpr TileTable MakeBf16DotTable(std::index_sequence<R...>) {
  return {kMaxTile, kMaxTile, {Bf16DotRow<static_cast<int>(R) + 1>(std::make_index_sequence<kMaxTile>())...}};
}
constexpr TileTable kBf16DotTable = MakeBf16DotTable(std::make_index_sequence<kMaxTile>());

Isa DetectIsa() {
  const CpuFeatures& f = DetectedCpuFeatures();
  return f.avx512 ? Isa::kAvx512 : f.avx2 ? Isa::kAvx2 : Isa::kPortable;
}

Isa DetectedIsa() {
  static const Isa detected = DetectIsa();
  return detected;
}

bool HasAvx512Bf16() {
  static const bool has = DetectedCpuFeatures().avx512_bf16;
  return has;
}

std::atomic<bool> bf16_dot{false};

std::atomic<int> isa_cap{static_cast<int>(Isa::kAvx512)};

Isa ActiveIsa() {
  return static_cast<Isa>(std::min(static_cast<int>(DetectedIsa()), isa_cap.load(std::memory_order_relaxed)));
}

// Rows up to this long (bytes) get software prefetches (see HalfMatmul).
constexpr size_t kMaxPrefetchRowBytes = 4096;
// Below this many multiply-adds per call a parallel region costs more than it saves.
constexpr int64_t kMinParallelMacs = 1 << 15;
// sgemm from this many activation rows on; 0: never, the default. Measured (bench/half_gemm_bench.cc,
// one thread, shared machine, rough): the direct AVX-512 tiles reach 50-95 GFLOP/s at M = 64..256,
// widen-then-sgemm 20-57 (tiles of 64 K floats) or 23-57 (1 M floats), fp32 sgemm itself 40-83.
std::atomic<int64_t> sgemm_min_rows{0};
// Floats of widened weights per sgemm tile (4 MiB; 64 K floats, a quarter of L2, was no faster).
constexpr int64_t kSgemmTileFloats = 1024 * 1024;

void WidenRow(Isa isa, bool bf16, const uint8_t* src, int64_t n, float* out) {
  switch (isa) {
    case Isa::kAvx512: WidenRowAvx512(bf16, src, n, out); return;
    case Isa::kAvx2: WidenRowAvx2(bf16, src, n, out); return;
    case Isa::kPortable: WidenRowPortable(bf16, src, n, out); return;
  }
}

// Prefill: tiles of weight rows widened to fp32 (one thread-local buffer per thread), each
// multiplied by all of x with sgemm (single-threaded OpenBLAS; the pool splits the tiles).
void SgemmMatmul(Isa isa, bool bf16, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                 int64_t ldy) {
  int64_t tile = std::clamp<int64_t>(kSgemmTileFloats / K / 16 * 16, 16, 512);
  // Every thread gets work: at most ceil(N / threads) rows per tile.
  const int64_t threads = CurrentThreads();
  const int64_t per_thread = (N + threads - 1) / threads;
  tile = std::max<int64_t>(1, std::min(tile, per_thread));
  ParallelFor(
      N,
      [&](int64_t n_begin, int64_t n_end) {
        thread_local std::vector<float> widened;
        for (int64_t n = n_begin; n < n_end; n += tile) {
          const int64_t rows = std::min(tile, n_end - n);
          if (widened.size() < static_cast<size_t>(rows * K)) widened.resize(static_cast<size_t>(rows * K));
          WidenRow(isa, bf16, w + 2 * n * K, rows * K, widened.data());
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(M), static_cast<blasint>(rows),
                      static_cast<blasint>(K), 1.0f, x, static_cast<blasint>(K), widened.data(),
                      static_cast<blasint>(K), 0.0f, y + n, static_cast<blasint>(ldy));
        }
      },
      tile, threads > 1 && N > tile ? 2 : N + 1);
}

}  // namespace

void HalfMatmul(DType w_type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                int64_t ldy) {
  assert(IsHalfWeightType(w_type) && "HalfMatmul: weights are not F16 or BF16");
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy, y + m * ldy + N, 0.0f);
    return;
  }
  const bool bf16 = w_type == DType::kBF16;
  const Isa isa = ActiveIsa();
  const int64_t sgemm_rows = sgemm_min_rows.load(std::memory_order_relaxed);
  if (sgemm_rows > 0 && M >= sgemm_rows) {
    SgemmMatmul(isa, bf16, x, M, K, w, N, y, ldy);
    return;
  }
  const TileTable* table_ptr = &kTables[static_cast<int>(isa)][bf16 ? 1 : 0];
  // The opt-in bf16 dot-product path: x rounded to bf16 once per call, rows padded to 32 elements.
  // (The buffer is the calling thread's; the workers get its address.)
  thread_local std::vector<uint16_t> x_bf16;
  const int64_t ldxh = (K + 31) / 32 * 32;
  const uint16_t* xh = nullptr;
  if (bf16 && isa == Isa::kAvx512 && HasAvx512Bf16() && bf16_dot.load(std::memory_order_relaxed)) {
    if (x_bf16.size() < static_cast<size_t>(M * ldxh)) x_bf16.resize(static_cast<size_t>(M * ldxh));
    RoundRowsToBf16(x, M, K, x_bf16.data(), ldxh);
    xh = x_bf16.data();
    table_ptr = &kBf16DotTable;
  }
  const TileTable& table = *table_ptr;
  const size_t w_stride = static_cast<size_t>(2 * K);
  // Each thread takes a contiguous run of weight rows (whole tiles), so it streams its part of the
  // weights once; within it, a tile of weight rows meets every tile of activation rows.
  const int64_t threads = CurrentThreads();
  const int64_t rows_per_thread = (N + threads - 1) / threads;
  const int64_t chunk = (rows_per_thread + table.rows_w - 1) / table.rows_w * table.rows_w;
  const bool parallel = threads > 1 && N > table.rows_w && N * M * K >= kMinParallelMacs;
  // Software prefetch of the next tile's rows pays on short rows (GEMV on 576 x 1536: ~+12%, on
  // 1536 x 576: ~+3%) and costs on long ones (4096 x 4096: ~-5%), where the hardware prefetchers
  // keep up with the streams (bench/half_gemm_bench.cc, one thread, rough).
  const bool prefetch_rows = w_stride <= kMaxPrefetchRowBytes;
  ParallelFor(
      N,
      [&](int64_t n_begin, int64_t n_end) {
        for (int64_t n = n_begin; n < n_end; n += table.rows_w) {
          const int64_t tile_w = std::min<int64_t>(table.rows_w, n_end - n);
          for (int64_t m = 0; m < M; m += table.rows_a) {
            const int64_t tile_a = std::min<int64_t>(table.rows_a, M - m);
            // The first activation tile brings the weights in; the others find them in cache.
            const size_t prefetch = prefetch_rows && m == 0 && n + table.rows_w < n_end ? table.rows_w * w_stride : 0;
            const TileArgs args{w + n * w_stride, w_stride, x + m * K, K,   xh ? xh + m * ldxh : nullptr,
                                ldxh,             K,        y + m * ldy + n, ldy, prefetch};
            table.tiles[tile_w - 1][tile_a - 1](args);
          }
        }
      },
      chunk, parallel ? 2 : N + 1);
}

void HalfToFloatRow(DType w_type, const uint8_t* src, int64_t n, float* out) {
  assert(IsHalfWeightType(w_type));
  WidenRow(ActiveIsa(), w_type == DType::kBF16, src, n, out);
}

const char* HalfKernelIsa() { return kIsaNames[static_cast<int>(ActiveIsa())]; }

const char* LimitHalfKernelIsa(const char* isa) {
  int cap = static_cast<int>(Isa::kAvx512);
  if (isa != nullptr) {
    for (int i = 0; i < 3; ++i) {
      if (std::strcmp(isa, kIsaNames[i]) == 0) cap = i;
    }
  }
  const int previous = isa_cap.exchange(cap);
  return previous == static_cast<int>(Isa::kAvx512) ? nullptr : kIsaNames[previous];
}

int64_t SetHalfSgemmMinRows(int64_t rows) { return sgemm_min_rows.exchange(rows); }

bool HalfBf16DotAvailable() { return HasAvx512Bf16(); }

bool SetHalfBf16DotProducts(bool on) { return bf16_dot.exchange(on); }

}  // namespace kvflow::cpu
