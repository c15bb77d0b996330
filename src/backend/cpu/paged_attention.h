// Reference paged attention on the CPU. The CUDA kernels are tested against these functions, so
// they read and write the cache exactly as described in kv/kv_cache_layout.h.
#pragma once

#include "backend/backend.h"
#include "kv/kv_cache_layout.h"

namespace kvflow::cpu {

// Writes the K and V rows of every new token of `batch` into its block slot (reshape_and_cache).
// key/value: [num_tokens, num_kv_heads, head_dim]; caches: one layer's pools.
void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache);

// Causal attention of every new token over its sequence's cached context (which already holds the
// token's own K/V). query/out: [num_tokens, num_heads, head_dim]; query head h reads KV head
// h / (num_heads / num_kv_heads).
void PagedAttention(const ForwardBatch& batch, const KvCacheLayout& layout, int num_heads,
                    const float* query, const float* key_cache, const float* value_cache, float scale,
                    float* out);

}  // namespace kvflow::cpu
