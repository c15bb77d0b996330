#include "sampling/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

namespace kvflow {

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// The top-p search narrows the boundary of the nucleus down to this many candidates before it
// sorts them.
constexpr size_t kNucleusSortedTail = 64;

// 53 random bits scaled into [0, 1): the same value on every platform, unlike
// std::uniform_real_distribution.
double UniformUnit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

bool InVocab(int32_t token, size_t vocab_size) {
  return token >= 0 && static_cast<size_t>(token) < vocab_size;
}

// Lowest id among the largest logits, as greedy decoding breaks ties.
int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// exp(x) for x <= 0 within 1e-7 relative error (Cephes' expf polynomial); exactly 0 for -inf and
// anything below the float range. Unlike std::exp it vectorizes, which makes the pass over a 128K
// vocab about six times faster.
float ExpNonPositive(float x) {
  constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kRoundingShift;
  const float power_of_two = shifted - kRoundingShift;
  const int32_t exponent =
      std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRoundingShift);
  // x - power_of_two * ln 2, with ln 2 split in two so that the product stays exact.
  const float r = x - power_of_two * 0.693359375f + power_of_two * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float scaled = p * std::bit_cast<float>((exponent + 127) << 23);
  // A bit mask rather than a branch, so that the loops calling this vectorize.
  const int32_t in_range = -static_cast<int32_t>(x >= -87.0f);
  return std::bit_cast<float>(std::bit_cast<int32_t>(scaled) & in_range);
}

// weights[i] = exp((logits[i] - max_logit) / temperature), returning their sum.
double ExponentiateAll(std::span<const float> logits, float max_logit, float temperature,
                       float* weights) {
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = ExpNonPositive((logits[i] - max_logit) / temperature);
  }
  // Independent double accumulators: accurate over 128K terms and still vectorizable.
  constexpr size_t kLanes = 8;
  double lanes[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= logits.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) lanes[lane] += weights[i + lane];
  }
  double sum = 0.0;
  for (; i < logits.size(); ++i) sum += weights[i];
  for (double lane : lanes) sum += lane;
  return sum;
}

}  // namespace

Sampler::Sampler(const SamplingParams& params, uint64_t seed) : params_(params), rng_(seed) {}

double Sampler::NextUniform() { return UniformUnit(rng_); }

SampledToken Sampler::Sample(std::span<float> logits, std::span<const int32_t> prompt,
                             std::span<const int32_t> output, std::span<const int32_t> banned) {
  banned_.Clear();
  banned_.Ban(banned);
  return Sample(logits, prompt, output, &banned_);
}

SampledToken Sampler::Sample(std::span<float> logits, std::span<const int32_t> prompt,
                             std::span<const int32_t> output, const TokenConstraint* constraint) {
  raw_log_normalizer_ = ScanRawLogits(logits);
  Constrain(logits, constraint);
  ApplyPenalties(logits, prompt, output);
  return Report(logits, params_.greedy() ? Argmax(logits) : Draw(logits));
}

SampledToken Sampler::Report(std::span<const float> logits, int32_t token) const {
  SampledToken sampled;
  sampled.token = token;
  sampled.logprob = static_cast<float>(RawLogit(logits, token) - raw_log_normalizer_);
  sampled.top_logprobs.reserve(top_raw_.size());
  for (const ScoredToken& top : top_raw_) {
    sampled.top_logprobs.push_back({top.token, static_cast<float>(top.logit - raw_log_normalizer_)});
  }
  return sampled;
}

void Sampler::Distribution(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                           std::span<const int32_t> banned, std::vector<float>& probs) {
  banned_.Clear();
  banned_.Ban(banned);
  Distribution(logits, prompt, output, &banned_, probs);
}

void Sampler::Constrain(std::span<float> logits, const TokenConstraint* constraint) {
  biased_.clear();
  if (constraint != nullptr) constraint->ApplyTo(logits, &biased_);
}

void Sampler::Distribution(std::span<float> logits, std::span<const int32_t> prompt, std::span<const int32_t> output,
                           const TokenConstraint* constraint, std::vector<float>& probs) {
  raw_log_normalizer_ = ScanRawLogits(logits);
  Constrain(logits, constraint);
  ApplyPenalties(logits, prompt, output);
  probs.assign(logits.size(), 0.0f);
  const double kept_weight = params_.greedy() ? 0.0 : KeepCandidates(logits);
  if (kept_weight <= 0.0) {
    probs[static_cast<size_t>(Argmax(logits))] = 1.0f;
    return;
  }
  for (int32_t token : order_) {
    if (Eligible(token)) probs[static_cast<size_t>(token)] = static_cast<float>(weights_[token] / kept_weight);
  }
}

int32_t Sampler::DrawFrom(std::span<const float> probs) {
  double total = 0.0;
  for (float p : probs) total += p;
  const double threshold = UniformUnit(rng_) * total;
  double cumulative = 0.0;
  int32_t chosen = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    chosen = static_cast<int32_t>(i);
    cumulative += probs[i];
    if (threshold < cumulative) break;
  }
  return chosen >= 0 ? chosen : Argmax(probs);
}

void Sampler::SelectLargest(std::span<const float> logits, size_t count,
                            std::vector<ScoredToken>* largest) {
  // A heap whose front is the worst of the best `count` seen so far: one comparison per token.
  auto better = [](const ScoredToken& a, const ScoredToken& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
  };
  count = std::min(count, logits.size());
  largest->clear();
  for (size_t i = 0; i < logits.size() && count > 0; ++i) {
    const ScoredToken candidate{logits[i], static_cast<int32_t>(i)};
    if (largest->size() < count) {
      largest->push_back(candidate);
      std::push_heap(largest->begin(), largest->end(), better);
    } else if (better(candidate, largest->front())) {
      std::pop_heap(largest->begin(), largest->end(), better);
      largest->back() = candidate;
      std::push_heap(largest->begin(), largest->end(), better);
    }
  }
  std::sort_heap(largest->begin(), largest->end(), better);
}

double Sampler::ScanRawLogits(std::span<const float> logits) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  if (weights_.size() < logits.size()) weights_.resize(logits.size());
  if (kept_bits_.size() < (logits.size() + 63) / 64) kept_bits_.resize((logits.size() + 63) / 64, 0);
  const double sum = ExponentiateAll(logits, max_logit, 1.0f, weights_.data());
  SelectLargest(logits, params_.logprobs, &top_raw_);
  return max_logit + std::log(sum);
}

void Sampler::ApplyPenalties(std::span<float> logits, std::span<const int32_t> prompt,
                             std::span<const int32_t> output) {
  penalized_.clear();
  const bool repetition = params_.repetition_penalty != 1.0f;
  if (!repetition && params_.frequency_penalty == 0.0f && params_.presence_penalty == 0.0f) {
    return;
  }
  if (occurrences_.size() < logits.size()) occurrences_.resize(logits.size(), 0);

  // Collect each distinct token once: repetition divides a logit once however often it repeats.
  auto collect = [&](int32_t token) {
    if (occurrences_[token] != 0) return;
    occurrences_[token] = 1;
    penalized_.push_back({logits[token], token});
  };
  if (repetition) {
    for (int32_t token : prompt) {
      if (InVocab(token, logits.size())) collect(token);
    }
  }
  for (int32_t token : output) {
    if (!InVocab(token, logits.size())) continue;
    collect(token);
    ++occurrences_[token];
  }

  for (const ScoredToken& raw : penalized_) {
    float& logit = logits[raw.token];
    if (repetition) {
      logit = logit > 0.0f ? logit / params_.repetition_penalty
                           : logit * params_.repetition_penalty;
    }
    const int32_t output_count = occurrences_[raw.token] - 1;
    if (output_count > 0) {
      logit -= params_.frequency_penalty * static_cast<float>(output_count) +
               params_.presence_penalty;
    }
    occurrences_[raw.token] = 0;  // leave the scratch zeroed for the next call
  }
}

int32_t Sampler::Draw(std::span<const float> logits) {
  const double kept_weight = KeepCandidates(logits);
  // Everything is masked: there is nothing to draw from, so answer as greedy would.
  if (kept_weight <= 0.0) return Argmax(logits);
  // Inverse CDF over the kept tokens in ascending id order: the first token whose cumulative
  // weight exceeds the threshold. The canonical order makes the token a function of the uniform
  // draw alone, so the CUDA sampler (kernels/sampling.cu) picks the same token from the same draw.
  const double threshold = UniformUnit(rng_) * kept_weight;
  double cumulative = 0.0;
  int32_t chosen = -1;
  for (int32_t token : order_) {
    if (!Eligible(token)) continue;
    chosen = token;
    cumulative += weights_[token];
    if (threshold < cumulative) break;
  }
  return chosen;
}

double Sampler::KeepCandidates(std::span<const float> logits) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  if (max_logit == kNegativeInfinity) return 0.0;

  // The one softmax pass. The top token's weight is exactly 1, so min-p's threshold is min_p.
  const double all_weight =
      ExponentiateAll(logits, max_logit, params_.temperature, weights_.data());
  double total_weight = 0.0;
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < logits.size()) {
    SelectLargest(logits, params_.top_k, &top_k_);
    order_.clear();
    for (const ScoredToken& top : top_k_) {
      order_.push_back(top.token);
      total_weight += weights_[top.token];
    }
  } else {
    order_.resize(logits.size());
    std::iota(order_.begin(), order_.end(), 0);
    total_weight = all_weight;
  }
  if (params_.top_p < 1.0f) KeepNucleus(params_.top_p * total_weight);
  // Top-k leaves order_ best-first and top-p partitioned; the draw below walks ascending ids.
  if (order_.size() < logits.size() || params_.top_p < 1.0f) SortByTokenId();

  double kept_weight = 0.0;
  for (int32_t token : order_) {
    if (Eligible(token)) kept_weight += weights_[token];
  }
  return kept_weight;
}

// Bucketing the weights by binary exponent settles all but one bucket in a single pass, and halving
// that bucket with nth_element finds the boundary in O(n); sorting a 128K vocab to walk it would
// cost O(n log n) per token.
void Sampler::KeepNucleus(double nucleus_weight) {
  // Weights lie in [0, 1], so their exponent bits lie in [0, 127]; 0 holds zeros and denormals.
  constexpr int kExponentOfOne = 127;
  auto exponent_of = [&](int32_t token) {
    return static_cast<int>(std::bit_cast<uint32_t>(weights_[token]) >> 23);
  };
  double bucket_weight[kExponentOfOne + 1] = {};
  for (int32_t token : order_) bucket_weight[exponent_of(token)] += weights_[token];
  double heavier_weight = 0.0;
  int boundary = kExponentOfOne;
  while (boundary > 0 && heavier_weight + bucket_weight[boundary] < nucleus_weight) {
    heavier_weight += bucket_weight[boundary--];
  }
  // Heavier buckets are all in, lighter ones all out: only the boundary bucket needs ordering.
  const auto boundary_begin = std::partition(
      order_.begin(), order_.end(), [&](int32_t token) { return exponent_of(token) > boundary; });
  const auto boundary_end = std::partition(
      boundary_begin, order_.end(), [&](int32_t token) { return exponent_of(token) == boundary; });

  auto heavier = [&](int32_t a, int32_t b) {
    return weights_[a] > weights_[b] || (weights_[a] == weights_[b] && a < b);
  };
  // Invariant: order_[0, begin) outweighs every token in order_[begin, end), carries
  // heavier_weight < nucleus_weight, and the nucleus ends inside (begin, end].
  size_t begin = boundary_begin - order_.begin();
  size_t end = boundary_end - order_.begin();
  while (end - begin > kNucleusSortedTail) {
    const size_t middle = begin + (end - begin) / 2;
    std::nth_element(order_.begin() + begin, order_.begin() + middle, order_.begin() + end,
                     heavier);
    double upper_weight = 0.0;
    for (size_t i = begin; i < middle; ++i) upper_weight += weights_[order_[i]];
    if (heavier_weight + upper_weight >= nucleus_weight) {
      end = middle;
    } else {
      heavier_weight += upper_weight;
      begin = middle;
    }
  }
  std::sort(order_.begin() + begin, order_.begin() + end, heavier);
  size_t kept = begin;
  while (kept < end && heavier_weight < nucleus_weight) heavier_weight += weights_[order_[kept++]];
  order_.resize(kept);
}

// A bit per token, then the set bits in order: O(kept + vocab / 64), where sorting a nucleus of
// 100K tokens would cost milliseconds.
void Sampler::SortByTokenId() {
  for (int32_t token : order_) kept_bits_[token >> 6] |= uint64_t{1} << (token & 63);
  size_t kept = 0;
  for (size_t word = 0; word < kept_bits_.size(); ++word) {
    uint64_t bits = kept_bits_[word];
    if (bits == 0) continue;
    kept_bits_[word] = 0;  // leave the scratch zeroed for the next call
    do {
      order_[kept++] = static_cast<int32_t>(word * 64 + std::countr_zero(bits));
      bits &= bits - 1;
    } while (bits != 0);
  }
}

float Sampler::RawLogit(std::span<const float> logits, int32_t token) const {
  for (const TokenLogit& raw : biased_) {
    if (raw.token == token) return raw.logit;  // the logit before its bias
  }
  for (const ScoredToken& raw : penalized_) {
    if (raw.token == token) return raw.logit;
  }
  return logits[token];
}

}  // namespace kvflow
