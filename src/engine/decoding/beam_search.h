// Beam search (vLLM / Hugging Face semantics): every step extends each live beam by its 2 * width
// best continuations, keeps the `width` best by cumulative logprob (forking beams that continue
// twice, pruning the rest), and records beams that end (EOS, a stop token, the length limit) as
// hypotheses scored cumulative logprob / length^length_penalty. It stops early once no live beam
// can beat the width-th hypothesis and delivers the n best. Deterministic (temperature 0).
#pragma once

#include <unordered_map>
#include <vector>

#include "engine/decoding/strategy.h"

namespace kvflow {

class BeamSearch final : public DecodingStrategy {
 public:
  void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) override;
  void Deliver(EngineCore& core, RequestState& req) override;

 private:
  struct Hypothesis {
    std::vector<int32_t> tokens;
    std::vector<SampledToken> logprobs;
    double cumulative_logprob = 0.0;
    double score = 0.0;
    FinishReason finish = FinishReason::kNone;
  };
  // Records a finished beam: the beam's tokens plus `last` (if any).
  void AddHypothesis(const RequestState& req, const SeqState& beam, const SampledToken* last, double cumulative,
                     FinishReason why);

  // A step's logits of each live beam, by sequence index: beam search waits for every beam's row
  // (a beam may still be prefilling after a recompute).
  std::unordered_map<int, std::vector<float>> pending_;
  std::vector<Hypothesis> done_;
};

}  // namespace kvflow
