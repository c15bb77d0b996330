// Systems plug into the engine by name. Each registers itself (its folder's plugin.cc) under one
// kind, with a factory and what it declares about itself: what it cannot run with and why, and how
// it completes the configuration. The engine resolves the names in EngineConfig against a registry
// and checks every active system's declarations against the features the configuration turns on,
// so no pairwise table lives in the engine and every refusal names both features.
//
// Kinds and the EngineConfig field that names a system of that kind:
//   drafter     speculative.method       (engine/drafter.h)
//   kv_selector kv_selection.method      (engine/kv_selector.h)
//   prefiller   prefill_parallel.method  (engine/prompt_prefiller.h)
//   scheduling_policy  scheduling_policy  (sched/policy.h; S3 adds its length supervisor)
//   kv_connector  its own switch: kv_offload.enabled ("kv_offload"), host_prefix_cache
//                 ("host_prefix_cache")     (engine/kv_connector.h)
//   logits_processor  always on; a request's SamplingParams turn it on (structured output)
//                 (engine/logits_processor.h)
//   model_parallel    tensor_parallel_size or pipeline_parallel_size > 1 ("model_parallel")
//                     (engine/model_parallel.h)
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/drafter.h"
#include "engine/evaluation.h"
#include "engine/kv_connector.h"
#include "engine/kv_selector.h"
#include "engine/logits_processor.h"
#include "engine/model_parallel.h"
#include "engine/prompt_prefiller.h"
#include "kvflow/config.h"
#include "kvflow/engine_config.h"
#include "kvflow/status.h"
#include "kvflow/tokenizer.h"
#include "model/tensor_source.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"

namespace kvflow {
namespace dist {
class Communicator;
}

// A feature a configuration turns on: "<kind>:<name>" for a registered system (e.g.
// "drafter:triforce"), or one of the engine's own: "swap preemption", "prefix caching" and
// "draft model" (a second model on the device, whichever system runs it).
struct ActiveFeature {
  std::string id;
  std::string label;  // for errors: "speculative decoding (triforce)"
};

// "X cannot run with `feature`: `why`". `feature` matches a feature id exactly, or every system
// of a kind when it names the kind alone ("drafter").
struct Exclusion {
  std::string feature;
  std::string why;
};

// What every system declares.
struct SystemInfo {
  std::string kind;
  std::string name;
  std::string label;  // a user's name for it: "speculative decoding (triforce)"
  std::vector<Exclusion> excludes;
  // Checks its own section of the configuration (null: nothing to check).
  std::function<Status(const EngineConfig&)> validate;
  // Refuses options of this system set while another (or none) is chosen (null: ignored).
  std::function<Status(const EngineConfig&)> validate_when_off;
  // Completes the configuration before it is validated: method defaults, features it turns on
  // (logged). Null: nothing.
  std::function<void(EngineConfig&)> complete;
  // Its metrics, derived from the engine's counters (called for every registered system, on or
  // off, so a dashboard sees zeros rather than gaps). Null: none of its own.
  std::function<void(const EngineStats&, std::vector<SystemMetric>&)> metrics;
};

// SystemInfo::metrics' helpers.
inline void AddCounter(std::vector<SystemMetric>& out, std::string name, std::string help, double value) {
  out.push_back({std::move(name), std::move(help), true, value, {}});
}
inline void AddGauge(std::vector<SystemMetric>& out, std::string name, std::string help, double value) {
  out.push_back({std::move(name), std::move(help), false, value, {}});
}

struct DrafterContext {
  const EngineConfig& config;
  Backend& target;
  Backend* draft_backend;     // the draft model's (speculative.model set), else null
  int num_target_blocks;      // blocks of the target's pool, scratch included
  int target_scratch_blocks;  // of those, the drafter's own (the last ones)
};

struct DrafterPlugin {
  SystemInfo info;
  // The backend of its draft model, where it runs one: the engine calls it when
  // speculative.model is set (each drafter's validate ties that to its own settings), before the
  // drafter; the executor runs it as a follower of the target's blocks.
  std::function<Result<std::unique_ptr<Backend>>(const EngineConfig&, const Backend& target, const ModelConfig&,
                                                 const Tokenizer&)>
      create_draft_backend;
  // Blocks of the target's pool the drafter keeps for itself, past those the block manager owns
  // (null: none), and what they are for ("drafting lanes").
  std::function<int(const EngineConfig&)> target_scratch_blocks;
  std::string target_scratch_use;
  std::function<Result<std::unique_ptr<Drafter>>(const DrafterContext&)> create;
};

struct KvSelectorContext {
  const EngineConfig& config;
  const std::string& model_path;
  const ModelConfig& model;
  Backend& backend;
};

struct KvSelectorPlugin {
  SystemInfo info;
  std::function<Result<std::unique_ptr<KvSelector>>(const KvSelectorContext&)> create;
};

struct PrefillerContext {
  const EngineConfig& config;
  Backend& backend;
  dist::Communicator* communicator;  // null: the process's MPI world
};

struct PrefillerPlugin {
  SystemInfo info;
  std::function<Result<std::unique_ptr<PromptPrefiller>>(const PrefillerContext&)> create;
};

struct SchedulingContext {
  const EngineConfig& config;
  const EvaluationOptions& evaluation;
  const Tokenizer& tokenizer;
  const ModelConfig& model;  // the served model's (S3's length probe reads its hidden states)
};

// What a scheduling policy brings: the policy the scheduler consults, and (S3) the supervisor that
// predicts output lengths and learns from them.
struct SchedulingParts {
  std::unique_ptr<SchedulingPolicy> policy;
  std::unique_ptr<LengthSupervisor> supervisor;
};

struct SchedulingPolicyPlugin {
  SystemInfo info;
  std::function<Result<SchedulingParts>(const SchedulingContext&)> create;
};

// The connector EngineConfig::kv_offload turns on.
inline constexpr const char* kKvOffloadConnector = "kv_offload";

struct KvConnectorContext {
  const EngineConfig& config;
  Backend& backend;
  // The host pool's blocks [host_block_begin, host_block_begin + num_host_blocks) are the
  // connector's own (past the swap space).
  int host_block_begin;
  int num_host_blocks;
};

// A KV connector: what moves KV between the device pool and somewhere else for every step.
struct KvConnectorPlugin {
  SystemInfo info;
  // Whether `config` turns it on.
  std::function<bool(const EngineConfig&)> enabled;
  // Blocks of the backend's host pool it keeps, resolved by the backend factory (null: none).
  std::function<int(const EngineConfig&)> host_blocks;
  std::function<Result<std::unique_ptr<KvConnector>>(const KvConnectorContext&)> create;
};

struct LogitsProcessorContext {
  const EngineConfig& config;
  const ModelConfig& model;
  const Tokenizer& tokenizer;
  std::span<const int32_t> eos_token_ids;  // the model's, then the tokenizer's
};

// A logits processor every engine runs after the built-in ones; requests turn it on through their
// SamplingParams (it constrains nothing otherwise).
struct LogitsProcessorPlugin {
  SystemInfo info;
  std::function<Result<std::unique_ptr<LogitsProcessor>>(const LogitsProcessorContext&)> create;
};

// The model_parallel system EngineConfig::tensor_parallel_size or pipeline_parallel_size > 1 turns
// on: tensor and pipeline parallelism over the ranks of one job.
inline constexpr const char* kModelParallel = "model_parallel";

struct ModelParallelContext {
  EngineConfig& config;          // the factory may lower max_model_len to what the pool holds
  bool max_model_len_requested;  // whether the user set it (then it is refused instead)
  ModelFiles& files;
  dist::Communicator* communicator;  // null: the process's MPI world
  // GPU ranks' sums over device buffers; null: NCCL over `communicator` (tests: a CUDA peer world).
  dist::Communicator* device_communicator = nullptr;
};

// Splits the model across the job's ranks: builds this (driver) rank's backend for its share, and
// starts driving the others.
struct ModelParallelPlugin {
  SystemInfo info;
  std::function<Result<ModelParallelParts>(const ModelParallelContext&)> create;
};

class SystemRegistry {
 public:
  Status Register(DrafterPlugin plugin);
  Status Register(KvSelectorPlugin plugin);
  Status Register(PrefillerPlugin plugin);
  Status Register(KvConnectorPlugin plugin);
  Status Register(SchedulingPolicyPlugin plugin);
  Status Register(LogitsProcessorPlugin plugin);
  Status Register(ModelParallelPlugin plugin);

  // The system of that kind and name, or an error listing the registered names.
  Result<const DrafterPlugin*> Drafter(const std::string& name) const;
  Result<const KvSelectorPlugin*> KvSelector(const std::string& name) const;
  Result<const PrefillerPlugin*> Prefiller(const std::string& name) const;
  Result<const SchedulingPolicyPlugin*> Policy(const std::string& name) const;
  // The model_parallel system `config` turns on, or null when the model is whole on this rank.
  Result<const ModelParallelPlugin*> ActiveModelParallel(const EngineConfig& config) const;
  // The connectors `config` turns on, in registration order.
  std::vector<const KvConnectorPlugin*> ActiveKvConnectors(const EngineConfig& config) const;
  // Every registered logits processor, in registration order (each engine makes one of each).
  const std::vector<LogitsProcessorPlugin>& LogitsProcessors() const { return logits_processors_; }

  // The systems `config` names, completed (each system's `complete`), validated and checked
  // against each other's exclusions.
  Status CompleteAndCheck(EngineConfig& config) const;
  // Every registered system's metrics (SystemInfo::metrics) derived from `stats`.
  std::vector<SystemMetric> Metrics(const EngineStats& stats) const;
 private:
  Result<std::vector<const SystemInfo*>> ActiveSystems(const EngineConfig& config) const;
  // The features a validated `config` turns on: its `active` systems and the engine's own.
  static std::vector<ActiveFeature> ActiveFeatures(const EngineConfig& config,
                                                   std::span<const SystemInfo* const> active);

  std::vector<DrafterPlugin> drafters_;
  std::vector<KvSelectorPlugin> kv_selectors_;
  std::vector<PrefillerPlugin> prefillers_;
  std::vector<KvConnectorPlugin> kv_connectors_;
  std::vector<SchedulingPolicyPlugin> policies_;
  std::vector<LogitsProcessorPlugin> logits_processors_;
  std::vector<ModelParallelPlugin> model_parallel_;
};

}  // namespace kvflow
