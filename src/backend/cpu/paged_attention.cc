#include "backend/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kvflow::cpu {

void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache) {
  const int D = layout.head_dim;
  const int KV = layout.num_kv_heads;
  for (const SequenceSlice& s : batch.seqs) {
    for (int32_t i = 0; i < s.num_tokens; ++i) {
      const int64_t t = s.token_offset + i;
      const int32_t pos = batch.positions[static_cast<size_t>(t)];
      const BlockId block = s.block_table[static_cast<size_t>(pos / layout.block_size)];
      const int slot = pos % layout.block_size;
      for (int h = 0; h < KV; ++h) {
        const size_t dst = layout.offset(block, h, slot);
        std::memcpy(key_cache + dst, key + (t * KV + h) * D, sizeof(float) * D);
        std::memcpy(value_cache + dst, value + (t * KV + h) * D, sizeof(float) * D);
      }
    }
  }
}

namespace {

struct AttentionTask {
  const SequenceSlice* seq;
  int32_t token;  // index into the batch
  int32_t head;
};

}  // namespace

void PagedAttention(const ForwardBatch& batch, const KvCacheLayout& layout, int num_heads,
                    const float* query, const float* key_cache, const float* value_cache, float scale,
                    float* out) {
  const int D = layout.head_dim;
  const int group = num_heads / layout.num_kv_heads;
  const int bs = layout.block_size;
  std::vector<AttentionTask> tasks;
  tasks.reserve(batch.tokens.size() * static_cast<size_t>(num_heads));
  for (const SequenceSlice& s : batch.seqs) {
    for (int32_t i = 0; i < s.num_tokens; ++i) {
      for (int h = 0; h < num_heads; ++h) tasks.push_back({&s, s.token_offset + i, h});
    }
  }

#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 4)
    for (size_t n = 0; n < tasks.size(); ++n) {
      const AttentionTask& task = tasks[n];
      const int kv_head = task.head / group;
      const int32_t pos = batch.positions[static_cast<size_t>(task.token)];
      const int32_t ctx = pos + 1;  // causal: sees itself and everything before
      const float* q = query + (static_cast<int64_t>(task.token) * num_heads + task.head) * D;
      const std::vector<BlockId>& table = task.seq->block_table;
      scores.resize(static_cast<size_t>(ctx));

      float max_score = -INFINITY;
      for (int32_t j = 0; j < ctx; ++j) {
        const float* k = key_cache + layout.offset(table[static_cast<size_t>(j / bs)], kv_head, j % bs);
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[static_cast<size_t>(j)] = dot * scale;
        max_score = std::max(max_score, scores[static_cast<size_t>(j)]);
      }
      float denom = 0.0f;
      for (int32_t j = 0; j < ctx; ++j) {
        scores[static_cast<size_t>(j)] = std::exp(scores[static_cast<size_t>(j)] - max_score);
        denom += scores[static_cast<size_t>(j)];
      }
      float* o = out + (static_cast<int64_t>(task.token) * num_heads + task.head) * D;
      std::fill(o, o + D, 0.0f);
      for (int32_t j = 0; j < ctx; ++j) {
        const float p = scores[static_cast<size_t>(j)] / denom;
        const float* v = value_cache + layout.offset(table[static_cast<size_t>(j / bs)], kv_head, j % bs);
        for (int d = 0; d < D; ++d) o[d] += p * v[d];
      }
    }
  }
}

}  // namespace kvflow::cpu
