// What the paged-attention launchers (attention_decode.h, attention_prefill.h) share: the layer's
// query, output and KV pools, and the batch's block tables. Conventions: kernels/kernel_common.h;
// cache layout: kv/kv_cache_layout.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

struct PagedAttentionArgs {
  DType dtype = DType::kF16;  // of query, out and the caches: kF16 or kBF16
  void* out = nullptr;        // row r: num_heads x head_dim at out + r * out_row_stride
  int64_t out_row_stride = 0;
  const void* query = nullptr;  // same shape as out, rows of query_row_stride
  int64_t query_row_stride = 0;
  const void* key_cache = nullptr;  // one layer's pools
  const void* value_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs][block_table_stride] physical block ids
  int block_table_stride = 0;
  const int32_t* context_lens = nullptr;  // [num_seqs] tokens cached, this step's tokens included
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // divides num_heads; query head h reads kv head h / (num_heads / num_kv_heads)
  int head_dim = 0;      // 64, 128 or 256 (Gemma)
  int block_size = 0;    // 8, 16 or 32
  float scale = 1.0f;    // softmax scale, usually 1/sqrt(head_dim)
  // > 0: sliding-window attention: the query at position q sees keys q - window + 1 .. q only, and
  // block-table entries wholly before every query's window are never read (they may be -1: blocks
  // released from the window). 0: keys 0 .. q.
  int window = 0;
  // > 0: the scaled scores are soft-capped before the mask and the softmax (Gemma-2):
  // scale * q.k -> softcap * tanh(scale * q.k / softcap), as cpu::PagedAttention's
  // AttentionIo::softcap; lse (below) is then over the capped scores. 0: none.
  float softcap = 0.0f;
  // Optional (nullptr: not written, no extra work). [rows][num_heads], row r as in `out`: the
  // natural log of sum(exp(scale * q.k)) over the keys query row r, head h sees, as
  // cpu::PagedAttention writes into AttentionIo::lse, so that attentions over disjoint KV sets
  // merge exactly (cpu::MergeAttentionStates).
  float* lse = nullptr;
};

}  // namespace kvflow::cuda
