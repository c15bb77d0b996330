// Where kvflow finds models by short name.
#pragma once

#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

// Where short model names are looked up: $KVFLOW_MODEL_DIR, ./models, and the models/ folder of
// the source tree kvflow was built from.
std::vector<std::string> ModelSearchDirs();
// Resolves a path or short name to a file or directory path ("tiny-random" resolves to itself).
Result<std::string> ResolveModel(const std::string& path_or_name);

}  // namespace kvflow
