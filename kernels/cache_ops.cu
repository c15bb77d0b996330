// reshape_and_cache: scatter the new K/V rows of a batch into their blocks of the paged cache.
#include <cuda_runtime.h>

#include "cache_ops.h"

namespace kvflow::cuda {
namespace {

// One thread block per token; threads stride over the kv_heads * head_dim elements, so each warp
// writes contiguous head_dim spans of one head (the layout keeps a head's slot contiguous).
template <typename T>
__global__ void ReshapeAndCacheKernel(const T* __restrict__ key, const T* __restrict__ value,
                                      T* __restrict__ key_cache, T* __restrict__ value_cache,
                                      const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                      int head_dim, int block_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / block_size;
  const int64_t offset_in_block = slot % block_size;
  const int n = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / head_dim;
    const int d = i % head_dim;
    const int64_t dst = ((block * num_kv_heads + head) * block_size + offset_in_block) * head_dim + d;
    key_cache[dst] = key[token * n + i];
    value_cache[dst] = value[token * n + i];
  }
}

}  // namespace

int ReshapeAndCacheF32(const float* key, const float* value, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                       int block_size, void* stream) {
  if (num_tokens == 0) return 0;
  const int threads = num_kv_heads * head_dim < 512 ? num_kv_heads * head_dim : 512;
  ReshapeAndCacheKernel<float><<<num_tokens, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      key, value, key_cache, value_cache, slot_mapping, num_kv_heads, head_dim, block_size);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvflow::cuda
