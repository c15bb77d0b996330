#include "backend/cpu/paged_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "util/half.h"
#include "util/thread_pool.h"

namespace kvflow::cpu {

size_t KvElementBytes(KvElement e) { return e == KvElement::kF16 ? sizeof(uint16_t) : sizeof(float); }
const char* KvElementName(KvElement e) { return e == KvElement::kF16 ? "fp16" : "fp32"; }

namespace {

// fp32 <-> fp16 rows, rounding to nearest even: F16C where the build targets it (Release builds
// x86-64-v3), else the bit-exact portable conversions (sanitizer and debug builds).
void ToHalf(const float* src, uint16_t* dst, int n) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = FloatToHalfBits(src[i]);
}

void FromHalf(const uint16_t* src, float* dst, int n) {
  int i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]);
}

template <typename T>
void WriteRows(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key, const float* value,
               int64_t row_stride, T* key_cache, T* value_cache) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  const int bs = layout.block_size;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    const int block = static_cast<int>(slots[t] / bs);
    const int offset = static_cast<int>(slots[t] % bs);
    for (int h = 0; h < KV; ++h) {
      const size_t dst = layout.offset(block, h, offset);
      const float* k = key + static_cast<int64_t>(t) * row_stride + h * D;
      const float* v = value + static_cast<int64_t>(t) * row_stride + h * D;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(key_cache + dst, k, sizeof(float) * D);
        std::memcpy(value_cache + dst, v, sizeof(float) * D);
      } else {
        ToHalf(k, key_cache + dst, D);
        ToHalf(v, value_cache + dst, D);
      }
    }
  }
}

}  // namespace

void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, float* key_cache, float* value_cache) {
  WriteRows(slots, layout, key, value, row_stride, key_cache, value_cache);
}

void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, KvElement element, void* key_cache, void* value_cache) {
  if (element == KvElement::kF16) {
    WriteRows(slots, layout, key, value, row_stride, static_cast<uint16_t*>(key_cache),
              static_cast<uint16_t*>(value_cache));
  } else {
    WriteRows(slots, layout, key, value, row_stride, static_cast<float*>(key_cache), static_cast<float*>(value_cache));
  }
}

void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache) {
  const std::vector<int64_t> slots = ResolveSlotMapping(batch, layout.block_size);
  WriteKvCache(slots, layout, key, value, static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim, key_cache,
               value_cache);
}

namespace {

// Keys per partition when a query's context is split (flash-decoding): a decode step of one sequence
// has only num_kv_heads units of work, fewer than the threads at long context. A context of
// 2 * kPartitionKeys or more is split into visible / kPartitionKeys partitions; the choice depends
// on the query's own context only, so a row's result does not depend on the batch it is in or on
// the thread count.
constexpr int32_t kPartitionKeys = 512;
// Largest head_dim the fp16 row buffer holds.
constexpr int kMaxHeadDim = 512;

// One (token, KV head) of the batch: its `group` query heads attend together, so each key and value
// row is read once for the whole group (grouped-query attention), over view entries
// [begin, end) of the `visible` ones.
struct AttentionTask {
  int32_t seq;      // slice index
  int32_t token;    // index into the batch
  int32_t visible;  // view entries this query sees
  int32_t kv_head;
  int32_t begin, end;
  int32_t partial;  // index of its partial result when the context is split, else -1
};

// Partial softmax state of one task's query heads: running max, sum of exponentials and the
// unnormalized output, per query head of the group.
struct PartialState {
  float* max;
  float* sum;
  float* out;  // group x D
};

// Attention of the task's query heads over its key range; with `partial` null it writes the
// normalized outputs (and lse) to io, else the unnormalized state.
// A K or V row as fp32: in place for an fp32 pool, converted into `buffer` for fp16 (once per row
// for the whole query group).
template <typename T>
const float* RowAsFloat(const T* row, float* buffer, int D) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    FromHalf(row, buffer, D);
    return buffer;
  }
}

template <typename T>
void AttendRange(const AttentionTask& task, std::span<const int64_t> slots, const KvCacheLayout& layout, int group,
                 const AttentionIo& io, int num_heads, const T* key_cache, const T* value_cache, float scale,
                 std::vector<float>& scores, const PartialState* partial) {
  const int D = layout.head_dim;
  const int bs = layout.block_size;
  const int32_t n = task.end - task.begin;
  scores.resize(static_cast<size_t>(group) * static_cast<size_t>(n));
  auto row = [&](const T* cache, int64_t slot) {
    return cache + layout.offset(static_cast<int>(slot / bs), task.kv_head, static_cast<int>(slot % bs));
  };
  float converted[kMaxHeadDim];
  const float* q0 = io.query + task.token * io.query_row_stride + static_cast<int64_t>(task.kv_head) * group * D;
  float max_score[16], denom[16];  // group <= 16 is checked by the caller
  for (int g = 0; g < group; ++g) max_score[g] = -INFINITY;
  for (int32_t j = 0; j < n; ++j) {
    const float* k = RowAsFloat(row(key_cache, slots[static_cast<size_t>(task.begin + j)]), converted, D);
    for (int g = 0; g < group; ++g) {
      const float* q = q0 + g * D;
      float dot = 0.0f;
      // simd reduction: lets the compiler keep several partial sums (a vectorized dot product).
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < D; ++d) dot += q[d] * k[d];
      const float score = dot * scale;
      scores[static_cast<size_t>(g) * n + j] = score;
      max_score[g] = std::max(max_score[g], score);
    }
  }
  for (int g = 0; g < group; ++g) {
    float* sg = &scores[static_cast<size_t>(g) * n];
    float sum = 0.0f;
    for (int32_t j = 0; j < n; ++j) sum += (sg[j] = std::exp(sg[j] - max_score[g]));
    denom[g] = sum;
  }
  float* out_rows[16];
  for (int g = 0; g < group; ++g) {
    out_rows[g] = partial ? partial->out + static_cast<size_t>(g) * D
                          : io.out + task.token * io.out_row_stride + static_cast<int64_t>(task.kv_head * group + g) * D;
    std::fill(out_rows[g], out_rows[g] + D, 0.0f);
  }
  for (int32_t j = 0; j < n; ++j) {
    const float* v = RowAsFloat(row(value_cache, slots[static_cast<size_t>(task.begin + j)]), converted, D);
    for (int g = 0; g < group; ++g) {
      const float p = scores[static_cast<size_t>(g) * n + j];
      float* o = out_rows[g];
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += p * v[d];
    }
  }
  for (int g = 0; g < group; ++g) {
    if (partial) {
      partial->max[g] = max_score[g];
      partial->sum[g] = denom[g];
      continue;
    }
    const float inv = 1.0f / denom[g];
    for (int d = 0; d < D; ++d) out_rows[g][d] *= inv;
    if (io.lse) {
      io.lse[static_cast<int64_t>(task.token) * num_heads + task.kv_head * group + g] = max_score[g] + std::log(denom[g]);
    }
  }
}

template <typename T>
void Attention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
               const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const T* key_cache,
               const T* value_cache, float scale) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  const int group = num_heads / KV;
  if (group > 16) throw std::invalid_argument("PagedAttention: more than 16 query heads per KV head");
  if (D > kMaxHeadDim) throw std::invalid_argument("PagedAttention: head_dim above 512");

  int64_t units = 0;
  for (const SequenceSlice& slice : batch.seqs) units += static_cast<int64_t>(slice.num_tokens) * KV;
  std::vector<AttentionTask> tasks;
  tasks.reserve(static_cast<size_t>(units));
  // Split units: (first task, number of partitions), for the merge.
  std::vector<std::pair<int32_t, int32_t>> split_units;
  int32_t partials = 0;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    const int32_t size = static_cast<int32_t>(view_slots[s].size());
    for (int32_t i = 0; i < slice.num_tokens; ++i) {
      // Causal in view order: the slice's tokens are the view's last entries.
      const int32_t visible = size - slice.num_tokens + i + 1;
      const int32_t parts = std::max(1, visible / kPartitionKeys);
      for (int h = 0; h < KV; ++h) {
        if (parts > 1) split_units.push_back({static_cast<int32_t>(tasks.size()), parts});
        for (int32_t p = 0; p < parts; ++p) {
          const int32_t begin = static_cast<int32_t>(static_cast<int64_t>(visible) * p / parts);
          const int32_t end = static_cast<int32_t>(static_cast<int64_t>(visible) * (p + 1) / parts);
          tasks.push_back({static_cast<int32_t>(s), slice.token_offset + i, visible, h, begin, end,
                           parts > 1 ? partials++ : -1});
        }
      }
    }
  }
  // Per partial: group maxima, group sums, group x D outputs.
  std::vector<float> partial_store(static_cast<size_t>(partials) * group * (D + 2));
  auto partial_of = [&](int32_t index) {
    float* base = partial_store.data() + static_cast<size_t>(index) * group * (D + 2);
    return PartialState{base, base + group, base + 2 * group};
  };

  // Dynamic chunks: tasks differ in length (context lengths, causal prefill rows).
  ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scores;
    for (int64_t n = first; n < last; ++n) {
      const AttentionTask& task = tasks[static_cast<size_t>(n)];
      const std::vector<int64_t>& slots = view_slots[static_cast<size_t>(task.seq)];
      if (task.partial < 0) {
        AttendRange(task, slots, layout, group, io, num_heads, key_cache, value_cache, scale, scores, nullptr);
      } else {
        const PartialState state = partial_of(task.partial);
        AttendRange(task, slots, layout, group, io, num_heads, key_cache, value_cache, scale, scores, &state);
      }
    }
  }, 4);

  // Merge each split unit's partitions: rescale every partition to the global max.
  for (const auto& [first, parts] : split_units) {
    const AttentionTask& task = tasks[static_cast<size_t>(first)];
    for (int g = 0; g < group; ++g) {
      float m = -INFINITY;
      for (int32_t p = 0; p < parts; ++p) m = std::max(m, partial_of(tasks[static_cast<size_t>(first + p)].partial).max[g]);
      float* o = io.out + task.token * io.out_row_stride + static_cast<int64_t>(task.kv_head * group + g) * D;
      std::fill(o, o + D, 0.0f);
      float sum = 0.0f;
      for (int32_t p = 0; p < parts; ++p) {
        const PartialState st = partial_of(tasks[static_cast<size_t>(first + p)].partial);
        const float w = std::exp(st.max[g] - m);
        sum += w * st.sum[g];
        const float* po = st.out + static_cast<size_t>(g) * D;
        for (int d = 0; d < D; ++d) o[d] += w * po[d];
      }
      const float inv = 1.0f / sum;
      for (int d = 0; d < D; ++d) o[d] *= inv;
      if (io.lse) io.lse[static_cast<int64_t>(task.token) * num_heads + task.kv_head * group + g] = m + std::log(sum);
    }
  }
}

}  // namespace

void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const float* key_cache,
                    const float* value_cache, float scale) {
  Attention(batch, view_slots, layout, num_heads, io, key_cache, value_cache, scale);
}

void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, KvElement element,
                    const void* key_cache, const void* value_cache, float scale) {
  if (element == KvElement::kF16) {
    Attention(batch, view_slots, layout, num_heads, io, static_cast<const uint16_t*>(key_cache),
              static_cast<const uint16_t*>(value_cache), scale);
  } else {
    Attention(batch, view_slots, layout, num_heads, io, static_cast<const float*>(key_cache),
              static_cast<const float*>(value_cache), scale);
  }
}

void PagedAttention(const ForwardBatch& batch, const KvCacheLayout& layout, int num_heads,
                    const float* query, const float* key_cache, const float* value_cache, float scale,
                    float* out) {
  std::vector<std::vector<int64_t>> views(batch.seqs.size());
  for (size_t s = 0; s < batch.seqs.size(); ++s) ViewSlots(batch.seqs[s], layout.block_size, views[s]);
  AttentionIo io;
  io.query = query;
  io.query_row_stride = static_cast<int64_t>(num_heads) * layout.head_dim;
  io.out = out;
  io.out_row_stride = io.query_row_stride;
  PagedAttention(batch, views, layout, num_heads, io, key_cache, value_cache, scale);
}

void MergeAttentionStates(const float* out_a, const float* lse_a, const float* out_b, const float* lse_b,
                          int64_t rows, int head_dim, float* out, float* lse_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float a = lse_a[r], b = lse_b[r];
    const float m = std::max(a, b);
    // An empty side has lse -inf and weight 0.
    const float wa = std::isinf(a) && a < 0 ? 0.0f : std::exp(a - m);
    const float wb = std::isinf(b) && b < 0 ? 0.0f : std::exp(b - m);
    const float inv = 1.0f / (wa + wb);
    for (int d = 0; d < head_dim; ++d) {
      out[r * head_dim + d] = (wa * out_a[r * head_dim + d] + wb * out_b[r * head_dim + d]) * inv;
    }
    lse_out[r] = m + std::log(wa + wb);
  }
}

}  // namespace kvflow::cpu
