// Runs the engine's steps on a Backend: the step's block moves, then one forward pass over the
// scheduled batch, sampling on the device when the core hands it sample rows.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "engine/executor.h"
#include "kv/block_manager.h"
#include "model/llama_model.h"

namespace kvflow {

// The backend's view of a step: every scheduled sequence's new tokens (drafts included), their
// positions, the sequence's block table and the logit rows it needs.
ForwardBatch BuildForwardBatch(const SchedulerOutput& sched, const BlockManager& blocks,
                               std::span<const LogitsMode> logits);

class ModelExecutor final : public Executor {
 public:
  // `backend` and `blocks` (the block tables the scheduler keeps) must outlive the executor.
  ModelExecutor(Backend& backend, const BlockManager& blocks) : backend_(backend), model_(backend), blocks_(blocks) {}

  bool SupportsSampling() const override { return backend_.SupportsDeviceSampling(); }
  Status MoveBlocks(const SchedulerOutput& sched) override;
  Status Run(const SchedulerOutput& sched, std::span<const LogitsMode> logits,
             std::optional<std::span<const DeviceSampleRow>> sample_rows, ExecutorOutput& out) override;

 private:
  Backend& backend_;
  LlamaModel model_;
  const BlockManager& blocks_;
  std::vector<float> logits_;
  std::vector<SampledToken> sampled_;
};

}  // namespace kvflow
