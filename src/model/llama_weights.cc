#include "model/llama_weights.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <unordered_set>

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
  WeightReader(const TensorSource& source, bool gguf, bool keep_quantized)
      : source_(source),
        gguf_(gguf),
        keep_quantized_(keep_quantized),
        progress_(keep_quantized ? "loading weights" : "dequantizing weights", TotalBytes(source)) {}

  // Tensors of the source that no Read* took and that kvflow's Llama does not need: a model that
  // has them (biases, extra projections) would compute something else than kvflow does.
  std::vector<std::string> Unused() const {
    std::vector<std::string> unused;
    for (const std::string& name : source_.Names()) {
      const bool harmless = name.ends_with("rotary_emb.inv_freq");  // recomputed from the config
      if (!used_.contains(name) && !harmless) unused.push_back(name);
    }
    return unused;
  }

  // The tensor named `hf_name` (or its GGUF twin), its shape checked.
  Result<const TensorInfo*> Find(const std::string& hf_name, const std::string& gguf_name,
                                 const std::vector<int64_t>& shape) const {
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
    used_.insert(info->name);
    return info;
  }

  // While set, the Read* calls check and account for their tensors but read no data (a tensor of
  // another rank's share: a mapped file's pages for it are never touched).
  void set_skip_data(bool skip) { skip_data_ = skip; }

  // A 1-D tensor (norm weights, biases) as fp32, appended to `out` when `append`.
  Status ReadVector(const std::string& hf_name, const std::string& gguf_name, int64_t n, std::vector<float>& out,
                    bool append = false) const {
    KVFLOW_ASSIGN_OR_RETURN(const TensorInfo* info, Find(hf_name, gguf_name, {n}));
    if (Skipped(*info)) return Status::Ok();
    const size_t first = append ? out.size() : 0;
    out.resize(first + static_cast<size_t>(n));
    KVFLOW_RETURN_IF_ERROR(DequantizeToF32(*info, out.data() + first));
    progress_.Advance(info->nbytes);
    return Status::Ok();
  }

  // Appends the rows of a [rows, cols] tensor to `out`; `fix_rows` may reorder them first.
  Status ReadRows(const std::string& hf_name, const std::string& gguf_name, int64_t rows, int64_t cols,
                  WeightMatrix& out, const std::function<void(WeightPart&)>& fix_rows = {}) const {
    KVFLOW_ASSIGN_OR_RETURN(const TensorInfo* info, Find(hf_name, gguf_name, {rows, cols}));
    if (Skipped(*info)) return Status::Ok();
    KVFLOW_ASSIGN_OR_RETURN(WeightPart part, ReadWeightPart(*info, keep_quantized_));
    if (keep_quantized_ && part.dtype == DType::kF32 && DTypeBlockElements(info->dtype) > 1) {
      dequantized_formats_.insert(DTypeName(info->dtype));
    }
    if (fix_rows) fix_rows(part);
    out.cols = cols;
    out.Append(std::move(part));
    progress_.Advance(info->nbytes);
    return Status::Ok();
  }

  // Appends to each of `out`'s matrices its expert's [rows, cols] rows of a [experts, rows, cols]
  // tensor (llama.cpp's merged expert tensors).
  Status ReadExpertRows(const std::string& gguf_name, int64_t rows, int64_t cols, std::vector<WeightMatrix>& out) const {
    const int64_t experts = static_cast<int64_t>(out.size());
    KVFLOW_ASSIGN_OR_RETURN(const TensorInfo* info, Find(gguf_name, gguf_name, {experts, rows, cols}));
    if (Skipped(*info)) return Status::Ok();
    KVFLOW_ASSIGN_OR_RETURN(WeightPart all, ReadWeightPart(*info, keep_quantized_));
    const size_t row_bytes = all.dtype == DType::kF32 ? sizeof(float) * cols : all.row_bytes(cols);
    const uint8_t* base = all.dtype == DType::kF32 ? reinterpret_cast<const uint8_t*>(all.f32.data()) : all.blocks.data();
    for (int64_t e = 0; e < experts; ++e) {
      WeightPart part;
      part.dtype = all.dtype;
      part.rows = rows;
      const uint8_t* first = base + static_cast<size_t>(e * rows) * row_bytes;
      if (all.dtype == DType::kF32) {
        const float* f = reinterpret_cast<const float*>(first);
        part.f32.assign(f, f + rows * cols);
      } else {
        part.blocks.assign(first, first + rows * row_bytes);
      }
      out[static_cast<size_t>(e)].cols = cols;
      out[static_cast<size_t>(e)].Append(std::move(part));
    }
    progress_.Advance(info->nbytes);
    return Status::Ok();
  }

  // Block formats that were asked to stay quantized but have no kernels (none today: every GGUF
  // block format the loader reads has CPU kernels): they are held as fp32, several times their size.
  const std::set<std::string>& dequantized_formats() const { return dequantized_formats_; }

  bool Has(const std::string& hf_name, const std::string& gguf_name) const {
    return source_.Find(hf_name) != nullptr || source_.Find(gguf_name) != nullptr;
  }

 private:
  bool Skipped(const TensorInfo& info) const {
    if (skip_data_) progress_.Advance(info.nbytes);
    return skip_data_;
  }

  static uint64_t TotalBytes(const TensorSource& source) {
    uint64_t total = 0;
    for (const std::string& name : source.Names()) total += source.Find(name)->nbytes;
    return total;
  }

  const TensorSource& source_;
  bool gguf_;
  bool keep_quantized_;
  bool skip_data_ = false;
  mutable LoadProgress progress_;
  mutable std::unordered_set<std::string> used_;
  mutable std::set<std::string> dequantized_formats_;
};

// llama.cpp stores each head's rows as interleaved pairs (2j, 2j+1); HF keeps halves (j, j+d/2).
// Rows move whole, so this works on fp32 and on block-quantized rows alike.
void UnpermuteRopeRows(uint8_t* rows, int num_heads, int head_dim, size_t row_bytes) {
  const int half = head_dim / 2;
  std::vector<uint8_t> head(static_cast<size_t>(head_dim) * row_bytes);
  for (int h = 0; h < num_heads; ++h) {
    uint8_t* base = rows + static_cast<size_t>(h) * head_dim * row_bytes;
    std::memcpy(head.data(), base, head.size());
    for (int j = 0; j < half; ++j) {
      for (int s = 0; s < 2; ++s) {
        std::memcpy(base + static_cast<size_t>(s * half + j) * row_bytes,
                    head.data() + static_cast<size_t>(2 * j + s) * row_bytes, row_bytes);
      }
    }
  }
}

// A bias of permuted rows: one float per row.
void UnpermuteRopeBias(float* bias, int num_heads, int head_dim) {
  UnpermuteRopeRows(reinterpret_cast<uint8_t*>(bias), num_heads, head_dim, sizeof(float));
}

void UnpermuteRopeRows(WeightPart& part, int num_heads, int head_dim, int64_t cols) {
  if (part.dtype == DType::kF32) {
    UnpermuteRopeRows(reinterpret_cast<uint8_t*>(part.f32.data()), num_heads, head_dim, sizeof(float) * cols);
  } else {
    UnpermuteRopeRows(part.blocks.data(), num_heads, head_dim, part.row_bytes(cols));
  }
}

// The biases the config declares, fused as the matrices are (q|k|v, gate|up). A declared bias the
// source lacks is an error that says which flag asked for it.
Status ReadBiases(const WeightReader& r, const ModelConfig& c, const std::string& hf, const std::string& gg,
                  bool gguf_rope_permuted, LlamaLayerWeights& l) {
  const int64_t H = c.hidden_size, D = c.head_dim, F = c.intermediate_size;
  const int64_t q_rows = static_cast<int64_t>(c.num_heads) * D;
  const int64_t kv_rows = static_cast<int64_t>(c.num_kv_heads) * D;
  auto declared = [](Status st, const char* flag) {
    if (st.code() != StatusCode::kNotFound) return st;
    return Status::NotFound(st.message() + "; the config declares " + flag);
  };
  const char* attention_flag = "attention_bias (in a GGUF file: blk.0 has attention biases)";
  const char* mlp_flag = "mlp_bias (in a GGUF file: blk.0 has ffn_gate.bias)";
  if (c.qkv_bias) {
    l.bqkv.clear();
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "self_attn.q_proj.bias", gg + "attn_q.bias", q_rows, l.bqkv, true), attention_flag));
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "self_attn.k_proj.bias", gg + "attn_k.bias", kv_rows, l.bqkv, true), attention_flag));
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "self_attn.v_proj.bias", gg + "attn_v.bias", kv_rows, l.bqkv, true), attention_flag));
    if (gguf_rope_permuted) {  // llama.cpp's converter permutes the q and k biases with their rows
      UnpermuteRopeBias(l.bqkv.data(), c.num_heads, c.head_dim);
      UnpermuteRopeBias(l.bqkv.data() + q_rows, c.num_kv_heads, c.head_dim);
    }
  }
  if (c.o_bias) {
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "self_attn.o_proj.bias", gg + "attn_output.bias", H, l.bo), attention_flag));
  }
  if (c.mlp_bias) {
    l.b_gate_up.clear();
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "mlp.gate_proj.bias", gg + "ffn_gate.bias", F, l.b_gate_up, true), mlp_flag));
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "mlp.up_proj.bias", gg + "ffn_up.bias", F, l.b_gate_up, true), mlp_flag));
    KVFLOW_RETURN_IF_ERROR(
        declared(r.ReadVector(hf + "mlp.down_proj.bias", gg + "ffn_down.bias", H, l.b_down), mlp_flag));
  }
  return Status::Ok();
}

// The router and experts. HF: Mixtral's block_sparse_moe.gate and experts.E.w1 (gate), w3 (up),
// w2 (down); Qwen-MoE's mlp.gate, mlp.experts.E.gate_proj / up_proj / down_proj and the shared
// expert (mlp.shared_expert.*, mlp.shared_expert_gate). GGUF: ffn_gate_inp, the merged
// ffn_gate_exps / ffn_up_exps / ffn_down_exps, and ffn_*_shexp, ffn_gate_inp_shexp.
Status ReadExperts(const WeightReader& r, const ModelConfig& c, const std::string& hf, const std::string& gg,
                   LlamaLayerWeights& l) {
  const int64_t H = c.hidden_size, F = c.expert_intermediate_size, E = c.num_experts;
  const bool mixtral = c.architecture == "mixtral" || c.architecture == "llama";  // llama.cpp's Mixtral is a llama
  const std::string moe = hf + (mixtral ? "block_sparse_moe." : "mlp.");
  KVFLOW_RETURN_IF_ERROR(r.ReadRows(moe + "gate.weight", gg + "ffn_gate_inp.weight", E, H, l.router));
  l.expert_gate_up.assign(static_cast<size_t>(E), WeightMatrix{});
  l.expert_down.assign(static_cast<size_t>(E), WeightMatrix{});
  if (r.Has(gg + "ffn_gate_exps.weight", gg + "ffn_gate_exps.weight")) {
    KVFLOW_RETURN_IF_ERROR(r.ReadExpertRows(gg + "ffn_gate_exps.weight", F, H, l.expert_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.ReadExpertRows(gg + "ffn_up_exps.weight", F, H, l.expert_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.ReadExpertRows(gg + "ffn_down_exps.weight", H, F, l.expert_down));
  } else {
    // gate, up, down
    const std::array<const char*, 3> names = mixtral ? std::array<const char*, 3>{"w1", "w3", "w2"}
                                                     : std::array<const char*, 3>{"gate_proj", "up_proj", "down_proj"};
    for (int64_t e = 0; e < E; ++e) {
      const std::string ex = moe + "experts." + std::to_string(e) + ".";
      WeightMatrix& gate_up = l.expert_gate_up[static_cast<size_t>(e)];
      for (int k = 0; k < 2; ++k) {
        const std::string name = ex + names[k] + ".weight";
        KVFLOW_RETURN_IF_ERROR(r.ReadRows(name, name, F, H, gate_up));
      }
      const std::string down = ex + names[2] + ".weight";
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(down, down, H, F, l.expert_down[static_cast<size_t>(e)]));
    }
  }
  if (c.shared_expert_intermediate_size > 0) {
    const int64_t Fs = c.shared_expert_intermediate_size;
    const std::string sh = hf + "mlp.shared_expert.";
    KVFLOW_RETURN_IF_ERROR(r.ReadRows(sh + "gate_proj.weight", gg + "ffn_gate_shexp.weight", Fs, H, l.shared_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.ReadRows(sh + "up_proj.weight", gg + "ffn_up_shexp.weight", Fs, H, l.shared_gate_up));
    KVFLOW_RETURN_IF_ERROR(r.ReadRows(sh + "down_proj.weight", gg + "ffn_down_shexp.weight", H, Fs, l.shared_down));
    // HF's Linear(hidden, 1) is a [1, hidden] matrix; llama.cpp's ffn_gate_inp_shexp a vector.
    const std::string gate_hf = hf + "mlp.shared_expert_gate.weight", gate_gg = gg + "ffn_gate_inp_shexp.weight";
    WeightMatrix gate;
    if (r.Has(gate_hf, "")) {
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(gate_hf, gate_gg, 1, H, gate));
    } else {
      KVFLOW_RETURN_IF_ERROR(r.ReadVector(gate_hf, gate_gg, H, l.shared_gate));
    }
    if (!gate.empty()) {
      l.shared_gate.resize(static_cast<size_t>(H));
      gate.DequantizeRow(0, l.shared_gate.data());
    }
  }
  return Status::Ok();
}

}  // namespace

size_t LlamaWeights::num_parameters() const {
  size_t n = embed.num_parameters() + final_norm.size() + lm_head.num_parameters();
  for (const auto& l : layers) {
    n += l.attn_norm.size() + l.post_attn_norm.size() + l.post_ffn_norm.size() + l.wqkv.num_parameters() +
         l.wo.num_parameters() + l.ffn_norm.size() + l.w_gate_up.num_parameters() + l.w_down.num_parameters() + l.bqkv.size() + l.bo.size() +
         l.b_gate_up.size() + l.b_down.size() + l.q_norm.size() + l.k_norm.size() + l.router.num_parameters() +
         l.shared_gate_up.num_parameters() + l.shared_down.num_parameters() + l.shared_gate.size();
    for (const WeightMatrix& m : l.expert_gate_up) n += m.num_parameters();
    for (const WeightMatrix& m : l.expert_down) n += m.num_parameters();
  }
  return n;
}

size_t LlamaWeights::bytes() const {
  size_t n = embed.bytes() + lm_head.bytes() + final_norm.size() * sizeof(float);
  for (const auto& l : layers) {
    n += (l.attn_norm.size() + l.ffn_norm.size() + l.post_attn_norm.size() + l.post_ffn_norm.size() +
          l.bqkv.size() + l.bo.size() + l.b_gate_up.size() + l.b_down.size() + l.q_norm.size() + l.k_norm.size()) * sizeof(float) + l.wqkv.bytes() + l.wo.bytes() +
         l.w_gate_up.bytes() + l.w_down.bytes() + l.router.bytes() + l.shared_gate_up.bytes() +
         l.shared_down.bytes() + l.shared_gate.size() * sizeof(float);
    for (const WeightMatrix& m : l.expert_gate_up) n += m.bytes();
    for (const WeightMatrix& m : l.expert_down) n += m.bytes();
  }
  return n;
}

bool LlamaWeights::all_f32() const {
  auto f32 = [](const WeightMatrix& m) { return m.empty() || m.is_f32(); };
  if (!f32(embed) || !f32(lm_head)) return false;
  for (const auto& l : layers) {
    if (!f32(l.wqkv) || !f32(l.wo) || !f32(l.w_gate_up) || !f32(l.w_down) || !f32(l.router) ||
        !f32(l.shared_gate_up) || !f32(l.shared_down)) {
      return false;
    }
    for (const WeightMatrix& m : l.expert_gate_up) if (!f32(m)) return false;
    for (const WeightMatrix& m : l.expert_down) if (!f32(m)) return false;
  }
  return true;
}

Status CheckFamilyWeights(const ModelConfig& c, const LlamaWeights& w) {
  const int64_t D = c.head_dim;
  // A rank of a vocabulary split holds its rows of the embedding and head only.
  for (const WeightMatrix* m : {&w.embed, &w.lm_head}) {
    if (!m->empty() && m->rows != c.logit_columns()) {
      return Status::InvalidArgument("the embedding or LM head has " + std::to_string(m->rows) +
                                     " rows; the config implies " + std::to_string(c.logit_columns()) +
                                     (c.vocab_shard_rows > 0 ? " (its vocabulary shard)" : ""));
    }
  }
  const int64_t qkv = (static_cast<int64_t>(c.num_heads) + 2 * c.num_kv_heads) * D;
  const int64_t H = c.hidden_size, F = c.intermediate_size, q = static_cast<int64_t>(c.num_heads) * D;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LlamaLayerWeights& l = w.layers[i];
    // The projections' shapes: a backend sizes its buffers from the config and copies these in.
    const struct {
      const char* name;
      const WeightMatrix& m;
      int64_t rows, cols;
    } matrices[] = {{"q/k/v projection", l.wqkv, qkv, H},
                    {"o projection", l.wo, H, q},
                    {"gate/up projection", l.w_gate_up, c.num_experts > 0 ? 0 : 2 * F, H},
                    {"down projection", l.w_down, c.num_experts > 0 ? 0 : H, F}};
    for (const auto& m : matrices) {
      if (m.rows == 0 && m.m.empty()) continue;  // a mixture of experts has no dense MLP
      if (m.m.rows != m.rows || m.m.cols != m.cols) {
        return Status::InvalidArgument("layer " + std::to_string(i) + "'s " + m.name + " is [" +
                                       std::to_string(m.m.rows) + ", " + std::to_string(m.m.cols) +
                                       "], the config implies [" + std::to_string(m.rows) + ", " +
                                       std::to_string(m.cols) + "]");
      }
    }
    const struct {
      const char* name;
      const std::vector<float>& bias;
      bool declared;
      int64_t size;
    } biases[] = {{"q/k/v bias", l.bqkv, c.qkv_bias, qkv},
                  {"o bias", l.bo, c.o_bias, c.hidden_size},
                  {"gate/up bias", l.b_gate_up, c.mlp_bias, 2 * static_cast<int64_t>(c.intermediate_size)},
                  {"down bias", l.b_down, c.mlp_bias, c.hidden_size},
                  {"q norm", l.q_norm, c.qk_norm, c.qk_norm_per_head ? D : c.num_heads * D},
                  {"k norm", l.k_norm, c.qk_norm, c.qk_norm_per_head ? D : c.num_kv_heads * D},
                  {"post-attention norm", l.post_attn_norm, c.sandwich_norms, c.hidden_size},
                  {"post-MLP norm", l.post_ffn_norm, c.sandwich_norms, c.hidden_size}};
    const size_t experts = static_cast<size_t>(c.num_experts);
    if (l.expert_gate_up.size() != experts || l.expert_down.size() != experts ||
        (experts > 0 && (l.router.rows != c.num_experts || l.router.cols != c.hidden_size))) {
      return Status::InvalidArgument("layer " + std::to_string(i) + " has " + std::to_string(l.expert_gate_up.size()) +
                                     " experts and a router of " + std::to_string(l.router.rows) +
                                     " rows; the config implies " + std::to_string(experts));
    }
    const bool shared = c.shared_expert_intermediate_size > 0;
    if (shared != !l.shared_gate_up.empty() || (shared && l.shared_gate.size() != static_cast<size_t>(c.hidden_size))) {
      return Status::InvalidArgument("layer " + std::to_string(i) + "'s shared expert does not match the config");
    }
    for (const auto& b : biases) {
      const int64_t want = b.declared ? b.size : 0;
      if (static_cast<int64_t>(b.bias.size()) != want) {
        return Status::InvalidArgument("layer " + std::to_string(i) + "'s " + b.name + " has " +
                                       std::to_string(b.bias.size()) + " elements, the config implies " +
                                       std::to_string(want));
      }
    }
  }
  return Status::Ok();
}

Result<LlamaWeights> LoadLlamaWeights(const TensorSource& source, const ModelConfig& c, bool gguf_rope_permuted,
                                      WeightFormat format, const WeightSelection& selection) {
  KVFLOW_RETURN_IF_ERROR(c.Validate());
  const bool gguf = source.Find("token_embd.weight") != nullptr;
  WeightReader r(source, gguf, format == WeightFormat::kKeepQuantized);
  const int64_t H = c.hidden_size, D = c.head_dim, F = c.intermediate_size, V = c.vocab_size;
  const int64_t q_rows = static_cast<int64_t>(c.num_heads) * D;
  const int64_t kv_rows = static_cast<int64_t>(c.num_kv_heads) * D;

  const int first_layer = selection.first_layer;
  const int end_layer = selection.num_layers < 0 ? c.num_layers : first_layer + selection.num_layers;
  if (first_layer < 0 || end_layer > c.num_layers || first_layer >= end_layer) {
    return Status::InvalidArgument("layers [" + std::to_string(first_layer) + ", " + std::to_string(end_layer) +
                                   ") are not a run of the model's " + std::to_string(c.num_layers));
  }
  const bool untied = r.Has("lm_head.weight", "output.weight");
  const auto start = std::chrono::steady_clock::now();
  LlamaWeights w;
  r.set_skip_data(!selection.embedding && !(selection.head && !untied));  // a tied head reads the embedding
  KVFLOW_RETURN_IF_ERROR(r.ReadRows("model.embed_tokens.weight", "token_embd.weight", V, H, w.embed));
  r.set_skip_data(!selection.head);
  KVFLOW_RETURN_IF_ERROR(r.ReadVector("model.norm.weight", "output_norm.weight", H, w.final_norm));
  // Gemma's RMSNorms scale by (1 + w): HF checkpoints store w, llama.cpp's GGUFs 1 + w already.
  const bool norm_plus_one = c.architecture.starts_with("gemma") && !gguf;
  auto plus_one = [norm_plus_one](std::vector<float>& norm) {
    if (norm_plus_one) {
      for (float& x : norm) x += 1.0f;  // in fp32, as HF's (1.0 + self.weight.float())
    }
  };
  plus_one(w.final_norm);
  if (untied) {
    KVFLOW_RETURN_IF_ERROR(r.ReadRows("lm_head.weight", "output.weight", V, H, w.lm_head));
  } else if (!c.tie_word_embeddings) {
    return Status::NotFound("the config says embeddings are untied but there is no lm_head.weight in " +
                            source.Describe());
  }

  if (gguf && c.rope_scaling.type == RopeScaling::Type::kLongRope) {
    // Read into the config already (ModelConfigFromGguf); here only accounted for.
    KVFLOW_RETURN_IF_ERROR(r.Find("", "rope_factors_long.weight", {D / 2}).status());
    KVFLOW_RETURN_IF_ERROR(r.Find("", "rope_factors_short.weight", {D / 2}).status());
  }

  auto unpermute = [&](int heads) -> std::function<void(WeightPart&)> {
    if (!gguf_rope_permuted) return {};
    return [&c, heads, H](WeightPart& part) { UnpermuteRopeRows(part, heads, c.head_dim, H); };
  };
  const bool fused = c.architecture == "phi3";
  w.layers.reserve(static_cast<size_t>(end_layer - first_layer));
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string hf = "model.layers." + std::to_string(i) + ".";
    const std::string gg = "blk." + std::to_string(i) + ".";
    const bool selected = i >= first_layer && i < end_layer;
    r.set_skip_data(!selected);
    LlamaLayerWeights skipped;
    LlamaLayerWeights& l = selected ? w.layers.emplace_back() : skipped;
    KVFLOW_RETURN_IF_ERROR(r.ReadVector(hf + "input_layernorm.weight", gg + "attn_norm.weight", H, l.attn_norm));
    plus_one(l.attn_norm);
    if (c.sandwich_norms) {
      // Gemma-2's post_attention_layernorm norms the attention output; the MLP's input norm is
      // pre_feedforward_layernorm.
      KVFLOW_RETURN_IF_ERROR(r.ReadVector(hf + "post_attention_layernorm.weight", gg + "post_attention_norm.weight", H,
                                          l.post_attn_norm));
      KVFLOW_RETURN_IF_ERROR(r.ReadVector(hf + "post_feedforward_layernorm.weight", gg + "post_ffw_norm.weight", H,
                                          l.post_ffn_norm));
      plus_one(l.post_attn_norm);
      plus_one(l.post_ffn_norm);
    }
    if (fused) {  // Phi-3 stores q|k|v and gate|up as one matrix each, in kvflow's order already
      KVFLOW_RETURN_IF_ERROR(
          r.ReadRows(hf + "self_attn.qkv_proj.weight", gg + "attn_qkv.weight", q_rows + 2 * kv_rows, H, l.wqkv));
    } else {
      KVFLOW_RETURN_IF_ERROR(
          r.ReadRows(hf + "self_attn.q_proj.weight", gg + "attn_q.weight", q_rows, H, l.wqkv, unpermute(c.num_heads)));
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "self_attn.k_proj.weight", gg + "attn_k.weight", kv_rows, H, l.wqkv,
                                        unpermute(c.num_kv_heads)));
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "self_attn.v_proj.weight", gg + "attn_v.weight", kv_rows, H, l.wqkv));
    }
    KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", H, q_rows, l.wo));
    KVFLOW_RETURN_IF_ERROR(r.ReadVector(
        hf + (c.sandwich_norms ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight"),
        gg + "ffn_norm.weight", H, l.ffn_norm));
    plus_one(l.ffn_norm);
    if (c.num_experts > 0) {
      KVFLOW_RETURN_IF_ERROR(ReadExperts(r, c, hf, gg, l));
    } else if (fused) {  // llama.cpp keeps Phi-3's gate|up matrix whole as ffn_up
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "mlp.gate_up_proj.weight", gg + "ffn_up.weight", 2 * F, H, l.w_gate_up));
    } else {
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", F, H, l.w_gate_up));
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", F, H, l.w_gate_up));
    }
    if (c.num_experts == 0) {
      KVFLOW_RETURN_IF_ERROR(r.ReadRows(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", H, F, l.w_down));
    }
    KVFLOW_RETURN_IF_ERROR(ReadBiases(r, c, hf, gg, gguf_rope_permuted, l));
    if (c.qk_norm) {
      const int64_t q_norm = c.qk_norm_per_head ? D : q_rows, k_norm = c.qk_norm_per_head ? D : kv_rows;
      KVFLOW_RETURN_IF_ERROR(r.ReadVector(hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", q_norm, l.q_norm));
      KVFLOW_RETURN_IF_ERROR(r.ReadVector(hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", k_norm, l.k_norm));
      plus_one(l.q_norm);  // Gemma-3's q/k norms are (1 + w) too
      plus_one(l.k_norm);
    }
    if (selected && selection.per_layer) KVFLOW_RETURN_IF_ERROR(selection.per_layer(i, l));
  }
  r.set_skip_data(false);
  if (const std::vector<std::string> unused = r.Unused(); !unused.empty()) {
    std::string names;
    for (size_t i = 0; i < unused.size() && i < 4; ++i) names += (i ? ", " : "") + unused[i];
    if (unused.size() > 4) names += ", ... (" + std::to_string(unused.size()) + " in all)";
    const bool biases = std::any_of(unused.begin(), unused.end(), [](const std::string& n) { return n.ends_with(".bias"); });
    return Status::Unsupported(
        source.Describe() + " has tensors kvflow's Llama does not use (" + names +
        "); running without them would give wrong logits" +
        (biases ? std::string(". Biases are used only where the config declares them (HF attention_bias: q, k, v "
                              "and o_proj together; mlp_bias: gate, up and down_proj together; a GGUF file: "
                              "attn_q/k/v, attn_output or ffn_gate/up/down biases as groups, in every layer)")
                : std::string()));
  }
  if (!r.dequantized_formats().empty()) {
    std::string formats;
    for (const std::string& f : r.dequantized_formats()) formats += (formats.empty() ? "" : ", ") + f;
    spdlog::warn("{} matrices have no quantized kernels yet and were dequantized to fp32", formats);
  }
  spdlog::info("loaded {:.1f}M parameters as {} ({:.0f} MiB) in {:.2f} s", w.num_parameters() / 1e6,
               w.all_f32() ? std::string("fp32") : "kept " + w.layers.front().wqkv.FormatName() + " (embeddings " +
                                                       w.embed.FormatName() + ")",
               w.bytes() / double(1 << 20),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return w;
}

}  // namespace kvflow
