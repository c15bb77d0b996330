// The distribution test every speculative method must pass (n-gram, draft model, TriForce): sampled
// completions drawn with drafting on must follow the target model's own distribution, in every
// context the draws reach, at a stated significance.
//
// For each output position and each distinct prefix (a context) the draws reach, the tokens that
// came are compared with the target's top-k distribution there (the engine's prompt logprobs,
// renormalized: temperature 1 and top-k sampling draw from exactly that) by Pearson's chi-square,
// cells with fewer than 5 expected draws pooled. A systematic bias spread thin over many contexts is
// caught by a pooled test per position: each draw is labelled with the rank its token has in its own
// context's distribution (0 = the likeliest), and the rank counts are compared with their expectation
// (the sum of each draw's rank probabilities) by the multinomial quadratic form with the exact
// covariance, chi-square with k - 1 degrees of freedom. Every test is one of a family at
// family-wise significance `alpha` (Bonferroni), and any draw of a token outside the target's top-k
// fails outright. The draws are seeded, so the verdict is deterministic; `alpha` bounds the chance
// that the fixed seeds make a correct sampler fail.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "engine_test_util.h"

namespace kvflow::test {

// P(X > x) for X ~ chi-square with `df` degrees of freedom: the regularized upper incomplete gamma
// Q(df / 2, x / 2), by its series below a + 1 and its continued fraction above (Numerical Recipes
// 6.2), to about 1e-12 relative.
inline double ChiSquareSurvival(double x, int df) {
  if (df <= 0) return 1.0;
  if (!(x > 0.0)) return 1.0;
  if (std::isinf(x)) return 0.0;
  const double a = 0.5 * df, z = 0.5 * x;
  const double log_prefactor = a * std::log(z) - z - std::lgamma(a);
  if (z < a + 1.0) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 1000 && std::fabs(term) > std::fabs(sum) * 1e-15; ++n) {
      term *= z / (a + n);
      sum += term;
    }
    return std::max(0.0, 1.0 - sum * std::exp(log_prefactor));
  }
  constexpr double kTiny = 1e-300;
  double b = z + 1.0 - a, c = 1.0 / kTiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < 1e-15) break;
  }
  return std::exp(log_prefactor) * h;
}

struct ChiSquareResult {
  double statistic = 0.0;
  int df = 0;  // 0: too few draws to test (fewer than two cells of 5 expected draws)
  double p_value = 1.0;
};

// Pearson's goodness of fit of `observed` counts to `probs` (summing to 1). Cells expected fewer than
// 5 draws are pooled, smallest first, until every pooled cell expects at least 5.
inline ChiSquareResult PearsonChiSquare(const std::vector<int64_t>& observed, const std::vector<double>& probs) {
  int64_t n = 0;
  for (int64_t o : observed) n += o;
  struct Cell {
    double expected;
    int64_t observed;
  };
  std::vector<Cell> cells;
  for (size_t i = 0; i < probs.size(); ++i) cells.push_back({probs[i] * double(n), observed[i]});
  std::sort(cells.begin(), cells.end(), [](const Cell& a, const Cell& b) { return a.expected < b.expected; });
  while (cells.size() >= 2 && cells[0].expected < 5.0) {
    cells[1].expected += cells[0].expected;
    cells[1].observed += cells[0].observed;
    cells.erase(cells.begin());
    std::sort(cells.begin(), cells.end(), [](const Cell& a, const Cell& b) { return a.expected < b.expected; });
  }
  ChiSquareResult r;
  if (cells.size() < 2 || cells[0].expected < 5.0) return r;
  for (const Cell& c : cells) r.statistic += (double(c.observed) - c.expected) * (double(c.observed) - c.expected) / c.expected;
  r.df = static_cast<int>(cells.size()) - 1;
  r.p_value = ChiSquareSurvival(r.statistic, r.df);
  return r;
}

// Counts of K categories over independent draws, draw i taking category c with probability
// probs[i][c]: the quadratic form (O - E)^T S^-1 (O - E) over the first K - 1 categories, S the exact
// covariance sum_i (diag(p_i) - p_i p_i^T), is asymptotically chi-square with K - 1 degrees of
// freedom. Categories with less than 5 expected draws are folded into the next likelier one.
inline ChiSquareResult HeterogeneousMultinomialTest(const std::vector<int64_t>& observed,
                                                    const std::vector<std::vector<double>>& probs) {
  const size_t K = observed.size();
  std::vector<double> expected(K, 0.0);
  for (const auto& p : probs)
    for (size_t c = 0; c < K; ++c) expected[c] += p[c];
  // Fold sparse trailing categories (ranks are ordered by likelihood) into their predecessors.
  std::vector<size_t> group(K);
  size_t groups = 0;
  {
    double acc = 0.0;
    for (size_t c = 0; c < K; ++c) {
      group[c] = groups;
      acc += expected[c];
      if (acc >= 5.0) {
        ++groups;
        acc = 0.0;
      }
    }
    if (acc > 0.0 && groups > 0) {  // a sparse tail: into the last full group
      for (size_t c = 0; c < K; ++c)
        if (group[c] == groups) group[c] = groups - 1;
    } else if (acc > 0.0) {
      groups = 1;
    }
  }
  ChiSquareResult r;
  if (groups < 2) return r;
  const size_t G = groups - 1;  // the last group is implied by the total
  std::vector<double> diff(G, 0.0), cov(G * G, 0.0);
  for (size_t c = 0; c < K; ++c)
    if (group[c] < G) diff[group[c]] += double(observed[c]) - expected[c];
  std::vector<double> pg(G);
  for (const auto& p : probs) {
    std::fill(pg.begin(), pg.end(), 0.0);
    for (size_t c = 0; c < K; ++c)
      if (group[c] < G) pg[group[c]] += p[c];
    for (size_t a = 0; a < G; ++a) {
      cov[a * G + a] += pg[a];
      for (size_t b = 0; b < G; ++b) cov[a * G + b] -= pg[a] * pg[b];
    }
  }
  // Solve cov * x = diff (Gaussian elimination with partial pivoting; G <= K - 1 is small).
  std::vector<double> m = cov, x = diff;
  for (size_t col = 0; col < G; ++col) {
    size_t pivot = col;
    for (size_t row = col + 1; row < G; ++row)
      if (std::fabs(m[row * G + col]) > std::fabs(m[pivot * G + col])) pivot = row;
    if (std::fabs(m[pivot * G + col]) < 1e-12) return r;  // degenerate: nothing to test
    if (pivot != col) {
      for (size_t k = 0; k < G; ++k) std::swap(m[col * G + k], m[pivot * G + k]);
      std::swap(x[col], x[pivot]);
    }
    for (size_t row = col + 1; row < G; ++row) {
      const double f = m[row * G + col] / m[col * G + col];
      for (size_t k = col; k < G; ++k) m[row * G + k] -= f * m[col * G + k];
      x[row] -= f * x[col];
    }
  }
  for (size_t col = G; col-- > 0;) {
    for (size_t k = col + 1; k < G; ++k) x[col] -= m[col * G + k] * x[k];
    x[col] /= m[col * G + col];
  }
  for (size_t a = 0; a < G; ++a) r.statistic += diff[a] * x[a];
  r.df = static_cast<int>(G);
  r.p_value = ChiSquareSurvival(r.statistic, r.df);
  return r;
}

// What the check found: the verdict and the evidence for the log.
struct DistributionCheck {
  double alpha = 1e-3;      // family-wise significance
  int tests = 0;            // contexts and per-position rank tests in the family
  int contexts_tested = 0;  // contexts with enough draws for a chi-square
  int contexts_untested = 0;
  int64_t draws_outside_support = 0;  // tokens the target gives probability 0
  int64_t draws_without_scores = 0;   // contexts the engine returned no top-k logprobs for
  double min_p_value = 1.0;
  std::string worst;  // the test with the smallest p-value
  std::vector<std::string> lines;

  // The family's verdict: some draw outside the support, or some p-value below alpha / tests.
  bool Rejects() const {
    return draws_outside_support > 0 || draws_without_scores > 0 || (tests > 0 && min_p_value < alpha / tests);
  }
  void Print(const char* what) const {
    std::printf("  %s: %d tests (%d contexts, %d too thin to test), smallest p %.3g (%s), threshold %.3g%s\n", what,
                tests, contexts_tested, contexts_untested, min_p_value, worst.c_str(), tests ? alpha / tests : alpha,
                draws_outside_support ? ", draws OUTSIDE the target's support" : "");
    for (const auto& l : lines) std::printf("    %s\n", l.c_str());
  }
};

// What the distribution tests draw with: temperature 1 and top-k `top_k`, so that the target's
// distribution is exactly its renormalized top-k logprobs; `max_tokens` each, EOS ignored.
inline SamplingParams TopKSampling(int max_tokens, int top_k = 4) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = top_k;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// `draws` completions of `prompt` under `params` (seeds 0, 1, ...; 100 in flight at a time), each
// params.max_tokens long.
inline std::vector<std::vector<int32_t>> DrawCompletions(Engine& engine, const std::vector<int32_t>& prompt,
                                                         const SamplingParams& params, int draws) {
  std::vector<std::vector<int32_t>> all;
  for (int base = 0; base < draws; base += 100) {
    const int batch = std::min(100, draws - base);
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(batch));
    for (int i = 0; i < batch; ++i) {
      SamplingParams q = params;
      q.seed = static_cast<uint64_t>(base + i);
      EXPECT_TRUE(engine.AddRequest(prompt, q, [&out, i](const StreamEvent& e) {
                          for (const auto& t : e.tokens) out[size_t(i)].push_back(t.token);
                        }).ok());
    }
    while (engine.HasUnfinishedRequests()) EXPECT_TRUE(engine.Step().ok());
    for (auto& o : out) {
      EXPECT_EQ(o.size(), static_cast<size_t>(params.max_tokens));
      all.push_back(std::move(o));
    }
  }
  return all;
}

// The target's top-k distribution after prompt + each prefix (renormalized), from the engine's
// prompt logprobs, all requests in one batch. An empty map: the engine returned no top-k.
inline std::vector<std::map<int32_t, double>> TargetDistributions(Engine& engine, const std::vector<int32_t>& prompt,
                                                                  const std::vector<std::vector<int32_t>>& prefixes,
                                                                  int top_k) {
  std::vector<std::map<int32_t, double>> dists(prefixes.size());
  for (size_t i = 0; i < prefixes.size(); ++i) {
    std::vector<int32_t> scored = prompt;
    scored.insert(scored.end(), prefixes[i].begin(), prefixes[i].end());
    scored.push_back(3);  // any token: its row's top-k is the distribution after the prefix
    SamplingParams s = Greedy(0);
    s.prompt_logprobs = top_k;
    const size_t rows = scored.size() - 1;
    EXPECT_TRUE(engine.AddRequest(scored, s, [&dists, i, rows](const StreamEvent& e) {
                        if (e.prompt_logprobs.size() != rows) return;
                        const auto& top = e.prompt_logprobs.back().top_logprobs;
                        double z = 0.0;
                        for (const auto& t : top) z += std::exp(double(t.logprob));
                        for (const auto& t : top) dists[i][t.token] = std::exp(double(t.logprob)) / z;
                      }).ok());
  }
  while (engine.HasUnfinishedRequests()) EXPECT_TRUE(engine.Step().ok());
  return dists;
}

// Whether `completions` of `prompt` follow the target's top-k distribution at output positions
// [first_position, last_position] (the family described at the top of this file).
inline DistributionCheck CheckCompletionsFollowTheTarget(Engine& engine, const std::vector<int32_t>& prompt,
                                                         const std::vector<std::vector<int32_t>>& completions,
                                                         int top_k, int first_position, int last_position,
                                                         double alpha = 1e-3) {
  DistributionCheck check;
  check.alpha = alpha;
  struct PositionTests {
    std::vector<ChiSquareResult> contexts;
    std::vector<std::string> names;
    ChiSquareResult ranks;
  };
  std::vector<PositionTests> positions;
  for (int j = first_position; j <= last_position; ++j) {
    std::map<std::vector<int32_t>, std::map<int32_t, int64_t>> by_context;
    for (const auto& o : completions) {
      if (static_cast<int>(o.size()) <= j) continue;
      ++by_context[std::vector<int32_t>(o.begin(), o.begin() + j)][o[size_t(j)]];
    }
    std::vector<std::vector<int32_t>> prefixes;
    for (const auto& [prefix, counts] : by_context) prefixes.push_back(prefix);
    const auto dists = TargetDistributions(engine, prompt, prefixes, top_k);
    PositionTests pt;
    std::vector<int64_t> rank_counts(size_t(top_k), 0);
    std::vector<std::vector<double>> rank_probs;
    size_t c = 0;
    for (const auto& [prefix, counts] : by_context) {
      const auto& dist = dists[c++];
      int64_t n = 0;
      for (const auto& [token, count] : counts) n += count;
      if (dist.size() != size_t(top_k)) {
        check.draws_without_scores += n;
        continue;
      }
      // Tokens by likelihood: the rank labels, and the cells of the context's test.
      std::vector<std::pair<double, int32_t>> order;
      for (const auto& [token, p] : dist) order.push_back({p, token});
      std::sort(order.begin(), order.end(), std::greater<>());
      std::vector<double> probs;
      std::vector<int64_t> observed;
      for (const auto& [p, token] : order) {
        probs.push_back(p);
        const auto it = counts.find(token);
        observed.push_back(it == counts.end() ? 0 : it->second);
      }
      int64_t in_support = 0;
      for (int64_t o : observed) in_support += o;
      check.draws_outside_support += n - in_support;
      for (size_t r = 0; r < observed.size(); ++r) rank_counts[r] += observed[r];
      for (int64_t i = 0; i < in_support; ++i) rank_probs.push_back(probs);
      const ChiSquareResult t = PearsonChiSquare(observed, probs);
      if (t.df == 0) {
        ++check.contexts_untested;
        continue;
      }
      ++check.contexts_tested;
      pt.contexts.push_back(t);
      std::string name = "position " + std::to_string(j) + " after [";
      for (size_t k = 0; k < prefix.size(); ++k) name += (k ? " " : "") + std::to_string(prefix[k]);
      name += "] (" + std::to_string(n) + " draws)";
      pt.names.push_back(name);
    }
    pt.ranks = HeterogeneousMultinomialTest(rank_counts, rank_probs);
    std::string line = "position " + std::to_string(j) + ": " + std::to_string(rank_probs.size()) +
                       " draws in " + std::to_string(by_context.size()) + " contexts; ranks";
    std::vector<double> expected(size_t(top_k), 0.0);
    for (const auto& p : rank_probs)
      for (size_t r = 0; r < p.size(); ++r) expected[r] += p[r];
    for (size_t r = 0; r < size_t(top_k); ++r) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), " %lld/%.0f", (long long)rank_counts[r], expected[r]);
      line += buf;
    }
    char buf[96];
    std::snprintf(buf, sizeof(buf), " (drawn/expected): chi2 %.2f, df %d, p %.3g", pt.ranks.statistic, pt.ranks.df,
                  pt.ranks.p_value);
    check.lines.push_back(line + buf);
    positions.push_back(std::move(pt));
  }
  for (size_t j = 0; j < positions.size(); ++j) {
    const PositionTests& pt = positions[j];
    auto consider = [&](const ChiSquareResult& t, const std::string& name) {
      if (t.df == 0) return;
      ++check.tests;
      if (t.p_value < check.min_p_value || check.worst.empty()) {
        check.min_p_value = t.p_value;
        check.worst = name;
      }
    };
    consider(pt.ranks, "ranks at position " + std::to_string(first_position + int(j)));
    for (size_t i = 0; i < pt.contexts.size(); ++i) consider(pt.contexts[i], pt.names[i]);
  }
  return check;
}

// Draws `draws` completions of `prompt` under TopKSampling(max_tokens) and checks every position of
// them; `stats`, if given, receives the engine's speculation counters after the draws.
inline DistributionCheck DrawAndCheck(Engine& engine, const std::vector<int32_t>& prompt, int max_tokens, int draws,
                                      SpecDecodeStats* stats = nullptr) {
  const SamplingParams p = TopKSampling(max_tokens);
  const auto completions = DrawCompletions(engine, prompt, p, draws);
  if (stats) *stats = engine.stats().spec;
  return CheckCompletionsFollowTheTarget(engine, prompt, completions, p.top_k, 0, p.max_tokens - 1);
}

}  // namespace kvflow::test
