// Weights of a Llama-architecture decoder: fp32 (dequantized from any supported file format), or
// with the matrices kept in the file's block quantization where the CPU kernels compute with it.
#pragma once

#include <functional>

#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"
#include "model/tensor_source.h"
#include "model/weight_matrix.h"

namespace kvflow {

// Matrices are row-major [out_features, in_features], as HF stores them. Q/K/V and gate/up are
// concatenated along the output dimension at load so each becomes one GEMM.
struct LlamaLayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  WeightMatrix wqkv;             // [(heads + 2 * kv_heads) * head_dim, hidden]
  WeightMatrix wo;               // [hidden, heads * head_dim]
  std::vector<float> ffn_norm;   // [hidden]
  // ModelConfig::sandwich_norms (Gemma-2): of the attention's output and of the MLP's, each before
  // it joins the residual stream; else empty.
  std::vector<float> post_attn_norm;  // [hidden]
  std::vector<float> post_ffn_norm;   // [hidden]
  WeightMatrix w_gate_up;        // [2 * intermediate, hidden]: gate rows, then up rows
  WeightMatrix w_down;           // [hidden, intermediate]
  // Biases (fp32, whatever the file stores), fused like the matrices; empty when the config has
  // none (ModelConfig::qkv_bias, o_bias, mlp_bias).
  std::vector<float> bqkv;       // [(heads + 2 * kv_heads) * head_dim]: q, then k, then v
  std::vector<float> bo;         // [hidden]
  std::vector<float> b_gate_up;  // [2 * intermediate]: gate, then up
  std::vector<float> b_down;     // [hidden]
  // A mixture of experts (ModelConfig::num_experts > 0) in place of w_gate_up / w_down: the router,
  // each expert's fused gate|up and down matrices (F = expert_intermediate_size), and Qwen2-MoE's
  // shared expert (Fs = shared_expert_intermediate_size) with its gate's row.
  WeightMatrix router;                       // [experts, hidden]
  std::vector<WeightMatrix> expert_gate_up;  // experts x [2F, hidden]
  std::vector<WeightMatrix> expert_down;     // experts x [hidden, F]
  WeightMatrix shared_gate_up;               // [2Fs, hidden]
  WeightMatrix shared_down;                  // [hidden, Fs]
  std::vector<float> shared_gate;            // [hidden]
  // Per-head norms of q and k (ModelConfig::qk_norm), else empty.
  std::vector<float> q_norm;     // [head_dim]
  std::vector<float> k_norm;     // [head_dim]
};

struct LlamaWeights {
  WeightMatrix embed;             // [vocab, hidden]
  std::vector<float> final_norm;  // [hidden]
  WeightMatrix lm_head;           // [vocab, hidden]; empty when tied to `embed`
  std::vector<LlamaLayerWeights> layers;

  const WeightMatrix& output_matrix() const { return lm_head.empty() ? embed : lm_head; }
  size_t num_parameters() const;
  // Bytes of the matrices and norms in memory.
  size_t bytes() const;
  // Whether every matrix is fp32 (what the CUDA backend needs).
  bool all_f32() const;
};

// Whether the biases and q/k norms of `w` are exactly those `config` declares, of the sizes it
// implies (what a backend checks before computing with them).
Status CheckFamilyWeights(const ModelConfig& config, const LlamaWeights& w);

// How the matrices are kept: fp32 (exact; the reference and the CUDA backend's input), or in the
// file's block quantization where CPU kernels exist for it and F16 / BF16 as 16-bit (others become
// fp32).
enum class WeightFormat { kF32, kKeepQuantized };

// Accepts HF names (model.layers.N.self_attn.q_proj.weight) and GGUF names (blk.N.attn_q.weight).
// `gguf_rope_permuted`: undo llama.cpp's reordering of Q/K rows (and of their biases) so that RoPE
// uses HF's rotate_half pairing everywhere. Phi-3's fused projections (qkv_proj and gate_up_proj;
// GGUF attn_qkv and an ffn_up of both halves) are read whole. Every tensor's shape is checked
// against the config.
// Biases are read exactly when the config declares them: one it declares but the source lacks is
// NotFound, one the source has but the config does not declare is Unsupported (as is every other
// tensor the model would not use).
//
// `selection` loads one rank's share (tensor and pipeline parallelism): a run of the layers, the
// embedding and the head where the rank needs them, each layer cut to its share as soon as it is
// read. Every tensor's shape is still checked and accounted for; the others' data is never read
// (from a mapped file, their pages are never touched), so a rank's memory holds its share and one
// layer more.
struct WeightSelection {
  int first_layer = 0;
  int num_layers = -1;   // -1: to the last layer
  bool embedding = true;  // (read anyway where `head` reads it: tied embeddings)
  bool head = true;       // the final norm and the LM head
  // Applied to each selected layer (its index in the whole model) once it is read.
  std::function<Status(int layer, LlamaLayerWeights& weights)> per_layer;
};
Result<LlamaWeights> LoadLlamaWeights(const TensorSource& source, const ModelConfig& config,
                                      bool gguf_rope_permuted, WeightFormat format = WeightFormat::kF32,
                                      const WeightSelection& selection = {});

}  // namespace kvflow
