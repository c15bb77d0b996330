#include "engine/system_registry.h"

#include <algorithm>

namespace kvflow {
namespace {

template <typename Plugin>
Status AddUnique(std::vector<Plugin>& plugins, Plugin plugin, const char* kind) {
  plugin.info.kind = kind;
  if (plugin.info.name.empty()) return Status::InvalidArgument(std::string("a ") + kind + " needs a name");
  for (const Plugin& p : plugins) {
    if (p.info.name == plugin.info.name) {
      return Status::Internal(std::string(kind) + " '" + plugin.info.name + "' is registered twice");
    }
  }
  if (plugin.info.label.empty()) plugin.info.label = plugin.info.name;
  plugins.push_back(std::move(plugin));
  return Status::Ok();
}

template <typename Plugin>
Result<const Plugin*> Find(const std::vector<Plugin>& plugins, const std::string& name, const char* field) {
  for (const Plugin& p : plugins) {
    if (p.info.name == name) return &p;
  }
  std::string names;
  for (size_t i = 0; i < plugins.size(); ++i) {
    names += (i == 0 ? "" : i + 1 == plugins.size() ? " or " : ", ") + plugins[i].info.name;
  }
  return Status::InvalidArgument(std::string(field) + " must be " + (names.empty() ? "empty (none is built in)" : names) +
                                 " (or empty: off), not '" + name + "'");
}

bool Matches(const std::string& excluded, const ActiveFeature& feature) {
  if (excluded == feature.id) return true;
  // A kind alone ("drafter") excludes every system of that kind.
  return feature.id.size() > excluded.size() && feature.id.compare(0, excluded.size(), excluded) == 0 &&
         feature.id[excluded.size()] == ':';
}

}  // namespace

Status SystemRegistry::Register(DrafterPlugin plugin) { return AddUnique(drafters_, std::move(plugin), "drafter"); }
Status SystemRegistry::Register(KvSelectorPlugin plugin) {
  return AddUnique(kv_selectors_, std::move(plugin), "kv_selector");
}
Status SystemRegistry::Register(PrefillerPlugin plugin) { return AddUnique(prefillers_, std::move(plugin), "prefiller"); }
Status SystemRegistry::Register(KvConnectorPlugin plugin) {
  if (!plugin.enabled) return Status::InvalidArgument("kv_connector " + plugin.info.name + " needs an enabled()");
  return AddUnique(kv_connectors_, std::move(plugin), "kv_connector");
}

Result<const DrafterPlugin*> SystemRegistry::Drafter(const std::string& name) const {
  return Find(drafters_, name, "speculative_method");
}
Result<const KvSelectorPlugin*> SystemRegistry::KvSelector(const std::string& name) const {
  return Find(kv_selectors_, name, "kv_selection");
}
Result<const PrefillerPlugin*> SystemRegistry::Prefiller(const std::string& name) const {
  return Find(prefillers_, name, "prefill_parallel");
}

Status SystemRegistry::Register(SchedulingPolicyPlugin plugin) {
  return AddUnique(policies_, std::move(plugin), "scheduling_policy");
}

Status SystemRegistry::Register(LogitsProcessorPlugin plugin) {
  if (!plugin.create) return Status::InvalidArgument("logits_processor " + plugin.info.name + " needs a create()");
  return AddUnique(logits_processors_, std::move(plugin), "logits_processor");
}

Status SystemRegistry::Register(ModelParallelPlugin plugin) {
  if (!plugin.create) return Status::InvalidArgument("model_parallel " + plugin.info.name + " needs a create()");
  return AddUnique(model_parallel_, std::move(plugin), "model_parallel");
}

Result<const ModelParallelPlugin*> SystemRegistry::ActiveModelParallel(const EngineConfig& c) const {
  if (c.tensor_parallel_size < 1 || c.pipeline_parallel_size < 1) {
    return Status::InvalidArgument("tensor_parallel_size and pipeline_parallel_size must be at least 1, got " +
                                   std::to_string(c.tensor_parallel_size) + " and " +
                                   std::to_string(c.pipeline_parallel_size));
  }
  if (c.pipeline_batches_in_flight < 0) {
    return Status::InvalidArgument("pipeline_batches_in_flight must be 0 (auto) or more, got " +
                                   std::to_string(c.pipeline_batches_in_flight));
  }
  if (c.pipeline_microbatches < 0) {
    return Status::InvalidArgument("pipeline_microbatches must be 0 (auto) or more, got " +
                                   std::to_string(c.pipeline_microbatches));
  }
  if (!c.pipeline_layer_split.empty() && static_cast<int>(c.pipeline_layer_split.size()) != c.pipeline_parallel_size) {
    return Status::InvalidArgument("pipeline_layer_split gives " + std::to_string(c.pipeline_layer_split.size()) +
                                   " stages' layer counts for a pipeline parallel size of " +
                                   std::to_string(c.pipeline_parallel_size) + " (one count a stage)");
  }
  if (c.model_parallel_ranks() == 1) return static_cast<const ModelParallelPlugin*>(nullptr);
  for (const ModelParallelPlugin& p : model_parallel_) {
    if (p.info.name == kModelParallel) return &p;
  }
  return Status::Unsupported("tensor and pipeline parallelism are not built into this kvflow (no model_parallel system '" +
                             std::string(kModelParallel) + "' registered)");
}

Result<const SchedulingPolicyPlugin*> SystemRegistry::Policy(const std::string& name) const {
  for (const SchedulingPolicyPlugin& p : policies_) {
    if (p.info.name == name) return &p;
  }
  std::string known;
  for (const SchedulingPolicyPlugin& p : policies_) known += (known.empty() ? "" : ", ") + p.info.name;
  return Status::InvalidArgument("unknown scheduling policy '" + name + "' (known: " + known + ")");
}

std::vector<const KvConnectorPlugin*> SystemRegistry::ActiveKvConnectors(const EngineConfig& config) const {
  std::vector<const KvConnectorPlugin*> active;
  for (const KvConnectorPlugin& p : kv_connectors_) {
    if (p.enabled(config)) active.push_back(&p);
  }
  return active;
}

Result<std::vector<const SystemInfo*>> SystemRegistry::ActiveSystems(const EngineConfig& c) const {
  std::vector<const SystemInfo*> active;
  if (!c.speculative.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const DrafterPlugin* p, Drafter(c.speculative.method));
    active.push_back(&p->info);
  }
  if (!c.kv_selection.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const KvSelectorPlugin* p, KvSelector(c.kv_selection.method));
    active.push_back(&p->info);
  }
  if (!c.prefill_parallel.method.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(const PrefillerPlugin* p, Prefiller(c.prefill_parallel.method));
    active.push_back(&p->info);
  }
  for (const KvConnectorPlugin* p : ActiveKvConnectors(c)) active.push_back(&p->info);
  KVFLOW_ASSIGN_OR_RETURN(const ModelParallelPlugin* split, ActiveModelParallel(c));
  if (split != nullptr) active.push_back(&split->info);
  KVFLOW_ASSIGN_OR_RETURN(const SchedulingPolicyPlugin* policy, Policy(c.scheduling_policy));
  active.push_back(&policy->info);
  return active;
}

std::vector<ActiveFeature> SystemRegistry::ActiveFeatures(const EngineConfig& c,
                                                         std::span<const SystemInfo* const> active) {
  std::vector<ActiveFeature> features;
  for (const SystemInfo* s : active) features.push_back({s->kind + ":" + s->name, s->label});
  if (!c.speculative.model.empty()) {
    features.push_back({"draft model", "a draft model (speculative_model " + c.speculative.model + ")"});
  }
  if (c.preemption_mode == "swap") features.push_back({"swap preemption", "preemption_mode swap"});
  if (c.enable_prefix_caching) features.push_back({"prefix caching", "prefix caching"});
  return features;
}

Status SystemRegistry::CompleteAndCheck(EngineConfig& config) const {
  KVFLOW_ASSIGN_OR_RETURN(std::vector<const SystemInfo*> active, ActiveSystems(config));
  for (const SystemInfo* s : active) {
    if (s->complete) s->complete(config);
  }
  for (const SystemInfo* s : active) {
    if (s->validate) KVFLOW_RETURN_IF_ERROR(s->validate(config));
  }
  auto check_off = [&](const auto& plugins) -> Status {
    for (const auto& p : plugins) {
      if (p.info.validate_when_off && std::find(active.begin(), active.end(), &p.info) == active.end()) {
        KVFLOW_RETURN_IF_ERROR(p.info.validate_when_off(config));
      }
    }
    return Status::Ok();
  };
  KVFLOW_RETURN_IF_ERROR(check_off(drafters_));
  KVFLOW_RETURN_IF_ERROR(check_off(kv_selectors_));
  KVFLOW_RETURN_IF_ERROR(check_off(prefillers_));
  KVFLOW_RETURN_IF_ERROR(check_off(kv_connectors_));
  KVFLOW_RETURN_IF_ERROR(check_off(policies_));
  KVFLOW_RETURN_IF_ERROR(check_off(model_parallel_));
  const std::vector<ActiveFeature> features = ActiveFeatures(config, active);
  for (const SystemInfo* s : active) {
    const std::string self = s->kind + ":" + s->name;
    for (const Exclusion& e : s->excludes) {
      for (const ActiveFeature& f : features) {
        if (f.id != self && Matches(e.feature, f)) {
          return Status::InvalidArgument(s->label + " cannot run with " + f.label + ": " + e.why);
        }
      }
    }
  }
  return Status::Ok();
}

std::vector<SystemMetric> SystemRegistry::Metrics(const EngineStats& stats) const {
  std::vector<SystemMetric> metrics;
  auto add = [&](const auto& plugins) {
    for (const auto& p : plugins) {
      if (p.info.metrics) p.info.metrics(stats, metrics);
    }
  };
  add(drafters_);
  add(kv_selectors_);
  add(prefillers_);
  add(kv_connectors_);
  add(policies_);
  add(logits_processors_);
  add(model_parallel_);
  return metrics;
}

}  // namespace kvflow
