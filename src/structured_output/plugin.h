// Registers structured output (grammar-constrained decoding through xgrammar) as the logits
// processor "structured_output": every engine runs it; requests with
// SamplingParams::structured_output turn it on.
#pragma once

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterStructuredOutput(SystemRegistry& registry);

}  // namespace kvflow
