// Registers the speculative drafters of this folder: "ngram" (prompt lookup) and "draft_model".
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterSpeculativeDrafters(SystemRegistry& registry);

}  // namespace kvflow
