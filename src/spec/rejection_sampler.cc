#include "spec/rejection_sampler.h"

#include <algorithm>

namespace kvflow {

DraftVerdict VerifyDraft(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                         double u_resample) {
  const size_t d = static_cast<size_t>(draft);
  auto q_of = [&](size_t i) -> double { return q.empty() ? (i == d ? 1.0 : 0.0) : static_cast<double>(q[i]); };
  const double pd = p[d], qd = q_of(d);
  if (qd > 0.0 && u_accept * qd < pd) return {true, draft};  // u < p/q without dividing
  // Residual mass max(0, p - q); inverse CDF in id order.
  double total = 0.0;
  for (size_t i = 0; i < p.size(); ++i) total += std::max(0.0, static_cast<double>(p[i]) - q_of(i));
  if (total <= 0.0) return {true, draft};  // p == q: a rejection has probability 0
  const double threshold = u_resample * total;
  double cumulative = 0.0;
  int32_t last = draft;
  for (size_t i = 0; i < p.size(); ++i) {
    const double r = std::max(0.0, static_cast<double>(p[i]) - q_of(i));
    if (r <= 0.0) continue;
    last = static_cast<int32_t>(i);
    cumulative += r;
    if (threshold < cumulative) break;
  }
  return {false, last};
}

}  // namespace kvflow
