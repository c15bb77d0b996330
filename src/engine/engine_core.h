// The engine's core: the requests, the Scheduler and BlockManager that place their sequences, and
// the update after each step in one place (vLLM's Scheduler.update_from_output): append the
// accepted tokens, check stops token by token, finish and free, fail and cancel, S3's supervisor
// hooks, stats. It runs no model: an Executor runs each step (the model on a backend, or the
// serving simulator's cost model) and each request's DecodingStrategy turns what the step produced
// into tokens. The tokenizer is optional (without one: no text, no stop strings). Driven by one
// thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/evaluation.h"
#include "engine/executor.h"
#include "engine/request_state.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "kvflow/tokenizer.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"
#include "sched/scheduler.h"
#include "engine/kv_selector.h"
#include "engine/drafter.h"
#include "engine/logits_processor.h"

namespace kvflow {

struct EngineCoreConfig {
  SchedulerConfig scheduler;
  BlockManagerConfig blocks;
  int vocab_size = 0;  // prompt token ids must lie below it (0: not checked)
  std::vector<int32_t> eos_token_ids;  // the model's, then the tokenizer's
  uint64_t seed = 0;  // seeds requests that bring no seed of their own
  // Say (rate-limited) when preemptions show the KV cache is too small for the load; the serving
  // simulator preempts by design.
  bool warn_on_preemption = true;
  // Speculative decoding for requests that keep SamplingParams::speculative on: the drafter (n-gram
  // lookup or a draft model), null for none. Not owned; it must outlive the core.
  Drafter* drafter = nullptr;
  // Chooses which cached tokens attention reads (kv_selector.h), null for none; requests use it
  // unless SamplingParams::kv_selection says otherwise (kv_selection_default). Not owned.
  KvSelector* kv_selector = nullptr;
  bool kv_selection_default = true;
  // Logits processors of the systems (structured output), applied after the built-in ones
  // (engine/logits_processor.h). Not owned; they must outlive the core.
  std::vector<const LogitsProcessor*> logits_processors;
};

// Watches the core from outside (the serving simulator's measurements).
class EngineCoreObserver {
 public:
  virtual ~EngineCoreObserver() = default;
  // A step ran: its sequences' KV advanced; the tokens it produced are not appended yet.
  virtual void OnStepComputed(const SchedulerOutput& sched) {}
  // A request finished (not cancelled, not failed), just before the core forgets it.
  virtual void OnRequestFinished(const SequenceGroup& group) {}
};

class EngineCore {
 public:
  // `tokenizer` may be null; otherwise it must outlive the core.
  EngineCore(const EngineCoreConfig& config, std::unique_ptr<SchedulingPolicy> policy,
             std::unique_ptr<LengthSupervisor> supervisor, const Tokenizer* tokenizer);

  // ---- requests --------------------------------------------------------------------------------
  // The checks AddRequest makes; reads only the configuration (any thread may call it).
  Status ValidateRequest(const std::vector<int32_t>& prompt, const SamplingParams& params) const;
  // Queues a request that arrived at `arrival_time` (seconds on any monotonic clock: FCFS order).
  Result<RequestId> AddRequest(std::vector<int32_t> prompt, const SamplingParams& params, StreamCallback on_event,
                               const RequestHints& hints, double arrival_time);
  // Ends a request with FinishReason::kCancelled, at once or (during a step) when the step ends.
  Status Cancel(RequestId id);
  bool HasUnfinishedRequests() const { return !requests_.empty(); }

  // ---- steps -----------------------------------------------------------------------------------
  // Schedules one step, has `executor` move blocks and run it, and updates every request from what
  // it produced. An error means the executor could not move blocks; a failed run fails only the
  // requests in the batch. With scheduler.batches_in_flight > 1 (an executor whose
  // MaxStepsInFlight allows it) a call first ends the oldest step in flight when that many are,
  // then starts the next step and returns; when nothing can start, it ends the oldest.
  Result<StepResult> Step(Executor& executor);
  // Steps started and not yet ended.
  int steps_in_flight() const { return static_cast<int>(in_flight_.size()); }

  // A KV connector's scheduler side (kv/kv_connector_scheduler.h) for the block manager to consult; must
  // outlive the core. Before any request.
  void AddKvConnector(KvConnectorScheduler* connector) { blocks_.AddConnector(connector); }

  EngineStats stats() const;
  void set_observer(EngineCoreObserver* observer) { observer_ = observer; }
  const EngineCoreConfig& config() const { return config_; }
  const Scheduler& scheduler() const { return scheduler_; }
  const BlockManager& block_manager() const { return blocks_; }
  const LengthSupervisor* length_supervisor() const { return supervisor_.get(); }

  // ---- for decoding strategies -----------------------------------------------------------------
  // A new sequence of `req` sharing all of `parent`'s tokens and KV blocks.
  SeqState& Fork(RequestState& req, const SeqState& parent, int index, uint64_t seed);
  // Appends accepted tokens to `seq` one by one, checking the stops after each: EOS, stop token
  // ids, stop strings, max_tokens, max_model_len. The first stop finishes the sequence and drops
  // the tokens after it. Streams what was appended (streaming requests). Returns the finish reason
  // (kNone: still running).
  FinishReason AppendTokens(RequestState& req, SeqState& seq, std::span<const SampledToken> tokens);
  // Appends a token without stop checks or streaming (beam search decides itself).
  void AppendUnchecked(SeqState& seq, const SampledToken& token);
  // Ends a sequence and frees its blocks (the request stays until it is finished).
  void FinishSequence(SeqState& seq, FinishReason why);

  bool IsEos(const SamplingParams& p, int32_t token) const;
  static bool IsStopToken(const SamplingParams& p, int32_t token);
  bool ReachedLength(const SamplingParams& p, const SchedSequence& seq) const;
  // What `seq` may sample after `output` (its output, or under speculative verification its output
  // and the drafts kept so far; engine/logits_processor.h), filled into `constraint`; null when
  // nothing constrains it.
  const TokenConstraint* Constrain(const SamplingParams& p, const SeqState& seq, std::span<const int32_t> output,
                                   TokenConstraint& constraint) const;
  // Text of `tokens` (empty without a tokenizer).
  std::string Decode(const std::vector<int32_t>& tokens) const;
  // After a speculative sequence's tokens were appended (AppendTokens): counts the drafts and, if
  // the sequence goes on, keeps the accepted drafts' KV and frees the rejected drafts' slots.
  Status CommitDrafts(RequestState& req, SeqState& seq, const ScheduledSeq& step, int64_t drafted, int64_t accepted);
  // Has the drafter fill `job` for `seq` before the coming step is scheduled, batched with the step's other
  // jobs (call from BeforeStep; `job` must stay put until then). The drafts become the sequence's
  // draft_tokens.
  void QueueDraft(DraftJob& job, SchedSequence& seq) {
    job.seq = &seq;
    draft_jobs_.push_back(&job);
    draft_seqs_.push_back(&seq);
  }
  // The request's prompt logprobs go out once, with its first event.
  static void AttachPromptLogprobs(RequestState& req, StreamEvent& event);

 private:
  // Per scheduled sequence: the logit rows it needs, where its slice started, the drafts that ran.
  struct StepRecord {
    std::vector<LogitsMode> logits;
    std::vector<int64_t> first_position;
    std::vector<std::vector<int32_t>> drafts;
  };
  // A step started and not yet ended (batches in flight).
  struct InFlightStep {
    SchedulerOutput sched;
    StepRecord record;
  };
  Result<StepResult> StepInner(Executor& executor);
  // Batches in flight: ends the oldest step when the queue is full, then starts the next; ends the
  // oldest when nothing can start.
  Result<StepResult> PipelinedStep(Executor& executor);
  // Ends the oldest step in flight: its logits, then every request's update (or its failure).
  void CollectOldest(Executor& executor, StepResult& result);
  // The step's block moves; a failure fails the step's requests.
  Status MoveStepBlocks(Executor& executor, const SchedulerOutput& sched);
  // Drafts, then the scheduler's plan; fails what it rejected.
  SchedulerOutput PlanStep();
  static StepResult CountStep(const SchedulerOutput& sched);
  StepRecord RecordStep(const SchedulerOutput& sched) const;
  // After a step ran: its sequences move on, then every request takes its share of `out`.
  void FinishStep(const SchedulerOutput& sched, ExecutorOutput& out, bool sampled, bool prepared,
                  const StepRecord& record);
  void WarnAboutPreemptions(const SchedulerOutput& sched) const;
  LogitsMode LogitsFor(const ScheduledSeq& s) const;
  static int64_t RowsOf(const ScheduledSeq& s, LogitsMode mode);
  // Whether the executor may sample every row of the step itself.
  bool ExecutorMaySample(const Executor& executor, const SchedulerOutput& sched, const StepRecord& record) const;
  // Whether the executor returned a token list (`sampled`) or the logit rows the step asked for.
  // Host sampling: hands the logits processors the step's plain decode rows before they are
  // sampled (LogitsProcessor::Prepare), so that one may fill its constraints for the batch at once.
  void PrepareConstraints(const SchedulerOutput& sched, const StepRecord& record);
  // Device sampling: the constraints of device_rows_ (whose contexts are prepare_rows_), prepared
  // for the batch at once.
  void FillDeviceConstraints();
  Status CheckOutput(const SchedulerOutput& sched, const ExecutorOutput& out, bool sampled,
                     const StepRecord& record) const;
  // Hands each request its share of the step's output (tokens the executor `sampled`, or logits),
  // then finishes the requests that are done. `prepared`: PrepareConstraints ran during the step.
  void UpdateFromOutput(const SchedulerOutput& sched, ExecutorOutput& out, bool sampled, bool prepared,
                        const StepRecord& record);
  // Scores the prompt tokens that follow the positions of a slice's rows.
  void RecordPromptLogprobs(RequestState& req, const SchedSequence& seq, int64_t first_position, const float* rows,
                            int64_t num_rows, int64_t vocab_size);
  // max_tokens 0: the prompt is scored, nothing is generated.
  void FinishPromptOnly(RequestState& req);
  // When every sequence of `req` is done: S3 learns its length, the strategy delivers what it held
  // back, and the request is forgotten.
  void MaybeFinishRequest(RequestState& req);
  void ReportLength(const RequestState& req);
  // Ends a request with an error or cancellation: one final event, blocks freed at once.
  void FailRequest(RequestId id, const Status& error, bool in_scheduler);
  // Fails every request with a sequence in the step (each once).
  void FailScheduled(const SchedulerOutput& sched, const Status& error);
  void Forget(RequestId id);
  void ReapCancelled();
  RequestState& Get(RequestId id) { return *requests_.at(id); }

  EngineCoreConfig config_;
  const Tokenizer* tokenizer_;
  BlockManager blocks_;
  Scheduler scheduler_;
  std::unique_ptr<LengthSupervisor> supervisor_;  // s3 only
  int64_t probe_released_blocks_ = 0;  // EngineStats::s3.probe_released_blocks
  EngineCoreObserver* observer_ = nullptr;
  std::mt19937_64 seed_rng_;
  std::unordered_map<RequestId, std::unique_ptr<RequestState>> requests_;
  std::vector<RequestId> cancelled_;  // asked to stop during a step, in the order asked
  std::vector<DraftJob*> draft_jobs_;  // queued by BeforeStep for the coming step
  std::vector<SchedSequence*> draft_seqs_;
  EngineStats stats_;
  LogitsProcessors logits_processors_;
  std::vector<TokenConstraint> step_constraints_;  // the device-sampled rows' constraints of a step
  std::vector<LogitsContext> prepare_rows_;        // PrepareConstraints' rows (reused)
  std::vector<DeviceSampleRow> device_rows_;       // the rows a step samples on the device (reused)
  std::deque<InFlightStep> in_flight_;           // oldest first
  RequestId next_id_ = 1;
  bool in_step_ = false;
};

}  // namespace kvflow
