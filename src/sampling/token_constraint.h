// What one sequence may sample at one position, as the logits processors (engine/
// logits_processor.h) narrow it: banned tokens, an optional bitmask of the allowed tokens (bit t of
// word t / 32, xgrammar's layout; a structured-output grammar fills it) and additive biases
// (OpenAI's logit_bias). The CPU Sampler and the CUDA sampling kernel apply it to a row after
// reading the raw logits (logprobs stay those of the raw logits) and before the penalties:
// banned and not-allowed tokens become -inf, a biased token's logit gains its bias.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvflow {

struct TokenBias {
  int32_t token = 0;
  float bias = 0.0f;
};

struct TokenLogit {
  int32_t token = 0;
  float logit = 0.0f;
};

class TokenConstraint {
 public:
  // Every token allowed, nothing biased.
  void Clear();

  void Ban(int32_t token) { banned_.push_back(token); }
  void Ban(std::span<const int32_t> tokens) { banned_.insert(banned_.end(), tokens.begin(), tokens.end()); }
  // Allows only the tokens whose bit is set in `mask` (ceil(vocab / 32) words), intersected with
  // any mask already set.
  void AllowOnly(std::span<const uint32_t> mask);
  // Adds to a token's logit; biases of one token add up.
  void AddBias(int32_t token, float bias) { bias_.push_back({token, bias}); }

  bool empty() const { return banned_.empty() && mask_.empty() && bias_.empty(); }
  std::span<const int32_t> banned() const { return banned_; }
  std::span<const uint32_t> mask() const { return mask_; }  // empty: no mask
  std::span<const TokenBias> bias() const { return bias_; }
  // Whether `token` may be sampled (bias aside).
  bool Allows(int32_t token) const;

  // Applies the bans and the mask to `logits` (one row: -inf), then the biases; `raw`, when
  // given, receives each biased token's logit before its bias (the sampler reports raw logprobs).
  void ApplyTo(std::span<float> logits, std::vector<TokenLogit>* raw = nullptr) const;

 private:
  std::vector<int32_t> banned_;
  std::vector<uint32_t> mask_;
  std::vector<TokenBias> bias_;
};

}  // namespace kvflow
