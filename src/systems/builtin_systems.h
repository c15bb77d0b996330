// The systems kvflow ships, registered in one place, and the engines built with them. This is the
// composition root: the only code that knows every system folder.
#pragma once

#include <memory>

#include "engine/evaluation.h"
#include "engine/system_registry.h"

namespace kvflow {

// Every built-in system: the drafters ngram, draft_model and triforce; the KV selectors infinigen
// and h2o; the prefillers kv-runahead and tsp; the KV tier kv_offload; the logits processor
// structured_output.
const SystemRegistry& BuiltinSystems();

// Engine::Create with the evaluation options (tests and benchmarks).
Result<std::unique_ptr<EvaluationEngine>> CreateEvaluationEngine(const EngineConfig& config,
                                                                 const EvaluationOptions& options);

}  // namespace kvflow
