#include "backend/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "util/thread_pool.h"

namespace kvflow::cpu {

void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, float* key_cache, float* value_cache) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  const int bs = layout.block_size;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    const int block = static_cast<int>(slots[t] / bs);
    const int offset = static_cast<int>(slots[t] % bs);
    for (int h = 0; h < KV; ++h) {
      const size_t dst = layout.offset(block, h, offset);
      std::memcpy(key_cache + dst, key + static_cast<int64_t>(t) * row_stride + h * D, sizeof(float) * D);
      std::memcpy(value_cache + dst, value + static_cast<int64_t>(t) * row_stride + h * D, sizeof(float) * D);
    }
  }
}

void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache) {
  const std::vector<int64_t> slots = ResolveSlotMapping(batch, layout.block_size);
  WriteKvCache(slots, layout, key, value, static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim, key_cache,
               value_cache);
}

namespace {

struct AttentionTask {
  int32_t seq;    // slice index
  int32_t token;  // index into the batch
  int32_t visible;  // view entries this query sees
  int32_t head;
};

}  // namespace

void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const float* key_cache,
                    const float* value_cache, float scale) {
  const int D = layout.head_dim;
  const int group = num_heads / layout.num_kv_heads;
  const int bs = layout.block_size;
  std::vector<AttentionTask> tasks;
  tasks.reserve(batch.tokens.size() * static_cast<size_t>(num_heads));
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    const int32_t size = static_cast<int32_t>(view_slots[s].size());
    for (int32_t i = 0; i < slice.num_tokens; ++i) {
      // Causal in view order: the slice's tokens are the view's last entries.
      const int32_t visible = size - slice.num_tokens + i + 1;
      for (int h = 0; h < num_heads; ++h) {
        tasks.push_back({static_cast<int32_t>(s), slice.token_offset + i, visible, h});
      }
    }
  }
  // Offset of a slot's head row within one layer's pool.
  auto at = [&](int64_t slot, int kv_head) {
    return layout.offset(static_cast<int>(slot / bs), kv_head, static_cast<int>(slot % bs));
  };

  // Dynamic chunks: tasks differ in length (context lengths, causal prefill rows).
  ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scores;
    for (int64_t n = first; n < last; ++n) {
      const AttentionTask& task = tasks[static_cast<size_t>(n)];
      const int kv_head = task.head / group;
      const std::vector<int64_t>& slots = view_slots[static_cast<size_t>(task.seq)];
      const float* q = io.query + task.token * io.query_row_stride + static_cast<int64_t>(task.head) * D;
      scores.resize(static_cast<size_t>(task.visible));

      float max_score = -INFINITY;
      for (int32_t j = 0; j < task.visible; ++j) {
        const float* k = key_cache + at(slots[static_cast<size_t>(j)], kv_head);
        float dot = 0.0f;
        // simd reduction: lets the compiler keep several partial sums (a vectorized dot product).
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[static_cast<size_t>(j)] = dot * scale;
        max_score = std::max(max_score, scores[static_cast<size_t>(j)]);
      }
      float denom = 0.0f;
      for (int32_t j = 0; j < task.visible; ++j) {
        scores[static_cast<size_t>(j)] = std::exp(scores[static_cast<size_t>(j)] - max_score);
        denom += scores[static_cast<size_t>(j)];
      }
      float* o = io.out + task.token * io.out_row_stride + static_cast<int64_t>(task.head) * D;
      std::fill(o, o + D, 0.0f);
      for (int32_t j = 0; j < task.visible; ++j) {
        const float p = scores[static_cast<size_t>(j)] / denom;
        const float* v = value_cache + at(slots[static_cast<size_t>(j)], kv_head);
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += p * v[d];
      }
      if (io.lse) io.lse[static_cast<int64_t>(task.token) * num_heads + task.head] = max_score + std::log(denom);
    }
  }, 4);
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
