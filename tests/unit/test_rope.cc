#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>

#include "model/rope.h"

namespace kvflow {
namespace {

ModelConfig RopeConfig(int head_dim, float theta) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  c.max_position_embeddings = 4096;
  return c;
}

std::vector<float> RandomVector(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

TEST(Rope, MatchesRotateHalfFormulaInDouble) {
  const int D = 64;
  const auto freqs = ComputeRopeFrequencies(RopeConfig(D, 100000.0f));
  for (int pos : {0, 1, 17, 511, 4000}) {
    auto x = RandomVector(D, static_cast<uint32_t>(pos));
    auto y = x;
    ApplyRope(y.data(), D, pos, freqs);
    for (int i = 0; i < D / 2; ++i) {
      const double inv = 1.0 / std::pow(100000.0, 2.0 * i / D);
      const double a = pos * inv;
      EXPECT_NEAR(y[i], x[i] * std::cos(a) - x[i + D / 2] * std::sin(a), 2e-3 * (1 + pos / 1000.0));
      EXPECT_NEAR(y[i + D / 2], x[i + D / 2] * std::cos(a) + x[i] * std::sin(a), 2e-3 * (1 + pos / 1000.0));
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  const int D = 32;
  const auto freqs = ComputeRopeFrequencies(RopeConfig(D, 10000.0f));
  const auto q = RandomVector(D, 1), k = RandomVector(D, 2);
  auto dot_at = [&](int m, int n) {
    auto a = q, b = k;
    ApplyRope(a.data(), D, m, freqs);
    ApplyRope(b.data(), D, n, freqs);
    double s = 0;
    for (int i = 0; i < D; ++i) s += a[i] * b[i];
    return s;
  };
  EXPECT_NEAR(dot_at(10, 3), dot_at(107, 100), 1e-3);
  EXPECT_NEAR(dot_at(5, 5), dot_at(0, 0), 1e-4);
}

TEST(Rope, LinearScalingDividesFrequencies) {
  ModelConfig c = RopeConfig(16, 10000.0f);
  const auto base = ComputeRopeFrequencies(c);
  c.rope_scaling.type = RopeScaling::Type::kLinear;
  c.rope_scaling.factor = 4.0f;
  const auto scaled = ComputeRopeFrequencies(c);
  for (size_t i = 0; i < base.inv_freq.size(); ++i) EXPECT_FLOAT_EQ(scaled.inv_freq[i] * 4.0f, base.inv_freq[i]);
}

TEST(Rope, Llama3ScalingKeepsHighFrequenciesAndDividesLowOnes) {
  ModelConfig c = RopeConfig(128, 500000.0f);
  const auto base = ComputeRopeFrequencies(c);
  c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 8192};
  const auto scaled = ComputeRopeFrequencies(c);
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < base.inv_freq.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / base.inv_freq[i];
    if (wavelen < 8192 / 4.0) {
      EXPECT_FLOAT_EQ(scaled.inv_freq[i], base.inv_freq[i]);
      ++kept;
    } else if (wavelen > 8192 / 1.0) {
      EXPECT_FLOAT_EQ(scaled.inv_freq[i] * 8.0f, base.inv_freq[i]);
      ++divided;
    } else {
      EXPECT_LT(scaled.inv_freq[i], base.inv_freq[i]);
      EXPECT_GT(scaled.inv_freq[i] * 8.0f, base.inv_freq[i]);
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(Rope, YarnScalesAttentionAndInterpolatesLowFrequencies) {
  ModelConfig c = RopeConfig(64, 10000.0f);
  const auto base = ComputeRopeFrequencies(c);
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 4.0f;
  c.rope_scaling.original_max_position_embeddings = 2048;
  const auto yarn = ComputeRopeFrequencies(c);
  EXPECT_NEAR(yarn.attention_scale, 0.1 * std::log(4.0) + 1.0, 1e-6);
  EXPECT_FLOAT_EQ(yarn.inv_freq.front(), base.inv_freq.front());         // extrapolated
  EXPECT_FLOAT_EQ(yarn.inv_freq.back() * 4.0f, base.inv_freq.back());    // interpolated
}

}  // namespace
}  // namespace kvflow
