// The seam for features that choose which cached tokens attention reads, per layer and step
// (InfiniGen's speculated tokens, H2O's kept heavy hitters): the executor asks the selector for
// its layer hooks each step (model/llama_model.h, LayerHooks::AttentionSelection), the engine
// core tells it when a sequence is gone and collects its counters.
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"
#include "kvflow/engine.h"
#include "model/llama_model.h"

namespace kvflow {

class KvSelector {
 public:
  virtual ~KvSelector() = default;
  // The hooks for one step (null: none). seq_ids[i] is the id of batch.seqs[i]'s sequence and
  // selecting[i] whether its request lets attention read a selection (SamplingParams::kv_selection).
  virtual LayerHooks* ForStep(const ForwardBatch& batch, std::span<const int64_t> seq_ids,
                              std::span<const uint8_t> selecting) = 0;
  // The sequence is finished, failed, cancelled or preempted for recompute: drop its state.
  virtual void Forget(int64_t seq_id) = 0;
  virtual void AddStats(KvSelectionStats& stats) const = 0;
};

}  // namespace kvflow
