// Memory layout of the paged KV cache, shared by the CPU reference and the CUDA kernels.
//
// One pool per layer and per K/V, each an array of physical blocks:
//
//   key_cache[layer]   : [num_blocks][num_kv_heads][block_size][head_dim]
//   value_cache[layer] : [num_blocks][num_kv_heads][block_size][head_dim]
//
// The token at logical position t of a sequence with block table `bt` lives in physical block
// bt[t / block_size], slot t % block_size. Within a block, one KV head's tokens are contiguous
// (block_size x head_dim), so a GPU warp reading one head of one block streams a single
// contiguous span, and a whole block of one head is block_size*head_dim elements. All layers of
// one pool are allocated as one buffer: layer l starts at l * layer_stride().
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvflow {

struct KvCacheLayout {
  int num_layers = 0;
  int num_blocks = 0;
  int num_kv_heads = 0;
  int block_size = 16;
  int head_dim = 0;

  size_t head_stride() const { return static_cast<size_t>(block_size) * head_dim; }
  size_t block_stride() const { return head_stride() * num_kv_heads; }
  size_t layer_stride() const { return block_stride() * num_blocks; }
  // Offset (in elements) of (block, kv_head, slot) within one layer's K or V pool.
  size_t offset(int block, int kv_head, int slot) const {
    return static_cast<size_t>(block) * block_stride() + static_cast<size_t>(kv_head) * head_stride() +
           static_cast<size_t>(slot) * head_dim;
  }
  // Elements of K plus V for one block across all layers.
  size_t elements_per_block_all_layers() const { return 2 * block_stride() * num_layers; }
};

}  // namespace kvflow
