// Speculative decoding in the engine (n-gram drafts, EngineConfig::speculative_method): lossless.
// Greedy outputs equal plain decoding's on every prompt, in batches, with prefix caching, swap and
// recompute preemption; under sampling a seeded request gives the same tokens as without
// speculation, and the tokens after a fixed prefix follow the target's distribution.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "engine_test_util.h"

namespace kvflow {
namespace {

// Prompts whose continuations repeat what came before, so that drafts get accepted: a random
// phrase said a few times, and an ascending run.
std::vector<std::vector<int32_t>> RepetitivePrompts() {
  std::vector<std::vector<int32_t>> prompts;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> tok(5, 250);
  for (int p = 0; p < 5; ++p) {
    std::vector<int32_t> phrase(static_cast<size_t>(6 + 3 * p));
    for (auto& t : phrase) t = tok(rng);
    std::vector<int32_t> prompt;
    for (int r = 0; r < 3 + p % 2; ++r) prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    prompts.push_back(prompt);
  }
  std::vector<int32_t> run;
  for (int i = 0; i < 40; ++i) run.push_back(10 + i % 20);
  prompts.push_back(run);
  return prompts;
}


TEST(SpeculativeDecoding, GreedyOutputsEqualPlainDecoding) {
  const auto prompts = RepetitivePrompts();
  SamplingParams p = test::Greedy(96);
  for (const test::EngineSetup& setup : test::EngineSetups()) {
    EngineConfig spec_config = setup.config;
    spec_config.speculative_method = "ngram";
    spec_config.num_speculative_tokens = 5;
    spec_config.ngram_max = 3;
    auto plain = test::MakeEngine(setup.config);
    auto spec = test::MakeEngine(spec_config);
    ASSERT_TRUE(plain && spec);
    const auto want = test::GenerateAll(*plain, prompts, p, false);
    const auto got = test::GenerateAll(*spec, prompts, p, false);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], want[i]) << setup.name << ", prompt " << i;
    const EngineStats s = spec->stats();
    std::printf("  %-14s drafts %lld, draft tokens %lld, accepted %lld (%.0f%%; by position", setup.name,
                (long long)s.spec.num_drafts, (long long)s.spec.num_draft_tokens, (long long)s.spec.num_accepted_tokens,
                100.0 * s.spec.num_accepted_tokens / std::max<int64_t>(1, s.spec.num_draft_tokens));
    for (int64_t n : s.spec.accepted_per_position) std::printf(" %lld", (long long)n);
    std::printf("), preemptions %lld\n", (long long)s.num_preemptions);
    EXPECT_GT(s.spec.num_accepted_tokens, 0) << setup.name;
    EXPECT_GT(s.spec.num_draft_tokens, s.spec.num_accepted_tokens) << setup.name << ": some drafts must be rejected";
    if (setup.config.num_kv_blocks > 0) EXPECT_GT(s.num_preemptions, 0) << setup.name;
    EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total) << setup.name << ": every block back";
    int64_t per_position = 0;
    for (int64_t n : s.spec.accepted_per_position) per_position += n;
    EXPECT_EQ(per_position, s.spec.num_accepted_tokens);
  }
}

TEST(SpeculativeDecoding, SeededSamplingGivesThePlainTokensAndOptOutWorks) {
  const auto prompts = RepetitivePrompts();
  SamplingParams p;
  p.max_tokens = 48;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.repetition_penalty = 1.1f;
  p.min_tokens = 4;
  EngineConfig spec_config;
  spec_config.speculative_method = "ngram";
  auto plain = test::MakeEngine({});
  auto spec = test::MakeEngine(spec_config);
  const auto want = test::GenerateAll(*plain, prompts, p, true);
  const auto got = test::GenerateAll(*spec, prompts, p, true);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], want[i]) << "prompt " << i;
  EXPECT_GT(spec->stats().spec.num_draft_tokens, 0);
  const int64_t before = spec->stats().spec.num_draft_tokens;
  p.speculative = false;
  EXPECT_EQ(test::GenerateAll(*spec, prompts, p, true), want);
  EXPECT_EQ(spec->stats().spec.num_draft_tokens, before) << "an opted-out request drafts nothing";
}

// The second token after a fixed prompt, drawn 2000 times with top-k 4 at temperature 1 while it
// is verified against a draft: for the most frequent first tokens, the empirical distribution of
// the second equals the target's (prompt logprobs of the same model) within total variation 0.07
// (the sampling noise of a few hundred draws over 4 outcomes is about 0.03).
TEST(SpeculativeDecoding, SampledTokensFollowTheTargetDistribution) {
  EngineConfig c;
  c.speculative_method = "ngram";
  c.num_speculative_tokens = 3;
  c.enable_prefix_caching = true;  // the shared prompt is computed once
  auto engine = test::MakeEngine(c);
  // Every token occurs in the prompt, so the drafter always proposes something after the first.
  std::vector<int32_t> prompt;
  for (int t = 0; t < engine->model_config().vocab_size; ++t) prompt.push_back(t);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 4;
  p.max_tokens = 3;  // the drafter drafts only where a token is still to come
  p.ignore_eos = true;
  const int kDraws = 2000;
  test::FirstTwoTokens drawn = test::DrawFirstTwoTokens(*engine, prompt, p, kDraws);
  EXPECT_GT(engine->stats().spec.num_draft_tokens, kDraws / 2) << "the second tokens were verified against drafts";
  EXPECT_GE(test::ExpectSecondTokensFollowTheTarget(*engine, prompt, drawn.firsts, drawn.pairs), 1);
}

TEST(SpeculativeDecoding, BadConfigurationsAreRefused) {
  EngineConfig c;
  c.speculative_method = "medusa";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.speculative_method = "ngram";
  c.num_speculative_tokens = -1;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.num_speculative_tokens = 4;
  c.ngram_min = 3;
  c.ngram_max = 2;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
