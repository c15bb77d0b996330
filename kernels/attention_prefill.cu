// Paged prefill attention (flash-attention-2 style) on tensor cores: see attention_prefill.h.
//
// Work decomposition. One CTA of 4 warps handles one (sequence, kv head, tile of kBlockM "rows").
// A row is one (query token, query head) pair of the GQA group that shares the kv head, packed
// token-major: row m <-> token m / group, head kv_head * group + m % group. For short query
// chunks (decode-like rows, chunked-prefill tails over a long cached prefix) this fills the tile
// with the group's heads, so each K/V tile is gathered once for the whole group instead of once
// per query head, and far fewer tile rows are padding; for long prompts it costs the same as
// per-head tiling (and its diagonal tiles span fewer positions). Each warp owns 16 * kMTiles
// consecutive rows; the K/V loop walks the sequence's keys 0 .. (last position of the tile) in
// tiles of kBlockN tokens gathered from the paged cache through the block table with cp.async,
// double-buffered so the next tile's copy overlaps this tile's math.
//
// Per K/V tile and warp: S = Q K^T (mma.m16n8k16, fp32 accumulators), causal mask on tiles that
// reach past the warp's first position, online softmax (running row max m and row sum l in fp32,
// exp2 with the scale folded in), then O += P V with P converted to fp16/bf16 in registers: the
// accumulator layout of S is exactly the A-fragment layout of P (FA2 register reuse). At the end
// O / l is staged through shared memory (the warp's own Q rows) for 16-byte coalesced stores.
// The optional LSE of a row is ln 2 * (m * scale_log2 + log2(l)) from the same running max and sum
// (l sums the fp32 probabilities; only their copies fed to the P V mma are rounded).
//
// Grid: x = row tiles (reversed, so the longest causal tiles start first), y = kv heads,
// z = sequences. CTAs whose tile lies beyond their sequence's rows exit at once.
#include "attention_prefill.h"

#include "device_utils.cuh"

namespace kvflow::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 64;  // keys per K/V tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct PrefillParams {
  void* out;
  int64_t out_row_stride;
  const void* query;
  int64_t query_row_stride;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int block_table_stride;
  const int32_t* query_starts;
  const int32_t* query_lens;
  const int32_t* context_lens;
  int num_kv_heads;
  int group;        // query heads per kv head
  int block_size;   // a power of two
  int block_shift;  // log2(block_size)
  float scale_log2;  // softmax scale * log2(e): p = exp2(s * scale_log2 - max * scale_log2)
  float* lse;        // [rows][num_kv_heads * group] or nullptr
  int window;        // PagedAttentionArgs::window
  // PagedAttentionArgs::softcap > 0: raw scores s become cap_over_scale * tanh(s * scale_over_cap)
  // before the mask, so that * scale_log2 gives softcap * tanh(scale * s / softcap) * log2(e).
  float softcap;
  float scale_over_cap;
  float cap_over_scale;
};

// 16 bytes moved as one vector load/store (ld/st .v4.b32).
struct alignas(16) Vec16 {
  uint32_t v[4];
};

template <int kHeadDim, int kMTiles, typename T>
struct PrefillConfig {
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  // Shared-memory row pitch in elements: 16 bytes of padding shift consecutive rows by 4 banks, so
  // the 8 row addresses of every ldmatrix 8x8 matrix (and the 4-byte O staging stores) hit 8
  // distinct 16-byte bank groups: conflict-free without a swizzle.
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per head row
  // Q fragments of the warp's rows kept in registers across the K/V loop (16 * kHeadDim * kMTiles
  // / 32 / 2 registers) when that is cheap; otherwise reloaded from shared memory per tile.
  static constexpr bool kQInRegs = kHeadDim * kMTiles <= 128;
  static constexpr size_t kSmemBytes = static_cast<size_t>(kBlockM + 4 * kBlockN) * kStride * sizeof(T);
};

__device__ __forceinline__ int IMin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int IMax(int a, int b) { return a > b ? a : b; }

// dev::PackTwo with one paired conversion (cvt.rn.f16x2.f32 / .bf16x2): same rounding, half the
// conversion instructions, and this runs for every element of P and O.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&bits, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &h, 4);
  }
  return bits;
}

// kLse: whether the kernel writes p.lse. A separate instantiation, so that launches without an LSE
// run exactly the code they ran before (the 128-row head_dim 128 kernel sits at 255 registers; its
// LSE variant spills 8 bytes).
template <typename T, int kHeadDim, int kMTiles, bool kLse>
__global__ void __launch_bounds__(kThreads) PagedPrefillKernel(const PrefillParams p) {
  using Cfg = PrefillConfig<kHeadDim, kMTiles, T>;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kStride = Cfg::kStride;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kNB = kBlockN / 8;    // n-blocks of S (8 keys each)
  constexpr int kDB = kHeadDim / 8;   // n-blocks of O (8 dims each)
  constexpr int kKD = kHeadDim / 16;  // k-steps of Q K^T (16 dims each)
  constexpr int kKN = kBlockN / 16;   // k-steps of P V (16 keys each)

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int group = p.group;
  const int qlen = p.query_lens[seq];
  const int rows = qlen * group;  // packed (token, head) rows of this sequence and kv head
  const int tile_m0 = m_block * kBlockM;
  if (tile_m0 >= rows) return;  // uniform over the CTA: before any barrier

  const int ctx = p.context_lens[seq];
  const int q_start = p.query_starts[seq];
  const int pos0 = ctx - qlen;  // position of query token 0
  const int tile_rows = IMin(kBlockM, rows - tile_m0);
  // The tile's last row has the largest position: keys 0 .. kv_len - 1 are all it can see.
  const int kv_len = pos0 + (tile_m0 + tile_rows - 1) / group + 1;
  const int n_tiles = (kv_len + kBlockN - 1) / kBlockN;
  // Sliding window: the tile's first row sees keys from kv_first on, every later row from later.
  const int kv_first = p.window > 0 ? IMax(0, pos0 + tile_m0 / group - p.window + 1) : 0;
  const int first_tile = kv_first / kBlockN;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // fragment coordinates (see MmaM16N8K16)
  const int warp_row0 = warp * 16 * kMTiles;

  KVFLOW_DYNAMIC_SMEM(T, smem);
  T* const sQ = smem;                         // [kBlockM][kStride]
  T* const sK = sQ + kBlockM * kStride;       // [2][kBlockN][kStride]
  T* const sV = sK + 2 * kBlockN * kStride;   // [2][kBlockN][kStride]

  const T* const query = static_cast<const T*>(p.query);
  const T* const key_cache = static_cast<const T*>(p.key_cache);
  const T* const value_cache = static_cast<const T*>(p.value_cache);
  const int32_t* const block_table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.block_size * kHeadDim;
  const int64_t block_stride = static_cast<int64_t>(p.num_kv_heads) * p.block_size * kHeadDim;

  // ---- Q tile -> shared memory (rows past the sequence's rows are zero-filled) ----------------------
  static_assert(kBlockM * kChunks % kThreads == 0 && kBlockN * kChunks % kThreads == 0, "whole copy passes");
  constexpr int kRowsPerPass = kThreads / kChunks;  // rows one pass of 16-byte copies covers
  const int load_chunk = tid % kChunks;
  const int load_row0 = tid / kChunks;
#pragma unroll
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
    const int r = load_row0 + i * kRowsPerPass;
    const int m = tile_m0 + r;
    const bool valid = m < rows;
    const T* src = query;
    if (valid) {
      const int token = m / group;
      const int head = kv_head * group + (m - token * group);
      src += static_cast<int64_t>(q_start + token) * p.query_row_stride + head * kHeadDim + load_chunk * 8;
    }
    dev::CpAsync16(sQ + r * kStride + load_chunk * 8, src, valid);
  }
  dev::CpAsyncCommit();

  // ---- K/V tile `tile` -> stage: each thread copies one 16-byte chunk column of kBlockN /
  // kRowsPerPass token rows. Token n lives in block block_table[n / block_size], slot
  // n % block_size; keys at or past kv_len are zero-filled and never read (the cache may hold
  // anything there, even NaN, and a zero V row times p = 0 stays 0).
  // Per-thread bases: this kv head's span of a block plus the thread's chunk column.
  const T* const k_base = key_cache + head_offset + load_chunk * 8;
  const T* const v_base = value_cache + head_offset + load_chunk * 8;
  auto load_kv = [&](int tile, int stage) {
    const int n0 = tile * kBlockN;
#pragma unroll 2
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int r = load_row0 + i * kRowsPerPass;
      const int key = n0 + r;
      const bool valid = key < kv_len && key >= kv_first;
      int64_t offset = 0;
      if (valid) {
        offset = static_cast<int64_t>(block_table[key >> p.block_shift]) * block_stride +
                 (key & (p.block_size - 1)) * kHeadDim;
      }
      const int dst = (stage * kBlockN + r) * kStride + load_chunk * 8;
      dev::CpAsync16(sK + dst, valid ? k_base + offset : key_cache, valid);
      dev::CpAsync16(sV + dst, valid ? v_base + offset : value_cache, valid);
    }
  };
  load_kv(first_tile, 0);
  dev::CpAsyncCommit();

  // ---- per-thread row bookkeeping ---------------------------------------------------------------------
  // Thread holds rows g (h = 0) and g + 8 (h = 1) of each of its warp's 16-row m-tiles. pos = -1
  // marks a row past the sequence's rows: it is computed like any other (masked everywhere, its
  // result discarded), which keeps every mma warp-uniform.
  int pos[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = tile_m0 + warp_row0 + mt * 16 + g + 8 * h;
      pos[mt][h] = m < rows ? pos0 + m / group : -1;
    }
  }
  // Positions of the warp's first and last valid rows: key tiles past warp_max_pos are skipped by
  // the warp, tiles ending at or before warp_min_pos need no mask.
  const int warp_first = tile_m0 + warp_row0;
  const int warp_last = IMin(warp_first + 16 * kMTiles, rows) - 1;
  const int warp_min_pos = warp_first <= warp_last ? pos0 + warp_first / group : -1;
  const int warp_max_pos = warp_first <= warp_last ? pos0 + warp_last / group : -1;

  float o[kMTiles][kDB][4];  // O accumulators: o[mt][db][e] = O[row g + 8(e/2)][dim 8 db + 2t + e%2]
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];  // this thread's partial sum over its columns; quad-reduced at the end
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int db = 0; db < kDB; ++db) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][db][e] = 0.0f;
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  // ldmatrix row addresses (lane-dependent parts). For an A fragment (16 rows x 16 k) matrix
  // i = lane / 8 covers rows (i % 2) * 8 .. +7, columns (i / 2) * 8 .. +7, so r[0..3] = a[0..3]:
  const int a_row = lane % 16, a_col = (lane / 16) * 8;
  // For K^T B fragments from K rows [key][dim]: matrix 0 = keys 0-7 x dims 0-7 (b[0] of n-block 0),
  // 1 = keys 0-7 x dims 8-15 (b[1] of n-block 0), 2 and 3 the same for keys 8-15 (n-block 1). A
  // non-transposed 8x8 load gives lane (g, t) K[key g][dims 2t, 2t+1] = B[k = 2t, 2t+1][n = g].
  const int k_row = (lane / 16) * 8 + lane % 8, k_col = ((lane / 8) % 2) * 8;
  // For V B fragments from V rows [key][dim] (transposed loads): matrix 0 = keys 0-7 x dims 0-7
  // (b[0] of dim-block 0), 1 = keys 8-15 x dims 0-7 (b[1]), 2 and 3 the same for dims 8-15
  // (dim-block 1). .trans gives lane (g, t) V[keys 2t, 2t+1][dim g] = B[k = 2t, 2t+1][n = g].
  const int v_row = lane % 16, v_col = (lane / 16) * 8;

  uint32_t q_frag[Cfg::kQInRegs ? kMTiles : 1][Cfg::kQInRegs ? kKD : 1][4];
  if constexpr (Cfg::kQInRegs) {
    dev::CpAsyncWait<1>();  // the Q group (K/V tile 0 may still be in flight)
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int kd = 0; kd < kKD; ++kd) {
        dev::LdMatrixX4(q_frag[mt][kd], sQ + (warp_row0 + mt * 16 + a_row) * kStride + kd * 16 + a_col);
      }
    }
  }

  for (int it = first_tile; it < n_tiles; ++it) {
    const int stage = (it - first_tile) & 1;
    // Prefetch the next tile into the other stage (freed by the barrier that ended the previous
    // iteration), then wait for this one.
    if (it + 1 < n_tiles) {
      load_kv(it + 1, stage ^ 1);
      dev::CpAsyncCommit();
      dev::CpAsyncWait<1>();
    } else {
      dev::CpAsyncWait<0>();
    }
    __syncthreads();

    const int n0 = it * kBlockN;
    if (n0 <= warp_max_pos) {  // warp-uniform: otherwise every key of the tile is above the diagonal
      const T* const k_tile = sK + stage * kBlockN * kStride;
      const T* const v_tile = sV + stage * kBlockN * kStride;

      // ---- S = Q K^T: s[mt][nb][e] = S[row g + 8(e/2)][key n0 + 8 nb + 2t + e%2] ---------------------
      float s[kMTiles][kNB][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.0f;
        }
      }
#pragma unroll
      for (int kd = 0; kd < kKD; ++kd) {
        uint32_t qa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          if constexpr (Cfg::kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) qa[mt][i] = q_frag[mt][kd][i];
          } else {
            dev::LdMatrixX4(qa[mt], sQ + (warp_row0 + mt * 16 + a_row) * kStride + kd * 16 + a_col);
          }
        }
#pragma unroll
        for (int np = 0; np < kNB / 2; ++np) {
          uint32_t kb[4];  // kb[0..1]: keys 16np + 0..7, kb[2..3]: keys 16np + 8..15; dims 16kd..+15
          dev::LdMatrixX4(kb, k_tile + (np * 16 + k_row) * kStride + kd * 16 + k_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            dev::MmaM16N8K16<T>(s[mt][2 * np], qa[mt], kb);
            dev::MmaM16N8K16<T>(s[mt][2 * np + 1], qa[mt], kb + 2);
          }
        }
      }

      if (p.softcap > 0.0f) {  // Gemma-2's soft cap, before the mask (it maps -inf nowhere)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nb][e] = p.cap_over_scale * tanhf(s[mt][nb][e] * p.scale_over_cap);
          }
        }
      }

      // ---- causal mask (also covers the zero-filled keys >= kv_len, which exceed every position) ----
      // and the sliding window's (covering the zero-filled keys before kv_first).
      const bool window_mask = p.window > 0 && n0 <= warp_max_pos - p.window;
      if (n0 + kBlockN - 1 > warp_min_pos || window_mask) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = n0 + nb * 8 + 2 * t + (e & 1);
              const int q = pos[mt][e >> 1];
              if (key > q || (window_mask && q - key >= p.window)) s[mt][nb][e] = -INFINITY;
            }
          }
        }
      }

      // ---- online softmax; P overwrites S in place ---------------------------------------------------
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = row_max[mt][h];
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) mx = fmaxf(mx, fmaxf(s[mt][nb][2 * h], s[mt][nb][2 * h + 1]));
          // The 4 lanes of a quad (same g) hold the row's 64 columns between them.
          mx = fmaxf(mx, __shfl_xor_sync(dev::kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(dev::kFullMask, mx, 2));
          // A row masked so far has max -inf: use 0 as its base so exp2 gives 0, not NaN.
          const float base = mx == -INFINITY ? 0.0f : mx * p.scale_log2;
          const float alpha = exp2f(row_max[mt][h] * p.scale_log2 - base);  // -inf old max -> 0
          row_max[mt][h] = mx;
          float sum = 0.0f;
#pragma unroll
          for (int nb = 0; nb < kNB; ++nb) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float pv = exp2f(s[mt][nb][2 * h + j] * p.scale_log2 - base);
              s[mt][nb][2 * h + j] = pv;
              sum += pv;
            }
          }
          row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
#pragma unroll
          for (int db = 0; db < kDB; ++db) {
            o[mt][db][2 * h] *= alpha;
            o[mt][db][2 * h + 1] *= alpha;
          }
        }
      }

      // ---- O += P V -----------------------------------------------------------------------------------
#pragma unroll
      for (int kn = 0; kn < kKN; ++kn) {
        // A fragment of P for keys 16kn..16kn+15 from the S accumulators of n-blocks 2kn, 2kn+1:
        // a[0] = P[g][16kn + 2t, +1]      = s[2kn][0..1]     a[1] = P[g+8][16kn + 2t, +1] = s[2kn][2..3]
        // a[2] = P[g][16kn + 8 + 2t, +1]  = s[2kn+1][0..1]   a[3] = P[g+8][16kn + 8 + 2t, +1] = s[2kn+1][2..3]
        uint32_t pa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          pa[mt][0] = PackPair<T>(s[mt][2 * kn][0], s[mt][2 * kn][1]);
          pa[mt][1] = PackPair<T>(s[mt][2 * kn][2], s[mt][2 * kn][3]);
          pa[mt][2] = PackPair<T>(s[mt][2 * kn + 1][0], s[mt][2 * kn + 1][1]);
          pa[mt][3] = PackPair<T>(s[mt][2 * kn + 1][2], s[mt][2 * kn + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kDB / 2; ++dp) {
          uint32_t vb[4];  // vb[0..1]: dims 16dp + 0..7, vb[2..3]: dims 16dp + 8..15; keys 16kn..+15
          dev::LdMatrixX4Trans(vb, v_tile + (kn * 16 + v_row) * kStride + dp * 16 + v_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            dev::MmaM16N8K16<T>(o[mt][2 * dp], pa[mt], vb);
            dev::MmaM16N8K16<T>(o[mt][2 * dp + 1], pa[mt], vb + 2);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next prefetch overwrites it
  }

  // ---- O / l -> the warp's own rows of sQ -> 16-byte stores -----------------------------------------
  // Only this warp ever read these rows of sQ, and the loop's last barrier ordered those reads.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mt][h];
      l += __shfl_xor_sync(dev::kFullMask, l, 1);
      l += __shfl_xor_sync(dev::kFullMask, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // l == 0 only for discarded rows
      T* const dst_row = sQ + (warp_row0 + mt * 16 + g + 8 * h) * kStride + 2 * t;
      if (kLse && t == 0) {
        const int m = tile_m0 + warp_row0 + mt * 16 + g + 8 * h;
        if (m < rows) {
          const int token = m / group;
          const int head = kv_head * group + (m - token * group);
          p.lse[static_cast<int64_t>(q_start + token) * (p.num_kv_heads * group) + head] =
              (row_max[mt][h] * p.scale_log2 + log2f(l)) * kLn2;
        }
      }
#pragma unroll
      for (int db = 0; db < kDB; ++db) {
        *reinterpret_cast<uint32_t*>(dst_row + db * 8) =
            PackPair<T>(o[mt][db][2 * h] * inv, o[mt][db][2 * h + 1] * inv);
      }
    }
  }
  __syncwarp();
  T* const out = static_cast<T*>(p.out);
  static_assert(16 * kChunks % 32 == 0, "whole store passes");
  // Not unrolled (runs once per CTA): the 128-row, head_dim 128 kernel sits at 255 registers, and
  // these unroll factors (here and in load_kv) are the ones with which ptxas reports no spills for
  // all eight instantiations without an LSE (check with -Xptxas=-v after changes).
#pragma unroll 1
  for (int i = 0; i < 16 * kMTiles * kChunks / 32; ++i) {
    const int idx = lane + 32 * i;
    const int r = idx / kChunks, c = idx % kChunks;
    const int m = warp_first + r;
    if (m < rows) {
      const int token = m / group;
      const int head = kv_head * group + (m - token * group);
      T* const dst = out + static_cast<int64_t>(q_start + token) * p.out_row_stride + head * kHeadDim + c * 8;
      *reinterpret_cast<Vec16*>(dst) = *reinterpret_cast<const Vec16*>(sQ + (warp_row0 + r) * kStride + c * 8);
    }
  }
}

template <typename T, int kHeadDim, int kMTiles>
int LaunchPrefill(const PrefillParams& params, int max_rows, int num_kv_heads, int num_seqs, void* stream) {
  using Cfg = PrefillConfig<kHeadDim, kMTiles, T>;
  const dim3 grid((max_rows + Cfg::kBlockM - 1) / Cfg::kBlockM, num_kv_heads, num_seqs);
  if (params.lse) {
    return LaunchKernel(PagedPrefillKernel<T, kHeadDim, kMTiles, true>, grid, dim3(kThreads), Cfg::kSmemBytes,
                        stream, params);
  }
  return LaunchKernel(PagedPrefillKernel<T, kHeadDim, kMTiles, false>, grid, dim3(kThreads), Cfg::kSmemBytes, stream,
                      params);
}

// block_m: rows per CTA, 64 or 128, or 0 to choose. 128-row tiles (32 rows per warp) halve the
// shared-memory and L2 traffic per mma against 64-row tiles; 64-row tiles waste less on short
// query chunks and make twice the CTAs, which wins when 128-row tiles would not even fill one wave
// of an H100 (132 SMs x 2 resident CTAs: both variants fit two per SM by registers and smem).
template <typename T, int kHeadDim>
int DispatchTile(const PrefillParams& params, int block_m, int max_rows, int num_kv_heads, int num_seqs,
                 void* stream) {
  if (block_m == 0) {
    const int64_t big_ctas = static_cast<int64_t>((max_rows + 127) / 128) * num_kv_heads * num_seqs;
    block_m = max_rows <= 64 || big_ctas < 2 * 132 ? 64 : 128;
  }
  // head_dim 256 (Gemma): 64-row tiles only; 32 rows per warp would hold 256 fp32 O accumulators per thread.
  if constexpr (kHeadDim > 128) {
    return LaunchPrefill<T, kHeadDim, 1>(params, max_rows, num_kv_heads, num_seqs, stream);
  } else {
    if (block_m == 64) return LaunchPrefill<T, kHeadDim, 1>(params, max_rows, num_kv_heads, num_seqs, stream);
    return LaunchPrefill<T, kHeadDim, 2>(params, max_rows, num_kv_heads, num_seqs, stream);
  }
}

bool IsPowerOfTwo(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

bool PagedPrefillSupports(int head_dim, int block_size) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && IsPowerOfTwo(block_size) && block_size >= 8 &&
         block_size <= 256;
}

namespace detail {

// PagedAttentionPrefill with the CTA tile height forced (64 or 128 rows; 0 = the launcher's
// choice), so that tests cover both tile shapes on small problems. Not part of the public header.
int PagedAttentionPrefillTiled(const PagedPrefillArgs& a, int block_m, void* stream) {
  if (block_m != 0 && block_m != 64 && block_m != 128) return kInvalidValue;
  if (a.dtype != DType::kF16 && a.dtype != DType::kBF16) return kInvalidValue;
  if (!PagedPrefillSupports(a.head_dim, a.block_size)) return kInvalidValue;
  if (a.num_seqs < 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return kInvalidValue;
  }
  if (!(a.scale > 0.0f) || a.scale == INFINITY) return kInvalidValue;  // the -inf masking assumes scale > 0
  if (a.num_seqs == 0) return 0;
  if (a.max_query_len <= 0 || a.block_table_stride <= 0 || a.num_seqs > 65535 || a.num_kv_heads > 65535 ||
      a.window < 0 || !(a.softcap >= 0.0f)) {
    return kInvalidValue;
  }
  if (!a.out || !a.query || !a.key_cache || !a.value_cache || !a.block_tables || !a.query_starts ||
      !a.query_lens || !a.context_lens) {
    return kInvalidValue;
  }
  // 16-byte copies of head rows: row strides and base pointers must keep every head 16-byte aligned.
  const int64_t row_elems = static_cast<int64_t>(a.num_heads) * a.head_dim;
  if (a.query_row_stride < row_elems || a.out_row_stride < row_elems || a.query_row_stride % 8 != 0 ||
      a.out_row_stride % 8 != 0) {
    return kInvalidValue;
  }
  for (const void* ptr : {static_cast<const void*>(a.out), a.query, a.key_cache, a.value_cache}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return kInvalidValue;
  }
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t max_rows = static_cast<int64_t>(a.max_query_len) * group;
  if (max_rows > (int64_t{1} << 30)) return kInvalidValue;

  PrefillParams params;
  params.out = a.out;
  params.out_row_stride = a.out_row_stride;
  params.query = a.query;
  params.query_row_stride = a.query_row_stride;
  params.key_cache = a.key_cache;
  params.value_cache = a.value_cache;
  params.block_tables = a.block_tables;
  params.block_table_stride = a.block_table_stride;
  params.query_starts = a.query_starts;
  params.query_lens = a.query_lens;
  params.context_lens = a.context_lens;
  params.num_kv_heads = a.num_kv_heads;
  params.group = group;
  params.block_size = a.block_size;
  params.block_shift = 0;
  while ((1 << params.block_shift) < a.block_size) ++params.block_shift;
  params.scale_log2 = a.scale * kLog2e;
  params.lse = a.lse;
  params.window = a.window;
  params.softcap = a.softcap;
  params.scale_over_cap = a.softcap > 0.0f ? a.scale / a.softcap : 0.0f;
  params.cap_over_scale = a.softcap > 0.0f ? a.softcap / a.scale : 0.0f;

  const int rows = static_cast<int>(max_rows);
  KVFLOW_DISPATCH_HALF_DTYPE(a.dtype, T, {
    if (a.head_dim == 64) return DispatchTile<T, 64>(params, block_m, rows, a.num_kv_heads, a.num_seqs, stream);
    if (a.head_dim == 128) return DispatchTile<T, 128>(params, block_m, rows, a.num_kv_heads, a.num_seqs, stream);
    return DispatchTile<T, 256>(params, block_m, rows, a.num_kv_heads, a.num_seqs, stream);
  });
  return kInvalidValue;
}

}  // namespace detail

int PagedAttentionPrefill(const PagedPrefillArgs& args, void* stream) {
  return detail::PagedAttentionPrefillTiled(args, 0, stream);
}

}  // namespace kvflow::cuda
