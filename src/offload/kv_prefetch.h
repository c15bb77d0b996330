// The prefetch schedule of an offloaded KV pool (EngineConfig::kv_offload): layer i's K/V are
// fetched from the host pool while layer i-1 still computes, as soon as what layer i reads is
// known. Without a selector that is at layer i-1's start (its views: FlexGen's full offload, the
// fetch hiding behind all of layer i-1); with InfiniGen, right after its speculation of layer i
// (the fetch of the selected tokens hides behind layer i-1's MLP, or behind all of it with the
// paper's layer-input point). Layer 0, and layers whose selection is made only at the layer (H2O),
// are fetched by their attention (Backend::PrefetchKv).
//
// It wraps the step's other hooks (the KV selector's), forwarding every point to them first.
#pragma once

#include "forward/llama_model.h"

namespace kvflow {

class KvPrefetchHooks final : public WrappingHooks {
 public:
  LayerHooks* Wrap(LayerHooks* inner, int num_layers) override;

  Status BeforeAttention(const LayerContext& ctx) override;
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override;
  std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) override;
  Status AfterAttention(const LayerContext& ctx) override;
  Status AfterMlpInput(const LayerContext& ctx) override;
  Status AfterAttentionOutput(const LayerContext& ctx) override {
    return inner_ ? inner_->AfterAttentionOutput(ctx) : Status::Ok();
  }
  Status AfterMlpOutput(const LayerContext& ctx) override { return inner_ ? inner_->AfterMlpOutput(ctx) : Status::Ok(); }
  bool capturable() const override { return inner_ == nullptr || inner_->capturable(); }

 private:
  // Prefetches layer ctx.layer + 1 once its reads are known (and it was not yet).
  Status MaybePrefetchNext(const LayerContext& ctx);

  LayerHooks* inner_ = nullptr;
  int num_layers_ = 0;
  int prefetched_through_ = -1;  // the last layer whose prefetch was issued this step
};

}  // namespace kvflow
