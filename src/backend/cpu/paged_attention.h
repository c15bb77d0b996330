// Paged attention on the CPU: the reference the CUDA kernels are tested against (it reads and writes
// the cache exactly as described in kv/kv_cache_layout.h) and the CPU backend's fast path. Tiled
// like flash-attention (paged_attention.cc, kernels in attention_kernels.h); its own tests compare
// it with plain attention in double precision.
#pragma once

#include <span>
#include <vector>

#include "backend/backend.h"
#include "kv/kv_cache_layout.h"

namespace kvflow::cpu {

// The element type of a KV pool: fp32 (exact), fp16 (half the bytes a long context reads per
// step; llama.cpp's default; rounded to nearest even when written) or q4 (4-bit groups of 32 along
// head_dim with an fp16 scale and minimum, 0.625 bytes a value: kv_q4.h; InfiniGen's INT4
// baseline). Reads widen every type to fp32.
enum class KvElement { kF32, kF16, kQ4 };
const char* KvElementName(KvElement e);
// Bytes of `elements` consecutive pool elements, which is also the byte offset of element offset
// `elements` in a pool. kQ4 counts whole rows only (layout offsets and row counts are multiples of
// head_dim, itself a multiple of 32: CheckKvElement).
size_t KvPoolBytes(KvElement e, size_t elements);
// InvalidArgument when a pool of `e` cannot hold rows of head_dim (kQ4 needs a multiple of 32).
Status CheckKvElement(KvElement e, int head_dim);

// Writes K and V row t (num_kv_heads x head_dim at key + t * row_stride, likewise value) into
// physical slot slots[t] (block * block_size + offset); -1 skips the token (reshape_and_cache).
void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, float* key_cache, float* value_cache);
// The same into a pool of `element`s (key_cache / value_cache point at that layer's pool).
void WriteKvCache(std::span<const int64_t> slots, const KvCacheLayout& layout, const float* key,
                  const float* value, int64_t row_stride, KvElement element, void* key_cache, void* value_cache);
// The same for dense rows ([num_tokens, num_kv_heads, head_dim]) at the batch's slots.
void WriteKvCache(const ForwardBatch& batch, const KvCacheLayout& layout, const float* key,
                  const float* value, float* key_cache, float* value_cache);

// The cached rows at `slots` as fp32: out[t][kv_head][head_dim] from a K or V pool of `element`s.
void ReadKvRows(std::span<const int64_t> slots, const KvCacheLayout& layout, KvElement element, const void* cache,
                float* out);

// Where attention reads its queries and writes its results: row t of the batch at
// query + t * query_row_stride (num_heads x head_dim), likewise out; lse, when set, receives the
// log-sum-exp of each (token, head)'s scaled scores, [num_tokens, num_heads], so attentions over
// disjoint KV sets can be merged (MergeAttentionStates).
struct AttentionIo {
  const float* query = nullptr;
  int64_t query_row_stride = 0;
  float* out = nullptr;
  int64_t out_row_stride = 0;
  float* lse = nullptr;
  // > 0: a sliding window, in view entries: the query that sees entries [0, e] sees only
  // [e - window + 1, e]. Entries before every query's window are never read (their slots may be
  // -1: blocks released from the window).
  int32_t window = 0;
  // > 0: scaled scores soft-capped, s -> softcap * tanh(s / softcap), before the mask (Gemma-2).
  float softcap = 0.0f;
};

// Attention of every new token over its sequence's KV view (which already holds the token's own
// K/V); causal in view order (backend.h, KvView). view_slots[s]: the physical slots of slice s's
// view (ViewSlots). Query head h reads KV head h / (num_heads / num_kv_heads). With one list per
// (slice, KV head) instead (view_slots[s * num_kv_heads + g], equal lengths within a slice: a
// KvHeadSelection), KV head g reads its own list.
void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, const float* key_cache,
                    const float* value_cache, float scale);
// The same over a pool of `element`s.
void PagedAttention(const ForwardBatch& batch, std::span<const std::vector<int64_t>> view_slots,
                    const KvCacheLayout& layout, int num_heads, const AttentionIo& io, KvElement element,
                    const void* key_cache, const void* value_cache, float scale);
// The same with dense queries and outputs ([num_tokens, num_heads, head_dim]) and each slice's view.
void PagedAttention(const ForwardBatch& batch, const KvCacheLayout& layout, int num_heads,
                    const float* query, const float* key_cache, const float* value_cache, float scale,
                    float* out);

// Merges two attentions of the same queries over disjoint KV sets a and b into one, exactly as if
// computed over their union: out = (e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b). Rows of
// `rows` = tokens x heads, each head_dim long; lse_out may alias lse_a.
void MergeAttentionStates(const float* out_a, const float* lse_a, const float* out_b, const float* lse_b,
                          int64_t rows, int head_dim, float* out, float* lse_out);

}  // namespace kvflow::cpu
