// Matrix products on 16-bit float weights (IEEE fp16 or bfloat16, as safetensors bf16/f16
// checkpoints and GGUF F16/BF16 tensors store them), kept 16-bit in memory instead of being
// widened to fp32 at load: a decode step reads half the bytes.
//
// The activations stay fp32 and every product is exact: each weight is widened to fp32 in a
// register (vcvtph2ps for fp16, a 16-bit shift for bf16) and multiplied-added in fp32, so the
// result differs from fp32 sgemm on the widened weights only by the order of the float sums.
//
// Three kernel paths, chosen at run time from the CPU's features: AVX-512 (F, BW, VL), AVX2 (+FMA,
// F16C) and portable C++. Two alternatives, off by default (measured slower, or inexact, on the
// machine this was written on; see half_gemm.cc): widening tiles of weight rows to fp32 for
// OpenBLAS's sgemm when there are many activation rows, and for bf16 weights llama.cpp's AVX512_BF16
// dot products (vdpbf16ps) on activations rounded to bf16.
#pragma once

#include <cstdint>

#include "model/tensor_source.h"  // DType

namespace kvflow::cpu {

inline bool IsHalfWeightType(DType t) { return t == DType::kF16 || t == DType::kBF16; }

// y[m * ldy + n] = dot(x row m, w row n) for m < M, n < N: x is [M, K] fp32 (row stride K), w holds
// N rows of K 16-bit elements of `w_type` (kF16 or kBF16; row after row, no padding; any K >= 1,
// any alignment). The current thread pool's threads (util/thread_pool.h) split the weight rows; each
// walks tiles of a few weight rows across all activation rows, so a weight row is read from memory
// once per call.
void HalfMatmul(DType w_type, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y,
                int64_t ldy);

// Widens n elements of `w_type` to fp32 (the dispatched path's conversions; bit-exact on all paths).
void HalfToFloatRow(DType w_type, const uint8_t* src, int64_t n, float* out);

// The instruction set the kernels dispatch to on this CPU: "avx512", "avx2" or "portable" (after the
// cap below).
const char* HalfKernelIsa();

// Caps the dispatch at "avx2" or "portable" (nullptr or "avx512": no cap), so tests and the
// benchmark can run each path on an AVX-512 machine; a path the CPU lacks is never chosen.
// Returns the previous cap (nullptr when none).
const char* LimitHalfKernelIsa(const char* isa);

// From this many activation rows on, HalfMatmul widens tiles of weight rows to fp32 and calls
// sgemm instead of its own kernels (0: never). Returns the previous setting. For tests and the
// benchmark.
int64_t SetHalfSgemmMinRows(int64_t rows);

// Whether this CPU has AVX512_BF16 (the bf16 dot-product path below can run).
bool HalfBf16DotAvailable();

// bf16 weights: round the activations to bf16 and use vdpbf16ps (as llama.cpp does) where
// HalfBf16DotAvailable() and the AVX-512 path is active; off by default (the exact widening).
// Returns the previous setting. For tests and the benchmark.
bool SetHalfBf16DotProducts(bool on);

}  // namespace kvflow::cpu
