// The CPU reference backend: fp32 weights, activations and paged KV cache in host memory, and the
// decoder's primitives over them (model/llama_model.h runs the layer loop).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "model/llama_weights.h"
#include "model/rope.h"

namespace kvflow {

class CpuBackend final : public Backend {
 public:
  // Allocates the KV pool described by `layout` and a swap pool of `num_host_blocks` blocks
  // (its pages are only touched when something is swapped out); OutOfMemory if the host cannot
  // hold them.
  static Result<std::unique_ptr<CpuBackend>> Create(const ModelConfig& config, LlamaWeights weights,
                                                    const KvCacheLayout& layout, int num_host_blocks,
                                                    int num_threads);

  Status RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                 bool capturable) override;
  Status Embed() override;
  Status RmsNorm(int layer, LayerWeight norm, bool add_delta) override;
  Status Linear(int layer, LayerWeight weight, Activation in, Activation out) override;
  Status Rotary() override;
  Status WriteKv(int layer) override;
  Status Attention(int layer) override;
  Status SiluMul() override;
  Status AddDelta() override;

  Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) override;
  Status TransferKv(std::span<const KvTransfer> transfers) override;
  const KvCacheLayout& kv_layout() const override { return layout_; }
  int num_host_blocks() const override { return host_layout_.num_blocks; }
  const ModelConfig& model_config() const override { return config_; }
  std::string Describe() const override;

  // Direct access to one layer's pools, for tests that compare against contiguous attention.
  const float* key_cache(int layer) const { return key_cache_.data() + layer * layout_.layer_stride(); }
  const float* value_cache(int layer) const { return value_cache_.data() + layer * layout_.layer_stride(); }
  // A row of the step's activations (valid inside and right after a step), for hooks and tests.
  const float* activation(Activation which) { return Buffer(which); }

 private:
  CpuBackend(const ModelConfig& config, LlamaWeights weights, const KvCacheLayout& layout);
  std::vector<float>& Storage(Activation which);
  float* Buffer(Activation which) { return Storage(which).data(); }
  int64_t Width(Activation which) const;
  const std::vector<float>& Weight(int layer, LayerWeight which) const;
  Status Head(const LogitsSink& sink);

  ModelConfig config_;
  LlamaWeights weights_;
  KvCacheLayout layout_;
  KvCacheLayout host_layout_;  // same shape, num_blocks = swap blocks
  // OpenMP's thread count is per calling thread: it is applied on the thread that runs the step
  // (an AsyncEngine steps on a thread of its own). 0: OpenMP's default.
  int num_threads_ = 0;
  RopeFrequencies rope_;
  std::vector<float> key_cache_;
  std::vector<float> value_cache_;
  std::unique_ptr<float[]> host_key_cache_;
  std::unique_ptr<float[]> host_value_cache_;
  // The step being run, its slots and the slots each sequence's view reads.
  const ForwardBatch* batch_ = nullptr;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> slots_;
  std::vector<std::vector<int64_t>> view_slots_;
  // Activations, reused across steps.
  std::vector<float> residual_, hidden_, qkv_, attention_, delta_, gate_up_, mlp_, final_rows_;
};

}  // namespace kvflow
