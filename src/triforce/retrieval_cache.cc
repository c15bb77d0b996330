#include "triforce/retrieval_cache.h"

#include <algorithm>

namespace kvflow {

int64_t RetrievalBudgetTokens(int configured, int64_t context) {
  if (configured > 0) return configured;
  return std::clamp<int64_t>(context / 8, 256, 4096);
}

int RecentBlocks(int64_t budget_blocks) { return static_cast<int>(std::max<int64_t>(1, budget_blocks / 8)); }

void RetrievalCache::Build(std::vector<int32_t> selected, int64_t cached) {
  built_ = true;
  ++builds_;
  selected_ = std::move(selected);
  built_at_ = cached;
  rounds_.clear();
  rounds_since_build_ = 0;
}

void RetrievalCache::ViewBlocks(int64_t cached, int block_size, std::vector<int32_t>& out) const {
  out.clear();
  const int64_t full = cached / block_size;
  for (int32_t b : selected_) {
    if (b < full) out.push_back(b);
  }
  for (int64_t b = built_at_ / block_size; b < full; ++b) out.push_back(static_cast<int32_t>(b));
}

void RetrievalCache::RecordVerification(int64_t drafted, int64_t accepted) {
  if (drafted <= 0) return;
  rounds_.emplace_back(drafted, accepted);
  ++rounds_since_build_;
}

double RetrievalCache::RollingAcceptance() const {
  int64_t drafted = 0;
  int64_t accepted = 0;
  for (const auto& [d, a] : rounds_) {
    drafted += d;
    accepted += a;
  }
  return drafted == 0 ? 1.0 : static_cast<double>(accepted) / static_cast<double>(drafted);
}

RetrievalCache::Action RetrievalCache::Decide(int64_t cached, int64_t budget_tokens, const RetrievalPolicy& policy) {
  while (static_cast<int>(rounds_.size()) > policy.acceptance_window) rounds_.pop_front();
  if (pause_left_ > 0) {
    --pause_left_;
    if (pause_left_ == 0) built_ = false;  // try again with a fresh selection
    return Action::kPlain;
  }
  // A cache that would hold half the context or more saves too little of the full pass.
  if (cached < policy.min_context || budget_tokens * 2 > cached) return Action::kPlain;
  if (!built_) return Action::kBuild;
  const bool window_full = rounds_since_build_ >= policy.acceptance_window;
  const double rate = RollingAcceptance();
  if (window_full && rate < policy.pause_acceptance) {
    pause_left_ = policy.pause_steps;
    rounds_.clear();
    return Action::kPlain;
  }
  if (window_full && rate < policy.rebuild_acceptance) return Action::kBuild;
  if (policy.rebuild_stride > 0 && cached - built_at_ >= policy.rebuild_stride) return Action::kBuild;
  return Action::kDraft;
}

}  // namespace kvflow
