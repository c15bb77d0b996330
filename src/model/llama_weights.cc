#include "model/llama_weights.h"

#include <chrono>
#include <cstring>
#include <string>

#include <spdlog/spdlog.h>

namespace kvflow {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

class WeightReader {
 public:
  WeightReader(const TensorSource& source, bool gguf)
      : source_(source), gguf_(gguf), progress_("dequantizing weights", TotalBytes(source)) {}

  // Appends the tensor named `hf_name` (or its GGUF twin) to `out`, checking its shape.
  Status Read(const std::string& hf_name, const std::string& gguf_name,
              const std::vector<int64_t>& shape, std::vector<float>& out) const {
    const TensorInfo* info = source_.Find(gguf_ ? gguf_name : hf_name);
    if (info == nullptr) info = source_.Find(gguf_ ? hf_name : gguf_name);
    if (info == nullptr) {
      return Status::NotFound("tensor '" + (gguf_ ? gguf_name : hf_name) + "' is missing from " +
                              source_.Describe());
    }
    std::vector<int64_t> got = info->shape;
    // 1-D norms may be stored as [n] or [1, n].
    if (got.size() == 2 && shape.size() == 1 && got[0] == 1) got.erase(got.begin());
    if (got != shape) {
      return Status::InvalidArgument("tensor '" + info->name + "' in " + info->file + " has shape " +
                                     ShapeString(info->shape) + ", the config implies " +
                                     ShapeString(shape));
    }
    const size_t offset = out.size();
    out.resize(offset + static_cast<size_t>(info->numel()));
    KVFLOW_RETURN_IF_ERROR(DequantizeToF32(*info, out.data() + offset));
    progress_.Advance(info->nbytes);
    return Status::Ok();
  }

  bool Has(const std::string& hf_name, const std::string& gguf_name) const {
    return source_.Find(hf_name) != nullptr || source_.Find(gguf_name) != nullptr;
  }

 private:
  static uint64_t TotalBytes(const TensorSource& source) {
    uint64_t total = 0;
    for (const std::string& name : source.Names()) total += source.Find(name)->nbytes;
    return total;
  }

  const TensorSource& source_;
  bool gguf_;
  mutable LoadProgress progress_;
};

// llama.cpp stores each head's rows as interleaved pairs (2j, 2j+1); HF keeps halves (j, j+d/2).
void UnpermuteRopeRows(float* rows, int num_heads, int head_dim, int64_t cols) {
  const int half = head_dim / 2;
  std::vector<float> head(static_cast<size_t>(head_dim) * cols);
  for (int h = 0; h < num_heads; ++h) {
    float* base = rows + static_cast<int64_t>(h) * head_dim * cols;
    std::memcpy(head.data(), base, head.size() * sizeof(float));
    for (int j = 0; j < half; ++j) {
      for (int s = 0; s < 2; ++s) {
        std::memcpy(base + static_cast<int64_t>(s * half + j) * cols,
                    head.data() + static_cast<int64_t>(2 * j + s) * cols, cols * sizeof(float));
      }
    }
  }
}

}  // namespace

size_t LlamaWeights::num_parameters() const {
  size_t n = embed.size() + final_norm.size() + lm_head.size();
  for (const auto& l : layers) {
    n += l.attn_norm.size() + l.wqkv.size() + l.wo.size() + l.ffn_norm.size() + l.w_gate_up.size() +
         l.w_down.size();
  }
  return n;
}

Result<LlamaWeights> LoadLlamaWeights(const TensorSource& source, const ModelConfig& c,
                                      bool gguf_rope_permuted) {
  KVFLOW_RETURN_IF_ERROR(c.Validate());
  const bool gguf = source.Find("token_embd.weight") != nullptr;
  WeightReader r(source, gguf);
  const int64_t H = c.hidden_size, D = c.head_dim, F = c.intermediate_size, V = c.vocab_size;
  const int64_t q_rows = static_cast<int64_t>(c.num_heads) * D;
  const int64_t kv_rows = static_cast<int64_t>(c.num_kv_heads) * D;

  LlamaWeights w;
  KVFLOW_RETURN_IF_ERROR(r.Read("model.embed_tokens.weight", "token_embd.weight", {V, H}, w.embed));
  KVFLOW_RETURN_IF_ERROR(r.Read("model.norm.weight", "output_norm.weight", {H}, w.final_norm));
  if (r.Has("lm_head.weight", "output.weight")) {
    KVFLOW_RETURN_IF_ERROR(r.Read("lm_head.weight", "output.weight", {V, H}, w.lm_head));
  } else if (!c.tie_word_embeddings) {
    return Status::NotFound("the config says embeddings are untied but there is no lm_head.weight in " +
                            source.Describe());
  }

  const auto start = std::chrono::steady_clock::now();
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string hf = "model.layers." + std::to_string(i) + ".";
    const std::string gg = "blk." + std::to_string(i) + ".";
    LlamaLayerWeights& l = w.layers[static_cast<size_t>(i)];
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "input_layernorm.weight", gg + "attn_norm.weight", {H}, l.attn_norm));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "self_attn.q_proj.weight", gg + "attn_q.weight", {q_rows, H}, l.wqkv));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "self_attn.k_proj.weight", gg + "attn_k.weight", {kv_rows, H}, l.wqkv));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "self_attn.v_proj.weight", gg + "attn_v.weight", {kv_rows, H}, l.wqkv));
    if (gguf_rope_permuted) {
      UnpermuteRopeRows(l.wqkv.data(), c.num_heads, c.head_dim, H);
      UnpermuteRopeRows(l.wqkv.data() + q_rows * H, c.num_kv_heads, c.head_dim, H);
    }
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", {H, q_rows}, l.wo));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", {H}, l.ffn_norm));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", {F, H}, l.w_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", {F, H}, l.w_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.Read(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", {H, F}, l.w_down));
  }
  spdlog::info("loaded {:.1f}M parameters as fp32 ({:.0f} MiB) in {:.2f} s", w.num_parameters() / 1e6,
               w.num_parameters() * 4.0 / (1 << 20),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return w;
}

}  // namespace kvflow
