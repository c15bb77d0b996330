// Engines on the built-in tiny-random model, shared by the engine tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "kvflow/engine.h"
#include "forward/llama_model.h"
#include "model/llama_weights.h"

namespace kvflow::test {

inline Result<std::unique_ptr<Engine>> CreateTinyEngine(EngineConfig c = {}, const EvaluationOptions& evaluation = {}) {
  c.model = "tiny-random";
  c.num_threads = 2;
  KVFLOW_ASSIGN_OR_RETURN(auto engine, CreateEvaluationEngine(c, evaluation));
  return std::unique_ptr<Engine>(std::move(engine));
}

// An engine the test expects to be created (nullptr, with a test failure, otherwise).
inline std::unique_ptr<Engine> MakeEngine(EngineConfig c = {}, const EvaluationOptions& evaluation = {}) {
  auto e = CreateTinyEngine(c, evaluation);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

inline SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

struct Generated {
  std::vector<std::vector<int32_t>> tokens;  // per prompt
  std::vector<std::vector<float>> logprobs;  // each token's
};

// Runs every prompt to completion in one batch and returns each one's tokens and their logprobs;
// with vary_seed, request i gets seed 1000 + i.
inline Generated GenerateAllWithLogprobs(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                         const SamplingParams& base, bool vary_seed) {
  Generated out;
  out.tokens.resize(prompts.size());
  out.logprobs.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams p = base;
    if (vary_seed) p.seed = 1000 + i;
    auto id = engine.AddRequest(prompts[i], p, [&out, i](const StreamEvent& e) {
      for (const auto& t : e.tokens) {
        out.tokens[i].push_back(t.token);
        out.logprobs[i].push_back(t.logprob);
      }
    });
    EXPECT_TRUE(id.ok()) << id.status().ToString();
  }
  while (engine.HasUnfinishedRequests()) {
    auto st = engine.Step();
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    if (!st.ok()) break;
  }
  return out;
}

// GenerateAllWithLogprobs' tokens.
inline std::vector<std::vector<int32_t>> GenerateAll(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                                     const SamplingParams& base, bool vary_seed) {
  return GenerateAllWithLogprobs(engine, prompts, base, vary_seed).tokens;
}

struct EngineSetup {
  const char* name;
  EngineConfig config;
};

// The memory setups a lossless feature must keep outputs under: plain, prefix caching, and a pool
// small enough that 6 sequences growing to ~110 tokens are preempted by swap or by recompute.
inline std::vector<EngineSetup> EngineSetups() {
  std::vector<EngineSetup> s;
  s.push_back({"default", {}});
  EngineConfig prefix;
  prefix.enable_prefix_caching = true;
  s.push_back({"prefix caching", prefix});
  for (const char* mode : {"swap", "recompute"}) {
    EngineConfig small;
    small.num_kv_blocks = 24;  // 384 tokens for 6 sequences growing to ~110: preemption
    small.max_model_len = 256;
    small.preemption_mode = mode;
    s.push_back({mode, small});
  }
  return s;
}

// Prefill of all but the last of `tokens` with every row's logits, then one decode step (a GEMV), through
// a fresh CPU backend built on `w` (2 threads; 8 KV blocks of 16 in a shuffled table).
inline std::vector<float> RunLogits(const ModelConfig& config, LlamaWeights w, const std::vector<int32_t>& tokens) {
  KvCacheLayout layout{config.num_layers, 8, config.num_kv_heads, 16, config.head_dim};
  auto backend = CpuBackend::Create(config, std::move(w), layout, 0, 2).value();
  LlamaModel model(*backend);
  std::vector<BlockId> table = {3, 1, 6, 0};
  ForwardBatch prefill;
  prefill.tokens.assign(tokens.begin(), tokens.end() - 1);
  SequenceSlice s;
  s.num_tokens = static_cast<int32_t>(prefill.tokens.size());
  s.context_len = s.num_tokens;
  s.block_table = table;
  s.logits = LogitsMode::kAll;
  for (int32_t i = 0; i < s.num_tokens; ++i) prefill.positions.push_back(i);
  prefill.seqs.push_back(s);
  std::vector<float> logits, step;
  EXPECT_TRUE(model.Forward(prefill, logits).ok());
  ForwardBatch decode;
  decode.tokens = {tokens.back()};
  decode.positions = {s.num_tokens};
  s.num_tokens = 1;
  s.context_len += 1;
  s.logits = LogitsMode::kLast;
  decode.seqs.push_back(s);
  EXPECT_TRUE(model.Forward(decode, step).ok());
  logits.insert(logits.end(), step.begin(), step.end());
  return logits;
}

}  // namespace kvflow::test
