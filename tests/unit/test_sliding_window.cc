// Sliding-window attention end to end, on tiny-random-sliding-window (tiny-random as a Mistral whose
// queries see the last 24 positions). The engine releases the blocks behind the window as decoding
// goes; its greedy tokens must stay those of the masking alone (one token a step over a table of
// every block, nothing released), under prefix caching, preemption by swap and by recompute, and
// n-gram speculation (drafts verified, rejected ones truncated). The window must change the tokens
// (against tiny-random itself), a small pool must serve sequences it could not hold without the
// release, and what cannot run with a window is refused by name. (Hugging Face's Mistral and Phi-3
// are the reference for the mask itself: tests/reference/test_llama_reference.py.)
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "engine_test_util.h"
#include "forward/llama_model.h"
#include "model/llama_weights.h"
#include "model/tiny_random.h"

namespace kvflow {
namespace {

using test::EngineSetup;
using test::EngineSetups;
using test::GenerateAll;
using test::Greedy;

// Prompts of 1 to 70 tokens, some repetitive (so the n-gram drafter proposes), from the bytes.
std::vector<std::vector<int32_t>> Prompts() {
  std::vector<std::vector<int32_t>> prompts;
  for (int len : {1, 9, 30, 70}) {
    std::vector<int32_t> p;
    for (int i = 0; i < len; ++i) p.push_back(32 + (i * 37 + len) % 90);
    prompts.push_back(p);
  }
  std::vector<int32_t> repeat;
  for (int i = 0; i < 48; ++i) repeat.push_back(97 + i % 6);
  prompts.push_back(repeat);
  return prompts;
}

// Greedy decoding one token a step through LlamaModel on a CPU backend (fp32), every block of the
// table kept: what the engine must reproduce with the blocks behind the window released.
std::vector<int32_t> MaskOnlyGreedy(const ModelFiles& files, const std::vector<int32_t>& prompt, int new_tokens) {
  const ModelConfig& c = files.config;
  const int bs = 16;
  const int blocks = BlocksForTokens(static_cast<int64_t>(prompt.size()) + new_tokens, bs) + 1;
  KvCacheLayout layout{c.num_layers, blocks, c.num_kv_heads, bs, c.head_dim};
  auto backend = CpuBackend::Create(c, LoadLlamaWeights(*files.tensors, c, files.gguf_rope_permuted).value(), layout, 0, 2);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  LlamaModel model(*backend.value());
  std::vector<BlockId> table(static_cast<size_t>(blocks));
  std::iota(table.rbegin(), table.rend(), 0);  // reversed: a table is not the identity
  std::vector<int32_t> context = prompt, out;
  int32_t computed = 0;
  for (int step = 0; step < new_tokens; ++step) {
    ForwardBatch b;
    SequenceSlice s;
    s.num_tokens = static_cast<int32_t>(context.size()) - computed;
    s.context_len = static_cast<int32_t>(context.size());
    s.block_table = table;
    for (int32_t p = computed; p < s.context_len; ++p) {
      b.tokens.push_back(context[static_cast<size_t>(p)]);
      b.positions.push_back(p);
    }
    b.seqs.push_back(s);
    std::vector<float> logits;
    const Status st = model.Forward(b, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return out;
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    computed = s.context_len;
    context.push_back(next);
    out.push_back(next);
  }
  return out;
}

EngineConfig WindowConfig() {
  EngineConfig c;
  c.model = kTinyRandomSlidingWindowName;
  c.num_threads = 2;
  c.dtype = "f32";  // as the mask-only reference computes
  return c;
}

std::vector<std::vector<int32_t>> Generate(EngineConfig c, const std::vector<std::vector<int32_t>>& prompts, int n,
                                           EngineStats* stats = nullptr) {
  auto engine = CreateEvaluationEngine(c, {});
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  auto out = GenerateAll(*engine.value(), prompts, Greedy(n), false);
  if (stats) *stats = engine.value()->stats();
  return out;
}

TEST(SlidingWindow, EngineMatchesTheMaskWithBlocksReleasedUnderEveryMemorySetup) {
  const ModelFiles files = MakeBuiltInModel(kTinyRandomSlidingWindowName).value();
  ASSERT_EQ(files.config.sliding_window, kTinyRandomSlidingWindow);
  const auto prompts = Prompts();
  const int kNew = 100;
  std::vector<std::vector<int32_t>> reference;
  for (const auto& p : prompts) reference.push_back(MaskOnlyGreedy(files, p, kNew));

  std::vector<EngineSetup> setups = EngineSetups();
  EngineConfig ngram = WindowConfig();
  ngram.speculative.method = "ngram";
  setups.push_back({"n-gram speculation", ngram});
  EngineConfig ngram_prefix = ngram;
  ngram_prefix.enable_prefix_caching = true;
  setups.push_back({"n-gram speculation + prefix caching", ngram_prefix});
  for (const EngineSetup& setup : setups) {
    SCOPED_TRACE(setup.name);
    EngineConfig c = setup.config;
    c.model = kTinyRandomSlidingWindowName;
    c.num_threads = 2;
    c.dtype = "f32";
    // Twice: the second round hits the prefix cache where it is on, over blocks the first round
    // released from its sequences' windows.
    for (int round = 0; round < 2; ++round) {
      EngineStats stats;
      auto engine = CreateEvaluationEngine(c, {});
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      for (int r = 0; r <= round; ++r) {
        const auto got = GenerateAll(*engine.value(), prompts, Greedy(kNew), false);
        for (size_t i = 0; i < prompts.size(); ++i) {
          EXPECT_EQ(got[i], reference[i]) << "prompt " << i << " round " << r;
        }
      }
      stats = engine.value()->stats();
      if (c.enable_prefix_caching && round == 1) EXPECT_GT(stats.prefix_cache_hit_blocks, 0);
    }
  }
}

// The same weights without the window decode differently once a sequence is past 24 tokens: the
// comparison above checks the window, not a model that ignores it.
TEST(SlidingWindow, TheWindowChangesTheTokens) {
  const auto prompts = Prompts();
  EngineConfig plain = WindowConfig();
  plain.model = kTinyRandomName;
  const auto windowed = Generate(WindowConfig(), prompts, 60);
  const auto whole = Generate(plain, prompts, 60);
  ASSERT_EQ(windowed.size(), whole.size());
  int differ = 0;
  for (size_t i = 0; i < prompts.size(); ++i) differ += windowed[i] != whole[i];
  EXPECT_GE(differ, 3) << "the window barely changes the greedy tokens";
}

// 4 sequences of 30 + 170 tokens need 13 blocks of 16 each without the release (52 in all); with
// it each holds at most 3 (24 tokens behind the newest, and its newest block), so a pool of 16
// serves them all at once, never preempting.
TEST(SlidingWindow, ReleasedBlocksLetASmallPoolServeLongSequences) {
  EngineConfig c = WindowConfig();
  c.num_kv_blocks = 16;
  c.max_model_len = 256;
  std::vector<std::vector<int32_t>> prompts;
  for (int s = 0; s < 4; ++s) {
    std::vector<int32_t> p;
    for (int i = 0; i < 30; ++i) p.push_back(40 + (i * 7 + s * 13) % 80);
    prompts.push_back(p);
  }
  EngineStats stats;
  const auto got = Generate(c, prompts, 170, &stats);
  ASSERT_EQ(got.size(), prompts.size());
  const ModelFiles files = MakeBuiltInModel(kTinyRandomSlidingWindowName).value();
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(got[i].size(), 170u);
    EXPECT_EQ(got[i], MaskOnlyGreedy(files, prompts[i], 170)) << "sequence " << i;
  }
  EXPECT_EQ(stats.num_preemptions, 0) << "the released blocks did not return to the pool";
  EXPECT_EQ(stats.kv_blocks_free, stats.kv_blocks_total);
}

// What reads the KV other than position by position is refused, naming itself and the window.
TEST(SlidingWindow, SystemsThatReadTheKvOtherwiseAreRefused) {
  std::vector<std::pair<std::string, EngineConfig>> refused;
  EngineConfig c = WindowConfig();
  c.kv_selection.method = "h2o";
  refused.push_back({"kv_selection h2o", c});
  c = WindowConfig();
  c.speculative.method = "triforce";
  refused.push_back({"speculative method triforce", c});
  c = WindowConfig();
  c.kv_offload.enabled = true;
  refused.push_back({"kv_offload", c});
  for (const auto& [what, config] : refused) {
    auto engine = CreateEvaluationEngine(config, {});
    ASSERT_FALSE(engine.ok()) << what;
    EXPECT_NE(engine.status().message().find(what), std::string::npos) << engine.status().ToString();
    EXPECT_NE(engine.status().message().find("sliding-window"), std::string::npos) << engine.status().ToString();
  }
}

}  // namespace
}  // namespace kvflow
