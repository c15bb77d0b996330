#include "speculative/ngram_drafter.h"

#include <algorithm>
#include <string>

#include "sched/sequence_group.h"

namespace kvflow {

Status NgramDrafterConfig::Validate() const {
  if (num_speculative_tokens < 1 || num_speculative_tokens > 64) {
    return Status::InvalidArgument("num_speculative_tokens must be in [1, 64], not " +
                                   std::to_string(num_speculative_tokens));
  }
  if (ngram_min < 1 || ngram_max < ngram_min) {
    return Status::InvalidArgument("ngram sizes need 1 <= ngram_min <= ngram_max, not min " + std::to_string(ngram_min) +
                                   " max " + std::to_string(ngram_max));
  }
  return Status::Ok();
}

std::vector<int32_t> NgramDrafter::Propose(std::span<const int32_t> tokens, int max_tokens) const {
  const int k = std::min(max_tokens, config_.num_speculative_tokens);
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (k <= 0) return {};
  for (int n = std::min<int64_t>(config_.ngram_max, len - 1); n >= config_.ngram_min; --n) {
    const auto suffix = tokens.subspan(static_cast<size_t>(len - n));
    // Latest earlier occurrence: scan backwards from the position just before the suffix itself.
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const int64_t from = start + n;
      const int64_t count = std::min<int64_t>(k, len - from);
      return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + from + count);
    }
  }
  return {};
}

void NgramDrafter::Propose(std::span<DraftJob* const> jobs) {
  for (DraftJob* job : jobs) {
    job->drafts = Propose(job->seq->tokens, job->max_drafts);
    job->probs.clear();
  }
}

}  // namespace kvflow
