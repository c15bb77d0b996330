// Sampling strategies: one completion sampled token by token (PlainSampling), or n / best_of
// candidates forked off the first after the prompt's logits and sampled independently
// (ParallelSampling).
#pragma once

#include <cstdint>

#include "engine/decoding/strategy.h"

namespace kvflow {

// One sequence; the executor may sample it on the device.
class PlainSampling final : public DecodingStrategy {
 public:
  bool ExecutorMaySample() const override { return true; }
  void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) override;
};

// best_of (or n) candidates sharing the prompt's KV blocks. With best_of == n every candidate
// streams; with best_of > n the n with the highest cumulative logprob are delivered at the end.
class ParallelSampling final : public DecodingStrategy {
 public:
  void OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) override;
  bool Finished(const RequestState& req) const override;
  void Deliver(EngineCore& core, RequestState& req) override;

 private:
  bool forked_ = false;  // the candidates beyond the first exist (after the prompt's logits)
};

// Seed of candidate `index` of a request: the request seed itself for the first, so n = 1
// reproduces what a plain request gives.
uint64_t CandidateSeed(uint64_t seed, int index);

// Samples one token for `seq` from its logits (EOS and stop tokens suppressed before min_tokens)
// and appends it.
void SampleAndAppend(EngineCore& core, RequestState& req, SeqState& seq, std::span<float> logits);

}  // namespace kvflow
