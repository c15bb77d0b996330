// The seam for features that choose which cached tokens attention reads, per layer and step
// (InfiniGen's speculated tokens, H2O's kept heavy hitters): the executor asks the selector for
// its layer hooks each step (forward/llama_model.h, LayerHooks::AttentionSelection), the engine
// core tells it when a sequence is gone and collects its counters.
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"
#include "kvflow/kv_selection.h"
#include "forward/llama_model.h"

namespace kvflow {

// Its StepHooks::ForStep gives the hooks for one step (null: none).
class KvSelector : public StepHooks {
 public:
  // The sequence is finished, failed, cancelled or preempted for recompute: drop its state.
  virtual void Forget(int64_t seq_id) = 0;
  virtual void AddStats(KvSelectionStats& stats) const = 0;
};

}  // namespace kvflow
