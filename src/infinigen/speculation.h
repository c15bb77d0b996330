// InfiniGen's speculation rules (seed 000, §4.3), as plain functions over scores: which partial
// columns a layer keeps after skewing, and which tokens a layer's speculated attention selects.
// The engine-side parts (the skewing tool, the partial key cache, the prefetch) build on these.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace kvflow {

// The partial weight index of one head: the ceil(ratio * head_dim) columns (at least 1) with the
// largest column sums |Q~| + |K~| (q_abs_sums[d] = sum over tokens of |Q~[t][d]|, likewise k),
// ascending. Ties: the lower column. ratio in (0, 1] (the paper keeps 30%).
std::vector<int32_t> PartialColumns(std::span<const float> q_abs_sums, std::span<const float> k_abs_sums, double ratio);

// Tokens a layer fetches, from its speculated scores ([heads][tokens], row-major, scaled logits):
// per head, the tokens scoring above (head max - alpha) are counted; the count is averaged over the
// heads (rounded to nearest) and capped at max_fraction of the tokens (at least 1), so every head
// fetches the same number; each head then takes its own top `count` tokens (ties: the lower
// index), returned ascending per head.
// The most tokens a layer's selection takes out of `tokens`: max(1, floor(max_fraction * tokens)).
inline int SpeculatedTokenCap(int tokens, double max_fraction) {
  return std::max(1, static_cast<int>(std::floor(max_fraction * tokens)));
}
// With a cap in tokens (max_tokens > 0): min(max_tokens, tokens), at least 1.
inline int SpeculatedTokenCap(int tokens, double max_fraction, int max_tokens) {
  return max_tokens > 0 ? std::max(1, std::min(max_tokens, tokens)) : SpeculatedTokenCap(tokens, max_fraction);
}

struct SpeculatedTokens {
  int32_t count = 0;
  std::vector<std::vector<int32_t>> per_head;
};
SpeculatedTokens SelectSpeculatedTokens(std::span<const float> scores, int heads, int tokens, float alpha,
                                        double max_fraction);

// The general rule, of which SelectSpeculatedTokens is the case group 1, no forced tokens.
// `scores` holds one row per query head ([rows][tokens], rows = kv_heads x group, a KV head's group
// consecutive); every row counts the tokens above (its max - alpha); n = that count averaged over the
// rows (rounded to nearest), in [1, cap]. A KV head's read is the forced tokens (positions
// [0, sink_tokens) and [tokens - recent_tokens, tokens)) and then its rows' rankings taken in turn
// (each row's best, then each row's second, ..., ties: the lower index, duplicates skipped); each KV
// head reads `count` of them, count = the largest over the KV heads of |forced ∪ each row's top n|,
// in [1, cap]. Returned ascending per KV head. With group 1 and no forced tokens: each KV head's own
// top n, as SelectSpeculatedTokens.
struct TokenSelectionRule {
  int group = 1;  // rows per KV head
  float alpha = 5.0f;
  double max_fraction = 0.2;
  int max_tokens = 0;  // > 0: the cap in tokens instead of max_fraction
  int sink_tokens = 0;
  int recent_tokens = 0;
};
SpeculatedTokens SelectTokensByRows(std::span<const float> scores, int rows, int tokens, const TokenSelectionRule& rule);

}  // namespace kvflow
