// `kvflow bench`'s timing loop (src/cli/decode_bench.h): steps are attributed to prefill and decode,
// the counts match what was asked, and the medians are medians.
#include <gtest/gtest.h>

#include "cli/decode_bench.h"
#include "engine_test_util.h"

namespace kvflow {
namespace {

TEST(DecodeBench, MedianOfOddEvenAndEmpty) {
  EXPECT_DOUBLE_EQ(Median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_DOUBLE_EQ(Median({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_DOUBLE_EQ(Median({}), 0.0);
}

TEST(DecodeBench, SyntheticPromptIsReproducibleAndAvoidsLowIds) {
  const auto a = SyntheticPrompt(500, 1000, 7);
  EXPECT_EQ(a, SyntheticPrompt(500, 1000, 7));
  EXPECT_NE(a, SyntheticPrompt(500, 1000, 8));
  ASSERT_EQ(a.size(), 500u);
  for (int32_t t : a) {
    EXPECT_GE(t, 100);
    EXPECT_LT(t, 1000);
  }
  for (int32_t t : SyntheticPrompt(50, 64, 1)) EXPECT_GE(t, 32);  // a tiny vocabulary keeps its upper half
}

TEST(DecodeBench, PrefillChunksAndDecodeStepsAreCountedSeparately) {
  EngineConfig c;
  c.max_num_batched_tokens = 32;  // a 100-token prompt prefills in 4 chunks
  c.max_model_len = 256;
  auto engine = test::MakeEngine(c);
  ASSERT_NE(engine, nullptr);
  auto run = TimeDecodeRun(*engine, {SyntheticPrompt(100, engine->model_config().vocab_size, 1)}, 10);
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  EXPECT_EQ(run->prompt_tokens, 100);
  EXPECT_EQ(run->decode_steps, 10);
  EXPECT_GT(run->prefill_s, 0.0);
  EXPECT_GT(run->decode_s, 0.0);
  EXPECT_FALSE(engine->HasUnfinishedRequests());

  auto prefill_only = TimeDecodeRun(*engine, {{5, 6, 7}}, 0);
  ASSERT_TRUE(prefill_only.ok()) << prefill_only.status().ToString();
  EXPECT_EQ(prefill_only->decode_steps, 0);
  EXPECT_EQ(prefill_only->decode_s, 0.0);
}

TEST(DecodeBench, RepeatsGiveOneRunEachAndMedianRates) {
  EngineConfig c;
  c.max_model_len = 128;
  auto engine = test::MakeEngine(c);
  ASSERT_NE(engine, nullptr);
  DecodeBenchOptions opt;
  opt.depth = 40;
  opt.decode_tokens = 8;
  opt.repeats = 3;
  auto r = RunDecodeBench(*engine, opt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->runs.size(), 3u);
  std::vector<double> decode_rates;
  for (const auto& run : r->runs) {
    EXPECT_EQ(run.prompt_tokens, 40);
    EXPECT_EQ(run.decode_steps, 8);
    decode_rates.push_back(run.decode_steps / run.decode_s);
  }
  EXPECT_DOUBLE_EQ(r->decode_tok_s, Median(decode_rates));
  EXPECT_GT(r->prefill_tok_s, 0.0);

  opt.batch = 4;  // four sequences decoding together
  auto batched = RunDecodeBench(*engine, opt);
  ASSERT_TRUE(batched.ok()) << batched.status().ToString();
  EXPECT_EQ(batched->runs[0].prompt_tokens, 4 * 40);
  EXPECT_EQ(batched->runs[0].decode_steps, 4 * 8);
  opt.batch = 1;

  opt.depth = 0;  // a one-token prompt
  auto shallow = RunDecodeBench(*engine, opt);
  ASSERT_TRUE(shallow.ok()) << shallow.status().ToString();
  EXPECT_EQ(shallow->runs[0].prompt_tokens, 1);
}

TEST(DecodeBench, RejectsBadOptionsAndPromptsOverTheContext) {
  EngineConfig c;
  c.max_model_len = 64;
  auto engine = test::MakeEngine(c);
  ASSERT_NE(engine, nullptr);
  DecodeBenchOptions opt;
  opt.repeats = 0;
  EXPECT_FALSE(RunDecodeBench(*engine, opt).ok());
  opt.repeats = 1;
  opt.depth = 60;
  opt.decode_tokens = 10;  // 60 + 10 + 1 > 64
  opt.warmup = false;
  EXPECT_FALSE(RunDecodeBench(*engine, opt).ok());
  EXPECT_FALSE(engine->HasUnfinishedRequests());
}

}  // namespace
}  // namespace kvflow
