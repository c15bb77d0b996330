// Row gather into fp32: the embedding lookup (token ids -> hidden rows of the residual stream) and
// the selection of the rows that need logits.
#include "device_utils.cuh"

#include <cmath>

#include "embedding.h"

namespace kvflow::cuda {
namespace {

using dev::Vec;

// grid = (num_rows, chunks of kChunk elements of a row): rows on x (no 65535 limit for long
// prefills), a few CTAs per row so a decode step with a handful of rows still spreads out.
constexpr int kThreads = 128;
constexpr int kPerThread = 8;
constexpr int kChunk = kThreads * kPerThread;

// kVec: each thread moves kPerThread consecutive elements with 16-byte loads (8 x 16-bit or
// 4 x fp32) and 16-byte float4 stores; consecutive threads touch consecutive 16-byte words. The
// launcher only picks it when n is a multiple of the vector width and everything is 16-byte
// aligned. Otherwise each thread moves elements blockDim apart (still coalesced).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const T* __restrict__ src, int64_t src_row_stride, int64_t num_src_rows,
                     const int32_t* __restrict__ indices, int n, float scale, float* __restrict__ dst,
                     int64_t shard_first) {
  const int64_t row = blockIdx.x;
  const int64_t index = static_cast<int64_t>(indices[row]) - (shard_first >= 0 ? shard_first : 0);
  const bool valid = index >= 0 && index < num_src_rows;
  // Outside a shard: another rank's row, zeros here; outside a whole table: NaN.
  const float invalid = shard_first >= 0 ? 0.0f : NAN;
  const T* in = src + (valid ? index * src_row_stride : 0);
  float* out = dst + row * n;
  const int begin = static_cast<int>(blockIdx.y) * kChunk;
  if constexpr (kVec) {
    constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
#pragma unroll
    for (int j = 0; j < kPerThread / V; ++j) {
      const int i = begin + (j * kThreads + static_cast<int>(threadIdx.x)) * V;
      if (i >= n) break;  // n % V == 0: a vector is either wholly in the row or wholly out
      Vec<float, V> f;
      if (valid) {
        const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(in + i);
#pragma unroll
        for (int k = 0; k < V; ++k) f.v[k] = dev::ToFloat(x.v[k]) * scale;
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) f.v[k] = invalid;  // a bad token id is made loud downstream
      }
#pragma unroll
      for (int k = 0; k < V; k += 4) {
        *reinterpret_cast<Vec<float, 4>*>(out + i + k) = *reinterpret_cast<const Vec<float, 4>*>(&f.v[k]);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = begin + j * kThreads + static_cast<int>(threadIdx.x);
      if (i < n) out[i] = valid ? dev::ToFloat(in[i]) * scale : invalid;
    }
  }
}

}  // namespace

int GatherRowsToF32(DType src_dtype, const void* src, int64_t src_row_stride, int64_t num_src_rows,
                    const int32_t* indices, int num_rows, int n, float* dst, void* stream, float scale,
                    int64_t shard_first) {
  if (num_rows < 0 || n < 0 || num_src_rows < 0 || src_row_stride < 0) return kInvalidValue;
  if (num_rows == 0 || n == 0) return 0;
  if (!src || !indices || !dst || (num_src_rows > 1 && src_row_stride < n)) return kInvalidValue;
  const int64_t chunks = (static_cast<int64_t>(n) + kChunk - 1) / kChunk;
  if (chunks > 65535) return kInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(chunks));
  KVFLOW_DISPATCH_DTYPE(src_dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const bool vec = n % V == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                     (src_row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst) % 16 == 0;
    if (vec) {
      return LaunchKernel(GatherRowsKernel<T, true>, grid, dim3(kThreads), 0, stream, static_cast<const T*>(src),
                          src_row_stride, num_src_rows, indices, n, scale, dst, shard_first);
    }
    return LaunchKernel(GatherRowsKernel<T, false>, grid, dim3(kThreads), 0, stream, static_cast<const T*>(src),
                        src_row_stride, num_src_rows, indices, n, scale, dst, shard_first);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
