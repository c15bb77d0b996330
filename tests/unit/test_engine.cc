// Engine behaviour on the built-in tiny-random model: batching, chunked prefill and preemption
// never change greedy outputs; seeds reproduce; stop conditions, cancellation and bad input.
#include <gtest/gtest.h>

#include "engine/stop_matcher.h"
#include "engine_test_util.h"
#include "backend/cuda/cuda_device.h"
#include "kvflow/engine.h"

namespace kvflow {
namespace {

const std::vector<std::string> kPrompts = {
    "The quick brown fox", "Paged attention stores keys and values in blocks.", "a",
    "Once upon a time, in a land far, far away, there lived a", "1 2 3 4 5 6 7 8 9 10 11 12"};

using test::Greedy;
using test::MakeEngine;

std::vector<std::vector<int32_t>> OneByOne(const SamplingParams& p) {
  auto engine = MakeEngine();
  std::vector<std::vector<int32_t>> out;
  for (const auto& prompt : kPrompts) out.push_back(engine->Generate(prompt, p).value().first().tokens);
  return out;
}

std::vector<std::vector<int32_t>> Batched(EngineConfig c, const SamplingParams& p, EngineStats* stats = nullptr) {
  auto engine = MakeEngine(c);
  auto outs = engine->Generate(kPrompts, p);
  EXPECT_TRUE(outs.ok()) << outs.status().ToString();
  std::vector<std::vector<int32_t>> tokens;
  for (const auto& o : outs.value()) tokens.push_back(o.first().tokens);
  if (stats) *stats = engine->stats();
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total) << "blocks leaked";
  return tokens;
}

TEST(Engine, BatchedGreedyEqualsOneByOne) {
  const auto p = Greedy(24);
  const auto reference = OneByOne(p);
  for (const auto& r : reference) EXPECT_EQ(r.size(), 24u);
  EXPECT_EQ(Batched({}, p), reference);
}

TEST(Engine, ChunkedPrefillAndBlockSizesDoNotChangeOutputs) {
  const auto p = Greedy(16);
  const auto reference = OneByOne(p);
  EngineConfig chunked;
  chunked.max_num_batched_tokens = 7;  // prompts span several steps, decodes interleave
  EXPECT_EQ(Batched(chunked, p), reference);
  for (int bs : {8, 32}) {
    EngineConfig c;
    c.block_size = bs;
    EXPECT_EQ(Batched(c, p), reference) << "block size " << bs;
  }
}

TEST(Engine, PreemptionByRecomputeDoesNotChangeOutputs) {
  const auto p = Greedy(40);
  const auto reference = OneByOne(p);
  EngineConfig tiny_pool;
  tiny_pool.block_size = 8;
  tiny_pool.num_kv_blocks = 14;  // far less than 5 sequences x ~60 tokens need
  EngineStats stats;
  EXPECT_EQ(Batched(tiny_pool, p, &stats), reference);
  EXPECT_GT(stats.num_preemptions, 0);
}

TEST(Engine, SameSeedSameOutputDifferentSeedDifferentOutput) {
  auto engine = MakeEngine();
  SamplingParams p;
  p.temperature = 1.0f;
  p.max_tokens = 32;
  p.ignore_eos = true;
  p.seed = 7;
  auto a = engine->Generate(kPrompts[0], p).value().first().tokens;
  auto b = engine->Generate(kPrompts[0], p).value().first().tokens;
  EXPECT_EQ(a, b);
  p.seed = 8;
  auto c = engine->Generate(kPrompts[0], p).value().first().tokens;
  EXPECT_NE(a, c);
}

TEST(Engine, StreamedTextEqualsDecodedOutputAndHonoursMaxTokens) {
  auto engine = MakeEngine();
  std::string streamed;
  int events = 0;
  auto out = engine->Generate(kPrompts[1], Greedy(20), [&](const StreamEvent& e) {
    streamed += e.text_delta;
    ++events;
  });
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first().finish_reason, FinishReason::kLength);
  EXPECT_EQ(out->first().tokens.size(), 20u);
  EXPECT_EQ(events, 20);
  EXPECT_EQ(streamed, out->first().text);
  EXPECT_EQ(out->first().text, engine->tokenizer().Decode(out->first().tokens));
}

TEST(Engine, StopStringEndsTheOutputBeforeIt) {
  auto engine = MakeEngine();
  auto full = engine->Generate(kPrompts[3], Greedy(30)).value();
  // Pick a stop string from the middle of what greedy decoding produces.
  const std::string text = full.first().text;
  ASSERT_GT(text.size(), 12u);
  const std::string stop = text.substr(text.size() / 2, 3);
  SamplingParams p = Greedy(30);
  p.stop = {stop};
  auto out = engine->Generate(kPrompts[3], p).value();
  EXPECT_EQ(out.first().finish_reason, FinishReason::kStop);
  EXPECT_EQ(out.first().text, text.substr(0, text.find(stop)));
}

TEST(Engine, StopTokenIdEndsGeneration) {
  auto engine = MakeEngine();
  auto full = engine->Generate(kPrompts[0], Greedy(10)).value();
  SamplingParams p = Greedy(10);
  p.stop_token_ids = {full.first().tokens[4]};
  auto out = engine->Generate(kPrompts[0], p).value();
  EXPECT_EQ(out.first().finish_reason, FinishReason::kStop);
  EXPECT_LE(out.first().tokens.size(), 5u);
  EXPECT_EQ(out.first().tokens.back(), full.first().tokens[4]);
}

TEST(Engine, LogprobsAreSortedAndIncludeTheGreedyToken) {
  auto engine = MakeEngine();
  SamplingParams p = Greedy(5);
  p.logprobs = 3;
  auto out = engine->Generate(kPrompts[0], p).value();
  for (const SampledToken& t : out.first().logprobs) {
    ASSERT_EQ(t.top_logprobs.size(), 3u);
    EXPECT_EQ(t.top_logprobs[0].token, t.token);  // greedy picks the most likely
    EXPECT_FLOAT_EQ(t.top_logprobs[0].logprob, t.logprob);
    EXPECT_GE(t.top_logprobs[0].logprob, t.top_logprobs[1].logprob);
    EXPECT_LE(t.logprob, 0.0f);
  }
}

TEST(Engine, CancelFreesBlocksAndReportsCancelled) {
  auto engine = MakeEngine();
  FinishReason reason = FinishReason::kNone;
  auto id = engine->AddRequest(kPrompts[3], Greedy(100), [&](const StreamEvent& e) {
    if (e.finished) reason = e.finish_reason;
  });
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine->Step().ok());
  ASSERT_TRUE(engine->Step().ok());
  EXPECT_LT(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
  ASSERT_TRUE(engine->Cancel(id.value()).ok());
  EXPECT_EQ(reason, FinishReason::kCancelled);
  EXPECT_FALSE(engine->HasUnfinishedRequests());
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
  EXPECT_EQ(engine->Cancel(id.value()).code(), StatusCode::kNotFound);
}

TEST(Engine, BadRequestsGetClearErrors) {
  EngineConfig c;
  c.max_model_len = 64;
  auto engine = MakeEngine(c);
  SamplingParams p;
  p.temperature = -1.0f;
  EXPECT_EQ(engine->AddRequest("hi", p).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->AddRequest(std::vector<int32_t>{}, Greedy(4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->AddRequest(std::vector<int32_t>{1, 99999}, Greedy(4)).status().code(),
            StatusCode::kInvalidArgument);
  auto too_long = engine->AddRequest(std::string(200, 'x'), Greedy(4));
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("max_model_len"), std::string::npos);
  // A request that reaches max_model_len finishes with kLength instead of failing.
  auto out = engine->Generate(std::string(50, 'y'), Greedy(100)).value();
  EXPECT_EQ(out.first().finish_reason, FinishReason::kLength);
  EXPECT_EQ(out.prompt_tokens.size() + out.first().tokens.size(), 64u);
}

TEST(Engine, BadConfigsAndModelsGetClearErrors) {
  EngineConfig c;
  c.model = "/nonexistent/model.gguf";
  auto e = Engine::Create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
  c.model = "tiny-random";
  c.block_size = 0;
  EXPECT_EQ(Engine::Create(c).status().code(), StatusCode::kInvalidArgument);
  c.block_size = 16;
  c.device = "tpu";
  EXPECT_EQ(Engine::Create(c).status().code(), StatusCode::kInvalidArgument);
  c.device = "cuda";
  if (cuda::DeviceCount() == 0) {
    // Built without CUDA, or no GPU here: says so instead of falling back to the CPU.
    const Status st = Engine::Create(c).status();
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
  }
}

TEST(StopMatcher, HoldsBackPossibleStopPrefixes) {
  StopMatcher m({"END", "xyz"});
  EXPECT_EQ(m.Push("hello E"), "hello ");
  EXPECT_EQ(m.Push("N"), "");
  EXPECT_EQ(m.Push("D more"), "");
  EXPECT_TRUE(m.stopped());
  StopMatcher n({"END"});
  EXPECT_EQ(n.Push("abcE"), "abc");
  EXPECT_EQ(n.Push("x"), "Ex");
  EXPECT_EQ(n.Push("EN"), "");
  EXPECT_EQ(n.Flush(), "EN");
  EXPECT_FALSE(n.stopped());
}

}  // namespace
}  // namespace kvflow
