// Launchers of the KV-cache kernels (kernels/cache_ops.cu). Layout: kv/kv_cache_layout.h.
// Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// reshape_and_cache: writes the K and V rows of a batch's new tokens into their paged slots, one
// launch for the whole batch. Row t of key is at key + t * key_row_stride and holds num_kv_heads
// x head_dim elements (likewise value), so K and V can be read straight out of a fused QKV buffer.
// slot_mapping[t] = physical_block * block_size + slot, or -1 to skip the token.
int ReshapeAndCache(DType dtype, const void* key, int64_t key_row_stride, const void* value,
                    int64_t value_row_stride, void* key_cache, void* value_cache,
                    const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                    int block_size, void* stream);

// Kept for the fp32 reference test of issue 2; same as ReshapeAndCache(kF32, dense rows).
int ReshapeAndCacheF32(const float* key, const float* value, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                       int block_size, void* stream);

// gather_slots: for one layer, copies the K and V of cache slot src_slots[i] (physical_block *
// block_size + slot) into slot i of dst_key / dst_value, which are laid out like the cache (slot i
// = block i / block_size, offset i % block_size; a block holds num_kv_heads x block_size x
// head_dim elements). Scattered tokens (a KvView of explicit slots) thus become whole blocks that
// the paged-attention kernels read through a plain block table. src_slots[i] = -1 leaves slot i
// untouched (the padding up to a block boundary). The destination must not overlap the cache.
int GatherSlots(DType dtype, const void* key_cache, const void* value_cache, const int64_t* src_slots, int num_slots,
                void* dst_key, void* dst_value, int num_kv_heads, int head_dim, int block_size, void* stream);

// copy_blocks (copy-on-write): for each i < num_pairs copies block pairs[2i] to block pairs[2i+1]
// in every layer of both pools, in one launch. The pools hold num_layers consecutive layers of
// layer_stride elements; a block is block_stride elements (kv/kv_cache_layout.h). Sources and
// destinations must not overlap (the block manager guarantees it).
int CopyBlocks(DType dtype, void* key_pool, void* value_pool, int num_layers, int64_t layer_stride,
               int64_t block_stride, const int32_t* pairs, int num_pairs, void* stream);

}  // namespace kvflow::cuda
