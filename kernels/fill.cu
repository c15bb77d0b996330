// Deterministic uniform fill for synthetic benchmark weights. Element i gets
//   u_i = top 24 bits of splitmix64(Mix64(seed) + (i + 1) * golden) mapped onto [-1, 1)
//   data[i] = fmaf(scale, u_i, offset) rounded to the dtype
// a pure function of (seed, i): identical on every run, every GPU and in the emulator, whatever the
// launch shape (the explicit fmaf leaves the compiler no contraction choice).
#include "device_utils.cuh"

#include "fill.h"

namespace kvflow::cuda {
namespace {

using dev::Vec;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// splitmix64's output function (a bijection on 64-bit words with full avalanche).
__device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ float UniformValue(uint64_t key, int64_t i, float scale, float offset) {
  const uint64_t h = Mix64(key + (static_cast<uint64_t>(i) + 1) * kGolden);
  // 24 random bits k: k * 2^-23 - 1 is exact in fp32 and covers [-1, 1) in steps of 2^-23.
  const float u = static_cast<float>(static_cast<uint32_t>(h >> 40)) * (1.0f / 8388608.0f) - 1.0f;
  return fmaf(scale, u, offset);
}

// Grid-stride over groups of V = 16 / sizeof(T) elements: a full group of an aligned buffer is one
// 16-byte store; the tail group (or every group of a misaligned buffer) is written element-wise.
constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    FillUniformKernel(T* __restrict__ data, int64_t count, uint64_t key, float scale, float offset, bool aligned) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const int64_t groups = (count + V - 1) / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const int64_t base = g * V;
    if (aligned && base + V <= count) {
      Vec<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = dev::FromFloat<T>(UniformValue(key, base + k, scale, offset));
      *reinterpret_cast<Vec<T, V>*>(data + base) = out;
    } else {
      for (int64_t i = base; i < count && i < base + V; ++i) data[i] = dev::FromFloat<T>(UniformValue(key, i, scale, offset));
    }
  }
}

// Host copy of Mix64 for the key (device functions are not callable from the launcher on nvcc).
constexpr uint64_t HostMix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

int FillUniform(DType dtype, void* data, int64_t count, uint64_t seed, float scale, float offset, void* stream) {
  if (count < 0) return kInvalidValue;
  if (count == 0) return 0;
  if (!data) return kInvalidValue;
  const uint64_t key = HostMix64(seed);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    const int64_t groups = (count + V - 1) / V;
    // Plenty of CTAs to fill an H100 (132 SMs) many times; the grid-stride loop covers the rest.
    const int64_t blocks = (groups + kThreads - 1) / kThreads;
    return LaunchKernel(FillUniformKernel<T>, dim3(static_cast<unsigned>(blocks < 65536 ? blocks : 65536)),
                        dim3(kThreads), 0, stream, static_cast<T*>(data), count, key, scale, offset, aligned);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
