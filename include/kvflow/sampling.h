// Per-request sampling parameters (vLLM / OpenAI semantics).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

struct SamplingParams {
  // 0 means greedy (argmax); otherwise logits are divided by it before top-k/top-p/min-p.
  float temperature = 1.0f;
  int top_k = 0;          // <= 0: disabled
  float top_p = 1.0f;     // (0, 1]; 1: disabled
  float min_p = 0.0f;     // [0, 1]; 0: disabled
  // CTRL-style: logits of tokens seen in prompt or output are divided (if > 0) or multiplied by it.
  float repetition_penalty = 1.0f;
  // OpenAI-style, applied to tokens of the output only: logit -= freq * count + presence * (count > 0).
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // Same seed and same prompt => same output. Unset: the engine draws one.
  std::optional<uint64_t> seed;
  int max_tokens = 16;  // 0: only score the prompt (needs prompt_logprobs)
  int min_tokens = 0;  // EOS and stop tokens are suppressed until this many were generated
  std::vector<int32_t> stop_token_ids;
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs; the bias is added to the token's
  // logit before the penalties and the sampling (logprobs stay those of the raw logits). -100
  // bans the token in practice, +100 all but forces it.
  std::vector<std::pair<int32_t, float>> logit_bias;
  std::vector<std::string> stop;  // stop strings; the matched text is not included in the output
  bool ignore_eos = false;
  int logprobs = 0;  // return this many top alternatives per token (0: only the chosen token's)
  // vLLM's prompt_logprobs: when set, the logprob of every prompt token after the first (given the
  // tokens before it) with this many top alternatives. Scoring needs every prompt token computed,
  // so such a request does not take prefix-cache hits. With max_tokens 0 nothing is generated.
  std::optional<int> prompt_logprobs;
  // With an engine that decodes speculatively (EngineConfig::speculative_method), whether this
  // request does; false: plain decoding.
  bool speculative = true;
  // With an engine that selects KV (EngineConfig::kv_selection: InfiniGen, H2O), whether this
  // request's attention reads the selection (true) or the whole cache (false); unset: the
  // engine's kv_selection_default.
  std::optional<bool> kv_selection;
  // Completions returned. With best_of > n, best_of are generated and the n with the highest
  // cumulative logprob are returned (at the end, not streamed). All share the prompt's KV blocks.
  int n = 1;
  std::optional<int> best_of;
  // Beam search over best_of (or n) beams, returning the n best finished beams. Deterministic:
  // needs temperature 0; scores are cumulative logprob / length^length_penalty (vLLM/HF).
  bool use_beam_search = false;
  float length_penalty = 1.0f;

  bool greedy() const { return temperature <= 0.0f; }
  int num_candidates() const { return best_of.value_or(n); }
  // Tokens reach the stream callback as they are generated (not for beam search or best_of > n).
  bool streams() const { return !use_beam_search && num_candidates() == n; }
  // Rejects impossible values (negative temperature, top_p outside (0,1], ...).
  Status Validate() const;
};

}  // namespace kvflow
