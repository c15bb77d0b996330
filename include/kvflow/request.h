// What a request produces: tokens, text, logprobs, and why it finished.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvflow/sampling.h"
#include "kvflow/status.h"

namespace kvflow {

using RequestId = uint64_t;

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

// One generated token. `logprob` is log-softmax of the model's raw logits (before temperature and
// penalties, as vLLM V1 reports it); `top_logprobs` holds the N most likely alternatives.
struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top_logprobs;
};

enum class FinishReason { kNone, kLength, kStop, kEos, kCancelled, kError };
const char* FinishReasonName(FinishReason r);

// Delivered through the stream callback after every step that produced something for a request.
// With n > 1 each completion streams separately, told apart by `index`.
struct StreamEvent {
  RequestId id = 0;
  int index = 0;                     // which completion (0 .. n-1)
  std::vector<SampledToken> tokens;  // new tokens this step (usually one)
  // With SamplingParams::prompt_logprobs, once, on the request's first event: entry i is prompt
  // token i + 1 given the tokens before it (prompt length - 1 entries).
  std::vector<SampledToken> prompt_logprobs;
  std::string text_delta;            // new complete UTF-8 text (stop strings already cut)
  bool finished = false;             // this completion is done
  bool request_finished = false;     // every completion of the request is done (the last event)
  FinishReason finish_reason = FinishReason::kNone;
  Status error;                      // set when finish_reason == kError
};
using StreamCallback = std::function<void(const StreamEvent&)>;

struct CompletionOutput {
  int index = 0;
  std::vector<int32_t> tokens;
  std::vector<SampledToken> logprobs;  // one per token
  std::string text;
  double cumulative_logprob = 0.0;
  FinishReason finish_reason = FinishReason::kNone;
};

struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> prompt_tokens;
  std::vector<SampledToken> prompt_logprobs;  // see StreamEvent::prompt_logprobs
  std::vector<CompletionOutput> outputs;  // n of them, by index
  double time_to_first_token_s = 0.0;
  double total_time_s = 0.0;

  // The first completion (the only one when n == 1).
  const CompletionOutput& first() const { return outputs.front(); }
};

}  // namespace kvflow
