// KV-cache kernels: reshape_and_cache (scatter a batch's new K/V rows into their paged slots),
// gather_slots (collect scattered slots of one layer into consecutive blocks) and copy_blocks
// (copy-on-write of whole blocks in every layer). Layout: kv/kv_cache_layout.h.
//
// All are pure byte copies, so they are written in terms of an opaque "word" (16, 8, 4 or 2 bytes)
// rather than the element type: the copy is bit-exact by construction, and one instantiation per
// word size serves fp32, fp16 and bf16. The launcher picks the widest word that every pointer,
// stride and row length is a multiple of; for the supported head dims (64/128) that is 16 bytes.
#include "device_utils.cuh"

#include "cache_ops.h"

namespace kvflow::cuda {
namespace {

// ---- reshape_and_cache -------------------------------------------------------------------------------
//
// One thread block per token. Threads stride over the token's num_kv_heads * head_dim words and copy
// the K and the V word at the same index (two independent loads in flight per thread). Consecutive
// threads read consecutive words of the source row and write consecutive words of one head's slot
// (contiguous in the cache layout), so both sides are fully coalesced. All sizes here are in words.
template <typename W>
__global__ void __launch_bounds__(256)
    ReshapeAndCacheKernel(const W* __restrict__ key, int64_t key_row_stride, const W* __restrict__ value,
                          int64_t value_row_stride, W* __restrict__ key_cache, W* __restrict__ value_cache,
                          const int64_t* __restrict__ slot_mapping, int num_kv_heads, int head_words,
                          int block_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token: nothing to cache
  const int64_t block = slot / block_size;
  const int64_t offset_in_block = slot % block_size;
  const W* k_row = key + token * key_row_stride;
  const W* v_row = value + token * value_row_stride;
  // Element (head, d) of this token goes to ((block * H + head) * block_size + offset) * D + d.
  const int64_t base = (block * num_kv_heads * block_size + offset_in_block) * head_words;
  const int64_t head_stride = static_cast<int64_t>(block_size) * head_words;
  const int n = num_kv_heads * head_words;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / head_words;
    const int d = i - head * head_words;
    const int64_t dst = base + head * head_stride + d;
    const W k = k_row[i];
    const W v = v_row[i];
    key_cache[dst] = k;
    value_cache[dst] = v;
  }
}

template <typename W>
int LaunchReshapeAndCache(const void* key, int64_t key_row_stride_bytes, const void* value,
                          int64_t value_row_stride_bytes, void* key_cache, void* value_cache,
                          const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_bytes,
                          int block_size, void* stream) {
  const int head_words = head_bytes / static_cast<int>(sizeof(W));
  const int n = num_kv_heads * head_words;
  // Enough threads to cover the row in one pass where possible (8 KV heads x 128 fp16 = 128 words
  // of 16 bytes), at most 256.
  int threads = (n + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 256 ? 256 : threads;
  return LaunchKernel(ReshapeAndCacheKernel<W>, dim3(static_cast<unsigned>(num_tokens)),
                      dim3(static_cast<unsigned>(threads)), 0, stream, static_cast<const W*>(key),
                      key_row_stride_bytes / static_cast<int64_t>(sizeof(W)), static_cast<const W*>(value),
                      value_row_stride_bytes / static_cast<int64_t>(sizeof(W)), static_cast<W*>(key_cache),
                      static_cast<W*>(value_cache), slot_mapping, num_kv_heads, head_words, block_size);
}

// ---- gather_slots ------------------------------------------------------------------------------------
//
// One thread block per destination slot, as reshape_and_cache: threads stride over the slot's
// num_kv_heads * head_words words; within a head both the source and the destination rows are
// contiguous, so both sides are coalesced.
template <typename W>
__global__ void __launch_bounds__(256)
    GatherSlotsKernel(const W* __restrict__ key_cache, const W* __restrict__ value_cache,
                      const int64_t* __restrict__ src_slots, W* __restrict__ dst_key, W* __restrict__ dst_value,
                      int num_kv_heads, int head_words, int block_size) {
  const int64_t dst_slot = blockIdx.x;
  const int64_t src_slot = src_slots[dst_slot];
  if (src_slot < 0) return;  // padding up to a block boundary
  const int64_t head_stride = static_cast<int64_t>(block_size) * head_words;
  const int64_t block_words = num_kv_heads * head_stride;
  const int64_t src = (src_slot / block_size) * block_words + (src_slot % block_size) * head_words;
  const int64_t dst = (dst_slot / block_size) * block_words + (dst_slot % block_size) * head_words;
  const int n = num_kv_heads * head_words;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / head_words;
    const int64_t at = head * head_stride + (i - head * head_words);
    const W k = key_cache[src + at];
    const W v = value_cache[src + at];
    dst_key[dst + at] = k;
    dst_value[dst + at] = v;
  }
}

template <typename W>
int LaunchGatherSlots(const void* key_cache, const void* value_cache, const int64_t* src_slots, int num_slots,
                      void* dst_key, void* dst_value, int num_kv_heads, int head_bytes, int block_size,
                      void* stream) {
  const int head_words = head_bytes / static_cast<int>(sizeof(W));
  const int n = num_kv_heads * head_words;
  int threads = (n + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 256 ? 256 : threads;
  return LaunchKernel(GatherSlotsKernel<W>, dim3(static_cast<unsigned>(num_slots)), dim3(static_cast<unsigned>(threads)),
                      0, stream, static_cast<const W*>(key_cache), static_cast<const W*>(value_cache), src_slots,
                      static_cast<W*>(dst_key), static_cast<W*>(dst_value), num_kv_heads, head_words, block_size);
}

// ---- copy_blocks -------------------------------------------------------------------------------------
//
// grid = (num_pairs, num_layers, 2 pools): one thread block copies one block of one layer of one
// pool, block_words contiguous words from src to dst. Each thread keeps kUnroll independent loads
// in flight before storing, which a plain strided loop would not (stores may alias later loads as
// far as the compiler knows).
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;

template <typename W>
__global__ void __launch_bounds__(kCopyThreads)
    CopyBlocksKernel(W* __restrict__ key_pool, W* __restrict__ value_pool, int64_t layer_words,
                     int64_t block_words, const int32_t* __restrict__ pairs) {
  const int32_t src_block = pairs[2 * static_cast<int64_t>(blockIdx.x)];
  const int32_t dst_block = pairs[2 * static_cast<int64_t>(blockIdx.x) + 1];
  if (src_block < 0 || dst_block < 0) return;
  W* pool = blockIdx.z == 0 ? key_pool : value_pool;
  W* layer = pool + static_cast<int64_t>(blockIdx.y) * layer_words;
  const W* src = layer + src_block * block_words;
  W* dst = layer + dst_block * block_words;
  constexpr int64_t kStep = static_cast<int64_t>(kCopyThreads) * kCopyUnroll;
  for (int64_t base = threadIdx.x; base < block_words; base += kStep) {
    W tmp[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kCopyThreads;
      if (i < block_words) tmp[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kCopyThreads;
      if (i < block_words) dst[i] = tmp[u];
    }
  }
}

template <typename W>
int LaunchCopyBlocks(void* key_pool, void* value_pool, int num_layers, int64_t layer_bytes, int64_t block_bytes,
                     const int32_t* pairs, int num_pairs, void* stream) {
  const int64_t w = static_cast<int64_t>(sizeof(W));
  return LaunchKernel(CopyBlocksKernel<W>,
                      dim3(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_layers), 2),
                      dim3(kCopyThreads), 0, stream, static_cast<W*>(key_pool), static_cast<W*>(value_pool),
                      layer_bytes / w, block_bytes / w, pairs);
}

}  // namespace

int ReshapeAndCache(DType dtype, const void* key, int64_t key_row_stride, const void* value,
                    int64_t value_row_stride, void* key_cache, void* value_cache, const int64_t* slot_mapping,
                    int num_tokens, int num_kv_heads, int head_dim, int block_size, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return kInvalidValue;
  if (num_tokens < 0 || num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0) return kInvalidValue;
  const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
  if (key_row_stride < row || value_row_stride < row) return kInvalidValue;
  if (num_tokens == 0) return 0;
  if (!key || !value || !key_cache || !value_cache || !slot_mapping) return kInvalidValue;
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  const int head_bytes = head_dim * static_cast<int>(es);
  const int64_t ks = key_row_stride * es, vs = value_row_stride * es;
  const int align = CommonAlignment({reinterpret_cast<uintptr_t>(key), reinterpret_cast<uintptr_t>(value),
                                     reinterpret_cast<uintptr_t>(key_cache),
                                     reinterpret_cast<uintptr_t>(value_cache), static_cast<uint64_t>(ks),
                                     static_cast<uint64_t>(vs), static_cast<uint64_t>(head_bytes)});
  switch (align) {
    case 16:
      return LaunchReshapeAndCache<Word16>(key, ks, value, vs, key_cache, value_cache, slot_mapping, num_tokens,
                                           num_kv_heads, head_bytes, block_size, stream);
    case 8:
      return LaunchReshapeAndCache<Word8>(key, ks, value, vs, key_cache, value_cache, slot_mapping, num_tokens,
                                          num_kv_heads, head_bytes, block_size, stream);
    case 4:
      return LaunchReshapeAndCache<Word4>(key, ks, value, vs, key_cache, value_cache, slot_mapping, num_tokens,
                                          num_kv_heads, head_bytes, block_size, stream);
    case 2:
      return LaunchReshapeAndCache<Word2>(key, ks, value, vs, key_cache, value_cache, slot_mapping, num_tokens,
                                          num_kv_heads, head_bytes, block_size, stream);
    default:
      return kInvalidValue;  // pointers not even element-aligned
  }
}

int ReshapeAndCacheF32(const float* key, const float* value, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim, int block_size,
                       void* stream) {
  const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
  return ReshapeAndCache(DType::kF32, key, row, value, row, key_cache, value_cache, slot_mapping, num_tokens,
                         num_kv_heads, head_dim, block_size, stream);
}

int GatherSlots(DType dtype, const void* key_cache, const void* value_cache, const int64_t* src_slots, int num_slots,
                void* dst_key, void* dst_value, int num_kv_heads, int head_dim, int block_size, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return kInvalidValue;
  if (num_slots < 0 || num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0) return kInvalidValue;
  if (num_slots == 0) return 0;
  if (!key_cache || !value_cache || !src_slots || !dst_key || !dst_value) return kInvalidValue;
  const int head_bytes = head_dim * static_cast<int>(DTypeSize(dtype));
  const int align = CommonAlignment({reinterpret_cast<uintptr_t>(key_cache), reinterpret_cast<uintptr_t>(value_cache),
                                     reinterpret_cast<uintptr_t>(dst_key), reinterpret_cast<uintptr_t>(dst_value),
                                     static_cast<uint64_t>(head_bytes)});
  switch (align) {
    case 16:
      return LaunchGatherSlots<Word16>(key_cache, value_cache, src_slots, num_slots, dst_key, dst_value, num_kv_heads,
                                       head_bytes, block_size, stream);
    case 8:
      return LaunchGatherSlots<Word8>(key_cache, value_cache, src_slots, num_slots, dst_key, dst_value, num_kv_heads,
                                      head_bytes, block_size, stream);
    case 4:
      return LaunchGatherSlots<Word4>(key_cache, value_cache, src_slots, num_slots, dst_key, dst_value, num_kv_heads,
                                      head_bytes, block_size, stream);
    case 2:
      return LaunchGatherSlots<Word2>(key_cache, value_cache, src_slots, num_slots, dst_key, dst_value, num_kv_heads,
                                      head_bytes, block_size, stream);
    default:
      return kInvalidValue;
  }
}

int CopyBlocks(DType dtype, void* key_pool, void* value_pool, int num_layers, int64_t layer_stride,
               int64_t block_stride, const int32_t* pairs, int num_pairs, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return kInvalidValue;
  if (num_pairs < 0 || num_layers < 0 || num_layers > 65535 || block_stride <= 0 || layer_stride < block_stride) {
    return kInvalidValue;
  }
  if (num_pairs == 0 || num_layers == 0) return 0;
  if (!key_pool || !value_pool || !pairs) return kInvalidValue;
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t layer_bytes = layer_stride * es, block_bytes = block_stride * es;
  const int align = CommonAlignment({reinterpret_cast<uintptr_t>(key_pool), reinterpret_cast<uintptr_t>(value_pool),
                                     static_cast<uint64_t>(layer_bytes), static_cast<uint64_t>(block_bytes)});
  switch (align) {
    case 16:
      return LaunchCopyBlocks<Word16>(key_pool, value_pool, num_layers, layer_bytes, block_bytes, pairs, num_pairs,
                                      stream);
    case 8:
      return LaunchCopyBlocks<Word8>(key_pool, value_pool, num_layers, layer_bytes, block_bytes, pairs, num_pairs,
                                     stream);
    case 4:
      return LaunchCopyBlocks<Word4>(key_pool, value_pool, num_layers, layer_bytes, block_bytes, pairs, num_pairs,
                                     stream);
    case 2:
      return LaunchCopyBlocks<Word2>(key_pool, value_pool, num_layers, layer_bytes, block_bytes, pairs, num_pairs,
                                     stream);
    default:
      return kInvalidValue;
  }
}

}  // namespace kvflow::cuda
