// The logprob of a given token under one row of raw logits (log-softmax, no temperature or
// penalties, as vLLM reports prompt logprobs), with the row's most likely alternatives.
#pragma once

#include <cstdint>
#include <span>

#include "kvflow/request.h"

namespace kvflow {

SampledToken ScoreToken(std::span<const float> logits, int32_t token, int num_top);

}  // namespace kvflow
