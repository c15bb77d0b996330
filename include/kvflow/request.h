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
struct StreamEvent {
  RequestId id = 0;
  std::vector<SampledToken> tokens;  // new tokens this step (usually one)
  std::string text_delta;            // new complete UTF-8 text (stop strings already cut)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;                      // set when finish_reason == kError
};
using StreamCallback = std::function<void(const StreamEvent&)>;

struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> prompt_tokens;
  std::vector<int32_t> output_tokens;
  std::vector<SampledToken> output_logprobs;  // one per output token
  std::string text;
  FinishReason finish_reason = FinishReason::kNone;
  double time_to_first_token_s = 0.0;
  double total_time_s = 0.0;
};

}  // namespace kvflow
