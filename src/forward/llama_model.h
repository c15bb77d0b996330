// The Llama decoder, written once over the primitives every backend provides (backend/backend.h):
//
//   embed -> per layer: [attn norm] -> QKV -> (q/k norm) -> RoPE -> KV write -> (hook) -> attention -> (hook)
//            -> O -> [add + ffn norm] -> gate_up -> SiLU*mul -> down (or the mixture of experts)
//            -> next layer's [add + norm]
//   -> add -> head (final norm, LM head) over the rows that want logits
//
// Each projection (QKV, O, gate_up, down) is one Linear, which adds the projection's bias when the
// model has one, so q/k get theirs before RoPE, as in HF.
//
// The families (Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen-MoE) are this one loop: their differences are
// fields of ModelConfig (biases, q/k norms, experts) that the loop and the primitives honour.
//
// Features that act inside the layer loop (speculative prefetch, KV send/recv, KV selection) plug
// in through LayerHooks, not through a copy of this loop.
#pragma once

#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/status.h"

namespace kvflow {

// What a hook sees at its point in the loop. The step's activations (Activation::kHidden: the
// layer's attention input, free for a hook to overwrite once the QKV projection has read it; kQkv: its Q, K and V, rotated; kAttention after attention) stay in the
// backend's memory, reachable through `backend`.
struct LayerContext {
  int layer = 0;
  const ForwardBatch& batch;
  Backend& backend;
};

// Named points in every layer where a feature may act.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  // After the layer's K/V are written to the cache, before its attention reads it.
  virtual Status BeforeAttention(const LayerContext& ctx) { return Status::Ok(); }
  // Per-slice token selections (backend.h, KvHeadSelection) the layer's attention reads instead of
  // the batch's views; empty: the views. Called after BeforeAttention.
  virtual std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) { return {}; }
  // What layer `layer`'s attention will read, where the hooks know it before that layer runs (an
  // offloaded KV pool prefetches it during the previous layer): nullopt: not known yet; an empty
  // span: every slice's view; else one KvHeadSelection per slice, as AttentionSelection will return.
  virtual std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) { return std::nullopt; }
  // Once the MLP has read its input (kGateUp holds the layer's gate and up projections, or, in a
  // mixture of experts, the experts have run already; the residual stream holds the layer's input
  // plus its attention output; kHidden is free).
  virtual Status AfterMlpInput(const LayerContext& ctx) { return Status::Ok(); }
  // After attention, before the output projection.
  virtual Status AfterAttention(const LayerContext& ctx) { return Status::Ok(); }
  // After the output projection, before its output (kDelta) joins the residual stream: where
  // tensor parallelism sums the ranks' partial projections.
  virtual Status AfterAttentionOutput(const LayerContext& ctx) { return Status::Ok(); }
  // After the MLP's down projection (kDelta), before it joins the residual stream: the same for
  // the MLP.
  virtual Status AfterMlpOutput(const LayerContext& ctx) { return Status::Ok(); }
  // Whether the hooks issue the same device work on every step, so a backend may record the step
  // as a CUDA graph and replay it (hooks that act on the host must say no).
  virtual bool capturable() const { return false; }
};

// A feature that acts inside the engine's own passes (engine/model_executor.h): for each step, the
// layer hooks to run with its batch, or null for none. seq_ids[i] is the id of the sequence of
// batch.seqs[i], and kv_selection[i] whether its request lets attention read a selection
// (SamplingParams::kv_selection). Every active feature's hooks run together (HookChain).
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  virtual LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                              std::span<const uint8_t> kv_selection) = 0;
};

// Hooks that act around every other feature's, seeing what they select (an offloaded KV pool's
// prefetch schedule fetches each layer's reads during the layer before).
class WrappingHooks : public LayerHooks {
 public:
  // The hooks for one step around `inner` (null: none).
  virtual LayerHooks* Wrap(LayerHooks* inner, int num_layers) = 0;
};

// Several features' hooks as one: every point runs each in the order added (the first error
// stops the rest); the selections are the first hook's that makes one (the systems declare that
// two selectors do not run together).
class HookChain final : public LayerHooks {
 public:
  void Clear() { hooks_.clear(); }
  void Add(LayerHooks* hooks) {
    if (hooks != nullptr) hooks_.push_back(hooks);
  }
  // Null when empty, the one hook alone, else the chain.
  LayerHooks* Collapse() { return hooks_.empty() ? nullptr : hooks_.size() == 1 ? hooks_.front() : this; }

  Status BeforeAttention(const LayerContext& ctx) override;
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override;
  std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) override;
  Status AfterMlpInput(const LayerContext& ctx) override;
  Status AfterAttention(const LayerContext& ctx) override;
  Status AfterAttentionOutput(const LayerContext& ctx) override;
  Status AfterMlpOutput(const LayerContext& ctx) override;
  bool capturable() const override;

 private:
  std::vector<LayerHooks*> hooks_;
};

// Tensor parallelism's seam (model_parallel/): after each row-parallel projection (the attention's
// output and the MLP's down projection) every rank holds a partial sum of kDelta; the reducer makes
// it the whole sum on every rank, before the sandwich norms and the hooks see it. Likewise the
// residual stream after a vocabulary shard's embedding (ModelConfig::vocab_shard_rows: each token's
// row on one rank, zeros on the others).
class DeltaReducer {
 public:
  virtual ~DeltaReducer() = default;
  virtual Status ReduceDelta(Backend& backend) = 0;
  virtual Status ReduceEmbedding(Backend& backend) = 0;
};

// Pipeline parallelism's seam (model_parallel/): the model on this rank is one stage, a run of
// consecutive layers. Every stage but the first takes the residual stream from the stage before in
// place of the embedding; every stage but the last hands it to the stage after once its layers have
// run (the batch it runs then asks for no logits).
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  virtual bool first() const = 0;
  virtual bool last() const = 0;
  // Fills backend.HostResidual() with the previous stage's output for this batch.
  virtual Status ReceiveResidual(Backend& backend) = 0;
  // Sends backend.HostResidual() on (it may return before the next stage has it).
  virtual Status SendResidual(Backend& backend) = 0;
  // After each layer: lets the transfers in flight advance (MPI moves a large message only inside
  // its calls).
  virtual void AfterLayer() {}
};

class LlamaModel {
 public:
  // `backend` holds the weights and the KV pools; it must outlive the model.
  explicit LlamaModel(Backend& backend, LayerHooks* hooks = nullptr) : backend_(backend), hooks_(hooks) {}

  // Runs the decoder on `batch`, writing each new token's K/V into its slot, and fills `logits`
  // with num_logit_rows() x vocab_size floats.
  Status Forward(const ForwardBatch& batch, std::vector<float>& logits);
  // Runs the decoder and samples each logit row on the device (rows: one per logit row, in order);
  // needs backend.SupportsDeviceSampling(). `await_constraints`: DeviceSampling's.
  Status ForwardAndSample(const ForwardBatch& batch, std::span<const DeviceSampleRow> rows,
                          std::vector<SampledToken>& sampled, const std::function<void()>& await_constraints = {});

  void set_hooks(LayerHooks* hooks) { hooks_ = hooks; }
  // Null: the model is whole on this backend.
  void set_delta_reducer(DeltaReducer* reducer) { reducer_ = reducer; }
  // Null: the model's layers are all on this rank.
  void set_pipeline_stage(PipelineStage* stage) { stage_ = stage; }
  Backend& backend() { return backend_; }

 private:
  Status Run(const ForwardBatch& batch, const LogitsSink& sink);
  Status Layers(const ForwardBatch& batch);

  Backend& backend_;
  LayerHooks* hooks_ = nullptr;
  DeltaReducer* reducer_ = nullptr;
  PipelineStage* stage_ = nullptr;
};

}  // namespace kvflow
