// Launchers of the KV pack kernels (kernels/kv_pack.cu): KV-Runahead's and TSP's wire format built
// and taken apart on the device, so a transport of device buffers (NCCL, CUDA peer copies) sends
// one contiguous buffer per layer and nothing crosses to the host. Layout: kv/kv_cache_layout.h.
// Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// The packed format (Backend's KvPacking): K then V, per KV head, the listed slots' rows in list
// order: packed[((kv * num_kv_heads + h) * num_slots + i) * head_dim + d] is element d of head h of
// slot slots[i] in the key (kv 0) or value (kv 1) cache of one layer. slots[i] = physical_block *
// block_size + offset; every slot must lie inside the layer's pool.
//
// PackKv copies the layer's K/V at `slots` into `packed`; UnpackKv writes `packed` into the layer at
// `slots` (which must not repeat: two rows to one slot would race). Byte copies, exact for every
// dtype; one launch each for the whole list.
int PackKv(DType dtype, const void* key_cache, const void* value_cache, const int64_t* slots, int num_slots,
           void* packed, int num_kv_heads, int head_dim, int block_size, void* stream);
int UnpackKv(DType dtype, const void* packed, const int64_t* slots, int num_slots, void* key_cache, void* value_cache,
             int num_kv_heads, int head_dim, int block_size, void* stream);

}  // namespace kvflow::cuda
