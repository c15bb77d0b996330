// Launcher of the logit soft-cap kernel (kernels/softcap.cu). Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// In place, x[i] = cap * tanh(x[i] / cap) for i < n (fp32): Gemma-2's final logit soft-cap, as the
// CPU backend applies it. cap > 0.
int SoftCap(float* x, int64_t n, float cap, void* stream);

}  // namespace kvflow::cuda
