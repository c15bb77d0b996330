// ModelConfig from a Hugging Face config.json or from GGUF metadata.
#pragma once

#include <string>

#include "kvflow/config.h"
#include "kvflow/status.h"
#include "model/gguf.h"

namespace kvflow {

// config.json of a LlamaForCausalLM / MistralForCausalLM checkpoint.
Result<ModelConfig> ModelConfigFromHfJson(const std::string& path);

// `<arch>.*` metadata of a llama/mistral GGUF; tie_word_embeddings when there is no output.weight.
Result<ModelConfig> ModelConfigFromGguf(const GgufFile& gguf);

}  // namespace kvflow
