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

// What a step produced for the scheduled sequences that needed logits, in batch order: either the
// tokens the executor sampled itself (when the core handed it sample rows), or logits.
struct ExecutorOutput {
  // One entry per such sequence: its sampled tokens (one per step today).
  std::vector<std::vector<SampledToken>> sampled;
  // Otherwise one row of vocab_size floats per such sequence.
  std::span<float> logits;
  int64_t vocab_size = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;

  // Whether Run can sample rows itself (on the device), so that only tokens come back.
  virtual bool SupportsSampling() const = 0;
  // Carries out the step's block moves: swap-out, swap-in, then copy-on-write. A failure leaves
  // the KV cache unknown and fails the step.
  virtual Status MoveBlocks(const SchedulerOutput& sched) = 0;
  // Runs the scheduled sequences; called every step after MoveBlocks, also when nothing was
  // scheduled (a step that only moved blocks). Given `sample_rows` (one per sequence that needs
  // logits, batch order) it fills out.sampled, else out.logits. A failure fails the requests in the
  // batch, not the engine.
  virtual Status Run(const SchedulerOutput& sched, std::optional<std::span<const DeviceSampleRow>> sample_rows,
                     ExecutorOutput& out) = 0;
};

}  // namespace kvflow
