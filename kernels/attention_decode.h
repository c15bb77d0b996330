// Launcher of the paged-attention decode kernel (kernels/attention_decode.cu): one query token per
// sequence attending to its whole paged context. Conventions: kernels/kernel_common.h; cache
// layout: kv/kv_cache_layout.h. Same result as cpu::PagedAttention for one-token slices.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

struct PagedDecodeArgs {
  DType dtype = DType::kF16;  // of query, out and the caches: kF16 or kBF16
  void* out = nullptr;        // row r: num_heads x head_dim at out + r * out_row_stride
  int64_t out_row_stride = 0;
  const void* query = nullptr;  // same shape as out, rows of query_row_stride
  int64_t query_row_stride = 0;
  const void* key_cache = nullptr;    // one layer's pools
  const void* value_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride] physical block ids
  int block_table_stride = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs] tokens cached, this step's token included (>= 1)
  const int32_t* query_rows = nullptr;    // [num_seqs] the row of query/out that belongs to seq s
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // divides num_heads; query head h reads kv head h / (num_heads / num_kv_heads)
  int head_dim = 0;      // 64 or 128
  int block_size = 0;    // 8, 16 or 32
  // An upper bound on every context_lens[s]; it sizes the grid (the number of context partitions),
  // so a CUDA graph captured with max_model_len serves every step.
  int max_context_len = 0;
  float scale = 1.0f;  // softmax scale, usually 1/sqrt(head_dim)
  void* workspace = nullptr;  // PagedDecodeWorkspaceBytes(...) bytes, for the split-context partials
  size_t workspace_bytes = 0;
};

bool PagedDecodeSupports(int head_dim, int block_size);
size_t PagedDecodeWorkspaceBytes(int num_seqs, int num_heads, int head_dim, int max_context_len);
int PagedAttentionDecode(const PagedDecodeArgs& args, void* stream);

}  // namespace kvflow::cuda
