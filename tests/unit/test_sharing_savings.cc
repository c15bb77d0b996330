// Memory saved by block sharing on Alpaca prompts (vLLM §6.3, Fig. 15: 6.1–9.8 % for parallel
// sampling and 37.6–55.2 % for beam search with OPT-13B). Runs SmolLM2-135M when
// models/ has it (tiny-random otherwise), prints the figures, and checks that sharing saves
// blocks and that beam search saves more than parallel sampling.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "kvflow/engine.h"

namespace kvflow {
namespace {

const std::string kAlpaca = std::string(KVFLOW_SOURCE_DIR) + "/../shared/datasets/alpaca/alpaca_5000.json";
const std::string kSmolLM2 = std::string(KVFLOW_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
constexpr int kNumPrompts = 8;
constexpr int kMaxOutput = 48;

struct Saving {
  double saved = 0.0;  // 1 - physical / logical, summed over steps
  int64_t steps = 0;
};

Saving Measure(Engine& engine, const std::vector<std::vector<int32_t>>& prompts, const std::vector<int>& out_lens,
               const SamplingParams& base) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams p = base;
    p.max_tokens = out_lens[i];
    EXPECT_TRUE(engine.AddRequest(prompts[i], p).ok());
  }
  int64_t logical = 0, physical = 0, steps = 0;
  while (engine.HasUnfinishedRequests()) {
    EXPECT_TRUE(engine.Step().ok());
    const EngineStats s = engine.stats();
    logical += s.kv_blocks_logical;
    physical += s.kv_blocks_total - s.kv_blocks_free;
    ++steps;
  }
  EXPECT_EQ(engine.stats().kv_blocks_free, engine.stats().kv_blocks_total);
  return {logical > 0 ? 1.0 - static_cast<double>(physical) / static_cast<double>(logical) : 0.0, steps};
}

TEST(SharingSavings, ParallelSamplingAndBeamSearchOnAlpaca) {
  if (!std::filesystem::exists(kAlpaca)) GTEST_SKIP() << kAlpaca << " not present (the ../shared datasets)";
  const bool real_model = std::filesystem::exists(kSmolLM2);
  EngineConfig c;
  c.model = real_model ? kSmolLM2 : "tiny-random";
  c.block_size = 16;
  c.num_threads = 2;
  c.max_model_len = 1024;
  auto engine_or = Engine::Create(c);
  ASSERT_TRUE(engine_or.ok()) << engine_or.status().ToString();
  Engine& engine = *engine_or.value();

  const auto data = nlohmann::json::parse(std::ifstream(kAlpaca));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int> out_lens;
  for (size_t i = 0; prompts.size() < kNumPrompts && i < data.size(); ++i) {
    std::string prompt = data[i]["instruction"].get<std::string>();
    const std::string input = data[i]["input"].get<std::string>();
    if (!input.empty()) prompt += "\n" + input;
    const auto out = engine.tokenizer().Encode(data[i]["output"].get<std::string>(), false);
    prompts.push_back(engine.tokenizer().Encode(prompt, engine.tokenizer().add_bos()));
    out_lens.push_back(std::clamp(static_cast<int>(out.size()), 1, kMaxOutput));
  }

  nlohmann::json report = {{"model", real_model ? "SmolLM2-135M-Instruct Q4_1" : "tiny-random"},
                           {"block_size", c.block_size}, {"prompts", kNumPrompts}, {"max_output", kMaxOutput}};
  std::printf("blocks saved by sharing on %d Alpaca prompts (%s, block size %d, outputs = reference length <= %d)\n",
              kNumPrompts, real_model ? "SmolLM2-135M" : "tiny-random", c.block_size, kMaxOutput);
  for (int width : {2, 4, 6}) {
    SamplingParams sample;
    sample.temperature = 1.0f;
    sample.ignore_eos = true;
    sample.n = width;
    sample.seed = 1;
    const Saving ps = Measure(engine, prompts, out_lens, sample);
    SamplingParams beam;
    beam.temperature = 0.0f;
    beam.ignore_eos = true;
    beam.use_beam_search = true;
    beam.n = width;
    const Saving bs = Measure(engine, prompts, out_lens, beam);
    std::printf("  n = %d: parallel sampling %5.1f %%, beam search %5.1f %%\n", width, 100 * ps.saved, 100 * bs.saved);
    report["parallel_sampling"][std::to_string(width)] = ps.saved;
    report["beam_search"][std::to_string(width)] = bs.saved;
    EXPECT_GT(ps.saved, 0.0);
    // At the same width (the comparison the vLLM paper makes): across widths it depends on the
    // model's outputs (on an AVX2-only CPU, beams of 2 save 46.6% against 55.3% for 6 samples).
    EXPECT_GT(bs.saved, ps.saved) << "n = " << width << ": beams share more than independent samples";
  }
  std::ofstream("sharing_savings.json") << report.dump(2) << "\n";
}

}  // namespace
}  // namespace kvflow
