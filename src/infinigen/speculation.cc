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
  SpeculatedTokens out;
  if (heads <= 0 || tokens <= 0 || scores.size() < static_cast<size_t>(heads) * static_cast<size_t>(tokens)) return out;
  double total = 0.0;
  for (int h = 0; h < heads; ++h) {
    const float* row = scores.data() + static_cast<size_t>(h) * tokens;
    const float max = *std::max_element(row, row + tokens);
    total += static_cast<double>(std::count_if(row, row + tokens, [&](float s) { return s > max - alpha; }));
  }
  const int cap = SpeculatedTokenCap(tokens, max_fraction);
  out.count = std::clamp(static_cast<int>(std::lround(total / heads)), 1, cap);
  out.per_head.reserve(static_cast<size_t>(heads));
  for (int h = 0; h < heads; ++h) out.per_head.push_back(TopK(scores.data() + static_cast<size_t>(h) * tokens, tokens, out.count));
  return out;
}

}  // namespace kvflow
