// Runs the engine's steps on a Backend: the step's block moves (every KV connector's, then the
// copy-on-write copies), then one forward pass over the scheduled batch, sampling on the device
// when the core hands it sample rows.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "engine/executor.h"
#include "engine/kv_connector.h"
#include "kv/block_manager.h"
#include "engine/model_parallel.h"
#include "forward/llama_model.h"

namespace kvflow {

// The backend's view of a step: every scheduled sequence's new tokens (drafts included), their
// positions, the sequence's block table and the logit rows it needs.
ForwardBatch BuildForwardBatch(const SchedulerOutput& sched, const BlockManager& blocks,
                               std::span<const LogitsMode> logits);

class ModelExecutor final : public Executor {
 public:
  // `backend` and `blocks` (the block tables the scheduler keeps) must outlive the executor.
  ModelExecutor(Backend& backend, const BlockManager& blocks) : backend_(backend), model_(backend), blocks_(blocks) {}
  ModelExecutor(const ModelExecutor&) = delete;  // its connector list points at its own members
  ModelExecutor& operator=(const ModelExecutor&) = delete;

  // Several KV caches in one engine: `follower` holds a second model (a draft model) whose KV pool
  // follows the target's block tables. Every block move is applied to its pool too, and every
  // step's tokens run through it after the target's pass (no logits), so each computed position
  // has the follower's K/V in the same slot. Its pool must have at least the target's device and
  // host blocks; blocks past those are its own (speculative/draft_model.h's scratch). A follower's failed
  // pass is logged and leaves its cache stale there, never fails the step: a draft model only
  // proposes.
  void AddFollower(Backend& follower);
  // A feature that acts inside the target's passes (a KV selector, TriForce's chunk scoring);
  // must outlive the executor. Each step runs every feature's hooks together, in the order added.
  void AddStepHooks(StepHooks* hooks) {
    if (hooks != nullptr) step_hooks_.push_back(hooks);
  }
  // The KV connectors (engine/kv_connector.h) that move KV for every step, in order, after the
  // swap connector every executor has; must outlive the executor. Their layer hooks wrap all the
  // step hooks, the last added outermost.
  void AddConnector(KvConnector* connector) {
    if (connector != nullptr) connectors_.push_back(connector);
  }

  // A model split across ranks: `mirror` hears every step's block moves before this executor makes
  // them, and runs every step's batch with the other ranks; it must outlive the executor.
  void SetModelParallel(StepMirror* mirror) { mirror_ = mirror; }

  bool SupportsSampling() const override { return backend_.SupportsDeviceSampling(); }
  bool ForwardUsesHostCores() const override { return backend_.ComputesOnHost(); }
  bool AppliesTokenMasks() const override { return backend_.SupportsDeviceTokenMask(); }
  Status MoveBlocks(const SchedulerOutput& sched) override;
  Status Run(const SchedulerOutput& sched, std::span<const LogitsMode> logits,
             const DeviceSampling* sampling, ExecutorOutput& out) override;
  // Batches in flight: the mirror's pipeline (a model split into stages), else one step at a time.
  int MaxStepsInFlight() const override { return mirror_ ? mirror_->StepsInFlight() : 1; }
  Status SubmitStep(const SchedulerOutput& sched, std::span<const LogitsMode> logits) override;
  Status CollectStep(ExecutorOutput& out) override;

 private:
  Backend& backend_;
  LlamaModel model_;
  std::vector<LlamaModel> followers_;
  std::vector<StepHooks*> step_hooks_;
  HookChain chain_;
  SwapConnector swap_;
  std::vector<KvConnector*> connectors_{&swap_};
  std::vector<int64_t> seq_ids_;
  std::vector<uint8_t> selecting_;
  const BlockManager& blocks_;
  StepMirror* mirror_ = nullptr;
  // Sets the step's hooks (its features' and connectors') on model_; the caller clears them after the pass.
  void SetStepHooks(const SchedulerOutput& sched, const ForwardBatch& batch);
  Status RunTarget(const ForwardBatch& batch, const DeviceSampling* sampling,
                   ExecutorOutput& out);
  // The step through the mirror (a model split across ranks).
  Status RunAcrossRanks(const ForwardBatch& batch, const DeviceSampling* sampling, ExecutorOutput& out);
  // Runs the step's batch through every follower (no logits).
  void RunFollowers(const ForwardBatch& target_batch);

  std::vector<float> logits_;
  std::vector<float> final_hidden_;
  bool final_hidden_unsupported_ = false;  // logged once
  std::vector<SampledToken> sampled_;
  std::vector<float> follower_logits_;
  int64_t follower_failures_ = 0;
};

}  // namespace kvflow
