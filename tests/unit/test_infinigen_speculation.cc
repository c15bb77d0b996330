// InfiniGen's speculation rules (src/infinigen/speculation.h): partial columns by |Q~| + |K~| column
// sums, and the token count within alpha of each head's max, averaged over heads and capped, each
// head then taking its own top tokens; random cases against a brute-force sort.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "infinigen/speculation.h"

namespace kvflow {
namespace {

TEST(InfiniGenSpeculation, PartialColumnsKeepTheLargestSums) {
  const std::vector<float> q = {1, 5, 0, 2, 2, 0.5f, 3, 0};
  const std::vector<float> k = {0, 1, 0, 1, 1, 0.5f, 0, 4};
  // sums: 1 6 0 3 3 1 3 4 -> 30% of 8 = 3 columns: 1 (6), 7 (4), then 3 of the three 3s (lowest index).
  EXPECT_EQ(PartialColumns(q, k, 0.3), (std::vector<int32_t>{1, 3, 7}));
  EXPECT_EQ(PartialColumns(q, k, 1.0).size(), 8u);
  EXPECT_EQ(PartialColumns(q, k, 0.01), (std::vector<int32_t>{1})) << "at least one column";
  EXPECT_TRUE(PartialColumns({}, {}, 0.3).empty());
}

TEST(InfiniGenSpeculation, CountWithinAlphaAveragedOverHeadsAndCapped) {
  // Head 0: max 10, alpha 3 -> 10, 9, 8 count (3). Head 1: max 5 -> 5, 4.5 (2) ... average 2.5 -> 3.
  const std::vector<float> s = {10, 1, 9, 8, 0, 2, 3, 7,   //
                                0, 5, 1, 4.5f, -1, 2, 0, 1.5f};
  SpeculatedTokens t = SelectSpeculatedTokens(s, 2, 8, 3.0f, 1.0);
  EXPECT_EQ(t.count, 3);
  EXPECT_EQ(t.per_head[0], (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(t.per_head[1], (std::vector<int32_t>{1, 3, 5}));
  t = SelectSpeculatedTokens(s, 2, 8, 3.0f, 0.25);  // cap: 2 of 8
  EXPECT_EQ(t.count, 2);
  EXPECT_EQ(t.per_head[0], (std::vector<int32_t>{0, 2}));
  t = SelectSpeculatedTokens(s, 2, 8, 0.0f, 0.01);  // nothing strictly within 0 but the rule keeps one
  EXPECT_EQ(t.count, 1);
  EXPECT_TRUE(SelectSpeculatedTokens(s, 3, 8, 3.0f, 1.0).per_head.empty()) << "too few scores: nothing";
}

TEST(InfiniGenSpeculation, RandomCasesMatchABruteForceSort) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int trial = 0; trial < 200; ++trial) {
    const int heads = 1 + static_cast<int>(rng() % 9), tokens = 1 + static_cast<int>(rng() % 300);
    std::vector<float> s(static_cast<size_t>(heads * tokens));
    for (float& x : s) x = std::round(normal(rng) * 4) / 4;  // quarter steps: ties happen
    const float alpha = 0.5f + static_cast<float>(rng() % 8);
    const double frac = 0.05 + 0.05 * static_cast<double>(rng() % 10);
    const SpeculatedTokens t = SelectSpeculatedTokens(s, heads, tokens, alpha, frac);
    double total = 0;
    for (int h = 0; h < heads; ++h) {
      const float mx = *std::max_element(s.begin() + h * tokens, s.begin() + (h + 1) * tokens);
      for (int j = 0; j < tokens; ++j) total += s[static_cast<size_t>(h * tokens + j)] > mx - alpha;
    }
    const int cap = std::max(1, static_cast<int>(std::floor(frac * tokens)));
    ASSERT_EQ(t.count, std::clamp(static_cast<int>(std::lround(total / heads)), 1, cap));
    for (int h = 0; h < heads; ++h) {
      std::vector<int32_t> order(static_cast<size_t>(tokens));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return s[static_cast<size_t>(h * tokens + a)] > s[static_cast<size_t>(h * tokens + b)];
      });
      order.resize(static_cast<size_t>(t.count));
      std::sort(order.begin(), order.end());
      ASSERT_EQ(t.per_head[static_cast<size_t>(h)], order) << "trial " << trial << ", head " << h;
    }
  }
}

}  // namespace
}  // namespace kvflow
