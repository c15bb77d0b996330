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

// Keys per chunk: scores rows are this long, and a chunk's keys and values are gathered into
// fp32 buffers of this many rows. A multiple of 16 (one AVX-512 vector of scores).
constexpr int kAttentionChunkKeys = 64;

struct AttentionKernels {
  const char* isa;  // "avx512", "avx2" or "portable"
  // s[r * ld + j] = scale * dot(q[r * head_dim ...], k[j * head_dim ...]) for r < rows, j < n.
  // Reads key rows up to n rounded up to 4 (the buffer must hold them; their scores are dropped).
  void (*scores)(const float* q, int rows, const float* k, int n, int head_dim, float scale, float* s, int ld);
  // Largest of s[0, n).
  float (*row_max)(const float* s, int n);
  // s[j] = exp(s[j] - max) for j < n (n a multiple of 16), in place; returns their sum. Arguments
  // below ln(FLT_MIN) (masked keys: -inf) give exactly 0.
  float (*exp_and_sum)(float* s, int n, float max);
  // o[r * head_dim + d] += sum over j < n, in order, of p[r * ld + j] * v[j * head_dim + d].
  void (*accumulate)(const float* p, int rows, int ld, const float* v, int n, int head_dim, float* o);
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
