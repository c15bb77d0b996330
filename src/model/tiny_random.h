// A built-in, seeded, tiny random Llama (GQA, byte-level tokenizer) so everything runs offline in
// seconds. Tests use it wherever a real model is not the point.
#pragma once

#include <cstdint>
#include <string>

#include "model/tensor_source.h"

namespace kvflow {

inline constexpr const char* kTinyRandomName = "tiny-random";
// Its first two layers, embeddings and head (a layer-skip draft of tiny-random: same tokenizer,
// a related distribution), for testing draft-model speculative decoding.
inline constexpr const char* kTinyRandomDraftName = "tiny-random-draft";
// tiny-random as a Mistral with a sliding window of 24 tokens (the blocks behind it released as
// decoding goes), for the engine's and the server's sliding-window paths.
inline constexpr const char* kTinyRandomSlidingWindowName = "tiny-random-sliding-window";
inline constexpr int kTinyRandomSlidingWindow = 24;
// tiny-random with a Qwen2-MoE block in place of each MLP: a router over 4 experts (top 2, not
// renormalized), each a SwiGLU of width 128, and a shared expert of width 256 behind a sigmoid gate;
// for the mixture-of-experts paths (tensor parallelism's expert split among them).
inline constexpr const char* kTinyRandomMoeName = "tiny-random-moe";
// Built in: tiny-random, tiny-random-draft, tiny-random-sliding-window, and random:<shape> (model/random_shape_model.h).
inline bool IsBuiltInModel(const std::string& name) {
  return name == kTinyRandomName || name == kTinyRandomDraftName || name == kTinyRandomSlidingWindowName ||
         name == kTinyRandomMoeName || name.rfind("random:", 0) == 0;
}

// `num_layers` < 4 keeps the first layers of the 4-layer model (the same weights). `biases`: the
// same model with random biases on every projection (HF attention_bias and mlp_bias), drawn from a
// stream of their own so that every other weight is unchanged. `qk_norm`: the same model as a
// Qwen3 (per-head q and k norms, random around 1, from a stream of their own).
// `moe`: tiny-random-moe's mixture of experts in place of the MLPs (the attention's weights the same).
Result<ModelFiles> MakeTinyRandomModel(uint64_t seed = 0x6b76666c6f77, int num_layers = 4, bool biases = false,
                                       bool qk_norm = false, bool moe = false);
// The built-in model of that name (IsBuiltInModel).
Result<ModelFiles> MakeBuiltInModel(const std::string& name);

}  // namespace kvflow
