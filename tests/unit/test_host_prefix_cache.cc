// The host prefix cache: its index over the block manager (what it saves, matches and loads), and
// engines whose device pool is too small for every conversation of a multi-turn workload, which
// must give exactly the outputs of an engine without the tier while loading blocks back from it.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "engine_test_util.h"
#include "host_prefix_cache/host_prefix_index.h"
#include "kv/block_manager.h"

namespace kvflow {
namespace {

std::vector<int32_t> RandomTokens(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int32_t> d(0, 250);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = d(rng);
  return t;
}

// Admits, "computes" and frees a sequence, leaving its full blocks in the device prefix cache.
int64_t RunAndFree(BlockManager& bm, SeqId seq, const std::vector<int32_t>& tokens) {
  const int64_t cached = bm.Allocate(seq, tokens, static_cast<int64_t>(tokens.size())).value();
  bm.MarkComputed(seq, tokens, static_cast<int64_t>(tokens.size()));
  bm.Free(seq);
  return cached;
}

TEST(HostPrefixIndex, SavesEvictedBlocksAndLoadsThemBackInPromptOrder) {
  std::mt19937 rng(7);
  BlockManager bm(BlockManagerConfig{4, 4, 2, true});
  HostPrefixIndex index(/*block_size=*/4, /*first_host_block=*/2, /*num_blocks=*/8, /*block_bytes=*/100);
  bm.AddConnector(&index);
  const std::vector<int32_t> a = RandomTokens(rng, 13);  // 3 full blocks + the last token
  EXPECT_EQ(RunAndFree(bm, 1, a), 0);
  EXPECT_TRUE(bm.TakeConnectorMoves().empty()) << "nothing evicted yet";

  // Another prompt takes the whole pool: A's three cached blocks are reclaimed and saved.
  const std::vector<int32_t> b = RandomTokens(rng, 16);
  ASSERT_EQ(bm.Allocate(2, b, 16).value(), 0);
  std::vector<KvConnectorMoves> moves = bm.TakeConnectorMoves();
  ASSERT_EQ(moves.size(), 1u);
  ASSERT_EQ(moves[0].save.size(), 3u);
  EXPECT_TRUE(moves[0].load.empty());
  std::set<BlockId> host;
  for (const BlockMove& m : moves[0].save) {
    EXPECT_GE(m.dst, 2) << "host blocks below 2 are the swap space";
    EXPECT_LT(m.dst, 10);
    host.insert(m.dst);
  }
  EXPECT_EQ(host.size(), 3u);
  bm.Free(2);

  // A's prompt again (plus a new turn): no device hit, three blocks loaded from host memory into
  // the new table's first three blocks, in the order they were saved (the prompt's order).
  std::vector<int32_t> a2 = a;
  a2.push_back(5);
  a2.push_back(6);
  const int64_t cached = bm.Allocate(3, a2, 15).value();
  EXPECT_EQ(cached, 12);
  const std::vector<KvConnectorMoves> loads = bm.TakeConnectorMoves();
  ASSERT_EQ(loads.size(), 1u);
  ASSERT_EQ(loads[0].load.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(loads[0].load[i].src, moves[0].save[i].dst) << "block " << i;
    EXPECT_EQ(loads[0].load[i].dst, bm.BlockTable(3)[i]) << "block " << i;
  }
  const HostPrefixCacheStats s = index.stats();
  EXPECT_EQ(s.saved_blocks, 3);
  EXPECT_EQ(s.hit_blocks, 3);
  EXPECT_EQ(s.bytes_loaded, 300);
  EXPECT_EQ(s.used_blocks, 3);
  EXPECT_EQ(bm.prefix_hit_blocks(), 0);
  EXPECT_EQ(bm.connector_hit_blocks(), 3);
}

TEST(HostPrefixIndex, MatchesOnlyTheSamePrefixAndNeverTheLastToken) {
  std::mt19937 rng(8);
  BlockManager bm(BlockManagerConfig{4, 3, 0, true});
  HostPrefixIndex index(4, 0, 8, 1);
  bm.AddConnector(&index);
  const std::vector<int32_t> a = RandomTokens(rng, 9);  // 2 full blocks + 1
  RunAndFree(bm, 1, a);
  ASSERT_EQ(bm.Allocate(2, RandomTokens(rng, 12), 12).value(), 0);  // evicts both
  ASSERT_EQ(bm.TakeConnectorMoves().at(0).save.size(), 2u);
  bm.Free(2);

  // The second block alone, after another first block, is another prefix: no match.
  std::vector<int32_t> other = RandomTokens(rng, 4);
  other.insert(other.end(), a.begin() + 4, a.end());
  EXPECT_EQ(index.NumMatchedTokens(other, 0), 0);
  // Exactly A's 8 tokens: the last must run, so one block only.
  const std::vector<int32_t> a8(a.begin(), a.begin() + 8);
  EXPECT_EQ(index.NumMatchedTokens(a8, 0), 4);
  // Past a device hit of one block, the second comes from the host.
  EXPECT_EQ(index.NumMatchedTokens(a, 4), 4);
  EXPECT_EQ(index.NumMatchedTokens(a, 0), 8);
}

TEST(HostPrefixIndex, EvictsLeastRecentlyUsedButNeverABlockMovedThisStep) {
  std::mt19937 rng(9);
  BlockManager bm(BlockManagerConfig{4, 4, 0, true});
  HostPrefixIndex index(4, 0, 2, 1);  // room for two blocks only
  bm.AddConnector(&index);
  const std::vector<int32_t> a = RandomTokens(rng, 13);  // 3 full blocks
  RunAndFree(bm, 1, a);
  ASSERT_EQ(bm.Allocate(2, RandomTokens(rng, 16), 16).value(), 0);  // evicts all three at once
  std::vector<KvConnectorMoves> moves = bm.TakeConnectorMoves();
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].save.size(), 2u) << "a third save would overwrite a block saved in the same step";
  EXPECT_EQ(index.stats().used_blocks, 2);
  EXPECT_EQ(index.stats().evicted_blocks, 0);
  bm.Free(2);
  // The two saved are A's first two blocks (the pool reclaims least recently released first).
  EXPECT_EQ(index.NumMatchedTokens(a, 0), 8);

  // The next step's evictions make room by dropping the least recently used host block.
  const std::vector<int32_t> c = RandomTokens(rng, 5);
  RunAndFree(bm, 3, c);
  ASSERT_EQ(bm.Allocate(4, RandomTokens(rng, 16), 16).value(), 0);
  moves = bm.TakeConnectorMoves();
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].save.size(), 1u);
  EXPECT_EQ(index.stats().evicted_blocks, 1);
  EXPECT_EQ(index.stats().used_blocks, 2);
}

// ---- engines ----------------------------------------------------------------------------------

// Four conversations of three turns, round robin: each turn resends the conversation so far (its
// prompt, the reply, a new user message), so turn t + 1 shares turn t's prompt and reply.
struct Conversations {
  std::vector<std::vector<int32_t>> history;
  explicit Conversations(uint32_t seed) {
    std::mt19937 rng(seed);
    for (int c = 0; c < 4; ++c) history.push_back(RandomTokens(rng, 70));
  }
};

std::vector<std::vector<int32_t>> RunChat(const EngineConfig& config, const SamplingParams& params,
                                          EngineStats* stats = nullptr, std::vector<SystemMetric>* metrics = nullptr) {
  auto engine = test::MakeEngine(config);
  if (!engine) return {};
  Conversations chat(11);
  std::mt19937 rng(12);
  std::vector<std::vector<int32_t>> replies;
  for (int turn = 0; turn < 3; ++turn) {
    for (size_t c = 0; c < chat.history.size(); ++c) {
      std::vector<int32_t>& h = chat.history[c];
      SamplingParams p = params;
      p.seed = 100 * turn + c;
      const auto reply = test::GenerateAll(*engine, {h}, p, false).at(0);
      replies.push_back(reply);
      h.insert(h.end(), reply.begin(), reply.end());
      const std::vector<int32_t> user = RandomTokens(rng, 20);
      h.insert(h.end(), user.begin(), user.end());
    }
  }
  if (stats) *stats = engine->stats();
  if (metrics) *metrics = engine->SystemMetrics(engine->stats());
  return replies;
}

// The value of a system metric (NaN: absent).
double SystemMetricValue(const std::vector<SystemMetric>& metrics, const std::string& name) {
  for (const SystemMetric& m : metrics) {
    if (m.name == name) return m.value;
  }
  return std::nan("");
}

EngineConfig SmallPool() {
  EngineConfig c;
  c.block_size = 8;
  c.num_kv_blocks = 40;  // 320 tokens: one conversation's turn fits, not all four conversations' history
  c.max_model_len = 320;
  c.enable_prefix_caching = true;
  return c;
}

TEST(HostPrefixCacheEngine, MultiTurnChatGivesTheSameOutputsAndLoadsFromHostMemory) {
  for (const bool sampled : {false, true}) {
    SamplingParams p = test::Greedy(12);
    if (sampled) {
      p.temperature = 0.8f;
      p.top_p = 0.9f;
    }
    EngineConfig plain = SmallPool();
    plain.enable_prefix_caching = false;
    const auto reference = RunChat(plain, p);
    ASSERT_EQ(reference.size(), 12u);

    EngineStats device_only;
    std::vector<SystemMetric> device_only_metrics;
    EXPECT_EQ(RunChat(SmallPool(), p, &device_only, &device_only_metrics), reference) << (sampled ? "sampled" : "greedy");
    EXPECT_EQ(device_only.host_prefix_cache.hit_blocks, 0);
    // Its metrics are there when it is off (zeros, not gaps).
    EXPECT_EQ(SystemMetricValue(device_only_metrics, "kvflow:host_prefix_cache_hit_blocks_total"), 0.0);

    EngineConfig tier = SmallPool();
    tier.host_prefix_cache.num_blocks = 64;
    EngineStats with_tier;
    std::vector<SystemMetric> with_tier_metrics;
    EXPECT_EQ(RunChat(tier, p, &with_tier, &with_tier_metrics), reference) << (sampled ? "sampled" : "greedy");
    const HostPrefixCacheStats& h = with_tier.host_prefix_cache;
    EXPECT_GT(h.saved_blocks, 0);
    EXPECT_GT(h.hit_blocks, 0) << "later turns find their conversation's blocks in host memory";
    EXPECT_EQ(h.loaded_blocks, h.hit_blocks);
    EXPECT_EQ(h.capacity_blocks, 64);
    EXPECT_LE(h.used_blocks, 64);
    EXPECT_GT(h.bytes_loaded, 0);
    EXPECT_EQ(SystemMetricValue(with_tier_metrics, "kvflow:host_prefix_cache_hit_blocks_total"), static_cast<double>(h.hit_blocks));
    EXPECT_EQ(SystemMetricValue(with_tier_metrics, "kvflow:host_prefix_cache_bytes_loaded_total"),
              static_cast<double>(h.bytes_loaded));
    // Every block the tier supplied is one the engine did not compute.
    EXPECT_LT(with_tier.prompt_tokens_processed, device_only.prompt_tokens_processed);
  }
}

TEST(HostPrefixCacheEngine, ComposesWithSwapPreemptionNgramAndADraftModel) {
  const SamplingParams p = test::Greedy(12);
  EngineConfig plain = SmallPool();
  const auto reference = RunChat(plain, p);

  EngineConfig swap = SmallPool();
  swap.host_prefix_cache.num_blocks = 32;
  swap.num_kv_blocks = 30;
  swap.max_model_len = 240;
  swap.preemption_mode = "swap";
  swap.num_host_kv_blocks = 30;
  EngineConfig swap_reference = swap;
  swap_reference.host_prefix_cache = {};
  EngineStats s;
  EXPECT_EQ(RunChat(swap, p, &s), RunChat(swap_reference, p)) << "swap preemption";
  EXPECT_GT(s.host_prefix_cache.hit_blocks, 0);

  EngineConfig ngram = SmallPool();
  ngram.host_prefix_cache.num_blocks = 64;
  ngram.speculative.method = "ngram";
  EXPECT_EQ(RunChat(ngram, p, &s), reference) << "ngram speculation";
  EXPECT_GT(s.host_prefix_cache.hit_blocks, 0);

  // The draft model's pool follows the target's block tables: its blocks are saved and loaded too.
  EngineConfig draft = SmallPool();
  draft.host_prefix_cache.num_blocks = 64;
  draft.speculative.model = "tiny-random-draft";
  draft.speculative.num_tokens = 3;
  EngineConfig draft_reference = draft;
  draft_reference.host_prefix_cache = {};
  EngineStats d;
  EXPECT_EQ(RunChat(draft, p, &d), reference) << "draft model";
  EngineStats d_ref;
  RunChat(draft_reference, p, &d_ref);
  EXPECT_GT(d.host_prefix_cache.hit_blocks, 0);
  // Drafts proposed from loaded blocks are the drafts proposed from computed ones.
  EXPECT_EQ(d.spec.num_accepted_tokens, d_ref.spec.num_accepted_tokens);
}

TEST(HostPrefixCacheEngine, RefusesWhatItCannotServe) {
  EngineConfig no_prefix;
  no_prefix.host_prefix_cache.num_blocks = 8;
  auto e = test::CreateTinyEngine(no_prefix);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("prefix caching"), std::string::npos) << e.status().ToString();

  EngineConfig offload = SmallPool();
  offload.host_prefix_cache.num_blocks = 8;
  offload.kv_offload.enabled = true;
  offload.preemption_mode = "recompute";
  e = test::CreateTinyEngine(offload);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("host prefix cache"), std::string::npos) << e.status().ToString();
  EXPECT_NE(e.status().message().find("kv_offload"), std::string::npos) << e.status().ToString();

  for (const bool prefix : {false, true}) {
    EngineConfig negative = SmallPool();
    negative.enable_prefix_caching = prefix;
    negative.host_prefix_cache.bytes = -1;
    e = test::CreateTinyEngine(negative);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().ToString();
  }

  EngineConfig too_small = SmallPool();
  too_small.host_prefix_cache.bytes = 100;  // less than one block
  e = test::CreateTinyEngine(too_small);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("no host blocks"), std::string::npos) << e.status().ToString();
}

}  // namespace
}  // namespace kvflow
