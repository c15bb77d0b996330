#include "engine/engine_core.h"

#include "sampling/logprobs.h"

#include <algorithm>
#include <future>
#include <optional>
#include <utility>

#include <spdlog/spdlog.h>

namespace kvflow {
namespace {

// Runs logits-processor work: one that throws fails the step (logged), not the engine.
template <typename Work>
bool Guarded(Work&& work) noexcept {
  try {
    work();
    return true;
  } catch (const std::exception& e) {
    spdlog::error("logits processors: {}", e.what());
    return false;
  }
}

}  // namespace

EngineCore::EngineCore(const EngineCoreConfig& config, std::unique_ptr<SchedulingPolicy> policy,
                       std::unique_ptr<LengthSupervisor> supervisor, const Tokenizer* tokenizer)
    : config_(config),
      tokenizer_(tokenizer),
      blocks_(config_.blocks),
      scheduler_(config_.scheduler, blocks_, std::move(policy)),
      supervisor_(std::move(supervisor)),
      seed_rng_(config_.seed) {
  logits_processors_.Add(MakeMinTokensProcessor(config_.eos_token_ids));
  logits_processors_.Add(MakeLogitBiasProcessor());
  for (const LogitsProcessor* p : config_.logits_processors) logits_processors_.Add(p);
}

// ---- requests -------------------------------------------------------------------------------------

Status EngineCore::ValidateRequest(const std::vector<int32_t>& prompt, const SamplingParams& params) const {
  KVFLOW_RETURN_IF_ERROR(params.Validate());
  if (prompt.empty()) return Status::InvalidArgument("the prompt is empty");
  if (params.num_candidates() > config_.scheduler.max_num_seqs) {
    return Status::InvalidArgument("best_of/n of " + std::to_string(params.num_candidates()) +
                                   " exceeds max_num_seqs (" + std::to_string(config_.scheduler.max_num_seqs) + ")");
  }
  if (params.structured_output && !logits_processors_.HandlesStructuredOutput()) {
    return Status::Unsupported("structured output (" +
                               std::string(StructuredOutputKindName(params.structured_output->kind)) +
                               ") needs the structured-output logits processor, which this engine was built without "
                               "(Engine::Create adds it)");
  }
  if (config_.vocab_size > 0) {
    KVFLOW_RETURN_IF_ERROR(logits_processors_.Validate(params, config_.vocab_size));
    for (int32_t t : prompt) {
      if (t < 0 || t >= config_.vocab_size) {
        return Status::InvalidArgument("prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                       std::to_string(config_.vocab_size) + ")");
      }
    }
  }
  // Room for one generated token, unless the request only scores its prompt.
  if (static_cast<int64_t>(prompt.size()) + (params.max_tokens > 0 ? 1 : 0) > config_.scheduler.max_model_len) {
    return Status::InvalidArgument("the prompt has " + std::to_string(prompt.size()) +
                                   " tokens; max_model_len is " + std::to_string(config_.scheduler.max_model_len));
  }
  if (!params.stop.empty() && !tokenizer_) return Status::InvalidArgument("stop strings need a tokenizer");
  return Status::Ok();
}

Result<RequestId> EngineCore::AddRequest(std::vector<int32_t> prompt, const SamplingParams& params,
                                         StreamCallback on_event, const RequestHints& hints, double arrival_time) {
  KVFLOW_RETURN_IF_ERROR(ValidateRequest(prompt, params));
  auto req = std::make_unique<RequestState>();
  req->id = next_id_++;
  req->params = params;
  req->seed = params.seed.value_or(seed_rng_());
  req->on_event = std::move(on_event);
  req->strategy = MakeDecodingStrategy(params, req->seed, config_.drafter);

  auto group = std::make_unique<SequenceGroup>();
  group->request_id = req->id;
  group->arrival_time = arrival_time;
  group->max_output_tokens = hints.hide_max_tokens
                                 ? config_.scheduler.max_model_len - static_cast<int64_t>(prompt.size())
                                 : params.max_tokens;
  group->num_candidates = params.num_candidates();
  group->compute_whole_prompt = params.prompt_logprobs.has_value();
  group->prompt_decode_from = params.prompt_decode_from;
  group->kv_selection = config_.kv_selector != nullptr && params.kv_selection.value_or(config_.kv_selection_default);
  group->true_output_len = hints.true_output_len;
  group->predicted_output_len = hints.predicted_output_len;
  auto seq = std::make_unique<SchedSequence>();
  seq->id = scheduler_.NewSeqId();
  seq->prompt_len = static_cast<int64_t>(prompt.size());
  seq->tokens = std::move(prompt);
  group->seqs.push_back(std::move(seq));
  if (supervisor_ && !group->predicted_output_len) supervisor_->Predict(*group);
  SchedSequence* first = group->seqs.front().get();
  req->seqs.push_back(std::make_unique<SeqState>(first, 0, params, req->seed, tokenizer_));
  req->group = group.get();
  scheduler_.AddGroup(std::move(group));
  const RequestId id = req->id;
  requests_.emplace(id, std::move(req));
  return id;
}

Status EngineCore::Cancel(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::NotFound("no unfinished request " + std::to_string(id));
  cancelled_.push_back(id);
  if (!in_step_) ReapCancelled();
  return Status::Ok();
}

// ---- steps ----------------------------------------------------------------------------------------

Result<StepResult> EngineCore::Step(Executor& executor) {
  in_step_ = true;
  auto result = StepInner(executor);
  in_step_ = false;
  ReapCancelled();
  return result;
}

SchedulerOutput EngineCore::PlanStep() {
  ReapCancelled();
  // Drafts first: the scheduler runs them with their sequence's next token (not known yet for a
  // request whose step is in flight).
  for (auto& [id, req] : requests_) {
    if (!req->group->in_flight) req->strategy->BeforeStep(*this, *req);
  }
  if (!draft_jobs_.empty()) {
    for (DraftJob* job : draft_jobs_) job->block_table = blocks_.BlockTable(job->seq->id);
    config_.drafter->Propose(draft_jobs_);
    for (size_t i = 0; i < draft_jobs_.size(); ++i) draft_seqs_[i]->draft_tokens = draft_jobs_[i]->drafts;
    draft_jobs_.clear();
    draft_seqs_.clear();
  }
  SchedulerOutput sched = scheduler_.Schedule();
  for (auto& [id, why] : sched.rejected) FailRequest(id, why, /*in_scheduler=*/false);
  if (supervisor_) {
    for (RequestId id : sched.reservation_exhausted) {
      if (const SequenceGroup* g = scheduler_.Find(id)) supervisor_->OnReservationExhausted(*g);
    }
  }
  if (config_.warn_on_preemption) WarnAboutPreemptions(sched);
  return sched;
}

StepResult EngineCore::CountStep(const SchedulerOutput& sched) {
  StepResult result;
  for (const ScheduledSeq& s : sched.scheduled) {
    const bool is_prefill = s.seq->num_computed < s.seq->prompt_len || s.num_tokens > 1;
    (is_prefill ? result.num_prefill_tokens : result.num_decode_tokens) += static_cast<int>(s.num_tokens);
  }
  result.num_seqs = static_cast<int>(sched.scheduled.size());
  return result;
}

// The rows each sequence needs, and what the update needs of the step once CompleteStep has moved
// the sequences on: where each slice started, and the drafts that ran.
EngineCore::StepRecord EngineCore::RecordStep(const SchedulerOutput& sched) const {
  StepRecord record;
  for (const ScheduledSeq& s : sched.scheduled) {
    record.logits.push_back(LogitsFor(s));
    record.first_position.push_back(s.seq->num_computed);
    record.drafts.emplace_back();
    for (int64_t i = s.num_real_tokens(); i < s.num_tokens; ++i) record.drafts.back().push_back(s.token(i));
  }
  return record;
}

void EngineCore::FinishStep(const SchedulerOutput& sched, ExecutorOutput& out, bool sampled, bool prepared,
                            const StepRecord& record) {
  stats_.prompt_tokens_processed += CountStep(sched).num_prefill_tokens;  // before the sequences move on
  scheduler_.CompleteStep(sched);
  ++stats_.num_steps;
  if (observer_) observer_->OnStepComputed(sched);
  UpdateFromOutput(sched, out, sampled, prepared, record);
}

Status EngineCore::MoveStepBlocks(Executor& executor, const SchedulerOutput& sched) {
  Status moved = executor.MoveBlocks(sched);
  if (!moved.ok()) {
    // The KV the step's requests need is unknown now: they fail (and the step, as before), so a
    // caller stepping until every request is done never spins on a failure.
    spdlog::error("block moves failed: {}", moved.ToString());
    FailScheduled(sched, moved);
  }
  return moved;
}

void EngineCore::CollectOldest(Executor& executor, StepResult& result) {
  InFlightStep step = std::move(in_flight_.front());
  in_flight_.pop_front();
  ExecutorOutput out;
  Status st = executor.CollectStep(out);
  if (st.ok()) st = CheckOutput(step.sched, out, /*sampled=*/false, step.record);
  result.num_steps_completed = 1;
  if (!st.ok()) {
    spdlog::error("forward pass failed: {}", st.ToString());
    FailScheduled(step.sched, st);
    return;
  }
  FinishStep(step.sched, out, /*sampled=*/false, /*prepared=*/false, step.record);
}

Result<StepResult> EngineCore::PipelinedStep(Executor& executor) {
  const size_t depth = static_cast<size_t>(config_.scheduler.batches_in_flight);
  StepResult result;
  // A full queue ends its oldest step first: its sequences may go into the step planned next, and
  // the last stage hands over its logits while this rank waits for them (were this rank running
  // its own stage instead, the transfer would wait for it).
  if (in_flight_.size() >= depth) CollectOldest(executor, result);
  SchedulerOutput sched = PlanStep();
  // Block moves first; every rank takes them in order, after the steps in flight.
  KVFLOW_RETURN_IF_ERROR(MoveStepBlocks(executor, sched));
  if (!sched.empty()) {
    const StepResult started = CountStep(sched);
    result.num_seqs = started.num_seqs;
    result.num_prefill_tokens = started.num_prefill_tokens;
    result.num_decode_tokens = started.num_decode_tokens;
    StepRecord record = RecordStep(sched);
    if (Status st = executor.SubmitStep(sched, record.logits); !st.ok()) {
      spdlog::error("forward pass failed: {}", st.ToString());
      FailScheduled(sched, st);
      ++result.num_steps_completed;
      return result;
    }
    in_flight_.push_back({std::move(sched), std::move(record)});
    return result;
  }
  // Nothing to start (every running group is in flight, or waits for blocks): end the oldest step.
  if (result.num_steps_completed == 0 && !in_flight_.empty()) CollectOldest(executor, result);
  return result;
}

Result<StepResult> EngineCore::StepInner(Executor& executor) {
  if (config_.scheduler.batches_in_flight > 1) {
    if (executor.MaxStepsInFlight() < config_.scheduler.batches_in_flight) {
      return Status::Internal("the scheduler keeps " + std::to_string(config_.scheduler.batches_in_flight) +
                              " batches in flight; the executor runs " + std::to_string(executor.MaxStepsInFlight()));
    }
    return PipelinedStep(executor);
  }
  SchedulerOutput sched = PlanStep();
  // Block moves first: swap-out frees device blocks this step may reuse.
  KVFLOW_RETURN_IF_ERROR(MoveStepBlocks(executor, sched));

  StepResult result = CountStep(sched);
  const StepRecord record = RecordStep(sched);
  // The executor samples when it can and every row is a plain one (no forks, no beams): then only
  // tokens and logprobs come back. A costly constraint (a grammar's mask) is computed on a helper
  // thread while the forward pass runs on a device: the device sampler awaits the step's
  // constraints, the host sampler their prepared masks. A cheap one is computed here; on the CPU
  // backend, whose forward pass keeps every core busy, host-sampled rows' masks are filled after it
  // (in parallel, UpdateFromOutput).
  std::optional<DeviceSampling> sampling;
  std::future<bool> constraints;
  bool costly = false, constraints_ok = true, host_constraints_prepared = false;
  if (!sched.empty() && ExecutorMaySample(executor, sched, record)) {
    device_rows_.clear();
    prepare_rows_.clear();
    for (const ScheduledSeq& s : sched.scheduled) {
      if (!s.needs_logits) continue;
      RequestState& req = Get(s.group->request_id);
      SeqState* st = req.Find(s.seq);
      const SamplingParams& p = req.params;
      DeviceSampleRow row;
      row.params = &req.params;
      row.uniform = p.greedy() ? 0.0 : st->sampler.NextUniform();
      row.prompt = st->prompt();
      row.output = st->output();
      device_rows_.push_back(row);
      prepare_rows_.push_back(
          LogitsContext{p, st->prompt(), st->output(), config_.vocab_size, static_cast<uint64_t>(st->seq->id)});
      costly = costly || logits_processors_.Costly(p);
    }
    if (step_constraints_.size() < device_rows_.size()) step_constraints_.resize(device_rows_.size());
    sampling.emplace();
    sampling->rows = device_rows_;
    if (costly) {
      constraints = std::async(std::launch::async, [this] { return Guarded([this] { FillDeviceConstraints(); }); });
      sampling->await_constraints = [&constraints] { constraints.wait(); };
    } else {
      constraints_ok = Guarded([this] { FillDeviceConstraints(); });
    }
  } else if (!sched.empty() && !executor.ForwardUsesHostCores() &&
             std::any_of(sched.scheduled.begin(), sched.scheduled.end(), [&](const ScheduledSeq& s) {
               return s.needs_logits && logits_processors_.Costly(requests_.at(s.group->request_id)->params);
             })) {
    constraints = std::async(std::launch::async,
                             [this, &sched, &record] { return Guarded([&] { PrepareConstraints(sched, record); }); });
    host_constraints_prepared = true;
  }
  ExecutorOutput out;
  out.want_final_hidden = supervisor_ && supervisor_->has_probe();
  Status st = executor.Run(sched, record.logits, sampling ? &*sampling : nullptr, out);
  // Awaited here too: the forward pass may have failed before the sampler asked.
  if (constraints.valid()) constraints_ok = constraints.get();
  if (!constraints_ok && st.ok()) st = Status::Internal("a logits processor failed (see the log)");
  if (sched.empty()) return result;
  result.num_steps_completed = 1;
  if (st.ok()) st = CheckOutput(sched, out, sampling.has_value(), record);
  if (!st.ok()) {
    // A failed step fails the requests in it, not the engine.
    spdlog::error("forward pass failed: {}", st.ToString());
    FailScheduled(sched, st);
    return result;
  }
  FinishStep(sched, out, sampling.has_value(), host_constraints_prepared, record);
  return result;
}

LogitsMode EngineCore::LogitsFor(const ScheduledSeq& s) const {
  const RequestState& req = *requests_.at(s.group->request_id);
  // Draft verification: a row for the last real token and one per draft (a decoding sequence has
  // one real token); prompt logprobs: a row for every prompt token followed by another.
  if (s.num_draft_tokens > 0) return LogitsMode::kAll;
  if (req.params.prompt_logprobs && s.seq->num_computed < s.seq->prompt_len - 1) return LogitsMode::kAll;
  return s.needs_logits ? LogitsMode::kLast : LogitsMode::kNone;
}

int64_t EngineCore::RowsOf(const ScheduledSeq& s, LogitsMode mode) {
  return mode == LogitsMode::kAll ? s.num_tokens : mode == LogitsMode::kLast ? 1 : 0;
}

Status EngineCore::CheckOutput(const SchedulerOutput& sched, const ExecutorOutput& out, bool sampled,
                               const StepRecord& record) const {
  size_t rows = 0;
  if (sampled) {
    rows = static_cast<size_t>(std::count_if(sched.scheduled.begin(), sched.scheduled.end(),
                                             [](const ScheduledSeq& s) { return s.needs_logits; }));
  } else {
    for (size_t k = 0; k < sched.scheduled.size(); ++k) rows += static_cast<size_t>(RowsOf(sched.scheduled[k], record.logits[k]));
  }
  if (sampled ? out.sampled.size() == rows : out.logits.size() == rows * static_cast<size_t>(out.vocab_size)) {
    return Status::Ok();
  }
  return Status::Internal("the executor returned " +
                          std::to_string(sampled ? out.sampled.size() : out.logits.size()) + (sampled ? " token lists" : " logits") +
                          " for " + std::to_string(rows) + " sequences");
}

void EngineCore::WarnAboutPreemptions(const SchedulerOutput& sched) const {
  const int preempted = sched.num_preempted_recompute + sched.num_preempted_swap;
  if (preempted == 0) return;
  // Like vLLM: say so (rate-limited), since it means the KV cache is too small for the load.
  const SchedulerStats s = scheduler_.stats();
  const int64_t total = s.num_preemptions_recompute + s.num_preemptions_swap;
  if (total == preempted || total / 50 != (total - preempted) / 50) {
    spdlog::warn("KV cache full: preempted {} request(s) this step ({} by swap), {} in total; more KV blocks "
                 "(kv_cache_bytes / num_kv_blocks) would avoid it",
                 preempted, sched.num_preempted_swap, total);
  }
}

bool EngineCore::ExecutorMaySample(const Executor& executor, const SchedulerOutput& sched,
                                   const StepRecord& record) const {
  if (!executor.SupportsSampling()) return false;
  for (LogitsMode m : record.logits) {
    if (m == LogitsMode::kAll) return false;  // prompt logprobs and drafts are scored on the host
  }
  for (const ScheduledSeq& s : sched.scheduled) {
    if (!s.needs_logits) continue;
    const RequestState& req = *requests_.at(s.group->request_id);
    if (!req.strategy->ExecutorMaySample() || req.params.logprobs > kMaxDeviceTopLogprobs ||
        req.params.max_tokens == 0 ||
        ((!req.params.logit_bias.empty() || req.params.structured_output) && !executor.AppliesTokenMasks())) {
      return false;
    }
  }
  return true;
}

void EngineCore::UpdateFromOutput(const SchedulerOutput& sched, ExecutorOutput& out, bool sampled, bool prepared,
                                  const StepRecord& record) {
  if (sampled) {
    size_t next = 0;
    for (const ScheduledSeq& s : sched.scheduled) {
      if (!s.needs_logits) continue;
      RequestState& req = Get(s.group->request_id);
      req.strategy->OnSampled(*this, req, *req.Find(s.seq), out.sampled[next++]);
      MaybeFinishRequest(req);
    }
    return;
  }
  if (!prepared) PrepareConstraints(sched, record);
  // Logit rows by request, in batch order; prompt rows are scored on the way.
  const int64_t V = out.vocab_size;
  std::vector<std::pair<RequestState*, std::vector<SeqLogits>>> by_request;
  int64_t row = 0;
  for (size_t k = 0; k < sched.scheduled.size(); ++k) {
    const ScheduledSeq& s = sched.scheduled[k];
    const int64_t rows = RowsOf(s, record.logits[k]);
    float* first_row = out.logits.data() + row * V;
    row += rows;
    RequestState* req = &Get(s.group->request_id);
    if (req->params.prompt_logprobs && record.logits[k] == LogitsMode::kAll && record.drafts[k].empty()) {
      RecordPromptLogprobs(*req, *s.seq, record.first_position[k], first_row, s.num_tokens, V);
    }
    if (!s.needs_logits) continue;
    // The prompt's last row, before its first output: S3's probe re-sizes the reservation.
    if (!out.final_hidden.empty() && s.seq->num_tokens() == s.seq->prompt_len && record.drafts[k].empty()) {
      const size_t H = static_cast<size_t>(out.hidden_size);
      supervisor_->OnPrefillHidden(*s.group, out.final_hidden.subspan(static_cast<size_t>(row - 1) * H, H));
      // A shorter reservation than the one admitted gives its unwritten blocks back at once.
      probe_released_blocks_ += scheduler_.ReleaseBeyondReservation(*s.group);
    }
    if (req->params.max_tokens == 0) {
      FinishPromptOnly(*req);
      continue;
    }
    // The sampling rows: the last one, or the last real token's and each draft's.
    const int64_t used = static_cast<int64_t>(record.drafts[k].size()) + 1;
    std::span<float> logits(first_row + (rows - used) * V, static_cast<size_t>(used * V));
    if (by_request.empty() || by_request.back().first != req) by_request.push_back({req, {}});
    by_request.back().second.push_back({req->Find(s.seq), logits, record.drafts[k], &s});
  }
  for (auto& [req, rows] : by_request) {
    req->strategy->OnLogits(*this, *req, rows);
    MaybeFinishRequest(*req);
  }
}

// ---- prompt logprobs -------------------------------------------------------------------------------

void EngineCore::RecordPromptLogprobs(RequestState& req, const SchedSequence& seq, int64_t first_position,
                                      const float* rows, int64_t num_rows, int64_t vocab_size) {
  for (int64_t j = 0; j < num_rows; ++j) {
    const int64_t next = first_position + j + 1;  // the prompt token row j predicts
    if (next >= seq.prompt_len) break;
    // A prompt recomputed after a preemption is not scored twice.
    if (next != static_cast<int64_t>(req.prompt_logprobs.size()) + 1) continue;
    req.prompt_logprobs.push_back(ScoreToken(std::span<const float>(rows + j * vocab_size, static_cast<size_t>(vocab_size)),
                                             seq.tokens[static_cast<size_t>(next)], *req.params.prompt_logprobs));
  }
}

void EngineCore::AttachPromptLogprobs(RequestState& req, StreamEvent& event) {
  if (!req.params.prompt_logprobs || req.prompt_logprobs_sent) return;
  event.prompt_logprobs = std::move(req.prompt_logprobs);
  req.prompt_logprobs_sent = true;
}

void EngineCore::FinishPromptOnly(RequestState& req) {
  for (auto& st : req.seqs) FinishSequence(*st, FinishReason::kLength);
  StreamEvent e;
  e.id = req.id;
  e.finished = true;
  e.request_finished = true;
  e.finish_reason = FinishReason::kLength;
  AttachPromptLogprobs(req, e);
  if (supervisor_) ReportLength(req);
  if (observer_) observer_->OnRequestFinished(*req.group);
  if (req.on_event) req.on_event(e);
  Forget(req.id);
}

// ---- speculative decoding -------------------------------------------------------------------------

Status EngineCore::CommitDrafts(RequestState& req, SeqState& seq, const ScheduledSeq& step, int64_t drafted,
                                int64_t accepted) {
  stats_.spec.num_drafts += 1;
  stats_.spec.num_draft_tokens += drafted;
  stats_.spec.num_accepted_tokens += accepted;
  if (stats_.spec.accepted_per_position.size() < static_cast<size_t>(drafted)) {
    stats_.spec.accepted_per_position.resize(static_cast<size_t>(drafted), 0);
  }
  for (int64_t i = 0; i < accepted; ++i) ++stats_.spec.accepted_per_position[static_cast<size_t>(i)];
  if (config_.drafter) config_.drafter->OnVerified(seq.seq->id, drafted, accepted);
  if (seq.finish != FinishReason::kNone) return Status::Ok();  // finished: its blocks are free already
  return scheduler_.CommitDrafts(step, accepted);
}

// ---- the update of a sequence ---------------------------------------------------------------------

SeqState& EngineCore::Fork(RequestState& req, const SeqState& parent, int index, uint64_t seed) {
  SchedSequence* child = scheduler_.Fork(*req.group, *parent.seq);
  logits_processors_.Fork(parent.seq->id, child->id);
  req.seqs.push_back(std::make_unique<SeqState>(child, index, req.params, seed, tokenizer_));
  return *req.seqs.back();
}

void EngineCore::AppendUnchecked(SeqState& seq, const SampledToken& token) {
  seq.seq->tokens.push_back(token.token);
  seq.cumulative_logprob += token.logprob;
  seq.logprobs.push_back(token);
  ++stats_.generated_tokens;
}

FinishReason EngineCore::AppendTokens(RequestState& req, SeqState& st, std::span<const SampledToken> tokens) {
  const SamplingParams& p = req.params;
  FinishReason finish = FinishReason::kNone;
  StreamEvent event;
  event.id = req.id;
  event.index = st.index;
  for (const SampledToken& tok : tokens) {
    AppendUnchecked(st, tok);
    event.tokens.push_back(tok);
    if (IsEos(p, tok.token)) {
      finish = FinishReason::kEos;
    } else if (IsStopToken(p, tok.token)) {
      finish = FinishReason::kStop;
    } else {
      event.text_delta += st.stop.Push(st.decoder ? st.decoder->Push(tok.token) : std::string());
      if (st.stop.stopped()) finish = FinishReason::kStop;
    }
    if (finish == FinishReason::kNone && ReachedLength(p, *st.seq)) finish = FinishReason::kLength;
    if (finish != FinishReason::kNone) break;  // the tokens after a stop are dropped
  }
  if (finish != FinishReason::kNone && finish != FinishReason::kStop) {
    if (st.decoder) event.text_delta += st.stop.Push(st.decoder->Flush());
    event.text_delta += st.stop.Flush();
  }
  st.text += event.text_delta;
  if (finish != FinishReason::kNone) {
    FinishSequence(st, finish);
    event.finished = true;
    event.finish_reason = finish;
  }
  if (p.streams() && req.on_event) {
    event.request_finished = event.finished && req.strategy->Finished(req);
    AttachPromptLogprobs(req, event);
    req.on_event(event);
  }
  return finish;
}

void EngineCore::FinishSequence(SeqState& seq, FinishReason why) {
  seq.finish = why;
  if (config_.drafter) config_.drafter->Forget(seq.seq->id);
  if (config_.kv_selector) config_.kv_selector->Forget(seq.seq->id);
  logits_processors_.Forget(seq.seq->id);
  scheduler_.FinishSequence(*seq.seq);
}

bool EngineCore::IsEos(const SamplingParams& p, int32_t token) const {
  const auto& eos = config_.eos_token_ids;
  return !p.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end();
}

bool EngineCore::IsStopToken(const SamplingParams& p, int32_t token) {
  return std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
}

bool EngineCore::ReachedLength(const SamplingParams& p, const SchedSequence& seq) const {
  return seq.output_len() >= p.max_tokens || seq.num_tokens() >= config_.scheduler.max_model_len;
}

void EngineCore::PrepareConstraints(const SchedulerOutput& sched, const StepRecord& record) {
  prepare_rows_.clear();
  for (size_t k = 0; k < sched.scheduled.size(); ++k) {
    const ScheduledSeq& s = sched.scheduled[k];
    if (!s.needs_logits || record.logits[k] != LogitsMode::kLast) continue;
    RequestState& req = Get(s.group->request_id);
    if (req.params.max_tokens == 0) continue;
    const SeqState* st = req.Find(s.seq);
    if (st == nullptr) continue;
    prepare_rows_.push_back(
        LogitsContext{req.params, st->prompt(), st->output(), config_.vocab_size, static_cast<uint64_t>(st->seq->id)});
  }
  if (!prepare_rows_.empty()) logits_processors_.Prepare(prepare_rows_);
}

void EngineCore::FillDeviceConstraints() {
  logits_processors_.Prepare(prepare_rows_);
  for (size_t i = 0; i < device_rows_.size(); ++i) {
    device_rows_[i].constraint =
        logits_processors_.Constrain(prepare_rows_[i], step_constraints_[i]) ? &step_constraints_[i] : nullptr;
  }
}

const TokenConstraint* EngineCore::Constrain(const SamplingParams& p, const SeqState& seq,
                                             std::span<const int32_t> output, TokenConstraint& constraint) const {
  const LogitsContext ctx{p, seq.prompt(), output, config_.vocab_size, static_cast<uint64_t>(seq.seq->id)};
  return logits_processors_.Constrain(ctx, constraint) ? &constraint : nullptr;
}

std::string EngineCore::Decode(const std::vector<int32_t>& tokens) const {
  return tokenizer_ ? tokenizer_->DecodePieces(tokens) : std::string();
}

// ---- the end of a request -------------------------------------------------------------------------

void EngineCore::MaybeFinishRequest(RequestState& req) {
  if (!req.strategy->Finished(req)) return;
  if (supervisor_) ReportLength(req);
  if (observer_) observer_->OnRequestFinished(*req.group);
  req.strategy->Deliver(*this, req);
  Forget(req.id);
}

// Tells the S3 supervisor how long the request really ran: its longest sequence, and whether that
// one ended by itself (so the length is true, not a cut).
void EngineCore::ReportLength(const RequestState& req) {
  int64_t longest = -1;
  bool natural = false;
  for (const auto& s : req.seqs) {
    if (s->seq->output_len() > longest) {
      longest = s->seq->output_len();
      natural = s->finish == FinishReason::kEos || s->finish == FinishReason::kStop;
    }
  }
  // A trace replay knows the true length: reaching it is the request's natural end.
  if (req.group->true_output_len && longest == *req.group->true_output_len) natural = true;
  if (longest >= 0) supervisor_->OnFinished(*req.group, longest, natural);
}

void EngineCore::FailScheduled(const SchedulerOutput& sched, const Status& error) {
  std::vector<RequestId> failed;
  for (const ScheduledSeq& s : sched.scheduled) failed.push_back(s.group->request_id);
  std::sort(failed.begin(), failed.end());
  failed.erase(std::unique(failed.begin(), failed.end()), failed.end());
  for (RequestId id : failed) FailRequest(id, error, true);
}

void EngineCore::FailRequest(RequestId id, const Status& error, bool in_scheduler) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  RequestState* req = it->second.get();
  StreamEvent event;
  event.id = id;
  event.finished = true;
  event.request_finished = true;
  event.finish_reason = error.code() == StatusCode::kCancelled ? FinishReason::kCancelled : FinishReason::kError;
  event.error = error;
  if (req->on_event) req->on_event(event);
  for (const auto& st : req->seqs) {
    if (config_.drafter) config_.drafter->Forget(st->seq->id);
    if (config_.kv_selector) config_.kv_selector->Forget(st->seq->id);
    logits_processors_.Forget(st->seq->id);
  }
  if (in_scheduler) scheduler_.RemoveGroup(id);
  requests_.erase(it);
}

void EngineCore::Forget(RequestId id) {
  if (auto it = requests_.find(id); it != requests_.end()) {
    for (const auto& st : it->second->seqs) {
      if (config_.drafter) config_.drafter->Forget(st->seq->id);
      if (config_.kv_selector) config_.kv_selector->Forget(st->seq->id);
      logits_processors_.Forget(st->seq->id);
    }
  }
  scheduler_.RemoveGroup(id);
  requests_.erase(id);
}

void EngineCore::ReapCancelled() {
  std::vector<RequestId> cancelled;
  cancelled.swap(cancelled_);
  for (RequestId id : cancelled) {
    // A request in a step still in flight ends when that step does: its rows are on their way.
    auto it = requests_.find(id);
    if (it != requests_.end() && it->second->group->in_flight) {
      cancelled_.push_back(id);
      continue;
    }
    FailRequest(id, Status::Cancelled("request cancelled"), true);
  }
}

// ---- stats ----------------------------------------------------------------------------------------

EngineStats EngineCore::stats() const {
  EngineStats s = stats_;
  const SchedulerStats sched = scheduler_.stats();
  s.num_waiting = sched.num_waiting;
  s.num_running = sched.num_running;
  s.num_swapped = sched.num_swapped;
  s.num_running_seqs = sched.num_running_seqs;
  s.kv_blocks_total = blocks_.device().num_blocks();
  s.kv_blocks_free = blocks_.device().num_free();
  s.kv_blocks_cached = blocks_.device().num_cached_unused();
  s.kv_blocks_logical = blocks_.NumLogicalDeviceBlocks();
  s.host_blocks_total = blocks_.host().num_blocks();
  s.host_blocks_free = blocks_.host().num_free();
  s.prefix_cache_hit_rate = blocks_.PrefixHitRate();
  s.prefix_cache_queried_blocks = blocks_.prefix_queried_blocks();
  s.prefix_cache_hit_blocks = blocks_.prefix_hit_blocks();
  s.num_preemptions = sched.num_preemptions_recompute + sched.num_preemptions_swap;
  s.num_preemptions_swap = sched.num_preemptions_swap;
  s.blocks_swapped_out = sched.blocks_swapped_out;
  s.blocks_swapped_in = sched.blocks_swapped_in;
  s.blocks_copied = sched.blocks_copied;
  s.s3.reservation_preemptions = sched.num_reservation_preemptions;
  if (supervisor_) {
    const LengthSupervisorStats& l = supervisor_->stats();
    s.s3.predictions = l.predictions;
    s.s3.compared = l.compared;
    s.s3.under_predicted = l.under_predicted;
    s.s3.over_predicted = l.over_predicted;
    s.s3.correct = l.correct;
    s.s3.online_updates = l.online_updates;
    s.s3.predict_seconds = l.predict_seconds;
    s.s3.update_seconds = l.update_seconds;
    s.s3.probe_predictions = l.probe_predictions;
    s.s3.probe_resized = l.probe_resized;
    s.s3.probe_released_blocks = probe_released_blocks_;
    s.s3.probe_seconds = l.probe_seconds;
    s.s3.probe_online_updates = l.probe_online_updates;
  }
  if (config_.drafter) config_.drafter->AddStats(s.spec);
  if (config_.kv_selector) config_.kv_selector->AddStats(s.kv_selection);
  return s;
}

}  // namespace kvflow
