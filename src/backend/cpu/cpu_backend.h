// The CPU backend: weights (fp32, the exact reference mode, or kept in the file's block
// quantization), fp32 activations and paged KV cache in host memory, and the decoder's primitives
// over them (forward/llama_model.h runs the layer loop).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "backend/cpu/paged_attention.h"
#include "backend/cpu/quant_gemm.h"
#include "model/llama_weights.h"
#include "model/rope.h"
#include "util/thread_pool.h"

namespace kvflow {

class CpuBackend final : public Backend, public KvBlockScoring, public OffloadedKvPool, public KvPacking {
 public:
  // Allocates the KV pool described by `layout` and a swap pool of `num_host_blocks` blocks
  // (its pages are only touched when something is swapped out); OutOfMemory if the host cannot
  // hold them. `num_threads` (>= 1) workers, the stepping thread included, run each step. A q4
  // `kv_element` needs head_dim a multiple of 32 (InvalidArgument otherwise).
  //
  // With `kv_offload` the pool is the offload tier's host pool (EngineConfig::kv_offload) and two
  // layers' staging buffers stand for the device memory attention reads; there is no swap pool
  // then (num_host_blocks must be 0). The "device" and "host" are the same memory here, so the
  // copies cost what they cost in RAM: this runs the mechanism and counts its bytes, it does not
  // model a PCIe link.
  static Result<std::unique_ptr<CpuBackend>> Create(const ModelConfig& config, LlamaWeights weights,
                                                    const KvCacheLayout& layout, int num_host_blocks,
                                                    int num_threads, cpu::KvElement kv_element = cpu::KvElement::kF32,
                                                    bool kv_offload = false);

  Status RunStep(const ForwardBatch& batch, const LogitsSink& sink, const std::function<Status()>& layers,
                 bool capturable) override;
  Status Embed() override;
  Status RmsNorm(int layer, LayerWeight norm, bool add_delta) override;
  Status Linear(int layer, LayerWeight weight, Activation in, Activation out) override;
  Status QkNorm(int layer) override;
  Status Rotary(int layer) override;
  Status WriteKv(int layer) override;
  Status Attention(int layer) override;
  Status AttentionOverSelection(int layer, std::span<const KvHeadSelection> selection) override;
  Status SiluMul() override;
  Status GeluTanhMul() override;
  Status NormDelta(int layer, LayerWeight norm) override;
  Status MoeMlp(int layer) override;
  Result<std::span<float>> HostActivation(Activation which) override;
  Result<std::span<float>> HostResidual() override;
  Status AddDelta() override;

  Status ReadActivationRows(Activation which, int64_t first_row, int64_t rows, std::span<float> out) override;
  Status ReadKv(int layer, int kv, std::span<const int64_t> slots, std::span<float> out) override;
  Status ReadFinalHidden(int64_t first_row, int64_t rows, std::span<float> out) override;
  Status PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) override;
  Status UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) override;

  Status ResetKvBlockScores(int64_t size) override;
  Status ScoreKvBlocks(int layer, std::span<const KvBlockScoreJob> jobs) override;
  Status SelectTopKvBlocks(std::span<const KvBlockSelectJob> jobs, std::vector<int32_t>& chosen) override;
  Status ReadKvBlockScores(int64_t offset, std::span<float> out) override;

  // Whether the pool is offloaded (the OffloadedKvPool capability is offered only then).
  bool kv_offloaded() const { return staging_key_ != nullptr; }
  Status PrefetchKv(int layer, std::span<const KvHeadSelection> selection) override;
  KvOffloadStats kv_offload_stats() const override { return offload_stats_; }
  // The resident blocks stay in the pool's own array (this backend's "device" is host memory too):
  // a resident step reads and writes them there and stages nothing.
  Status KeepResident(BlockId first) override;
  BlockId resident_begin() const override { return resident_begin_; }

 protected:
  void* FindCapability(BackendCapability id) const override { return OfferCapabilities(this, id, kv_offloaded()); }

 public:

  Status CopyBlocks(std::span<const BlockMove> moves, BlockCopyKind kind) override;
  Status TransferKv(std::span<const KvTransfer> transfers) override;
  const KvCacheLayout& kv_layout() const override { return layout_; }
  int num_host_blocks() const override { return host_layout_.num_blocks; }
  int64_t kv_token_bytes() const override {
    return 2 * static_cast<int64_t>(cpu::KvPoolBytes(kv_element_, static_cast<size_t>(layout_.num_kv_heads) * layout_.head_dim));
  }
  const ModelConfig& model_config() const override { return config_; }
  std::string Describe() const override;

  cpu::KvElement kv_element() const { return kv_element_; }
  // A row of the step's activations (valid inside and right after a step), for hooks and tests.
  const float* activation(Activation which) { return Buffer(which); }

 private:
  CpuBackend(const ModelConfig& config, LlamaWeights weights, const KvCacheLayout& layout);
  std::vector<float>& Storage(Activation which);
  float* Buffer(Activation which) { return Storage(which).data(); }
  int64_t Width(Activation which) const;
  const std::vector<float>& Norm(int layer, LayerWeight which) const;
  const WeightMatrix& Matrix(int layer, LayerWeight which) const;
  // The bias of a matrix (empty when it has none).
  const std::vector<float>& Bias(int layer, LayerWeight which) const;
  // y[M, matrix.rows] = x[M, matrix.cols] * matrix^T, part by part (each in its own format).
  void Matmul(const WeightMatrix& matrix, const float* x, int64_t M, float* y);
  Status Head(const LogitsSink& sink);
  // kAttention over the given view lists (one per slice, or one per slice and KV head).
  void RunAttention(int layer, std::span<const std::vector<int64_t>> view_slots);
  // The slots each (slice, KV head) reads at a layer under `selection` (views where it is empty or
  // a slice's per_head is 0), into head_view_slots_.
  void HeadReadLists(std::span<const KvHeadSelection> selection);
  // Copies what `selection` reads of `layer` (views: whole blocks of the cached tokens; selections:
  // each KV head's selected rows; never the step's own tokens, which WriteKv stages) from the pool
  // to the layer's staging buffer.
  void StageKv(int layer, std::span<const KvHeadSelection> selection);
  // Attention's side of the offload: the layer's staging buffer must hold `selection`'s reads
  // (fetched now when nothing was prefetched for the layer).
  Status EnsureStaged(int layer, std::span<const KvHeadSelection> selection);
  uint8_t* Staging(int kv, int layer) const;
  // The copies of PackKv (into `pack_to`) and UnpackKv (from `unpack_from`; pack_to null).
  void CopyPacked(int layer, std::span<const int64_t> slots, std::byte* pack_to, const std::byte* unpack_from);

  ModelConfig config_;
  LlamaWeights weights_;
  KvCacheLayout layout_;
  KvCacheLayout host_layout_;  // same shape, num_blocks = swap blocks
  // The step's parallel loops run here (made current on the stepping thread for the step).
  std::unique_ptr<ThreadPool> pool_;
  RopeFrequencies rope_;
  RopeFrequencies local_rope_;  // the sliding layers' (ModelConfig::local_rope_theta > 0)
  // K (kv 0) or V (kv 1) pool of one layer in a tier.
  uint8_t* Pool(KvTier tier, int kv, int layer) const;

  cpu::KvElement kv_element_ = cpu::KvElement::kF32;
  std::unique_ptr<uint8_t[]> key_cache_;
  std::unique_ptr<uint8_t[]> value_cache_;
  std::unique_ptr<uint8_t[]> host_key_cache_;
  std::unique_ptr<uint8_t[]> host_value_cache_;
  // Offloaded pool: the staging buffers of two layers (KvStagingLedger::kBuffers), what each
  // holds, and the counters.
  std::unique_ptr<uint8_t[]> staging_key_;
  std::unique_ptr<uint8_t[]> staging_value_;
  KvStagingLedger staged_;
  KvOffloadStats offload_stats_;
  BlockId resident_begin_ = 0;   // KeepResident; num_blocks until then
  bool resident_step_ = false;   // the step reads and writes resident blocks only
  // Whether this step's attention reads staging buffers (an offloaded pool's non-resident step).
  bool staged_step() const { return kv_offloaded() && !resident_step_; }
  // The step being run, its slots and the slots each sequence's view reads.
  const ForwardBatch* batch_ = nullptr;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> slots_;
  std::vector<std::vector<int64_t>> view_slots_;
  std::vector<std::vector<int64_t>> head_view_slots_;  // AttentionOverSelection: one per (slice, KV head)
  std::vector<float> block_scores_;  // chunk scores (ScoreKvBlocks)
  // Activations, reused across steps.
  std::vector<float> residual_, hidden_, qkv_, attention_, delta_, gate_up_, mlp_, final_rows_;
  // MoeMlp's scratch: router logits, one expert's gathered rows, its gate|up, activation, output.
  std::vector<float> router_logits_, expert_in_, expert_gate_up_, expert_act_, expert_out_;
  std::vector<std::vector<std::pair<int64_t, float>>> moe_routed_;  // expert -> (token, weight)
  std::vector<float> speculative_qkv_;
  // The input rows of the current product, quantized for a weight format (reused across calls).
  cpu::QuantizedActivations quantized_input_;
};

}  // namespace kvflow
