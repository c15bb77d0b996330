// Prompt logprobs (vLLM's prompt_logprobs) and the perplexity windows built on them: every prompt
// token's logprob from the engine equals log-softmax of a plain full-prompt forward pass, through
// chunked prefill, prefix caching (a scoring request computes every token), recompute preemption
// and requests that also generate; max_tokens 0 scores only.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "engine_test_util.h"
#include "eval/perplexity.h"
#include "forward/llama_model.h"
#include "model/tiny_random.h"

namespace kvflow {
namespace {

// log p(prompt[i + 1] | prompt[..i]) from one forward pass over the whole prompt, in double.
std::vector<double> ReferenceLogprobs(const std::vector<int32_t>& prompt) {
  auto files = MakeTinyRandomModel().value();
  LlamaWeights w = LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
  const int bs = 16;
  const int blocks = static_cast<int>(prompt.size()) / bs + 1;
  KvCacheLayout layout{files.config.num_layers, blocks, files.config.num_kv_heads, bs, files.config.head_dim};
  auto backend = CpuBackend::Create(files.config, std::move(w), layout, 0, 2).value();
  ForwardBatch b;
  b.tokens = prompt;
  b.positions.resize(prompt.size());
  std::iota(b.positions.begin(), b.positions.end(), 0);
  SequenceSlice s;
  s.num_tokens = static_cast<int32_t>(prompt.size());
  s.context_len = s.num_tokens;
  s.block_table.resize(static_cast<size_t>(blocks));
  std::iota(s.block_table.begin(), s.block_table.end(), 0);
  s.logits = LogitsMode::kAll;
  b.seqs.push_back(s);
  std::vector<float> logits;
  EXPECT_TRUE(LlamaModel(*backend).Forward(b, logits).ok());
  const size_t V = static_cast<size_t>(files.config.vocab_size);
  std::vector<double> out;
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const float* row = logits.data() + i * V;
    double mx = -INFINITY, sum = 0.0;
    for (size_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (size_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    out.push_back(double(row[size_t(prompt[i + 1])]) - mx - std::log(sum));
  }
  return out;
}

std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(3, 250);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = tok(rng);
  return p;
}

double MaxError(const std::vector<SampledToken>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) err = std::max(err, std::fabs(got[i].logprob - want[i]));
  return err;
}

TEST(PromptLogprobs, EqualAFullForwardThroughChunksPrefixHitsAndGeneration) {
  EngineConfig c;
  c.dtype = "f32";  // compared with the fp32 reference forward (fp32 KV cache)
  c.max_num_batched_tokens = 16;  // a 53-token prompt prefills in 4 chunks
  c.enable_prefix_caching = true;
  auto engine = test::MakeEngine(c);
  const std::vector<int32_t> prompt = RandomPrompt(53, 1);
  const std::vector<double> want = ReferenceLogprobs(prompt);

  SamplingParams score = test::Greedy(0);
  score.prompt_logprobs = 3;
  // Twice: the second run's prompt blocks are in the prefix cache, and must be computed anyway.
  for (int run = 0; run < 2; ++run) {
    auto out = engine->Generate(std::vector<std::string>{}, score);  // nothing; keeps the engine warm
    ASSERT_TRUE(out.ok());
    RequestOutput got;
    int events = 0;
    auto id = engine->AddRequest(prompt, score, [&](const StreamEvent& e) {
      ++events;
      if (!e.prompt_logprobs.empty()) got.prompt_logprobs = e.prompt_logprobs;
      EXPECT_TRUE(e.tokens.empty());
      if (e.request_finished) EXPECT_EQ(e.finish_reason, FinishReason::kLength);
    });
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
    EXPECT_EQ(events, 1);
    const double err = MaxError(got.prompt_logprobs, want);
    std::printf("  run %d: %zu prompt logprobs, max |err| vs a full forward %.2e\n", run, got.prompt_logprobs.size(), err);
    EXPECT_LT(err, 1e-4);
    for (size_t i = 0; i < got.prompt_logprobs.size(); ++i) {
      const SampledToken& t = got.prompt_logprobs[i];
      EXPECT_EQ(t.token, prompt[i + 1]);
      ASSERT_EQ(t.top_logprobs.size(), 3u);
      EXPECT_GE(t.top_logprobs[0].logprob, t.logprob - 1e-6f);
      EXPECT_GE(t.top_logprobs[0].logprob, t.top_logprobs[2].logprob);
    }
  }

  // With generation: the prompt logprobs come with the first token's event; greedy tokens are
  // those of a plain request.
  SamplingParams gen = test::Greedy(5);
  gen.prompt_logprobs = 0;
  auto with = engine->Generate(std::string("hello world, hello world"), gen);
  auto plain = engine->Generate(std::string("hello world, hello world"), test::Greedy(5));
  ASSERT_TRUE(with.ok() && plain.ok());
  EXPECT_EQ(with->first().tokens, plain->first().tokens);
  EXPECT_EQ(with->prompt_logprobs.size(), with->prompt_tokens.size() - 1);
  EXPECT_LT(MaxError(with->prompt_logprobs, ReferenceLogprobs(with->prompt_tokens)), 1e-4);
  EXPECT_TRUE(plain->prompt_logprobs.empty());
}

TEST(PromptLogprobs, SurviveRecomputePreemptionWithoutDuplicates) {
  EngineConfig c;
  c.dtype = "f32";  // compared with the fp32 reference forward (fp32 KV cache)
  c.num_kv_blocks = 10;  // 160 tokens: two requests growing to 100 tokens each cannot both stay
  c.max_num_batched_tokens = 32;
  c.max_model_len = 128;
  c.preemption_mode = "recompute";
  auto engine = test::MakeEngine(c);
  SamplingParams p = test::Greedy(40);
  p.prompt_logprobs = 0;
  std::vector<std::vector<int32_t>> prompts = {RandomPrompt(60, 2), RandomPrompt(60, 3), RandomPrompt(60, 4)};
  std::vector<std::vector<SampledToken>> got(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(engine->AddRequest(prompts[i], p, [&, i](const StreamEvent& e) {
                        if (!e.prompt_logprobs.empty()) got[i] = e.prompt_logprobs;
                      }).ok());
  }
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
  EXPECT_GT(engine->stats().num_preemptions, 0) << "the pool was meant to force preemption";
  for (int i = 0; i < 3; ++i) EXPECT_LT(MaxError(got[i], ReferenceLogprobs(prompts[i])), 1e-4) << i;
}

TEST(PromptLogprobs, ScoringOnlyNeedsPromptLogprobsAndFitsMaxModelLen) {
  EngineConfig c;
  c.dtype = "f32";  // compared with the fp32 reference forward (fp32 KV cache)
  c.max_model_len = 64;
  auto engine = test::MakeEngine(c);
  SamplingParams p = test::Greedy(0);
  EXPECT_EQ(engine->AddRequest(RandomPrompt(8, 5), p).status().code(), StatusCode::kInvalidArgument);
  p.prompt_logprobs = 0;
  EXPECT_TRUE(engine->AddRequest(RandomPrompt(64, 5), p).ok()) << "a scoring request may fill the context";
  p.max_tokens = 1;
  EXPECT_FALSE(engine->AddRequest(RandomPrompt(64, 5), p).ok()) << "a generating one needs room for a token";
  p.prompt_logprobs = 21;
  EXPECT_FALSE(engine->AddRequest(RandomPrompt(8, 5), p).ok());
  p.prompt_logprobs = 0;
  p.max_tokens = 0;
  p.n = 2;
  EXPECT_FALSE(engine->AddRequest(RandomPrompt(8, 5), p).ok());
  while (engine->HasUnfinishedRequests()) ASSERT_TRUE(engine->Step().ok());
}

TEST(PerplexityWindows, SlidingWindowScoresEveryTokenOnceAndSecondHalfAsLlamaCpp) {
  auto w = PlanPerplexityWindows(10, 4, 2, PerplexityMethod::kSlidingWindow).value();
  // [0,4) scores 1..3; [2,6) scores 4,5; [4,8) 6,7; [6,10) 8,9.
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].score_from, 1);
  EXPECT_EQ(w[1].begin, 2);
  EXPECT_EQ(w[1].score_from, 4);
  EXPECT_EQ(w[3].end, 10);
  int64_t scored = 0;
  for (const auto& x : w) scored += x.end - x.score_from;
  EXPECT_EQ(scored, 9);
  auto flat = PlanPerplexityWindows(10, 4, 4, PerplexityMethod::kSlidingWindow).value();
  ASSERT_EQ(flat.size(), 3u);  // [0,4) [4,8) [8,10): each window's first token is context only
  EXPECT_EQ(flat[1].score_from, 5);
  auto half = PlanPerplexityWindows(10, 4, 0, PerplexityMethod::kSecondHalf).value();
  ASSERT_EQ(half.size(), 2u);  // whole chunks only
  EXPECT_EQ(half[0].score_from, 3);
  EXPECT_EQ(half[1].begin, 4);
  EXPECT_FALSE(PlanPerplexityWindows(10, 1, 1, PerplexityMethod::kSlidingWindow).ok());
  EXPECT_FALSE(PlanPerplexityWindows(10, 4, 5, PerplexityMethod::kSlidingWindow).ok());
  EXPECT_FALSE(PlanPerplexityWindows(3, 4, 0, PerplexityMethod::kSecondHalf).ok());
  EXPECT_FALSE(ParsePerplexityMethod("bogus").ok());
}

TEST(Perplexity, OverTheEngineEqualsTheReferenceLogprobs) {
  EngineConfig c;
  c.dtype = "f32";  // compared with the fp32 reference forward (fp32 KV cache)
  c.max_num_batched_tokens = 24;
  c.max_model_len = 32;
  auto engine = test::MakeEngine(c);
  const std::vector<int32_t> text = RandomPrompt(70, 9);
  PerplexityOptions o;
  o.ctx = 32;
  o.stride = 20;
  auto r = ComputePerplexity(*engine, text, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  double nll = 0.0;
  int64_t n = 0;
  const std::vector<PerplexityWindow> windows = PlanPerplexityWindows(70, 32, 20, PerplexityMethod::kSlidingWindow).value();
  for (const auto& w : windows) {
    const std::vector<int32_t> window(text.begin() + w.begin, text.begin() + w.end);
    const std::vector<double> lp = ReferenceLogprobs(window);
    for (int64_t pos = w.score_from; pos < w.end; ++pos) nll -= lp[size_t(pos - w.begin - 1)];
    n += w.end - w.score_from;
  }
  EXPECT_EQ(r->scored_tokens, 69);
  EXPECT_EQ(n, 69);
  EXPECT_NEAR(r->perplexity, std::exp(nll / double(n)), 1e-4 * r->perplexity);

  // By window position in spans of 8: the same logprobs summed by (pos - begin) / 8.
  o.position_chunk = 8;
  auto by_position = ComputePerplexity(*engine, text, o);
  ASSERT_TRUE(by_position.ok()) << by_position.status().ToString();
  std::vector<double> chunk_nll(4, 0.0);
  std::vector<int64_t> chunk_tokens(4, 0);
  for (const auto& w : windows) {
    const std::vector<int32_t> window(text.begin() + w.begin, text.begin() + w.end);
    const std::vector<double> lp = ReferenceLogprobs(window);
    for (int64_t pos = w.score_from; pos < w.end; ++pos) {
      chunk_nll[size_t((pos - w.begin) / 8)] -= lp[size_t(pos - w.begin - 1)];
      ++chunk_tokens[size_t((pos - w.begin) / 8)];
    }
  }
  ASSERT_EQ(by_position->chunk_nll.size(), 4u);
  EXPECT_EQ(by_position->chunk_tokens, chunk_tokens);
  for (size_t k = 0; k < 4; ++k) EXPECT_NEAR(by_position->chunk_nll[k], chunk_nll[k], 1e-3) << "span " << k;
  o.position_chunk = -1;
  EXPECT_FALSE(ComputePerplexity(*engine, text, o).ok());
}

// prompt_decode_from (teacher-forced decoding): the prompt prefills in chunks up to it, then one token
// per step, and the logprobs are still a full forward's; kvflow perplexity --decode-from scores only
// the decoded part of each window.
TEST(PromptLogprobs, DecodeFromRunsOneTokenPerStepPastItAndScoresTheSame) {
  EngineConfig c;
  c.dtype = "f32";
  c.max_num_batched_tokens = 16;
  c.kv_selection.method = "h2o";  // counts its decode-mode steps: exactly the tokens past decode_from
  c.kv_selection.h2o.budget = 1.0;
  auto engine = test::MakeEngine(c);
  const std::vector<int32_t> prompt = RandomPrompt(45, 4);
  SamplingParams score = test::Greedy(0);
  score.prompt_logprobs = 0;
  score.prompt_decode_from = 37;
  std::vector<SampledToken> got;
  ASSERT_TRUE(engine->AddRequest(prompt, score, [&](const StreamEvent& e) {
                      if (!e.prompt_logprobs.empty()) got = e.prompt_logprobs;
                    }).ok());
  int steps = 0;
  while (engine->HasUnfinishedRequests()) {
    ASSERT_TRUE(engine->Step().ok());
    ++steps;
  }
  // 37 tokens in chunks of 16 (16, 16, 5), then 8 one-token steps.
  EXPECT_EQ(steps, 3 + 8);
  EXPECT_EQ(engine->stats().kv_selection.decode_tokens, 8);
  EXPECT_LT(MaxError(got, ReferenceLogprobs(prompt)), 1e-4);
  score.prompt_decode_from = -1;
  EXPECT_FALSE(engine->AddRequest(prompt, score, nullptr).ok());

  // The perplexity windows: [0, 32) and [32, 64) of 70 tokens, each scoring positions 24.. only.
  c.max_model_len = 32;
  auto fresh = test::MakeEngine(c);
  const std::vector<int32_t> text = RandomPrompt(70, 9);
  PerplexityOptions o;
  o.ctx = 32;
  o.decode_from = 24;
  auto r = ComputePerplexity(*fresh, text, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  double nll = 0.0;
  for (int64_t begin : {0, 32}) {
    const std::vector<int32_t> window(text.begin() + begin, text.begin() + begin + 32);
    const std::vector<double> lp = ReferenceLogprobs(window);
    for (int64_t pos = 24; pos < 32; ++pos) nll -= lp[size_t(pos - 1)];
  }
  EXPECT_EQ(r->windows, 2);  // the last 6 tokens make no window past decode_from
  EXPECT_EQ(r->scored_tokens, 16);
  EXPECT_NEAR(r->perplexity, std::exp(nll / 16.0), 1e-4 * r->perplexity);
  EXPECT_EQ(fresh->stats().kv_selection.decode_tokens, 2 * 8);
  o.decode_from = 32;
  EXPECT_FALSE(ComputePerplexity(*fresh, text, o).ok());
}

}  // namespace
}  // namespace kvflow
