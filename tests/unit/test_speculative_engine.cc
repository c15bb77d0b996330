// Speculative decoding in the engine (n-gram drafts, EngineConfig::speculative_method): lossless.
// Greedy outputs equal plain decoding's on every prompt, in batches, with prefix caching, swap and
// recompute preemption; under sampling a seeded request gives the same tokens as without
// speculation, and the tokens after a fixed prefix follow the target's distribution.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "sampling/rejection_sampler.h"
#include "spec_distribution.h"

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
    spec_config.speculative.method = "ngram";
    spec_config.speculative.num_tokens = 5;
    spec_config.speculative.ngram.max = 3;
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
  spec_config.speculative.method = "ngram";
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

// A prompt whose n-gram drafts the target finds likely, so that the resampling rule matters (a draft
// outside the target's top-k is rejected with certainty, and every rule then draws from the
// target): a seed and the target's own greedy continuation of it, which on tiny-random falls into a
// loop, so that the drafter, matching the sampled tokens against the loop, proposes what the target
// would pick.
std::vector<int32_t> PromptWhoseDraftsTheTargetLikes(Engine& engine) {
  std::mt19937 rng(8);
  std::vector<int32_t> prompt(12);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 250) + 5;
  const auto greedy = test::GenerateAll(engine, {prompt}, test::Greedy(160), false)[0];
  prompt.insert(prompt.end(), greedy.begin(), greedy.end());
  return prompt;
}

// Completions of that prompt drawn at temperature 1 and top-k 4 while n-gram drafts are verified:
// with the residual rule they follow the target's distribution in every context
// (spec_distribution.h); with either wrong resampling rule installed, the same check fails.
test::DistributionCheck NgramCompletionsCheck(int draws, RejectionRule rule, SpecDecodeStats* stats = nullptr) {
  EngineConfig c;
  c.speculative.method = "ngram";
  c.speculative.num_tokens = 3;
  c.enable_prefix_caching = true;  // the shared prompt is computed once
  auto engine = test::MakeEngine(c);
  if (!engine) return {};
  const std::vector<int32_t> prompt = PromptWhoseDraftsTheTargetLikes(*engine);
  // The check's scoring requests decode nothing, so the rule matters only to the draws. 4 tokens: the
  // drafter drafts only where a token is still to come.
  testing::ScopedRejectionRule mutant(VerifySite::kTarget, rule);
  return test::DrawAndCheck(*engine, prompt, 4, draws, stats);
}

TEST(SpeculativeDecoding, SampledTokensFollowTheTargetDistribution) {
  const int kDraws = 8000;
  SpecDecodeStats s;
  const test::DistributionCheck check = NgramCompletionsCheck(kDraws, RejectionRule::kResidual, &s);
  std::printf("  %lld drafts, %lld accepted\n", (long long)s.num_draft_tokens, (long long)s.num_accepted_tokens);
  check.Print("n-gram, residual rule");
  EXPECT_GE(s.num_draft_tokens, kDraws) << "the later tokens were verified against drafts";
  // Few n-gram drafts land in tiny-random's top 4 (about 1 in 80), but enough that a wrong rule shows
  // (WrongResamplingRulesFailTheDistributionTest: p ~ 1e-11 against a threshold of 1e-5).
  EXPECT_GT(s.num_accepted_tokens, 50) << "some drafts the target likes: the resampling rule matters";
  EXPECT_GE(check.contexts_tested, 15);
  EXPECT_FALSE(check.Rejects()) << check.worst;
}

TEST(SpeculativeDecoding, WrongResamplingRulesFailTheDistributionTest) {
  for (const RejectionRule rule : {RejectionRule::kResampleFromVerifier, RejectionRule::kResampleFromDrafter}) {
    const test::DistributionCheck check = NgramCompletionsCheck(8000, rule);
    check.Print(rule == RejectionRule::kResampleFromVerifier ? "n-gram, resample from the target"
                                                             : "n-gram, resample from the drafter");
    EXPECT_TRUE(check.Rejects()) << "rule " << int(rule);
  }
}

TEST(SpeculativeDecoding, BadConfigurationsAreRefused) {
  EngineConfig c;
  c.speculative.method = "medusa";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.speculative.method = "ngram";
  c.speculative.num_tokens = -1;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.speculative.num_tokens = 4;
  c.speculative.ngram.min = 3;
  c.speculative.ngram.max = 2;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
