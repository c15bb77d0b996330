#include "systems/builtin_systems.h"

#include <spdlog/spdlog.h>

#include "h2o/plugin.h"
#include "host_prefix_cache/plugin.h"
#include "infinigen/plugin.h"
#include "kv_runahead/plugin.h"
#include "offload/plugin.h"
#include "s3/plugin.h"
#include "sched/policy.h"
#include "speculative/plugin.h"
#include "structured_output/plugin.h"
#include "model_parallel/plugin.h"
#include "triforce/plugin.h"

namespace kvflow {

namespace {

// The scheduler's own policies: vLLM's paged FCFS (the default) and, for evaluation, Orca's
// reservations (the maximum length, the next power of two, the true length).
Status RegisterBasicPolicies(SystemRegistry& registry) {
  const std::pair<const char*, const char*> policies[] = {
      {"paged", "paged scheduling (FCFS, blocks on demand)"},
      {"orca-max", "Orca reserving max_model_len (evaluation)"},
      {"orca-pow2", "Orca reserving the next power of two (evaluation)"},
      {"orca-oracle", "Orca reserving the true length (evaluation)"},
  };
  for (const auto& [name, label] : policies) {
    SchedulingPolicyPlugin p;
    p.info.name = name;
    p.info.label = label;
    p.create = [name = std::string(name)](const SchedulingContext&) -> Result<SchedulingParts> {
      SchedulingParts parts;
      KVFLOW_ASSIGN_OR_RETURN(parts.policy, MakeSchedulingPolicy(name));
      return parts;
    };
    KVFLOW_RETURN_IF_ERROR(registry.Register(std::move(p)));
  }
  return Status::Ok();
}

}  // namespace

const SystemRegistry& BuiltinSystems() {
  static const SystemRegistry registry = [] {
    SystemRegistry r;
    for (const Status& st : {RegisterSpeculativeDrafters(r), RegisterTriForce(r), RegisterInfiniGen(r),
                             RegisterH2O(r), RegisterKvRunahead(r), RegisterHostPrefixCache(r),
                             RegisterKvOffload(r), RegisterBasicPolicies(r), RegisterS3(r),
                             RegisterStructuredOutput(r), RegisterModelParallel(r)}) {
      // A built-in system that cannot register is a programming error, caught by every test.
      if (!st.ok()) spdlog::critical("registering the built-in systems: {}", st.ToString());
    }
    return r;
  }();
  return registry;
}

Result<std::unique_ptr<EvaluationEngine>> CreateEvaluationEngine(const EngineConfig& config,
                                                                 const EvaluationOptions& options) {
  return CreateEngineWithSystems(config, BuiltinSystems(), options);
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config) {
  KVFLOW_ASSIGN_OR_RETURN(auto engine, CreateEvaluationEngine(config, {}));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace kvflow
