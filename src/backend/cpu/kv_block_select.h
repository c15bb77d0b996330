// TriForce's chunk scoring and top-k selection on the CPU (backend.h: KvBlockScoreJob,
// KvBlockSelectJob): the CPU backend's implementation and the reference the CUDA kernels
// (kernels/kv_block_select.cu) are tested against.
#pragma once

#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/paged_attention.h"
#include "kv/kv_cache_layout.h"

namespace kvflow::cpu {

// Adds one layer's scores of every job into `scores`. Query row t of the step is at
// query + t * query_row_stride (num_heads x head_dim, rotated); `key_cache` is the layer's K pool of
// `element`s. Query head h reads KV head h / (num_heads / num_kv_heads).
void ScoreKvBlocks(std::span<const KvBlockScoreJob> jobs, const KvCacheLayout& layout, int num_heads,
                   const float* query, int64_t query_row_stride, KvElement element, const void* key_cache,
                   std::span<float> scores);

// Each job's chosen block indices, ascending, appended to `chosen` (see KvBlockSelectJob).
void SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::span<const float> scores,
                       std::vector<int32_t>& chosen);

// Checks jobs against the layout, the step's rows and a score buffer of `score_size` floats.
Status ValidateKvBlockScoreJobs(std::span<const KvBlockScoreJob> jobs, const KvCacheLayout& layout,
                                int64_t num_rows, int64_t score_size);
Status ValidateKvBlockSelectJobs(std::span<const KvBlockSelectJob> jobs, int64_t score_size);

}  // namespace kvflow::cpu
