// The inner loops of the tiled CPU attention (paged_attention.cc): scores of a tile of query rows
// against a chunk of keys, the softmax exponentials, and the weighted sum of values. One set per
// instruction set (AVX-512, AVX2 + FMA + F16C, portable C++), chosen at run time from the CPU's
// features and the head size.
//
// Every kernel computes each output element from its own row's inputs with a fixed order of
// operations, whatever the number of rows or keys in the call. That is what makes a query row's
// attention bit-identical whether it is decoded alone, verified among drafted tokens or prefilled
// in a tile of hundreds (lossless speculative decoding and batch-invariant sampling rely on it).
#pragma once

#include <cstdint>

namespace kvflow::cpu {

// Keys per chunk: a chunk's keys are packed for the score kernel and its scores rows are this long.
// A multiple of 16 (one AVX-512 vector of scores).
constexpr int kAttentionChunkKeys = 128;

// How every path computes a score, so that all of them (and every tiling) give the same bits:
// score(r, j) = scale * fma(q[D-1], k[D-1], ... fma(q[1], k[1], fma(q[0], k[0], 0))), one fused
// multiply-add chain over the head's dimensions in order. The vector kernels keep that chain per
// lane: keys are packed transposed (kt[d * kAttentionChunkKeys + j] = key j's element d, fp16
// widened to fp32 on the way), so a vector holds one dimension of 16 (or 8) keys and a row's scores
// accumulate vertically, without per-key horizontal sums.
struct AttentionKernels {
  const char* isa;  // "avx512", "avx2" or "portable"
  // Packs kAttentionChunkKeys key rows (rows[j]: head_dim elements; pad with a row of zeros) into
  // kt, [head_dim][kAttentionChunkKeys] fp32. The fp16 variant widens as it packs (exact).
  void (*pack_keys_f16)(const uint16_t* const* rows, int head_dim, float* kt);
  void (*pack_keys_f32)(const float* const* rows, int head_dim, float* kt);
  // s[r * ld + j] = score(r, j) for r < rows and every j < kAttentionChunkKeys (the caller masks
  // keys past the chunk's end), q row r at q + r * head_dim.
  void (*scores)(const float* q, int rows, const float* kt, int head_dim, float scale, float* s, int ld);
  // Largest of s[0, n).
  float (*row_max)(const float* s, int n);
  // s[j] = exp(s[j] - max) for j < n (n a multiple of 16), in place; returns their sum. Arguments
  // below ln(FLT_MIN) (masked keys: -inf) give exactly 0.
  float (*exp_and_sum)(float* s, int n, float max);
  // o[r * head_dim + d] += sum over j < n, in order, of p[r * ld + j] * v[j][d], one fused
  // multiply-add at a time; v[j] a value row (fp16 widened as it is read, or fp32).
  void (*accumulate_f16)(const float* p, int rows, int ld, const uint16_t* const* v, int n, int head_dim, float* o);
  void (*accumulate_f32)(const float* p, int rows, int ld, const float* const* v, int n, int head_dim, float* o);
  // fp16 bits to fp32 (exact).
  void (*half_to_float)(const uint16_t* src, float* dst, int64_t n);
};

// The fastest set this CPU runs for head_dim (AVX-512 needs head_dim % 16 == 0, AVX2 % 8), after
// the cap below.
const AttentionKernels& SelectAttentionKernels(int head_dim);

// Caps the choice at "avx2" or "portable" (nullptr: no cap) so tests compare the paths on one
// machine; a set the CPU lacks is never chosen. Returns the previous cap (nullptr when none).
const char* LimitAttentionIsa(const char* isa);

}  // namespace kvflow::cpu
