// The serving path of KV-Runahead (kv_runahead/prompt_prefill_service.h) on an in-process world: the last
// rank's engine prefills long prompts across prefill workers running on threads, through a KV
// connector that fills the admitted request's blocks. The engine's outputs, greedy and seeded sampled, must equal an engine on one
// process that prefills the prompt in the same chunks (bit-identical logits make them equal).
#include <gtest/gtest.h>


#include "distributed/in_process_communicator.h"
#include "kv_runahead/prompt_prefill_service.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "engine_test_util.h"
#include "in_process_job.h"
#include "kv_selection_test_util.h"

namespace kvflow::dist {
namespace {

using test::RandomTokens;

EngineConfig TinyConfig() {
  EngineConfig c;
  c.model = "tiny-random";
  c.num_threads = 2;  // as test::MakeEngine's reference engines
  c.max_model_len = 512;
  c.num_kv_blocks = 128;
  c.enable_prefix_caching = true;
  return c;
}

// A world of `ranks`: prefill workers 0..ranks-2 on threads, the engine on the last rank.
struct PrefillWorld : test::InProcessJob {
  PrefillWorld(int ranks, const EngineConfig& config)
      : InProcessJob(ranks, ranks - 1, [config](Communicator& comm) { return RunPrefillWorker(config, comm, 30.0); }) {}
  Communicator& leader() { return serving(); }
};

std::unique_ptr<EvaluationEngine> LeaderEngine(EngineConfig c, Communicator& comm) {
  EvaluationOptions options;
  options.prefill_communicator = &comm;
  auto engine = CreateEvaluationEngine(c, options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// 300-token prompts: 288 tokens (18 whole blocks) are prefilled across the ranks, the engine
// computes the last 12.
std::vector<std::vector<int32_t>> LongPrompts() {
  return {RandomTokens(300, 31, 256), RandomTokens(300, 32, 256), RandomTokens(40, 33, 256)};
}

TEST(PromptPrefillService, OutputsEqualAnEngineThatPrefillsInTheSameChunks) {
  for (const std::string method : {"kv-runahead", "tsp"}) {
    for (int ranks : {2, 3}) {
      SCOPED_TRACE(method + " over " + std::to_string(ranks) + " ranks");
      EngineConfig config = TinyConfig();
      config.prefill_parallel.method = method;
      config.prefill_parallel.min_tokens = 64;
      // The reference chunks the prompt as the even partition of its 288 prefilled tokens does.
      EngineConfig reference_config = TinyConfig();
      reference_config.max_num_batched_tokens = 288 / ranks;
      auto reference = test::MakeEngine(reference_config);
      ASSERT_NE(reference, nullptr);
      PrefillWorld world(ranks, config);
      {
        auto engine = LeaderEngine(config, world.leader());
        ASSERT_NE(engine, nullptr);
        EXPECT_NE(engine->Describe().find(method + " prefill across " + std::to_string(ranks) + " ranks"),
                  std::string::npos)
            << engine->Describe();
        const auto prompts = LongPrompts();
        // One at a time, so every prompt is prefilled before the engine steps.
        for (bool sampled : {false, true}) {
          SamplingParams params = test::Greedy(16);
          if (sampled) {
            params.temperature = 0.9f;
            params.top_p = 0.95f;
          }
          for (size_t i = 0; i < prompts.size(); ++i) {
            auto ours = test::GenerateAll(*engine, {prompts[i]}, params, sampled);
            auto theirs = test::GenerateAll(*reference, {prompts[i]}, params, sampled);
            EXPECT_EQ(ours, theirs) << "prompt " << i << (sampled ? " sampled" : " greedy");
            EXPECT_EQ(ours[0].size(), 16u);
          }
        }
        // The long prompts' whole blocks were not computed by the engine's steps: the ranks'
        // connector supplied them.
        EXPECT_GT(engine->stats().prefix_cache_hit_rate, 0.0);
      }
      // The engine told its workers to stop when it went.
      world.Join();
      for (int r = 0; r + 1 < ranks; ++r) EXPECT_TRUE(world.result(r).ok()) << world.result(r).ToString();
    }
  }
}

TEST(PromptPrefillService, ShortPromptsAndPromptLogprobsStayOnTheLastRank) {
  EngineConfig config = TinyConfig();
  config.prefill_parallel.method = "kv-runahead";
  config.prefill_parallel.min_tokens = 400;
  PrefillWorld world(2, config);
  {
    auto engine = LeaderEngine(config, world.leader());
    ASSERT_NE(engine, nullptr);
    test::GenerateAll(*engine, LongPrompts(), test::Greedy(4), false);
    EXPECT_EQ(engine->stats().prefix_cache_hit_rate, 0.0);
  }
  world.Join();
  EXPECT_TRUE(world.result(0).ok()) << world.result(0).ToString();
}

// With the host prefix cache: a pool that holds one long prompt at a time evicts each, and the
// same prompt again (a new turn) loads its leading blocks from host memory instead of going to the
// ranks. Outputs equal a one-process engine's with the same pool.
TEST(PromptPrefillService, ComposesWithTheHostPrefixCache) {
  EngineConfig config = TinyConfig();
  config.num_kv_blocks = 36;
  config.max_model_len = 320;
  config.prefill_parallel.method = "kv-runahead";
  config.prefill_parallel.min_tokens = 64;
  config.host_prefix_cache.num_blocks = 64;
  EngineConfig alone = TinyConfig();
  alone.num_kv_blocks = 36;
  alone.max_model_len = 320;
  auto reference = test::MakeEngine(alone);
  ASSERT_NE(reference, nullptr);
  PrefillWorld world(2, config);
  {
    auto engine = LeaderEngine(config, world.leader());
    ASSERT_NE(engine, nullptr);
    std::vector<std::vector<int32_t>> turns = {RandomTokens(300, 41, 256), RandomTokens(300, 42, 256)};
    for (int round = 0; round < 2; ++round) {
      for (auto& prompt : turns) {
        const auto ours = test::GenerateAll(*engine, {prompt}, test::Greedy(8), false);
        EXPECT_EQ(ours, test::GenerateAll(*reference, {prompt}, test::Greedy(8), false)) << "round " << round;
        prompt.insert(prompt.end(), ours[0].begin(), ours[0].end());
      }
    }
    const EngineStats s = engine->stats();
    EXPECT_GT(s.host_prefix_cache.hit_blocks, 0) << "the second round found its blocks in host memory";
    EXPECT_GT(s.prefix_cache_hit_rate, 0.0);
  }
  world.Join();
  EXPECT_TRUE(world.result(0).ok()) << world.result(0).ToString();
}

// A worker that goes away: the prefill fails, the engine computes the prompt itself (same
// output), and serves every later prompt alone.
TEST(PromptPrefillService, EngineServesOnWhenAWorkerIsGone) {
  EngineConfig config = TinyConfig();
  config.prefill_parallel.method = "kv-runahead";
  config.prefill_parallel.min_tokens = 64;
  auto reference = test::MakeEngine(TinyConfig());
  ASSERT_NE(reference, nullptr);
  PrefillWorld world(2, config);
  auto engine = LeaderEngine(config, world.leader());
  ASSERT_NE(engine, nullptr);
  world.rank(0).MarkGone();
  for (const auto& prompt : LongPrompts()) {
    auto ours = test::GenerateAll(*engine, {prompt}, test::Greedy(8), false);
    EXPECT_EQ(ours, test::GenerateAll(*reference, {prompt}, test::Greedy(8), false));
  }
  engine.reset();
  // The worker waits on a last rank that is now gone too: it ends with an error, not a hang.
  world.rank(1).MarkGone();
  world.Join();
  EXPECT_EQ(world.result(0).code(), StatusCode::kUnavailable) << world.result(0).ToString();
}

TEST(PromptPrefillService, RefusesWorkersOfAnotherKvFormatAndBadConfigurations) {
  EngineConfig config = TinyConfig();
  config.prefill_parallel.method = "kv-runahead";
  EngineConfig other = config;
  other.kv_cache_dtype = "f16";
  {
    PrefillWorld world(2, other);
    EvaluationOptions options;
    options.prefill_communicator = &world.leader();
    config.dtype = "f32";
    config.kv_cache_dtype = "f32";
    auto engine = CreateEvaluationEngine(config, options);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().message().find("KV format"), std::string::npos) << engine.status().ToString();
    // The worker is still waiting for commands: the last rank leaving ends it.
    world.rank(1).MarkGone();
  }
  for (auto bad : {std::pair<std::string, std::string>{"prefill_parallel", "ring"}, {"kv_selection", "h2o"},
                   {"speculative_method", "triforce"}}) {
    EngineConfig c = TinyConfig();
    c.prefill_parallel.method = "kv-runahead";
    if (bad.first == "prefill_parallel") c.prefill_parallel.method = bad.second;
    if (bad.first == "kv_selection") c.kv_selection.method = bad.second;
    if (bad.first == "speculative_method") c.speculative.method = bad.second;
    auto engine = CreateEvaluationEngine(c, {});
    ASSERT_FALSE(engine.ok()) << bad.first;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument) << engine.status().ToString();
  }
}

}  // namespace
}  // namespace kvflow::dist
