#include "kvflow/engine.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <random>
#include <thread>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "backend/cpu/cpu_backend.h"
#include "engine/sequence.h"
#include "kv/block_allocator.h"
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

class EngineImpl final : public Engine {
 public:
  EngineImpl(EngineConfig config, ModelFiles files, std::unique_ptr<Backend> backend)
      : config_(std::move(config)),
        model_config_(files.config),
        tokenizer_(std::move(files.tokenizer)),
        backend_(std::move(backend)),
        allocator_(backend_->kv_layout().num_blocks),
        seed_rng_(config_.seed) {}

  Result<RequestId> AddRequest(const std::string& prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    return AddRequest(tokenizer_->Encode(prompt, tokenizer_->add_bos()), params, std::move(on_event));
  }

  Result<RequestId> AddRequest(std::vector<int32_t> prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    KVFLOW_RETURN_IF_ERROR(params.Validate());
    if (prompt.empty()) return Status::InvalidArgument("the prompt is empty");
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
    const int64_t pool_tokens = static_cast<int64_t>(allocator_.num_blocks()) * config_.block_size;
    if (static_cast<int64_t>(prompt.size()) + 1 > pool_tokens) {
      return Status::InvalidArgument("the prompt has " + std::to_string(prompt.size()) +
                                     " tokens but the whole KV cache holds " + std::to_string(pool_tokens));
    }
    const RequestId id = next_id_++;
    const uint64_t seed = params.seed.value_or(seed_rng_());
    auto seq = std::make_unique<Sequence>(id, std::move(prompt), params, seed, std::move(on_event), *tokenizer_,
                                          config_.block_size);
    waiting_.push_back(seq.get());
    sequences_.emplace(id, std::move(seq));
    return id;
  }

  Status Cancel(RequestId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("no unfinished request " + std::to_string(id));
    it->second->cancel_requested = true;
    if (!in_step_) ReapCancelled();
    return Status::Ok();
  }

  bool HasUnfinishedRequests() const override { return !sequences_.empty(); }

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
    KVFLOW_ASSIGN_OR_RETURN(out.id, AddRequest(out.prompt_tokens, params, Collector(out, std::move(on_event))));
    KVFLOW_RETURN_IF_ERROR(RunUntilDone());
    return out;
  }

  Result<std::vector<RequestOutput>> Generate(const std::vector<std::string>& prompts,
                                              const SamplingParams& params) override {
    std::vector<RequestOutput> outs(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      outs[i].prompt_tokens = tokenizer_->Encode(prompts[i], tokenizer_->add_bos());
      auto id = AddRequest(outs[i].prompt_tokens, params, Collector(outs[i], {}));
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
    s.num_waiting = static_cast<int>(waiting_.size());
    s.num_running = static_cast<int>(running_.size());
    s.kv_blocks_total = allocator_.num_blocks();
    s.kv_blocks_free = allocator_.num_free();
    return s;
  }

  std::string Describe() const override {
    return model_config_.name + " on " + backend_->Describe() + ", max_model_len " +
           std::to_string(config_.max_model_len);
  }

 private:
  // Wraps a user callback so the final RequestOutput is assembled as events arrive.
  static StreamCallback Collector(RequestOutput& out, StreamCallback user) {
    const auto start = Clock::now();
    return [&out, user = std::move(user), start](const StreamEvent& e) {
      for (const SampledToken& t : e.tokens) {
        if (out.output_tokens.empty()) out.time_to_first_token_s = Seconds(Clock::now() - start);
        out.output_tokens.push_back(t.token);
        out.output_logprobs.push_back(t);
      }
      out.text += e.text_delta;
      if (e.finished) {
        out.finish_reason = e.finish_reason;
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

  // Drops the victim's blocks; it re-enters the queue first and re-prefills prompt + output.
  void PreemptByRecompute(Sequence* victim) {
    spdlog::debug("preempting request {} (recompute): KV cache is full", victim->id);
    victim->blocks.Release(allocator_);
    victim->num_computed = 0;
    running_.erase(std::find(running_.begin(), running_.end(), victim));
    waiting_.push_front(victim);
    ++stats_.num_preemptions;
  }

  struct Scheduled {
    Sequence* seq;
    int64_t num_tokens;
  };

  // FCFS over running then waiting sequences, within the token, sequence and block budgets.
  std::vector<Scheduled> Schedule() {
    std::vector<Scheduled> batch;
    int64_t budget = config_.max_num_batched_tokens;
    // Running sequences, earliest first; when blocks run out the latest running one gives way.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
      Sequence* seq = running_[i];
      const int64_t n = std::min(seq->num_uncomputed(), budget);
      if (seq->blocks.EnsureCapacity(seq->num_computed + n, allocator_).ok()) {
        batch.push_back({seq, n});
        budget -= n;
        ++i;
        continue;
      }
      Sequence* victim = running_.back();
      if (victim == seq && i == 0) {
        // Alone and still out of blocks: this sequence can never fit.
        Fail(seq, Status::OutOfMemory("the KV cache cannot hold this sequence (" +
                                      std::to_string(seq->num_tokens()) + " tokens)"));
        continue;
      }
      PreemptByRecompute(victim);
      if (victim == seq) break;
    }
    // Waiting sequences join while there is room, in arrival order; nothing overtakes.
    while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < config_.max_num_seqs) {
      Sequence* seq = waiting_.front();
      const int64_t n = std::min(seq->num_uncomputed(), budget);
      if (!seq->blocks.EnsureCapacity(n, allocator_).ok()) {
        if (running_.empty()) {
          Fail(seq, Status::OutOfMemory("the KV cache cannot hold the prompt"));
          continue;
        }
        break;
      }
      waiting_.pop_front();
      running_.push_back(seq);
      batch.push_back({seq, n});
      budget -= n;
    }
    return batch;
  }

  Result<StepResult> StepInner() {
    ReapCancelled();
    std::vector<Scheduled> scheduled = Schedule();
    StepResult result;
    if (scheduled.empty()) return result;

    ForwardBatch batch;
    for (const Scheduled& s : scheduled) {
      SequenceSlice slice;
      slice.token_offset = static_cast<int32_t>(batch.tokens.size());
      slice.num_tokens = static_cast<int32_t>(s.num_tokens);
      slice.context_len = static_cast<int32_t>(s.seq->num_computed + s.num_tokens);
      slice.block_table = s.seq->blocks.blocks();
      const bool completes = slice.context_len == s.seq->num_tokens();
      slice.logits = completes ? LogitsMode::kLast : LogitsMode::kNone;
      for (int64_t i = 0; i < s.num_tokens; ++i) {
        batch.tokens.push_back(s.seq->token_at(s.seq->num_computed + i));
        batch.positions.push_back(static_cast<int32_t>(s.seq->num_computed + i));
      }
      const bool is_prefill = s.seq->num_computed < static_cast<int64_t>(s.seq->prompt.size()) || s.num_tokens > 1;
      (is_prefill ? result.num_prefill_tokens : result.num_decode_tokens) += static_cast<int>(s.num_tokens);
      batch.seqs.push_back(std::move(slice));
    }
    result.num_seqs = static_cast<int>(scheduled.size());

    Status st = backend_->Forward(batch, logits_);
    if (!st.ok()) {
      // A failed step fails the requests in it, not the engine.
      spdlog::error("forward pass failed: {}", st.ToString());
      for (const Scheduled& s : scheduled) Fail(s.seq, st);
      return result;
    }
    ++stats_.num_steps;
    stats_.prompt_tokens_processed += result.num_prefill_tokens;

    const int64_t V = model_config_.vocab_size;
    int64_t row = 0;
    for (size_t i = 0; i < scheduled.size(); ++i) {
      Sequence* seq = scheduled[i].seq;
      seq->num_computed += scheduled[i].num_tokens;
      if (batch.seqs[i].logits == LogitsMode::kNone) continue;
      std::span<float> logits(logits_.data() + row * V, static_cast<size_t>(V));
      ++row;
      SampleAndStream(seq, logits);
    }
    return result;
  }

  void SampleAndStream(Sequence* seq, std::span<float> logits) {
    const SamplingParams& p = seq->params;
    std::vector<int32_t> suppress;
    if (static_cast<int>(seq->output.size()) < p.min_tokens) {
      suppress = p.stop_token_ids;
      if (!p.ignore_eos) suppress.insert(suppress.end(), model_config_.eos_token_ids.begin(), model_config_.eos_token_ids.end());
    }
    SampledToken tok = seq->sampler.Sample(logits, seq->prompt, seq->output, suppress);
    if (!seq->first_token_time) seq->first_token_time = Clock::now();
    seq->output.push_back(tok.token);
    ++stats_.generated_tokens;

    FinishReason finish = FinishReason::kNone;
    const auto& eos = model_config_.eos_token_ids;
    const bool is_eos = !p.ignore_eos && (std::find(eos.begin(), eos.end(), tok.token) != eos.end() ||
                                          tok.token == tokenizer_->eos_id());
    const bool is_stop_token = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok.token) !=
                               p.stop_token_ids.end();
    StreamEvent event;
    event.id = seq->id;
    if (is_eos) {
      finish = FinishReason::kEos;
    } else if (is_stop_token) {
      finish = FinishReason::kStop;
    } else {
      event.text_delta = seq->stop.Push(seq->decoder.Push(tok.token));
      if (seq->stop.stopped()) finish = FinishReason::kStop;
    }
    if (finish == FinishReason::kNone && (static_cast<int>(seq->output.size()) >= p.max_tokens ||
                                          seq->num_tokens() >= config_.max_model_len)) {
      finish = FinishReason::kLength;
    }
    if (finish != FinishReason::kNone && finish != FinishReason::kStop) {
      event.text_delta += seq->stop.Push(seq->decoder.Flush());
      event.text_delta += seq->stop.Flush();
    }
    event.tokens.push_back(std::move(tok));
    if (finish != FinishReason::kNone) {
      event.finished = true;
      event.finish_reason = finish;
    }
    if (seq->on_event) seq->on_event(event);
    if (event.finished) Retire(seq);
  }

  void Fail(Sequence* seq, const Status& error) {
    StreamEvent event;
    event.id = seq->id;
    event.finished = true;
    event.finish_reason = error.code() == StatusCode::kCancelled ? FinishReason::kCancelled : FinishReason::kError;
    event.error = error;
    if (seq->on_event) seq->on_event(event);
    Retire(seq);
  }

  // Frees the sequence's blocks and forgets it.
  void Retire(Sequence* seq) {
    seq->blocks.Release(allocator_);
    if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) running_.erase(it);
    if (auto it = std::find(waiting_.begin(), waiting_.end(), seq); it != waiting_.end()) waiting_.erase(it);
    sequences_.erase(seq->id);
  }

  void ReapCancelled() {
    std::vector<Sequence*> cancelled;
    for (auto& [id, seq] : sequences_) {
      if (seq->cancel_requested) cancelled.push_back(seq.get());
    }
    for (Sequence* seq : cancelled) Fail(seq, Status::Cancelled("request cancelled"));
  }

  EngineConfig config_;
  ModelConfig model_config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Backend> backend_;
  BlockAllocator allocator_;
  std::mt19937_64 seed_rng_;
  std::unordered_map<RequestId, std::unique_ptr<Sequence>> sequences_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // in arrival order
  std::vector<float> logits_;
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
  if (c.device != "cpu") {
    return Status::Unsupported("device '" + c.device + "' is not available in this build (supported: cpu)");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& input) {
  EngineConfig config = input;
  KVFLOW_RETURN_IF_ERROR(ValidateEngineConfig(config));
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

  KvCacheLayout layout;
  layout.num_layers = mc.num_layers;
  layout.num_kv_heads = mc.num_kv_heads;
  layout.head_dim = mc.head_dim;
  layout.block_size = config.block_size;
  const int64_t block_bytes = static_cast<int64_t>(layout.elements_per_block_all_layers() * sizeof(float));
  if (config.num_kv_blocks > 0) {
    layout.num_blocks = config.num_kv_blocks;
  } else {
    int64_t bytes = config.kv_cache_bytes;
    if (bytes == 0) {
      const int64_t full = static_cast<int64_t>(config.max_num_seqs) *
                           BlocksForTokens(config.max_model_len, config.block_size) * block_bytes;
      bytes = std::min<int64_t>(full, int64_t{1} << 30);
    }
    layout.num_blocks = static_cast<int>(std::max<int64_t>(1, bytes / block_bytes));
  }

  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights weights, LoadLlamaWeights(*files.tensors, mc, files.gguf_rope_permuted));
  files.tensors.reset();  // weights are now fp32 copies; drop the mapping
  const int threads = config.num_threads > 0 ? config.num_threads
                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  KVFLOW_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create(mc, std::move(weights), layout, threads));
  auto engine = std::make_unique<EngineImpl>(config, std::move(files), std::move(backend));
  spdlog::info("engine ready: {}", engine->Describe());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace kvflow
