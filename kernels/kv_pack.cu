// KV pack / unpack: one layer's K and V at a list of paged slots to and from one contiguous buffer
// in the packed format of kv_pack.h (what KV-Runahead's chain and TSP's all-gather send).
//
// Pure byte copies, written over an opaque word (16, 8, 4 or 2 bytes) as cache_ops.cu is: one
// instantiation per word size serves fp32, fp16 and bf16 bit-exactly, and the launcher picks the
// widest word that every pointer and the head row divide into.
//
// grid = (num_slots, 2): one thread block moves one slot's K (blockIdx.y 0) or V (1), every KV head
// of it. Threads stride over num_kv_heads x head_words words; within a head both the cache row and
// the packed row are contiguous, so both sides are coalesced.
#include "device_utils.cuh"

#include "kv_pack.h"

namespace kvflow::cuda {
namespace {

template <typename W, bool kUnpack>
__global__ void __launch_bounds__(256)
    KvPackKernel(W* __restrict__ key_cache, W* __restrict__ value_cache, const int64_t* __restrict__ slots,
                 int64_t num_slots, W* __restrict__ packed, int num_kv_heads, int head_words, int block_size) {
  const int64_t i = blockIdx.x;
  const int kv = static_cast<int>(blockIdx.y);
  const int64_t slot = slots[i];
  W* cache = kv == 0 ? key_cache : value_cache;
  // Element (h, d) of the slot sits at ((block * H + h) * block_size + offset) * head_words + d.
  const int64_t cache_base = ((slot / block_size) * num_kv_heads * block_size + slot % block_size) * head_words;
  const int64_t cache_head_stride = static_cast<int64_t>(block_size) * head_words;
  // ... and is packed at ((kv * H + h) * num_slots + i) * head_words + d.
  const int64_t packed_base = (static_cast<int64_t>(kv) * num_kv_heads * num_slots + i) * head_words;
  const int64_t packed_head_stride = num_slots * head_words;
  const int n = num_kv_heads * head_words;
  for (int w = threadIdx.x; w < n; w += blockDim.x) {
    const int h = w / head_words;
    const int d = w - h * head_words;
    const int64_t at_cache = cache_base + h * cache_head_stride + d;
    const int64_t at_packed = packed_base + h * packed_head_stride + d;
    if constexpr (kUnpack) {
      cache[at_cache] = packed[at_packed];
    } else {
      packed[at_packed] = cache[at_cache];
    }
  }
}

template <typename W, bool kUnpack>
int LaunchKvPack(void* key_cache, void* value_cache, const int64_t* slots, int num_slots, void* packed,
                 int num_kv_heads, int head_bytes, int block_size, void* stream) {
  const int head_words = head_bytes / static_cast<int>(sizeof(W));
  const int n = num_kv_heads * head_words;
  int threads = (n + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 256 ? 256 : threads;
  return LaunchKernel(KvPackKernel<W, kUnpack>, dim3(static_cast<unsigned>(num_slots), 2),
                      dim3(static_cast<unsigned>(threads)), 0, stream, static_cast<W*>(key_cache),
                      static_cast<W*>(value_cache), slots, static_cast<int64_t>(num_slots), static_cast<W*>(packed),
                      num_kv_heads, head_words, block_size);
}

template <bool kUnpack>
int Dispatch(DType dtype, void* key_cache, void* value_cache, const int64_t* slots, int num_slots, void* packed,
             int num_kv_heads, int head_dim, int block_size, void* stream) {
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) return kInvalidValue;
  if (num_slots < 0 || num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0) return kInvalidValue;
  if (num_slots == 0) return 0;
  if (!key_cache || !value_cache || !slots || !packed) return kInvalidValue;
  const int head_bytes = head_dim * static_cast<int>(DTypeSize(dtype));
  const int align = CommonAlignment({reinterpret_cast<uintptr_t>(key_cache), reinterpret_cast<uintptr_t>(value_cache),
                                     reinterpret_cast<uintptr_t>(packed), static_cast<uint64_t>(head_bytes)});
  switch (align) {
    case 16:
      return LaunchKvPack<Word16, kUnpack>(key_cache, value_cache, slots, num_slots, packed, num_kv_heads, head_bytes,
                                           block_size, stream);
    case 8:
      return LaunchKvPack<Word8, kUnpack>(key_cache, value_cache, slots, num_slots, packed, num_kv_heads, head_bytes,
                                          block_size, stream);
    case 4:
      return LaunchKvPack<Word4, kUnpack>(key_cache, value_cache, slots, num_slots, packed, num_kv_heads, head_bytes,
                                          block_size, stream);
    case 2:
      return LaunchKvPack<Word2, kUnpack>(key_cache, value_cache, slots, num_slots, packed, num_kv_heads, head_bytes,
                                          block_size, stream);
    default:
      return kInvalidValue;  // pointers not even element-aligned
  }
}

}  // namespace

int PackKv(DType dtype, const void* key_cache, const void* value_cache, const int64_t* slots, int num_slots,
           void* packed, int num_kv_heads, int head_dim, int block_size, void* stream) {
  // The caches are only read (the kernel is shared with UnpackKv, which writes them).
  return Dispatch<false>(dtype, const_cast<void*>(key_cache), const_cast<void*>(value_cache), slots, num_slots, packed,
                         num_kv_heads, head_dim, block_size, stream);
}

int UnpackKv(DType dtype, const void* packed, const int64_t* slots, int num_slots, void* key_cache, void* value_cache,
             int num_kv_heads, int head_dim, int block_size, void* stream) {
  return Dispatch<true>(dtype, key_cache, value_cache, slots, num_slots, const_cast<void*>(packed), num_kv_heads,
                        head_dim, block_size, stream);
}

}  // namespace kvflow::cuda
