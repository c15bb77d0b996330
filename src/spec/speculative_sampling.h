// Speculative decoding as a decoding strategy (engine/decoding/strategy.h): before each step the
// n-gram drafter proposes up to k tokens to follow the sequence; the step runs the sequence's
// next token and the drafts in one pass (the scheduler reserves their KV slots); the target's rows
// then verify them left to right. Lossless: each row is sampled by the sequence's own sampler
// exactly as plain decoding would (greedy: argmax), and a draft is kept iff the sampled token
// equals it. For a one-hot drafter this is speculative sampling's acceptance rule with residual
// resampling (spec/rejection_sampler.h), so the output is distributed as the target's; with a seed
// it is the same token sequence as without speculation.
#pragma once

#include "engine/decoding/strategy.h"
#include "spec/ngram_drafter.h"

namespace kvflow {

class SpeculativeSampling final : public DecodingStrategy {
 public:
  explicit SpeculativeSampling(const NgramDrafterConfig& config) : drafter_(config) {}

  void BeforeStep(EngineCore& core, RequestState& req) override;
  void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) override;

 private:
  NgramDrafter drafter_;
};

}  // namespace kvflow
