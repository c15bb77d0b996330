// Dot products of K-quant weight rows (Q2_K..Q6_K, ggml's 256-element super-blocks) with
// activation rows quantized to Q8_K, after ggml's ggml_vec_dot_q*_K_q8_K. Internal to the CPU
// backend: quant_gemm.cc tiles and dispatches them.
//
// Q8_K block (292 bytes): {float d; int8 qs[256]; int16 bsums[16]}, bsums[j] = sum of qs[16j..16j+15]
// (they carry the weights' min / offset terms: sum_j min_j * sum(x in sub-block j)).
//
// Every path computes each super-block's integer sums exactly in int32 and scales them in float,
// so the paths differ only by float summation order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "model/tensor_source.h"  // DType

namespace kvflow::cpu::kquant {

constexpr int64_t kSuperBlock = 256;
constexpr size_t kQ8_KBytes = 4 + 256 + 2 * 16;

constexpr bool IsKQuant(DType t) {
  return t == DType::kQ2_K || t == DType::kQ3_K || t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K;
}

// One activation row of `blocks` super-blocks to Q8_K, as ggml's quantize_row_q8_K_ref: the
// element of largest magnitude m (the first on ties) maps to -127, q = round-half-even(-127 / m * x)
// capped at 127, d = 1 / (-127 / m) (so d is negative when m is positive); all-zero blocks give d = 0.
void QuantizeRowQ8K(const float* x, int64_t blocks, uint8_t* out);

// out[a] = dot(weight row w, Q8_K row x + a * x_stride) over `blocks` super-blocks, for a < nx
// (1..kMaxDotRows): the SIMD kernels unpack each weight super-block once for all nx rows.
constexpr int kMaxDotRows = 4;
using DotRowsFn = void (*)(const uint8_t* w, const uint8_t* x, size_t x_stride, int nx, int64_t blocks, float* out);

// The kernel for `w` on one instruction set: 0 portable, 1 AVX2 (+FMA, F16C), 2 AVX-512 BW/VL with
// VNNI (vpdpwssd fuses the scale multiply-add; zmm for Q4_K/Q5_K/Q6_K, ymm for Q2_K/Q3_K). Callers
// pick an ISA the CPU has.
DotRowsFn DotRowsFor(DType w, int isa);

}  // namespace kvflow::cpu::kquant
