// TriForce's chunk scoring and top-k chunk selection (see kv_block_select.h), the same function as
// cpu::ScoreKvBlocks / cpu::SelectTopKvBlocks (backend/cpu/kv_block_select.cc).
//
// Scoring, two launches:
//   1. MeanKeyLogitsKernel, one thread block per (flattened job block, kv head): each thread owns
//      head_dim elements d (at most two) and sums the block's valid keys at d in token order, then
//      scales by 1/count, exactly as the CPU reference does, so the mean keys are the same bits;
//      each query head of the kv head's group then takes one block-wide dot product (the only
//      difference from the CPU: the order of the head_dim products' sum) into logits[h][block].
//   2. SoftmaxAddKernel, one thread block per job: for each query head in ascending order, the
//      max and the sum of exps over the job's blocks, then every thread adds p_h(b) into the
//      scores of its own blocks. Each score is only ever touched by one thread, heads in a fixed
//      order, so the result is deterministic (no atomics) and adds in the CPU's order.
//
// Selection, one thread block per job: forced first/last blocks are written directly; every
// middle candidate counts the middle blocks that beat it under (score desc, index asc) -- the CPU
// comparator -- and is a winner if fewer than `want` do. Winners are then compacted in ascending
// index order with a block-wide prefix sum per chunk of candidates, so no O(n) storage is needed.
#include "device_utils.cuh"

#include <cmath>

#include "kv_block_select.h"

namespace kvflow::cuda {
namespace {

constexpr int kScoreThreads = 128;
constexpr int kMaxHeadDim = 2 * kScoreThreads;  // two elements of d per thread
constexpr int kSoftmaxThreads = 256;
constexpr int kSelectThreads = 256;

// grid = (total_blocks, num_kv_heads).
template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    MeanKeyLogitsKernel(const T* __restrict__ query, int64_t query_row_stride, const T* __restrict__ key_cache,
                        const KvBlockScoreJobDesc* __restrict__ jobs, const int32_t* __restrict__ block_ids,
                        const int32_t* __restrict__ block_jobs, int total_blocks, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, float* __restrict__ logits) {
  __shared__ float scratch[32];
  const int flat = static_cast<int>(blockIdx.x);
  const int kvh = static_cast<int>(blockIdx.y);
  const KvBlockScoreJobDesc job = jobs[block_jobs[flat]];
  const int b = flat - job.first_block;
  const int count = b + 1 == job.num_blocks ? job.num_tokens - (job.num_blocks - 1) * block_size : block_size;
  // (block, kv_head, slot 0) of the layer's pool: kv/kv_cache_layout.h.
  const T* keys = key_cache + (static_cast<int64_t>(block_ids[flat]) * num_kv_heads + kvh) *
                                  static_cast<int64_t>(block_size) * head_dim;
  const int d0 = static_cast<int>(threadIdx.x), d1 = d0 + kScoreThreads;
  // Token-order fp32 sums, then one multiply by 1/count: the CPU's MeanKey, bit for bit.
  float m0 = 0.0f, m1 = 0.0f;
  for (int t = 0; t < count; ++t) {
    const T* k = keys + static_cast<int64_t>(t) * head_dim;
    if (d0 < head_dim) m0 += dev::ToFloat(k[d0]);
    if (d1 < head_dim) m1 += dev::ToFloat(k[d1]);
  }
  const float inv = 1.0f / static_cast<float>(count);
  m0 *= inv;
  m1 *= inv;
  const int group = num_heads / num_kv_heads;
  const T* q_row = query + static_cast<int64_t>(job.row) * query_row_stride;
  for (int g = 0; g < group; ++g) {
    const int h = kvh * group + g;
    const T* q = q_row + static_cast<int64_t>(h) * head_dim;
    float dot = 0.0f;
    if (d0 < head_dim) dot += dev::ToFloat(q[d0]) * m0;
    if (d1 < head_dim) dot += dev::ToFloat(q[d1]) * m1;
    dot = dev::BlockSum(dot, scratch);  // every thread calls it (it holds barriers)
    if (threadIdx.x == 0) logits[static_cast<int64_t>(h) * total_blocks + flat] = dot * scale;
  }
}

// grid = num_jobs.
__global__ void __launch_bounds__(kSoftmaxThreads)
    SoftmaxAddKernel(const KvBlockScoreJobDesc* __restrict__ jobs, const float* __restrict__ logits, int total_blocks,
                     int num_heads, float* __restrict__ scores) {
  __shared__ float scratch[32];
  const KvBlockScoreJobDesc job = jobs[blockIdx.x];
  const int n = job.num_blocks;
  if (n == 0) return;  // the whole thread block leaves: no barrier is left waiting
  float* out = scores + job.score_offset;
  for (int h = 0; h < num_heads; ++h) {
    const float* row = logits + static_cast<int64_t>(h) * total_blocks + job.first_block;
    float max = -INFINITY;
    for (int b = threadIdx.x; b < n; b += kSoftmaxThreads) max = fmaxf(max, row[b]);
    max = dev::BlockMax(max, scratch);
    float sum = 0.0f;
    for (int b = threadIdx.x; b < n; b += kSoftmaxThreads) sum += expf(row[b] - max);
    sum = dev::BlockSum(sum, scratch);
    const float inv = 1.0f / sum;
    // Thread t owns blocks t, t + threads, ...: heads add to a score one after the other.
    for (int b = threadIdx.x; b < n; b += kSoftmaxThreads) out[b] += expf(row[b] - max) * inv;
  }
}

// grid = num_jobs.
__global__ void __launch_bounds__(kSelectThreads)
    SelectTopKernel(const float* __restrict__ scores, const KvBlockSelectJobDesc* __restrict__ jobs,
                    int32_t* __restrict__ out) {
  __shared__ int scan[kSelectThreads];
  const KvBlockSelectJobDesc job = jobs[blockIdx.x];
  const int tid = static_cast<int>(threadIdx.x);
  // The CPU's clamping, in the same order: forced blocks never exceed k, first before last.
  const int n = job.num_blocks;
  const int k = min(job.k, n);
  const int first = min(job.keep_first, k);
  const int last = min(job.keep_last, k - first);
  int32_t* o = out + job.out_offset;
  for (int i = tid; i < first; i += kSelectThreads) o[i] = i;
  for (int i = tid; i < last; i += kSelectThreads) o[k - last + i] = n - last + i;
  const int lo = first, hi = n - last;  // the middle range
  const int want = k - first - last;
  if (want <= 0) return;  // uniform: the whole thread block leaves
  const bool take_all = want >= hi - lo;
  const float* s = scores + job.score_offset;
  int written = 0;  // winners before this chunk (the same in every thread)
  for (int chunk = lo; chunk < hi; chunk += kSelectThreads) {
    const int i = chunk + tid;
    int chosen = 0;
    if (i < hi) {
      if (take_all) {
        chosen = 1;
      } else {
        // Rank of i: middle blocks that beat it. The CPU's better(j, i) is s[j] != s[i] ? s[j] >
        // s[i] : j < i; the expression below is the same for every pair, NaN included.
        const float si = s[i];
        int rank = 0;
        for (int j = lo; j < hi && rank < want; ++j) {
          const float sj = s[j];
          rank += (sj > si || (sj == si && j < i)) ? 1 : 0;
        }
        chosen = rank < want ? 1 : 0;
      }
    }
    // Inclusive prefix sum of `chosen` over the chunk (Hillis-Steele): winner i lands after the
    // forced first blocks and every winner of lower index.
    scan[tid] = chosen;
    __syncthreads();
    for (int offset = 1; offset < kSelectThreads; offset <<= 1) {
      const int add = tid >= offset ? scan[tid - offset] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    if (chosen) o[first + written + scan[tid] - 1] = i;
    written += scan[kSelectThreads - 1];
    __syncthreads();  // scan[] is rewritten by the next chunk
  }
}

}  // namespace

int ScoreKvBlocks(const KvBlockScoreArgs& a, void* stream) {
  if (a.num_jobs < 0 || a.total_blocks < 0) return kInvalidValue;
  if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return kInvalidValue;
  if (a.head_dim <= 0 || a.head_dim > kMaxHeadDim || a.block_size <= 0) return kInvalidValue;
  if (a.num_kv_heads > 65535) return kInvalidValue;
  if (a.num_jobs == 0 || a.total_blocks == 0) return 0;  // jobs without blocks add nothing
  if (!a.query || !a.key_cache || !a.jobs || !a.block_ids || !a.block_jobs || !a.logits || !a.scores) {
    return kInvalidValue;
  }
  if (a.query_row_stride < static_cast<int64_t>(a.num_heads) * a.head_dim) return kInvalidValue;
  // The CPU's scale, computed the same way.
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  KVFLOW_DISPATCH_DTYPE(a.dtype, T, {
    const int rc = LaunchKernel(MeanKeyLogitsKernel<T>,
                                dim3(static_cast<unsigned>(a.total_blocks), static_cast<unsigned>(a.num_kv_heads)),
                                dim3(kScoreThreads), 0, stream, static_cast<const T*>(a.query), a.query_row_stride,
                                static_cast<const T*>(a.key_cache), a.jobs, a.block_ids, a.block_jobs,
                                a.total_blocks, a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, scale,
                                a.logits);
    if (rc != 0) return rc;
  });
  return LaunchKernel(SoftmaxAddKernel, dim3(static_cast<unsigned>(a.num_jobs)), dim3(kSoftmaxThreads), 0, stream,
                      a.jobs, a.logits, a.total_blocks, a.num_heads, a.scores);
}

int SelectTopKvBlocks(const float* scores, const KvBlockSelectJobDesc* jobs, int num_jobs, int32_t* out,
                      void* stream) {
  if (num_jobs < 0) return kInvalidValue;
  if (num_jobs == 0) return 0;
  if (!scores || !jobs || !out) return kInvalidValue;
  return LaunchKernel(SelectTopKernel, dim3(static_cast<unsigned>(num_jobs)), dim3(kSelectThreads), 0, stream, scores,
                      jobs, out);
}

}  // namespace kvflow::cuda
