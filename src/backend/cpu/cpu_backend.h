// The CPU reference backend: fp32 Llama forward over a paged KV cache in host memory.
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

  Status Forward(const ForwardBatch& batch, std::vector<float>& logits) override;
  Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) override;
  const KvCacheLayout& kv_layout() const override { return layout_; }
  int num_host_blocks() const override { return host_layout_.num_blocks; }
  const ModelConfig& model_config() const override { return config_; }
  std::string Describe() const override;

  // Direct access to one layer's pools, for tests that compare against contiguous attention.
  const float* key_cache(int layer) const { return key_cache_.data() + layer * layout_.layer_stride(); }
  const float* value_cache(int layer) const { return value_cache_.data() + layer * layout_.layer_stride(); }

 private:
  CpuBackend(const ModelConfig& config, LlamaWeights weights, const KvCacheLayout& layout);

  ModelConfig config_;
  LlamaWeights weights_;
  KvCacheLayout layout_;
  KvCacheLayout host_layout_;  // same shape, num_blocks = swap blocks
  // OpenMP's thread count is per calling thread: it is applied on the thread that runs Forward
  // (an AsyncEngine steps on a thread of its own). 0: OpenMP's default.
  int num_threads_ = 0;
  RopeFrequencies rope_;
  std::vector<float> key_cache_;
  std::vector<float> value_cache_;
  std::unique_ptr<float[]> host_key_cache_;
  std::unique_ptr<float[]> host_value_cache_;
  // Activations, reused across steps.
  std::vector<float> x_, h_, qkv_, q_, k_, v_, attn_, gate_up_, act_, final_h_;
};

}  // namespace kvflow
