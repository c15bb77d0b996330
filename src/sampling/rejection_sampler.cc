#include "sampling/rejection_sampler.h"

#include <algorithm>
#include <atomic>

namespace kvflow {

namespace {
std::atomic<RejectionRule> g_rules[2] = {RejectionRule::kResidual, RejectionRule::kResidual};

template <typename Weight>
double TotalWeight(size_t n, Weight weight) {
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) total += weight(i);
  return total;
}

// Inverse CDF in id order of the unnormalized `weight(i)` summing to `total`, at u * total.
template <typename Weight>
int32_t InverseCdf(size_t n, Weight weight, double total, double u, int32_t fallback) {
  const double threshold = u * total;
  double cumulative = 0.0;
  int32_t last = fallback;
  for (size_t i = 0; i < n; ++i) {
    const double w = weight(i);
    if (w <= 0.0) continue;
    last = static_cast<int32_t>(i);
    cumulative += w;
    if (threshold < cumulative) break;
  }
  return last;
}
}  // namespace

RejectionRule ActiveRejectionRule(VerifySite site) {
  return g_rules[static_cast<int>(site)].load(std::memory_order_relaxed);
}

namespace testing {
ScopedRejectionRule::ScopedRejectionRule(VerifySite site, RejectionRule rule)
    : site_(site), previous_(g_rules[static_cast<int>(site)].exchange(rule)) {}
ScopedRejectionRule::~ScopedRejectionRule() { g_rules[static_cast<int>(site_)].store(previous_); }
}  // namespace testing

DraftVerdict VerifyDraft(std::span<const float> p, std::span<const float> q, int32_t draft, double u_accept,
                         double u_resample, VerifySite site) {
  const size_t d = static_cast<size_t>(draft);
  auto q_of = [&](size_t i) -> double { return q.empty() ? (i == d ? 1.0 : 0.0) : static_cast<double>(q[i]); };
  const double pd = p[d], qd = q_of(d);
  if (qd > 0.0 && u_accept * qd < pd) return {true, draft};  // u < p/q without dividing
  switch (ActiveRejectionRule(site)) {
    case RejectionRule::kResampleFromVerifier: {  // wrong: p again, as if nothing had been rejected
      const auto p_of = [&](size_t i) { return static_cast<double>(p[i]); };
      return {false, InverseCdf(p.size(), p_of, TotalWeight(p.size(), p_of), u_resample, draft)};
    }
    case RejectionRule::kResampleFromDrafter:  // wrong: q again
      return {false, InverseCdf(p.size(), q_of, TotalWeight(p.size(), q_of), u_resample, draft)};
    case RejectionRule::kResidual:
      break;
  }
  // Residual mass max(0, p - q); inverse CDF in id order. All zero means p == q: a rejection has
  // probability 0, so keep the draft.
  const auto residual = [&](size_t i) { return std::max(0.0, static_cast<double>(p[i]) - q_of(i)); };
  const double total = TotalWeight(p.size(), residual);
  if (total <= 0.0) return {true, draft};
  return {false, InverseCdf(p.size(), residual, total, u_resample, draft)};
}

}  // namespace kvflow
