#include "systems/builtin_systems.h"

#include <spdlog/spdlog.h>

#include "h2o/plugin.h"
#include "host_prefix_cache/plugin.h"
#include "infinigen/plugin.h"
#include "kv_runahead/plugin.h"
#include "offload/plugin.h"
#include "speculative/plugin.h"
#include "triforce/plugin.h"

namespace kvflow {

const SystemRegistry& BuiltinSystems() {
  static const SystemRegistry registry = [] {
    SystemRegistry r;
    for (const Status& st : {RegisterSpeculativeDrafters(r), RegisterTriForce(r), RegisterInfiniGen(r),
                             RegisterH2O(r), RegisterKvRunahead(r), RegisterHostPrefixCache(r),
                             RegisterKvOffload(r)}) {
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
