// Speculative decoding's parts alone: the n-gram (prompt lookup) drafter, and the acceptance rule,
// whose output must be distributed exactly as the target's for any draft distribution.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "speculative/ngram_drafter.h"
#include "sampling/rejection_sampler.h"

namespace kvflow {
namespace {

TEST(NgramDrafter, ProposesWhatFollowedTheLatestMatchLongestSuffixFirst) {
  NgramDrafter d({.num_speculative_tokens = 3, .ngram_max = 3, .ngram_min = 1});
  // "5 6 7" occurs at 0 and 4: the latest earlier one (4) is followed by 9 1 2.
  EXPECT_EQ(d.Propose(std::vector<int32_t>{5, 6, 7, 8, 5, 6, 7, 9, 1, 2, 3, 5, 6, 7}, 8),
            (std::vector<int32_t>{9, 1, 2}));
  // No 3-gram or 2-gram match; the 1-gram "4" matches at 1.
  EXPECT_EQ(d.Propose(std::vector<int32_t>{1, 4, 2, 3, 0, 4}, 8), (std::vector<int32_t>{2, 3, 0}));
  // Capped by max_tokens and by what follows the match.
  EXPECT_EQ(d.Propose(std::vector<int32_t>{1, 2, 3, 1, 2, 3}, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(d.Propose(std::vector<int32_t>{7, 8, 7}, 8), (std::vector<int32_t>{8, 7}));
  EXPECT_TRUE(d.Propose(std::vector<int32_t>{1, 2, 3, 4}, 8).empty());
  EXPECT_TRUE(d.Propose(std::vector<int32_t>{1}, 8).empty());
  EXPECT_TRUE(d.Propose(std::vector<int32_t>{}, 8).empty());
  NgramDrafter bigrams({.num_speculative_tokens = 2, .ngram_max = 3, .ngram_min = 2});
  EXPECT_TRUE(bigrams.Propose(std::vector<int32_t>{1, 4, 2, 3, 0, 4}, 8).empty()) << "1-grams are below ngram_min";
}

TEST(NgramDrafter, RejectsImpossibleConfigs) {
  EXPECT_FALSE((NgramDrafterConfig{.num_speculative_tokens = 0}).Validate().ok());
  EXPECT_FALSE((NgramDrafterConfig{.num_speculative_tokens = 4, .ngram_max = 1, .ngram_min = 2}).Validate().ok());
  EXPECT_FALSE((NgramDrafterConfig{.num_speculative_tokens = 4, .ngram_max = 3, .ngram_min = 0}).Validate().ok());
  EXPECT_TRUE((NgramDrafterConfig{}).Validate().ok());
}

std::vector<float> RandomDistribution(std::mt19937& rng, int n, double sharpness) {
  std::gamma_distribution<double> g(sharpness, 1.0);
  std::vector<double> w(static_cast<size_t>(n));
  double sum = 0.0;
  for (double& x : w) sum += (x = g(rng));
  std::vector<float> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[size_t(i)] = static_cast<float>(w[size_t(i)] / sum);
  return p;
}

// The output of draft-then-verify follows p for a one-hot drafter and for random drafters (close
// to p, far from it, and zero where p is not): total variation between the empirical distribution
// of 400k trials and p below 0.006 (the sampling noise of 400k draws over 12 outcomes is ~0.003).
TEST(RejectionSampler, OutputIsDistributedAsTheTarget) {
  std::mt19937 rng(7);
  std::mt19937_64 uniforms(11);
  auto unit = [&] { return static_cast<double>(uniforms() >> 11) * 0x1.0p-53; };
  const int V = 12;
  const int kTrials = 400000;
  for (int c = 0; c < 4; ++c) {
    const std::vector<float> p = RandomDistribution(rng, V, 0.7);
    std::vector<float> q;
    if (c == 1) q = RandomDistribution(rng, V, 0.7);
    if (c == 2) {  // close to p
      q = p;
      for (float& x : q) x = 0.8f * x + 0.2f / V;
    }
    if (c == 3) {  // q puts mass where p has none
      q = RandomDistribution(rng, V, 2.0);
    }
    std::vector<float> target = p;
    if (c == 3) {
      target[0] = 0.0f;
      double s = 0.0;
      for (float x : target) s += x;
      for (float& x : target) x = static_cast<float>(x / s);
    }
    std::discrete_distribution<int> draft_from_q(q.empty() ? target.begin() : q.begin(),
                                                 q.empty() ? target.end() : q.end());
    std::vector<int> counts(V, 0);
    int accepted = 0;
    for (int t = 0; t < kTrials; ++t) {
      // A one-hot drafter proposes any fixed token; here a random one each trial.
      const int32_t draft = q.empty() ? static_cast<int32_t>(t % V) : draft_from_q(rng);
      const DraftVerdict v = VerifyDraft(target, q, draft, unit(), unit());
      ++counts[size_t(v.token)];
      accepted += v.accepted;
    }
    double tv = 0.0;
    for (int i = 0; i < V; ++i) tv += 0.5 * std::fabs(double(counts[size_t(i)]) / kTrials - target[size_t(i)]);
    std::printf("  drafter %d: acceptance %.3f, total variation to the target %.4f\n", c,
                double(accepted) / kTrials, tv);
    EXPECT_LT(tv, 0.006) << "drafter " << c;
    EXPECT_EQ(counts[0] > 0, target[0] > 0.0f);
  }
}

}  // namespace
}  // namespace kvflow
