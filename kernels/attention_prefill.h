// Launcher of the paged prefill attention kernel (kernels/attention_prefill.cu): a variable-length
// batch of query chunks, each attending causally to its sequence's paged context (earlier chunks,
// prefix-cache hits and the chunk's own K/V, already written by ReshapeAndCache). Flash-attention
// style: tiled, online softmax, no score matrix in memory. Conventions: kernels/kernel_common.h.
// Same result as cpu::PagedAttention.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

struct PagedPrefillArgs {
  DType dtype = DType::kF16;  // of query, out and the caches: kF16 or kBF16
  void* out = nullptr;        // row r: num_heads x head_dim at out + r * out_row_stride
  int64_t out_row_stride = 0;
  const void* query = nullptr;
  int64_t query_row_stride = 0;
  const void* key_cache = nullptr;  // one layer's pools
  const void* value_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride]
  int block_table_stride = 0;
  const int32_t* query_starts = nullptr;  // [num_seqs] row of the first query token of seq s
  const int32_t* query_lens = nullptr;    // [num_seqs] query tokens of seq s (>= 1)
  // [num_seqs] tokens cached incl. this chunk; query token j of seq s sits at position
  // context_lens[s] - query_lens[s] + j and sees keys 0 .. that position.
  const int32_t* context_lens = nullptr;
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;    // 64 or 128
  int block_size = 0;  // 8, 16 or 32
  int max_query_len = 0;  // upper bound on query_lens[s]; sizes the grid
  float scale = 1.0f;
};

bool PagedPrefillSupports(int head_dim, int block_size);
int PagedAttentionPrefill(const PagedPrefillArgs& args, void* stream);

}  // namespace kvflow::cuda
