// Launchers of InfiniGen's device side (kernels/infinigen_score.cu): the partial key cache's growth,
// the speculative query's skew, the speculated scores, the token selection, the gather of the
// selected K/V and the asynchronous host-to-device prefetch. Each computes the same function as
// its CPU reference:
//   SkewPartialKeys        SkewPartialColumns      (infinigen/partial_keys.h) on pool keys
//   SkewPartialQueries     SkewPartialColumns      on scaled query heads
//   ScorePartialKeys       ScorePartialKeys        (infinigen/partial_keys.h)
//   SelectSpeculatedTokens SelectSpeculatedTokens  (infinigen/speculation.h), bit for bit
// Layout of the K/V pools: kv/kv_cache_layout.h. Conventions: kernels/kernel_common.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// ---- the partial key cache ------------------------------------------------------------------------

// One (sequence, kv head) of a layer: the keys of slots[first_slot, first_slot + num_slots) of the
// flattened slot list (physical_block * block_size + offset) are skewed and their partial columns
// written to rows dst_row, dst_row + 1, ... of dst (num_partial_columns floats per row).
//
// A partial key cache may be paged: with `chunks` set, row r lives at row chunks[r / chunk_rows] *
// chunk_rows + r % chunk_rows of dst (a sequence's rows in fixed-size chunks of a shared pool, as
// its K/V in blocks), chunk_rows given by the launch (SkewPartialKeysArgs, ScorePartialKeys).
struct InfiniGenSkewJob {
  const float* matrix = nullptr;     // the (layer, kv head)'s skew A: head_dim x head_dim, row-major
  const int32_t* columns = nullptr;  // [num_partial_columns] the kept columns of x.A
  float* dst = nullptr;              // the partial key cache of (sequence, layer, kv head)
  const int32_t* chunks = nullptr;   // optional: the rows' chunk table (paged), null: rows contiguous
  int64_t dst_row = 0;
  int32_t kv_head = 0;
  int32_t first_slot = 0;
  int32_t num_slots = 0;
};

struct SkewPartialKeysArgs {
  DType dtype = DType::kBF16;       // of the K pool
  const void* key_cache = nullptr;  // one layer's K pool [block][kv_head][slot][head_dim]
  const int64_t* slots = nullptr;   // flattened physical slots of every job
  const InfiniGenSkewJob* jobs = nullptr;
  int num_jobs = 0;
  int max_job_slots = 0;  // >= every job's num_slots (sizes the grid)
  int num_kv_heads = 0;
  int head_dim = 0;  // <= 256
  int block_size = 0;
  int num_partial_columns = 0;  // head_dim x num_partial_columns fp32 must fit in shared memory
  int chunk_rows = 0;           // rows per chunk of the jobs with a chunk table (> 0 where any has one)
};

// dst[dst_row + i][c] = sum_d key(slot i)[d] * A[d][columns[c]], fp32, d in ascending order as the
// CPU sums. Grid (ceil(max_job_slots / 32), num_jobs), 256 threads: a block stages A's kept
// columns and 32 keys (widened to fp32) in shared memory, then each thread computes outputs.
int SkewPartialKeys(const SkewPartialKeysArgs& args, void* stream);

// The speculative query's side: out[r][h] = the partial columns of (scale * q_{r,h}) . A_{h / group},
// num_partial_columns floats, for query head h of row r (rows of num_heads x head_dim at
// rows + r * row_stride: e.g. the Q part of the fused QKV buffer), the multiply by scale in fp32
// before the skew as the CPU path does. out: [num_rows][num_heads][num_partial_columns].
// Optionally row r reads source row row_indices[r], and with `positions` set the head is first
// rotated in fp32 at position positions[source row] as ApplyRope (model/rope.h) does: the
// speculative projection of a decode token, which no Rotary() pass rotated.
struct SkewPartialQueriesArgs {
  DType dtype = DType::kBF16;  // of the rows
  const void* rows = nullptr;
  int64_t row_stride = 0;
  int num_rows = 0;
  const int32_t* row_indices = nullptr;  // optional [num_rows] (device): source rows; null: row r
  const int32_t* positions = nullptr;    // optional (device, by source row): rotate at these positions
  const float* inv_freq = nullptr;       // [head_dim / 2] (device), with positions
  float attention_scale = 1.0f;          // the rope's cos/sin factor (RopeFrequencies::attention_scale)
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // <= 256
  int num_partial_columns = 0;
  float scale = 1.0f;                // usually 1/sqrt(head_dim)
  const float* matrices = nullptr;   // [num_kv_heads][head_dim][head_dim]: the layer's skews
  const int32_t* columns = nullptr;  // [num_kv_heads][num_partial_columns]
  float* out = nullptr;
};

// Grid (num_rows, num_heads), 64 threads: the scaled head in shared memory, a thread per column.
int SkewPartialQueries(const SkewPartialQueriesArgs& args, void* stream);

// ---- speculated scores ----------------------------------------------------------------------------

// One (sequence, kv head): scores[t] = max over the group's query rows q_j of q_j . keys[t].
struct PartialKeyScoreJob {
  const float* queries = nullptr;  // [group][num_partial_columns]: skewed partial columns of the query heads
  const float* keys = nullptr;     // [num_tokens][num_partial_columns]: the partial key cache
  const int32_t* chunks = nullptr; // optional: key t at row chunks[t / chunk_rows] * chunk_rows + t % chunk_rows
  float* scores = nullptr;         // [num_tokens]
  int32_t num_tokens = 0;
};

// Grid (ceil(max_tokens / 128), num_jobs), 128 threads, one token per thread: the block stages the
// job's queries and a tile of 128 keys in shared memory (coalesced), then each thread takes its
// group dot products in column order. fp32, no atomics: a rerun gives the same bits.
// group * p + 128 * p floats must fit in shared memory (p <= 256 with group <= 64 does).
// chunk_rows: rows per chunk of the jobs with a chunk table (> 0 where any has one).
int ScorePartialKeys(const PartialKeyScoreJob* jobs, int num_jobs, int max_tokens, int group,
                     int num_partial_columns, void* stream, int chunk_rows = 0);

// ---- token selection ------------------------------------------------------------------------------

// The most tokens a layer's selection may fetch out of `tokens`: the CPU's cap,
// max(1, floor(max_fraction * tokens)), computed the same way (host side).
inline int SpeculatedTokenCap(int tokens, double max_fraction) {
  return std::max(1, static_cast<int>(std::floor(max_fraction * tokens)));
}

// One sequence of a layer: its kv heads' scores, and where the selection goes.
struct SpeculationSelectJob {
  const float* scores = nullptr;  // head h's num_tokens scores at scores + h * score_head_stride
  int64_t score_head_stride = 0;
  int32_t num_tokens = 0;
  int32_t cap = 0;             // SpeculatedTokenCap(num_tokens, max_fraction); also the row stride of indices
  int32_t* indices = nullptr;  // out [num_kv_heads][cap]: head h's count indices, ascending
  int32_t* count = nullptr;    // out: the count every head takes (0 for a job without tokens)
};

struct SelectSpeculatedTokensArgs {
  const SpeculationSelectJob* jobs = nullptr;
  int num_jobs = 0;
  int num_kv_heads = 0;
  float alpha = 0.0f;
  int32_t* head_counts = nullptr;  // scratch [num_jobs][num_kv_heads]
};

// Exactly the CPU's selection: per head the tokens scoring above (head max - alpha) are counted;
// count = clamp(lround(mean over heads), 1, cap); each head then takes its top count tokens by
// (score desc, index asc), -0 and +0 equal, written ascending. Two launches, grid (num_jobs,
// num_kv_heads) and 256 threads each: the per-head counts; then, per head, a 4-pass radix select
// (8 bits a pass) of the count-th largest score and a block-wide compaction in index order that
// keeps every score above it and the lowest-index ties. O(n) per head; integer counts only, so
// deterministic. Scores must not be NaN.
int SelectSpeculatedTokens(const SelectSpeculatedTokensArgs& args, void* stream);

// ---- gather of the selected K/V -------------------------------------------------------------------

// One sequence of a layer. Every kv head takes the same number of tokens (InfiniGen's uniform
// count), so the heads' selections share one block table: token i of head h goes to scratch block
// first_block + i / block_size, head h, offset i % block_size, laid out like the pool. The paged
// decode kernel then reads the selection through the table [first_block, first_block + 1, ...]
// with context_len tokens, each kv head its own tokens: CudaBackend's KvView::kSlots scheme
// (cache_ops GatherSlots), per kv head.
struct SelectedKvGatherJob {
  const int32_t* block_table = nullptr;  // the sequence's physical blocks (token t in block t / block_size)
  const int32_t* positions = nullptr;    // head h's token positions at positions + h * position_head_stride
  int32_t position_head_stride = 0;
  const int32_t* count = nullptr;  // device: positions per head (SpeculationSelectJob::count)
  int32_t append_position = -1;    // >= 0: gathered after the selection for every head (the step's own token)
  // Gathers only the appended token (to index count): the selection itself was gathered earlier, by
  // a prefetch made before the step's own K/V was written.
  bool only_appended = false;
  int32_t first_block = 0;         // scratch blocks [first_block, first_block + num_blocks)
  int32_t num_blocks = 0;          // ceil((cap + 1) / block_size) holds any selection and the appended token
  int32_t* context_len = nullptr;  // optional out: tokens gathered per head (count, + 1 if appended)
};

// Bit-exact copies of the K and V rows (any dtype). Grid (num_jobs, num_kv_heads), 128 threads
// striding over the (token, 16-byte word) pairs of the head; tokens past the job's num_blocks are
// dropped (context_len says what was gathered). Scratch slots past context_len are not written.
int GatherSelectedKv(DType dtype, const void* key_cache, const void* value_cache, const SelectedKvGatherJob* jobs,
                     int num_jobs, void* dst_key, void* dst_value, int num_kv_heads, int head_dim, int block_size,
                     void* stream);

// ---- asynchronous prefetch ------------------------------------------------------------------------

struct HostToDeviceRange {
  const void* host_src = nullptr;  // pinned host memory (cudaMallocHost), so the copy is asynchronous
  void* device_dst = nullptr;
  size_t bytes = 0;
};

// Issues the copies on copy_stream in order (ranges contiguous on both sides are merged into one
// copy) and records done_event (a cudaEvent_t) after the last. `ranges` is host memory. Nothing is
// synchronized: the host returns at once, and the copies overlap whatever runs on other streams.
// The host sources must stay untouched until the event has completed.
int PrefetchToDevice(const HostToDeviceRange* ranges, int num_ranges, void* copy_stream, void* done_event);

// Makes compute_stream wait on the device for done_event (cudaStreamWaitEvent): work queued on it
// afterwards sees every prefetched byte; the host does not block.
int WaitForPrefetch(void* compute_stream, void* done_event);

}  // namespace kvflow::cuda
