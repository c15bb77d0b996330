// Matrix products on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0 and the K-quants Q2_K..Q6_K),
// kept in ggml's block layout instead of being dequantized to fp32. As in ggml, the activations are
// quantized per block to 8 bits (the weight type's "vec_dot_type") and each block's dot product
// runs in integer arithmetic, scaled by the two blocks' scales in float.
//
// Three kernel paths, chosen at run time from the CPU's features: AVX-512 with VNNI (vpdpbusd; for
// the K-quants vpdpwssd, on zmm for Q4_K/Q5_K/Q6_K, on ymm for Q2_K/Q3_K), AVX2 (+FMA, F16C) and
// portable C++. All of them produce the
// same quantized activations bit for bit; the products differ only by float summation order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/tensor_source.h"  // DType

namespace kvflow::cpu {

// Activation rows quantized for the dot products with one weight type (ggml's vec_dot_type):
// Q8_0 blocks {f16 d; int8 qs[32]} (34 bytes) for Q4_0 and Q8_0 weights; Q8_1 blocks
// {float d; float s = d * sum(qs); int8 qs[32]} (40 bytes) for Q4_1 (s carries the weight's min term);
// Q8_K blocks of 256 {float d; int8 qs[256]; int16 bsums[16]} (292 bytes, bsums: sums of 16
// consecutive qs, which carry the mins and offsets) for Q2_K..Q6_K.
struct QuantizedActivations {
  DType weight_type = DType::kQ4_0;
  int64_t rows = 0, cols = 0;  // cols: multiple of 32 (256 for the K-quants)
  std::vector<uint8_t> data;   // rows * row_bytes()
  size_t row_bytes() const;
  const uint8_t* row(int64_t r) const { return data.data() + static_cast<size_t>(r) * row_bytes(); }
};

// Whether activations quantized for `a` weights serve `b` weights as they are (the same ggml
// vec_dot_type: Q4_0 and Q8_0 take Q8_0, the K-quants all take Q8_K); then setting
// x.weight_type = b reuses them (a Q4_K_M matrix mixes Q4_K, Q5_K and Q6_K rows).
bool SameActivationFormat(DType a, DType b);

// Quantizes x [rows, cols] (row-major, row stride cols) for products with `weight_type` weights:
// per 32-element block d = amax / 127, q = round-to-nearest-even(x / d) (as ggml's SIMD
// quantize_row_q8_0 / q8_1); for the K-quants per 256 elements as ggml's quantize_row_q8_K_ref
// (d = -max / 127 with max the signed element of largest magnitude, q = round-half-even(x / d)).
// Preconditions (callers validate at load; debug builds assert): cols is a multiple of the block
// (32, or 256 for the K-quants) and weight_type is one with kernels (IsComputableQuantization).
// `out.data` is resized only when it grows.
void QuantizeActivations(const float* x, int64_t rows, int64_t cols, DType weight_type,
                         QuantizedActivations& out);

// y[m * ldy + n] = (accumulate ? y[m * ldy + n] : 0) + dot(w row n, x row m) for m < x.rows,
// n < n_rows: `w` holds n_rows rows of x.cols elements each in x.weight_type's ggml block layout
// (row after row). The current thread pool's threads (util/thread_pool.h) split the weight rows; each walks tiles of a few weight rows
// across all activation rows, so a weight block is read from memory once per call.
void QuantizedMatmul(const QuantizedActivations& x, const uint8_t* w, int64_t n_rows, float* y,
                     int64_t ldy, bool accumulate);

// One weight row (w_type blocks) dotted with one activation row quantized for w_type; cols elements.
float QuantizedDot(DType w_type, const uint8_t* w_row, const uint8_t* x_row, int64_t cols);

// The instruction set the kernels dispatch to on this CPU: "avx512vnni", "avx2" or "portable"
// (after the overrides below).
const char* QuantKernelIsa();

// Forces the portable path (tests compare paths); returns the previous setting.
bool ForcePortableQuantKernels(bool on);

// Caps the dispatch at "avx2" or "portable" (nullptr or "avx512vnni": no cap), so tests and the
// benchmark can run the AVX2 path on an AVX-512 machine; a path the CPU lacks is never chosen.
// Returns the previous cap (nullptr when none).
const char* LimitQuantKernelIsa(const char* isa);

}  // namespace kvflow::cpu
