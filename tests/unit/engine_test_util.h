// Engines on the built-in tiny-random model, shared by the engine tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "kvflow/engine.h"

namespace kvflow::test {

inline Result<std::unique_ptr<Engine>> CreateTinyEngine(EngineConfig c = {}) {
  c.model = "tiny-random";
  c.num_threads = 2;
  return Engine::Create(c);
}

// An engine the test expects to be created (nullptr, with a test failure, otherwise).
inline std::unique_ptr<Engine> MakeEngine(EngineConfig c = {}) {
  auto e = CreateTinyEngine(c);
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
