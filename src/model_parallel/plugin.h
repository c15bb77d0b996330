#pragma once

#include "engine/system_registry.h"

namespace kvflow {

// The model_parallel system "model_parallel" (EngineConfig::tensor_parallel_size or
// pipeline_parallel_size > 1).
Status RegisterModelParallel(SystemRegistry& registry);

}  // namespace kvflow
