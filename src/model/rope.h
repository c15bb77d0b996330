// Rotary position embedding tables (HF `rope_type` semantics), independent of any backend.
#pragma once

#include <vector>

#include "kvflow/config.h"

namespace kvflow {

// Inverse frequencies (head_dim / 2 of them) and the cos/sin scale, after rope scaling.
struct RopeFrequencies {
  std::vector<float> inv_freq;
  float attention_scale = 1.0f;  // YaRN multiplies cos and sin by this
};

// Dynamic NTK is applied statically at max_position_embeddings * factor, as vLLM does.
RopeFrequencies ComputeRopeFrequencies(const ModelConfig& config);
// LongRoPE's choice for a context of max_model_len tokens: the long factors when it exceeds the
// original context (as llama.cpp chooses per context). No-op for other scalings.
void SelectRopeFactorsForContext(ModelConfig& config, int64_t max_model_len);
// The config whose RoPE the sliding layers use when ModelConfig::local_rope_theta > 0 (Gemma-3):
// that base, no scaling. Otherwise `config` itself.
ModelConfig LocalRopeConfig(const ModelConfig& config);

// Rotates one head vector in place, HF `rotate_half` convention: element i pairs with
// i + head_dim/2.
void ApplyRope(float* head, int head_dim, int position, const RopeFrequencies& freqs);

}  // namespace kvflow
