// RMSNorm over fp32 residual rows, writing the normalized activations in the model dtype, plus the
// fused residual add that precedes every norm after the first.
//
// Math exactly as cpu::RmsNorm (src/backend/cpu/cpu_ops.cc), all in fp32:
//   inv = 1.0f / sqrtf(sum(x^2) / float(n) + eps);   out = weight * (x * inv)
// Only the summation order differs (a tree instead of a sequential sum), so fp32 results agree with
// the CPU to a few ulp. 1/sqrtf rather than rsqrtf: rsqrtf is off by up to 2 ulp.
#include "device_utils.cuh"

#include "rms_norm.h"

namespace kvflow::cuda {
namespace {

using dev::Vec;

// V consecutive fp32 values (V a multiple of 4: float4 loads/stores; V == 1: scalar).
template <int V>
__device__ __forceinline__ void LoadF32(const float* p, float (&f)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      const Vec<float, 4> t = *reinterpret_cast<const Vec<float, 4>*>(p + k);
#pragma unroll
      for (int j = 0; j < 4; ++j) f[k + j] = t.v[j];
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = p[k];
  }
}
template <int V>
__device__ __forceinline__ void StoreF32(float* p, const float (&f)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int k = 0; k < V; k += 4) {
      Vec<float, 4> t;
#pragma unroll
      for (int j = 0; j < 4; ++j) t.v[j] = f[k + j];
      *reinterpret_cast<Vec<float, 4>*>(p + k) = t;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = f[k];
  }
}
// V consecutive elements of type T in one load of V * sizeof(T) bytes (16 on the vector path).
template <typename T, int V>
__device__ __forceinline__ void LoadElems(const T* p, float (&f)[V]) {
  const Vec<T, V> t = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
  for (int k = 0; k < V; ++k) f[k] = dev::ToFloat(t.v[k]);
}
template <typename T, int V>
__device__ __forceinline__ void StoreElems(T* p, const float (&f)[V]) {
  Vec<T, V> t;
#pragma unroll
  for (int k = 0; k < V; ++k) t.v[k] = dev::FromFloat<T>(f[k]);
  *reinterpret_cast<Vec<T, V>*>(p) = t;
}

// One CTA per row. Thread t handles the V-element groups t, t + blockDim, ...: one pass reads x (or
// updates the residual) and sums squares, a block reduction gives the row's scale, a second pass
// re-reads the row (now in L1/L2: at most a few tens of KB per row) and writes the output. Every
// element is read and written by the same thread, and all reads of the first pass precede the
// barrier in BlockSum, so RmsNorm in place (fp32, out == x) is safe: x and out are not __restrict__.
constexpr int kMaxThreads = 256;

template <typename T, int V>
__device__ __forceinline__ void NormalizeRow(const float* x, const T* __restrict__ weight, T* out,
                                             int n, float sum, float eps) {
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(n) + eps);
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    float f[V], w[V];
    LoadF32<V>(x + i, f);
    LoadElems<T, V>(weight + i, w);
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = w[k] * (f[k] * inv);
    StoreElems<T, V>(out + i, f);
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads)
    RmsNormKernel(const float* x, const T* __restrict__ weight, T* out, int n, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float sum = 0.0f;
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    float f[V];
    LoadF32<V>(xr + i, f);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += f[k] * f[k];
  }
  sum = dev::BlockSum(sum, scratch);
  NormalizeRow<T, V>(xr, weight, out + row * n, n, sum, eps);
}

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads)
    FusedAddRmsNormKernel(float* __restrict__ residual, const T* __restrict__ delta, const T* __restrict__ weight,
                          T* __restrict__ out, int n, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  float* res = residual + row * n;
  const T* d = delta + row * n;
  float sum = 0.0f;
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    float f[V], g[V];
    LoadF32<V>(res + i, f);
    LoadElems<T, V>(d + i, g);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      f[k] += g[k];
      sum += f[k] * f[k];
    }
    StoreF32<V>(res + i, f);
  }
  sum = dev::BlockSum(sum, scratch);
  // Each thread re-reads exactly the groups it wrote above: no barrier needed for those values.
  NormalizeRow<T, V>(res, weight, out + row * n, n, sum, eps);
}

// One warp per (row, head): each lane sums the squares of elements lane, lane + 32, ..., the warp
// reduces, then each lane rewrites the elements it read (so in place is safe without a barrier).
constexpr int kHeadWarps = 4;  // heads per CTA

template <typename T>
__global__ void __launch_bounds__(32 * kHeadWarps)
    HeadRmsNormKernel(T* x, int row_stride, int first, int heads, int head_dim, const T* __restrict__ weight,
                      float eps) {
  const int head = blockIdx.x * kHeadWarps + threadIdx.x / 32;
  if (head >= heads) return;
  const int lane = threadIdx.x % 32;
  T* h = x + static_cast<int64_t>(blockIdx.y) * row_stride + first + static_cast<int64_t>(head) * head_dim;
  float sum = 0.0f;
  for (int i = lane; i < head_dim; i += 32) {
    const float f = dev::ToFloat(h[i]);
    sum += f * f;
  }
  sum = dev::WarpSum(sum);
  const float inv = 1.0f / sqrtf(sum / static_cast<float>(head_dim) + eps);
  for (int i = lane; i < head_dim; i += 32) {
    h[i] = dev::FromFloat<T>(dev::ToFloat(weight[i]) * (dev::ToFloat(h[i]) * inv));
  }
}

// Flat element-wise residual += delta over rows * n (dense rows): grid-stride over V-groups.
constexpr int kAddThreads = 256;

template <typename T, int V>
__global__ void __launch_bounds__(kAddThreads)
    AddToResidualKernel(float* __restrict__ residual, const T* __restrict__ delta, int64_t groups) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    float f[V], d[V];
    LoadF32<V>(residual + g * V, f);
    LoadElems<T, V>(delta + g * V, d);
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] += d[k];
    StoreF32<V>(residual + g * V, f);
  }
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Enough threads to cover a row in one pass, at most kMaxThreads (a multiple of 32 for BlockSum).
inline unsigned RowThreads(int n, int v) {
  int threads = ((n + v - 1) / v + 31) / 32 * 32;
  return static_cast<unsigned>(threads > kMaxThreads ? kMaxThreads : threads);
}

inline bool BadShape(int rows, int n) { return rows < 0 || n <= 0; }

}  // namespace

int RmsNorm(DType dtype, const float* x, const void* weight, void* out, int rows, int n, float eps, void* stream) {
  if (BadShape(rows, n)) return kInvalidValue;
  if (rows == 0) return 0;
  if (!x || !weight || !out) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const T* w = static_cast<const T*>(weight);
    T* o = static_cast<T*>(out);
    if (n % V == 0 && Aligned16(x) && Aligned16(w) && Aligned16(o)) {
      return LaunchKernel(RmsNormKernel<T, V>, dim3(static_cast<unsigned>(rows)), dim3(RowThreads(n, V)), 0, stream,
                          x, w, o, n, eps);
    }
    return LaunchKernel(RmsNormKernel<T, 1>, dim3(static_cast<unsigned>(rows)), dim3(RowThreads(n, 1)), 0, stream, x,
                        w, o, n, eps);
  });
  return kInvalidValue;
}

int FusedAddRmsNorm(DType dtype, float* residual, const void* delta, const void* weight, void* out, int rows, int n,
                    float eps, void* stream) {
  if (BadShape(rows, n)) return kInvalidValue;
  if (rows == 0) return 0;
  if (!residual || !delta || !weight || !out) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const T* d = static_cast<const T*>(delta);
    const T* w = static_cast<const T*>(weight);
    T* o = static_cast<T*>(out);
    if (n % V == 0 && Aligned16(residual) && Aligned16(d) && Aligned16(w) && Aligned16(o)) {
      return LaunchKernel(FusedAddRmsNormKernel<T, V>, dim3(static_cast<unsigned>(rows)), dim3(RowThreads(n, V)), 0,
                          stream, residual, d, w, o, n, eps);
    }
    return LaunchKernel(FusedAddRmsNormKernel<T, 1>, dim3(static_cast<unsigned>(rows)), dim3(RowThreads(n, 1)), 0,
                        stream, residual, d, w, o, n, eps);
  });
  return kInvalidValue;
}

int HeadRmsNorm(DType dtype, void* x, int row_stride, int first, int rows, int heads, int head_dim,
                const void* weight, float eps, void* stream) {
  if (rows < 0 || heads < 0 || head_dim <= 0 || first < 0 || row_stride < first + heads * head_dim) {
    return kInvalidValue;
  }
  if (rows == 0 || heads == 0) return 0;
  if (!x || !weight) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    const dim3 grid(static_cast<unsigned>((heads + kHeadWarps - 1) / kHeadWarps), static_cast<unsigned>(rows));
    return LaunchKernel(HeadRmsNormKernel<T>, grid, dim3(32 * kHeadWarps), 0, stream, static_cast<T*>(x), row_stride,
                        first, heads, head_dim, static_cast<const T*>(weight), eps);
  });
  return kInvalidValue;
}

int AddToResidual(DType dtype, float* residual, const void* delta, int rows, int n, void* stream) {
  if (BadShape(rows, n)) return kInvalidValue;
  if (rows == 0) return 0;
  if (!residual || !delta) return kInvalidValue;
  const int64_t count = static_cast<int64_t>(rows) * n;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const T* d = static_cast<const T*>(delta);
    // Enough CTAs to fill an H100 several times over; the grid-stride loop covers the rest.
    auto blocks = [](int64_t groups) {
      const int64_t b = (groups + kAddThreads - 1) / kAddThreads;
      return static_cast<unsigned>(b < 8192 ? b : 8192);
    };
    if (count % V == 0 && Aligned16(residual) && Aligned16(d)) {
      return LaunchKernel(AddToResidualKernel<T, V>, dim3(blocks(count / V)), dim3(kAddThreads), 0, stream, residual,
                          d, count / V);
    }
    return LaunchKernel(AddToResidualKernel<T, 1>, dim3(blocks(count)), dim3(kAddThreads), 0, stream, residual, d,
                        count);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
