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

// SelectTokensByRows, worked by hand: 2 KV heads of 2 query heads each over 10 tokens.
TEST(InfiniGenSpeculation, QueryHeadsCountOnTheirOwnMaxAndKvHeadsReadTheUnion) {
  // Rows (query heads): 0 and 1 of KV head 0, 2 and 3 of KV head 1.
  const std::vector<float> scores = {
      9, 8, 0, 0, 0, 0, 0, 0, 0, 0,   // head 0: tokens 0, 1 within alpha 2 of its max
      0, 0, 0, 0, 0, 0, 0, 0, 5, 4,   // head 1: tokens 8, 9 (a KV-head max would see only head 0's 9)
      0, 0, 0, 0, 0, 7, 0, 0, 0, 0,   // head 2: token 5
      0, 0, 0, 3, 0, 0, 0, 0, 0, 0,   // head 3: token 3
  };
  TokenSelectionRule rule;
  rule.group = 2;
  rule.alpha = 2.0f;
  rule.max_fraction = 1.0;
  // Counts 2, 2, 1, 1: n = round(1.5) = 2. KV head 0's union of its rows' top 2: {0, 1, 8, 9};
  // KV head 1's {5, 3} and each row's second best (ties: the lowest index, 0).
  SpeculatedTokens t = SelectTokensByRows(scores, 4, 10, rule);
  EXPECT_EQ(t.count, 4);
  EXPECT_EQ(t.per_head[0], (std::vector<int32_t>{0, 1, 8, 9}));
  // KV head 1: rank 0 of each row (5, 3), rank 1 (0 for both: one), then rank 2 (1, 1): {0, 1, 3, 5}.
  EXPECT_EQ(t.per_head[1], (std::vector<int32_t>{0, 1, 3, 5}));
  // Under a cap of 3 tokens, KV head 0 keeps its rows' best two in turn (0, 8) then row 0's second (1).
  rule.max_tokens = 3;
  t = SelectTokensByRows(scores, 4, 10, rule);
  EXPECT_EQ(t.count, 3);
  EXPECT_EQ(t.per_head[0], (std::vector<int32_t>{0, 1, 8}));
  // Sinks and a recent window come first: 1 sink and 2 recent (8, 9) within 4 tokens.
  rule.max_tokens = 4;
  rule.sink_tokens = 1;
  rule.recent_tokens = 2;
  t = SelectTokensByRows(scores, 4, 10, rule);
  EXPECT_EQ(t.count, 4);
  EXPECT_EQ(t.per_head[0], (std::vector<int32_t>{0, 1, 8, 9}));
  EXPECT_EQ(t.per_head[1], (std::vector<int32_t>{0, 5, 8, 9}));
}

// On random scores: group 1 without forced tokens is SelectSpeculatedTokens; otherwise every KV
// head reads `count` distinct tokens within the cap, the forced ones first, and the KV head with the
// largest union reads exactly its rows' top n (n from the rows' counts, recomputed here).
TEST(InfiniGenSpeculation, RowRuleRandomCasesKeepTheirInvariants) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int trial = 0; trial < 300; ++trial) {
    const int group = 1 + trial % 4, kv = 1 + (trial / 4) % 3, rows = group * kv;
    const int tokens = 1 + static_cast<int>(rng() % 200);
    std::vector<float> scores(static_cast<size_t>(rows) * tokens);
    for (float& x : scores) x = std::round(normal(rng) * 4) / 4;  // ties happen
    TokenSelectionRule rule;
    rule.group = group;
    rule.alpha = 1.0f + static_cast<float>(trial % 5);
    rule.max_fraction = 0.05 + 0.1 * (trial % 9);
    rule.max_tokens = trial % 7 == 0 ? 1 + trial % 13 : 0;
    rule.sink_tokens = trial % 3 == 0 ? trial % 4 : 0;
    rule.recent_tokens = trial % 5 == 0 ? trial % 6 : 0;
    const SpeculatedTokens t = SelectTokensByRows(scores, rows, tokens, rule);
    const int cap = SpeculatedTokenCap(tokens, rule.max_fraction, rule.max_tokens);
    ASSERT_EQ(static_cast<int>(t.per_head.size()), kv);
    ASSERT_GE(t.count, 1);
    ASSERT_LE(t.count, cap);
    if (group == 1 && rule.sink_tokens == 0 && rule.recent_tokens == 0 && rule.max_tokens == 0) {
      const SpeculatedTokens plain = SelectSpeculatedTokens(scores, rows, tokens, rule.alpha, rule.max_fraction);
      EXPECT_EQ(t.count, plain.count);
      EXPECT_EQ(t.per_head, plain.per_head);
    }
    // n: the rows' counts within alpha of their max, averaged.
    double total = 0;
    std::vector<std::vector<int32_t>> ranked(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      const float* v = scores.data() + static_cast<size_t>(r) * tokens;
      const float mx = *std::max_element(v, v + tokens);
      for (int i = 0; i < tokens; ++i) total += v[i] > mx - rule.alpha;
      ranked[r].resize(static_cast<size_t>(tokens));
      std::iota(ranked[r].begin(), ranked[r].end(), 0);
      std::stable_sort(ranked[r].begin(), ranked[r].end(), [v](int32_t a, int32_t b) { return v[a] > v[b]; });
    }
    const int n = std::clamp(static_cast<int>(std::lround(total / rows)), 1, cap);
    std::vector<int32_t> forced;
    for (int i = 0; i < tokens; ++i) {
      if (i < rule.sink_tokens || i >= tokens - rule.recent_tokens) forced.push_back(i);
    }
    int largest_union = 0;
    std::vector<std::vector<int32_t>> unions(static_cast<size_t>(kv));
    for (int h = 0; h < kv; ++h) {
      std::vector<int32_t> u = forced;
      for (int r = h * group; r < (h + 1) * group; ++r) u.insert(u.end(), ranked[r].begin(), ranked[r].begin() + n);
      std::sort(u.begin(), u.end());
      u.erase(std::unique(u.begin(), u.end()), u.end());
      largest_union = std::max(largest_union, static_cast<int>(u.size()));
      unions[static_cast<size_t>(h)] = std::move(u);
    }
    EXPECT_EQ(t.count, std::min(largest_union, cap)) << "trial " << trial;
    for (int h = 0; h < kv; ++h) {
      const std::vector<int32_t>& got = t.per_head[static_cast<size_t>(h)];
      ASSERT_EQ(static_cast<int>(got.size()), t.count) << "trial " << trial;
      EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end()) << "a token twice";
      // The forced tokens, as many as fit.
      const int forced_in = std::min(static_cast<int>(forced.size()), t.count);
      for (int k = 0; k < forced_in; ++k) {
        EXPECT_TRUE(std::binary_search(got.begin(), got.end(), forced[static_cast<size_t>(k)])) << "trial " << trial;
      }
      // Where the union fits, every token of it is read.
      if (static_cast<int>(unions[static_cast<size_t>(h)].size()) <= t.count) {
        EXPECT_TRUE(std::includes(got.begin(), got.end(), unions[h].begin(), unions[h].end())) << "trial " << trial;
      }
    }
  }
}

}  // namespace
}  // namespace kvflow
