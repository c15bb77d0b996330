// Launchers of the logits-processing and sampling kernels (kernels/sampling.cu). Conventions:
// kernels/kernel_common.h. The semantics are those of the CPU Sampler (sampling/sampler.h), given
// the row's uniform draw `uniform` (the host keeps each sequence's seeded RNG, so a seed gives the
// same tokens on either backend):
//   1. raw log-normalizer and the num_top_logprobs largest raw logits (ties: lower id first);
//   2. the row's constraint (sampling/token_constraint.h): suppressed (banned) tokens and tokens
//      outside its allowed-token mask -> -inf, then each bias added to its token's logit (the
//      token's raw logit kept for step 4); repetition penalty over prompt + output tokens (divide positive
//      logits, multiply negative ones, once per distinct token), then frequency and presence
//      penalties over output tokens;
//   3. temperature <= 0 (or every logit -inf): argmax (lowest id among ties). Otherwise weights
//      w = exp((l - max) / T) (the top token weighs exactly 1); top-k keeps the k largest logits
//      (ties: lower id first); top-p keeps the smallest set of heaviest tokens (heavier first,
//      ties: lower id first) whose weight reaches top_p * (weight of the top-k set); min-p keeps
//      tokens with w >= min_p; a kept token also has w > 0. The draw is an inverse CDF over the
//      kept tokens in ASCENDING TOKEN ID order: the first kept token whose inclusive prefix sum of
//      weights exceeds uniform * (sum of the kept weights), or the last kept token if rounding
//      leaves none (exactly what Sampler::Draw does with its own uniform draw);
//   4. logprob of the chosen token on the raw (unpenalized) logits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// One row's parameters, in device memory (an array of num_rows).
struct SamplingRow {
  float temperature = 1.0f;  // <= 0: greedy
  int32_t top_k = 0;         // <= 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  int32_t history_offset = 0;  // the row's prompt then output tokens in `history`
  int32_t prompt_len = 0;
  int32_t output_len = 0;
  int32_t suppress_offset = 0;  // the row's suppressed tokens in `suppress`
  int32_t suppress_len = 0;
  int32_t mask_offset = -1;     // the row's allowed-token mask in `masks` (ceil(vocab / 32) words); -1: none
  int32_t bias_offset = 0;      // the row's biases in `bias_tokens` / `bias_values`
  int32_t bias_len = 0;
  double uniform = 0.0;  // the row's draw in [0, 1)
};

struct SampleArgs {
  float* logits = nullptr;  // [num_rows][vocab_size] fp32, overwritten (penalties, masking)
  int num_rows = 0;
  int vocab_size = 0;
  const SamplingRow* rows = nullptr;
  const int32_t* history = nullptr;
  const int32_t* suppress = nullptr;
  const uint32_t* masks = nullptr;      // allowed-token masks, bit t of word t / 32
  const int32_t* bias_tokens = nullptr;
  const float* bias_values = nullptr;
  float* bias_raw = nullptr;            // as long as bias_tokens: scratch for the biased tokens' raw logits
  int num_top_logprobs = 0;          // 0..kMaxTopLogprobs, the same for every row
  int32_t* out_tokens = nullptr;     // [num_rows]
  float* out_logprobs = nullptr;     // [num_rows] raw logprob of the chosen token
  int32_t* out_top_tokens = nullptr; // [num_rows][num_top_logprobs], best first
  float* out_top_logprobs = nullptr; // [num_rows][num_top_logprobs]
  void* workspace = nullptr;         // SampleWorkspaceBytes(num_rows, vocab_size) bytes
  size_t workspace_bytes = 0;
};

constexpr int kMaxTopLogprobs = 20;

size_t SampleWorkspaceBytes(int num_rows, int vocab_size);
int SampleFromLogits(const SampleArgs& args, void* stream);

}  // namespace kvflow::cuda
