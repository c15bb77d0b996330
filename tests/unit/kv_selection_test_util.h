// Shared by the KV selection and KV offload tests: the tiny-random model's CPU backend, random
// prompts, and a skewing file calibrated on it.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend_factory.h"
#include "infinigen/calibration.h"
#include "infinigen/skew_file.h"

namespace kvflow::test {

// A path in the temp directory unique to this process: ctest runs each test in its own process,
// several at once, and a suite's files must not be another process's.
inline std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvflow_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

inline std::vector<int32_t> RandomTokens(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 10)) + 5;
  return t;
}

// The three prompts (90, 37 and 150 tokens) the engine tests decode together.
inline std::vector<std::vector<int32_t>> ThreePrompts() {
  return {RandomTokens(90, 1, 256), RandomTokens(37, 2, 256), RandomTokens(150, 3, 256)};
}

// The tiny-random model's CPU backend (fp32 weights), with room for `tokens`: resident or with the
// KV pool offloaded, KV elements of `kv_dtype`.
inline std::unique_ptr<Backend> TinyCpuBackend(int tokens, bool offload = false, const std::string& kv_dtype = "f32") {
  auto files = OpenModelFiles("tiny-random");
  EXPECT_TRUE(files.ok());
  EngineConfig c;
  c.model = "tiny-random";
  c.num_threads = 2;
  c.dtype = "f32";
  c.kv_cache_dtype = kv_dtype;
  c.max_model_len = tokens;
  c.num_kv_blocks = tokens / c.block_size + 2;
  c.num_host_kv_blocks = 0;
  c.kv_offload.enabled = offload;
  auto weights = LoadWeightsFor(files.value(), c);
  EXPECT_TRUE(weights.ok());
  auto backend = CreateBackend(c, true, files->config, std::move(weights.value()));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return std::move(backend).value();
}

// Calibrates tiny-random's skewing on 256 random tokens and writes it to `path`. 30% of the columns
// (19 of 64; the default is 50%): the tests' margins for 16-bit arithmetic were set on these scores.
inline void WriteTinySkewFile(const std::string& path) {
  auto backend = TinyCpuBackend(256);
  SkewCalibrationOptions options;
  options.partial_ratio = 0.3;
  auto t = CalibrateSkew(*backend, RandomTokens(256, 9, backend->model_config().vocab_size), options);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(WriteSkewTable(t.value(), path).ok());
}

}  // namespace kvflow::test
