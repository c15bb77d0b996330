// InfiniGen's device side (see infinigen_score.h): partial key cache growth, the speculative
// query's skew, speculated scores, token selection, the gather of the selected K/V, and the
// asynchronous prefetch.
//
// Scores and skewed columns are fp32 sums in the CPU reference's order (only FMA contraction can
// differ). The selection is exact: a token's rank only depends on comparisons of its score, so
// the radix select works on the scores' bit patterns mapped to order-preserving unsigned keys
// (-0 first made +0, which the CPU's `!=` treats as equal), and the count is integer arithmetic.
#include "device_utils.cuh"

#include "infinigen_score.h"

namespace kvflow::cuda {
namespace {

constexpr int kSkewThreads = 256;
constexpr int kSkewTokens = 32;  // keys per thread block
constexpr int kQueryThreads = 64;
constexpr int kScoreTokens = 128;  // one token per thread
constexpr int kSelectThreads = 256;
constexpr int kGatherThreads = 128;
constexpr int kMaxHeadDim = 256;
constexpr size_t kMaxDynamicSmem = 200 * 1024;  // under the 227 KiB opt-in limit of sm_80/sm_90

// ---- SkewPartialKeys ------------------------------------------------------------------------------

// Where row r of a partial key cache lives: r itself, or through its chunk table (paged).
__device__ __forceinline__ int64_t PartialRow(const int32_t* chunks, int chunk_rows, int64_t r) {
  if (chunks == nullptr) return r;
  const int64_t chunk = r / chunk_rows;
  return static_cast<int64_t>(chunks[chunk]) * chunk_rows + (r - chunk * chunk_rows);
}

// grid = (ceil(max_job_slots / kSkewTokens), num_jobs).
template <typename T>
__global__ void __launch_bounds__(kSkewThreads)
    SkewPartialKeysKernel(const T* __restrict__ key_cache, const int64_t* __restrict__ slots,
                          const InfiniGenSkewJob* __restrict__ jobs, int num_kv_heads, int head_dim, int block_size,
                          int num_cols, int chunk_rows) {
  const InfiniGenSkewJob job = jobs[blockIdx.y];
  const int first = static_cast<int>(blockIdx.x) * kSkewTokens;
  if (first >= job.num_slots) return;  // the whole thread block leaves before any barrier
  const int tokens = min(kSkewTokens, job.num_slots - first);
  const int D = head_dim, P = num_cols, tid = static_cast<int>(threadIdx.x);
  KVFLOW_DYNAMIC_SMEM(float, smem);
  float* a = smem;          // [D][P]: A's kept columns, so every output reads a contiguous column
  float* x = smem + D * P;  // [tokens][D]: the keys, widened
  for (int i = tid; i < D * P; i += kSkewThreads) {
    const int d = i / P, c = i - d * P;
    a[i] = job.matrix[static_cast<int64_t>(d) * D + job.columns[c]];
  }
  for (int i = tid; i < tokens * D; i += kSkewThreads) {
    const int t = i / D, d = i - t * D;
    const int64_t slot = slots[job.first_slot + first + t];
    const int64_t block = slot / block_size, offset = slot - block * block_size;
    x[i] = dev::ToFloat(key_cache[((block * num_kv_heads + job.kv_head) * block_size + offset) * D + d]);
  }
  __syncthreads();
  // Consecutive threads take consecutive columns of one key: conflict-free reads of a, x broadcast.
  for (int i = tid; i < tokens * P; i += kSkewThreads) {
    const int t = i / P, c = i - t * P;
    const float* xt = x + t * D;
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += xt[d] * a[d * P + c];
    job.dst[PartialRow(job.chunks, chunk_rows, job.dst_row + first + t) * P + c] = acc;
  }
}

// grid = (num_rows, num_heads).
template <typename T>
__global__ void __launch_bounds__(kQueryThreads)
    SkewPartialQueriesKernel(const T* __restrict__ rows, int64_t row_stride, const int32_t* __restrict__ row_indices,
                             const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                             float attention_scale, int num_heads, int group, int head_dim, int num_cols, float scale,
                             const float* __restrict__ matrices, const int32_t* __restrict__ columns,
                             float* __restrict__ out) {
  __shared__ float q[kMaxHeadDim];
  const int r = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y), kvh = h / group;
  const int D = head_dim, P = num_cols;
  const int source = row_indices ? row_indices[r] : r;
  const T* row = rows + source * row_stride + static_cast<int64_t>(h) * D;
  if (positions == nullptr) {
    for (int d = threadIdx.x; d < D; d += kQueryThreads) q[d] = dev::ToFloat(row[d]) * scale;
  } else {
    // ApplyRope's arithmetic (model/rope.cc), then the scale, each in fp32.
    const int half = D / 2;
    const float position = static_cast<float>(positions[source]);
    for (int i = threadIdx.x; i < half; i += kQueryThreads) {
      const float angle = position * inv_freq[i];
      const float c = cosf(angle) * attention_scale;
      const float s = sinf(angle) * attention_scale;
      const float x0 = dev::ToFloat(row[i]);
      const float x1 = dev::ToFloat(row[i + half]);
      q[i] = (x0 * c - x1 * s) * scale;
      q[i + half] = (x1 * c + x0 * s) * scale;
    }
  }
  __syncthreads();
  const float* a = matrices + static_cast<int64_t>(kvh) * D * D;
  const int32_t* cols = columns + static_cast<int64_t>(kvh) * P;
  float* o = out + (static_cast<int64_t>(r) * num_heads + h) * P;
  for (int c = threadIdx.x; c < P; c += kQueryThreads) {
    const int col = cols[c];
    float acc = 0.0f;
    for (int d = 0; d < D; ++d) acc += q[d] * a[d * D + col];
    o[c] = acc;
  }
}

// ---- ScorePartialKeys -----------------------------------------------------------------------------

// grid = (ceil(max_tokens / kScoreTokens), num_jobs).
__global__ void __launch_bounds__(kScoreTokens)
    ScorePartialKeysKernel(const PartialKeyScoreJob* __restrict__ jobs, int group, int num_cols, int chunk_rows) {
  const PartialKeyScoreJob job = jobs[blockIdx.y];
  const int first = static_cast<int>(blockIdx.x) * kScoreTokens;
  if (first >= job.num_tokens) return;  // uniform
  const int tokens = min(kScoreTokens, job.num_tokens - first);
  const int P = num_cols, stride = P | 1;  // an odd row stride: thread t's reads hit distinct banks
  const int tid = static_cast<int>(threadIdx.x);
  KVFLOW_DYNAMIC_SMEM(float, smem);
  float* q = smem;                  // [group][P]
  float* keys = smem + group * P;   // [tokens][stride]
  for (int i = tid; i < group * P; i += kScoreTokens) q[i] = job.queries[i];
  // Coalesced: a tile is contiguous in global memory, or runs of chunk_rows rows of it are.
  for (int i = tid; i < tokens * P; i += kScoreTokens) {
    const int t = i / P, c = i - t * P;
    keys[t * stride + c] = job.keys[PartialRow(job.chunks, chunk_rows, first + t) * P + c];
  }
  __syncthreads();
  if (tid >= tokens) return;
  const float* k = keys + tid * stride;
  float best = -INFINITY;
  for (int j = 0; j < group; ++j) {
    const float* qj = q + j * P;
    float acc = 0.0f;
    for (int c = 0; c < P; ++c) acc += qj[c] * k[c];
    best = best < acc ? acc : best;  // std::max(best, acc), as the CPU takes it
  }
  job.scores[first + tid] = best;
}

// ---- SelectSpeculatedTokens -----------------------------------------------------------------------

// Integer sum over the thread block (blockDim.x a multiple of 32); every thread gets it.
__device__ __forceinline__ int BlockSumInt(int v, int* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(dev::kFullMask, v, offset);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(dev::kFullMask, v, offset);
  return v;
}

// Exclusive prefix sum of v over the thread block in thread order; *total gets the block's sum.
// scratch is __shared__ int[32]. Contains barriers: call from all threads.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int from = __shfl_up_sync(dev::kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += from;
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    const int t = scratch[w];
    before += w < warp ? t : 0;
    all += t;
  }
  *total = all;
  return before + inclusive - v;
}

// Order-preserving key of a (non-NaN) score: a > b as floats iff Key(a) > Key(b) as unsigned, and
// -0 maps with +0.
__device__ __forceinline__ uint32_t OrderKey(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// grid = (num_jobs, num_kv_heads): head_counts[job][h] = #(s > max_h - alpha).
__global__ void __launch_bounds__(kSelectThreads)
    CountWithinAlphaKernel(const SpeculationSelectJob* __restrict__ jobs, int num_kv_heads, float alpha,
                           int32_t* __restrict__ head_counts) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  const SpeculationSelectJob job = jobs[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y);
  const int n = job.num_tokens;
  const float* s = job.scores + h * job.score_head_stride;
  float max = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kSelectThreads) max = fmaxf(max, s[i]);
  max = dev::BlockMax(max, fscratch);
  const float threshold = max - alpha;  // the CPU's expression, in fp32
  int count = 0;
  for (int i = threadIdx.x; i < n; i += kSelectThreads) count += s[i] > threshold ? 1 : 0;
  count = BlockSumInt(count, iscratch);
  if (threadIdx.x == 0) head_counts[static_cast<int64_t>(blockIdx.x) * num_kv_heads + h] = count;
}

// grid = (num_jobs, num_kv_heads): the count, then head h's top count indices, ascending.
__global__ void __launch_bounds__(kSelectThreads)
    SelectTopTokensKernel(const SpeculationSelectJob* __restrict__ jobs, int num_kv_heads,
                          const int32_t* __restrict__ head_counts) {
  __shared__ int histogram[256];
  __shared__ int scan_scratch[32];
  __shared__ uint32_t found_prefix;
  __shared__ int found_remaining;
  const SpeculationSelectJob job = jobs[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
  const int n = job.num_tokens;
  if (n <= 0) {  // the CPU returns count 0 and no tokens
    if (h == 0 && tid == 0) *job.count = 0;
    return;
  }
  // lround(total / heads) for a non-negative total, in integers: half rounds up, as lround does.
  int64_t total = 0;
  for (int g = 0; g < num_kv_heads; ++g) total += head_counts[static_cast<int64_t>(blockIdx.x) * num_kv_heads + g];
  int count = static_cast<int>((2 * total + num_kv_heads) / (2 * num_kv_heads));
  count = min(max(count, 1), max(job.cap, 1));
  count = min(count, n);  // never binding (a head counts at most n tokens); keeps the writes in bounds
  if (h == 0 && tid == 0) *job.count = count;
  const float* s = job.scores + h * job.score_head_stride;
  int32_t* out = job.indices + static_cast<int64_t>(h) * job.cap;

  // Radix select of the count-th largest key, 8 bits a pass from the top: `prefix` holds the bits
  // found so far, `remaining` how many of the keys matching it are still to be taken.
  uint32_t prefix = 0, mask = 0;
  int remaining = count;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kSelectThreads) histogram[b] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kSelectThreads) {
      const uint32_t key = OrderKey(s[i]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xffu], 1);  // integer: order-free
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + histogram[b] >= remaining) {
          found_prefix = prefix | (static_cast<uint32_t>(b) << shift);
          found_remaining = remaining - above;
          break;
        }
        above += histogram[b];
      }
    }
    __syncthreads();
    prefix = found_prefix;
    remaining = found_remaining;
    mask |= 0xffu << shift;
    __syncthreads();  // found_* and histogram are rewritten by the next pass
  }
  // Every key above the threshold is taken, and the first `remaining` equal to it by index: the
  // CPU's (score desc, index asc) order. Compaction in index order, a chunk of indices at a time.
  const uint32_t threshold = prefix;
  int written = 0, ties_seen = 0;  // the same in every thread
  for (int chunk = 0; chunk < n && written < count; chunk += kSelectThreads) {
    const int i = chunk + tid;
    int above = 0, tie = 0;
    if (i < n) {
      const uint32_t key = OrderKey(s[i]);
      above = key > threshold ? 1 : 0;
      tie = key == threshold ? 1 : 0;
    }
    int ties_in_chunk = 0, chosen_in_chunk = 0;
    const int ties_before = BlockExclusiveScan(tie, scan_scratch, &ties_in_chunk);
    const int chosen = above | (tie & (ties_seen + ties_before < remaining ? 1 : 0));
    const int position = BlockExclusiveScan(chosen, scan_scratch, &chosen_in_chunk);
    if (chosen) out[written + position] = i;
    written += chosen_in_chunk;
    ties_seen += ties_in_chunk;
  }
}

// ---- GatherSelectedKv -----------------------------------------------------------------------------


// grid = (num_jobs, num_kv_heads).
template <typename W>
__global__ void __launch_bounds__(kGatherThreads)
    GatherSelectedKvKernel(const W* __restrict__ key_cache, const W* __restrict__ value_cache,
                           const SelectedKvGatherJob* __restrict__ jobs, W* __restrict__ dst_key,
                           W* __restrict__ dst_value, int num_kv_heads, int head_words, int block_size) {
  const SelectedKvGatherJob job = jobs[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y);
  const int count = *job.count;
  const int capacity = job.num_blocks * block_size;
  const int tokens = min(count + (job.append_position >= 0 ? 1 : 0), capacity);
  if (h == 0 && threadIdx.x == 0 && job.context_len) *job.context_len = tokens;
  const int32_t* positions = job.positions + static_cast<int64_t>(h) * job.position_head_stride;
  const int first = job.only_appended ? min(count, tokens) : 0;
  for (int i = threadIdx.x; i < (tokens - first) * head_words; i += kGatherThreads) {
    const int t = first + i / head_words, w = i - (t - first) * head_words;
    const int pos = t < count ? positions[t] : job.append_position;
    const int64_t block = job.block_table[pos / block_size];
    const int64_t src = ((block * num_kv_heads + h) * block_size + pos % block_size) * head_words + w;
    const int64_t dst_block = job.first_block + t / block_size;
    const int64_t dst = ((dst_block * num_kv_heads + h) * block_size + t % block_size) * head_words + w;
    const W k = key_cache[src];
    const W v = value_cache[src];
    dst_key[dst] = k;
    dst_value[dst] = v;
  }
}

template <typename W>
int LaunchGatherSelectedKv(const void* key_cache, const void* value_cache, const SelectedKvGatherJob* jobs,
                           int num_jobs, void* dst_key, void* dst_value, int num_kv_heads, int head_bytes,
                           int block_size, void* stream) {
  return LaunchKernel(GatherSelectedKvKernel<W>, dim3(static_cast<unsigned>(num_jobs), static_cast<unsigned>(num_kv_heads)),
                      dim3(kGatherThreads), 0, stream, static_cast<const W*>(key_cache),
                      static_cast<const W*>(value_cache), jobs, static_cast<W*>(dst_key), static_cast<W*>(dst_value),
                      num_kv_heads, head_bytes / static_cast<int>(sizeof(W)), block_size);
}

}  // namespace

int SkewPartialKeys(const SkewPartialKeysArgs& a, void* stream) {
  if (a.num_jobs < 0 || a.max_job_slots < 0) return kInvalidValue;
  if (a.num_kv_heads <= 0 || a.head_dim <= 0 || a.head_dim > kMaxHeadDim || a.block_size <= 0) return kInvalidValue;
  if (a.num_partial_columns <= 0 || a.num_partial_columns > a.head_dim) return kInvalidValue;
  const size_t smem = (static_cast<size_t>(a.head_dim) * a.num_partial_columns +
                       static_cast<size_t>(kSkewTokens) * a.head_dim) * sizeof(float);
  if (smem > kMaxDynamicSmem) return kInvalidValue;
  if (a.num_jobs == 0 || a.max_job_slots == 0) return 0;
  if (a.num_jobs > 65535) return kInvalidValue;
  if (!a.key_cache || !a.slots || !a.jobs || a.chunk_rows < 0) return kInvalidValue;
  const unsigned tiles = static_cast<unsigned>((a.max_job_slots + kSkewTokens - 1) / kSkewTokens);
  KVFLOW_DISPATCH_DTYPE(a.dtype, T, {
    return LaunchKernel(SkewPartialKeysKernel<T>, dim3(tiles, static_cast<unsigned>(a.num_jobs)), dim3(kSkewThreads),
                        smem, stream, static_cast<const T*>(a.key_cache), a.slots, a.jobs, a.num_kv_heads,
                        a.head_dim, a.block_size, a.num_partial_columns, a.chunk_rows);
  });
  return kInvalidValue;
}

int SkewPartialQueries(const SkewPartialQueriesArgs& a, void* stream) {
  if (a.num_rows < 0 || a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return kInvalidValue;
  }
  if (a.head_dim <= 0 || a.head_dim > kMaxHeadDim || a.num_partial_columns <= 0 ||
      a.num_partial_columns > a.head_dim || a.num_heads > 65535) {
    return kInvalidValue;
  }
  if (a.num_rows == 0) return 0;
  if (!a.rows || !a.matrices || !a.columns || !a.out) return kInvalidValue;
  if (a.row_stride < static_cast<int64_t>(a.num_heads) * a.head_dim) return kInvalidValue;
  if (a.positions && (!a.inv_freq || a.head_dim % 2 != 0)) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(a.dtype, T, {
    return LaunchKernel(SkewPartialQueriesKernel<T>,
                        dim3(static_cast<unsigned>(a.num_rows), static_cast<unsigned>(a.num_heads)),
                        dim3(kQueryThreads), 0, stream, static_cast<const T*>(a.rows), a.row_stride, a.row_indices,
                        a.positions, a.inv_freq, a.attention_scale, a.num_heads, a.num_heads / a.num_kv_heads,
                        a.head_dim, a.num_partial_columns, a.scale, a.matrices, a.columns, a.out);
  });
  return kInvalidValue;
}

int ScorePartialKeys(const PartialKeyScoreJob* jobs, int num_jobs, int max_tokens, int group,
                     int num_partial_columns, void* stream, int chunk_rows) {
  if (num_jobs < 0 || max_tokens < 0 || group <= 0 || num_partial_columns <= 0 || chunk_rows < 0) return kInvalidValue;
  const size_t smem = (static_cast<size_t>(group) * num_partial_columns +
                       static_cast<size_t>(kScoreTokens) * (num_partial_columns | 1)) * sizeof(float);
  if (smem > kMaxDynamicSmem) return kInvalidValue;
  if (num_jobs == 0 || max_tokens == 0) return 0;
  if (num_jobs > 65535 || !jobs) return kInvalidValue;
  const unsigned tiles = static_cast<unsigned>((max_tokens + kScoreTokens - 1) / kScoreTokens);
  return LaunchKernel(ScorePartialKeysKernel, dim3(tiles, static_cast<unsigned>(num_jobs)), dim3(kScoreTokens), smem,
                      stream, jobs, group, num_partial_columns, chunk_rows);
}

int SelectSpeculatedTokens(const SelectSpeculatedTokensArgs& a, void* stream) {
  if (a.num_jobs < 0 || a.num_kv_heads <= 0 || a.num_kv_heads > 65535) return kInvalidValue;
  if (a.num_jobs == 0) return 0;
  if (!a.jobs || !a.head_counts) return kInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.num_jobs), static_cast<unsigned>(a.num_kv_heads));
  const int rc = LaunchKernel(CountWithinAlphaKernel, grid, dim3(kSelectThreads), 0, stream, a.jobs, a.num_kv_heads,
                              a.alpha, a.head_counts);
  if (rc != 0) return rc;
  return LaunchKernel(SelectTopTokensKernel, grid, dim3(kSelectThreads), 0, stream, a.jobs, a.num_kv_heads,
                      a.head_counts);
}

int GatherSelectedKv(DType dtype, const void* key_cache, const void* value_cache, const SelectedKvGatherJob* jobs,
                     int num_jobs, void* dst_key, void* dst_value, int num_kv_heads, int head_dim, int block_size,
                     void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return kInvalidValue;
  if (num_jobs < 0 || num_kv_heads <= 0 || num_kv_heads > 65535 || head_dim <= 0 || block_size <= 0) {
    return kInvalidValue;
  }
  if (num_jobs == 0) return 0;
  if (!key_cache || !value_cache || !jobs || !dst_key || !dst_value) return kInvalidValue;
  // The widest word that every base address and the row length are a multiple of.
  const uint64_t head_bytes = static_cast<uint64_t>(head_dim) * DTypeSize(dtype);
  const uint64_t bits = reinterpret_cast<uintptr_t>(key_cache) | reinterpret_cast<uintptr_t>(value_cache) |
                        reinterpret_cast<uintptr_t>(dst_key) | reinterpret_cast<uintptr_t>(dst_value) | head_bytes;
  const int hb = static_cast<int>(head_bytes);
  if (bits % 16 == 0) {
    return LaunchGatherSelectedKv<Word16>(key_cache, value_cache, jobs, num_jobs, dst_key, dst_value, num_kv_heads,
                                          hb, block_size, stream);
  }
  if (bits % 8 == 0) {
    return LaunchGatherSelectedKv<Word8>(key_cache, value_cache, jobs, num_jobs, dst_key, dst_value, num_kv_heads, hb,
                                         block_size, stream);
  }
  if (bits % 4 == 0) {
    return LaunchGatherSelectedKv<Word4>(key_cache, value_cache, jobs, num_jobs, dst_key, dst_value, num_kv_heads, hb,
                                         block_size, stream);
  }
  if (bits % 2 == 0) {
    return LaunchGatherSelectedKv<Word2>(key_cache, value_cache, jobs, num_jobs, dst_key, dst_value, num_kv_heads, hb,
                                         block_size, stream);
  }
  return kInvalidValue;
}

int PrefetchToDevice(const HostToDeviceRange* ranges, int num_ranges, void* copy_stream, void* done_event) {
  if (num_ranges < 0 || !done_event || (num_ranges > 0 && !ranges)) return kInvalidValue;
  const cudaStream_t stream = static_cast<cudaStream_t>(copy_stream);
  for (int i = 0; i < num_ranges;) {
    const char* src = static_cast<const char*>(ranges[i].host_src);
    char* dst = static_cast<char*>(ranges[i].device_dst);
    size_t bytes = ranges[i].bytes;
    int next = i + 1;
    // Ranges that continue the previous one on both sides (a sequence's consecutive tokens) go as one copy.
    while (next < num_ranges && ranges[next].host_src == src + bytes && ranges[next].device_dst == dst + bytes) {
      bytes += ranges[next].bytes;
      ++next;
    }
    if (bytes > 0) {
      if (!src || !dst) return kInvalidValue;
      const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
      if (e != cudaSuccess) return static_cast<int>(e);
    }
    i = next;
  }
  return static_cast<int>(cudaEventRecord(static_cast<cudaEvent_t>(done_event), stream));
}

int WaitForPrefetch(void* compute_stream, void* done_event) {
  if (!done_event) return kInvalidValue;
  return static_cast<int>(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(compute_stream), static_cast<cudaEvent_t>(done_event), 0));
}

}  // namespace kvflow::cuda
