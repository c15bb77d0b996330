// Bias add of a Linear layer: y[r, i] = round(float(y[r, i]) + bias[i]), the same fp32 sum as
// cpu::AddBias on the (dtype-rounded) product. The biases stay fp32 on the device.
#include "device_utils.cuh"

#include "bias.h"

namespace kvflow::cuda {
namespace {

// grid = (rows, chunks of kThreads elements of a row): rows on x (no 65535 limit), one element per
// thread, no integer division per element.
constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) AddBiasKernel(T* __restrict__ y, const float* __restrict__ bias, int n) {
  const int64_t row = blockIdx.x;
  const int i = static_cast<int>(blockIdx.y) * kThreads + static_cast<int>(threadIdx.x);
  if (i >= n) return;
  T* p = y + row * n + i;
  *p = dev::FromFloat<T>(dev::ToFloat(*p) + bias[i]);
}

}  // namespace

int AddBias(DType dtype, void* y, const float* bias, int rows, int n, void* stream) {
  if (rows < 0 || n <= 0) return kInvalidValue;
  if (rows == 0) return 0;
  if (!y || !bias) return kInvalidValue;
  const int64_t chunks = (static_cast<int64_t>(n) + kThreads - 1) / kThreads;
  if (chunks > 65535) return kInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  KVFLOW_DISPATCH_DTYPE(dtype, T, {
    return LaunchKernel(AddBiasKernel<T>, grid, dim3(kThreads), 0, stream, static_cast<T*>(y), bias, n);
  });
  return kInvalidValue;
}

}  // namespace kvflow::cuda
