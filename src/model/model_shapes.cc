#include "model/model_shapes.h"

namespace kvflow {
namespace {

// HuggingFaceTB/SmolLM2-135M: GQA 9/3, head_dim 64, tied embeddings.
ModelConfig SmolLM2_135M() {
  ModelConfig c;
  c.vocab_size = 49152;
  c.hidden_size = 576;
  c.intermediate_size = 1536;
  c.num_layers = 30;
  c.num_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 64;
  c.max_position_embeddings = 8192;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 100000.0f;
  c.tie_word_embeddings = true;
  return c;
}

// meta-llama/Llama-3.1-8B: GQA 32/8, vocab 128256, llama3 RoPE scaling.
ModelConfig Llama31_8B() {
  ModelConfig c;
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 500000.0f;
  c.rope_scaling.type = RopeScaling::Type::kLlama3;
  c.rope_scaling.factor = 8.0f;
  c.rope_scaling.low_freq_factor = 1.0f;
  c.rope_scaling.high_freq_factor = 4.0f;
  c.rope_scaling.original_max_position_embeddings = 8192;
  return c;
}

// meta-llama/Llama-2-7b-hf: multi-head attention, vocab 32000.
ModelConfig Llama2_7B() {
  ModelConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5f;
  return c;
}

// A small GQA shape for tests of the random-weight path (fast on the CUDA emulator).
ModelConfig Tiny() {
  ModelConfig c;
  c.vocab_size = 320;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5f;
  return c;
}

struct Entry {
  const char* name;
  ModelConfig (*make)();
};
constexpr Entry kShapes[] = {
    {"smollm2-135m", SmolLM2_135M}, {"llama-3.1-8b", Llama31_8B}, {"llama-2-7b", Llama2_7B}, {"tiny", Tiny}};

}  // namespace

std::vector<std::string> ModelShapeNames() {
  std::vector<std::string> names;
  for (const Entry& e : kShapes) names.emplace_back(e.name);
  return names;
}

Result<ModelConfig> ModelShape(const std::string& name) {
  std::string known;
  for (const Entry& e : kShapes) {
    if (name == e.name) {
      ModelConfig c = e.make();
      c.name = name + "-shape";
      return c;
    }
    known += std::string(known.empty() ? "" : ", ") + e.name;
  }
  return Status::NotFound("no model shape named '" + name + "'; known shapes: " + known);
}

}  // namespace kvflow
