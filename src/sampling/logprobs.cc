#include "sampling/logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kvflow {

SampledToken ScoreToken(std::span<const float> logits, int32_t token, int num_top) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l - max_logit));
  const double log_z = static_cast<double>(max_logit) + std::log(sum);
  SampledToken out;
  out.token = token;
  out.logprob = static_cast<float>(logits[static_cast<size_t>(token)] - log_z);
  const size_t k = std::min(static_cast<size_t>(std::max(num_top, 0)), logits.size());
  if (k > 0) {
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (size_t i = 0; i < k; ++i) out.top_logprobs.push_back({ids[i], static_cast<float>(logits[size_t(ids[i])] - log_z)});
  }
  return out;
}

}  // namespace kvflow
