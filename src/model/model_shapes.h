// The shapes of models people run (layer counts, widths, heads, vocabularies), without weights:
// for speed measurements at real sizes with random weights (kvflow_bench_cuda's end-to-end decode,
// the built-in `random:<shape>` models of model/random_shape_model.h).
#pragma once

#include <string>
#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"

namespace kvflow {

// The names ModelShape knows, in a stable order: smollm2-135m, llama-3.1-8b, llama-2-7b, tiny.
std::vector<std::string> ModelShapeNames();

// The shape of that name (config.name is "<name>-shape"); NotFound lists the known names.
Result<ModelConfig> ModelShape(const std::string& name);

}  // namespace kvflow
