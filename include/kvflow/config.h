// Model and engine configuration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

// How RoPE frequencies are rescaled for long contexts (HF `rope_scaling`).
struct RopeScaling {
  enum class Type { kNone, kLinear, kDynamic, kLlama3, kYarn };
  Type type = Type::kNone;
  float factor = 1.0f;
  // Llama-3.x ("rope_type": "llama3").
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position_embeddings = 0;
  // YaRN.
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  float attention_factor = 0.0f;  // 0: derive from factor as HF does
};

// Shape and hyper-parameters of a decoder of the Llama family: Llama, Mistral, Qwen2, Qwen3, Phi-3,
// Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.
// The families differ only in the fields below (biases, q/k norms) and in how their files lay
// the weights out (the loader's business); the one model loop honours the fields.
struct ModelConfig {
  std::string architecture = "llama";  // llama, mistral, qwen2, qwen3, phi3, mixtral, qwen2moe, qwen3moe, olmoe
  std::string name;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // hidden_size / num_heads unless the config says otherwise
  int max_position_embeddings = 2048;
  // Sliding-window attention on every layer (Mistral, Phi-3): the query at position p attends to
  // keys p - sliding_window + 1 .. p, as Hugging Face's mask does; 0: to the whole context.
  int sliding_window = 0;
  float rms_norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  // Biases of the projections, each an fp32 vector added to the product (HF's nn.Linear(bias=True)).
  // HF Llama's attention_bias sets qkv_bias and o_bias, mlp_bias sets mlp_bias; a GGUF file has no
  // flags, so they follow the bias tensors it holds (llama.cpp adds each one it finds).
  bool qkv_bias = false;  // q_proj, k_proj, v_proj
  bool o_bias = false;    // o_proj
  bool mlp_bias = false;  // gate_proj, up_proj, down_proj
  // A mixture of experts in place of the MLP where num_experts > 0 (Mixtral, Qwen2-MoE, Qwen3-MoE):
  // a router picks experts_per_token of num_experts SwiGLU experts (each expert_intermediate_size
  // wide) per token, from the softmax of its logits; with norm_topk_prob the chosen probabilities
  // are renormalized to sum to 1 (Mixtral, Qwen3-MoE). Qwen2-MoE adds a shared expert
  // (shared_expert_intermediate_size wide) that every token runs, scaled by a sigmoid gate.
  int num_experts = 0;
  int experts_per_token = 0;
  int expert_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;
  // An RMSNorm over each head of q and of k (weights of head_dim, one for q, one for k) between
  // the projection and RoPE: Qwen3's q_norm and k_norm. Without qk_norm_per_head one RMSNorm runs
  // over all of q and one over all of k (weights of heads * head_dim and kv_heads * head_dim: OLMoE).
  bool qk_norm = false;
  bool qk_norm_per_head = true;
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;

  // Checks internal consistency (positive sizes, heads divide, GQA groups).
  Status Validate() const;
  // Multi-line human-readable summary (used by `kvflow info`).
  std::string Describe() const;
};

}  // namespace kvflow
