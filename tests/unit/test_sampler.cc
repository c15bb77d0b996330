#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvflow/sampling.h"
#include "sampling/sampler.h"

namespace kvflow {
namespace {

// Uniform logits in [-spread, spread] from a fixed seed, generated portably so that every
// platform tests the same distribution.
std::vector<float> RandomLogits(size_t vocab_size, uint64_t seed, double spread) {
  std::mt19937_64 rng(seed);
  std::vector<float> logits(vocab_size);
  for (float& logit : logits) {
    const double unit = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    logit = static_cast<float>(spread * (2.0 * unit - 1.0));
  }
  return logits;
}

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> probs(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    probs[i] = std::exp((logits[i] - max_logit) / temperature);
    sum += probs[i];
  }
  for (double& p : probs) p /= sum;
  return probs;
}

std::vector<double> LogSoftmax(const std::vector<float>& logits) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(logit - max_logit);
  const double log_normalizer = max_logit + std::log(sum);
  std::vector<double> logprobs(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) logprobs[i] = logits[i] - log_normalizer;
  return logprobs;
}

// Ids by descending probability, ties toward the lower id.
std::vector<int32_t> ByDescendingProbability(const std::vector<double>& probs) {
  std::vector<int32_t> ids(probs.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  return ids;
}

// Keeps only `support` and renormalizes.
std::vector<double> Restrict(const std::vector<double>& probs, const std::set<int32_t>& support) {
  std::vector<double> restricted(probs.size(), 0.0);
  double sum = 0.0;
  for (int32_t token : support) sum += probs[token];
  for (int32_t token : support) restricted[token] = probs[token] / sum;
  return restricted;
}

std::vector<int> CountDraws(Sampler& sampler, const std::vector<float>& logits, int draws,
                            std::span<const int32_t> suppress = {}) {
  std::vector<int> counts(logits.size(), 0);
  std::vector<float> scratch;
  for (int i = 0; i < draws; ++i) {
    scratch = logits;  // Sample() overwrites its input
    ++counts[sampler.Sample(scratch, {}, {}, suppress).token];
  }
  return counts;
}

std::set<int32_t> Support(const std::vector<int>& counts) {
  std::set<int32_t> support;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > 0) support.insert(static_cast<int32_t>(i));
  }
  return support;
}

// Pearson's chi-square test at significance 0.001. Bins expected to hold fewer than 5 draws are
// pooled so that the chi-square approximation holds.
void ExpectMatchesDistribution(const std::vector<int>& counts, const std::vector<double>& probs,
                               int draws) {
  double statistic = 0.0;
  int bins = 0;
  double pooled_expected = 0.0;
  int pooled_observed = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double expected = probs[i] * draws;
    if (expected < 5.0) {
      pooled_expected += expected;
      pooled_observed += counts[i];
      continue;
    }
    statistic += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++bins;
  }
  if (pooled_expected > 0.0) {
    statistic += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) /
                 pooled_expected;
    ++bins;
  }
  ASSERT_GE(bins, 2) << "the test distribution is too peaked to test";
  // Wilson-Hilferty approximation of the 0.999 quantile; z(0.999) = 3.0902.
  const double df = bins - 1;
  const double h = 2.0 / (9.0 * df);
  const double critical = df * std::pow(1.0 - h + 3.0902 * std::sqrt(h), 3.0);
  EXPECT_LT(statistic, critical) << "chi-square with " << df << " degrees of freedom";
}

SamplingParams WithTemperature(float temperature) {
  SamplingParams params;
  params.temperature = temperature;
  return params;
}

int32_t Greedy(SamplingParams params, std::vector<float> logits,
               std::vector<int32_t> prompt = {}, std::vector<int32_t> output = {}) {
  params.temperature = 0.0f;
  Sampler sampler(params, 1);
  return sampler.Sample(logits, prompt, output).token;
}

// ---- SamplingParams::Validate ------------------------------------------------------------------

TEST(SamplingParamsTest, DefaultsAreValid) { EXPECT_TRUE(SamplingParams{}.Validate().ok()); }

TEST(SamplingParamsTest, BoundaryValuesAreValid) {
  SamplingParams params;
  params.temperature = 0.0f;
  params.top_k = -1;
  params.top_p = 1.0f;
  params.min_p = 1.0f;
  params.repetition_penalty = 0.01f;
  params.frequency_penalty = -2.0f;
  params.presence_penalty = 2.0f;
  params.max_tokens = 1;
  params.min_tokens = 1;
  params.logprobs = 20;
  params.stop = {"x"};
  EXPECT_TRUE(params.Validate().ok()) << params.Validate().ToString();
  params.top_k = 0;
  params.top_p = 1e-6f;
  params.min_p = 0.0f;
  params.min_tokens = 0;
  params.logprobs = 0;
  EXPECT_TRUE(params.Validate().ok()) << params.Validate().ToString();
}

TEST(SamplingParamsTest, RejectsEachBadFieldNamingIt) {
  struct BadCase {
    std::string field;
    std::function<void(SamplingParams&)> spoil;
  };
  const float nan = std::nanf("");
  const float inf = INFINITY;
  const std::vector<BadCase> cases = {
      {"temperature", [](SamplingParams& p) { p.temperature = -0.1f; }},
      {"temperature", [&](SamplingParams& p) { p.temperature = inf; }},
      {"temperature", [&](SamplingParams& p) { p.temperature = nan; }},
      {"top_k", [](SamplingParams& p) { p.top_k = -2; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 0.0f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 1.01f; }},
      {"top_p", [&](SamplingParams& p) { p.top_p = nan; }},
      {"min_p", [](SamplingParams& p) { p.min_p = -0.01f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.5f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; }},
      {"repetition_penalty", [&](SamplingParams& p) { p.repetition_penalty = inf; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = 2.1f; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = -2.1f; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.1f; }},
      {"presence_penalty", [&](SamplingParams& p) { p.presence_penalty = nan; }},
      {"max_tokens", [](SamplingParams& p) { p.max_tokens = 0; }},
      {"min_tokens", [](SamplingParams& p) { p.min_tokens = -1; }},
      {"min_tokens", [](SamplingParams& p) { p.min_tokens = p.max_tokens + 1; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = -1; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = 21; }},
      {"stop[1]", [](SamplingParams& p) { p.stop = {"ok", ""}; }},
  };
  for (const BadCase& bad : cases) {
    SamplingParams params;
    bad.spoil(params);
    const Status status = params.Validate();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << bad.field;
    EXPECT_NE(status.message().find(bad.field), std::string::npos)
        << "message does not name " << bad.field << ": " << status.message();
  }
}

// ---- Greedy ------------------------------------------------------------------------------------

TEST(SamplerTest, GreedyPicksArgmax) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const std::vector<float> logits = RandomLogits(1000, seed, 5.0);
    const auto argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();
    EXPECT_EQ(Greedy({}, logits), argmax);
  }
}

TEST(SamplerTest, GreedyBreaksTiesTowardLowestId) {
  EXPECT_EQ(Greedy({}, {0.5f, 2.0f, -1.0f, 2.0f, 2.0f}), 1);
}

TEST(SamplerTest, GreedyIgnoresTruncation) {
  SamplingParams params;
  params.top_k = 1;
  params.top_p = 0.1f;
  params.min_p = 0.9f;
  const std::vector<float> logits = RandomLogits(100, 3, 2.0);
  EXPECT_EQ(Greedy(params, logits), std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// ---- Distributions -----------------------------------------------------------------------------

TEST(SamplerTest, FrequenciesMatchSoftmaxOfLogitsOverTemperature) {
  constexpr int kDraws = 20000;
  for (float temperature : {0.5f, 1.0f, 1.7f}) {
    SCOPED_TRACE(temperature);
    const std::vector<float> logits = RandomLogits(24, 11, 2.0);
    Sampler sampler(WithTemperature(temperature), 42);
    ExpectMatchesDistribution(CountDraws(sampler, logits, kDraws), Softmax(logits, temperature),
                              kDraws);
  }
}

TEST(SamplerTest, TopKOnlyYieldsTheKLargest) {
  constexpr int kDraws = 20000;
  constexpr int kTopK = 5;
  const std::vector<float> logits = RandomLogits(50, 5, 2.0);
  const std::vector<double> probs = Softmax(logits, 0.8);
  const std::vector<int32_t> ranked = ByDescendingProbability(probs);
  const std::set<int32_t> largest(ranked.begin(), ranked.begin() + kTopK);

  SamplingParams params = WithTemperature(0.8f);
  params.top_k = kTopK;
  Sampler sampler(params, 7);
  const std::vector<int> counts = CountDraws(sampler, logits, kDraws);
  EXPECT_EQ(Support(counts), largest);
  ExpectMatchesDistribution(counts, Restrict(probs, largest), kDraws);
}

TEST(SamplerTest, TopKAtLeastTheVocabOrNonPositiveIsDisabled) {
  const std::vector<float> logits = RandomLogits(30, 8, 2.0);
  auto draws_with_top_k = [&](int top_k) {
    SamplingParams params;
    params.top_k = top_k;
    Sampler sampler(params, 99);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 500; ++i) {
      std::vector<float> scratch = logits;
      tokens.push_back(sampler.Sample(scratch, {}, {}).token);
    }
    return tokens;
  };
  const std::vector<int32_t> disabled = draws_with_top_k(0);
  EXPECT_EQ(draws_with_top_k(-1), disabled);
  EXPECT_EQ(draws_with_top_k(30), disabled);
  EXPECT_EQ(draws_with_top_k(1000), disabled);
}

// The nucleus computed independently in double precision: the smallest prefix of the ranked
// tokens whose probability reaches top_p.
std::set<int32_t> Nucleus(const std::vector<double>& probs, double top_p) {
  std::set<int32_t> nucleus;
  double cumulative = 0.0;
  for (int32_t token : ByDescendingProbability(probs)) {
    if (probs[token] == 0.0) break;
    nucleus.insert(token);
    cumulative += probs[token];
    EXPECT_GT(std::abs(cumulative - top_p), 1e-4) << "top_p too close to a boundary to test";
    if (cumulative >= top_p) break;
  }
  return nucleus;
}

TEST(SamplerTest, TopPSupportIsTheNucleus) {
  constexpr int kDraws = 20000;
  const std::vector<float> logits = RandomLogits(40, 13, 2.5);
  for (float top_p : {0.3f, 0.75f, 0.95f}) {
    SCOPED_TRACE(top_p);
    const std::vector<double> probs = Softmax(logits, 1.2);
    const std::set<int32_t> nucleus = Nucleus(probs, top_p);
    ASSERT_LT(nucleus.size(), logits.size());
    SamplingParams params = WithTemperature(1.2f);
    params.top_p = top_p;
    Sampler sampler(params, 17);
    const std::vector<int> counts = CountDraws(sampler, logits, kDraws);
    EXPECT_EQ(Support(counts), nucleus);
    ExpectMatchesDistribution(counts, Restrict(probs, nucleus), kDraws);
  }
}

TEST(SamplerTest, TopPAlwaysKeepsTheTopToken) {
  const std::vector<float> logits = RandomLogits(64, 21, 1.0);
  SamplingParams params;
  params.top_p = 1e-6f;
  Sampler sampler(params, 5);
  const std::vector<int> counts = CountDraws(sampler, logits, 200);
  const int32_t argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();
  EXPECT_EQ(Support(counts), std::set<int32_t>{argmax});
}

TEST(SamplerTest, TopPIsTakenOverTheTopKRenormalized) {
  constexpr int kDraws = 20000;
  constexpr int kTopK = 8;
  constexpr float kTopP = 0.6f;
  const std::vector<float> logits = RandomLogits(100, 31, 3.0);
  const std::vector<double> probs = Softmax(logits, 1.0);
  const std::vector<int32_t> ranked = ByDescendingProbability(probs);
  const std::vector<double> top_k_probs =
      Restrict(probs, std::set<int32_t>(ranked.begin(), ranked.begin() + kTopK));
  const std::set<int32_t> nucleus = Nucleus(top_k_probs, kTopP);
  // Without renormalization the nucleus would be the whole top-k; make sure the test tells apart.
  ASSERT_LT(nucleus.size(), static_cast<size_t>(kTopK));
  ASSERT_NE(nucleus, Nucleus(probs, kTopP));

  SamplingParams params;
  params.top_k = kTopK;
  params.top_p = kTopP;
  Sampler sampler(params, 23);
  const std::vector<int> counts = CountDraws(sampler, logits, kDraws);
  EXPECT_EQ(Support(counts), nucleus);
  ExpectMatchesDistribution(counts, Restrict(probs, nucleus), kDraws);
}

TEST(SamplerTest, MinPDropsTokensBelowAFractionOfTheTopProbability) {
  constexpr int kDraws = 20000;
  constexpr float kMinP = 0.2f;
  const std::vector<float> logits = RandomLogits(40, 41, 2.5);
  const std::vector<double> probs = Softmax(logits, 0.9);
  const double max_prob = *std::max_element(probs.begin(), probs.end());
  std::set<int32_t> kept;
  for (size_t i = 0; i < probs.size(); ++i) {
    ASSERT_GT(std::abs(probs[i] / max_prob - kMinP), 1e-4) << "too close to the cut to test";
    if (probs[i] >= kMinP * max_prob) kept.insert(static_cast<int32_t>(i));
  }
  ASSERT_GT(kept.size(), 1u);
  ASSERT_LT(kept.size(), logits.size());

  SamplingParams params = WithTemperature(0.9f);
  params.min_p = kMinP;
  Sampler sampler(params, 29);
  const std::vector<int> counts = CountDraws(sampler, logits, kDraws);
  EXPECT_EQ(Support(counts), kept);
  ExpectMatchesDistribution(counts, Restrict(probs, kept), kDraws);
}

// A 128K vocab exercises the incremental sort of top-p over a nucleus of thousands of tokens.
TEST(SamplerTest, LargeVocabTopKAndTopPStayInsideTheirSets) {
  constexpr size_t kVocab = 128 * 1024;
  const std::vector<float> logits = RandomLogits(kVocab, 51, 8.0);
  const std::vector<double> probs = Softmax(logits, 1.0);
  const std::vector<int32_t> ranked = ByDescendingProbability(probs);
  std::vector<size_t> rank_of(kVocab);
  for (size_t r = 0; r < kVocab; ++r) rank_of[ranked[r]] = r;

  SamplingParams top_k_params;
  top_k_params.top_k = 10;
  Sampler top_k_sampler(top_k_params, 61);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> scratch = logits;
    EXPECT_LT(rank_of[top_k_sampler.Sample(scratch, {}, {}).token], 10u);
  }

  constexpr double kTopP = 0.9;
  size_t nucleus_size = 0;
  for (double cumulative = 0.0; cumulative < kTopP; ++nucleus_size) {
    cumulative += probs[ranked[nucleus_size]];
  }
  ASSERT_GT(nucleus_size, 1000u);
  SamplingParams top_p_params;
  top_p_params.top_p = static_cast<float>(kTopP);
  Sampler top_p_sampler(top_p_params, 67);
  // One token of slack: float and double may disagree on the token right at the boundary.
  for (int i = 0; i < 200; ++i) {
    std::vector<float> scratch = logits;
    EXPECT_LE(rank_of[top_p_sampler.Sample(scratch, {}, {}).token], nucleus_size);
  }
}

// ---- Seeds -------------------------------------------------------------------------------------

std::vector<int32_t> DrawSequence(uint64_t seed, const std::vector<float>& logits) {
  SamplingParams params;
  params.top_k = 20;
  params.top_p = 0.95f;
  Sampler sampler(params, seed);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 300; ++i) {
    std::vector<float> scratch = logits;
    tokens.push_back(sampler.Sample(scratch, {}, tokens).token);
  }
  return tokens;
}

TEST(SamplerTest, SameSeedGivesTheSameSequence) {
  const std::vector<float> logits = RandomLogits(32, 71, 1.0);
  EXPECT_EQ(DrawSequence(1234, logits), DrawSequence(1234, logits));
}

TEST(SamplerTest, DifferentSeedsGiveDifferentSequences) {
  const std::vector<float> logits = RandomLogits(32, 71, 1.0);
  EXPECT_NE(DrawSequence(1234, logits), DrawSequence(1235, logits));
}

// ---- Penalties ---------------------------------------------------------------------------------
// Token 3 competes with token 5 (all others far below); whether greedy flips from one to the other
// at a threshold 0.01 either side of the predicted penalized logit pins the penalty's exact size.

std::vector<float> Duel(float token3, float token5) {
  std::vector<float> logits(8, -10.0f);
  logits[3] = token3;
  logits[5] = token5;
  return logits;
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveLogits) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;  // token 3: 2.0 -> 1.0
  EXPECT_EQ(Greedy(params, Duel(2.0f, 0.99f), {3}), 3);
  EXPECT_EQ(Greedy(params, Duel(2.0f, 1.01f), {3}), 5);
  EXPECT_EQ(Greedy(params, Duel(2.0f, 1.01f), {}, {3}), 5);  // output counts as well as prompt
  EXPECT_EQ(Greedy(params, Duel(2.0f, 1.01f)), 3);           // unseen tokens are untouched
}

TEST(SamplerTest, RepetitionPenaltyMultipliesNegativeLogits) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;  // token 3: -1.0 -> -2.0
  EXPECT_EQ(Greedy(params, Duel(-1.0f, -2.01f), {3}), 3);
  EXPECT_EQ(Greedy(params, Duel(-1.0f, -1.99f), {3}), 5);
}

TEST(SamplerTest, RepetitionPenaltyBelowOneBoostsSeenTokens) {
  SamplingParams params;
  params.repetition_penalty = 0.5f;  // token 3: 1.0 -> 2.0
  EXPECT_EQ(Greedy(params, Duel(1.0f, 1.99f), {}, {3}), 3);
  EXPECT_EQ(Greedy(params, Duel(1.0f, 2.01f), {}, {3}), 5);
}

TEST(SamplerTest, RepetitionPenaltyAppliesOncePerDistinctToken) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;  // token 3: 4.0 -> 2.0, not 4.0 / 2^5
  EXPECT_EQ(Greedy(params, Duel(4.0f, 1.99f), {3, 3, 3}, {3, 3}), 3);
  EXPECT_EQ(Greedy(params, Duel(4.0f, 2.01f), {3, 3, 3}, {3, 3}), 5);
}

TEST(SamplerTest, FrequencyAndPresencePenaltiesUseOutputCounts) {
  SamplingParams params;
  params.frequency_penalty = 0.5f;
  params.presence_penalty = 0.25f;
  const std::vector<int32_t> output = {3, 1, 3, 3};  // token 3: 3.0 - 0.5 * 3 - 0.25 = 1.25
  EXPECT_EQ(Greedy(params, Duel(3.0f, 1.24f), {}, output), 3);
  EXPECT_EQ(Greedy(params, Duel(3.0f, 1.26f), {}, output), 5);
  // The prompt does not count for these two.
  EXPECT_EQ(Greedy(params, Duel(3.0f, 2.99f), {3, 3, 3, 3}), 3);
}

TEST(SamplerTest, NegativeFrequencyAndPresencePenaltiesBoost) {
  SamplingParams params;
  params.frequency_penalty = -1.0f;
  params.presence_penalty = -0.5f;  // token 3: 1.0 + 1.0 * 2 + 0.5 = 3.5
  EXPECT_EQ(Greedy(params, Duel(1.0f, 3.49f), {}, {3, 3}), 3);
  EXPECT_EQ(Greedy(params, Duel(1.0f, 3.51f), {}, {3, 3}), 5);
}

TEST(SamplerTest, RepetitionPenaltyComesBeforeFrequencyAndPresence) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 1.0f;
  params.presence_penalty = 0.5f;  // token 3: 6.0 / 2 - 1.0 * 2 - 0.5 = 0.5, not (6 - 2.5) / 2
  EXPECT_EQ(Greedy(params, Duel(6.0f, 0.49f), {}, {3, 3}), 3);
  EXPECT_EQ(Greedy(params, Duel(6.0f, 0.51f), {}, {3, 3}), 5);
}

TEST(SamplerTest, PenaltiesIgnoreTokensOutsideTheVocab) {
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 1.0f;
  EXPECT_EQ(Greedy(params, Duel(2.0f, 1.01f), {-1, 8, 1 << 30}, {100, 3}), 5);
}

// ---- Logprobs ----------------------------------------------------------------------------------

TEST(SamplerTest, LogprobsAreTheRawLogSoftmaxWithSortedTopN) {
  constexpr int kTopN = 20;
  const std::vector<float> logits = RandomLogits(5000, 81, 6.0);
  const std::vector<double> expected = LogSoftmax(logits);
  const std::vector<int32_t> ranked = ByDescendingProbability(Softmax(logits, 1.0));

  // Everything that changes the sampling logits is on, so a logprob taken after it would differ.
  SamplingParams params = WithTemperature(0.7f);
  params.top_k = 50;
  params.repetition_penalty = 1.02f;
  params.frequency_penalty = 0.02f;
  params.presence_penalty = 0.02f;
  params.logprobs = kTopN;
  const std::vector<int32_t> prompt(ranked.begin(), ranked.begin() + 10);
  const std::vector<int32_t> suppress = {ranked[0]};
  Sampler sampler(params, 91);
  std::vector<int32_t> output;
  int penalized_choices = 0;
  for (int step = 0; step < 100; ++step) {
    std::vector<float> scratch = logits;
    const SampledToken sampled = sampler.Sample(scratch, prompt, output, suppress);
    penalized_choices += std::count(prompt.begin(), prompt.end(), sampled.token) > 0 ||
                         std::count(output.begin(), output.end(), sampled.token) > 0;
    EXPECT_NEAR(sampled.logprob, expected[sampled.token], 1e-5);
    ASSERT_EQ(sampled.top_logprobs.size(), static_cast<size_t>(kTopN));
    for (int i = 0; i < kTopN; ++i) {
      EXPECT_EQ(sampled.top_logprobs[i].token, ranked[i]);  // suppressed ranked[0] included
      EXPECT_NEAR(sampled.top_logprobs[i].logprob, expected[ranked[i]], 1e-5);
    }
    output.push_back(sampled.token);
  }
  // Make sure the raw logprob was also reported for tokens whose logits the penalties changed.
  EXPECT_GT(penalized_choices, 10);
}

TEST(SamplerTest, GreedyLogprobOfAPenalizedTokenIsRaw) {
  SamplingParams params = WithTemperature(0.0f);
  params.repetition_penalty = 1.5f;
  params.logprobs = 2;
  std::vector<float> logits = Duel(4.0f, 1.0f);
  const std::vector<double> expected = LogSoftmax(logits);
  Sampler sampler(params, 1);
  const std::vector<int32_t> output = {3};
  const SampledToken sampled = sampler.Sample(logits, {}, output);
  EXPECT_EQ(sampled.token, 3);
  EXPECT_NEAR(sampled.logprob, expected[3], 1e-5);
  ASSERT_EQ(sampled.top_logprobs.size(), 2u);
  EXPECT_EQ(sampled.top_logprobs[0].token, 3);
  EXPECT_EQ(sampled.top_logprobs[1].token, 5);
}

TEST(SamplerTest, ZeroLogprobsReturnsOnlyTheChosenToken) {
  std::vector<float> logits = RandomLogits(100, 3, 2.0);
  const std::vector<double> expected = LogSoftmax(logits);
  Sampler sampler(SamplingParams{}, 3);
  const SampledToken sampled = sampler.Sample(logits, {}, {});
  EXPECT_TRUE(sampled.top_logprobs.empty());
  EXPECT_NEAR(sampled.logprob, expected[sampled.token], 1e-5);
}

TEST(SamplerTest, TopLogprobsBreakTiesTowardLowestId) {
  SamplingParams params;
  params.logprobs = 3;
  std::vector<float> logits = {1.0f, 2.0f, 0.0f, 2.0f, 2.0f, 2.0f};
  Sampler sampler(params, 3);
  const SampledToken sampled = sampler.Sample(logits, {}, {});
  ASSERT_EQ(sampled.top_logprobs.size(), 3u);
  EXPECT_EQ(sampled.top_logprobs[0].token, 1);
  EXPECT_EQ(sampled.top_logprobs[1].token, 3);
  EXPECT_EQ(sampled.top_logprobs[2].token, 4);
}

// ---- Suppression -------------------------------------------------------------------------------

TEST(SamplerTest, SuppressedTokensAreNeverSampled) {
  const std::vector<float> logits = RandomLogits(20, 101, 2.0);
  const std::vector<double> probs = Softmax(logits, 1.0);
  const std::vector<int32_t> ranked = ByDescendingProbability(probs);
  // The two likeliest tokens, plus ids outside the vocab that must be ignored.
  const std::vector<int32_t> suppress = {ranked[0], ranked[1], -5, 20};
  std::set<int32_t> allowed(ranked.begin() + 2, ranked.end());

  Sampler sampler(SamplingParams{}, 103);
  const std::vector<int> counts = CountDraws(sampler, logits, 20000, suppress);
  EXPECT_EQ(counts[ranked[0]], 0);
  EXPECT_EQ(counts[ranked[1]], 0);
  ExpectMatchesDistribution(counts, Restrict(probs, allowed), 20000);

  std::vector<float> scratch = logits;
  Sampler greedy(WithTemperature(0.0f), 1);
  EXPECT_EQ(greedy.Sample(scratch, {}, {}, suppress).token, ranked[2]);
}

// Distribution() is what Sample() draws from: for random rows under temperature, top-k, top-p,
// min-p, penalties and suppression, its probabilities sum to 1, a token Sample can never produce
// has probability 0, the sampled frequencies over 40000 draws are within total variation 0.02 of
// it, DrawFrom() draws from it alike, and Report() gives Sample's logprobs for a token.
TEST(Sampler, DistributionIsWhatSampleDrawsFrom) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 12;
  p.top_p = 0.9f;
  p.min_p = 0.02f;
  p.repetition_penalty = 1.3f;
  p.logprobs = 3;
  const std::vector<int32_t> prompt = {1, 2, 3};
  const std::vector<int32_t> output = {4, 4};
  const std::vector<int32_t> suppress = {5};
  for (uint64_t seed : {1u, 2u, 3u}) {
    const std::vector<float> logits = RandomLogits(64, seed, 3.0);
    Sampler sampler(p, seed);
    std::vector<float> scratch = logits;
    std::vector<float> probs;
    sampler.Distribution(scratch, prompt, output, suppress, probs);
    ASSERT_EQ(probs.size(), logits.size());
    EXPECT_NEAR(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0, 1e-5);
    EXPECT_EQ(probs[5], 0.0f) << "suppressed";
    EXPECT_LE(std::count_if(probs.begin(), probs.end(), [](float x) { return x > 0.0f; }), 12) << "top-k";

    const int kDraws = 40000;
    std::vector<double> sampled(logits.size()), drawn(logits.size());
    Sampler drawer(p, seed + 100);
    for (int i = 0; i < kDraws; ++i) {
      std::vector<float> row = logits;
      const SampledToken t = sampler.Sample(row, prompt, output, suppress);
      ASSERT_GT(probs[static_cast<size_t>(t.token)], 0.0f) << "Sample drew a token outside Distribution";
      sampled[static_cast<size_t>(t.token)] += 1.0 / kDraws;
      drawn[static_cast<size_t>(drawer.DrawFrom(probs))] += 1.0 / kDraws;
    }
    double tv_sampled = 0.0, tv_drawn = 0.0;
    for (size_t i = 0; i < probs.size(); ++i) {
      tv_sampled += 0.5 * std::fabs(sampled[i] - probs[i]);
      tv_drawn += 0.5 * std::fabs(drawn[i] - probs[i]);
    }
    EXPECT_LT(tv_sampled, 0.02) << "seed " << seed;
    EXPECT_LT(tv_drawn, 0.02) << "seed " << seed;

    // Report after Distribution equals what Sample reports for the same token.
    std::vector<float> a = logits, b = logits;
    Sampler reporter(p, seed), plain(p, seed);
    const SampledToken want = plain.Sample(a, prompt, output, suppress);
    reporter.Distribution(b, prompt, output, suppress, probs);
    const SampledToken got = reporter.Report(b, want.token);
    EXPECT_EQ(got.token, want.token);
    EXPECT_FLOAT_EQ(got.logprob, want.logprob);
    ASSERT_EQ(got.top_logprobs.size(), want.top_logprobs.size());
    for (size_t i = 0; i < got.top_logprobs.size(); ++i) {
      EXPECT_EQ(got.top_logprobs[i].token, want.top_logprobs[i].token);
      EXPECT_FLOAT_EQ(got.top_logprobs[i].logprob, want.top_logprobs[i].logprob);
    }
  }
  // Greedy: one-hot at the argmax.
  Sampler greedy(SamplingParams{.temperature = 0.0f}, 7);
  std::vector<float> row = RandomLogits(64, 9, 3.0);
  const auto best = std::max_element(row.begin(), row.end()) - row.begin();
  std::vector<float> probs;
  greedy.Distribution(row, {}, {}, {}, probs);
  EXPECT_EQ(probs[static_cast<size_t>(best)], 1.0f);
  EXPECT_EQ(std::accumulate(probs.begin(), probs.end(), 0.0), 1.0);
}

}  // namespace
}  // namespace kvflow

namespace kvflow {
namespace {

// The logits-processor seam's constraint on the CPU: bans and an allowed-token mask make tokens
// impossible, biases shift the sampled distribution to exactly softmax(logits + bias), and the
// logprobs reported stay those of the raw logits.
TEST(TokenConstraint, MaskBansAndBiasesApplyToARow) {
  const std::vector<float> logits = RandomLogits(70, 11, 2.0);
  TokenConstraint c;
  EXPECT_TRUE(c.empty());
  std::vector<uint32_t> mask(3, 0);  // 70 tokens: 3 words; allow 0..39 and 64..69
  mask[0] = 0xffffffffu;
  mask[1] = 0xffu;
  mask[2] = 0x3fu;
  c.AllowOnly(mask);
  c.Ban(3);
  c.AddBias(7, 2.5f);
  c.AddBias(7, 0.5f);  // biases of one token add up
  c.AddBias(66, -1.0f);
  EXPECT_FALSE(c.empty());
  EXPECT_TRUE(c.Allows(0));
  EXPECT_FALSE(c.Allows(3)) << "banned";
  EXPECT_FALSE(c.Allows(45)) << "outside the mask";
  EXPECT_TRUE(c.Allows(66));
  EXPECT_FALSE(c.Allows(70)) << "past the mask";
  std::vector<float> row = logits;
  std::vector<TokenLogit> raw;
  c.ApplyTo(row, &raw);
  for (int t = 0; t < 70; ++t) {
    if (!c.Allows(t)) {
      EXPECT_EQ(row[t], -std::numeric_limits<float>::infinity()) << t;
    } else if (t == 7) {
      EXPECT_FLOAT_EQ(row[t], logits[t] + 3.0f);
    } else if (t == 66) {
      EXPECT_FLOAT_EQ(row[t], logits[t] - 1.0f);
    } else {
      EXPECT_EQ(row[t], logits[t]) << t;
    }
  }
  ASSERT_EQ(raw.size(), 2u);
  EXPECT_EQ(raw[0].token, 7);
  EXPECT_EQ(raw[0].logit, logits[7]);
  // A second mask intersects the first.
  std::vector<uint32_t> odd(3, 0xaaaaaaaau);
  c.AllowOnly(odd);
  EXPECT_FALSE(c.Allows(0));
  EXPECT_TRUE(c.Allows(1));
}

TEST(TokenConstraint, BiasedSamplingFollowsTheBiasedSoftmaxAndReportsRawLogprobs) {
  SamplingParams p;
  p.temperature = 0.9f;
  p.logprobs = 2;
  const std::vector<float> logits = RandomLogits(40, 21, 2.0);
  TokenConstraint c;
  c.AddBias(5, 3.0f);
  c.AddBias(9, -100.0f);
  c.Ban(1);
  std::vector<float> biased = logits;
  biased[5] += 3.0f;
  biased[9] -= 100.0f;
  biased[1] = -std::numeric_limits<float>::infinity();
  const std::vector<double> want = Softmax(biased, 0.9);
  Sampler sampler(p, 3);
  std::vector<float> scratch = logits;
  std::vector<float> probs;
  sampler.Distribution(scratch, {}, {}, &c, probs);
  for (size_t t = 0; t < want.size(); ++t) EXPECT_NEAR(probs[t], want[t], 1e-6) << t;
  EXPECT_EQ(probs[1], 0.0f);
  const std::vector<double> raw_logprobs = LogSoftmax(logits);
  std::vector<int> counts(logits.size(), 0);
  const int kDraws = 30000;
  bool saw_biased = false;
  for (int i = 0; i < kDraws; ++i) {
    std::vector<float> row = logits;
    const SampledToken t = sampler.Sample(row, {}, {}, &c);
    ++counts[static_cast<size_t>(t.token)];
    if (t.token == 5 && !saw_biased) {
      saw_biased = true;
      EXPECT_NEAR(t.logprob, raw_logprobs[5], 1e-5) << "the biased token's logprob is its raw one";
    }
  }
  EXPECT_TRUE(saw_biased);
  EXPECT_EQ(counts[1], 0);
  double tv = 0.0;
  for (size_t t = 0; t < want.size(); ++t) tv += 0.5 * std::fabs(counts[t] / double(kDraws) - want[t]);
  EXPECT_LT(tv, 0.02);
}

}  // namespace
}  // namespace kvflow
