// Launcher of the bias-add kernel (kernels/bias.cu): the bias of a Linear layer, added after its
// cuBLAS product. Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// y[r, i] = y[r, i] + bias[i] for r < rows, i < n: `y` holds `rows` rows of n elements of `dtype`
// (contiguous), `bias` n fp32 values. The sum is taken in fp32 and rounded once to `dtype`.
int AddBias(DType dtype, void* y, const float* bias, int rows, int n, void* stream);

}  // namespace kvflow::cuda
