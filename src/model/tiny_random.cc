#include "model/tiny_random.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>

#include "model/byte_level.h"
#include "model/random_shape_model.h"

namespace kvflow {
namespace {

// Owns fp32 tensors in memory and serves them through the TensorSource interface.
class InMemoryTensorSource final : public TensorSource {
 public:
  void Add(const std::string& name, std::vector<int64_t> shape, std::vector<float> data) {
    auto& entry = tensors_[name];
    entry.data = std::move(data);
    entry.info.name = name;
    entry.info.dtype = DType::kF32;
    entry.info.shape = std::move(shape);
    entry.info.data = reinterpret_cast<const uint8_t*>(entry.data.data());
    entry.info.nbytes = entry.data.size() * sizeof(float);
    entry.info.file = kTinyRandomName;
  }
  const TensorInfo* Find(const std::string& name) const override {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second.info;
  }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (const auto& [name, _] : tensors_) names.push_back(name);
    return names;
  }
  std::string Describe() const override {
    return "built-in tiny-random model (" + std::to_string(tensors_.size()) + " tensors)";
  }

 private:
  struct Entry {
    std::vector<float> data;
    TensorInfo info;
  };
  std::map<std::string, Entry> tensors_;
};

// Box-Muller over mt19937_64 so the weights are identical on every platform.
class PortableNormal {
 public:
  explicit PortableNormal(uint64_t seed) : rng_(seed) {}
  float operator()(float stddev) {
    const double u1 = (static_cast<double>(rng_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    return static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
  }

 private:
  std::mt19937_64 rng_;
};

}  // namespace

Result<ModelFiles> MakeBuiltInModel(const std::string& name) {
  if (name == kTinyRandomDraftName) return MakeTinyRandomModel(0x6b76666c6f77, 2);
  if (name == kTinyRandomName) return MakeTinyRandomModel();
  if (name == kTinyRandomSlidingWindowName) {
    KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, MakeTinyRandomModel());
    files.config.name = kTinyRandomSlidingWindowName;
    files.config.architecture = "mistral";
    files.config.sliding_window = kTinyRandomSlidingWindow;
    return files;
  }
  if (name == kTinyRandomMoeName) return MakeTinyRandomModel(0x6b76666c6f77, 4, false, false, true);
  if (IsRandomShapeModel(name)) return MakeRandomShapeModel(name);
  return Status::NotFound("no built-in model named " + name);
}

Result<ModelFiles> MakeTinyRandomModel(uint64_t seed, int num_layers, bool biases, bool qk_norm, bool moe) {
  if (num_layers < 1 || num_layers > 4) return Status::InvalidArgument("tiny-random has 1 to 4 layers");
  ModelConfig c;
  c.name = num_layers == 4 ? kTinyRandomName : kTinyRandomDraftName;
  c.vocab_size = 259;  // 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|>
  c.hidden_size = 128;
  c.intermediate_size = 344;
  c.num_layers = num_layers;
  // head_dim 64, as in SmolLM2, so that the CUDA kernels (head_dim 64 / 128) run this model too.
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.tie_word_embeddings = false;
  c.bos_token_id = 256;
  c.eos_token_ids = {256};

  auto source = std::make_unique<InMemoryTensorSource>();
  PortableNormal normal(seed);
  auto random = [&](std::vector<int64_t> shape, float stddev) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(stddev);
    return v;
  };
  auto norm_weight = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = 1.0f + normal(0.1f);
    return v;
  };
  const int64_t H = c.hidden_size, D = c.head_dim, F = c.intermediate_size, V = c.vocab_size;
  source->Add("model.embed_tokens.weight", {V, H}, random({V, H}, 1.0f));
  source->Add("lm_head.weight", {V, H}, random({V, H}, 0.1f));
  source->Add("model.norm.weight", {H}, norm_weight(H));
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const float s = 1.0f / std::sqrt(static_cast<float>(H));
    source->Add(p + "input_layernorm.weight", {H}, norm_weight(H));
    source->Add(p + "post_attention_layernorm.weight", {H}, norm_weight(H));
    source->Add(p + "self_attn.q_proj.weight", {c.num_heads * D, H}, random({c.num_heads * D, H}, 2.0f * s));
    source->Add(p + "self_attn.k_proj.weight", {c.num_kv_heads * D, H}, random({c.num_kv_heads * D, H}, 2.0f * s));
    source->Add(p + "self_attn.v_proj.weight", {c.num_kv_heads * D, H}, random({c.num_kv_heads * D, H}, s));
    source->Add(p + "self_attn.o_proj.weight", {H, c.num_heads * D}, random({H, c.num_heads * D}, s));
    if (moe) continue;  // below, from a stream of its own
    source->Add(p + "mlp.gate_proj.weight", {F, H}, random({F, H}, s));
    source->Add(p + "mlp.up_proj.weight", {F, H}, random({F, H}, s));
    source->Add(p + "mlp.down_proj.weight", {H, F}, random({H, F}, 1.0f / std::sqrt(static_cast<float>(F))));
  }
  if (moe) {
    if (biases) return Status::InvalidArgument("tiny-random-moe has no biases");
    c.name = kTinyRandomMoeName;
    c.architecture = "qwen2moe";
    c.num_experts = 4;
    c.experts_per_token = 2;
    c.expert_intermediate_size = 128;
    c.shared_expert_intermediate_size = 256;
    c.norm_topk_prob = false;
    PortableNormal moe_normal(seed ^ 0x6d6f65);  // "moe"
    auto moe_random = [&](int64_t rows, int64_t cols, float stddev) {
      std::vector<float> v(static_cast<size_t>(rows * cols));
      for (float& x : v) x = moe_normal(stddev);
      return v;
    };
    const int64_t FE = c.expert_intermediate_size, FS = c.shared_expert_intermediate_size;
    const float s = 1.0f / std::sqrt(static_cast<float>(H));
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".mlp.";
      source->Add(p + "gate.weight", {c.num_experts, H}, moe_random(c.num_experts, H, 4.0f * s));
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string x = p + "experts." + std::to_string(e) + ".";
        source->Add(x + "gate_proj.weight", {FE, H}, moe_random(FE, H, s));
        source->Add(x + "up_proj.weight", {FE, H}, moe_random(FE, H, s));
        source->Add(x + "down_proj.weight", {H, FE}, moe_random(H, FE, 1.0f / std::sqrt(static_cast<float>(FE))));
      }
      source->Add(p + "shared_expert.gate_proj.weight", {FS, H}, moe_random(FS, H, s));
      source->Add(p + "shared_expert.up_proj.weight", {FS, H}, moe_random(FS, H, s));
      source->Add(p + "shared_expert.down_proj.weight", {H, FS}, moe_random(H, FS, 1.0f / std::sqrt(static_cast<float>(FS))));
      source->Add(p + "shared_expert_gate.weight", {1, H}, moe_random(1, H, s));
    }
  }
  if (biases) {
    c.qkv_bias = c.o_bias = c.mlp_bias = true;
    PortableNormal bias_normal(seed ^ 0x62696173);  // "bias"
    auto random_bias = [&](int64_t n, float stddev) {
      std::vector<float> v(static_cast<size_t>(n));
      for (float& x : v) x = bias_normal(stddev);
      return v;
    };
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      source->Add(p + "self_attn.q_proj.bias", {c.num_heads * D}, random_bias(c.num_heads * D, 0.5f));
      source->Add(p + "self_attn.k_proj.bias", {c.num_kv_heads * D}, random_bias(c.num_kv_heads * D, 0.5f));
      source->Add(p + "self_attn.v_proj.bias", {c.num_kv_heads * D}, random_bias(c.num_kv_heads * D, 0.5f));
      source->Add(p + "self_attn.o_proj.bias", {H}, random_bias(H, 0.2f));
      source->Add(p + "mlp.gate_proj.bias", {F}, random_bias(F, 0.5f));
      source->Add(p + "mlp.up_proj.bias", {F}, random_bias(F, 0.5f));
      source->Add(p + "mlp.down_proj.bias", {H}, random_bias(H, 0.2f));
    }
  }

  if (qk_norm) {
    c.architecture = "qwen3";
    c.qk_norm = true;
    PortableNormal norm_normal(seed ^ 0x716b6e6f726d);  // "qknorm"
    auto qk_weight = [&]() {
      std::vector<float> v(static_cast<size_t>(D));
      for (float& x : v) x = 1.0f + norm_normal(0.3f);
      return v;
    };
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      source->Add(p + "self_attn.q_norm.weight", {D}, qk_weight());
      source->Add(p + "self_attn.k_norm.weight", {D}, qk_weight());
    }
  }

  TokenizerSpec spec;
  spec.pre = "gpt2";
  for (int b = 0; b < 256; ++b) spec.tokens.push_back(ByteLevelSpelling(static_cast<uint8_t>(b)));
  spec.token_types.assign(256, 1);
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    spec.tokens.push_back(special);
    spec.token_types.push_back(3);
  }
  spec.bos_id = 256;
  spec.eos_id = 256;
  spec.add_bos = true;
  spec.chat_template = "chatml";

  ModelFiles files;
  files.config = c;
  files.tensors = std::move(source);
  KVFLOW_ASSIGN_OR_RETURN(files.tokenizer, Tokenizer::FromSpec(std::move(spec)));
  return files;
}

}  // namespace kvflow
