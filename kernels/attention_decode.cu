// Paged-attention decode: one query token per sequence over its whole paged context, split-K over
// the context (vLLM "v2" style) with a second kernel that merges the partitions.
//
// Work decomposition
//   Main kernel: one CTA per (partition, kv head [x head slice], sequence); grid.x = partitions, so
//   the grid depends only on launch arguments (CUDA-graph safe). A CTA whose partition starts past
//   its sequence's context exits at once. 4 warps; warp w takes the 16-token tiles w, w + 4, ... of
//   the partition and keeps its own online softmax (running max, sum, output accumulator) for all
//   query heads of the group, so K and V are read exactly once per KV head (GQA) and no warp ever
//   waits for another inside the loop. At the end the 4 warp states merge through shared memory;
//   a sequence whose context fits in one partition writes `out` directly, otherwise the CTA writes
//   its (max, sum, unnormalized output) to the workspace and the reduce kernel merges them.
//
// Both matrix products run on tensor cores (mma.m16n8k16, fp32 accumulation), fed straight from
// 16-byte global loads, with no shared-memory staging:
//   S = Q K^T   (M = 16 query-head rows of which the group uses <= 8, N = 8 tokens, K = head dims).
//               Lane (g, t) loads token g's 16-byte chunks t, t + 4, ...; a dot product does not
//               care about the order of its terms, so each 16-byte chunk of K (and the same chunk
//               of Q) is used as two k-steps' b (a) registers as is. One load instruction covers
//               8 tokens x 64 contiguous bytes: every 32-byte sector fully used.
//   O^T = V^T P^T (M = 16 head dims, N = 8 query heads, K = 16 tokens). The S accumulator layout
//               (lane (g, t): head g, tokens 2t, 2t + 1) is exactly the B operand layout of P^T, so
//               probabilities go from S to the second mma in registers (the FlashAttention-2 trick).
//               Lane (g, t) loads tokens 2t, 2t+1, 2t+8, 2t+9, 16-byte chunk g (+8): 4 tokens x 128
//               contiguous bytes per instruction; the A fragments are those chunks' 16-bit halves
//               re-paired (PRMT), each row of an m-tile being one head dim. The resulting output
//               layout gives lane (g, t) all 8 dims of chunk g (+8) for heads 2t and 2t + 1.
// The running max lives in lanes (g, *) for head g while the accumulator rows of head h live in
// lanes (*, h / 2): one shuffle pair per tile moves the rescale factors.
//
// Tokens of the last tile beyond the context read the last valid token instead (finite data, so
// that probability 0 times V stays 0) and get logit -inf. Block-table entries of the partition are
// staged in shared memory once per CTA, so tile addresses cost no dependent global load.
//
// Numerics: fp32 logits and accumulators; probabilities are rounded to the input dtype for the PV
// mma and the softmax denominator sums the rounded values, so the weights sum to exactly 1.
// Exponentials are exp2 of log2(e)-prescaled logits (same math as exp, different rounding).
// The optional LSE is ln 2 * (max + log2(sum)) of those log2-domain maxima and sums, written where
// `out` is (by the main kernel or the reduce kernel): it uses the same rounded denominator that
// normalized `out`, so merging partial attentions by their LSE reproduces the whole exactly.
#include "device_utils.cuh"

#include <algorithm>
#include <cmath>

#include "attention_decode.h"

namespace kvflow::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;         // tokens per warp iteration (k extent of the PV mma)
constexpr int kMaxGroup = 8;      // query heads per CTA (n extent of the PV mma)
constexpr int kMaxPartition = 512;
constexpr int kMinPartition = 64;
constexpr int kMinBlockSize = 8;
// Contexts up to this length are never split: a CTA streams 256 tokens about as fast as a split
// plus the reduce launch would.
constexpr int kMinSplitContext = 256;
// Partitions shrink (512 -> 64) until the grid has at least this many CTAs, so that a small batch
// still spreads over every SM (132 on an H100, each holding ~3 of these CTAs).
constexpr int64_t kTargetCtas = 512;

struct alignas(16) Chunk {  // 16 bytes: 8 fp16/bf16 elements
  uint32_t r[4];
};
struct alignas(16) Float4 {
  float v[4];
};

struct DecodeParams {
  void* out;
  int64_t out_row_stride;
  const void* query;
  int64_t query_row_stride;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* context_lens;
  const int32_t* query_rows;
  int num_heads;
  int group;            // query heads per kv head
  int heads_per_slice;  // query heads per CTA (<= kMaxGroup)
  int slices;           // CTAs per kv head and partition: ceil(group / kMaxGroup)
  int block_shift;      // log2(block_size)
  int64_t block_stride;  // elements between physical blocks (num_kv_heads * block_size * head_dim)
  int partition_size;
  int num_partitions;
  float scale_log2;  // softmax scale * log2(e)
  float* ws_out;     // [num_seqs][num_heads][num_partitions][head_dim], unnormalized
  float* ws_max;     // [num_seqs][num_heads][num_partitions], log2 domain
  float* ws_sum;     // [num_seqs][num_heads][num_partitions]
  float* lse;        // [rows][num_heads] or nullptr
  int window;        // PagedAttentionArgs::window
  // PagedAttentionArgs::softcap > 0: raw scores s become cap_over_scale * tanh(s * scale_over_cap),
  // so that the later * scale_log2 gives softcap * tanh(scale * s / softcap) * log2(e).
  float softcap;
  float scale_over_cap;
  float cap_over_scale;
};

// The raw score q.k as the softmax sees it: unchanged, or soft-capped (see DecodeParams::softcap).
template <typename Params>
__device__ __forceinline__ float SoftCapped(const Params& p, float s) {
  return p.softcap > 0.0f ? p.cap_over_scale * tanhf(s * p.scale_over_cap) : s;
}

// The first key the query at position ctx - 1 sees.
__device__ __forceinline__ int FirstKey(const DecodeParams& p, int ctx) {
  return p.window > 0 ? max(0, ctx - p.window) : 0;
}

constexpr float kLn2 = 0.6931471805599453f;

// Low halves (element 2j) and high halves (element 2j + 1) of two packed pairs, paired up: the
// first argument's element goes to the low half.
__device__ __forceinline__ uint32_t PairLo(uint32_t a, uint32_t b) { return (a & 0xffffu) | (b << 16); }
__device__ __forceinline__ uint32_t PairHi(uint32_t a, uint32_t b) { return (a >> 16) | (b & 0xffff0000u); }

template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  return dev::ToFloat(dev::FromFloat<T>(x));
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 3) PagedDecodeKernel(const DecodeParams p) {
  constexpr int kKChunks = kHeadDim / 32;  // K chunks per lane and token row: t, t + 4, ...
  constexpr int kVChunks = kHeadDim / 64;  // V chunks per lane and token row: g, g + 8
  constexpr int kAccStride = kHeadDim + 4;  // pads the float4 stores of s_acc off one bank group
  __shared__ int32_t s_blocks[kMaxPartition / kMinBlockSize];
  __shared__ float s_max[kWarps][kMaxGroup];
  __shared__ float s_sum[kWarps][kMaxGroup];
  __shared__ __align__(16) float s_acc[kWarps][kMaxGroup][kAccStride];

  const int part = blockIdx.x;
  const int seq = blockIdx.z;
  // Clamped so that a context_lens[s] above max_context_len cannot index past the workspace.
  const int ctx = min(p.context_lens[seq], p.num_partitions * p.partition_size);
  const int start = part * p.partition_size;
  const int first_key = FirstKey(p, ctx);
  // The whole CTA: nothing here for this sequence (past its context or before its window).
  if (start >= ctx || start + p.partition_size <= first_key) return;
  const int len = min(ctx - start, p.partition_size);
  // One partition holds every key it sees: no reduction for this sequence.
  const bool direct = (ctx - 1) / p.partition_size == first_key / p.partition_size;
  const int first = max(0, first_key - start);  // first key of the partition it sees (relative to start)

  const int kv_head = blockIdx.y / p.slices;
  const int slice = blockIdx.y - kv_head * p.slices;
  const int head0 = kv_head * p.group + slice * p.heads_per_slice;  // first query head of the CTA
  const int nh = min(p.heads_per_slice, p.group - slice * p.heads_per_slice);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Block ids of the partition (start is a multiple of the block size).
  const int nblocks = (len + (1 << p.block_shift) - 1) >> p.block_shift;
  const int32_t* table = p.block_tables + seq * p.block_table_stride + (start >> p.block_shift);
  for (int i = threadIdx.x; i < nblocks; i += kThreads) s_blocks[i] = table[i];

  // Q as the A operand: row g = query head head0 + g (zero rows beyond the group), chunk t + 4i.
  const int64_t row = p.query_rows[seq];
  uint32_t qf[kKChunks][4];
  if (g < nh) {
    const T* q = static_cast<const T*>(p.query) + row * p.query_row_stride + static_cast<int64_t>(head0 + g) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
      const Chunk c = *reinterpret_cast<const Chunk*>(q + (t + 4 * i) * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) qf[i][j] = c.r[j];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kKChunks; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) qf[i][j] = 0u;
    }
  }
  __syncthreads();  // s_blocks

  const int64_t head_offset = static_cast<int64_t>(kv_head) << p.block_shift;  // * block_size
  const T* kbase = static_cast<const T*>(p.key_cache) + head_offset * kHeadDim;
  const T* vbase = static_cast<const T*>(p.value_cache) + head_offset * kHeadDim;
  const int slot_mask = (1 << p.block_shift) - 1;
  const int last = len - 1;  // last valid token of the partition (relative to start)
  auto token_offset = [&](int tok) -> int64_t {  // tok relative to start, clamped to the keys it sees
    tok = max(min(tok, last), first);
    return s_blocks[tok >> p.block_shift] * p.block_stride + static_cast<int64_t>(tok & slot_mask) * kHeadDim;
  };

  float m = -INFINITY;  // running max of head g's logits (log2 domain)
  float l = 0.0f;       // running sum of head g's probabilities, over this lane's tokens
  float acc[kVChunks][4][4];  // [chunk][j][.]: heads 2t, 2t+1 x dims 8(g + 8i) + 2j, +1
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    }
  }

  const int num_tiles = (len + kTile - 1) / kTile;
  // From the tile holding the first key seen, so every tile has a valid token.
  for (int tile = first / kTile + warp; tile < num_tiles; tile += kWarps) {
    const int t0 = tile * kTile;
    // All loads of the tile first (16 x 16 bytes per lane at head_dim 128).
    Chunk kc[2][kKChunks];  // tokens t0 + g, t0 + 8 + g
    Chunk vc[4][kVChunks];  // tokens t0 + 2t, +1, +8, +9
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const T* k = kbase + token_offset(t0 + 8 * n + g);
#pragma unroll
      for (int i = 0; i < kKChunks; ++i) kc[n][i] = *reinterpret_cast<const Chunk*>(k + (t + 4 * i) * 8);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const T* v = vbase + token_offset(t0 + 2 * t + (r & 1) + 8 * (r >> 1));
#pragma unroll
      for (int i = 0; i < kVChunks; ++i) vc[r][i] = *reinterpret_cast<const Chunk*>(v + (g + 8 * i) * 8);
    }

    // S = Q K^T: s[n][0..1] = head g x tokens t0 + 8n + 2t, +1 (s[n][2..3]: the zero rows). Two
    // accumulators per n-tile (even / odd k-steps) halve the dependent mma chain.
    float s[2][4], s_odd[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = s_odd[n][e] = 0.0f;
#pragma unroll
      for (int i = 0; i < kKChunks; ++i) {
        const uint32_t a0[4] = {qf[i][0], 0u, qf[i][1], 0u};
        const uint32_t b0[2] = {kc[n][i].r[0], kc[n][i].r[1]};
        dev::MmaM16N8K16<T>(s[n], a0, b0);
        const uint32_t a1[4] = {qf[i][2], 0u, qf[i][3], 0u};
        const uint32_t b1[2] = {kc[n][i].r[2], kc[n][i].r[3]};
        dev::MmaM16N8K16<T>(s_odd[n], a1, b1);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) s[n][e] += s_odd[n][e];
    }

    // Online softmax for head g over the tile.
    float x[2][2];
    float tile_max = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = t0 + 8 * n + 2 * t + e;
        x[n][e] = tok <= last && tok >= first ? SoftCapped(p, s[n][e]) * p.scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, x[n][e]);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(dev::kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(dev::kFullMask, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);  // finite: every tile has a valid token
    const float alpha = exp2f(m - m_new);    // 0 on the first tile (m = -inf)
    m = m_new;
    float pr[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[n][e] = RoundTo<T>(exp2f(x[n][e] - m_new));
    }
    l = l * alpha + ((pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]));
    const uint32_t pb[2] = {dev::PackTwo<T>(pr[0][0], pr[0][1]), dev::PackTwo<T>(pr[1][0], pr[1][1])};

    // Rescale the accumulator rows: head 2t's factor lives in lane 4 * 2t, head 2t+1's in 4 * (2t+1).
    const float alpha0 = __shfl_sync(dev::kFullMask, alpha, 8 * t);
    const float alpha1 = __shfl_sync(dev::kFullMask, alpha, 8 * t + 4);

    // O^T += V^T P^T, one m-tile per (chunk i, pair j): rows g / g + 8 = dims 8(g + 8i) + 2j / + 1.
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j][0] *= alpha0;
        acc[i][j][1] *= alpha1;
        acc[i][j][2] *= alpha0;
        acc[i][j][3] *= alpha1;
        const uint32_t a[4] = {PairLo(vc[0][i].r[j], vc[1][i].r[j]), PairHi(vc[0][i].r[j], vc[1][i].r[j]),
                               PairLo(vc[2][i].r[j], vc[3][i].r[j]), PairHi(vc[2][i].r[j], vc[3][i].r[j])};
        dev::MmaM16N8K16<T>(acc[i][j], a, pb);
      }
    }
  }

  // Merge the warps. A warp without tiles has m = -inf, l = 0, acc = 0 and gets weight 0.
  l += __shfl_xor_sync(dev::kFullMask, l, 1);
  l += __shfl_xor_sync(dev::kFullMask, l, 2);
  if (t == 0) {
    s_max[warp][g] = m;
    s_sum[warp][g] = l;
  }
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) {
    const int d0 = 8 * (g + 8 * i);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // heads 2t (acc[.][.][0], [2]) and 2t + 1 ([1], [3])
      Float4 lo, hi;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        lo.v[2 * j] = acc[i][j][hh];
        lo.v[2 * j + 1] = acc[i][j][hh + 2];
        hi.v[2 * j] = acc[i][j + 2][hh];
        hi.v[2 * j + 1] = acc[i][j + 2][hh + 2];
      }
      float* dst = &s_acc[warp][2 * t + hh][d0];
      *reinterpret_cast<Float4*>(dst) = lo;
      *reinterpret_cast<Float4*>(dst + 4) = hi;
    }
  }
  __syncthreads();

  // One thread per (head, 8-dim chunk).
  constexpr int kChunksPerHead = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < nh * kChunksPerHead; idx += kThreads) {
    const int h = idx / kChunksPerHead;
    const int d0 = (idx % kChunksPerHead) * 8;
    float mw[kWarps];
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      mw[w] = s_max[w][h];
      big = fmaxf(big, mw[w]);
    }
    float sum = 0.0f;
    float o[8] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(mw[w] - big);
      sum += wt * s_sum[w][h];
      const Float4 lo = *reinterpret_cast<const Float4*>(&s_acc[w][h][d0]);
      const Float4 hi = *reinterpret_cast<const Float4*>(&s_acc[w][h][d0 + 4]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[e] += wt * lo.v[e];
        o[4 + e] += wt * hi.v[e];
      }
    }
    const int head = head0 + h;
    if (direct) {
      const float inv = 1.0f / sum;
      Chunk c;
#pragma unroll
      for (int e = 0; e < 4; ++e) c.r[e] = dev::PackTwo<T>(o[2 * e] * inv, o[2 * e + 1] * inv);
      T* dst = static_cast<T*>(p.out) + row * p.out_row_stride + static_cast<int64_t>(head) * kHeadDim + d0;
      *reinterpret_cast<Chunk*>(dst) = c;
      if (p.lse && d0 == 0) p.lse[row * p.num_heads + head] = (big + log2f(sum)) * kLn2;
    } else {
      const int64_t slot = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions + part;
      float* dst = p.ws_out + slot * kHeadDim + d0;
      Float4 lo, hi;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        lo.v[e] = o[e];
        hi.v[e] = o[4 + e];
      }
      *reinterpret_cast<Float4*>(dst) = lo;
      *reinterpret_cast<Float4*>(dst + 4) = hi;
      if (d0 == 0) {
        p.ws_max[slot] = big;
        p.ws_sum[slot] = sum;
      }
    }
  }
}

// Merges the partitions of one (head, sequence). Sequences whose context fit in one partition were
// written by the main kernel. kHeadDim / 4 threads cover one partition's output with float4 loads;
// the kReduceThreads / (kHeadDim / 4) such groups take every group-th partition, so several
// partitions' loads are in flight per thread, and merge through shared memory at the end.
constexpr int kReduceThreads = 128;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kReduceThreads) PagedDecodeReduceKernel(const DecodeParams p) {
  constexpr int kLanesPerPart = kHeadDim / 4;
  constexpr int kGroups = kReduceThreads / kLanesPerPart;
  __shared__ float scratch[32];
  __shared__ float s_sum[kGroups];
  __shared__ __align__(16) float s_out[kGroups][kHeadDim];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int ctx = min(p.context_lens[seq], p.num_partitions * p.partition_size);
  const int n = (ctx + p.partition_size - 1) / p.partition_size;
  const int first_part = FirstKey(p, ctx) / p.partition_size;  // partitions before it saw nothing
  if (n - first_part <= 1) return;
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * p.num_partitions;
  const float* maxes = p.ws_max + base;
  const float* sums = p.ws_sum + base;

  float big = -INFINITY;
  for (int i = first_part + threadIdx.x; i < n; i += kReduceThreads) big = fmaxf(big, maxes[i]);
  big = dev::BlockMax(big, scratch);

  const int grp = threadIdx.x / kLanesPerPart;
  const int d0 = (threadIdx.x % kLanesPerPart) * 4;
  const float* parts = p.ws_out + base * kHeadDim + d0;
  float sum = 0.0f;
  float o[4] = {};
#pragma unroll 4
  for (int i = first_part + grp; i < n; i += kGroups) {
    const float w = exp2f(maxes[i] - big);
    sum += w * sums[i];
    const Float4 v = *reinterpret_cast<const Float4*>(parts + static_cast<int64_t>(i) * kHeadDim);
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] += w * v.v[e];
  }
  Float4 st;
#pragma unroll
  for (int e = 0; e < 4; ++e) st.v[e] = o[e];
  *reinterpret_cast<Float4*>(&s_out[grp][d0]) = st;
  if (d0 == 0) s_sum[grp] = sum;
  __syncthreads();
  // One output dimension per thread, twice over for head_dim 256.
  for (int d = static_cast<int>(threadIdx.x); d < kHeadDim; d += kReduceThreads) {
    float total = 0.0f, acc = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      total += s_sum[g];
      acc += s_out[g][d];
    }
    const int64_t row = p.query_rows[seq];
    T* dst = static_cast<T*>(p.out) + row * p.out_row_stride + static_cast<int64_t>(head) * kHeadDim + d;
    *dst = dev::FromFloat<T>(acc / total);
    if (p.lse && d == 0) p.lse[row * p.num_heads + head] = (big + log2f(total)) * kLn2;
  }
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Tokens per partition: 512 (as vLLM), halved down to 64 while the grid would have fewer than
// kTargetCtas CTAs; contexts of at most kMinSplitContext tokens are never split. Depends only on
// launch arguments (never on device data), so the grid is fixed for a CUDA graph.
int PartitionSize(int num_seqs, int num_kv_heads, int max_context_len) {
  int size = kMaxPartition;
  while (size > kMinPartition && max_context_len > kMinSplitContext &&
         static_cast<int64_t>(num_seqs) * num_kv_heads * CeilDiv(max_context_len, size) < kTargetCtas) {
    size /= 2;
  }
  return size;
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, int kHeadDim>
int Launch(const PagedDecodeArgs& a, const DecodeParams& p, void* stream) {
  const dim3 grid(static_cast<unsigned>(p.num_partitions), static_cast<unsigned>(a.num_kv_heads * p.slices),
                  static_cast<unsigned>(a.num_seqs));
  int err = LaunchKernel(PagedDecodeKernel<T, kHeadDim>, grid, dim3(kThreads), 0, stream, p);
  if (err != 0 || p.num_partitions == 1) return err;
  return LaunchKernel(PagedDecodeReduceKernel<T, kHeadDim>,
                      dim3(static_cast<unsigned>(a.num_heads), static_cast<unsigned>(a.num_seqs)), dim3(kReduceThreads),
                      0, stream, p);
}

}  // namespace

bool PagedDecodeSupports(int head_dim, int block_size) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && (block_size == 8 || block_size == 16 || block_size == 32);
}

namespace detail {
// Workspace bytes one launch with these arguments needs (0: it does not split). Test hook.
size_t PagedDecodeWorkspaceNeeded(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int max_context_len) {
  const int parts = CeilDiv(max_context_len, PartitionSize(num_seqs, num_kv_heads, max_context_len));
  if (parts <= 1) return 0;
  return static_cast<size_t>(num_seqs) * num_heads * parts * (head_dim + 2) * sizeof(float);
}
}  // namespace detail

// An upper bound for every launch with num_seqs' <= num_seqs, max_context_len' <= max_context_len
// and any num_kv_heads (the backend sizes the workspace once, for max_num_seqs x max_model_len).
// A launch's (sequence, partition) pairs, U = n * ceil(m / P):
//   P = 512: U <= num_seqs * ceil(max_context_len / 512);
//   P < 512: the grid at 2P had n * kv * ceil(m / 2P) < kTargetCtas CTAs, so U < 2 * kTargetCtas;
//            and always U <= num_seqs * ceil(max_context_len / 64).
size_t PagedDecodeWorkspaceBytes(int num_seqs, int num_heads, int head_dim, int max_context_len) {
  if (num_seqs <= 0 || num_heads <= 0 || head_dim <= 0 || max_context_len <= kMinSplitContext) return 0;
  const int64_t n = num_seqs;
  const int64_t units = std::max(n * CeilDiv(max_context_len, kMaxPartition),
                                 std::min<int64_t>(2 * kTargetCtas, n * CeilDiv(max_context_len, kMinPartition)));
  return static_cast<size_t>(units) * num_heads * (head_dim + 2) * sizeof(float);
}

int PagedAttentionDecode(const PagedDecodeArgs& a, void* stream) {
  if (a.num_seqs < 0) return kInvalidValue;
  if (a.num_seqs == 0) return 0;
  if (a.dtype != DType::kF16 && a.dtype != DType::kBF16) return kInvalidValue;
  if (!PagedDecodeSupports(a.head_dim, a.block_size)) return kInvalidValue;
  if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return kInvalidValue;
  if (a.max_context_len <= 0 || a.num_seqs > 65535 || a.window < 0 || !(a.softcap >= 0.0f)) return kInvalidValue;
  if (!a.out || !a.query || !a.key_cache || !a.value_cache || !a.block_tables || !a.context_lens ||
      !a.query_rows) {
    return kInvalidValue;
  }
  // 16-byte vector access to query, out and the caches.
  if (!Aligned16(a.out) || !Aligned16(a.query) || !Aligned16(a.key_cache) || !Aligned16(a.value_cache) ||
      a.out_row_stride % 8 != 0 || a.query_row_stride % 8 != 0) {
    return kInvalidValue;
  }
  DecodeParams p{};
  p.out = a.out;
  p.out_row_stride = a.out_row_stride;
  p.query = a.query;
  p.query_row_stride = a.query_row_stride;
  p.key_cache = a.key_cache;
  p.value_cache = a.value_cache;
  p.block_tables = a.block_tables;
  p.block_table_stride = a.block_table_stride;
  p.context_lens = a.context_lens;
  p.query_rows = a.query_rows;
  p.num_heads = a.num_heads;
  p.group = a.num_heads / a.num_kv_heads;
  p.slices = CeilDiv(p.group, kMaxGroup);
  p.heads_per_slice = CeilDiv(p.group, p.slices);
  p.block_shift = a.block_size == 8 ? 3 : a.block_size == 16 ? 4 : 5;
  p.block_stride = static_cast<int64_t>(a.num_kv_heads) * a.block_size * a.head_dim;
  p.partition_size = PartitionSize(a.num_seqs, a.num_kv_heads, a.max_context_len);
  p.num_partitions = CeilDiv(a.max_context_len, p.partition_size);
  p.scale_log2 = a.scale * 1.4426950408889634f;
  p.window = a.window;
  p.softcap = a.softcap;
  p.scale_over_cap = a.softcap > 0.0f ? a.scale / a.softcap : 0.0f;
  p.cap_over_scale = a.softcap > 0.0f ? a.softcap / a.scale : 0.0f;
  p.lse = a.lse;
  if (p.num_partitions > 65535 || static_cast<int64_t>(a.num_kv_heads) * p.slices > 65535) return kInvalidValue;
  if (p.num_partitions > 1) {
    const size_t entries = static_cast<size_t>(a.num_seqs) * a.num_heads * p.num_partitions;
    if (!a.workspace || !Aligned16(a.workspace) || a.workspace_bytes < entries * (a.head_dim + 2) * sizeof(float)) {
      return kInvalidValue;
    }
    p.ws_out = static_cast<float*>(a.workspace);
    p.ws_max = p.ws_out + entries * a.head_dim;
    p.ws_sum = p.ws_max + entries;
  }
  KVFLOW_DISPATCH_HALF_DTYPE(a.dtype, T, {
    if (a.head_dim == 64) return Launch<T, 64>(a, p, stream);
    if (a.head_dim == 128) return Launch<T, 128>(a, p, stream);
    return Launch<T, 256>(a, p, stream);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
