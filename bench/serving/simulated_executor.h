// The sim executor: the engine's core (Scheduler, BlockManager, step protocol) driven on a virtual clock, each step costed by a CostModel.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine_core.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "sched/length_predictor.h"
#include "sched/length_supervisor.h"
#include "sched/sequence_group.h"

#include "serving/common.h"
#include "serving/trace.h"
#include "serving/cost_model.h"
#include "serving/run_record.h"

namespace kvflow::bench::serving {

// ---- sim executor ---------------------------------------------------------------------------

constexpr int32_t kSimulatedToken = 1;  // what the sim "samples"; only lengths matter

Json SupervisorJson(const kvflow::LengthSupervisorStats& s);

// The sim's executor: no model. Each step takes the time the cost model gives for its shape, on a
// virtual clock, and every sequence "samples" kSimulatedToken.
//
// Preemption penalty: the modelled time of recomputing KV a sequence had already computed once (its
// high-water mark) and of swapping, i.e. what a step costs beyond the same step without that work.
class CostModelExecutor final : public kvflow::Executor {
 public:
  CostModelExecutor(const CostModel& cost, int block_size) : cost_(cost), block_size_(block_size) {}

  bool SupportsSampling() const override { return true; }
  // Swaps are charged in Run, with the rest of the step.
  Status MoveBlocks(const kvflow::SchedulerOutput&) override { return Status::Ok(); }

  Status Run(const kvflow::SchedulerOutput& out, std::span<const kvflow::LogitsMode>,
             const kvflow::DeviceSampling* sampling,
             kvflow::ExecutorOutput& result) override;

  double now() const { return now_; }
  void AdvanceTo(double t) { now_ = std::max(now_, t); }
  double last_step_seconds() const { return last_step_s_; }
  // Whether the last step ran anything, and whether it changed the scheduler's state otherwise
  // (rejections, preemptions).
  bool ran() const { return ran_; }
  bool changed() const { return changed_; }
  Json PenaltyJson() const;

 private:
  const CostModel& cost_;
  const int block_size_;
  double now_ = 0.0;
  double last_step_s_ = 0.0;
  bool ran_ = false;
  bool changed_ = false;
  std::unordered_map<kvflow::SeqId, int64_t> high_water_;  // most KV ever computed per sequence
  int64_t recomputed_tokens_ = 0, swapped_blocks_ = 0;
  double penalty_s_ = 0.0;
};

// What the sim measures inside the core: per-step batch size and KV use, and (s3) whether each
// finished request's predicted length bucket was right.
class SimObserver final : public kvflow::EngineCoreObserver {
 public:
  SimObserver(const kvflow::EngineCore& core, const CostModelExecutor& executor, RunRecord& run)
      : core_(core), executor_(executor), run_(run), mispredicted_(run.requests.size(), -1) {}

  // Request `id` is trace request `index` (arrival order).
  void Track(kvflow::RequestId id, size_t index) { index_.emplace(id, index); }

  void OnStepComputed(const kvflow::SchedulerOutput& sched) override;

  void OnRequestFinished(const kvflow::SequenceGroup& group) override;

  // Whether online retraining converges: the misprediction rate per tenth of the requests, in
  // arrival order (a prediction is made at arrival, so only later arrivals can profit).
  Json MispredictionDeciles() const;

 private:
  const kvflow::EngineCore& core_;
  const CostModelExecutor& executor_;
  RunRecord& run_;
  std::unordered_map<kvflow::RequestId, size_t> index_;
  std::vector<int8_t> mispredicted_;  // per trace request; -1: not finished (or not s3)
};

// Replays the trace through the engine's core (the real Scheduler and BlockManager, the same step
// protocol as the engine) with the cost-model executor instead of a model. Every request runs to
// its true length: max_tokens is that length, hidden from the scheduler (which sees the context
// limit), and EOS is ignored. The s3 policy runs with its supervisor, as in the engine.
Result<RunRecord> Simulate(const Trace& trace, double rate, const std::string& policy_name, const ServingConfig& cfg,
                           const CostModel& cost, const kvflow::LengthPredictor* predictor);

}  // namespace kvflow::bench::serving
