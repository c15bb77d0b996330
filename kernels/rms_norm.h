// Launchers of the RMSNorm kernels (kernels/rms_norm.cu). Conventions: kernels/kernel_common.h.
// The residual stream stays fp32; normalized activations are written in the model dtype.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of n; x fp32, weight and out `dtype`.
int RmsNorm(DType dtype, const float* x, const void* weight, void* out, int rows, int n, float eps,
            void* stream);

// residual[r] += delta[r]; then out[r] = RmsNorm(residual[r]) * weight. delta, weight and out are
// `dtype`, residual fp32 (updated in place). One launch, one pass over the row.
int FusedAddRmsNorm(DType dtype, float* residual, const void* delta, const void* weight, void* out,
                    int rows, int n, float eps, void* stream);

// In place, per head (Qwen3's q_norm / k_norm): for each of `rows` rows of `x` (`row_stride`
// elements apart, `dtype`) and each of its `heads` heads of head_dim elements from `first`:
// head = RmsNorm(head) * weight (weight: head_dim, `dtype`). Sums in fp32 as cpu::RmsNorm.
int HeadRmsNorm(DType dtype, void* x, int row_stride, int first, int rows, int heads, int head_dim,
                const void* weight, float eps, void* stream);

// residual[r] += delta[r] only (after the last layer, before the final norm of the logit rows).
int AddToResidual(DType dtype, float* residual, const void* delta, int rows, int n, void* stream);

}  // namespace kvflow::cuda
