// Launcher of the paged prefill attention kernel (kernels/attention_prefill.cu): a variable-length
// batch of query chunks, each attending causally to its sequence's paged context (earlier chunks,
// prefix-cache hits and the chunk's own K/V, already written by ReshapeAndCache). Flash-attention
// style: tiled, online softmax, no score matrix in memory. Conventions: kernels/kernel_common.h.
// Same result as cpu::PagedAttention, including the optional log-sum-exp (PagedAttentionArgs::lse,
// rows query_starts[s] + j).
#pragma once

#include <cstdint>

#include "kernel_common.h"
#include "paged_attention.h"

namespace kvflow::cuda {

// A chunk of query_lens[s] tokens per sequence; context_lens[s] counts the chunk too, so query
// token j of seq s sits at position context_lens[s] - query_lens[s] + j and sees keys 0 .. that
// position.
struct PagedPrefillArgs : PagedAttentionArgs {
  const int32_t* query_starts = nullptr;  // [num_seqs] row of the first query token of seq s
  const int32_t* query_lens = nullptr;    // [num_seqs] query tokens of seq s (>= 1)
  int max_query_len = 0;                  // upper bound on query_lens[s]; sizes the grid
};

bool PagedPrefillSupports(int head_dim, int block_size);
int PagedAttentionPrefill(const PagedPrefillArgs& args, void* stream);

}  // namespace kvflow::cuda
