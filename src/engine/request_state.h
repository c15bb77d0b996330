// Engine-side state of a request beyond what the scheduler tracks: samplers, incremental text,
// logprobs, and the request's decoding strategy.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/decoding/strategy.h"
#include "engine/stop_matcher.h"
#include "kvflow/request.h"
#include "kvflow/tokenizer.h"
#include "sampling/sampler.h"
#include "sched/sequence_group.h"

namespace kvflow {

// One completion being generated (a parallel sample or a beam).
struct SeqState {
  // Without a tokenizer there is no text (and no stop strings).
  SeqState(SchedSequence* seq, int index, const SamplingParams& params, uint64_t seed, const Tokenizer* tokenizer)
      : seq(seq), index(index), sampler(params, seed), stop(params.stop) {
    if (tokenizer) decoder.emplace(*tokenizer, params.skip_special_tokens);
  }

  std::span<const int32_t> prompt() const {
    return {seq->tokens.data(), static_cast<size_t>(seq->prompt_len)};
  }
  std::span<const int32_t> output() const {
    return {seq->tokens.data() + seq->prompt_len, static_cast<size_t>(seq->output_len())};
  }

  SchedSequence* seq;
  int index;
  Sampler sampler;
  std::optional<IncrementalDecoder> decoder;
  StopMatcher stop;
  std::vector<SampledToken> logprobs;
  std::string text;  // streamed text so far (stop strings cut)
  double cumulative_logprob = 0.0;
  FinishReason finish = FinishReason::kNone;
};

struct RequestState {
  RequestId id = 0;
  SamplingParams params;
  uint64_t seed = 0;
  StreamCallback on_event;
  SequenceGroup* group = nullptr;
  std::vector<std::unique_ptr<SeqState>> seqs;  // every sequence ever created, index order
  std::unique_ptr<DecodingStrategy> strategy;
  // SamplingParams::prompt_logprobs: entry i scores prompt token i + 1; sent with the first event.
  std::vector<SampledToken> prompt_logprobs;
  bool prompt_logprobs_sent = false;

  SeqState* Find(const SchedSequence* s) {
    for (auto& st : seqs) {
      if (st->seq == s) return st.get();
    }
    return nullptr;
  }
};

}  // namespace kvflow
