// TriForce (speculative_method "triforce", src/triforce/): chunk scoring and selection against a
// double-precision reference, the retrieval cache's policy, the lane passes' exactness, and the
// engine lossless with every bottom drafter: greedy outputs equal plain decoding's in batches,
// with prefix caching, swap and recompute preemption; sampled tokens follow the target's
// distribution; cancelled requests leave neither blocks nor retrieval caches behind.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/kv_block_select.h"
#include "engine_test_util.h"
#include "sampling/rejection_sampler.h"
#include "spec_distribution.h"
#include "model/tiny_random.h"
#include "triforce/lane_pass.h"
#include "triforce/retrieval_cache.h"
#include "triforce/triforce_drafter.h"
#include "util/half.h"

namespace kvflow {
namespace {

// ---- chunk scoring and selection ------------------------------------------------------------------

TEST(ChunkScoring, MatchesDoublePrecisionReference) {
  // SmolLM2's head layout (9 query heads over 3 KV heads) and an odd head_dim.
  for (int head_dim : {64, 40}) {
    for (cpu::KvElement element : {cpu::KvElement::kF32, cpu::KvElement::kF16}) {
      KvCacheLayout layout{1, 24, 3, 16, head_dim};
      const int heads = 9;
      std::mt19937 rng(7 + head_dim);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> keys(layout.layer_stride());
      for (float& k : keys) k = normal(rng);
      std::vector<uint16_t> half(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        half[i] = FloatToHalfBits(keys[i]);
        keys[i] = HalfBitsToFloat(half[i]);  // both pools hold the same values
      }
      const int rows = 3;
      std::vector<float> query(static_cast<size_t>(rows * heads * head_dim));
      for (float& q : query) q = 2.0f * normal(rng);
      // Two jobs over shuffled blocks, the second with a partial last block.
      std::vector<KvBlockScoreJob> jobs(2);
      jobs[0].row = 1;
      jobs[0].blocks = {5, 2, 17, 9, 0, 11, 3};
      jobs[0].num_tokens = 7 * 16;
      jobs[1].row = 2;
      jobs[1].blocks = {20, 4, 13, 8, 23};
      jobs[1].num_tokens = 4 * 16 + 5;
      jobs[1].score_offset = 7;
      std::vector<float> scores(12, 0.25f);  // accumulates onto what is there
      const void* pool = element == cpu::KvElement::kF32 ? static_cast<const void*>(keys.data()) : half.data();
      ASSERT_TRUE(cpu::ValidateKvBlockScoreJobs(jobs, layout, rows, 12).ok());
      cpu::ScoreKvBlocks(jobs, layout, heads, query.data(), heads * head_dim, element, pool, scores);
      double max_err = 0.0;
      for (const KvBlockScoreJob& job : jobs) {
        const size_t n = job.blocks.size();
        std::vector<double> want(n, 0.25);
        for (int h = 0; h < heads; ++h) {
          std::vector<double> logit(n);
          for (size_t b = 0; b < n; ++b) {
            const int count = b + 1 == n ? job.num_tokens - static_cast<int>((n - 1) * 16) : 16;
            double dot = 0.0;
            for (int d = 0; d < head_dim; ++d) {
              double mean = 0.0;
              for (int t = 0; t < count; ++t) mean += keys[layout.offset(job.blocks[b], h / 3, t) + static_cast<size_t>(d)];
              dot += query[static_cast<size_t>((job.row * heads + h) * head_dim + d)] * mean / count;
            }
            logit[b] = dot / std::sqrt(static_cast<double>(head_dim));
          }
          const double mx = *std::max_element(logit.begin(), logit.end());
          double z = 0.0;
          for (double l : logit) z += std::exp(l - mx);
          for (size_t b = 0; b < n; ++b) want[b] += std::exp(logit[b] - mx) / z;
        }
        for (size_t b = 0; b < n; ++b) {
          max_err = std::max(max_err, std::fabs(want[b] - scores[static_cast<size_t>(job.score_offset) + b]));
        }
      }
      std::printf("  head_dim %d, %s pool: max |score error| %.2e\n", head_dim, cpu::KvElementName(element), max_err);
      EXPECT_LT(max_err, 2e-6);
    }
  }
}

TEST(ChunkSelection, KeepsForcedBlocksAndBreaksTiesByIndex) {
  // Scores: block 3 and 6 tie for the top; 1 is next.
  const std::vector<float> scores = {0.1f, 0.7f, 0.2f, 0.9f, 0.3f, 0.0f, 0.9f, 0.5f, 0.4f};
  std::vector<int32_t> chosen;
  KvBlockSelectJob job{0, 9, 1, 1, 4};
  cpu::SelectTopKvBlocks(std::span(&job, 1), scores, chosen);
  EXPECT_EQ(chosen, (std::vector<int32_t>{0, 3, 6, 8}));
  job.k = 3;  // one free place: the tie goes to the lower index
  cpu::SelectTopKvBlocks(std::span(&job, 1), scores, chosen = {});
  EXPECT_EQ(chosen, (std::vector<int32_t>{0, 3, 8}));
  job.k = 20;  // more than there are: all of them
  cpu::SelectTopKvBlocks(std::span(&job, 1), scores, chosen = {});
  EXPECT_EQ(chosen.size(), 9u);
  job = {0, 9, 2, 5, 3};  // forced blocks beyond k: the first ones, then the latest
  cpu::SelectTopKvBlocks(std::span(&job, 1), scores, chosen = {});
  EXPECT_EQ(chosen, (std::vector<int32_t>{0, 1, 8}));
  job = {2, 0, 1, 1, 4};  // an empty job chooses nothing
  cpu::SelectTopKvBlocks(std::span(&job, 1), scores, chosen = {});
  EXPECT_TRUE(chosen.empty());
  job = {5, 9, 0, 0, 1};  // outside the buffer: refused
  EXPECT_FALSE(cpu::ValidateKvBlockSelectJobs(std::span(&job, 1), 9).ok());
}

// ---- the retrieval cache's policy -----------------------------------------------------------------

TEST(RetrievalCache, BudgetViewAndRebuildPolicy) {
  EXPECT_EQ(RetrievalBudgetTokens(0, 1000), 256);
  EXPECT_EQ(RetrievalBudgetTokens(0, 8192), 1024);
  EXPECT_EQ(RetrievalBudgetTokens(0, 120000), 4096);
  EXPECT_EQ(RetrievalBudgetTokens(512, 8192), 512);

  RetrievalPolicy policy;
  policy.min_context = 100;
  policy.rebuild_stride = 64;
  policy.acceptance_window = 4;
  RetrievalCache cache;
  using A = RetrievalCache::Action;
  EXPECT_EQ(cache.Decide(99, 32, policy), A::kPlain) << "short context";
  EXPECT_EQ(cache.Decide(120, 64, policy), A::kPlain) << "the budget would be half the cache";
  EXPECT_EQ(cache.Decide(130, 32, policy), A::kBuild);
  cache.Build({0, 3, 7}, 130);  // 8 full blocks then
  EXPECT_EQ(cache.Decide(131, 32, policy), A::kDraft);
  std::vector<int32_t> view;
  cache.ViewBlocks(170, 16, view);  // 10 full blocks now: 8 and 9 filled since the build
  EXPECT_EQ(view, (std::vector<int32_t>{0, 3, 7, 8, 9}));
  EXPECT_EQ(cache.Decide(194, 32, policy), A::kBuild) << "stride";
  cache.Build({0, 5, 11}, 194);
  for (int i = 0; i < 4; ++i) cache.RecordVerification(4, 1);  // 25%: below the rebuild threshold
  EXPECT_EQ(cache.Decide(200, 32, policy), A::kBuild);
  cache.Build({0, 5, 11}, 200);
  for (int i = 0; i < 4; ++i) cache.RecordVerification(4, 0);  // nothing kept: it does not pay
  EXPECT_EQ(cache.Decide(201, 32, policy), A::kPlain);
  for (int i = 1; i < policy.pause_steps; ++i) EXPECT_EQ(cache.Decide(202, 32, policy), A::kPlain);
  EXPECT_EQ(cache.Decide(203, 32, policy), A::kPlain);  // the pause's last step drops the cache
  EXPECT_EQ(cache.Decide(204, 32, policy), A::kBuild) << "after the pause: a fresh selection";
}

// ---- lane passes ----------------------------------------------------------------------------------

// A lane pass over every full block (the build pass) computes what the target computes over its
// table: the partial last block copied into the lane, the new tokens' K/V written there.
TEST(LanePass, FullBlockListAndLaneGiveTheTargetsLogits) {
  auto files = MakeTinyRandomModel();
  ASSERT_TRUE(files.ok());
  const ModelConfig config = files->config;
  auto weights = LoadLlamaWeights(*files->tensors, config, /*gguf_rope_permuted=*/false);
  ASSERT_TRUE(weights.ok());
  KvCacheLayout layout{config.num_layers, 16, config.num_kv_heads, 16, config.head_dim};
  auto backend = CpuBackend::Create(config, std::move(weights).value(), layout, 0, 2).value();
  LlamaModel model(*backend);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(3, 255);
  std::vector<int32_t> tokens(57);
  for (auto& t : tokens) t = tok(rng);
  const std::vector<BlockId> table = {7, 2, 9, 4, 12};
  const int cached = 53;  // 3 full blocks + 5 tokens
  ForwardBatch prefill;
  prefill.tokens.assign(tokens.begin(), tokens.begin() + cached);
  SequenceSlice s;
  s.num_tokens = cached;
  s.context_len = cached;
  s.block_table = table;
  s.logits = LogitsMode::kNone;
  for (int i = 0; i < cached; ++i) prefill.positions.push_back(i);
  prefill.seqs.push_back(s);
  std::vector<float> unused, want, got;
  ASSERT_TRUE(model.Forward(prefill, unused).ok());
  // The lane pass first (it must not touch the table's blocks), then the target's own pass.
  LanePool lanes(*backend, 13, LanePool::BlocksPerLane(8, 16), 1);
  LanePool::PartialBlock part{0, table, cached};
  ASSERT_TRUE(lanes.CopyPartialBlocks(std::span(&part, 1)).ok());
  LaneSlice lane;
  lane.blocks = {7, 2, 9};
  lane.lane_origin = 48;
  lane.first_position = cached;
  lane.tokens.assign(tokens.begin() + cached, tokens.end());
  ASSERT_TRUE(lanes.Forward(std::span(&lane, 1), nullptr, got).ok());
  ForwardBatch step;
  step.tokens.assign(tokens.begin() + cached, tokens.end());
  for (int i = cached; i < 57; ++i) step.positions.push_back(i);
  s.num_tokens = 4;
  s.context_len = 57;
  s.logits = LogitsMode::kAll;
  step.seqs = {s};
  ASSERT_TRUE(model.Forward(step, want).ok());
  ASSERT_EQ(got.size(), want.size());
  float max_diff = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) max_diff = std::max(max_diff, std::fabs(got[i] - want[i]));
  std::printf("  lane pass vs the target's pass: max |logit diff| %.2e over %zu logits\n", max_diff, got.size());
  EXPECT_EQ(max_diff, 0.0f) << "same KV in the same view order: the same rows";
  // A lane that cannot hold the tokens is refused, not overrun.
  lane.tokens.resize(40, 5);
  EXPECT_FALSE(lanes.Forward(std::span(&lane, 1), nullptr, got).ok());
}

// ---- the engine -----------------------------------------------------------------------------------

// Prompts of 70-150 tokens whose continuations repeat what came before (so n-gram drafts get
// accepted) and a random one.
std::vector<std::vector<int32_t>> LongPrompts() {
  std::vector<std::vector<int32_t>> prompts;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(5, 250);
  for (int p = 0; p < 4; ++p) {
    std::vector<int32_t> phrase(static_cast<size_t>(9 + 5 * p));
    for (auto& t : phrase) t = tok(rng);
    std::vector<int32_t> prompt;
    for (int r = 0; r < 6; ++r) {
      prompt.insert(prompt.end(), phrase.begin(), phrase.end());
      prompt.push_back(tok(rng));
    }
    prompts.push_back(prompt);
  }
  std::vector<int32_t> random(90);
  for (auto& t : random) t = tok(rng);
  prompts.push_back(random);
  return prompts;
}

// TriForce on the tiny model: blocks of 8 tokens, a 24-token retrieval cache (the first block, the
// latest, and the best-scored one), drafting from the start.
EngineConfig TriForce(EngineConfig c, const std::string& bottom) {
  c.block_size = 8;
  if (c.num_kv_blocks > 0) c.num_kv_blocks *= 2;
  c.max_num_seqs = 8;
  c.speculative.method = "triforce";
  c.speculative.num_tokens = 5;
  c.speculative.triforce.draft = bottom;
  c.speculative.triforce.draft_tokens = 2;
  c.speculative.triforce.budget = 24;
  c.speculative.triforce.min_context = 0;
  c.speculative.triforce.rebuild_stride = 40;
  c.speculative.triforce.sinks = 4;
  c.speculative.triforce.window = 16;
  if (bottom == "draft_model") c.speculative.model = "tiny-random-draft";
  if (c.num_kv_blocks > 0) {
    TriForceConfig t = TriForceConfig::FromOptions(c.speculative, c.max_num_seqs);
    t.kv_offload = c.kv_offload.enabled;
    c.num_kv_blocks += TriForceDrafter::TargetScratchBlocks(t, c.block_size);
  }
  return c;
}

TEST(TriForce, GreedyOutputsEqualPlainDecoding) {
  const auto prompts = LongPrompts();
  const SamplingParams p = test::Greedy(80);
  for (const char* bottom : {"ngram", "streaming", "draft_model"}) {
    for (const test::EngineSetup& setup : test::EngineSetups()) {
      EngineConfig plain_config = setup.config;
      plain_config.block_size = 8;
      if (plain_config.num_kv_blocks > 0) plain_config.num_kv_blocks *= 2;
      auto plain = test::MakeEngine(plain_config);
      auto tri = test::MakeEngine(TriForce(setup.config, bottom));
      ASSERT_TRUE(plain && tri);
      const auto want = test::GenerateAll(*plain, prompts, p, false);
      const auto got = test::GenerateAll(*tri, prompts, p, false);
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(got[i], want[i]) << bottom << ", " << setup.name << ", prompt " << i;
      }
      const SpecDecodeStats s = tri->stats().spec;
      std::printf("  %-11s %-14s top: %lld/%lld kept; middle: %lld passes, %lld/%lld bottom drafts kept; "
                  "bottom passes %lld; builds %lld; preemptions %lld\n",
                  bottom, setup.name, (long long)s.num_accepted_tokens, (long long)s.num_draft_tokens,
                  (long long)s.middle_passes, (long long)s.middle_accepted_tokens, (long long)s.middle_draft_tokens,
                  (long long)s.bottom_passes, (long long)s.retrieval_builds, (long long)tri->stats().num_preemptions);
      EXPECT_GT(s.num_accepted_tokens, 0) << bottom << ", " << setup.name;
      EXPECT_GT(s.num_draft_tokens, s.num_accepted_tokens) << "some middle drafts must be rejected";
      EXPECT_GT(s.middle_passes, s.num_drafts) << "several middle passes per full pass";
      EXPECT_GT(s.retrieval_builds, static_cast<int64_t>(prompts.size())) << "built per sequence and rebuilt";
      if (std::string(bottom) != "ngram") EXPECT_GT(s.bottom_passes, 0);
      EXPECT_GT(s.middle_draft_tokens, 0) << bottom;
      if (setup.config.num_kv_blocks > 0) EXPECT_GT(tri->stats().num_preemptions, 0) << setup.name;
      EXPECT_EQ(tri->stats().kv_blocks_free, tri->stats().kv_blocks_total) << "every block back";
      EXPECT_EQ(s.retrieval_caches, 0) << "every retrieval cache dropped";
    }
  }
}

// The target's pool offloaded to host memory (the paper's offloading setting): verification steps
// stream the full cache through the staging buffers, the middle level reads copies of its
// retrieval blocks kept resident (fetching nothing), the draft model's cache stays on the device.
// Greedy outputs stay those of plain resident decoding, and seeded sampling draws exactly what
// TriForce over the resident pool draws (bit-identical logits at every level).
TEST(TriForce, OverAnOffloadedPoolKeepsOutputs) {
  const auto prompts = LongPrompts();
  for (const char* bottom : {"ngram", "draft_model"}) {
    for (const test::EngineSetup& setup : test::EngineSetups()) {
      EngineConfig plain_config = setup.config;
      plain_config.block_size = 8;
      if (plain_config.num_kv_blocks > 0) plain_config.num_kv_blocks *= 2;
      EngineConfig resident_config = TriForce(setup.config, bottom);
      EngineConfig offload_config = setup.config;
      offload_config.kv_offload.enabled = true;
      offload_config.preemption_mode = "recompute";
      offload_config = TriForce(offload_config, bottom);
      auto plain = test::MakeEngine(plain_config);
      auto resident = test::MakeEngine(resident_config);
      auto offloaded = test::MakeEngine(offload_config);
      ASSERT_TRUE(plain && resident && offloaded) << bottom << ", " << setup.name;
      const auto want = test::GenerateAll(*plain, prompts, test::Greedy(80), false);
      const auto got = test::GenerateAll(*offloaded, prompts, test::Greedy(80), false);
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(got[i], want[i]) << bottom << ", " << setup.name << ", prompt " << i;
      }
      const EngineStats st = offloaded->stats();
      std::printf("  %-11s %-14s offloaded: top kept %lld/%lld; middle passes %lld; %lld blocks copied to the "
                  "device for the middle; %.2f MiB fetched for verification, %lld on-demand fetches\n",
                  bottom, setup.name, (long long)st.spec.num_accepted_tokens, (long long)st.spec.num_draft_tokens,
                  (long long)st.spec.middle_passes, (long long)st.spec.retrieval_copied_blocks,
                  st.kv_offload.bytes_fetched / double(1 << 20), (long long)st.kv_offload.on_demand_fetches);
      EXPECT_GT(st.spec.middle_passes, st.spec.num_drafts) << bottom;
      EXPECT_GT(st.spec.retrieval_copied_blocks, 0) << bottom;
      EXPECT_GT(st.kv_offload.bytes_fetched, 0);
      EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total) << "every block back";
      EXPECT_EQ(st.spec.retrieval_caches, 0);
      SamplingParams sampled = test::Greedy(40);
      sampled.temperature = 1.0f;
      sampled.top_k = 8;
      EXPECT_EQ(test::GenerateAll(*offloaded, prompts, sampled, /*vary_seed=*/true),
                test::GenerateAll(*resident, prompts, sampled, /*vary_seed=*/true))
          << bottom << ", " << setup.name << ": seeded sampling over the offloaded pool";
    }
  }
}

TEST(TriForce, ShortContextsDecodePlainly) {
  EngineConfig c = TriForce({}, "ngram");
  c.speculative.triforce.min_context = 1000;
  auto tri = test::MakeEngine(c);
  auto plain = test::MakeEngine({});
  const auto prompts = LongPrompts();
  EXPECT_EQ(test::GenerateAll(*tri, prompts, test::Greedy(20), false),
            test::GenerateAll(*plain, prompts, test::Greedy(20), false));
  const SpecDecodeStats s = tri->stats().spec;
  EXPECT_EQ(s.num_draft_tokens, 0);
  EXPECT_EQ(s.middle_passes, 0);
  EXPECT_GT(s.plain_steps, 0);
}

// Completions of a fixed prompt drawn at temperature 1 with top-k 4. The first decode step scores the
// chunks (no drafts), so the third token is the first TriForce drafts: the streaming bottom samples a
// draft, the middle keeps or replaces it by exact rejection sampling (a distribution on both sides;
// n-gram drafts are one-hot, a special case of the same rule), and the top verifies what the middle
// hands up. Every context of every position is checked against the target (spec_distribution.h).
test::DistributionCheck TriForceCompletionsCheck(int draws, SpecDecodeStats* stats = nullptr,
                                                 const std::string& bottom = "streaming", bool offload = false) {
  EngineConfig base;
  base.kv_offload.enabled = offload;
  if (offload) base.preemption_mode = "recompute";
  EngineConfig c = TriForce(base, bottom);
  c.enable_prefix_caching = true;
  // Over an offloaded pool at most kMaxCopyRegions sequences draft at once (the rest decode plainly).
  c.max_num_seqs = offload ? TriForceDrafter::kMaxCopyRegions : 100;
  c.speculative.triforce.window = 8;
  c.speculative.triforce.budget = 48;
  auto engine = test::MakeEngine(c);
  if (!engine) return {};
  std::vector<int32_t> prompt;
  for (int t = 0; t < engine->model_config().vocab_size; ++t) prompt.push_back(t);
  // 5 tokens: the third is drafted together with the fourth (a bottom draft, then the middle's own).
  return test::DrawAndCheck(*engine, prompt, 5, draws, stats);
}

TEST(TriForce, SampledTokensFollowTheTargetDistribution) {
  const int kDraws = 6000;
  SpecDecodeStats s;
  const test::DistributionCheck check = TriForceCompletionsCheck(kDraws, &s);
  std::printf("  middle kept %lld of %lld bottom drafts; top kept %lld of %lld\n", (long long)s.middle_accepted_tokens,
              (long long)s.middle_draft_tokens, (long long)s.num_accepted_tokens, (long long)s.num_draft_tokens);
  check.Print("TriForce, residual rule at both levels");
  EXPECT_GE(s.num_draft_tokens, kDraws) << "the third tokens were verified against drafts";
  EXPECT_LT(s.num_accepted_tokens, s.num_draft_tokens * 9 / 10) << "the top must reject a fair share";
  EXPECT_GE(s.middle_draft_tokens, kDraws);
  EXPECT_LT(s.middle_accepted_tokens, s.middle_draft_tokens * 9 / 10) << "the middle must reject a fair share";
  EXPECT_GT(s.middle_accepted_tokens, s.middle_draft_tokens / 20) << "and keep some";
  EXPECT_GE(check.contexts_tested, 60);
  EXPECT_FALSE(check.Rejects()) << check.worst;
}

// The same distribution test with the target's pool offloaded: the draft model's bottom samples,
// the middle reads its resident copies, the top streams the host pool.
TEST(TriForce, SampledTokensFollowTheTargetDistributionOverAnOffloadedPool) {
  const int kDraws = 4000;
  SpecDecodeStats s;
  const test::DistributionCheck check = TriForceCompletionsCheck(kDraws, &s, "draft_model", true);
  std::printf("  offloaded: middle kept %lld of %lld bottom drafts; top kept %lld of %lld; %lld blocks copied\n",
              (long long)s.middle_accepted_tokens, (long long)s.middle_draft_tokens,
              (long long)s.num_accepted_tokens, (long long)s.num_draft_tokens, (long long)s.retrieval_copied_blocks);
  check.Print("TriForce over an offloaded pool, draft-model bottom");
  EXPECT_GE(s.num_draft_tokens, kDraws);
  EXPECT_GE(s.middle_draft_tokens, kDraws);
  EXPECT_GT(s.retrieval_copied_blocks, 0);
  EXPECT_GE(check.contexts_tested, 40);
  EXPECT_FALSE(check.Rejects()) << check.worst;
}

// A middle level that resamples a rejected bottom draft from its own distribution (as the published
// TriForce code does) or from the bottom's hands the top drafts that are not distributed as the
// probabilities it reports, and the output is skewed although the top's rule is right; a top that
// resamples from its own distribution skews it directly. The check must see all three, at half the
// draws of the test above (their p-values then lie 10^2 to 10^60 below the threshold).
TEST(TriForce, WrongResamplingRulesFailTheDistributionTest) {
  struct Mutant {
    VerifySite site;
    RejectionRule rule;
    const char* name;
  } mutants[] = {
      {VerifySite::kMiddle, RejectionRule::kResampleFromVerifier, "TriForce, middle resamples from itself"},
      {VerifySite::kMiddle, RejectionRule::kResampleFromDrafter, "TriForce, middle resamples from the bottom"},
      {VerifySite::kTarget, RejectionRule::kResampleFromVerifier, "TriForce, top resamples from itself"},
  };
  for (const Mutant& m : mutants) {
    testing::ScopedRejectionRule mutant(m.site, m.rule);
    const test::DistributionCheck check = TriForceCompletionsCheck(3000);
    check.Print(m.name);
    EXPECT_TRUE(check.Rejects()) << m.name;
  }
}

TEST(TriForce, CancelledRequestsFreeBlocksAndRetrievalCaches) {
  auto engine = test::MakeEngine(TriForce({}, "streaming"));
  ASSERT_TRUE(engine);
  std::vector<RequestId> ids;
  for (const auto& prompt : LongPrompts()) ids.push_back(engine->AddRequest(prompt, test::Greedy(200), {}).value());
  for (int i = 0; i < 12; ++i) ASSERT_TRUE(engine->Step().ok());
  EXPECT_GT(engine->stats().spec.retrieval_caches, 0);
  EXPECT_GT(engine->stats().spec.middle_passes, 0);
  for (RequestId id : ids) EXPECT_TRUE(engine->Cancel(id).ok());
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
  EXPECT_EQ(engine->stats().spec.retrieval_caches, 0);
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total);
}

TEST(TriForce, BadConfigurationsAreRefused) {
  EngineConfig c = TriForce({}, "ngram");
  c.speculative.triforce.draft = "medusa";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c = TriForce({}, "draft_model");
  c.speculative.model.clear();
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c = TriForce({}, "ngram");
  c.speculative.model = "tiny-random-draft";
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c = TriForce({}, "ngram");
  c.speculative.triforce.budget = -1;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c = TriForce({}, "ngram");
  c.speculative.triforce.rebuild_acceptance = 1.5;
  EXPECT_EQ(test::CreateTinyEngine(c).status().code(), StatusCode::kInvalidArgument);
  c = TriForce({}, "ngram");
  c.num_kv_blocks = 40;  // the lanes would leave no room for a max_model_len sequence
  auto refused = test::CreateTinyEngine(c);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("lanes"), std::string::npos) << refused.status().ToString();
}

}  // namespace
}  // namespace kvflow
