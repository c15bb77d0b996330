// Engine-side state of one request: its tokens, KV blocks, sampler and streamed text.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "kv/block_table.h"
#include "kvflow/request.h"
#include "kvflow/tokenizer.h"
#include "sampling/sampler.h"
#include "engine/stop_matcher.h"

namespace kvflow {

struct Sequence {
  Sequence(RequestId id, std::vector<int32_t> prompt, const SamplingParams& params, uint64_t seed,
           StreamCallback on_event, const Tokenizer& tokenizer, int block_size)
      : id(id), prompt(std::move(prompt)), params(params), sampler(params, seed),
        on_event(std::move(on_event)), decoder(tokenizer), stop(params.stop), blocks(block_size),
        arrival(std::chrono::steady_clock::now()) {}

  int64_t num_tokens() const { return static_cast<int64_t>(prompt.size() + output.size()); }
  int32_t token_at(int64_t i) const {
    const auto n = static_cast<int64_t>(prompt.size());
    return i < n ? prompt[static_cast<size_t>(i)] : output[static_cast<size_t>(i - n)];
  }
  // Tokens whose K/V are not in the cache yet (the whole prompt at first, then one per step).
  int64_t num_uncomputed() const { return num_tokens() - num_computed; }

  RequestId id;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  std::vector<SampledToken> output_logprobs;
  SamplingParams params;
  Sampler sampler;
  StreamCallback on_event;
  IncrementalDecoder decoder;
  StopMatcher stop;
  BlockTable blocks;
  int64_t num_computed = 0;
  bool cancel_requested = false;
  std::chrono::steady_clock::time_point arrival;
  std::optional<std::chrono::steady_clock::time_point> first_token_time;
};

}  // namespace kvflow
