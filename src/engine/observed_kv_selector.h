// A KvSelector that reports what each layer's attention read under a selection, for the engine-level
// selection oracle (tests/unit/test_kv_selection.cc: the reads equal an independent recomputation of
// the selector's rule, and attention over exactly them reproduces the engine's logits). It forwards
// every hook to the selector it wraps and changes nothing.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/kv_selector.h"

namespace kvflow {

// layer; the step's batch and seq_ids (seq_ids[i] for batch.seqs[i]); the selection attention reads
// (empty, or per_head 0 for a slice: its whole view).
using KvReadObserver = std::function<void(int layer, const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                                          std::span<const KvHeadSelection> selection)>;

class ObservedKvSelector final : public KvSelector, private LayerHooks {
 public:
  ObservedKvSelector(std::unique_ptr<KvSelector> inner, KvReadObserver observer)
      : inner_(std::move(inner)), observer_(std::move(observer)) {}

  LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                      std::span<const uint8_t> selecting) override {
    hooks_ = inner_->ForStep(batch, seq_ids, selecting);
    seq_ids_.assign(seq_ids.begin(), seq_ids.end());
    return hooks_ ? this : nullptr;
  }
  void Forget(int64_t seq_id) override { inner_->Forget(seq_id); }
  void AddStats(KvSelectionStats& stats) const override { inner_->AddStats(stats); }

 private:
  Status BeforeAttention(const LayerContext& ctx) override { return hooks_->BeforeAttention(ctx); }
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override {
    const std::span<const KvHeadSelection> selection = hooks_->AttentionSelection(ctx);
    // A selection speculated on the device is read back (waiting for it) for the observer only.
    auto* device = ctx.backend.As<DeviceKvSpeculation>();
    if (device != nullptr &&
        std::any_of(selection.begin(), selection.end(), [](const KvHeadSelection& s) { return s.speculated; })) {
      // Failing, the observer sees the slot-less selections (which no oracle accepts).
      if (device->ReadSpeculatedSelection(ctx.layer, selection, read_back_).ok()) {
        observer_(ctx.layer, ctx.batch, seq_ids_, read_back_);
        return selection;
      }
    }
    observer_(ctx.layer, ctx.batch, seq_ids_, selection);
    return selection;
  }
  std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) override {
    return hooks_->UpcomingSelection(layer);
  }
  Status AfterMlpInput(const LayerContext& ctx) override { return hooks_->AfterMlpInput(ctx); }
  Status AfterAttention(const LayerContext& ctx) override { return hooks_->AfterAttention(ctx); }
  bool capturable() const override { return hooks_->capturable(); }

  std::unique_ptr<KvSelector> inner_;
  KvReadObserver observer_;
  LayerHooks* hooks_ = nullptr;
  std::vector<int64_t> seq_ids_;
  std::vector<KvHeadSelection> read_back_;
};

}  // namespace kvflow
