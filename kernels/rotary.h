// Launcher of the rotary position embedding kernel (kernels/rotary.cu). Conventions:
// kernels/kernel_common.h. Same math as ApplyRope (model/rope.h): HF rotate_half pairing (element i
// with i + head_dim/2), angle = float(position) * inv_freq[i] in fp32, cos/sin scaled by
// attention_scale.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// Rotates, in place, the first num_q_heads + num_k_heads heads of each row of `qkv` (row t at
// qkv + t * row_stride: Q heads then K heads, each head_dim elements; V after them is untouched).
// positions[t] is token t's position; inv_freq has head_dim / 2 floats (device).
int ApplyRotaryEmbedding(DType dtype, void* qkv, int64_t row_stride, const int32_t* positions,
                         int num_tokens, int num_q_heads, int num_k_heads, int head_dim,
                         const float* inv_freq, float attention_scale, void* stream);

}  // namespace kvflow::cuda
