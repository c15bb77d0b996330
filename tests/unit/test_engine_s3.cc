// S3 in the engine (tiny-random): whatever the predictions (far too short, far too long, absent),
// the supervisor's preempt-and-double keeps greedy outputs equal to the paged engine's, frees every
// block, and counts what happened; predictor files are checked at startup.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "engine_test_util.h"
#include "kvflow/engine.h"
#include "kvflow/tokenizer.h"
#include "model/tiny_random.h"
#include "s3/plugin.h"
#include "sched/length_predictor.h"
#include "sched/length_probe.h"

namespace kvflow {
namespace {

using test::Greedy;
using test::MakeEngine;

const std::vector<std::string> kPrompts = {
    "The quick brown fox", "Paged attention stores keys and values in blocks.", "a",
    "Once upon a time, in a land far, far away, there lived a", "1 2 3 4 5 6 7 8 9 10 11 12",
    "Length-aware scheduling packs batches by predicted KV size."};

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;
  EngineStats stats;
};

RunResult GenerateAll(EngineConfig c, const SamplingParams& p, const EvaluationOptions& evaluation = {}) {
  c.max_model_len = 256;  // buckets of 26 tokens for an untrained predictor
  auto engine = MakeEngine(c, evaluation);
  RunResult r;
  if (!engine) return r;
  auto outs = engine->Generate(kPrompts, p);
  EXPECT_TRUE(outs.ok()) << outs.status().ToString();
  if (!outs.ok()) return r;
  for (const auto& o : outs.value()) r.tokens.push_back(o.first().tokens);
  r.stats = engine->stats();
  EXPECT_EQ(r.stats.kv_blocks_free, r.stats.kv_blocks_total) << "blocks leaked";
  EXPECT_EQ(r.stats.host_blocks_free, r.stats.host_blocks_total) << "host blocks leaked";
  return r;
}

EngineConfig SmallPool(const std::string& policy, const std::string& mode) {
  EngineConfig c;
  c.scheduling_policy = policy;
  c.preemption_mode = mode;
  c.block_size = 8;
  c.num_kv_blocks = 40;  // 320 tokens for six requests of up to ~70
  c.num_host_kv_blocks = 40;
  return c;
}

TEST(EngineS3, InjectedMispredictionsNeverChangeOutputsOrLeak) {
  const auto p = Greedy(60);
  const RunResult reference = GenerateAll(SmallPool("paged", "auto"), p);
  ASSERT_EQ(reference.tokens.size(), kPrompts.size());
  for (const std::string mode : {"recompute", "swap"}) {
    for (const std::string inject : {"none", "bucket:0", "bucket:9", "scale:0.05", "scale:20"}) {
      SCOPED_TRACE(mode + ", " + inject);
      EngineConfig c = SmallPool("s3", mode);
      EvaluationOptions evaluation;
      evaluation.length_prediction_override = inject;
      const RunResult r = GenerateAll(c, p, evaluation);
      EXPECT_EQ(r.tokens, reference.tokens);
      EXPECT_EQ(r.stats.s3.predictions, static_cast<int64_t>(kPrompts.size()));
      if (inject == "bucket:0" || inject == "scale:0.05" || inject == "none") {
        // Reserving at most 26 output tokens for 60: every request runs out at least once.
        EXPECT_GE(r.stats.s3.reservation_preemptions, static_cast<int64_t>(kPrompts.size())) << inject;
      }
      if (inject == "bucket:9" || inject == "scale:20") EXPECT_EQ(r.stats.s3.reservation_preemptions, 0);
      // Cut at max_tokens: the true bucket is unknown unless it is above the prediction.
      EXPECT_EQ(r.stats.s3.online_updates, 0);
    }
  }
}

TEST(EngineS3, OracleAndOrcaPoliciesRunThroughTheEngineToo) {
  const auto p = Greedy(30);
  const RunResult reference = GenerateAll(SmallPool("paged", "auto"), p);
  for (const std::string policy : {"s3-oracle", "orca-max", "orca-pow2", "orca-oracle"}) {
    SCOPED_TRACE(policy);
    const RunResult r = GenerateAll(SmallPool(policy, "auto"), p);
    EXPECT_EQ(r.tokens, reference.tokens);
    EXPECT_EQ(r.stats.s3.predictions, 0);  // only s3 predicts
  }
}

TEST(EngineS3, PredictorFilesAreCheckedAtStartup) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvflow_engine_s3_test";
  std::filesystem::create_directories(dir);
  EngineConfig c;
  c.scheduling_policy = "s3";

  c.s3.length_predictor = (dir / "missing.kvlp").string();
  EXPECT_FALSE(test::CreateTinyEngine(c).ok());

  const std::string garbage = (dir / "garbage.kvlp").string();
  std::ofstream(garbage) << "not a predictor";
  c.s3.length_predictor = garbage;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kCorruptFile);

  // Trained for another vocabulary: refused with both fingerprints named.
  const std::string foreign = (dir / "foreign.kvlp").string();
  LengthPredictor other;
  other.set_tokenizer_fingerprint("v32000-0123456789abcdef");
  ASSERT_TRUE(other.Save(foreign).ok());
  c.s3.length_predictor = foreign;
  const Status st = test::CreateTinyEngine(c).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("v32000-0123456789abcdef"), std::string::npos) << st.ToString();

  // The right tokenizer: loads, and predicts with it.
  auto engine = MakeEngine({});
  ASSERT_TRUE(engine);
  const std::string mine = (dir / "mine.kvlp").string();
  LengthPredictor ok;
  ok.set_tokenizer_fingerprint(TokenizerFingerprint(engine->tokenizer()));
  ASSERT_TRUE(ok.Save(mine).ok());
  c.s3.length_predictor = mine;
  c.s3.reservation_point = "middle";
  auto s3 = test::CreateTinyEngine(c);
  ASSERT_TRUE(s3.ok()) << s3.status().ToString();
  ASSERT_TRUE(s3.value()->Generate("hello", Greedy(4)).ok());
  EXPECT_EQ(s3.value()->stats().s3.predictions, 1);

  c.s3.reservation_point = "lower";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c.s3.reservation_point = "";
  EvaluationOptions evaluation;
  evaluation.length_prediction_override = "scale:-1";
  EXPECT_EQ(test::CreateTinyEngine(c, evaluation).status().code(), StatusCode::kInvalidArgument);
  evaluation.length_prediction_override = "bucket:10";
  EXPECT_EQ(test::CreateTinyEngine(c, evaluation).status().code(), StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

// The hidden-state probe re-sizes each reservation after the prefill: with the predictor forced to
// the shortest bucket (every request runs out of it) and a probe that says "long", no reservation is
// exhausted, and the outputs stay the paged engine's. A probe for another model is refused.
TEST(EngineS3, LengthProbeResizesReservationsAfterThePrefill) {
  auto files = MakeTinyRandomModel();
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  const std::string fingerprint = LengthProbeModelFingerprint(files->config, *files->tokenizer);
  LengthProbeConfig pc;
  pc.buckets = {256, 10};
  pc.hidden_size = files->config.hidden_size;
  pc.epochs = 20;
  pc.learning_rate = 0.05f;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<ProbeExample> examples(64);
  for (ProbeExample& e : examples) {
    for (int64_t i = 0; i < pc.hidden_size; ++i) e.hidden.push_back(normal(rng));
    e.output_len = 255;
  }
  LengthProbe long_probe(pc);
  long_probe.Train(examples);
  long_probe.set_model_fingerprint(fingerprint);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvflow_engine_s3_probe_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "long.lh").string();
  ASSERT_TRUE(long_probe.Save(path).ok());

  const auto p = Greedy(60);
  const RunResult reference = GenerateAll(SmallPool("paged", "auto"), p);
  EvaluationOptions short_predictions;
  short_predictions.length_prediction_override = "bucket:0";
  const RunResult without = GenerateAll(SmallPool("s3", "recompute"), p, short_predictions);
  EXPECT_GE(without.stats.s3.reservation_preemptions, static_cast<int64_t>(kPrompts.size()));
  EXPECT_EQ(without.stats.s3.probe_predictions, 0);

  EngineConfig c = SmallPool("s3", "recompute");
  c.s3.length_probe = path;
  const RunResult with = GenerateAll(c, p, short_predictions);
  EXPECT_EQ(with.tokens, reference.tokens);
  EXPECT_EQ(with.stats.s3.probe_predictions, static_cast<int64_t>(kPrompts.size()));
  EXPECT_EQ(with.stats.s3.probe_resized, static_cast<int64_t>(kPrompts.size()));
  EXPECT_EQ(with.stats.s3.reservation_preemptions, 0);
  // Online, the probe learns from every request the predictor learns from.
  EXPECT_EQ(with.stats.s3.probe_online_updates, with.stats.s3.online_updates);
  EXPECT_EQ(with.stats.s3.probe_released_blocks, 0);  // it only grew reservations

  // The other way round: the predictor reserves whole outputs at admission and a probe that says
  // "short" shrinks every reservation after the prefill. The blocks reserved past it go back to
  // the pool at once; sequences that then outgrow the short reservation are preempted and come
  // back with it doubled, and the outputs are still the paged engine's.
  for (ProbeExample& e : examples) e.output_len = 1;
  LengthProbe short_probe(pc);
  short_probe.Train(examples);
  short_probe.set_model_fingerprint(fingerprint);
  ASSERT_TRUE(short_probe.Save(path).ok());
  EvaluationOptions long_predictions;
  long_predictions.length_prediction_override = "bucket:9";
  const RunResult shrunk = GenerateAll(c, p, long_predictions);
  EXPECT_EQ(shrunk.tokens, reference.tokens);
  EXPECT_EQ(shrunk.stats.s3.probe_resized, static_cast<int64_t>(kPrompts.size()));
  // Each request reserved prompt + 60 tokens at admission and keeps prompt + 26 (the first
  // bucket's upper end) in blocks of 8: at least 4 blocks back from each.
  EXPECT_GE(shrunk.stats.s3.probe_released_blocks, 4 * static_cast<int64_t>(kPrompts.size()));
  EXPECT_GE(shrunk.stats.s3.reservation_preemptions, static_cast<int64_t>(kPrompts.size()));

  LengthProbe foreign(pc);
  foreign.set_model_fingerprint("llama-L30-H576-other");
  ASSERT_TRUE(foreign.Save(path).ok());
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  pc.hidden_size += 1;
  LengthProbe wrong_width(pc);
  wrong_width.set_model_fingerprint(fingerprint);
  ASSERT_TRUE(wrong_width.Save(path).ok());
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvflow
