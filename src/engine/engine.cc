#include "kvflow/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <deque>
#include <memory>
#include <random>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "engine/evaluation.h"
#include "engine/request_state.h"
#include "kv/block_manager.h"
#include "sched/policy.h"
#include "sched/length_supervisor.h"
#include "sched/scheduler.h"
#include "util/hash.h"
#include "model/llama_weights.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"

namespace kvflow {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kEos: return "eos";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Seed of candidate `index` of a request: the request seed itself for the first, so n = 1
// reproduces what a plain request gives.
uint64_t CandidateSeed(uint64_t seed, int index) {
  if (index == 0) return seed;
  return SplitMix64(seed + kGoldenGamma * static_cast<uint64_t>(index));
}

double BeamScore(double cumulative_logprob, int64_t length, float length_penalty) {
  return cumulative_logprob / std::pow(static_cast<double>(std::max<int64_t>(1, length)), length_penalty);
}

class EngineImpl final : public EvaluationEngine {
 public:
  EngineImpl(EngineConfig config, ModelFiles files, std::unique_ptr<Backend> backend,
             std::unique_ptr<SchedulingPolicy> policy, PreemptionMode preemption,
             std::unique_ptr<LengthSupervisor> supervisor)
      : config_(std::move(config)),
        model_config_(files.config),
        tokenizer_(std::move(files.tokenizer)),
        backend_(std::move(backend)),
        blocks_(BlockManagerConfig{config_.block_size, backend_->kv_layout().num_blocks, backend_->num_host_blocks(),
                                   config_.enable_prefix_caching}),
        scheduler_(SchedulerConfig{config_.max_num_seqs, config_.max_num_batched_tokens, config_.max_model_len,
                                   preemption},
                   blocks_, std::move(policy)),
        length_supervisor_(std::move(supervisor)),
        seed_rng_(config_.seed) {}

  Result<RequestId> AddRequest(const std::string& prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    return AddRequest(tokenizer_->Encode(prompt, tokenizer_->add_bos()), params, std::move(on_event));
  }

  Result<RequestId> AddRequest(std::vector<int32_t> prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    return AddRequestWithHints(std::move(prompt), params, std::move(on_event), {});
  }

  Status ValidateRequest(const std::vector<int32_t>& prompt, const SamplingParams& params) const override {
    KVFLOW_RETURN_IF_ERROR(params.Validate());
    if (prompt.empty()) return Status::InvalidArgument("the prompt is empty");
    if (params.num_candidates() > config_.max_num_seqs) {
      return Status::InvalidArgument("best_of/n of " + std::to_string(params.num_candidates()) +
                                     " exceeds max_num_seqs (" + std::to_string(config_.max_num_seqs) + ")");
    }
    for (int32_t t : prompt) {
      if (t < 0 || t >= model_config_.vocab_size) {
        return Status::InvalidArgument("prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                       std::to_string(model_config_.vocab_size) + ")");
      }
    }
    if (static_cast<int64_t>(prompt.size()) >= config_.max_model_len) {
      return Status::InvalidArgument("the prompt has " + std::to_string(prompt.size()) +
                                     " tokens; max_model_len is " + std::to_string(config_.max_model_len));
    }
    return Status::Ok();
  }

  Result<RequestId> AddRequestWithHints(std::vector<int32_t> prompt, const SamplingParams& params,
                                        StreamCallback on_event, const RequestHints& hints) override {
    KVFLOW_RETURN_IF_ERROR(ValidateRequest(prompt, params));
    auto req = std::make_unique<RequestState>();
    req->id = next_id_++;
    req->params = params;
    req->seed = params.seed.value_or(seed_rng_());
    req->on_event = std::move(on_event);

    auto group = std::make_unique<SequenceGroup>();
    group->request_id = req->id;
    group->arrival_time = Seconds(req->arrival.time_since_epoch());
    group->max_output_tokens = hints.hide_max_tokens ? config_.max_model_len - static_cast<int64_t>(prompt.size())
                                                     : params.max_tokens;
    group->num_candidates = params.num_candidates();
    group->true_output_len = hints.true_output_len;
    group->predicted_output_len = hints.predicted_output_len;
    auto seq = std::make_unique<SchedSequence>();
    seq->id = scheduler_.NewSeqId();
    seq->prompt_len = static_cast<int64_t>(prompt.size());
    seq->tokens = std::move(prompt);
    group->seqs.push_back(std::move(seq));
    if (length_supervisor_ && !group->predicted_output_len) length_supervisor_->Predict(*group);
    SchedSequence* first = group->seqs.front().get();
    req->seqs.push_back(std::make_unique<SeqState>(first, 0, params, req->seed, *tokenizer_));
    req->group = group.get();
    scheduler_.AddGroup(std::move(group));
    const RequestId id = req->id;
    requests_.emplace(id, std::move(req));
    return id;
  }

  Status Cancel(RequestId id) override {
    auto it = requests_.find(id);
    if (it == requests_.end()) return Status::NotFound("no unfinished request " + std::to_string(id));
    it->second->cancel_requested = true;
    if (!in_step_) ReapCancelled();
    return Status::Ok();
  }

  bool HasUnfinishedRequests() const override { return !requests_.empty(); }

  Result<StepResult> Step() override {
    in_step_ = true;
    auto result = StepInner();
    in_step_ = false;
    ReapCancelled();
    return result;
  }

  Result<RequestOutput> Generate(const std::string& prompt, const SamplingParams& params,
                                 StreamCallback on_event) override {
    RequestOutput out;
    out.prompt_tokens = tokenizer_->Encode(prompt, tokenizer_->add_bos());
    KVFLOW_ASSIGN_OR_RETURN(out.id, AddRequest(out.prompt_tokens, params, Collector(out, params, std::move(on_event))));
    KVFLOW_RETURN_IF_ERROR(RunUntilDone());
    return out;
  }

  Result<std::vector<RequestOutput>> Generate(const std::vector<std::string>& prompts,
                                              const SamplingParams& params) override {
    std::vector<RequestOutput> outs(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      outs[i].prompt_tokens = tokenizer_->Encode(prompts[i], tokenizer_->add_bos());
      auto id = AddRequest(outs[i].prompt_tokens, params, Collector(outs[i], params, {}));
      if (!id.ok()) {
        for (size_t j = 0; j < i; ++j) (void)Cancel(outs[j].id);
        (void)RunUntilDone();  // drain the cancellations; the admission error is what we report
        return id.status();
      }
      outs[i].id = id.value();
    }
    KVFLOW_RETURN_IF_ERROR(RunUntilDone());
    return outs;
  }

  const ModelConfig& model_config() const override { return model_config_; }
  const EngineConfig& config() const override { return config_; }
  const Tokenizer& tokenizer() const override { return *tokenizer_; }

  EngineStats stats() const override {
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
    s.num_preemptions = sched.num_preemptions_recompute + sched.num_preemptions_swap;
    s.num_preemptions_swap = sched.num_preemptions_swap;
    s.blocks_swapped_out = sched.blocks_swapped_out;
    s.blocks_swapped_in = sched.blocks_swapped_in;
    s.blocks_copied = sched.blocks_copied;
    s.s3.reservation_preemptions = sched.num_reservation_preemptions;
    if (length_supervisor_) {
      const LengthSupervisorStats& l = length_supervisor_->stats();
      s.s3.predictions = l.predictions;
      s.s3.compared = l.compared;
      s.s3.under_predicted = l.under_predicted;
      s.s3.over_predicted = l.over_predicted;
      s.s3.correct = l.correct;
      s.s3.online_updates = l.online_updates;
      s.s3.predict_seconds = l.predict_seconds;
      s.s3.update_seconds = l.update_seconds;
    }
    return s;
  }

  std::string Describe() const override {
    return model_config_.name + " on " + backend_->Describe() + ", swap " + std::to_string(blocks_.host().num_blocks()) +
           " blocks, max_model_len " + std::to_string(config_.max_model_len) + ", policy " +
           std::string(scheduler_.policy().name()) + ", preemption " +
           PreemptionModeName(scheduler_.config().preemption_mode) +
           (blocks_.prefix_caching() ? ", prefix caching" : "");
  }

 private:
  // Wraps a user callback so the final RequestOutput is assembled as events arrive.
  static StreamCallback Collector(RequestOutput& out, const SamplingParams& params, StreamCallback user) {
    const auto start = Clock::now();
    out.outputs.resize(static_cast<size_t>(params.n));
    for (int i = 0; i < params.n; ++i) out.outputs[static_cast<size_t>(i)].index = i;
    return [&out, user = std::move(user), start](const StreamEvent& e) {
      if (e.index >= 0 && static_cast<size_t>(e.index) < out.outputs.size()) {
        CompletionOutput& c = out.outputs[static_cast<size_t>(e.index)];
        for (const SampledToken& t : e.tokens) {
          if (out.time_to_first_token_s == 0.0) out.time_to_first_token_s = Seconds(Clock::now() - start);
          c.tokens.push_back(t.token);
          c.cumulative_logprob += t.logprob;
          c.logprobs.push_back(t);
        }
        c.text += e.text_delta;
        if (e.finished) c.finish_reason = e.finish_reason;
      }
      if (e.request_finished) {
        for (CompletionOutput& c : out.outputs) {
          if (c.finish_reason == FinishReason::kNone) c.finish_reason = e.finish_reason;
        }
        out.total_time_s = Seconds(Clock::now() - start);
      }
      if (user) user(e);
    };
  }

  Status RunUntilDone() {
    while (HasUnfinishedRequests()) {
      auto step = Step();
      if (!step.ok()) return step.status();
    }
    return Status::Ok();
  }

  Result<StepResult> StepInner() {
    ReapCancelled();
    SchedulerOutput sched = scheduler_.Schedule();
    for (auto& [id, why] : sched.rejected) FailRequest(id, why, /*in_scheduler=*/false);
    if (length_supervisor_) {
      for (RequestId id : sched.reservation_exhausted) {
        if (const SequenceGroup* g = scheduler_.Find(id)) length_supervisor_->OnReservationExhausted(*g);
      }
    }
    if (const int preempted = sched.num_preempted_recompute + sched.num_preempted_swap; preempted > 0) {
      // Like vLLM: say so (rate-limited), since it means the KV cache is too small for the load.
      const int64_t total = scheduler_.stats().num_preemptions_recompute + scheduler_.stats().num_preemptions_swap;
      if (total == preempted || total / 50 != (total - preempted) / 50) {
        spdlog::warn("KV cache full: preempted {} request(s) this step ({} by swap), {} in total; more KV blocks "
                     "(kv_cache_bytes / num_kv_blocks) would avoid it",
                     preempted, sched.num_preempted_swap, total);
      }
    }
    // Block moves first: swap-out frees device blocks this step may reuse.
    KVFLOW_RETURN_IF_ERROR(backend_->CopyBlocks(sched.swap_out, BlockCopyKind::kDeviceToHost));
    KVFLOW_RETURN_IF_ERROR(backend_->CopyBlocks(sched.swap_in, BlockCopyKind::kHostToDevice));
    KVFLOW_RETURN_IF_ERROR(backend_->CopyBlocks(sched.copies, BlockCopyKind::kDeviceToDevice));
    StepResult result;
    if (sched.empty()) return result;

    ForwardBatch batch;
    for (const ScheduledSeq& s : sched.scheduled) {
      SequenceSlice slice;
      slice.token_offset = static_cast<int32_t>(batch.tokens.size());
      slice.num_tokens = static_cast<int32_t>(s.num_tokens);
      slice.context_len = static_cast<int32_t>(s.seq->num_computed + s.num_tokens);
      slice.block_table = blocks_.BlockTable(s.seq->id);
      slice.logits = s.needs_logits ? LogitsMode::kLast : LogitsMode::kNone;
      for (int64_t i = 0; i < s.num_tokens; ++i) {
        const int64_t pos = s.seq->num_computed + i;
        batch.tokens.push_back(s.seq->tokens[static_cast<size_t>(pos)]);
        batch.positions.push_back(static_cast<int32_t>(pos));
      }
      const bool is_prefill = s.seq->num_computed < s.seq->prompt_len || s.num_tokens > 1;
      (is_prefill ? result.num_prefill_tokens : result.num_decode_tokens) += static_cast<int>(s.num_tokens);
      batch.seqs.push_back(std::move(slice));
    }
    result.num_seqs = static_cast<int>(sched.scheduled.size());

    // Sample on the device when the backend can and every row is a plain one (no forks, no beams):
    // then only tokens and logprobs come back to the host.
    std::vector<DeviceSampleRow> device_rows;
    std::vector<std::vector<int32_t>> device_suppress;
    std::vector<SampledToken> device_sampled;
    const bool sample_on_device = backend_->SupportsDeviceSampling() && DeviceSamplingApplies(sched);
    if (sample_on_device) {
      for (const ScheduledSeq& s : sched.scheduled) {
        if (!s.needs_logits) continue;
        RequestState* req = requests_.at(s.group->request_id).get();
        SeqState* st = req->Find(s.seq);
        const SamplingParams& p = req->params;
        device_suppress.push_back(st->seq->output_len() < p.min_tokens ? SuppressedBeforeMinTokens(p)
                                                                        : std::vector<int32_t>{});
        DeviceSampleRow row;
        row.params = &req->params;
        row.uniform = p.greedy() ? 0.0 : st->sampler.NextUniform();
        row.prompt = st->prompt();
        row.output = st->output();
        device_rows.push_back(row);
      }
      for (size_t i = 0; i < device_rows.size(); ++i) device_rows[i].suppress = device_suppress[i];
    }
    Status st = sample_on_device ? backend_->ForwardAndSample(batch, device_rows, device_sampled)
                                 : backend_->Forward(batch, logits_);
    if (!st.ok()) {
      // A failed step fails the requests in it, not the engine.
      spdlog::error("forward pass failed: {}", st.ToString());
      std::vector<RequestId> failed;
      for (const ScheduledSeq& s : sched.scheduled) failed.push_back(s.group->request_id);
      std::sort(failed.begin(), failed.end());
      failed.erase(std::unique(failed.begin(), failed.end()), failed.end());
      for (RequestId id : failed) FailRequest(id, st, true);
      return result;
    }
    scheduler_.CompleteStep(sched);
    ++stats_.num_steps;
    stats_.prompt_tokens_processed += result.num_prefill_tokens;

    if (sample_on_device) {
      size_t next = 0;
      for (const ScheduledSeq& s : sched.scheduled) {
        if (!s.needs_logits) continue;
        RequestState* req = requests_.at(s.group->request_id).get();
        req->forked = true;  // one candidate: nothing to fork
        AcceptToken(req, req->Find(s.seq), std::move(device_sampled[next++]));
        MaybeFinishRequest(req);
      }
      return result;
    }

    // Logit rows by request, in batch order.
    const int64_t V = model_config_.vocab_size;
    std::vector<std::pair<RequestState*, std::vector<std::pair<SeqState*, std::span<float>>>>> by_request;
    int64_t row = 0;
    for (const ScheduledSeq& s : sched.scheduled) {
      if (!s.needs_logits) continue;
      std::span<float> logits(logits_.data() + row * V, static_cast<size_t>(V));
      ++row;
      RequestState* req = requests_.at(s.group->request_id).get();
      if (by_request.empty() || by_request.back().first != req) by_request.push_back({req, {}});
      by_request.back().second.emplace_back(req->Find(s.seq), logits);
    }
    for (auto& [req, rows] : by_request) {
      if (req->params.use_beam_search) {
        BeamStep(req, rows);
      } else {
        SampleStep(req, rows);
      }
    }
    return result;
  }

  // ---- sampling (n, best_of) ------------------------------------------------------------------

  void SampleStep(RequestState* req, std::vector<std::pair<SeqState*, std::span<float>>>& rows) {
    const int candidates = req->params.num_candidates();
    if (!req->forked && candidates > 1) {
      // The prompt's logits are in: every further candidate forks off the first and shares its
      // prompt blocks, then samples from the same logits.
      req->forked = true;
      SeqState* first = rows.front().first;
      std::span<float> logits = rows.front().second;
      for (int i = 1; i < candidates; ++i) {
        SchedSequence* child = scheduler_.Fork(*req->group, *first->seq);
        req->seqs.push_back(
            std::make_unique<SeqState>(child, i, req->params, CandidateSeed(req->seed, i), *tokenizer_));
        fork_logits_.emplace_back(logits.begin(), logits.end());
      }
      for (int i = 1; i < candidates; ++i) {
        rows.emplace_back(req->seqs[static_cast<size_t>(i)].get(), std::span<float>(fork_logits_[static_cast<size_t>(i - 1)]));
      }
    } else {
      req->forked = true;
    }
    for (auto& [st, logits] : rows) SampleOne(req, st, logits);
    fork_logits_.clear();
    MaybeFinishRequest(req);
  }

  void SampleOne(RequestState* req, SeqState* st, std::span<float> logits) {
    const SamplingParams& p = req->params;
    std::vector<int32_t> suppress;
    if (st->seq->output_len() < p.min_tokens) suppress = SuppressedBeforeMinTokens(p);
    AcceptToken(req, st, st->sampler.Sample(logits, st->prompt(), st->output(), suppress));
  }

  // Every request behind the step's logit rows samples one plain sequence.
  bool DeviceSamplingApplies(const SchedulerOutput& sched) const {
    for (const ScheduledSeq& s : sched.scheduled) {
      if (!s.needs_logits) continue;
      const SamplingParams& p = requests_.at(s.group->request_id)->params;
      if (p.use_beam_search || p.num_candidates() != 1 || p.logprobs > kMaxDeviceTopLogprobs) return false;
    }
    return true;
  }

  // Appends a sampled token to its sequence and streams it; finishes the sequence at EOS, a stop
  // token or string, or its length limit.
  void AcceptToken(RequestState* req, SeqState* st, SampledToken tok) {
    const SamplingParams& p = req->params;
    st->seq->tokens.push_back(tok.token);
    st->cumulative_logprob += tok.logprob;
    ++stats_.generated_tokens;

    FinishReason finish = FinishReason::kNone;
    StreamEvent event;
    event.id = req->id;
    event.index = st->index;
    if (IsEos(p, tok.token)) {
      finish = FinishReason::kEos;
    } else if (IsStopToken(p, tok.token)) {
      finish = FinishReason::kStop;
    } else {
      event.text_delta = st->stop.Push(st->decoder.Push(tok.token));
      if (st->stop.stopped()) finish = FinishReason::kStop;
    }
    if (finish == FinishReason::kNone && ReachedLength(p, *st->seq)) finish = FinishReason::kLength;
    if (finish != FinishReason::kNone && finish != FinishReason::kStop) {
      event.text_delta += st->stop.Push(st->decoder.Flush());
      event.text_delta += st->stop.Flush();
    }
    st->text += event.text_delta;
    st->logprobs.push_back(tok);
    event.tokens.push_back(std::move(tok));
    if (finish != FinishReason::kNone) {
      st->finish = finish;
      scheduler_.FinishSequence(*st->seq);
      event.finished = true;
      event.finish_reason = finish;
    }
    if (p.streams() && req->on_event) {
      event.request_finished = event.finished && AllFinished(*req);
      req->on_event(event);
    }
  }

  // When every candidate is done: non-streaming requests deliver their n best now; then the
  // request is forgotten.
  void MaybeFinishRequest(RequestState* req) {
    if (!AllFinished(*req)) return;
    if (length_supervisor_) ReportLength(*req);
    if (!req->params.streams()) {
      std::vector<SeqState*> order;
      for (auto& s : req->seqs) order.push_back(s.get());
      std::stable_sort(order.begin(), order.end(), [](const SeqState* a, const SeqState* b) {
        return a->cumulative_logprob > b->cumulative_logprob;
      });
      for (int i = 0; i < req->params.n; ++i) {
        SeqState* s = order[static_cast<size_t>(i)];
        StreamEvent e;
        e.id = req->id;
        e.index = i;
        e.tokens = s->logprobs;
        e.text_delta = s->text;
        e.finished = true;
        e.finish_reason = s->finish;
        e.request_finished = i + 1 == req->params.n;
        if (req->on_event) req->on_event(e);
      }
    }
    Forget(req->id);
  }

  // Tells the S3 supervisor how long the request really ran: its longest sequence, and whether
  // that one ended by itself (so the length is true, not a cut).
  void ReportLength(const RequestState& req) {
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
    if (longest >= 0) length_supervisor_->OnFinished(*req.group, longest, natural);
  }

  bool AllFinished(const RequestState& req) const {
    if (!req.forked && req.params.num_candidates() > 1) return false;
    for (const auto& s : req.seqs) {
      if (s->finish == FinishReason::kNone) return false;
    }
    return true;
  }

  // ---- beam search ----------------------------------------------------------------------------

  void BeamStep(RequestState* req, std::vector<std::pair<SeqState*, std::span<float>>>& rows) {
    for (auto& [st, logits] : rows) st->pending_logits.emplace(logits.begin(), logits.end());
    std::vector<SeqState*> beams;
    for (auto& s : req->seqs) {
      if (s->finish != FinishReason::kNone) continue;
      if (!s->pending_logits) return;  // a beam still prefilling (after recompute): wait for it
      beams.push_back(s.get());
    }
    req->forked = true;
    const SamplingParams& p = req->params;
    const int width = p.num_candidates();
    const int64_t V = model_config_.vocab_size;

    struct Candidate {
      SeqState* parent;
      SampledToken token;
      double cumulative;
    };
    std::vector<Candidate> candidates;
    std::vector<int32_t> order(static_cast<size_t>(V));
    for (SeqState* beam : beams) {
      std::vector<float>& logits = *beam->pending_logits;
      if (beam->seq->output_len() < p.min_tokens) {
        for (int32_t t : SuppressedBeforeMinTokens(p)) {
          if (t >= 0 && t < V) logits[static_cast<size_t>(t)] = -std::numeric_limits<float>::infinity();
        }
      }
      // log-softmax, then the 2 * width best continuations of this beam.
      const float max = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (float l : logits) sum += std::exp(static_cast<double>(l - max));
      const double log_z = static_cast<double>(max) + std::log(sum);
      std::iota(order.begin(), order.end(), 0);
      const size_t keep = std::min<size_t>(static_cast<size_t>(2 * width), order.size());
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                        [&](int32_t a, int32_t b) {
                          return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
                                 (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
                        });
      for (size_t k = 0; k < keep; ++k) {
        SampledToken tok;
        tok.token = order[k];
        tok.logprob = static_cast<float>(logits[static_cast<size_t>(tok.token)] - log_z);
        for (int j = 0; j < p.logprobs && j < static_cast<int>(keep); ++j) {
          tok.top_logprobs.push_back({order[static_cast<size_t>(j)],
                                      static_cast<float>(logits[static_cast<size_t>(order[static_cast<size_t>(j)])] - log_z)});
        }
        candidates.push_back({beam, std::move(tok), beam->cumulative_logprob + (logits[static_cast<size_t>(order[k])] - log_z)});
      }
      beam->pending_logits.reset();
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) { return a.cumulative > b.cumulative; });

    // Top candidates: those ending the sequence become hypotheses (only within the first
    // `width` ranks, as vLLM and HF do); the rest continue until `width` beams are chosen.
    std::vector<Candidate> chosen;
    for (size_t rank = 0; rank < candidates.size() && static_cast<int>(chosen.size()) < width; ++rank) {
      Candidate& c = candidates[rank];
      const bool ends = IsEos(p, c.token.token) || IsStopToken(p, c.token.token);
      if (ends) {
        if (static_cast<int>(rank) < width) {
          AddHypothesis(req, *c.parent, &c.token, c.cumulative,
                        IsEos(p, c.token.token) ? FinishReason::kEos : FinishReason::kStop);
        }
        continue;
      }
      chosen.push_back(std::move(c));
    }

    // Fork extra children from untouched parents first, then append.
    std::vector<std::pair<SeqState*, Candidate*>> assignments;
    std::vector<SeqState*> used;
    for (Candidate& c : chosen) {
      SeqState* target = c.parent;
      if (std::find(used.begin(), used.end(), c.parent) != used.end()) {
        SchedSequence* child = scheduler_.Fork(*req->group, *c.parent->seq);
        req->seqs.push_back(std::make_unique<SeqState>(child, static_cast<int>(req->seqs.size()), p, req->seed, *tokenizer_));
        target = req->seqs.back().get();
        target->logprobs = c.parent->logprobs;
      } else {
        used.push_back(c.parent);
      }
      assignments.emplace_back(target, &c);
    }
    for (SeqState* beam : beams) {
      if (std::find(used.begin(), used.end(), beam) == used.end()) {
        beam->finish = FinishReason::kStop;  // pruned
        scheduler_.FinishSequence(*beam->seq);
      }
    }
    for (auto& [target, c] : assignments) {
      target->seq->tokens.push_back(c->token.token);
      target->cumulative_logprob = c->cumulative;
      target->logprobs.push_back(c->token);
      ++stats_.generated_tokens;
    }

    // Beams that hit the length limit finish; then the vLLM early-stopping test.
    std::vector<SeqState*> running;
    for (auto& [target, c] : assignments) {
      if (ReachedLength(p, *target->seq)) {
        AddHypothesis(req, *target, nullptr, target->cumulative_logprob, FinishReason::kLength);
        target->finish = FinishReason::kLength;
        scheduler_.FinishSequence(*target->seq);
      } else {
        running.push_back(target);
      }
    }
    bool done = running.empty();
    if (!done && static_cast<int>(req->beams_done.size()) >= width) {
      std::vector<double> scores;
      for (const auto& h : req->beams_done) scores.push_back(h.score);
      std::sort(scores.rbegin(), scores.rend());
      const double worst_kept = scores[static_cast<size_t>(width - 1)];
      double best_running = -std::numeric_limits<double>::infinity();
      for (SeqState* r : running) {
        best_running = std::max(best_running, BeamScore(r->cumulative_logprob, r->seq->num_tokens(), p.length_penalty));
      }
      done = worst_kept >= best_running;
    }
    if (!done) return;
    for (SeqState* r : running) {
      r->finish = FinishReason::kStop;
      scheduler_.FinishSequence(*r->seq);
    }
    FinishBeamSearch(req);
  }

  // Records a finished beam: the parent's tokens plus `last` (if any).
  void AddHypothesis(RequestState* req, const SeqState& beam, const SampledToken* last, double cumulative,
                     FinishReason why) {
    BeamHypothesis h;
    h.tokens.assign(beam.output().begin(), beam.output().end());
    h.logprobs = beam.logprobs;
    int64_t length = beam.seq->num_tokens();  // an ending EOS does not count (vLLM)
    if (last) {
      h.tokens.push_back(last->token);
      h.logprobs.push_back(*last);
    }
    h.cumulative_logprob = cumulative;
    h.score = BeamScore(cumulative, length, req->params.length_penalty);
    h.finish = why;
    req->beams_done.push_back(std::move(h));
  }

  void FinishBeamSearch(RequestState* req) {
    auto& done = req->beams_done;
    std::stable_sort(done.begin(), done.end(), [](const BeamHypothesis& a, const BeamHypothesis& b) { return a.score > b.score; });
    const int n = std::min<int>(req->params.n, static_cast<int>(done.size()));
    for (int i = 0; i < n; ++i) {
      const BeamHypothesis& h = done[static_cast<size_t>(i)];
      StreamEvent e;
      e.id = req->id;
      e.index = i;
      e.tokens = h.logprobs;
      std::vector<int32_t> text_tokens = h.tokens;
      if (h.finish == FinishReason::kEos && !text_tokens.empty()) text_tokens.pop_back();
      e.text_delta = tokenizer_->Decode(text_tokens);
      e.finished = true;
      e.finish_reason = h.finish;
      e.request_finished = i + 1 == n;
      if (req->on_event) req->on_event(e);
    }
    Forget(req->id);
  }

  // ---- shared helpers -------------------------------------------------------------------------

  std::vector<int32_t> SuppressedBeforeMinTokens(const SamplingParams& p) const {
    std::vector<int32_t> s = p.stop_token_ids;
    if (!p.ignore_eos) {
      s.insert(s.end(), model_config_.eos_token_ids.begin(), model_config_.eos_token_ids.end());
      if (tokenizer_->eos_id() >= 0) s.push_back(tokenizer_->eos_id());
    }
    return s;
  }
  bool IsEos(const SamplingParams& p, int32_t token) const {
    const auto& eos = model_config_.eos_token_ids;
    return !p.ignore_eos && (std::find(eos.begin(), eos.end(), token) != eos.end() || token == tokenizer_->eos_id());
  }
  static bool IsStopToken(const SamplingParams& p, int32_t token) {
    return std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end();
  }
  bool ReachedLength(const SamplingParams& p, const SchedSequence& seq) const {
    return seq.output_len() >= p.max_tokens || seq.num_tokens() >= config_.max_model_len;
  }

  // Ends a request with an error or cancellation: one final event, blocks freed at once.
  void FailRequest(RequestId id, const Status& error, bool in_scheduler) {
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
    if (in_scheduler) scheduler_.RemoveGroup(id);
    requests_.erase(it);
  }

  void Forget(RequestId id) {
    scheduler_.RemoveGroup(id);
    requests_.erase(id);
  }

  void ReapCancelled() {
    std::vector<RequestId> cancelled;
    for (auto& [id, req] : requests_) {
      if (req->cancel_requested) cancelled.push_back(id);
    }
    for (RequestId id : cancelled) FailRequest(id, Status::Cancelled("request cancelled"), true);
  }

  EngineConfig config_;
  ModelConfig model_config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Backend> backend_;
  BlockManager blocks_;
  Scheduler scheduler_;
  std::unique_ptr<LengthSupervisor> length_supervisor_;  // s3 only
  std::mt19937_64 seed_rng_;
  std::unordered_map<RequestId, std::unique_ptr<RequestState>> requests_;
  std::vector<float> logits_;
  std::vector<std::vector<float>> fork_logits_;
  EngineStats stats_;
  RequestId next_id_ = 1;
  bool in_step_ = false;
};

Status ValidateEngineConfig(const EngineConfig& c) {
  if (c.block_size < 1 || c.block_size > 256) return Status::InvalidArgument("block_size must be in [1, 256]");
  if (c.max_num_seqs < 1) return Status::InvalidArgument("max_num_seqs must be >= 1");
  if (c.max_num_batched_tokens < 1) return Status::InvalidArgument("max_num_batched_tokens must be >= 1");
  if (c.max_model_len < 0) return Status::InvalidArgument("max_model_len must be >= 0");
  if (c.kv_cache_bytes < 0 || c.num_kv_blocks < 0) return Status::InvalidArgument("KV cache size must be >= 0");
  if (c.swap_space_bytes < 0) return Status::InvalidArgument("swap_space must be >= 0");
  return ParseDevice(c.device).status();
}

}  // namespace

namespace {

// S3: the length predictor (loaded, or untrained with buckets over max_model_len) and its
// supervisor; none for other policies.
Result<std::unique_ptr<LengthSupervisor>> CreateLengthSupervisor(const EngineConfig& config,
                                                                 const EvaluationOptions& evaluation,
                                                                 const Tokenizer& tokenizer) {
  if (config.scheduling_policy != "s3") {
    if (!config.length_predictor.empty()) {
      spdlog::warn("length predictor {} ignored: only the s3 scheduling policy uses one", config.length_predictor);
    }
    return std::unique_ptr<LengthSupervisor>();
  }
  std::optional<LengthPredictor> trained;
  if (config.length_predictor.empty()) {
    spdlog::warn("s3 without a length predictor: every request starts in the shortest bucket and the predictor "
                 "learns online from completed requests (train one with kvflow-length-predictor train)");
  } else {
    KVFLOW_ASSIGN_OR_RETURN(trained, LengthPredictor::Load(config.length_predictor));
    const std::string fingerprint = TokenizerFingerprint(tokenizer);
    if (!trained->tokenizer_fingerprint().empty() && trained->tokenizer_fingerprint() != fingerprint) {
      return Status::InvalidArgument("length predictor " + config.length_predictor +
                                     " was trained on another tokenizer's token ids (fingerprint " +
                                     trained->tokenizer_fingerprint() + ", this model's " + fingerprint + ")");
    }
  }
  KVFLOW_ASSIGN_OR_RETURN(auto supervisor,
                          MakeLengthSupervisor(std::move(trained),
                                               {config.max_model_len, config.length_reservation_point,
                                                config.length_predictor_online_updates,
                                                evaluation.length_prediction_override}));
  const LengthPredictorConfig& pc = supervisor->predictor().config();
  spdlog::info("s3: length predictor {}: {} buckets of {} tokens, reserving the {} edge; online updates {}",
               config.length_predictor.empty() ? "untrained" : config.length_predictor, pc.buckets.num_buckets,
               pc.buckets.width(), ReservationPointName(pc.reservation_point),
               config.length_predictor_online_updates ? "on" : "off");
  return supervisor;
}

}  // namespace

Result<std::unique_ptr<EvaluationEngine>> CreateEvaluationEngine(const EngineConfig& input,
                                                                 const EvaluationOptions& evaluation) {
  EngineConfig config = input;
  KVFLOW_RETURN_IF_ERROR(ValidateEngineConfig(config));
  KVFLOW_ASSIGN_OR_RETURN(auto policy, MakeSchedulingPolicy(config.scheduling_policy));
  KVFLOW_ASSIGN_OR_RETURN(PreemptionMode preemption, ParsePreemptionMode(config.preemption_mode));
  KVFLOW_ASSIGN_OR_RETURN(std::string path, ResolveModel(config.model));
  ModelFiles files;
  if (path == kTinyRandomName) {
    KVFLOW_ASSIGN_OR_RETURN(files, MakeTinyRandomModel());
  } else {
    KVFLOW_ASSIGN_OR_RETURN(files, OpenModelFiles(path));
  }
  if (!files.tokenizer) {
    return Status::NotFound("no tokenizer found for " + path + " (expected tokenizer.json beside the weights)");
  }
  const ModelConfig& mc = files.config;
  KVFLOW_RETURN_IF_ERROR(mc.Validate());
  if (config.max_model_len == 0 || config.max_model_len > mc.max_position_embeddings) {
    if (config.max_model_len > mc.max_position_embeddings) {
      spdlog::warn("max_model_len {} exceeds the model's context length {}; using {}", config.max_model_len,
                   mc.max_position_embeddings, mc.max_position_embeddings);
    }
    config.max_model_len = mc.max_position_embeddings;
  }

  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights weights, LoadLlamaWeights(*files.tensors, mc, files.gguf_rope_permuted));
  files.tensors.reset();  // weights are now fp32 copies; drop the mapping
  KVFLOW_ASSIGN_OR_RETURN(auto backend, CreateBackend(config, input.max_model_len > 0, mc, std::move(weights)));
  KVFLOW_ASSIGN_OR_RETURN(auto supervisor, CreateLengthSupervisor(config, evaluation, *files.tokenizer));
  auto engine = std::make_unique<EngineImpl>(config, std::move(files), std::move(backend), std::move(policy),
                                             preemption, std::move(supervisor));
  spdlog::info("engine ready: {}", engine->Describe());
  return std::unique_ptr<EvaluationEngine>(std::move(engine));
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config) {
  KVFLOW_ASSIGN_OR_RETURN(auto engine, CreateEvaluationEngine(config, {}));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace kvflow
