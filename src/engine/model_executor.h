// Runs the engine's steps on a Backend: the step's block moves, then one forward pass over the
// scheduled batch, sampling on the device when the core hands it sample rows.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "engine/executor.h"
#include "engine/kv_selector.h"
#include "kv/block_manager.h"
#include "model/llama_model.h"
#include "offload/kv_prefetch.h"

namespace kvflow {

// The backend's view of a step: every scheduled sequence's new tokens (drafts included), their
// positions, the sequence's block table and the logit rows it needs.
ForwardBatch BuildForwardBatch(const SchedulerOutput& sched, const BlockManager& blocks,
                               std::span<const LogitsMode> logits);

class ModelExecutor final : public Executor {
 public:
  // `backend` and `blocks` (the block tables the scheduler keeps) must outlive the executor.
  ModelExecutor(Backend& backend, const BlockManager& blocks) : backend_(backend), model_(backend), blocks_(blocks) {}

  // Several KV caches in one engine: `follower` holds a second model (a draft model) whose KV pool
  // follows the target's block tables. Every block move is applied to its pool too, and every
  // step's tokens run through it after the target's pass (no logits), so each computed position
  // has the follower's K/V in the same slot. Its pool must have at least the target's device and
  // host blocks; blocks past those are its own (spec/draft_model.h's scratch). A follower's failed
  // pass is logged and leaves its cache stale there, never fails the step: a draft model only
  // proposes.
  void AddFollower(Backend& follower);
  // Hooks a feature runs inside the target's passes (null: none); must outlive the executor.
  void set_step_hooks(StepHooks* hooks) { step_hooks_ = hooks; }
  // The feature that chooses what attention reads (null: none); must outlive the executor. Its
  // hooks take the place of the step hooks (the engine does not combine the two).
  void set_kv_selector(KvSelector* selector) { kv_selector_ = selector; }

  bool SupportsSampling() const override { return backend_.SupportsDeviceSampling(); }
  Status MoveBlocks(const SchedulerOutput& sched) override;
  Status Run(const SchedulerOutput& sched, std::span<const LogitsMode> logits,
             std::optional<std::span<const DeviceSampleRow>> sample_rows, ExecutorOutput& out) override;

 private:
  Backend& backend_;
  LlamaModel model_;
  std::vector<LlamaModel> followers_;
  StepHooks* step_hooks_ = nullptr;
  KvSelector* kv_selector_ = nullptr;
  KvPrefetchHooks prefetch_hooks_;
  std::vector<int64_t> seq_ids_;
  std::vector<uint8_t> selecting_;
  const BlockManager& blocks_;
  Status RunTarget(const ForwardBatch& batch, std::optional<std::span<const DeviceSampleRow>> sample_rows,
                   ExecutorOutput& out);
  // Runs the step's batch through every follower (no logits).
  void RunFollowers(const ForwardBatch& target_batch);

  std::vector<float> logits_;
  std::vector<SampledToken> sampled_;
  std::vector<float> follower_logits_;
  int64_t follower_failures_ = 0;
};

}  // namespace kvflow
