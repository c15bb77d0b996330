#include "kvflow/engine.h"

#include <chrono>
#include <memory>
#include <optional>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "engine/engine_core.h"
#include "model/rope.h"
#include "engine/evaluation.h"
#include "engine/model_executor.h"
#include "engine/prompt_prefill_connector.h"
#include "engine/system_registry.h"
#include "model/llama_weights.h"
#include "model/tensor_source.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"

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

// The tokens that end a sequence: the model's, then the tokenizer's.
std::vector<int32_t> EosTokenIds(const ModelConfig& model, const Tokenizer& tokenizer) {
  std::vector<int32_t> eos(model.eos_token_ids.begin(), model.eos_token_ids.end());
  if (tokenizer.eos_id() >= 0) eos.push_back(tokenizer.eos_id());
  return eos;
}

// What the core needs to know of the engine's configuration and model.
EngineCoreConfig CoreConfig(const EngineConfig& c, const ModelConfig& model, const Tokenizer& tokenizer,
                            int num_device_blocks, int num_host_blocks, PreemptionMode preemption, Drafter* drafter,
                            KvSelector* kv_selector, std::vector<const LogitsProcessor*> logits_processors,
                            int batches_in_flight) {
  EngineCoreConfig core;
  core.scheduler = SchedulerConfig{c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, preemption};
  core.scheduler.batches_in_flight = batches_in_flight;
  core.blocks = BlockManagerConfig{c.block_size, num_device_blocks, num_host_blocks, c.enable_prefix_caching};
  core.blocks.sliding_window = model.ReleasableWindow();
  core.vocab_size = model.vocab_size;
  core.eos_token_ids = EosTokenIds(model, tokenizer);
  core.seed = c.seed;
  core.drafter = drafter;
  core.kv_selector = kv_selector;
  core.kv_selection_default = c.kv_selection.apply_by_default;
  core.logits_processors = std::move(logits_processors);
  return core;
}

std::vector<const LogitsProcessor*> Pointers(const std::vector<std::unique_ptr<LogitsProcessor>>& owned) {
  std::vector<const LogitsProcessor*> out;
  for (const auto& p : owned) out.push_back(p.get());
  return out;
}

// The public Engine API over the core, the model executor and the backend.
class EngineImpl final : public EvaluationEngine {
 public:
  // The systems the configuration names, made by their plugins.
  struct Systems {
    std::unique_ptr<Backend> draft_backend;  // a drafter's draft model (else null)
    std::unique_ptr<Drafter> drafter;
    int drafter_scratch_blocks = 0;  // blocks of the target's pool the drafter keeps
    std::unique_ptr<KvSelector> kv_selector;
    // The KV connectors the configuration turns on (after the executor's own swap), and the
    // blocks at the end of the backend's host pool they keep.
    std::vector<std::unique_ptr<KvConnector>> kv_connectors;
    int connector_host_blocks = 0;
    // Every registered logits processor (structured output), after the core's built-in ones.
    std::vector<std::unique_ptr<LogitsProcessor>> logits_processors;
    // A model split across ranks (model_parallel): runs each step with the other ranks.
    std::unique_ptr<StepMirror> mirror;
  };

  EngineImpl(EngineConfig config, ModelFiles files, std::unique_ptr<Backend> backend, Systems systems,
             std::unique_ptr<SchedulingPolicy> policy, PreemptionMode preemption,
             std::unique_ptr<LengthSupervisor> supervisor, const SystemRegistry& registry)
      : registry_(registry),
        config_(std::move(config)),
        model_config_(files.config),
        tokenizer_(std::move(files.tokenizer)),
        backend_(std::move(backend)),
        draft_backend_(std::move(systems.draft_backend)),
        drafter_(std::move(systems.drafter)),
        kv_selector_(std::move(systems.kv_selector)),
        kv_connectors_(std::move(systems.kv_connectors)),
        logits_processors_(std::move(systems.logits_processors)),
        mirror_(std::move(systems.mirror)),
        core_(CoreConfig(config_, model_config_, *tokenizer_,
                         backend_->kv_layout().num_blocks - systems.drafter_scratch_blocks,
                         backend_->num_host_blocks() - systems.connector_host_blocks, preemption, drafter_.get(),
                         kv_selector_.get(), Pointers(logits_processors_), mirror_ ? mirror_->StepsInFlight() : 1),
              std::move(policy), std::move(supervisor), tokenizer_.get()),
        executor_(*backend_, core_.block_manager()) {
    if (mirror_) executor_.SetModelParallel(mirror_.get());
    if (draft_backend_) executor_.AddFollower(*draft_backend_);
    executor_.AddStepHooks(kv_selector_.get());
    if (drafter_) executor_.AddStepHooks(drafter_->step_hooks());
    for (const auto& connector : kv_connectors_) {
      executor_.AddConnector(connector.get());
      if (KvConnectorScheduler* side = connector->scheduler_side()) core_.AddKvConnector(side);
    }
  }

  Result<RequestId> AddRequest(const std::string& prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    return AddRequest(tokenizer_->Encode(prompt, tokenizer_->add_bos()), params, std::move(on_event));
  }

  Result<RequestId> AddRequest(std::vector<int32_t> prompt, const SamplingParams& params,
                               StreamCallback on_event) override {
    return AddRequestWithHints(std::move(prompt), params, std::move(on_event), {});
  }

  Result<RequestId> AddRequestWithHints(std::vector<int32_t> prompt, const SamplingParams& params,
                                        StreamCallback on_event, const RequestHints& hints) override {
    return core_.AddRequest(std::move(prompt), params, std::move(on_event), hints,
                            Seconds(Clock::now().time_since_epoch()));
  }

  Status ValidateRequest(const std::vector<int32_t>& prompt, const SamplingParams& params) const override {
    return core_.ValidateRequest(prompt, params);
  }

  Status Cancel(RequestId id) override { return core_.Cancel(id); }
  bool HasUnfinishedRequests() const override { return core_.HasUnfinishedRequests(); }
  Result<StepResult> Step() override { return core_.Step(executor_); }

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
    EngineStats s = core_.stats();
    for (const auto& connector : kv_connectors_) connector->AddStats(s);
    if (mirror_) s.model_parallel = mirror_->stats();
    return s;
  }
  std::vector<SystemMetric> SystemMetrics(const EngineStats& stats) const override {
    return registry_.Metrics(stats);
  }

  std::string Describe() const override {
    const BlockManager& blocks = core_.block_manager();
    const Scheduler& scheduler = core_.scheduler();
    const std::string draft =
        draft_backend_ ? ", draft model " + draft_backend_->model_config().name + " (k " +
                             std::to_string(config_.speculative.num_tokens) + ")"
        : drafter_     ? ", " + config_.speculative.method + " speculation (k " +
                             std::to_string(config_.speculative.num_tokens) + ")"
                       : "";
    const std::string selection = config_.kv_selection.method.empty() ? "" : ", KV selection " + config_.kv_selection.method;
    std::string connectors;
    for (const auto& connector : kv_connectors_) connectors += ", " + connector->Describe();
    if (mirror_) connectors += ", " + mirror_->Describe();
    return model_config_.name + " on " + backend_->Describe() + draft + ", swap " + std::to_string(blocks.host().num_blocks()) +
           " blocks, max_model_len " + std::to_string(config_.max_model_len) + selection + ", policy " +
           std::string(scheduler.policy().name()) + ", preemption " +
           PreemptionModeName(scheduler.config().preemption_mode) +
           (blocks.prefix_caching() ? ", prefix caching" : "") + connectors;
  }

 private:
  // Wraps a user callback so the final RequestOutput is assembled as events arrive.
  static StreamCallback Collector(RequestOutput& out, const SamplingParams& params, StreamCallback user) {
    const auto start = Clock::now();
    out.outputs.resize(static_cast<size_t>(params.n));
    for (int i = 0; i < params.n; ++i) out.outputs[static_cast<size_t>(i)].index = i;
    return [&out, user = std::move(user), start](const StreamEvent& e) {
      if (!e.prompt_logprobs.empty()) out.prompt_logprobs = e.prompt_logprobs;
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

  const SystemRegistry& registry_;  // outlives the engine (the built-in one is static)
  EngineConfig config_;
  ModelConfig model_config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> draft_backend_;
  std::unique_ptr<Drafter> drafter_;
  std::unique_ptr<KvSelector> kv_selector_;
  std::vector<std::unique_ptr<KvConnector>> kv_connectors_;
  std::vector<std::unique_ptr<LogitsProcessor>> logits_processors_;  // the core's systems' processors
  std::unique_ptr<StepMirror> mirror_;  // destroyed after the executor: it stops the other ranks
  EngineCore core_;
  ModelExecutor executor_;
};

// The engine's own settings; each system checks its section (SystemRegistry::CompleteAndCheck).
Status ValidateEngineConfig(const EngineConfig& c) {
  if (c.block_size < 1 || c.block_size > 256) return Status::InvalidArgument("block_size must be in [1, 256]");
  if (c.max_num_seqs < 1) return Status::InvalidArgument("max_num_seqs must be >= 1");
  if (c.max_num_batched_tokens < 1) return Status::InvalidArgument("max_num_batched_tokens must be >= 1");
  if (c.max_model_len < 0) return Status::InvalidArgument("max_model_len must be >= 0");
  if (c.kv_cache_bytes < 0 || c.num_kv_blocks < 0) return Status::InvalidArgument("KV cache size must be >= 0");
  if (c.swap_space_bytes < 0) return Status::InvalidArgument("swap_space must be >= 0");
  KVFLOW_ASSIGN_OR_RETURN(int device, ParseDevice(c.device));
  const std::string& kv = c.kv_cache_dtype;
  if (device < 0 && kv != "auto" && kv != "f16" && kv != "fp16" && kv != "f32" && kv != "fp32" &&
      !IsQ4KvCacheDtype(kv)) {
    return Status::InvalidArgument("kv_cache_dtype on the CPU is auto, f16, f32 or q4 (int4), not '" + kv + "'");
  }
  if (device >= 0 && IsQ4KvCacheDtype(kv)) {
    return Status::InvalidArgument("kv_cache_dtype " + kv + " (the 4-bit KV cache) is CPU only; on CUDA it is auto");
  }
  if (device >= 0 && kv != "auto") {
    return Status::InvalidArgument("kv_cache_dtype on CUDA is auto (the dtype's 16-bit type), not '" + kv + "'");
  }
  if (device < 0 && c.dtype != "auto" && c.dtype != "f32" && c.dtype != "fp32") {
    return Status::InvalidArgument("the CPU backend computes with dtype auto (weights kept in the file's Q4_0/Q4_1/"
                                   "Q8_0 blocks or F16/BF16, else fp32) or f32 (every weight fp32: exact), not '" + c.dtype + "'");
  }
  return Status::Ok();
}

// A sliding window counts positions and releases the blocks behind it (BlockManagerConfig::
// sliding_window). What reads the KV another way is refused: retrieval and selected tokens
// (TriForce, InfiniGen, H2O), a draft model over the same block tables, an offloaded pool's
// staging, a prompt prefilled across ranks. The n-gram drafter only adds tokens to verify.
Status CheckSlidingWindowSystems(const EngineConfig& c, const ModelConfig& model) {
  if (model.sliding_window <= 0) return Status::Ok();
  auto refuse = [&](const std::string& what) {
    return Status::Unsupported(what + " cannot run with " + model.name + "'s sliding-window attention (window " +
                               std::to_string(model.sliding_window) + " tokens) yet");
  };
  if (!c.speculative.method.empty() && c.speculative.method != "ngram") {
    return refuse("speculative method " + c.speculative.method);
  }
  if (!c.kv_selection.method.empty()) return refuse("kv_selection " + c.kv_selection.method);
  if (!c.prefill_parallel.method.empty()) return refuse("prefill_parallel " + c.prefill_parallel.method);
  if (c.kv_offload.enabled) return refuse("kv_offload");
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<EvaluationEngine>> CreateEngineWithSystems(const EngineConfig& input,
                                                                  const SystemRegistry& registry,
                                                                  const EvaluationOptions& evaluation) {
  EngineConfig config = input;
  if (config.speculative.method.empty() && !config.speculative.model.empty()) config.speculative.method = "draft_model";
  KVFLOW_RETURN_IF_ERROR(ValidateEngineConfig(config));
  KVFLOW_RETURN_IF_ERROR(registry.CompleteAndCheck(config));
  KVFLOW_ASSIGN_OR_RETURN(PreemptionMode preemption, ParsePreemptionMode(config.preemption_mode));
  KVFLOW_ASSIGN_OR_RETURN(std::string path, ResolveModel(config.model));
  KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, OpenModelFiles(path));
  if (!files.tokenizer) {
    return Status::NotFound("no tokenizer found for " + path + " (expected tokenizer.json beside the weights)");
  }
  const ModelConfig& mc = files.config;
  KVFLOW_RETURN_IF_ERROR(mc.Validate());
  KVFLOW_RETURN_IF_ERROR(CheckSlidingWindowSystems(config, mc));
  if (config.max_model_len == 0 || config.max_model_len > mc.max_position_embeddings) {
    if (config.max_model_len > mc.max_position_embeddings) {
      spdlog::warn("max_model_len {} exceeds the model's context length {}; using {}", config.max_model_len,
                   mc.max_position_embeddings, mc.max_position_embeddings);
    }
    config.max_model_len = mc.max_position_embeddings;
  }
  SelectRopeFactorsForContext(files.config, config.max_model_len);
  if (mc.rope_scaling.type == RopeScaling::Type::kLongRope) {
    spdlog::info("LongRoPE: {} factors for max_model_len {} (original context {})",
                 mc.rope_scaling.long_factors ? "long" : "short", config.max_model_len,
                 mc.rope_scaling.original_max_position_embeddings);
  }

  // The connectors as the configuration asked for them (the factory resolves their host blocks).
  const std::vector<const KvConnectorPlugin*> connectors = registry.ActiveKvConnectors(config);
  EngineImpl::Systems systems;
  KVFLOW_ASSIGN_OR_RETURN(const ModelParallelPlugin* split, registry.ActiveModelParallel(config));
  std::unique_ptr<Backend> backend;
  if (split != nullptr) {
    KVFLOW_ASSIGN_OR_RETURN(ModelParallelParts parts,
                            split->create(ModelParallelContext{config, input.max_model_len > 0, files,
                                                               evaluation.model_parallel_communicator,
                                                               evaluation.model_parallel_device_communicator}));
    backend = std::move(parts.backend);
    systems.mirror = std::move(parts.mirror);
  } else {
    KVFLOW_ASSIGN_OR_RETURN(backend, CreateBackendForModel(config, input.max_model_len > 0, files));
  }
  if (!config.speculative.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const DrafterPlugin* drafter, registry.Drafter(config.speculative.method));
    if (drafter->create_draft_backend && !config.speculative.model.empty()) {
      KVFLOW_ASSIGN_OR_RETURN(systems.draft_backend,
                              drafter->create_draft_backend(config, *backend, mc, *files.tokenizer));
    }
    if (drafter->target_scratch_blocks) {
      const int scratch = systems.drafter_scratch_blocks = drafter->target_scratch_blocks(config);
      const int num_blocks = backend->kv_layout().num_blocks;
      if (num_blocks - scratch < BlocksForTokens(config.max_model_len, config.block_size)) {
        return Status::InvalidArgument(
            drafter->info.label + ": the KV pool of " + std::to_string(num_blocks) + " blocks cannot hold " +
            std::to_string(scratch) + " blocks of " + drafter->target_scratch_use +
            " and one max_model_len sequence; raise kv_cache_bytes or lower max_num_seqs / max_model_len");
      }
    }
    KVFLOW_ASSIGN_OR_RETURN(systems.drafter,
                            drafter->create(DrafterContext{config, *backend, systems.draft_backend.get(),
                                                           backend->kv_layout().num_blocks,
                                                           systems.drafter_scratch_blocks}));
  }
  KVFLOW_ASSIGN_OR_RETURN(const SchedulingPolicyPlugin* scheduling, registry.Policy(config.scheduling_policy));
  KVFLOW_ASSIGN_OR_RETURN(SchedulingParts policy, scheduling->create(SchedulingContext{config, evaluation, *files.tokenizer, files.config}));
  if (!config.kv_selection.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const KvSelectorPlugin* selector, registry.KvSelector(config.kv_selection.method));
    KVFLOW_ASSIGN_OR_RETURN(systems.kv_selector, selector->create(KvSelectorContext{config, path, mc, *backend}));
    if (evaluation.kv_read_observer) {
      systems.kv_selector =
          std::make_unique<ObservedKvSelector>(std::move(systems.kv_selector), evaluation.kv_read_observer);
    }
  }
  // Each connector's host blocks sit after the swap space, in registration order (the backend
  // factory sized the pool for them).
  for (const KvConnectorPlugin* p : connectors) systems.connector_host_blocks += p->host_blocks ? p->host_blocks(config) : 0;
  int host_block = backend->num_host_blocks() - systems.connector_host_blocks;
  for (const KvConnectorPlugin* p : connectors) {
    const int blocks = p->host_blocks ? p->host_blocks(config) : 0;
    KVFLOW_ASSIGN_OR_RETURN(auto connector, p->create(KvConnectorContext{config, *backend, host_block, blocks}));
    host_block += blocks;
    systems.kv_connectors.push_back(std::move(connector));
  }
  if (!config.prefill_parallel.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const PrefillerPlugin* prefiller, registry.Prefiller(config.prefill_parallel.method));
    KVFLOW_ASSIGN_OR_RETURN(auto prompt_prefiller,
                            prefiller->create(PrefillerContext{config, *backend, evaluation.prefill_communicator}));
    // Its KV enters through a connector that supplies a long prompt's leading blocks, after the
    // other connectors (a prompt cached in a tier is loaded, not recomputed across ranks).
    systems.kv_connectors.push_back(std::make_unique<PromptPrefillConnector>(
        std::move(prompt_prefiller), *backend, config.block_size, config.max_num_batched_tokens));
  }
  const std::vector<int32_t> eos = EosTokenIds(mc, *files.tokenizer);
  for (const LogitsProcessorPlugin& p : registry.LogitsProcessors()) {
    KVFLOW_ASSIGN_OR_RETURN(auto processor, p.create(LogitsProcessorContext{config, mc, *files.tokenizer, eos}));
    systems.logits_processors.push_back(std::move(processor));
  }
  auto engine = std::make_unique<EngineImpl>(config, std::move(files), std::move(backend), std::move(systems),
                                             std::move(policy.policy), preemption, std::move(policy.supervisor),
                                             registry);
  spdlog::info("engine ready: {}", engine->Describe());
  return std::unique_ptr<EvaluationEngine>(std::move(engine));
}

}  // namespace kvflow
