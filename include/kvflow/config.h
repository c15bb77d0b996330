// Model and engine configuration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

// How RoPE frequencies are rescaled for long contexts (HF `rope_scaling`).
struct RopeScaling {
  enum class Type { kNone, kLinear, kDynamic, kLlama3, kYarn, kLongRope };
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
  // LongRoPE (Phi-3, "type": "longrope"): per-frequency divisors, head_dim / 2 each, the short ones
  // for contexts up to original_max_position_embeddings, the long ones beyond; cos and sin scaled
  // by sqrt(1 + ln(max / original) / ln(original)). Hugging Face picks per forward call (on its
  // largest position), llama.cpp per context: kvflow, like llama.cpp, uses the long factors for
  // every position when the engine's max_model_len exceeds the original context
  // (long_factors, which the engine sets; true by default).
  std::vector<float> short_factor;
  std::vector<float> long_factor;
  bool long_factors = true;
};

// Shape and hyper-parameters of a decoder of the Llama family: Llama, Mistral, Qwen2, Qwen3, Phi-3,
// Gemma-2, Gemma-3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.
// The families differ only in the fields below (biases, q/k norms, windows, Gemma's norms, GeGLU and
// caps, experts) and in how their files lay
// the weights out (the loader's business); the one model loop honours the fields.
// The gated MLP's activation: SwiGLU's SiLU, or GeGLU's tanh-approximated GELU (Gemma).
enum class MlpActivation { kSilu, kGeluTanh };

struct ModelConfig {
  // llama, mistral, qwen2, qwen3, phi3, mixtral, qwen2moe, qwen3moe, olmoe, gemma2, gemma3
  std::string architecture = "llama";
  std::string name;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // hidden_size / num_heads unless the config says otherwise
  int max_position_embeddings = 2048;
  // Sliding-window attention (Mistral, Phi-3: every layer; Gemma-2: every other one): the query at
  // position p attends to keys p - sliding_window + 1 .. p, as Hugging Face's mask does; 0: to the
  // whole context. With global_layer_interval > 0, layer i attends to the whole context when
  // (i + 1) % global_layer_interval == 0 (Gemma-2: 2, its odd layers; Gemma-3: 6).
  int sliding_window = 0;
  int global_layer_interval = 0;
  // Pipeline parallelism: the whole model's index of this config's layer 0, where a rank holds a
  // run of the layers (num_layers of them), so per-layer patterns (global_layer_interval) stay the
  // whole model's.
  int first_layer = 0;
  // Tensor parallelism's vocabulary shard (Megatron's vocab-parallel embedding and LM head): this
  // config's embedding and head hold rows [vocab_shard_first, vocab_shard_first +
  // vocab_shard_rows) of the vocab_size. A token outside them embeds as zeros (the ranks' sum is its
  // embedding) and the logits have vocab_shard_rows columns. 0 rows: the whole vocabulary.
  int vocab_shard_first = 0;
  int vocab_shard_rows = 0;
  // > 0: the sliding-window layers' RoPE base, without rope_scaling, while the global layers keep
  // rope_theta and rope_scaling (Gemma-3's rope_local_base_freq).
  float local_rope_theta = 0.0f;
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
  // Gemma-2's (and Gemma-3's) departures from Llama. The softmax scale of q.k (0: 1 / sqrt(head_dim); Gemma:
  // query_pre_attn_scalar^-0.5); attention scores and final logits soft-capped, x -> cap *
  // tanh(x / cap), where the caps are > 0; embedding rows scaled by embedding_scale; the attention's
  // and the MLP's outputs each RMSNormed before they join the residual stream (sandwich_norms); the
  // gated MLP's activation. Gemma's (1 + w) norm weights are stored as 1 + w.
  float attention_scale = 0.0f;
  float attn_logit_softcap = 0.0f;
  float final_logit_softcap = 0.0f;
  float embedding_scale = 1.0f;
  bool sandwich_norms = false;
  MlpActivation mlp_activation = MlpActivation::kSilu;
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;

  // The sliding window of `layer`'s attention (0: the whole context).
  int LayerWindow(int layer) const { return IsGlobalLayer(layer) ? 0 : sliding_window; }
  // Whether `layer` is one of the global layers between the sliding ones (global_layer_interval).
  bool IsGlobalLayer(int layer) const {
    return global_layer_interval > 0 && (first_layer + layer + 1) % global_layer_interval == 0;
  }
  // The window every layer attends through (0 when some layer attends globally): only then may the
  // blocks behind it be released.
  int ReleasableWindow() const { return global_layer_interval > 0 ? 0 : sliding_window; }
  // The softmax scale of q.k.
  float AttentionScale() const;
  // Rows of the embedding and columns of the logits this config holds.
  int logit_columns() const { return vocab_shard_rows > 0 ? vocab_shard_rows : vocab_size; }

  // Checks internal consistency (positive sizes, heads divide, GQA groups).
  Status Validate() const;
  // Multi-line human-readable summary (used by `kvflow info`).
  std::string Describe() const;
};

}  // namespace kvflow
