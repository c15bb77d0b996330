#pragma once

#include "engine/system_registry.h"

namespace kvflow {

// The model_parallel system "tensor" (EngineConfig::tensor_parallel_size > 1).
Status RegisterTensorParallel(SystemRegistry& registry);

}  // namespace kvflow
