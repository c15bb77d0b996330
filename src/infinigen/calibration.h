// `kvflow skew`'s work: runs the model over sample text, collects every layer's post-RoPE queries
// and keys, and derives each KV head's skewing matrix and partial columns (skew_file.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "backend/backend.h"
#include "infinigen/skew_file.h"
#include "kvflow/status.h"

namespace kvflow {

// How a head's partial columns are ranked after skewing, from the sample's column sums of |Q~| and |K~|.
enum class PartialColumnRule {
  kAbsSum,   // sum |Q~| + sum |K~| (the paper's text)
  kProduct,  // mean |Q~| x mean |K~|: what a column adds to q.k, whatever the scales of Q and K
};
Result<PartialColumnRule> ParsePartialColumnRule(const std::string& name);  // "abs-sum", "product"

struct SkewCalibrationOptions {
  double partial_ratio = 0.5;  // of head_dim (the paper keeps 30% of 128; on SmolLM2's 64, 50% measured better)
  PartialColumnRule rule = PartialColumnRule::kAbsSum;
  int chunk_tokens = 512;      // tokens per forward pass
  // Called after each forward pass (tokens done, total) and each layer's SVD (layers done, total).
  std::function<void(int64_t, int64_t)> on_tokens;
  std::function<void(int, int)> on_layers;
};

// One sequence of `tokens` (at least 16; its KV must fit the backend's pool) through the model on
// `backend`, then per layer and KV head: A from the SVD of the group's stacked queries, partial
// columns from the column sums of |Q A| and |K A|. Overwrites the backend's KV pool.
Result<SkewTable> CalibrateSkew(Backend& backend, std::span<const int32_t> tokens, const SkewCalibrationOptions& options);

}  // namespace kvflow
