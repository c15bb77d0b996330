// What runs a step the scheduler planned: the model on a backend (ModelExecutor) or, in the
// serving simulator, a cost model on a virtual clock. The EngineCore drives either the same way.
#pragma once

#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "kvflow/request.h"
#include "kvflow/status.h"
#include "sched/scheduler.h"

namespace kvflow {

// What a step produced, in batch order: either the tokens the executor sampled itself (when the
// core handed it sample rows: one entry per sequence that needs logits), or the logit rows the
// core asked for (each scheduled sequence's LogitsMode: none, its last token, or every new token
// for prompt logprobs and draft verification).
struct ExecutorOutput {
  std::vector<std::vector<SampledToken>> sampled;
  std::span<float> logits;  // rows of vocab_size floats
  int64_t vocab_size = 0;
  // Set by the caller: also return the logit rows' final-norm hidden states (S3's length probe).
  // An executor that cannot leaves final_hidden empty.
  bool want_final_hidden = false;
  std::span<const float> final_hidden;  // rows of hidden_size floats, as the logit rows
  int64_t hidden_size = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;

  // Whether Run can sample rows itself (on the device), so that only tokens come back.
  virtual bool SupportsSampling() const = 0;
  // Whether Run's forward pass keeps the host's cores busy (the CPU backend): then there is no
  // idle core to compute host-sampled rows' constraints on meanwhile.
  virtual bool ForwardUsesHostCores() const { return true; }
  // Whether its sampling applies a TokenConstraint's mask and biases (bans it always applies).
  virtual bool AppliesTokenMasks() const { return false; }
  // Carries out the step's block moves: the KV connectors' saves (swap-out among them), their
  // loads (swap-in among them), then copy-on-write. A failure leaves the KV cache unknown and
  // fails the step.
  virtual Status MoveBlocks(const SchedulerOutput& sched) = 0;
  // Runs the scheduled sequences; called every step after MoveBlocks, also when nothing was
  // scheduled (a step that only moved blocks). `logits`: the rows each scheduled sequence needs.
  // Given `sampling` (its rows: one per sequence that needs logits, batch order; only when every
  // mode is kNone or kLast) it fills out.sampled, else out.logits. A failure fails the requests in
  // the batch, not the engine.
  virtual Status Run(const SchedulerOutput& sched, std::span<const LogitsMode> logits, const DeviceSampling* sampling,
                     ExecutorOutput& out) = 0;

  // Steps it can keep running at once (a pipeline of stages: vLLM V1's batch queue). With more
  // than one, the core may use SubmitStep and CollectStep instead of Run: SubmitStep starts a step
  // (after its MoveBlocks) and returns once it no longer needs this thread; CollectStep waits for
  // the oldest step submitted and fills `out` with its logit rows (host sampling only).
  virtual int MaxStepsInFlight() const { return 1; }
  virtual Status SubmitStep(const SchedulerOutput& sched, std::span<const LogitsMode> logits) {
    return Status::Unsupported("this executor runs one step at a time");
  }
  virtual Status CollectStep(ExecutorOutput& out) { return Status::Unsupported("this executor runs one step at a time"); }
};

}  // namespace kvflow
