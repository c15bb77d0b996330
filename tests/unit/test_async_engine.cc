// AsyncEngine: the engine on its own thread, fed and read from other threads.
#include "kvflow/async_engine.h"

#include <gtest/gtest.h>

#include <thread>

#include "engine_test_util.h"

namespace kvflow {
namespace {

using std::chrono::milliseconds;

std::unique_ptr<AsyncEngine> MakeAsync(AsyncEngineOptions options = {}, EngineConfig c = {}) {
  c.model = "tiny-random";
  c.num_threads = 1;
  auto e = AsyncEngine::Create(c, options);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// Reads a stream to its end: the tokens of completion 0 and the last event.
std::pair<std::vector<int32_t>, StreamEvent> Drain(RequestStream& s) {
  std::vector<int32_t> tokens;
  StreamEvent last;
  std::vector<StreamEvent> events;
  while (s.Next(events, milliseconds(100))) {
    for (const StreamEvent& e : events) {
      for (const SampledToken& t : e.tokens) tokens.push_back(t.token);
      if (e.request_finished) last = e;
    }
  }
  return {tokens, last};
}

TEST(AsyncEngine, ConcurrentSubmittersGetTheSameTokensAsTheEngine) {
  auto reference = test::MakeEngine();
  ASSERT_NE(reference, nullptr);
  auto engine = MakeAsync();
  ASSERT_NE(engine, nullptr);
  const std::vector<std::string> prompts = {"The quick brown fox", "Hello", "Paged attention stores KV in blocks",
                                            "x"};
  std::vector<std::vector<int32_t>> got(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      auto stream = engine->Submit(engine->tokenizer().Encode(prompts[i], true), test::Greedy(12 + 5 * i));
      ASSERT_TRUE(stream.ok()) << stream.status().ToString();
      auto [tokens, last] = Drain(*stream.value());
      EXPECT_EQ(last.finish_reason, FinishReason::kLength);
      got[i] = tokens;
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto want = reference->Generate(prompts[i], test::Greedy(12 + 5 * i));
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got[i], want->first().tokens) << prompts[i];
  }
  EXPECT_EQ(engine->num_unfinished(), 0);
}

TEST(AsyncEngine, CancelFreesBlocksAndEndsTheStream) {
  auto engine = MakeAsync();
  ASSERT_NE(engine, nullptr);
  auto stream = engine->Submit(engine->tokenizer().Encode("a long one", true), test::Greedy(3000));
  ASSERT_TRUE(stream.ok());
  std::vector<StreamEvent> events;
  while (events.empty()) ASSERT_TRUE(stream.value()->Next(events, milliseconds(1000)));
  stream.value()->Cancel();
  auto [tokens, last] = Drain(*stream.value());
  EXPECT_EQ(last.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(tokens.size(), 3000u);
  // The snapshot is refreshed after the step that processed the cancellation.
  for (int i = 0; i < 100 && engine->stats().kv_blocks_free != engine->stats().kv_blocks_total; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  const EngineStats s = engine->stats();
  EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total);
  EXPECT_EQ(s.num_running, 0);
}

TEST(AsyncEngine, RefusesBadRequestsAtOnceAndWhenTheQueueIsFull) {
  EngineConfig c;
  c.max_num_seqs = 1;
  c.max_model_len = 256;
  auto engine = MakeAsync({.max_queue_len = 1}, c);
  ASSERT_NE(engine, nullptr);
  SamplingParams bad = test::Greedy(4);
  bad.top_p = 0.0f;
  EXPECT_EQ(engine->Submit({1, 2, 3}, bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Submit({1, 999999}, test::Greedy(4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Submit(std::vector<int32_t>(300, 5), test::Greedy(4)).status().code(),
            StatusCode::kInvalidArgument);

  // One runs (max_num_seqs 1), one waits, the next is refused.
  std::vector<std::shared_ptr<RequestStream>> accepted;
  int refused = 0;
  for (int i = 0; i < 6; ++i) {
    auto s = engine->Submit({1, 2, 3, static_cast<int32_t>(i)}, test::Greedy(200));
    if (s.ok()) {
      accepted.push_back(s.value());
    } else {
      EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
      ++refused;
    }
  }
  EXPECT_GE(refused, 1);
  EXPECT_GE(accepted.size(), 1u);
  for (auto& s : accepted) EXPECT_EQ(Drain(*s).second.finish_reason, FinishReason::kLength);
}

TEST(AsyncEngine, DrainLetsRequestsFinishThenCancelsAtTheDeadline) {
  auto engine = MakeAsync();
  ASSERT_NE(engine, nullptr);
  auto quick = engine->Submit({1, 2, 3}, test::Greedy(5));
  ASSERT_TRUE(quick.ok());
  engine->Drain(AsyncEngine::Clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(Drain(*quick.value()).second.finish_reason, FinishReason::kLength);
  EXPECT_EQ(engine->Submit({1, 2, 3}, test::Greedy(5)).status().code(), StatusCode::kUnavailable);

  auto engine2 = MakeAsync();
  ASSERT_NE(engine2, nullptr);
  auto slow = engine2->Submit({1, 2, 3}, test::Greedy(4000));
  ASSERT_TRUE(slow.ok());
  engine2->Drain(AsyncEngine::Clock::now() + milliseconds(50));
  EXPECT_EQ(Drain(*slow.value()).second.finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(engine2->num_unfinished(), 0);
}

TEST(AsyncEngine, DestroyingWithRequestsInFlightCancelsThem) {
  auto engine = MakeAsync();
  ASSERT_NE(engine, nullptr);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(engine->Submit({1, 2, 3, i}, test::Greedy(4000)).value());
  engine.reset();
  for (auto& s : streams) EXPECT_TRUE(s->finished());
}

}  // namespace
}  // namespace kvflow
