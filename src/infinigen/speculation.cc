#include "infinigen/speculation.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvflow {

namespace {

// The `k` largest of values[0, n) (ties: the lower index), ascending.
std::vector<int32_t> TopK(const float* values, int n, int k) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  k = std::clamp(k, 0, n);
  auto better = [values](int32_t a, int32_t b) { return values[a] != values[b] ? values[a] > values[b] : a < b; };
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

std::vector<int32_t> PartialColumns(std::span<const float> q_abs_sums, std::span<const float> k_abs_sums, double ratio) {
  const int dim = static_cast<int>(std::min(q_abs_sums.size(), k_abs_sums.size()));
  if (dim == 0) return {};
  std::vector<float> sums(static_cast<size_t>(dim));
  for (int d = 0; d < dim; ++d) sums[static_cast<size_t>(d)] = q_abs_sums[static_cast<size_t>(d)] + k_abs_sums[static_cast<size_t>(d)];
  const int keep = std::clamp(static_cast<int>(std::ceil(std::clamp(ratio, 0.0, 1.0) * dim - 1e-9)), 1, dim);
  return TopK(sums.data(), dim, keep);
}

SpeculatedTokens SelectSpeculatedTokens(std::span<const float> scores, int heads, int tokens, float alpha,
                                        double max_fraction) {
  TokenSelectionRule rule;
  rule.alpha = alpha;
  rule.max_fraction = max_fraction;
  return SelectTokensByRows(scores, heads, tokens, rule);
}

SpeculatedTokens SelectTokensByRows(std::span<const float> scores, int rows, int tokens, const TokenSelectionRule& rule) {
  SpeculatedTokens out;
  const int group = rule.group;
  if (rows <= 0 || tokens <= 0 || group <= 0 || rows % group != 0 ||
      scores.size() < static_cast<size_t>(rows) * static_cast<size_t>(tokens)) {
    return out;
  }
  const int kv_heads = rows / group;
  double total = 0.0;
  for (int r = 0; r < rows; ++r) {
    const float* row = scores.data() + static_cast<size_t>(r) * tokens;
    const float max = *std::max_element(row, row + tokens);
    total += static_cast<double>(std::count_if(row, row + tokens, [&](float s) { return s > max - rule.alpha; }));
  }
  const int cap = SpeculatedTokenCap(tokens, rule.max_fraction, rule.max_tokens);
  const int n = std::clamp(static_cast<int>(std::lround(total / rows)), 1, cap);
  out.per_head.resize(static_cast<size_t>(kv_heads));
  // The common case: one row per KV head, nothing forced: its top n.
  if (group == 1 && rule.sink_tokens <= 0 && rule.recent_tokens <= 0) {
    out.count = n;
    for (int h = 0; h < kv_heads; ++h) out.per_head[static_cast<size_t>(h)] = TopK(scores.data() + static_cast<size_t>(h) * tokens, tokens, n);
    return out;
  }
  // Each row's ranking, best first, as deep as a read can go (cap).
  const int depth = std::min(cap, tokens);
  std::vector<std::vector<int32_t>> ranking(static_cast<size_t>(rows));
  std::vector<int32_t> idx(static_cast<size_t>(tokens));
  for (int r = 0; r < rows; ++r) {
    const float* v = scores.data() + static_cast<size_t>(r) * tokens;
    auto better = [v](int32_t a, int32_t b) { return v[a] != v[b] ? v[a] > v[b] : a < b; };
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + depth, idx.end(), better);
    ranking[static_cast<size_t>(r)].assign(idx.begin(), idx.begin() + depth);
  }
  std::vector<int32_t> forced;
  const int sinks = std::clamp(rule.sink_tokens, 0, tokens);
  for (int32_t t = 0; t < sinks; ++t) forced.push_back(t);
  for (int32_t t = std::max(sinks, tokens - std::clamp(rule.recent_tokens, 0, tokens)); t < tokens; ++t) forced.push_back(t);
  // Per KV head: the forced tokens, then its rows in turn, without repeats.
  std::vector<std::vector<int32_t>> order(static_cast<size_t>(kv_heads));
  std::vector<uint8_t> taken(static_cast<size_t>(tokens));
  int count = 1;
  for (int h = 0; h < kv_heads; ++h) {
    std::fill(taken.begin(), taken.end(), 0);
    std::vector<int32_t>& o = order[static_cast<size_t>(h)];
    o.reserve(static_cast<size_t>(depth));
    auto take = [&](int32_t t) {
      if (taken[static_cast<size_t>(t)] || static_cast<int>(o.size()) >= depth) return;
      taken[static_cast<size_t>(t)] = 1;
      o.push_back(t);
    };
    for (int32_t t : forced) take(t);
    int in_union = 0;  // |forced ∪ each row's top n| (the first n ranks of every row taken)
    for (int rank = 0; rank < depth && static_cast<int>(o.size()) < depth; ++rank) {
      if (rank == n) in_union = static_cast<int>(o.size());
      for (int r = 0; r < group; ++r) take(ranking[static_cast<size_t>(h * group + r)][static_cast<size_t>(rank)]);
    }
    if (in_union == 0) in_union = static_cast<int>(o.size());
    count = std::max(count, in_union);
  }
  out.count = std::clamp(count, 1, depth);
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<int32_t>& o = order[static_cast<size_t>(h)];
    o.resize(static_cast<size_t>(std::min<int>(out.count, static_cast<int>(o.size()))));
    std::sort(o.begin(), o.end());
    out.per_head[static_cast<size_t>(h)] = std::move(o);
  }
  return out;
}

}  // namespace kvflow
