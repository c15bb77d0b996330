// Runs the engine's steps on a Backend: the step's block moves, then one forward pass over the
// scheduled batch, sampling on the device when the core hands it sample rows.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "engine/executor.h"
#include "kv/block_manager.h"

namespace kvflow {

// The backend's view of a step: every scheduled sequence's new tokens, their positions and the
// sequence's block table; logits for the sequences that sample after this step.
ForwardBatch BuildForwardBatch(const SchedulerOutput& sched, const BlockManager& blocks);

class ModelExecutor final : public Executor {
 public:
  // `backend` and `blocks` (the block tables the scheduler keeps) must outlive the executor.
  ModelExecutor(Backend& backend, const BlockManager& blocks) : backend_(backend), blocks_(blocks) {}

  bool SupportsSampling() const override { return backend_.SupportsDeviceSampling(); }
  Status MoveBlocks(const SchedulerOutput& sched) override;
  Status Run(const SchedulerOutput& sched, std::optional<std::span<const DeviceSampleRow>> sample_rows,
             ExecutorOutput& out) override;

 private:
  Backend& backend_;
  const BlockManager& blocks_;
  std::vector<float> logits_;
  std::vector<SampledToken> sampled_;
};

}  // namespace kvflow
