// Launchers of the KV-cache kernels (kernels/cache_ops.cu). Plain C++ declarations: callers need
// no CUDA headers. Layout: kv/kv_cache_layout.h.
#pragma once

#include <cstdint>

namespace kvflow::cuda {

// Writes key/value rows [num_tokens, num_kv_heads, head_dim] into their paged slots in one launch.
// slot_mapping[t] = physical_block * block_size + slot, or -1 to skip the token (padding).
// All pointers are device pointers; `stream` is a cudaStream_t (nullptr: default stream).
// Returns 0 or the cudaError_t of the launch.
int ReshapeAndCacheF32(const float* key, const float* value, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                       int block_size, void* stream);

}  // namespace kvflow::cuda
