// Registers the prompt prefillers across ranks: "kv-runahead" (the chain) and "tsp" (the
// all-gather baseline).
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterKvRunahead(SystemRegistry& registry);

}  // namespace kvflow
