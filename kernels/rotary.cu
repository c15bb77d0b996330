// Rotary position embedding, in place on the Q and K heads of fused QKV rows. Same math as ApplyRope
// (src/model/rope.cc): element i pairs with i + head_dim/2 (HF rotate_half),
//   angle = float(position) * inv_freq[i]           (fp32, as HF)
//   c = cosf(angle) * scale, s = sinf(angle) * scale
//   x0' = x0 * c - x1 * s,  x1' = x1 * c + x0 * s
// Precise sinf/cosf (not __sinf: its error grows with |angle| and positions reach tens of
// thousands of radians), so the fp32 path agrees with the CPU to an ulp or two of cos/sin.
#include "device_utils.cuh"

#include <cmath>

#include "rotary.h"

namespace kvflow::cuda {
namespace {

using dev::Vec;

// a * b - c * d and a * b + c * d with both products rounded to fp32: the written formula, whatever
// the compiler would contract into an fma (the CPU reference, built for x86-64-v3, may contract one
// product; that differs by at most an ulp of a product).
__device__ __forceinline__ float MulSub(float a, float b, float c, float d) {
  return __fsub_rn(__fmul_rn(a, b), __fmul_rn(c, d));
}
__device__ __forceinline__ float MulAdd(float a, float b, float c, float d) {
  return __fadd_rn(__fmul_rn(a, b), __fmul_rn(c, d));
}

// One CTA per token. The CTA first tabulates the token's head_dim/2 (cos, sin) pairs in shared
// memory (each computed once, not once per head). Its threads are then laid out as
// groups_x x heads_y: thread (gx, hy) owns the V consecutive pair indices gx*V.. of every group
// gx, gx + groups_x, ..., holds their cos/sin in registers and walks the heads hy, hy + heads_y,
// ... rotating them. V is the 16-byte vector width (8 for fp16/bf16, 4 for fp32) when alignment
// allows, else 1. A warp then reads whole 16-byte words of both halves of several heads.
template <typename T, int V>
__global__ void __launch_bounds__(256)
    RotaryKernel(T* __restrict__ qkv, int64_t row_stride, const int32_t* __restrict__ positions, int num_heads,
                 int half, const float* __restrict__ inv_freq, float attention_scale, int groups_x) {
  KVFLOW_DYNAMIC_SMEM(float, table);
  float* cos_table = table;
  float* sin_table = table + half;
  const int64_t token = blockIdx.x;
  const float position = static_cast<float>(positions[token]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = position * inv_freq[i];
    cos_table[i] = cosf(angle) * attention_scale;
    sin_table[i] = sinf(angle) * attention_scale;
  }
  __syncthreads();

  T* row = qkv + token * row_stride;
  const int groups = half / V;  // per head
  const int heads_y = static_cast<int>(blockDim.x) / groups_x;
  const int gx0 = static_cast<int>(threadIdx.x) % groups_x;
  const int hy0 = static_cast<int>(threadIdx.x) / groups_x;
  if (hy0 >= heads_y) return;  // spare threads when blockDim is not a multiple of groups_x
  for (int g = gx0; g < groups; g += groups_x) {
    const int i = g * V;
    float c[V], s[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      c[k] = cos_table[i + k];
      s[k] = sin_table[i + k];
    }
    for (int h = hy0; h < num_heads; h += heads_y) {
      T* p0 = row + static_cast<int64_t>(h) * 2 * half + i;
      T* p1 = p0 + half;
      const Vec<T, V> a = *reinterpret_cast<const Vec<T, V>*>(p0);
      const Vec<T, V> b = *reinterpret_cast<const Vec<T, V>*>(p1);
      Vec<T, V> ra, rb;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float x0 = dev::ToFloat(a.v[k]);
        const float x1 = dev::ToFloat(b.v[k]);
        ra.v[k] = dev::FromFloat<T>(MulSub(x0, c[k], x1, s[k]));
        rb.v[k] = dev::FromFloat<T>(MulAdd(x1, c[k], x0, s[k]));
      }
      *reinterpret_cast<Vec<T, V>*>(p0) = ra;
      *reinterpret_cast<Vec<T, V>*>(p1) = rb;
    }
  }
}

template <typename T, int V>
int LaunchRotary(T* qkv, int64_t row_stride, const int32_t* positions, int num_tokens, int num_heads, int head_dim,
                 const float* inv_freq, float attention_scale, void* stream) {
  const int half = head_dim / 2;
  const int groups = half / V;
  // About 128 threads: all groups of a head side by side (up to 128), then as many heads as fit.
  const int groups_x = groups < 128 ? groups : 128;
  int heads_y = 128 / groups_x;
  if (heads_y > num_heads) heads_y = num_heads;
  if (heads_y < 1) heads_y = 1;
  const unsigned threads = static_cast<unsigned>(groups_x * heads_y);
  const size_t smem = 2 * static_cast<size_t>(half) * sizeof(float);
  return LaunchKernel(RotaryKernel<T, V>, dim3(static_cast<unsigned>(num_tokens)), dim3(threads), smem, stream, qkv,
                      row_stride, positions, num_heads, half, inv_freq, attention_scale, groups_x);
}

}  // namespace

int ApplyRotaryEmbedding(DType dtype, void* qkv, int64_t row_stride, const int32_t* positions, int num_tokens,
                         int num_q_heads, int num_k_heads, int head_dim, const float* inv_freq,
                         float attention_scale, void* stream) {
  if (num_tokens < 0 || num_q_heads < 0 || num_k_heads < 0 || head_dim <= 0 || head_dim % 2 != 0) {
    return kInvalidValue;
  }
  const int num_heads = num_q_heads + num_k_heads;
  // The (cos, sin) table must fit in the default 48 KB of shared memory.
  if (head_dim > 8192 || row_stride < static_cast<int64_t>(num_heads) * head_dim) return kInvalidValue;
  if (num_tokens == 0 || num_heads == 0) return 0;
  if (!qkv || !positions || !inv_freq) return kInvalidValue;
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    constexpr int V = 16 / static_cast<int>(sizeof(T));
    T* x = static_cast<T*>(qkv);
    const bool vec = (head_dim / 2) % V == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                     (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
    if (vec) {
      return LaunchRotary<T, V>(x, row_stride, positions, num_tokens, num_heads, head_dim, inv_freq, attention_scale,
                                stream);
    }
    return LaunchRotary<T, 1>(x, row_stride, positions, num_tokens, num_heads, head_dim, inv_freq, attention_scale,
                              stream);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
