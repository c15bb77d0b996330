// fp32 weights of a Llama-architecture decoder, dequantized from any supported file format.
#pragma once

#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"
#include "model/tensor_source.h"

namespace kvflow {

// Matrices are row-major [out_features, in_features], as HF stores them. Q/K/V and gate/up are
// concatenated along the output dimension at load so each becomes one GEMM.
struct LlamaLayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  std::vector<float> wqkv;       // [(heads + 2 * kv_heads) * head_dim, hidden]
  std::vector<float> wo;         // [hidden, heads * head_dim]
  std::vector<float> ffn_norm;   // [hidden]
  std::vector<float> w_gate_up;  // [2 * intermediate, hidden]: gate rows, then up rows
  std::vector<float> w_down;     // [hidden, intermediate]
};

struct LlamaWeights {
  std::vector<float> embed;       // [vocab, hidden]
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied to `embed`
  std::vector<LlamaLayerWeights> layers;

  const std::vector<float>& output_matrix() const { return lm_head.empty() ? embed : lm_head; }
  size_t num_parameters() const;
};

// Accepts HF names (model.layers.N.self_attn.q_proj.weight) and GGUF names (blk.N.attn_q.weight).
// `gguf_rope_permuted`: undo llama.cpp's reordering of Q/K rows so that RoPE uses HF's
// rotate_half pairing everywhere. Every tensor's shape is checked against the config.
Result<LlamaWeights> LoadLlamaWeights(const TensorSource& source, const ModelConfig& config,
                                      bool gguf_rope_permuted);

}  // namespace kvflow
