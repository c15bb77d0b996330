// The engine's seams for a model split across the ranks of a job (the tensor_parallel system,
// tensor_parallel/): the driver rank runs the engine; each step, its executor tells the other ranks
// the step's block moves and batch before running them itself, and its model sums the ranks'
// partial outputs inside each layer (forward/llama_model.h's DeltaReducer).
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "forward/llama_model.h"
#include "kvflow/engine.h"
#include "kvflow/status.h"
#include "sched/scheduler.h"

namespace kvflow {

// The other ranks of a split model, seen from the driver.
class StepMirror {
 public:
  virtual ~StepMirror() = default;
  // The step's swap-out, swap-in and copy-on-write moves, before this rank makes them.
  virtual Status MirrorMoves(const SchedulerOutput& sched) = 0;
  // The step's batch, before this rank runs it (the other ranks produce no logits).
  virtual Status MirrorBatch(const ForwardBatch& batch) = 0;
  // For the engine's log: "tensor parallel over 2 ranks (mpi rank 0 of 2)".
  virtual std::string Describe() const = 0;
  // The communication so far (the reducer's sums included).
  virtual ModelParallelStats stats() const = 0;
};

// What the model_parallel plugin hands the engine: the driver's share of the model on its backend,
// the reducer its model sums through, and the mirror that drives the other ranks (which stop when
// it is destroyed).
struct ModelParallelParts {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<DeltaReducer> reducer;
  std::unique_ptr<StepMirror> mirror;
};

}  // namespace kvflow
