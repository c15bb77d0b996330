// Turns one row of logits into a token, following a request's SamplingParams.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "sampling/token_constraint.h"

namespace kvflow {

// One sampler per sequence: it owns the sequence's RNG so that a fixed seed reproduces the output
// regardless of what else is in the batch.
class Sampler {
 public:
  Sampler(const SamplingParams& params, uint64_t seed);

  // `logits` (vocab_size floats) is scratch: it is modified in place.
  // `prompt` and `output` are the sequence's tokens so far (for the penalties).
  // `constraint`: what the logits processors allow now (null: everything); the logprobs reported
  // are those of the raw logits.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                      const TokenConstraint* constraint = nullptr);
  // The same with only `banned` tokens constrained.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                      std::span<const int32_t> banned);

  // For speculative decoding against a drafter that samples (sampling/rejection_sampler.h): the
  // distribution Sample would draw from for this row, with suppression, penalties, temperature,
  // top-k, top-p and min-p applied, as probabilities by token id (greedy, or every token masked:
  // one-hot at the argmax). `logits` is scratch, as for Sample; Report may follow.
  void Distribution(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                    const TokenConstraint* constraint, std::vector<float>& probs);
  void Distribution(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                    std::span<const int32_t> banned, std::vector<float>& probs);
  // What Sample would return had it chosen `token` from the row the last Sample or Distribution
  // processed (same `logits` span): its logprob on the raw logits and the top logprobs.
  SampledToken Report(std::span<const float> logits, int32_t token) const;
  // A token drawn from `probs` (by token id, summing to about 1) with this sampler's next uniform:
  // the inverse CDF in ascending id order, as Sample draws.
  int32_t DrawFrom(std::span<const float> probs);

  // The uniform draw Sample would take for its next token (non-greedy params), for a device
  // sampler: taking it here keeps the sequence's RNG in step with the CPU path. (The CPU path
  // skips the draw when every token is masked; a device row always takes it.)
  double NextUniform();

 private:
  struct ScoredToken {
    float logit = 0.0f;
    int32_t token = -1;
  };

  // The `count` largest logits, best first (equal logits: lower id first).
  static void SelectLargest(std::span<const float> logits, size_t count,
                            std::vector<ScoredToken>* largest);
  // Log of the softmax normalizer of the raw logits; fills top_raw_ with the params_.logprobs
  // largest of them, best first.
  double ScanRawLogits(std::span<const float> logits);
  // Repetition, frequency and presence penalties; keeps the raw logit of every token it touches
  // in penalized_ so that the chosen token's logprob can still be reported on the raw logits.
  void ApplyPenalties(std::span<float> logits, std::span<const int32_t> prompt,
                      std::span<const int32_t> output);
  // Temperature, top-k, top-p and min-p, then one draw from what is left: an inverse-CDF walk over
  // the kept tokens in ascending id order, so that a uniform draw maps to the same token whatever
  // the backend.
  int32_t Draw(std::span<const float> logits);
  // Draw's candidates: fills order_ (ascending ids) and weights_, returns the weight of the
  // eligible ones; 0 when every token is masked.
  double KeepCandidates(std::span<const float> logits);
  bool Eligible(int32_t token) const { return weights_[token] > 0.0f && weights_[token] >= params_.min_p; }
  // Trims order_ to the smallest set of heaviest tokens that weighs at least nucleus_weight
  // (always one token at least).
  void KeepNucleus(double nucleus_weight);
  // Puts order_ (distinct ids) in ascending order.
  void SortByTokenId();
  float RawLogit(std::span<const float> logits, int32_t token) const;
  // Applies the constraint after the raw scan, keeping the biased tokens' raw logits.
  void Constrain(std::span<float> logits, const TokenConstraint* constraint);

  SamplingParams params_;
  std::mt19937_64 rng_;
  // Scratch reused across calls so that a step allocates nothing once the vocab size is known.
  std::vector<int32_t> order_;          // candidate ids
  std::vector<float> weights_;          // by token id: exp(logit - max); sized by ScanRawLogits
  std::vector<int32_t> occurrences_;    // by token id: 1 + output count while penalizing, else 0
  std::vector<uint64_t> kept_bits_;     // a bit per token id, zero between calls (SortByTokenId)
  std::vector<ScoredToken> penalized_;  // raw logits of the tokens the penalties changed
  std::vector<TokenLogit> biased_;      // raw logits of the tokens the constraint biased
  TokenConstraint banned_;              // scratch of the ban-list overloads
  std::vector<ScoredToken> top_raw_;    // the largest raw logits, for top_logprobs
  std::vector<ScoredToken> top_k_;      // the largest sampling logits, for top-k
  double raw_log_normalizer_ = 0.0;     // of the row last scanned, for Report
};

}  // namespace kvflow
