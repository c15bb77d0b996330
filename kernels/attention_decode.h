// Launcher of the paged-attention decode kernel (kernels/attention_decode.cu): one query token per
// sequence attending to its whole paged context. Conventions: kernels/kernel_common.h; cache
// layout: kv/kv_cache_layout.h. Same result as cpu::PagedAttention for one-token slices, including
// the optional log-sum-exp (PagedAttentionArgs::lse, row query_rows[s]) with or without a split
// context.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_common.h"
#include "paged_attention.h"

namespace kvflow::cuda {

// One query token per sequence (context_lens[s] >= 1 includes it).
struct PagedDecodeArgs : PagedAttentionArgs {
  const int32_t* query_rows = nullptr;  // [num_seqs] the row of query/out that belongs to seq s
  // An upper bound on every context_lens[s]; it sizes the grid (the number of context partitions),
  // so a CUDA graph captured with max_model_len serves every step.
  int max_context_len = 0;
  void* workspace = nullptr;  // PagedDecodeWorkspaceBytes(...) bytes, for the split-context partials
  size_t workspace_bytes = 0;
};

bool PagedDecodeSupports(int head_dim, int block_size);
size_t PagedDecodeWorkspaceBytes(int num_seqs, int num_heads, int head_dim, int max_context_len);
int PagedAttentionDecode(const PagedDecodeArgs& args, void* stream);

}  // namespace kvflow::cuda
