// The logits-processor seam in the engine (engine/logits_processor.h): OpenAI's logit_bias and
// min_tokens through every decoding strategy, speculative verification included.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "engine_test_util.h"
#include "kv_selection_test_util.h"

namespace kvflow {
namespace {

std::vector<std::vector<int32_t>> Prompts() { return test::ThreePrompts(); }

TEST(LogitBias, APositiveBiasForcesItsTokenAndANegativeOneBansIt) {
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  const auto plain = test::GenerateAll(*engine, Prompts(), test::Greedy(12), false);
  SamplingParams forced = test::Greedy(12);
  forced.logit_bias = {{42, 100.0f}};
  for (const auto& out : test::GenerateAll(*engine, Prompts(), forced, false)) {
    ASSERT_EQ(out.size(), 12u);
    for (int32_t t : out) EXPECT_EQ(t, 42);
  }
  // Ban every token plain greedy chose for the first prompt: none of them comes back.
  SamplingParams banned = test::Greedy(12);
  for (int32_t t : plain[0]) banned.logit_bias.push_back({t, -100.0f});
  const auto out = test::GenerateAll(*engine, {Prompts()[0]}, banned, false)[0];
  ASSERT_EQ(out.size(), 12u);
  for (int32_t t : out) EXPECT_EQ(std::count(plain[0].begin(), plain[0].end(), t), 0) << t;
}

TEST(LogitBias, RawLogprobsAreReported) {
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  SamplingParams p = test::Greedy(1);
  p.logprobs = 1;
  auto plain = engine->Generate("hello world", p);
  ASSERT_TRUE(plain.ok());
  const SampledToken& top = plain->outputs[0].logprobs[0];
  // Force the runner-up: its reported logprob is the raw one the unbiased run listed.
  ASSERT_FALSE(top.top_logprobs.empty());
  p.logprobs = 2;
  auto listed = engine->Generate("hello world", p);
  ASSERT_TRUE(listed.ok());
  const TokenLogprob second = listed->outputs[0].logprobs[0].top_logprobs[1];
  p.logit_bias = {{second.token, 50.0f}};
  auto forced = engine->Generate("hello world", p);
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->outputs[0].tokens[0], second.token);
  EXPECT_NEAR(forced->outputs[0].logprobs[0].logprob, second.logprob, 1e-5);
}

// Speculative verification asks the processors about every position it verifies, with the drafts
// kept so far as the output: greedy outputs under a bias are plain decoding's under that bias,
// whatever was drafted. Parallel sampling and beam search take the constraint too.
TEST(LogitBias, EveryDecodingStrategyKeepsTheConstraintInStep) {
  auto plain = test::MakeEngine();
  EngineConfig spec_config;
  spec_config.speculative.method = "ngram";
  auto spec = test::MakeEngine(spec_config);
  ASSERT_TRUE(plain && spec);
  const auto unbiased = test::GenerateAll(*plain, Prompts(), test::Greedy(24), false);
  SamplingParams p = test::Greedy(24);
  // Push down the tokens the unbiased outputs repeat most, so the biased run diverges from them.
  for (int32_t t : {unbiased[0][0], unbiased[1][0], unbiased[2][0]}) p.logit_bias.push_back({t, -5.0f});
  p.min_tokens = 5;
  p.ignore_eos = false;
  const auto want = test::GenerateAll(*plain, Prompts(), p, false);
  EXPECT_NE(want, unbiased) << "the bias changed nothing: the test would not tell";
  EXPECT_EQ(test::GenerateAll(*spec, Prompts(), p, false), want);
  EXPECT_GT(spec->stats().spec.num_accepted_tokens, 0) << "no draft was accepted: verification not exercised";

  SamplingParams forced = test::Greedy(8);
  forced.logit_bias = {{42, 100.0f}};
  forced.n = 2;
  forced.temperature = 1.0f;
  forced.seed = 7;
  auto parallel = plain->Generate("two samples", forced);
  ASSERT_TRUE(parallel.ok());
  ASSERT_EQ(parallel->outputs.size(), 2u);
  for (const CompletionOutput& c : parallel->outputs) {
    for (int32_t t : c.tokens) EXPECT_EQ(t, 42);
  }
  SamplingParams beams = test::Greedy(6);
  beams.use_beam_search = true;
  beams.best_of = 2;
  beams.logit_bias = {{42, 100.0f}};
  auto beam = plain->Generate("beams", beams);
  ASSERT_TRUE(beam.ok());
  for (int32_t t : beam->outputs[0].tokens) EXPECT_EQ(t, 42);
}

TEST(LogitBias, BadBiasesAreRefused) {
  auto engine = test::MakeEngine();
  ASSERT_TRUE(engine);
  SamplingParams p = test::Greedy(4);
  p.logit_bias = {{engine->model_config().vocab_size, 1.0f}};
  EXPECT_EQ(engine->AddRequest("x", p).status().code(), StatusCode::kInvalidArgument);
  p.logit_bias = {{3, 101.0f}};
  EXPECT_EQ(engine->AddRequest("x", p).status().code(), StatusCode::kInvalidArgument);
  p.logit_bias = {{-1, 1.0f}};
  EXPECT_EQ(engine->AddRequest("x", p).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
