#include "engine/decoding/strategy.h"

#include "engine/decoding/beam_search.h"
#include "engine/decoding/sampling.h"
#include "engine/engine_core.h"
#include "engine/decoding/speculative_sampling.h"

namespace kvflow {

void DecodingStrategy::OnSampled(EngineCore& core, RequestState& req, SeqState& seq,
                                 std::span<const SampledToken> tokens) {
  core.AppendTokens(req, seq, tokens);
}

bool DecodingStrategy::Finished(const RequestState& req) const {
  for (const auto& s : req.seqs) {
    if (s->finish == FinishReason::kNone) return false;
  }
  return true;
}

std::unique_ptr<DecodingStrategy> MakeDecodingStrategy(const SamplingParams& params, uint64_t seed,
                                                       const Drafter* drafter) {
  if (params.use_beam_search) return std::make_unique<BeamSearch>();
  if (params.num_candidates() > 1) return std::make_unique<ParallelSampling>();
  if (drafter && params.speculative && params.max_tokens > 1) {
    return std::make_unique<SpeculativeSampling>(drafter->num_speculative_tokens(), params, seed);
  }
  return std::make_unique<PlainSampling>();
}

}  // namespace kvflow
