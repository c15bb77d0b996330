// Shared by the chain-prefill tests (in-process: tests/unit/test_chain_prefill.cc; MPI:
// tests/distributed/test_mpi_chain_prefill.cc): tiny-random backends with shuffled block tables, and the
// single-process prefill every distributed one is compared with.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kv_selection_test_util.h"
#include "forward/llama_model.h"

namespace kvflow::test {

inline constexpr int kPoolTokens = 320;

// A block table of `blocks` distinct pool blocks in an order of `seed`'s.
inline std::vector<BlockId> ShuffledTable(int blocks, int pool_blocks, uint32_t seed) {
  std::vector<BlockId> all(static_cast<size_t>(pool_blocks));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(static_cast<size_t>(blocks));
  return all;
}

// K then V of every layer at positions [0, n) of `table`, as fp32.
inline std::vector<float> ReadWholeKv(Backend& backend, std::span<const BlockId> table, int64_t n) {
  const KvCacheLayout& layout = backend.kv_layout();
  std::vector<int64_t> slots;
  for (int64_t pos = 0; pos < n; ++pos) slots.push_back(SlotOf(table, static_cast<int32_t>(pos), layout.block_size));
  const size_t row = static_cast<size_t>(layout.num_kv_heads) * layout.head_dim;
  std::vector<float> out, part(slots.size() * row);
  for (int layer = 0; layer < layout.num_layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      EXPECT_TRUE(backend.ReadKv(layer, kv, slots, part).ok());
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  return out;
}

// The first `n` positions of every (layer, K/V) part of a ReadWholeKv of `total` positions.
inline std::vector<float> KvPrefix(const std::vector<float>& kv, int64_t total, int64_t n, size_t row) {
  std::vector<float> out;
  const size_t part = static_cast<size_t>(total) * row;
  for (size_t at = 0; at < kv.size(); at += part) out.insert(out.end(), kv.begin() + at, kv.begin() + at + n * row);
  return out;
}

inline float MaxAbsDiff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

struct Q4Comparison {
  float worst_in_steps = 0;  // the largest difference over `float_tol`, in the reference group's q4 steps
  int64_t off_values = 0;    // values differing by more than `float_tol`
  double off_fraction = 0;
};

// Two dequantized q4 KV reads (groups of 32 along head_dim, Q4_1: min + q * step): the step of each
// group is its range / 15 (its extreme values take codes 0 and 15).
inline Q4Comparison CompareQ4Kv(std::span<const float> got, std::span<const float> reference, float float_tol) {
  EXPECT_EQ(got.size(), reference.size());
  EXPECT_EQ(reference.size() % 32, 0u);
  Q4Comparison out;
  for (size_t g = 0; g + 32 <= std::min(got.size(), reference.size()); g += 32) {
    const auto [lo, hi] = std::minmax_element(reference.begin() + g, reference.begin() + g + 32);
    const float step = (*hi - *lo) / 15.0f;
    for (size_t i = g; i < g + 32; ++i) {
      const float diff = std::fabs(got[i] - reference[i]);
      if (diff <= float_tol) continue;
      ++out.off_values;
      out.worst_in_steps = std::max(out.worst_in_steps, step > 0 ? (diff - float_tol) / step : INFINITY);
    }
  }
  out.off_fraction = reference.empty() ? 0.0 : static_cast<double>(out.off_values) / reference.size();
  return out;
}

struct Reference {
  std::vector<float> kv;
  std::vector<float> logits;
  size_t row = 0;  // floats per position in kv
};

// One process, one backend: the prompt prefilled chunk by chunk at `bounds` (bounds {0, C}: one pass).
inline Reference SingleProcessPrefill(const std::vector<int32_t>& prompt, std::span<const int64_t> bounds,
                               const std::string& kv_dtype) {
  auto backend = TinyCpuBackend(kPoolTokens, false, kv_dtype);
  LlamaModel model(*backend);
  const int bs = backend->kv_layout().block_size;
  const std::vector<BlockId> table = ShuffledTable((kPoolTokens + bs - 1) / bs, backend->kv_layout().num_blocks, 99);
  Reference ref;
  for (size_t c = 0; c + 1 < bounds.size(); ++c) {
    ForwardBatch batch;
    batch.tokens.assign(prompt.begin() + bounds[c], prompt.begin() + bounds[c + 1]);
    for (int64_t pos = bounds[c]; pos < bounds[c + 1]; ++pos) batch.positions.push_back(static_cast<int32_t>(pos));
    SequenceSlice slice;
    slice.num_tokens = static_cast<int32_t>(bounds[c + 1] - bounds[c]);
    slice.context_len = static_cast<int32_t>(bounds[c + 1]);
    slice.block_table = table;
    slice.logits = c + 2 == bounds.size() ? LogitsMode::kLast : LogitsMode::kNone;
    batch.seqs.push_back(slice);
    std::vector<float> logits;
    Status st = model.Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (c + 2 == bounds.size()) ref.logits = logits;
  }
  ref.kv = ReadWholeKv(*backend, table, bounds.back());
  ref.row = static_cast<size_t>(backend->kv_layout().num_kv_heads) * backend->kv_layout().head_dim;
  return ref;
}

}  // namespace kvflow::test
