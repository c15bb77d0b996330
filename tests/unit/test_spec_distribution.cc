// The statistics behind the speculative distribution tests (spec_distribution.h), checked against
// SciPy's values, for their false-alarm rate and power on draws from known distributions, and
// rejection sampling's acceptance rule with the two known wrong resampling rules installed.
#include <gtest/gtest.h>

#include <random>

#include "sampling/rejection_sampler.h"
#include "spec_distribution.h"

namespace kvflow {
namespace {

using test::ChiSquareSurvival;
using test::HeterogeneousMultinomialTest;
using test::PearsonChiSquare;

TEST(SpecDistributionStats, ChiSquareSurvivalMatchesScipy) {
  // scipy.stats.chi2.sf(x, df), SciPy 1.14.
  struct Case {
    double x;
    int df;
    double sf;
  } cases[] = {{3.841458820694124, 1, 0.04999999999999989}, {5.0, 2, 0.0820849986238988},
               {7.814727903251178, 3, 0.05},                {16.26623619623813, 3, 0.0010000000000000007},
               {0.5, 3, 0.9188914116546758},                {20.0, 5, 0.0012497305630313773},
               {30.0, 1, 4.3204630578274955e-08},           {2.0, 7, 0.9598403687301016}};
  for (const Case& c : cases) {
    EXPECT_NEAR(ChiSquareSurvival(c.x, c.df) / c.sf, 1.0, 1e-9) << "x " << c.x << " df " << c.df;
  }
  EXPECT_EQ(ChiSquareSurvival(0.0, 3), 1.0);
  EXPECT_EQ(ChiSquareSurvival(std::numeric_limits<double>::infinity(), 3), 0.0);
}

std::vector<int64_t> Multinomial(std::mt19937_64& rng, const std::vector<double>& p, int n) {
  std::discrete_distribution<int> draw(p.begin(), p.end());
  std::vector<int64_t> counts(p.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[size_t(draw(rng))];
  return counts;
}

// Under the null hypothesis the tests reject at about their nominal rate; a total-variation shift
// of 0.05 among four outcomes is found nearly always at 2000 draws and alpha = 1e-3 / 20.
TEST(SpecDistributionStats, PearsonFalseAlarmRateAndPower) {
  std::mt19937_64 rng(7);
  const std::vector<double> p = {0.4, 0.3, 0.2, 0.1};
  std::vector<double> biased = p;
  biased[0] -= 0.05;
  biased[2] += 0.05;
  const int kTrials = 2000;
  int false_alarms = 0, found = 0;
  for (int t = 0; t < kTrials; ++t) {
    false_alarms += PearsonChiSquare(Multinomial(rng, p, 300), p).p_value < 0.05;
    found += PearsonChiSquare(Multinomial(rng, biased, 2000), p).p_value < 1e-3 / 20;
  }
  std::printf("  false alarms at 0.05: %d of %d; bias found at 5e-5: %d of %d\n", false_alarms, kTrials, found, kTrials);
  EXPECT_GT(false_alarms, kTrials * 3 / 100);
  EXPECT_LT(false_alarms, kTrials * 8 / 100);
  EXPECT_GT(found, kTrials * 9 / 10);
  // Sparse cells are pooled; too few draws leave nothing to test.
  EXPECT_EQ(PearsonChiSquare({3, 1, 0, 0}, p).df, 0);
  EXPECT_EQ(PearsonChiSquare({12, 9, 6, 3}, p).df, 2);  // 0.1 * 30 = 3 and 0.2 * 30 = 6: one pooled cell
}

// Draws with a different distribution each (ranks of their own contexts): the quadratic form's
// false-alarm rate is nominal, and a shift of 0.05 of mass from rank 1 to rank 0 is found at
// 3000 draws nearly always (0.03 would need about 8000 for the same power).
TEST(SpecDistributionStats, HeterogeneousFalseAlarmRateAndPower) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int kTrials = 1000, kDraws = 3000;
  int false_alarms = 0, found = 0;
  for (int t = 0; t < kTrials; ++t) {
    std::vector<int64_t> fair(4, 0), shifted(4, 0);
    std::vector<std::vector<double>> probs;
    for (int i = 0; i < kDraws; ++i) {
      std::vector<double> p(4);
      double z = 0.0;
      for (double& x : p) z += (x = std::exp(unit(rng)));
      for (double& x : p) x /= z;
      std::sort(p.begin(), p.end(), std::greater<>());
      probs.push_back(p);
      std::discrete_distribution<int> draw(p.begin(), p.end());
      ++fair[size_t(draw(rng))];
      std::vector<double> q = p;
      q[0] += 0.05;
      q[1] -= 0.05;
      std::discrete_distribution<int> draw_shifted(q.begin(), q.end());
      ++shifted[size_t(draw_shifted(rng))];
    }
    false_alarms += HeterogeneousMultinomialTest(fair, probs).p_value < 0.05;
    found += HeterogeneousMultinomialTest(shifted, probs).p_value < 1e-3 / 20;
  }
  std::printf("  false alarms at 0.05: %d of %d; shift found at 5e-5: %d of %d\n", false_alarms, kTrials, found,
              kTrials);
  EXPECT_GT(false_alarms, kTrials * 2 / 100);
  EXPECT_LT(false_alarms, kTrials * 8 / 100);
  EXPECT_GT(found, kTrials * 9 / 10);
}

std::vector<float> Softmaxed(std::mt19937_64& rng, int V, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> p(static_cast<size_t>(V));
  double z = 0.0;
  for (float& x : p) z += (x = static_cast<float>(std::exp(normal(rng))));
  for (float& x : p) x = static_cast<float>(x / z);
  return p;
}

// VerifyDraft's output follows p under the residual rule and does not under either wrong rule, for a
// sampled drafter and a one-hot one: the chi-square at 1e-4 tells them apart at 20000 trials.
TEST(SpecDistributionStats, RejectionSamplingMutantsAreCaught) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int V = 8, kTrials = 20000;
  const std::vector<float> p = Softmaxed(rng, V, 1.0);
  const std::vector<double> p64(p.begin(), p.end());
  for (const bool one_hot : {false, true}) {
    const std::vector<float> q = one_hot ? std::vector<float>() : Softmaxed(rng, V, 1.0);
    // A one-hot drafter (n-gram lookup) proposes the same token whenever the context is the same:
    // here token 2 every time.
    std::discrete_distribution<int> draft_from = one_hot ? std::discrete_distribution<int>({0, 0, 1})
                                                         : std::discrete_distribution<int>(q.begin(), q.end());
    for (const RejectionRule rule :
         {RejectionRule::kResidual, RejectionRule::kResampleFromVerifier, RejectionRule::kResampleFromDrafter}) {
      testing::ScopedRejectionRule mutant(VerifySite::kTarget, rule);
      std::mt19937_64 draws(5);
      std::vector<int64_t> counts(size_t(V), 0);
      for (int t = 0; t < kTrials; ++t) {
        const int32_t draft = draft_from(draws);
        ++counts[size_t(VerifyDraft(p, q, draft, unit(draws), unit(draws)).token)];
      }
      const double pv = PearsonChiSquare(counts, p64).p_value;
      std::printf("  %s drafter, rule %d: p-value %.3g\n", one_hot ? "one-hot" : "sampled", int(rule), pv);
      if (rule == RejectionRule::kResidual) {
        EXPECT_GT(pv, 1e-4);
      } else {
        EXPECT_LT(pv, 1e-4) << "rule " << int(rule) << (one_hot ? ", one-hot" : ", sampled");
      }
    }
  }
  EXPECT_EQ(ActiveRejectionRule(VerifySite::kTarget), RejectionRule::kResidual) << "the scope restored the rule";
}

}  // namespace
}  // namespace kvflow
