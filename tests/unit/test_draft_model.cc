// Draft-model speculative decoding (EngineConfig::speculative_model): the first engine with two KV
// caches, the draft model's following the target's block tables (ModelExecutor::AddFollower).
// Lossless: greedy outputs equal plain decoding's in batches, with prefix caching, swap and
// recompute preemption; a draft that is the target itself has every draft accepted, which only
// holds if its cache is right after every swap, copy and recompute; under sampling the tokens after
// a fixed prefix follow the target's distribution (exact rejection sampling with residual
// resampling).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "engine_test_util.h"
#include "sampling/rejection_sampler.h"
#include "spec_distribution.h"

namespace kvflow {
namespace {

std::vector<std::vector<int32_t>> RandomPrompts(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int p = 0; p < n; ++p) {
    std::vector<int32_t> prompt(static_cast<size_t>(5 + rng() % 50));
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
    prompts.push_back(prompt);
  }
  return prompts;
}


TEST(DraftModelSpeculation, GreedyOutputsEqualPlainDecoding) {
  auto prompts = RandomPrompts(6, 11);
  // Two prompts share a long prefix, so prefix caching maps cached blocks into the draft's view.
  prompts[1] = prompts[0];
  prompts[1].insert(prompts[1].end(), {7, 8, 9});
  const SamplingParams p = test::Greedy(64);
  for (const test::EngineSetup& setup : test::EngineSetups()) {
    auto plain = test::MakeEngine(setup.config);
    ASSERT_TRUE(plain);
    const auto want = test::GenerateAll(*plain, prompts, p, !p.greedy());
    for (const char* draft : {"tiny-random-draft", "tiny-random"}) {
      EngineConfig c = setup.config;
      c.speculative.model = draft;
      c.speculative.num_tokens = 3;
      auto spec = test::MakeEngine(c);
      ASSERT_TRUE(spec);
      const auto got = test::GenerateAll(*spec, prompts, p, !p.greedy());
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(got[i], want[i]) << setup.name << ", draft " << draft << ", prompt " << i;
      }
      const EngineStats s = spec->stats();
      const double acceptance = double(s.spec.num_accepted_tokens) / double(std::max<int64_t>(1, s.spec.num_draft_tokens));
      std::printf("  %s, draft %s: %lld drafts, acceptance %.3f, preemptions %lld\n", setup.name, draft,
                  static_cast<long long>(s.spec.num_draft_tokens), acceptance, static_cast<long long>(s.num_preemptions));
      EXPECT_GT(s.spec.num_draft_tokens, 100);
      if (std::string(draft) == "tiny-random") {
        // The target drafting for itself agrees with itself, unless its draft cache went stale.
        EXPECT_GE(acceptance, 0.99) << setup.name;
      } else {
        EXPECT_GT(acceptance, 0.0) << setup.name;
      }
      if (std::string(setup.name) == "swap" || std::string(setup.name) == "recompute") {
        EXPECT_GT(s.num_preemptions, 0) << setup.name << ": the setup must preempt";
      }
      EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total) << "every block is back";
    }
  }
}

// Completions of a fixed prompt drawn at temperature 1 and top-k 4 while they are verified against
// sampled drafts of the layer-skip draft model (whose top 4 differ from the target's often enough to
// exercise rejections and residual draws): with the residual rule they follow the target's
// distribution in every context (spec_distribution.h); with either wrong resampling rule installed,
// the same check fails.
test::DistributionCheck DraftModelCompletionsCheck(int draws, SpecDecodeStats* stats = nullptr) {
  EngineConfig c;
  c.speculative.model = "tiny-random-draft";
  c.speculative.num_tokens = 2;
  c.enable_prefix_caching = true;  // the shared prompt is computed once
  auto engine = test::MakeEngine(c);
  if (!engine) return {};
  const std::vector<int32_t> prompt = RandomPrompts(1, 5)[0];
  return test::DrawAndCheck(*engine, prompt, 4, draws, stats);
}

TEST(DraftModelSpeculation, SampledTokensFollowTheTargetDistribution) {
  const int kDraws = 4000;
  SpecDecodeStats s;
  const test::DistributionCheck check = DraftModelCompletionsCheck(kDraws, &s);
  std::printf("  %lld drafts, %lld accepted\n", static_cast<long long>(s.num_draft_tokens),
              static_cast<long long>(s.num_accepted_tokens));
  check.Print("draft model, residual rule");
  EXPECT_GT(s.num_draft_tokens, kDraws) << "the later tokens were verified against drafts";
  EXPECT_GT(s.num_accepted_tokens, 0);
  EXPECT_LT(s.num_accepted_tokens, s.num_draft_tokens) << "some drafts were rejected (residual draws)";
  EXPECT_GE(check.contexts_tested, 15);
  EXPECT_FALSE(check.Rejects()) << check.worst;
}

TEST(DraftModelSpeculation, WrongResamplingRulesFailTheDistributionTest) {
  for (const RejectionRule rule : {RejectionRule::kResampleFromVerifier, RejectionRule::kResampleFromDrafter}) {
    testing::ScopedRejectionRule mutant(VerifySite::kTarget, rule);
    const test::DistributionCheck check = DraftModelCompletionsCheck(4000);
    check.Print(rule == RejectionRule::kResampleFromVerifier ? "draft model, resample from the target"
                                                             : "draft model, resample from the drafter");
    EXPECT_TRUE(check.Rejects()) << "rule " << int(rule);
  }
}

TEST(DraftModelSpeculation, SeededRunsRepeatAndCancelFreesEverything) {
  EngineConfig c;
  c.speculative.model = "tiny-random-draft";
  auto engine = test::MakeEngine(c);
  ASSERT_TRUE(engine);
  const auto prompts = RandomPrompts(4, 21);
  SamplingParams p;
  p.max_tokens = 40;
  p.temperature = 0.8f;
  p.top_p = 0.95f;
  p.repetition_penalty = 1.2f;
  p.min_tokens = 5;
  const auto first = test::GenerateAll(*engine, prompts, p, !p.greedy());
  EXPECT_EQ(test::GenerateAll(*engine, prompts, p, !p.greedy()), first) << "a seed gives the same tokens";
  EXPECT_GT(engine->stats().spec.num_draft_tokens, 0);

  std::vector<RequestId> ids;
  for (const auto& prompt : prompts) ids.push_back(engine->AddRequest(prompt, test::Greedy(200), {}).value());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(engine->Step().ok());
  for (RequestId id : ids) ASSERT_TRUE(engine->Cancel(id).ok());
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
}

TEST(DraftModelSpeculation, BadConfigurationsAreRefused) {
  EngineConfig c;
  c.speculative.method = "draft_model";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument) << "no draft model named";
  c.speculative.model = "no-such-model";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kNotFound);
  c.speculative.method = "ngram";
  c.speculative.model = "tiny-random-draft";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.speculative.method = "";
  c.speculative.num_tokens = -1;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  // A draft with another tokenizer: SmolLM2 for the tiny model.
  auto smollm = ResolveModel("smollm2-135m");
  if (smollm.ok()) {
    c.speculative.num_tokens = 4;
    c.speculative.model = smollm.value();
    auto e = test::CreateTinyEngine(c);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("tokenizer"), std::string::npos) << e.status().ToString();
  }
}

}  // namespace
}  // namespace kvflow
