#include "offload/kv_prefetch.h"

namespace kvflow {

LayerHooks* KvPrefetchHooks::Wrap(LayerHooks* inner, int num_layers) {
  inner_ = inner;
  num_layers_ = num_layers;
  prefetched_through_ = -1;
  return this;
}

Status KvPrefetchHooks::BeforeAttention(const LayerContext& ctx) {
  if (inner_) KVFLOW_RETURN_IF_ERROR(inner_->BeforeAttention(ctx));
  return MaybePrefetchNext(ctx);
}

std::span<const KvHeadSelection> KvPrefetchHooks::AttentionSelection(const LayerContext& ctx) {
  return inner_ ? inner_->AttentionSelection(ctx) : std::span<const KvHeadSelection>{};
}

std::optional<std::span<const KvHeadSelection>> KvPrefetchHooks::UpcomingSelection(int layer) {
  return inner_ ? inner_->UpcomingSelection(layer) : std::span<const KvHeadSelection>{};
}

Status KvPrefetchHooks::AfterAttention(const LayerContext& ctx) {
  if (inner_) KVFLOW_RETURN_IF_ERROR(inner_->AfterAttention(ctx));
  return MaybePrefetchNext(ctx);
}

Status KvPrefetchHooks::AfterMlpInput(const LayerContext& ctx) {
  if (inner_) KVFLOW_RETURN_IF_ERROR(inner_->AfterMlpInput(ctx));
  return MaybePrefetchNext(ctx);
}

Status KvPrefetchHooks::MaybePrefetchNext(const LayerContext& ctx) {
  const int next = ctx.layer + 1;
  if (next >= num_layers_ || prefetched_through_ >= next) return Status::Ok();
  // The staging buffer layer `next` reuses held layer next - 2, read by an attention that has run.
  const std::optional<std::span<const KvHeadSelection>> reads = UpcomingSelection(next);
  if (!reads) return Status::Ok();
  prefetched_through_ = next;
  OffloadedKvPool* pool = ctx.backend.As<OffloadedKvPool>();
  return pool != nullptr ? pool->PrefetchKv(next, *reads) : Status::Ok();
}

}  // namespace kvflow
