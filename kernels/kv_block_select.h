// Launchers of TriForce's chunk scoring and top-k chunk selection (kernels/kv_block_select.cu):
// the CUDA side of Backend::ScoreKvBlocks / SelectTopKvBlocks (backend/backend.h), computing the
// same function as cpu::ScoreKvBlocks / cpu::SelectTopKvBlocks (backend/cpu/kv_block_select.h).
// Layout of the K pool: kv/kv_cache_layout.h. Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// One scoring job (KvBlockScoreJob) as the kernels read it: its blocks are block_ids[first_block,
// first_block + num_blocks) of the flattened list, and its logits go to the same columns of the
// logits scratch.
struct KvBlockScoreJobDesc {
  int64_t score_offset = 0;
  int32_t row = 0;          // query row of the step
  int32_t num_blocks = 0;
  int32_t num_tokens = 0;   // every block full but the last
  int32_t first_block = 0;  // into block_ids / block_jobs / the logits columns
};

struct KvBlockScoreArgs {
  DType dtype = DType::kBF16;     // of the query and of the K pool
  const void* query = nullptr;    // row t at query + t * query_row_stride: num_heads x head_dim, rotated
  int64_t query_row_stride = 0;
  const void* key_cache = nullptr;  // one layer's K pool [block][kv_head][slot][head_dim]
  const KvBlockScoreJobDesc* jobs = nullptr;
  int num_jobs = 0;
  const int32_t* block_ids = nullptr;   // [total_blocks] physical block of each flattened entry
  const int32_t* block_jobs = nullptr;  // [total_blocks] the job each flattened entry belongs to
  int total_blocks = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  float* logits = nullptr;  // scratch [num_heads][total_blocks], overwritten
  float* scores = nullptr;  // the score buffer: job j's block b adds into scores[score_offset + b]
};

// Adds one layer's chunk scores of every job: per query head h the softmax over the job's blocks of
// q_h . mean_key(block, h / (num_heads / num_kv_heads)) / sqrt(head_dim), summed over the heads in
// ascending order into the scores. Two launches (per (block, kv head) the mean key and its
// logits; per job the softmaxes), deterministic: no atomics, so a rerun gives the same bits.
// head_dim <= 256; fp32 accumulation throughout.
int ScoreKvBlocks(const KvBlockScoreArgs& args, void* stream);

// One selection job (KvBlockSelectJob) plus where its chosen indices go: out[out_offset,
// out_offset + min(k, num_blocks)).
struct KvBlockSelectJobDesc {
  int64_t score_offset = 0;
  int32_t num_blocks = 0;
  int32_t keep_first = 0;
  int32_t keep_last = 0;
  int32_t k = 0;
  int32_t out_offset = 0;
};

// Per job: the first min(keep_first, k') and the last min(keep_last, k' - first) blocks (k' =
// min(k, num_blocks)), and the k' - first - last best of the others by (score desc, index asc),
// written as ascending indices: bit-for-bit cpu::SelectTopKvBlocks on the same scores (a NaN score
// orders nowhere on either side; the scores never hold one). One thread block per job; ranking is
// O(m^2 / threads) for m middle blocks.
int SelectTopKvBlocks(const float* scores, const KvBlockSelectJobDesc* jobs, int num_jobs, int32_t* out,
                      void* stream);

}  // namespace kvflow::cuda
