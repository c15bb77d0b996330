// Speculative decoding as a decoding strategy (engine/decoding/strategy.h): before each step the
// engine's drafter (engine/drafter.h: n-gram lookup or a draft model) proposes up to k tokens to
// follow the sequence; the step runs the sequence's next token and the drafts in one pass (the
// scheduler reserves their KV slots); the target's rows then verify them left to right.
//
// Lossless either way:
// - deterministic drafts (n-gram): each row is sampled by the sequence's own sampler exactly as
//   plain decoding would (greedy: argmax), and a draft is kept iff the sampled token equals it. For
//   a one-hot drafter this is speculative sampling's acceptance rule with residual resampling
//   (sampling/rejection_sampler.h), and with a seed it is the same token sequence as without
//   speculation;
// - sampled drafts (draft model, distribution q): a draft d is kept with probability
//   min(1, p(d)/q(d)), else the token is drawn from norm(max(0, p - q)), where p is the
//   distribution plain decoding draws from (penalties, temperature, top-k/p, min-p applied), and
//   after k kept drafts one more token is drawn from p. The output is distributed as the target's;
//   greedy requests give exactly the greedy tokens. A seed gives reproducible tokens, not the
//   same ones as without speculation (the draws differ).
#pragma once

#include <cstdint>
#include <optional>

#include "engine/decoding/strategy.h"
#include "sampling/sampler.h"
#include "engine/drafter.h"

namespace kvflow {

class SpeculativeSampling final : public DecodingStrategy {
 public:
  // `num_speculative_tokens`: the engine drafter's k; `seed`: the request's.
  SpeculativeSampling(int num_speculative_tokens, const SamplingParams& params, uint64_t seed);

  void BeforeStep(EngineCore& core, RequestState& req) override;
  void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) override;

 private:
  // Verifies sampled drafts against the target's rows; returns the tokens to append.
  std::vector<SampledToken> VerifySampledDrafts(EngineCore& core, RequestState& req, SeqState& seq,
                                                const SeqLogits& r, int64_t& accepted);

  int k_;
  DraftJob job_;
  Sampler draft_sampler_;  // the drafter draws this request's drafts with it
};

}  // namespace kvflow
