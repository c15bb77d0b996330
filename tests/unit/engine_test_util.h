// Engines on the built-in tiny-random model, shared by the engine tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "engine/evaluation.h"
#include "kvflow/engine.h"

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

}  // namespace kvflow::test
