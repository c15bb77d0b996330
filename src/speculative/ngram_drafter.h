// Prompt-lookup drafting (vLLM's "ngram" speculative method): the last n tokens of a sequence are
// looked up earlier in its own prompt and output, and the k tokens that followed the latest match
// are proposed as drafts. No model, no memory beyond the sequence itself; it pays off where text
// repeats (rewriting, summarising, code edits, retrieval answers).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvflow/status.h"
#include "engine/drafter.h"

namespace kvflow {

struct NgramDrafterConfig {
  int num_speculative_tokens = 4;  // k: drafts proposed per step at most
  int ngram_max = 4;               // longest suffix tried first
  int ngram_min = 1;               // shortest suffix accepted

  Status Validate() const;
};

class NgramDrafter final : public Drafter {
 public:
  explicit NgramDrafter(const NgramDrafterConfig& config) : config_(config) {}

  int num_speculative_tokens() const override { return config_.num_speculative_tokens; }
  // Deterministic drafts (no probs).
  void Propose(std::span<DraftJob* const> jobs) override;

  // Up to `max_tokens` (<= num_speculative_tokens) drafts to follow `tokens`: for n from ngram_max
  // down to ngram_min, the tokens after the latest earlier occurrence of the last n tokens. Empty
  // when nothing matches.
  std::vector<int32_t> Propose(std::span<const int32_t> tokens, int max_tokens) const;

  const NgramDrafterConfig& config() const { return config_; }

 private:
  NgramDrafterConfig config_;
};

}  // namespace kvflow
