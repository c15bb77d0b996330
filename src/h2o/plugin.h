// Registers H2O as the KV selector "h2o".
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterH2O(SystemRegistry& registry);

}  // namespace kvflow
