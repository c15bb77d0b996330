// Launchers of the gated activation kernels (kernels/activation.cu). Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i] for i < n: gate and up halves side by side in
// each row of 2n (the fused gate_up projection), computed in fp32.
int SiluAndMul(DType dtype, const void* gate_up, void* out, int rows, int n, void* stream);

// The same with the tanh approximation of GELU (Gemma's GeGLU, cpu::GeluTanhMul):
// out[r, i] = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up[r, i], g = gate_up[r, i].
int GeluTanhAndMul(DType dtype, const void* gate_up, void* out, int rows, int n, void* stream);

}  // namespace kvflow::cuda
