// Decoding strategies: how a request turns each step's model output into tokens. One object per
// request, holding the strategy's own state: plain sampling (PlainSampling), parallel sampling with
// n / best_of (ParallelSampling), beam search (BeamSearch). The EngineCore appends tokens, checks
// stops and finishes requests; a strategy decides which tokens, on which sequences, and what the
// request delivers at the end. A speculative strategy would also propose draft tokens before a
// step and verify several logit rows per sequence after it.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kvflow/request.h"
#include "kvflow/sampling.h"

namespace kvflow {

class Drafter;
class EngineCore;
struct RequestState;
struct ScheduledSeq;
struct SeqState;

// One sequence's logits from a step, scratch that sampling may modify: vocab_size floats, or with
// drafts one row for its last real token and one per draft ((drafts + 1) x vocab_size).
struct SeqLogits {
  SeqState* seq = nullptr;
  std::span<float> logits;
  std::span<const int32_t> drafts;
  const ScheduledSeq* step = nullptr;
};

class DecodingStrategy {
 public:
  virtual ~DecodingStrategy() = default;

  // Before each step is scheduled (a speculative strategy proposes its drafts here).
  virtual void BeforeStep(EngineCore& core, RequestState& req) {}
  // Whether the executor may sample this request's rows itself, each sequence with its own sampler
  // (device sampling): then OnSampled receives tokens instead of OnLogits receiving logits.
  virtual bool ExecutorMaySample() const { return false; }
  // The step's logits for the request's sequences that needed them, in batch order.
  virtual void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) = 0;
  // Tokens the executor sampled for `seq`: appended as they are.
  virtual void OnSampled(EngineCore& core, RequestState& req, SeqState& seq, std::span<const SampledToken> tokens);
  // Whether the request is done: every sequence it will have exists and has finished.
  virtual bool Finished(const RequestState& req) const;
  // Delivers what the request held back (best_of's n best, the best beams); called once, when
  // Finished, before the request is forgotten.
  virtual void Deliver(EngineCore& core, RequestState& req) {}
};

// The strategy `params` ask for; `drafter` (may be null): the engine's speculative decoding, used
// by plain requests that keep SamplingParams::speculative on. `seed`: the request's.
std::unique_ptr<DecodingStrategy> MakeDecodingStrategy(const SamplingParams& params, uint64_t seed,
                                                       const Drafter* drafter);

}  // namespace kvflow
