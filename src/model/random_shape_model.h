// Built-in models `random:<shape>` (model/model_shapes.h): a real model's shape with random weights
// generated on the GPU (CreateCudaBackendWithRandomWeights), and a byte-level tokenizer padded with
// reserved tokens to the shape's vocabulary. They measure speed at real sizes (an 8B model without
// a 16 GB checkpoint); their outputs are meaningless, and so is any speculative method's acceptance.
// The CPU backend refuses them (there are no host weights): use tiny-random there.
#pragma once

#include <cstdint>
#include <string>

#include "model/tensor_source.h"

namespace kvflow {

inline constexpr const char* kRandomShapePrefix = "random:";
inline bool IsRandomShapeModel(const std::string& name) { return name.rfind(kRandomShapePrefix, 0) == 0; }

// "random:llama-3.1-8b" -> ModelFiles with random_weights set, no tensors, the shape's config and
// the padded byte-level tokenizer. NotFound for an unknown shape (the message lists them).
Result<ModelFiles> MakeRandomShapeModel(const std::string& name, uint64_t seed = 42);

}  // namespace kvflow
