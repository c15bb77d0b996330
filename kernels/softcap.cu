// Soft-capping of fp32 logits: x -> cap * tanh(x / cap) (Gemma-2's final_logit_softcapping). The
// attention scores' cap lives in the attention kernels (PagedAttentionArgs::softcap).
#include "device_utils.cuh"

#include <algorithm>
#include <cmath>

#include "softcap.h"

namespace kvflow::cuda {
namespace {

constexpr int kThreads = 256;

// Grid-stride: a whole-prompt logits chunk is rows x vocab (256 x 256K) elements.
__global__ void __launch_bounds__(kThreads) SoftCapKernel(float* __restrict__ x, int64_t n, float cap) {
  const float inv_cap = 1.0f / cap;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    x[i] = cap * tanhf(x[i] * inv_cap);
  }
}

}  // namespace

int SoftCap(float* x, int64_t n, float cap, void* stream) {
  if (n < 0 || !(cap > 0.0f) || cap == INFINITY) return kInvalidValue;
  if (n == 0) return 0;
  if (!x) return kInvalidValue;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  return LaunchKernel(SoftCapKernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, x, n, cap);
}

}  // namespace kvflow::cuda
