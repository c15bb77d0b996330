// Launcher of the random-fill kernel (kernels/fill.cu): synthetic weights for benchmarks at real
// model sizes, generated on the device (a 7B model would take minutes to generate on the host).
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// data[i] = offset + scale * u_i with u_i uniform in [-1, 1), a counter-based hash of (seed, i):
// the same values on every run and every GPU.
int FillUniform(DType dtype, void* data, int64_t count, uint64_t seed, float scale, float offset,
                void* stream);

}  // namespace kvflow::cuda
