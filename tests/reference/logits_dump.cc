// Runs kvflow on token-id prompts and writes what the HF reference script compares:
//   logits of every position (all prompts in one batch, prefilled in two chunks through a paged
//   cache with shuffled block placement) and, optionally, greedy continuations from the Engine.
// --device cuda runs the same on the CUDA backend (--dtype fp16 or bf16); without a GPU it exits
// with 77, the code the reference tests report as skipped.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "forward/llama_model.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "model/llama_weights.h"
#include "model/rope.h"
#include "model/tensor_source.h"

namespace {

constexpr int kSkip = 77;  // ctest SKIP_RETURN_CODE of the reference tests

int Fail(const kvflow::Status& st) {
  std::cerr << "error: " << st.ToString() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Dump kvflow logits and greedy tokens for the HF reference comparison"};
  std::string model, prompts_path, logits_path, greedy_path;
  int chunk = 0, greedy_tokens = 0, block_size = 16, max_model_len = 0;
  app.add_option("--model", model)->required();
  app.add_option("--prompts", prompts_path, "JSON list of token-id lists")->required();
  app.add_option("--out-logits", logits_path, "float32 logits, prompt after prompt, all positions")->required();
  app.add_option("--chunk", chunk, "prefill the first `chunk` tokens in a separate step (0: half)");
  app.add_option("--block-size", block_size);
  app.add_option("--max-model-len", max_model_len,
                 "the context the engine serves (0: the model's); picks LongRoPE's short or long factors");
  app.add_option("--greedy-tokens", greedy_tokens);
  app.add_option("--out-greedy", greedy_path);
  int beam_width = 0;
  std::string beams_path;
  app.add_option("--beam-width", beam_width, "also run beam search over --greedy-tokens tokens with this width");
  app.add_option("--out-beams", beams_path, "JSON: per prompt, the beams best first");
  std::string device = "cpu", dtype = "fp16";
  bool keep_quantized = false;
  app.add_flag("--keep-quantized", keep_quantized,
               "CPU: keep the file's block quantization and compute with it (as kvflow --dtype auto), not fp32");
  app.add_option("--device", device, "backend: cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "CUDA weights/activations/KV cache: fp16 or bf16")
      ->check(CLI::IsMember({"fp16", "bf16"}));
  CLI11_PARSE(app, argc, argv);
  const bool cuda = device == "cuda";
  if (cuda && kvflow::cuda::DeviceCount() == 0) {
    std::cerr << "skipped: --device cuda but no CUDA GPU is available (" << kvflow::cuda::DeviceDescription(0)
              << ")\n";
    return kSkip;
  }

  std::vector<std::vector<int32_t>> prompts;
  try {
    prompts = nlohmann::json::parse(std::ifstream(prompts_path)).get<std::vector<std::vector<int32_t>>>();
  } catch (const std::exception& e) {
    return Fail(kvflow::Status::InvalidArgument(prompts_path + ": " + e.what()));
  }

  auto files = kvflow::OpenModelFiles(model);
  if (!files.ok()) return Fail(files.status());
  kvflow::SelectRopeFactorsForContext(files->config,
                                      max_model_len > 0 ? max_model_len : files->config.max_position_embeddings);
  const kvflow::ModelConfig config = files->config;
  auto weights = kvflow::LoadLlamaWeights(
      *files->tensors, config, files->gguf_rope_permuted,
      keep_quantized && !cuda ? kvflow::WeightFormat::kKeepQuantized : kvflow::WeightFormat::kF32);
  if (!weights.ok()) return Fail(weights.status());

  kvflow::KvCacheLayout layout{config.num_layers, 0, config.num_kv_heads, block_size, config.head_dim};
  for (const auto& p : prompts) layout.num_blocks += kvflow::BlocksForTokens(static_cast<int64_t>(p.size()), block_size);
  layout.num_blocks += 7;  // spare blocks so placement is not a permutation of a dense range
  std::unique_ptr<kvflow::Backend> backend;
  if (cuda) {
    // The same pool as on the CPU, and limits that hold every prompt in one step: all sequences,
    // all their tokens (more than either chunk has), the longest prompt plus the greedy tokens
    // (capped at what the pool holds; the logits here need only the longest prompt).
    int64_t total_tokens = 0, longest = 0;
    for (const auto& p : prompts) {
      total_tokens += static_cast<int64_t>(p.size());
      longest = std::max(longest, static_cast<int64_t>(p.size()));
    }
    const int64_t pool_tokens = static_cast<int64_t>(layout.num_blocks) * block_size;
    kvflow::CudaBackendOptions o;
    o.dtype = dtype;
    o.block_size = block_size;
    o.num_kv_blocks = layout.num_blocks;
    o.max_num_seqs = std::max(1, static_cast<int>(prompts.size()));
    o.max_num_batched_tokens = static_cast<int>(std::max<int64_t>(1, total_tokens));
    o.max_model_len = static_cast<int>(
        std::max<int64_t>(1, std::max(longest, std::min(longest + std::max(0, greedy_tokens), pool_tokens))));
    o.enable_cuda_graphs = true;
    auto created = kvflow::CreateCudaBackend(config, weights.value(), o);
    if (!created.ok()) return Fail(created.status());
    backend = std::move(created.value());
    weights.value() = kvflow::LlamaWeights{};  // uploaded; free the host copy
  } else {
    auto created = kvflow::CpuBackend::Create(config, std::move(weights.value()), layout, /*num_host_blocks=*/0, 0);
    if (!created.ok()) return Fail(created.status());
    backend = std::move(created.value());
  }

  // Shuffled physical blocks: the reference must not depend on blocks being contiguous.
  std::vector<kvflow::BlockId> pool(static_cast<size_t>(layout.num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(1234));
  size_t next_block = 0;
  std::vector<std::vector<kvflow::BlockId>> tables;
  for (const auto& p : prompts) {
    const int n = kvflow::BlocksForTokens(static_cast<int64_t>(p.size()), block_size);
    tables.emplace_back(pool.begin() + static_cast<long>(next_block), pool.begin() + static_cast<long>(next_block + n));
    next_block += static_cast<size_t>(n);
  }

  // Two steps per prompt: [0, split) then [split, n), both batched across prompts.
  std::vector<std::vector<float>> per_prompt(prompts.size());
  const int64_t V = config.vocab_size;
  for (int step = 0; step < 2; ++step) {
    kvflow::ForwardBatch batch;
    std::vector<size_t> members;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int n = static_cast<int>(prompts[i].size());
      const int split = chunk > 0 ? std::min(chunk, n) : (n + 1) / 2;
      const int begin = step == 0 ? 0 : split, end = step == 0 ? split : n;
      if (end <= begin) continue;
      kvflow::SequenceSlice s;
      s.token_offset = static_cast<int32_t>(batch.tokens.size());
      s.num_tokens = end - begin;
      s.context_len = end;
      s.block_table = tables[i];
      s.logits = kvflow::LogitsMode::kAll;
      for (int t = begin; t < end; ++t) {
        batch.tokens.push_back(prompts[i][static_cast<size_t>(t)]);
        batch.positions.push_back(t);
      }
      batch.seqs.push_back(s);
      members.push_back(i);
    }
    if (batch.seqs.empty()) continue;
    std::vector<float> logits;
    if (auto st = kvflow::LlamaModel(*backend).Forward(batch, logits); !st.ok()) return Fail(st);
    int64_t row = 0;
    for (size_t k = 0; k < members.size(); ++k) {
      const int64_t rows = batch.seqs[k].num_tokens;
      auto& dst = per_prompt[members[k]];
      dst.insert(dst.end(), logits.begin() + row * V, logits.begin() + (row + rows) * V);
      row += rows;
    }
  }
  std::ofstream out(logits_path, std::ios::binary);
  for (const auto& l : per_prompt) out.write(reinterpret_cast<const char*>(l.data()), static_cast<std::streamsize>(l.size() * sizeof(float)));
  if (!out) return Fail(kvflow::Status::IoError("cannot write " + logits_path));

  if (greedy_tokens > 0) {
    backend.reset();
    kvflow::EngineConfig ec;
    ec.model = model;
    ec.device = device;
    // On the CPU the exact fp32 mode, as transformers computes (the default keeps Q4 weights
    // quantized and the KV cache in fp16).
    ec.dtype = cuda ? dtype : "f32";
    ec.block_size = block_size;
    ec.max_model_len = max_model_len > 0 ? max_model_len : 4096;
    auto engine = kvflow::Engine::Create(ec);
    if (!engine.ok()) return Fail(engine.status());
    kvflow::SamplingParams sp;
    sp.temperature = 0.0f;
    sp.max_tokens = greedy_tokens;
    sp.ignore_eos = true;
    std::vector<std::vector<int32_t>> greedy(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto id = engine.value()->AddRequest(prompts[i], sp, [&greedy, i](const kvflow::StreamEvent& e) {
        for (const auto& t : e.tokens) greedy[i].push_back(t.token);
      });
      if (!id.ok()) return Fail(id.status());
    }
    while (engine.value()->HasUnfinishedRequests()) {
      auto step = engine.value()->Step();
      if (!step.ok()) return Fail(step.status());
    }
    std::ofstream(greedy_path) << nlohmann::json(greedy).dump();

    if (beam_width > 0) {
      kvflow::SamplingParams bp = sp;
      bp.use_beam_search = true;
      bp.n = beam_width;
      std::vector<std::vector<std::vector<int32_t>>> beams(prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) {
        beams[i].resize(static_cast<size_t>(beam_width));
        auto id = engine.value()->AddRequest(prompts[i], bp, [&beams, i](const kvflow::StreamEvent& e) {
          for (const auto& t : e.tokens) beams[i][static_cast<size_t>(e.index)].push_back(t.token);
        });
        if (!id.ok()) return Fail(id.status());
      }
      while (engine.value()->HasUnfinishedRequests()) {
        auto step = engine.value()->Step();
        if (!step.ok()) return Fail(step.status());
      }
      std::ofstream(beams_path) << nlohmann::json(beams).dump();
    }
  }
  return 0;
}
