// Launchers of the mixture-of-experts kernels (kernels/moe.cu): routing, grouping by expert, the
// grouped expert GEMM and the weighted combine. Conventions: kernels/kernel_common.h.
//
// One MoE MLP over T tokens, K experts each (the pairs (token t, slot k) are numbered t * K + k):
//   MoeRouteTopK        router logits [T, E] (fp32) -> ids [T, K], weights [T, K]
//   MoeGroupByExpert    ids -> the pairs sorted by expert, each expert's run padded to whole tiles
//                       of `tile_rows` (padding -1), the expert of each tile and the tile count
//   MoeGroupedGemm      per tile: out[pair] = in[pair / in_row_divisor] . W[expert]^T
//   (SiluAndMul on the gate|up rows, then MoeGroupedGemm again for the down projection)
//   MoeCombine          delta[t] = sum_k weight[t, k] * out[t * K + k] (+ a gated shared expert)
// Everything stays on the device (the tile count too), so a step is capturable in a CUDA graph:
// MoeGroupedGemm's grid covers MoeMaxTiles tiles and the tiles past the count return at once.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// The most experts the routing and grouping kernels take (their per-expert state is in shared
// memory and registers).
inline constexpr int kMoeMaxExperts = 1024;
// Tile heights MoeGroupedGemm has: 16 rows for decode-sized batches, 64 for prefill.
inline constexpr int kMoeSmallTile = 16;
inline constexpr int kMoeLargeTile = 64;

// The tile height for `num_pairs` pairs over `num_experts`: decode-sized batches (fewer than 32 rows
// per expert on average) take the 16-row tiles, whose padding wastes less.
constexpr int MoeTileRows(int64_t num_pairs, int num_experts) {
  return num_pairs >= int64_t{32} * num_experts ? kMoeLargeTile : kMoeSmallTile;
}

// Entries the sorted pair list needs (each expert's run rounded up to a whole tile), and the most
// tiles it can hold.
constexpr int64_t MoeSortedCapacity(int64_t num_pairs, int num_experts, int tile_rows) {
  return (num_pairs + static_cast<int64_t>(num_experts) * (tile_rows - 1) + tile_rows - 1) / tile_rows * tile_rows;
}
constexpr int64_t MoeMaxTiles(int64_t num_pairs, int num_experts, int tile_rows) {
  return MoeSortedCapacity(num_pairs, num_experts, tile_rows) / tile_rows;
}

// Per token: p = softmax(router_logits[t]) in fp32; ids[t] = the k largest p in descending order
// (ties to the lower expert), weights[t] = their p, divided by their sum when `renormalize`
// (Mixtral, Qwen3-MoE, OLMoE's norm_topk_prob). 1 <= k <= num_experts <= kMoeMaxExperts, k <= 32.
int MoeRouteTopK(const float* router_logits, int tokens, int num_experts, int k, bool renormalize, int32_t* ids,
                 float* weights, void* stream);

// Sorts the num_pairs pairs of `ids` (expert of each pair) by expert: sorted_pairs (capacity
// MoeSortedCapacity) gets each expert's pairs, in ascending expert order, its run padded with -1 to
// a multiple of tile_rows; tile_expert[i] (capacity MoeMaxTiles) is the expert of rows
// [i * tile_rows, (i + 1) * tile_rows); num_tiles[0] the number of tiles used. Within an expert the
// order of the pairs is unspecified (each output row depends on its own pair only).
int MoeGroupByExpert(const int32_t* ids, int num_pairs, int num_experts, int tile_rows, int32_t* sorted_pairs,
                     int32_t* tile_expert, int32_t* num_tiles, void* stream);

// For every tile i < num_tiles[0] (of at most max_tiles) and every pair p >= 0 in it:
//   out[p, n] = sum_j in[p / in_row_divisor, j] * weights[tile_expert[i]][n, j]    (n < N, j < K)
// with weights [experts][N][K] row-major, in [rows][K], out [pairs][N], all of `dtype` (fp16 or
// bf16; fp32 accumulation on tensor cores). K and N multiples of 8, 16-byte aligned pointers;
// tile_rows kMoeSmallTile or kMoeLargeTile, as given to MoeGroupByExpert.
int MoeGroupedGemm(DType dtype, const void* in, int in_row_divisor, const void* weights, void* out, int N, int K,
                   const int32_t* sorted_pairs, const int32_t* tile_expert, const int32_t* num_tiles, int max_tiles,
                   int tile_rows, void* stream);

// delta[t, h] = sum_k weights[t, k] * expert_out[t * K + k, h]
//             + (shared_out ? sigmoid(shared_gate_logit[t]) * shared_out[t, h] : 0)
// summed in fp32 and written in `dtype` (expert_out, shared_out, delta); weights and
// shared_gate_logit are fp32.
int MoeCombine(DType dtype, const void* expert_out, const float* weights, int tokens, int k, int hidden,
               const void* shared_out, const float* shared_gate_logit, void* delta, void* stream);

}  // namespace kvflow::cuda
