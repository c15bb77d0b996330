// S3's supervisor without a model: predictions land on the group, mispredictions are counted in
// the right direction, cut requests teach nothing they cannot know, injected predictions are
// applied, and an untrained predictor retrained online converges on a learnable workload.
#include <gtest/gtest.h>

#include <random>

#include "sched/length_supervisor.h"

namespace kvflow {
namespace {

LengthPredictorConfig SmallConfig() {
  LengthPredictorConfig c;
  c.buckets.max_output_len = 100;  // 10 buckets of 10 tokens
  c.hash_bits = 12;
  return c;
}

std::unique_ptr<SequenceGroup> Group(std::vector<int32_t> prompt, RequestId id = 1) {
  auto g = std::make_unique<SequenceGroup>();
  g->request_id = id;
  g->max_output_tokens = 1000;
  auto s = std::make_unique<SchedSequence>();
  s->prompt_len = static_cast<int64_t>(prompt.size());
  s->tokens = std::move(prompt);
  g->seqs.push_back(std::move(s));
  return g;
}

// A prompt whose first token (0..9) decides the output bucket, among noise tokens.
struct Workload {
  std::mt19937_64 rng{7};
  std::pair<std::vector<int32_t>, int64_t> Next() {
    const int topic = static_cast<int>(rng() % 10);
    std::vector<int32_t> prompt{topic};
    const int noise = 3 + static_cast<int>(rng() % 10);
    for (int i = 0; i < noise; ++i) prompt.push_back(100 + static_cast<int32_t>(rng() % 500));
    return {prompt, topic * 10 + static_cast<int64_t>(rng() % 10)};
  }
};

TEST(LengthSupervisor, PredictsOntoTheGroupAndCountsMispredictionsByDirection) {
  LengthSupervisor sup(LengthPredictor(SmallConfig()), {});
  auto g = Group({1, 2, 3});
  sup.Predict(*g);
  EXPECT_EQ(g->predicted_bucket, 0);          // untrained: bucket 0
  EXPECT_EQ(g->predicted_output_len, 10);     // its upper edge
  sup.OnFinished(*g, 5, /*natural_end=*/true);   // right
  sup.OnFinished(*g, 55, /*natural_end=*/true);  // under
  g->predicted_bucket = 6;
  sup.OnFinished(*g, 15, /*natural_end=*/true);  // over
  sup.OnReservationExhausted(*g);
  const LengthSupervisorStats& s = sup.stats();
  EXPECT_EQ(s.predictions, 1);
  EXPECT_EQ(s.compared, 3);
  EXPECT_EQ(s.correct, 1);
  EXPECT_EQ(s.under_predicted, 1);
  EXPECT_EQ(s.over_predicted, 1);
  EXPECT_EQ(s.reservation_misses, 1);
  EXPECT_EQ(s.online_updates, 3);
}

TEST(LengthSupervisor, ACutRequestTeachesOnlyWhatItProves) {
  LengthSupervisor sup(LengthPredictor(SmallConfig()), {});
  auto g = Group({4, 5, 6});
  g->predicted_bucket = 3;
  sup.OnFinished(*g, 12, /*natural_end=*/false);  // cut in bucket 1: the true bucket is unknown
  EXPECT_EQ(sup.stats().compared, 0);
  EXPECT_EQ(sup.stats().online_updates, 0);
  sup.OnFinished(*g, 55, /*natural_end=*/false);  // cut in bucket 5 > 3: certainly under-predicted
  EXPECT_EQ(sup.stats().under_predicted, 1);
  EXPECT_EQ(sup.stats().online_updates, 0);
  sup.OnFinished(*g, 250, /*natural_end=*/false);  // cut in the last bucket: that is its bucket
  EXPECT_EQ(sup.stats().compared, 1);
  EXPECT_EQ(sup.stats().online_updates, 1);
}

TEST(LengthSupervisor, OverridesInjectTooShortAndTooLongPredictions) {
  LengthSupervisorConfig c;
  c.override_predictions = ParsePredictionOverride("bucket:7", 10).value();
  LengthSupervisor always7(LengthPredictor(SmallConfig()), c);
  auto g = Group({1, 2});
  always7.Predict(*g);
  EXPECT_EQ(g->predicted_bucket, 7);
  EXPECT_EQ(g->predicted_output_len, 80);
  c.override_predictions = ParsePredictionOverride("scale:0.25", 10).value();
  LengthSupervisor quarter(LengthPredictor(SmallConfig()), c);
  quarter.Predict(*g);
  EXPECT_EQ(g->predicted_output_len, 3);  // round(10 * 0.25)
  EXPECT_EQ(g->predicted_bucket, 0);
  EXPECT_FALSE(ParsePredictionOverride("scale:0", 10).ok());
  EXPECT_FALSE(ParsePredictionOverride("scale:abc", 10).ok());
  EXPECT_FALSE(ParsePredictionOverride("bucket:10", 10).ok());
  EXPECT_FALSE(ParsePredictionOverride("bucket:1x", 10).ok());
  EXPECT_FALSE(ParsePredictionOverride("shift:2", 10).ok());
  EXPECT_TRUE(ParsePredictionOverride("none", 10).ok());
  EXPECT_TRUE(ParsePredictionOverride("", 10).ok());
}

// S3 retrains on what it got wrong: starting untrained, the error rate falls as requests complete,
// and the same sequence of requests gives the same counts (deterministic updates).
TEST(LengthSupervisor, OnlineRetrainingFromScratchConverges) {
  auto run = [] {
    LengthSupervisor sup(LengthPredictor(SmallConfig()), {});
    Workload w;
    std::vector<int> wrong;
    for (int i = 0; i < 3000; ++i) {
      auto [prompt, len] = w.Next();
      auto g = Group(prompt, static_cast<RequestId>(i + 1));
      sup.Predict(*g);
      wrong.push_back(LengthBuckets{100, 10}.BucketOf(len) != g->predicted_bucket ? 1 : 0);
      sup.OnFinished(*g, len, /*natural_end=*/true);
    }
    return std::make_pair(wrong, sup.stats());
  };
  const auto [wrong, stats] = run();
  auto rate = [&](size_t from, size_t to) {
    double n = 0;
    for (size_t i = from; i < to; ++i) n += wrong[i];
    return n / static_cast<double>(to - from);
  };
  const double first = rate(0, 200), last = rate(2500, 3000);
  std::printf("misprediction rate: first 200 requests %.3f, last 500 %.3f\n", first, last);
  EXPECT_GT(first, 0.3);
  EXPECT_LT(last, 0.05);
  EXPECT_EQ(stats.online_updates, 3000);
  EXPECT_GT(stats.update_seconds, 0.0);
  const auto [wrong2, stats2] = run();
  EXPECT_EQ(wrong, wrong2);
  EXPECT_EQ(stats.correct, stats2.correct);
}

// With a probe, the supervisor keeps each prompt's hidden row from the prefill and trains the probe
// on it when the request completes: an untrained probe, re-sizing every reservation, learns a
// workload whose hidden state decides the bucket. A cut request teaches the probe nothing it cannot
// know, and without online updates no row is kept.
TEST(LengthSupervisor, TheProbeLearnsOnlineFromCompletedRequests) {
  constexpr int64_t kWidth = 16;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> centres(10, std::vector<float>(kWidth));
  for (auto& c : centres) {
    for (float& x : c) x = 2.0f * normal(rng);
  }
  LengthProbeConfig pc;
  pc.buckets = {100, 10};
  pc.hidden_size = kWidth;
  pc.online_learning_rate = 0.01f;
  auto run = [&](bool online_updates) {
    LengthSupervisorConfig c;
    c.online_updates = online_updates;
    LengthSupervisor sup(LengthPredictor(SmallConfig()), c);
    sup.set_probe(LengthProbe(pc));
    Workload w;
    std::mt19937_64 noise_rng(12);
    std::vector<int> wrong;
    for (int i = 0; i < 1500; ++i) {
      auto [prompt, len] = w.Next();
      auto g = Group(prompt, static_cast<RequestId>(i + 1));
      sup.Predict(*g);
      std::vector<float> hidden = centres[static_cast<size_t>(len / 10)];
      for (float& x : hidden) x += 0.3f * normal(noise_rng);
      sup.OnPrefillHidden(*g, hidden);
      EXPECT_EQ(g->prompt_hidden.empty(), !online_updates);
      wrong.push_back(LengthBuckets{100, 10}.BucketOf(len) != g->predicted_bucket ? 1 : 0);
      sup.OnFinished(*g, len, /*natural_end=*/true);
    }
    return std::make_pair(wrong, sup.stats());
  };
  const auto [wrong, stats] = run(true);
  auto rate = [&](size_t from, size_t to) {
    double n = 0;
    for (size_t i = from; i < to; ++i) n += wrong[i];
    return n / static_cast<double>(to - from);
  };
  std::printf("probe misprediction rate: first 100 requests %.3f, last 500 %.3f\n", rate(0, 100), rate(1000, 1500));
  // From zero weights the argmax is a running class-mean rule whatever the step size: it learns
  // within a few requests per bucket.
  EXPECT_GT(rate(0, 100), 0.05);
  EXPECT_LT(rate(1000, 1500), 0.02);
  EXPECT_EQ(stats.probe_predictions, 1500);
  EXPECT_EQ(stats.probe_online_updates, 1500);
  const auto [still_wrong, still_stats] = run(false);
  EXPECT_EQ(still_stats.probe_online_updates, 0);
  double still_rate = 0;
  for (size_t i = 1000; i < 1500; ++i) still_rate += still_wrong[i];
  EXPECT_GT(still_rate / 500, 0.5);  // an untrained probe that never learns

  LengthSupervisor sup(LengthPredictor(SmallConfig()), {});
  sup.set_probe(LengthProbe(pc));
  auto g = Group({1, 2, 3});
  sup.Predict(*g);
  sup.OnPrefillHidden(*g, centres[4]);
  sup.OnFinished(*g, 12, /*natural_end=*/false);  // cut in bucket 1: its true bucket is unknown
  EXPECT_EQ(sup.stats().probe_online_updates, 0);
  EXPECT_EQ(sup.probe()->num_online_updates(), 0);
  sup.OnFinished(*g, 95, /*natural_end=*/true);
  EXPECT_EQ(sup.probe()->num_online_updates(), 1);

  // A probe trained to take no online step keeps no row and counts no update.
  pc.online_learning_rate = 0.0f;
  LengthSupervisor still(LengthPredictor(SmallConfig()), {});
  still.set_probe(LengthProbe(pc));
  auto h = Group({1, 2, 3});
  still.Predict(*h);
  still.OnPrefillHidden(*h, centres[4]);
  EXPECT_TRUE(h->prompt_hidden.empty());
  still.OnFinished(*h, 45, /*natural_end=*/true);
  EXPECT_EQ(still.stats().probe_online_updates, 0);
  EXPECT_EQ(still.stats().online_updates, 1);  // the n-gram predictor still learns
}

}  // namespace
}  // namespace kvflow
