// A built-in, seeded, tiny random Llama (GQA, byte-level tokenizer) so everything runs offline in
// seconds. Tests use it wherever a real model is not the point.
#pragma once

#include <cstdint>
#include <string>

#include "model/tensor_source.h"

namespace kvflow {

inline constexpr const char* kTinyRandomName = "tiny-random";

Result<ModelFiles> MakeTinyRandomModel(uint64_t seed = 0x6b76666c6f77);

}  // namespace kvflow
