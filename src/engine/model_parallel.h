// The engine's seams for a model split across the ranks of a job (the model_parallel system,
// model_parallel/): the driver rank runs the engine; each step, its executor tells the other ranks
// the step's block moves, then runs the step's batch with them: tensor parallelism sums the ranks'
// partial outputs inside each layer (forward/llama_model.h's DeltaReducer), pipeline parallelism
// passes the residual stream from stage to stage (PipelineStage) and brings the last stage's
// logits back.
#pragma once

#include <memory>
#include <string>
#include <vector>

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
  // Runs the step's batch on every rank, this rank's share through `model` (the driver's model, on
  // the backend of ModelParallelParts), and fills `logits` with batch.num_logit_rows() x vocab
  // floats, wherever the last layers ran.
  virtual Status RunStep(LlamaModel& model, const ForwardBatch& batch, std::vector<float>& logits) = 0;
  // Steps it keeps in flight at once (pipeline parallelism's batch queue; 1: RunStep only).
  virtual int StepsInFlight() const { return 1; }
  // Starts a step: sends it on and runs this rank's stage, then returns while the later stages
  // run it. CollectStep waits for the oldest step started and fills `logits` as RunStep does.
  virtual Status SubmitStep(LlamaModel& model, const ForwardBatch& batch) {
    return Status::Unsupported("this split runs one step at a time");
  }
  virtual Status CollectStep(std::vector<float>& logits) { return Status::Unsupported("this split runs one step at a time"); }
  // For the engine's log: "tensor parallel 2 x pipeline parallel 2 over 4 ranks (mpi rank 0 of 4)".
  virtual std::string Describe() const = 0;
  // The communication so far.
  virtual ModelParallelStats stats() const = 0;
};

// What the model_parallel plugin hands the engine: the driver's share of the model on its backend,
// and the mirror that runs the steps with the other ranks (which stop when it is destroyed).
struct ModelParallelParts {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<StepMirror> mirror;
};

}  // namespace kvflow
