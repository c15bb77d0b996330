#include "forward/llama_model.h"

namespace kvflow {

Status LlamaModel::Forward(const ForwardBatch& batch, std::vector<float>& logits) {
  LogitsSink sink;
  sink.host = &logits;
  return Run(batch, sink);
}

Status LlamaModel::ForwardAndSample(const ForwardBatch& batch, std::span<const DeviceSampleRow> rows,
                                    std::vector<SampledToken>& sampled, const std::function<void()>& await_constraints) {
  if (!backend_.SupportsDeviceSampling()) return Status::Unsupported("this backend does not sample on the device");
  LogitsSink sink;
  sink.sample_rows = rows;
  sink.sampled = &sampled;
  if (await_constraints) sink.await_constraints = &await_constraints;
  return Run(batch, sink);
}

Status LlamaModel::Run(const ForwardBatch& batch, const LogitsSink& sink) {
  // A reducer talks to the other ranks from the host between kernels: no graph holds that.
  const bool capturable = (hooks_ == nullptr || hooks_->capturable()) && reducer_ == nullptr && stage_ == nullptr;
  return backend_.RunStep(batch, sink, [&] { return Layers(batch); }, capturable);
}

Status LlamaModel::Layers(const ForwardBatch& batch) {
  Backend& b = backend_;
  if (stage_ != nullptr && !stage_->first()) {
    KVFLOW_RETURN_IF_ERROR(stage_->ReceiveResidual(b));
  } else {
    KVFLOW_RETURN_IF_ERROR(b.Embed());
    if (b.model_config().vocab_shard_rows > 0) {
      if (reducer_ == nullptr) return Status::InvalidArgument("a vocabulary shard's embedding without the other ranks");
      KVFLOW_RETURN_IF_ERROR(reducer_->ReduceEmbedding(b));
    }
  }
  const int num_layers = b.model_config().num_layers;
  const ModelConfig& config = b.model_config();
  const bool qk_norm = config.qk_norm;
  const bool moe = config.num_experts > 0;
  const bool sandwich = config.sandwich_norms;
  const bool gelu = config.mlp_activation == MlpActivation::kGeluTanh;
  for (int layer = 0; layer < num_layers; ++layer) {
    // The previous layer's MLP output joins the residual stream inside this norm.
    KVFLOW_RETURN_IF_ERROR(b.RmsNorm(layer, LayerWeight::kAttnNorm, /*add_delta=*/layer > 0));
    KVFLOW_RETURN_IF_ERROR(b.Linear(layer, LayerWeight::kQkv, Activation::kHidden, Activation::kQkv));
    if (qk_norm) KVFLOW_RETURN_IF_ERROR(b.QkNorm(layer));
    KVFLOW_RETURN_IF_ERROR(b.Rotary(layer));
    KVFLOW_RETURN_IF_ERROR(b.WriteKv(layer));
    const LayerContext ctx{layer, batch, b};
    if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->BeforeAttention(ctx));
    const std::span<const KvHeadSelection> selection =
        hooks_ ? hooks_->AttentionSelection(ctx) : std::span<const KvHeadSelection>{};
    KVFLOW_RETURN_IF_ERROR(selection.empty() ? b.Attention(layer) : b.AttentionOverSelection(layer, selection));
    if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->AfterAttention(ctx));
    KVFLOW_RETURN_IF_ERROR(b.Linear(layer, LayerWeight::kO, Activation::kAttention, Activation::kDelta));
    if (reducer_) KVFLOW_RETURN_IF_ERROR(reducer_->ReduceDelta(b));
    if (sandwich) KVFLOW_RETURN_IF_ERROR(b.NormDelta(layer, LayerWeight::kPostAttnNorm));
    if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->AfterAttentionOutput(ctx));
    KVFLOW_RETURN_IF_ERROR(b.RmsNorm(layer, LayerWeight::kFfnNorm, /*add_delta=*/true));
    if (moe) {
      KVFLOW_RETURN_IF_ERROR(b.MoeMlp(layer));
      if (reducer_) KVFLOW_RETURN_IF_ERROR(reducer_->ReduceDelta(b));
      if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->AfterMlpInput(ctx));
    } else {
      KVFLOW_RETURN_IF_ERROR(b.Linear(layer, LayerWeight::kGateUp, Activation::kHidden, Activation::kGateUp));
      if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->AfterMlpInput(ctx));
      KVFLOW_RETURN_IF_ERROR(gelu ? b.GeluTanhMul() : b.SiluMul());
      KVFLOW_RETURN_IF_ERROR(b.Linear(layer, LayerWeight::kDown, Activation::kMlp, Activation::kDelta));
      if (reducer_) KVFLOW_RETURN_IF_ERROR(reducer_->ReduceDelta(b));
    }
    if (sandwich) KVFLOW_RETURN_IF_ERROR(b.NormDelta(layer, LayerWeight::kPostFfnNorm));
    if (hooks_) KVFLOW_RETURN_IF_ERROR(hooks_->AfterMlpOutput(ctx));
    if (stage_) stage_->AfterLayer();
  }
  KVFLOW_RETURN_IF_ERROR(b.AddDelta());
  if (stage_ != nullptr && !stage_->last()) KVFLOW_RETURN_IF_ERROR(stage_->SendResidual(b));
  return Status::Ok();
}

Status HookChain::BeforeAttention(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) KVFLOW_RETURN_IF_ERROR(h->BeforeAttention(ctx));
  return Status::Ok();
}

std::span<const KvHeadSelection> HookChain::AttentionSelection(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) {
    if (auto selection = h->AttentionSelection(ctx); !selection.empty()) return selection;
  }
  return {};
}

std::optional<std::span<const KvHeadSelection>> HookChain::UpcomingSelection(int layer) {
  for (LayerHooks* h : hooks_) {
    if (auto selection = h->UpcomingSelection(layer)) return selection;
  }
  return std::nullopt;
}

Status HookChain::AfterMlpInput(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) KVFLOW_RETURN_IF_ERROR(h->AfterMlpInput(ctx));
  return Status::Ok();
}

Status HookChain::AfterAttention(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) KVFLOW_RETURN_IF_ERROR(h->AfterAttention(ctx));
  return Status::Ok();
}

Status HookChain::AfterAttentionOutput(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) KVFLOW_RETURN_IF_ERROR(h->AfterAttentionOutput(ctx));
  return Status::Ok();
}

Status HookChain::AfterMlpOutput(const LayerContext& ctx) {
  for (LayerHooks* h : hooks_) KVFLOW_RETURN_IF_ERROR(h->AfterMlpOutput(ctx));
  return Status::Ok();
}

bool HookChain::capturable() const {
  for (const LayerHooks* h : hooks_) {
    if (!h->capturable()) return false;
  }
  return true;
}

}  // namespace kvflow
