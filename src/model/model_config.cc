#include "model/model_config.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/mapped_file.h"

namespace kvflow {

namespace {

using nlohmann::json;

constexpr const char* kArchitectures =
    "llama, mistral, qwen2, qwen3, phi3, mixtral, qwen2moe, qwen3moe, olmoe, gemma2, gemma3";

bool IsSupportedArchitecture(const std::string& arch) {
  return arch == "llama" || arch == "mistral" || arch == "qwen2" || arch == "qwen3" || arch == "phi3" ||
         arch == "mixtral" || arch == "qwen2moe" || arch == "qwen3moe" || arch == "olmoe" || arch == "gemma2" ||
         arch == "gemma3";
}

// HF's class name of each architecture kvflow runs.
struct HfArchitecture {
  const char* hf;
  const char* arch;
};
constexpr HfArchitecture kHfArchitectures[] = {{"LlamaForCausalLM", "llama"},
                                               {"MistralForCausalLM", "mistral"},
                                               {"Qwen2ForCausalLM", "qwen2"},
                                               {"Qwen3ForCausalLM", "qwen3"},
                                               {"Phi3ForCausalLM", "phi3"},
                                               {"MixtralForCausalLM", "mixtral"},
                                               {"Qwen2MoeForCausalLM", "qwen2moe"},
                                               {"Qwen3MoeForCausalLM", "qwen3moe"},
                                               {"OlmoeForCausalLM", "olmoe"},
                                               {"Gemma2ForCausalLM", "gemma2"},
                                               {"Gemma3ForCausalLM", "gemma3"}};

const char* RopeScalingName(RopeScaling::Type t) {
  switch (t) {
    case RopeScaling::Type::kNone: return "none";
    case RopeScaling::Type::kLinear: return "linear";
    case RopeScaling::Type::kDynamic: return "dynamic";
    case RopeScaling::Type::kLlama3: return "llama3";
    case RopeScaling::Type::kYarn: return "yarn";
    case RopeScaling::Type::kLongRope: return "longrope";
  }
  return "?";
}

// Typed reads of a config.json object; JSON null counts as absent, as it does for HF.
class JsonFields {
 public:
  JsonFields(const json& object, std::string path) : object_(object), path_(std::move(path)) {}

  // Present, null included (HF's null: "off" for some fields, unlike absent: the default).
  bool Has(const char* key) const { return object_.contains(key); }

  const json* Get(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  Status Int(const char* key, int* out, bool required = false) const {
    const json* v = Get(key);
    if (v == nullptr) return required ? Missing(key) : Status::Ok();
    return ToInt(*v, key, out);
  }

  Status Float(const char* key, float* out) const {
    const json* v = Get(key);
    if (v == nullptr) return Status::Ok();
    if (!v->is_number()) return Wrong(key, "a number");
    *out = v->get<float>();
    return Status::Ok();
  }

  Status Bool(const char* key, bool* out) const {
    const json* v = Get(key);
    if (v == nullptr) return Status::Ok();
    if (!v->is_boolean()) return Wrong(key, "a boolean");
    *out = v->get<bool>();
    return Status::Ok();
  }

  // An int or a list of ints (HF allows both for eos_token_id).
  Status IntList(const char* key, std::vector<int>* out) const {
    const json* v = Get(key);
    if (v == nullptr) return Status::Ok();
    out->clear();
    if (!v->is_array()) {
      out->push_back(0);
      return ToInt(*v, key, &out->back());
    }
    for (const json& item : *v) {
      out->push_back(0);
      KVFLOW_RETURN_IF_ERROR(ToInt(item, key, &out->back()));
    }
    return Status::Ok();
  }

  Status ToInt(const json& v, const char* key, int* out) const {
    // Some exporters write integral values as floats (8192.0).
    if (!v.is_number()) return Wrong(key, "an integer");
    double d = v.get<double>();
    if (d != std::floor(d) || d < std::numeric_limits<int>::min() ||
        d > std::numeric_limits<int>::max()) {
      return Wrong(key, "an integer in range");
    }
    *out = static_cast<int>(d);
    return Status::Ok();
  }

  Status Missing(const char* key) const {
    return Status::CorruptFile(path_ + ": required field '" + key + "' is missing");
  }
  Status Wrong(const char* key, const char* expected) const {
    return Status::CorruptFile(path_ + ": field '" + key + "' is not " + expected);
  }

 private:
  const json& object_;
  std::string path_;
};

Status ReadHfRopeScaling(const JsonFields& config, const std::string& path, ModelConfig* out) {
  const json* scaling = config.Get("rope_scaling");
  if (scaling == nullptr) return Status::Ok();
  if (!scaling->is_object()) return config.Wrong("rope_scaling", "an object");
  JsonFields fields(*scaling, path);
  const json* type = fields.Get("rope_type");
  if (type == nullptr) type = fields.Get("type");
  if (type == nullptr || !type->is_string()) {
    return config.Wrong("rope_scaling", "an object with a type");
  }

  RopeScaling& rope = out->rope_scaling;
  const std::string name = type->get<std::string>();
  if (name == "default") return Status::Ok();
  if (name == "linear") {
    rope.type = RopeScaling::Type::kLinear;
  } else if (name == "dynamic") {
    rope.type = RopeScaling::Type::kDynamic;
  } else if (name == "llama3") {
    rope.type = RopeScaling::Type::kLlama3;
  } else if (name == "yarn") {
    rope.type = RopeScaling::Type::kYarn;
  } else if (name == "longrope" && out->architecture == "phi3") {
    rope.type = RopeScaling::Type::kLongRope;
    for (auto [key, factors] : {std::pair<const char*, std::vector<float>*>{"short_factor", &rope.short_factor},
                                {"long_factor", &rope.long_factor}}) {
      const json* list = fields.Get(key);
      if (list == nullptr || !list->is_array()) return config.Wrong("rope_scaling", "longrope with both factor lists");
      for (const json& f : *list) {
        if (!f.is_number()) return config.Wrong("rope_scaling", "longrope factors that are numbers");
        factors->push_back(f.get<float>());
      }
    }
    // Phi-3 keeps the pretrained context beside rope_scaling.
    KVFLOW_RETURN_IF_ERROR(config.Int("original_max_position_embeddings", &rope.original_max_position_embeddings));
  } else {
    return Status::Unsupported(path + ": rope_scaling type '" + name + "' is not supported");
  }

  KVFLOW_RETURN_IF_ERROR(fields.Float("factor", &rope.factor));
  KVFLOW_RETURN_IF_ERROR(fields.Float("low_freq_factor", &rope.low_freq_factor));
  KVFLOW_RETURN_IF_ERROR(fields.Float("high_freq_factor", &rope.high_freq_factor));
  KVFLOW_RETURN_IF_ERROR(fields.Float("beta_fast", &rope.beta_fast));
  KVFLOW_RETURN_IF_ERROR(fields.Float("beta_slow", &rope.beta_slow));
  KVFLOW_RETURN_IF_ERROR(fields.Float("attention_factor", &rope.attention_factor));
  KVFLOW_RETURN_IF_ERROR(
      fields.Int("original_max_position_embeddings", &rope.original_max_position_embeddings));
  // HF's YaRN falls back to the model's own context length.
  if (rope.type == RopeScaling::Type::kYarn && rope.original_max_position_embeddings == 0) {
    rope.original_max_position_embeddings = out->max_position_embeddings;
  }
  // Phi-3's rotary class derives its cos/sin scale itself, ignoring an attention_factor.
  if (rope.type == RopeScaling::Type::kLongRope) rope.attention_factor = 0.0f;
  return Status::Ok();
}

Status CheckHfArchitecture(const JsonFields& config, const std::string& path, ModelConfig* out) {
  if (const json* archs = config.Get("architectures")) {
    if (!archs->is_array()) return config.Wrong("architectures", "a list");
    for (const json& arch : *archs) {
      for (const HfArchitecture& known : kHfArchitectures) {
        if (arch == known.hf) {
          out->architecture = known.arch;
          return Status::Ok();
        }
      }
    }
    std::string known_names;
    for (const HfArchitecture& known : kHfArchitectures) known_names += (known_names.empty() ? "" : ", ") + std::string(known.hf);
    return Status::Unsupported(path + ": architectures " + archs->dump() + " not supported (" + known_names + ")");
  }
  if (const json* model_type = config.Get("model_type")) {
    if (!model_type->is_string() || !IsSupportedArchitecture(model_type->get<std::string>())) {
      return Status::Unsupported(path + ": model_type " + model_type->dump() + " not supported");
    }
    out->architecture = model_type->get<std::string>();
  }
  return Status::Ok();
}

// Gemma-2 (Gemma2ForCausalLM) and Gemma-3's text model (Gemma3ForCausalLM): GeGLU with the tanh
// GELU, sqrt(hidden)-scaled embeddings, (1 + w) norms around attention and MLP both, the softmax
// scale from query_pre_attn_scalar, and a sliding window on all layers but every 2nd (Gemma-2) or
// 6th (Gemma-3). Gemma-2 soft-caps attention scores and logits; Gemma-3 norms q and k per head and
// gives its sliding layers a RoPE base of their own. Both tie their embeddings unless told
// otherwise. The defaults are Gemma2Config's and Gemma3TextConfig's.
Status ReadHfGemmaFields(const JsonFields& fields, const std::string& path, ModelConfig* c) {
  const bool gemma3 = c->architecture == "gemma3";
  for (const char* key : {"hidden_activation", "hidden_act"}) {
    const json* act = fields.Get(key);
    if (act != nullptr && *act != "gelu_pytorch_tanh") {
      return Status::Unsupported(path + ": " + key + " " + act->dump() + " is not supported (gelu_pytorch_tanh)");
    }
  }
  bool attention_bias = false;
  KVFLOW_RETURN_IF_ERROR(fields.Bool("attention_bias", &attention_bias));
  if (attention_bias) return Status::Unsupported(path + ": attention_bias in a " + c->architecture + " model");
  c->mlp_activation = MlpActivation::kGeluTanh;
  c->sandwich_norms = true;
  c->embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(c->hidden_size)));
  float query_pre_attn_scalar = gemma3 ? 256.0f : 224.0f;
  c->attn_logit_softcap = gemma3 ? 0.0f : 50.0f;
  c->final_logit_softcap = gemma3 ? 0.0f : 30.0f;
  int window = 4096;
  int pattern = gemma3 ? 6 : 2;
  if (gemma3) {
    c->qk_norm = true;
    c->qk_norm_per_head = true;
    c->local_rope_theta = 10000.0f;
    KVFLOW_RETURN_IF_ERROR(fields.Float("rope_local_base_freq", &c->local_rope_theta));
    if (!(c->local_rope_theta > 0.0f)) return Status::CorruptFile(path + ": rope_local_base_freq must be positive");
    KVFLOW_RETURN_IF_ERROR(fields.Int("sliding_window_pattern", &pattern));
    if (pattern < 1) return Status::CorruptFile(path + ": sliding_window_pattern must be positive");
    // Newer configs list each layer's kind: kvflow runs the periodic pattern only.
    if (const json* types = fields.Get("layer_types")) {
      if (!types->is_array() || static_cast<int>(types->size()) != c->num_layers) {
        return Status::CorruptFile(path + ": layer_types is not one entry per layer");
      }
      for (int i = 0; i < c->num_layers; ++i) {
        const std::string want = (i + 1) % pattern == 0 ? "full_attention" : "sliding_attention";
        if ((*types)[static_cast<size_t>(i)] != want) {
          return Status::Unsupported(path + ": layer_types other than a full-attention layer every " +
                                     std::to_string(pattern) + " (layer " + std::to_string(i) + ")");
        }
      }
    }
  }
  KVFLOW_RETURN_IF_ERROR(fields.Float("query_pre_attn_scalar", &query_pre_attn_scalar));
  if (!(query_pre_attn_scalar > 0.0f)) return Status::CorruptFile(path + ": query_pre_attn_scalar must be positive");
  c->attention_scale = 1.0f / std::sqrt(query_pre_attn_scalar);
  // null turns a cap off, as in HF.
  for (auto [key, cap] : {std::pair<const char*, float*>{"attn_logit_softcapping", &c->attn_logit_softcap},
                          {"final_logit_softcapping", &c->final_logit_softcap}}) {
    if (fields.Get(key) == nullptr) {
      if (fields.Has(key)) *cap = 0.0f;
      continue;
    }
    KVFLOW_RETURN_IF_ERROR(fields.Float(key, cap));
    if (!(*cap > 0.0f)) return Status::CorruptFile(path + ": " + key + " must be positive");
  }
  if (fields.Get("sliding_window") == nullptr && fields.Has("sliding_window")) window = 0;
  KVFLOW_RETURN_IF_ERROR(fields.Int("sliding_window", &window));
  if (window < 0) return Status::CorruptFile(path + ": negative sliding_window");
  // A window as long as the context changes nothing (Gemma-3's local RoPE base still applies).
  c->sliding_window = window < c->max_position_embeddings ? window : 0;
  c->global_layer_interval = pattern;
  return Status::Ok();
}

// What each family's modeling code takes from its config beyond the Llama shape: which biases the
// projections have, whether q and k are normed, and the activation (every family here: SiLU).
Status ReadHfFamilyFields(const JsonFields& fields, const std::string& path, ModelConfig* c) {
  if (c->architecture == "gemma2" || c->architecture == "gemma3") return ReadHfGemmaFields(fields, path, c);
  const json* act = fields.Get("hidden_act");
  if (act != nullptr && *act != "silu") {
    return Status::Unsupported(path + ": hidden_act " + act->dump() + " is not supported (silu)");
  }
  bool attention_bias = false;
  KVFLOW_RETURN_IF_ERROR(fields.Bool("attention_bias", &attention_bias));
  KVFLOW_RETURN_IF_ERROR(fields.Bool("mlp_bias", &c->mlp_bias));
  if (c->architecture == "llama") {
    // HF Llama: attention_bias puts biases on q, k, v and o_proj, mlp_bias on gate, up and down_proj.
    c->qkv_bias = c->o_bias = attention_bias;
    return Status::Ok();
  }
  if (c->mlp_bias) {
    return Status::Unsupported(path + ": mlp_bias is true, but " + c->architecture + "'s MLP has no biases");
  }
  if (c->architecture == "mixtral") {
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_local_experts", &c->num_experts, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_experts_per_tok", &c->experts_per_token, /*required=*/true));
    c->expert_intermediate_size = c->intermediate_size;
    c->norm_topk_prob = true;  // MixtralSparseMoeBlock renormalizes the top-k always
  } else if (c->architecture == "olmoe") {
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_experts", &c->num_experts, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_experts_per_tok", &c->experts_per_token, /*required=*/true));
    c->expert_intermediate_size = c->intermediate_size;  // OLMoE's experts are intermediate_size wide
    c->norm_topk_prob = false;
    KVFLOW_RETURN_IF_ERROR(fields.Bool("norm_topk_prob", &c->norm_topk_prob));
    if (fields.Get("clip_qkv") != nullptr) {
      return Status::Unsupported(path + ": clip_qkv (q, k and v clamped after the projection) is not supported");
    }
  } else if (c->architecture == "qwen2moe" || c->architecture == "qwen3moe") {
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_experts", &c->num_experts, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_experts_per_tok", &c->experts_per_token, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("moe_intermediate_size", &c->expert_intermediate_size, /*required=*/true));
    c->norm_topk_prob = false;  // both configs' default
    KVFLOW_RETURN_IF_ERROR(fields.Bool("norm_topk_prob", &c->norm_topk_prob));
    if (c->architecture == "qwen2moe") {
      KVFLOW_RETURN_IF_ERROR(fields.Int("shared_expert_intermediate_size", &c->shared_expert_intermediate_size));
    }
    // Every layer sparse: kvflow does not mix dense and sparse layers yet.
    int sparse_step = 1;
    KVFLOW_RETURN_IF_ERROR(fields.Int("decoder_sparse_step", &sparse_step));
    const json* dense_layers = fields.Get("mlp_only_layers");
    if (sparse_step != 1 || (dense_layers != nullptr && !dense_layers->empty())) {
      return Status::Unsupported(path + ": dense MLP layers among the experts (decoder_sparse_step, mlp_only_layers) "
                                 "are not supported yet");
    }
  }
  if (c->architecture == "mistral" || c->architecture == "phi3" || c->architecture == "mixtral") {
    // Their modeling code has no biases whatever the config says: refuse rather than guess.
    if (attention_bias) {
      return Status::Unsupported(path + ": attention_bias is true, but " + c->architecture + "'s projections have no biases");
    }
    if (c->architecture == "phi3") {
      float partial_rotary = 1.0f;
      KVFLOW_RETURN_IF_ERROR(fields.Float("partial_rotary_factor", &partial_rotary));
      if (partial_rotary != 1.0f) {
        return Status::Unsupported(path + ": partial_rotary_factor " + std::to_string(partial_rotary) +
                                   " (RoPE on part of each head, Phi-4-mini) is not supported");
      }
    }
  } else if (c->architecture == "qwen2" || c->architecture == "qwen2moe") {
    c->qkv_bias = true;  // Qwen2's q, k and v projections always have biases, o_proj never
    if (attention_bias) return Status::Unsupported(path + ": attention_bias is not a Qwen2 config field");
  } else if (c->architecture == "qwen3" || c->architecture == "qwen3moe" || c->architecture == "olmoe") {
    c->qkv_bias = c->o_bias = attention_bias;  // q, k, v and o_proj together
    c->qk_norm = true;
    c->qk_norm_per_head = c->architecture != "olmoe";  // OLMoE norms all of q and all of k
  }
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ModelConfigFromHfJson(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  const char* text = reinterpret_cast<const char*>(file->data());
  json root = json::parse(text, text + file->size(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status::CorruptFile(path + ": not a JSON object");
  }

  // nlohmann's get<>() throws on type confusion we did not foresee; keep it inside the module.
  try {
    JsonFields fields(root, path);
    ModelConfig c;
    KVFLOW_RETURN_IF_ERROR(CheckHfArchitecture(fields, path, &c));
    const json* name = fields.Get("_name_or_path");
    c.name = name != nullptr && name->is_string() && !name->get<std::string>().empty()
                 ? name->get<std::string>()
                 : std::filesystem::absolute(path).parent_path().filename().string();
    KVFLOW_RETURN_IF_ERROR(fields.Int("vocab_size", &c.vocab_size, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("hidden_size", &c.hidden_size, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(
        fields.Int("intermediate_size", &c.intermediate_size, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_hidden_layers", &c.num_layers, /*required=*/true));
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_attention_heads", &c.num_heads, /*required=*/true));
    c.num_kv_heads = c.num_heads;
    KVFLOW_RETURN_IF_ERROR(fields.Int("num_key_value_heads", &c.num_kv_heads));
    if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
    KVFLOW_RETURN_IF_ERROR(fields.Int("head_dim", &c.head_dim));
    KVFLOW_RETURN_IF_ERROR(fields.Int("max_position_embeddings", &c.max_position_embeddings));
    c.rms_norm_eps = 1e-6f;  // LlamaConfig's default
    KVFLOW_RETURN_IF_ERROR(fields.Float("rms_norm_eps", &c.rms_norm_eps));
    KVFLOW_RETURN_IF_ERROR(fields.Float("rope_theta", &c.rope_theta));
    KVFLOW_RETURN_IF_ERROR(ReadHfRopeScaling(fields, path, &c));
    c.tie_word_embeddings = c.architecture.starts_with("gemma");  // the families' config defaults
    KVFLOW_RETURN_IF_ERROR(fields.Bool("tie_word_embeddings", &c.tie_word_embeddings));
    KVFLOW_RETURN_IF_ERROR(fields.Int("bos_token_id", &c.bos_token_id));
    KVFLOW_RETURN_IF_ERROR(fields.IntList("eos_token_id", &c.eos_token_ids));

    KVFLOW_RETURN_IF_ERROR(ReadHfFamilyFields(fields, path, &c));
    int sliding_window = 0;
    KVFLOW_RETURN_IF_ERROR(fields.Int("sliding_window", &sliding_window));
    bool use_sliding_window = false;
    KVFLOW_RETURN_IF_ERROR(fields.Bool("use_sliding_window", &use_sliding_window));
    if (c.architecture.starts_with("qwen")) {
      // Qwen2/Qwen3 carry a sliding_window that only use_sliding_window turns on, and then only
      // from layer max_window_layers on in transformers' flash-attention path but on every layer in
      // its eager one: no single reference to be exact against.
      if (use_sliding_window && sliding_window > 0) {
        return Status::Unsupported(path + ": use_sliding_window (Qwen's per-layer sliding window from "
                                   "max_window_layers) is not supported");
      }
    } else if (c.architecture == "mistral" || c.architecture == "mixtral" || c.architecture == "phi3") {
      // Their Hugging Face masks: the query at p sees keys p - sliding_window + 1 .. p. A window at
      // least the context long changes nothing.
      if (sliding_window > 0 && sliding_window < c.max_position_embeddings) c.sliding_window = sliding_window;
    }
    return c;
  } catch (const json::exception& e) {
    return Status::CorruptFile(path + ": " + e.what());
  }
}

Result<ModelConfig> ModelConfigFromGguf(const GgufFile& gguf) {
  ModelConfig c;
  KVFLOW_ASSIGN_OR_RETURN(c.architecture, gguf.GetString("general.architecture"));
  if (!IsSupportedArchitecture(c.architecture)) {
    return Status::Unsupported(gguf.path() + ": architecture '" + c.architecture +
                               "' is not supported (" + kArchitectures + ")");
  }
  const std::string arch = c.architecture + ".";
  auto read_int = [&](const std::string& key, int* out, bool required) -> Status {
    if (!required && !gguf.Has(key)) return Status::Ok();
    KVFLOW_ASSIGN_OR_RETURN(int32_t v, gguf.GetI32(key));
    *out = v;
    return Status::Ok();
  };
  auto read_float = [&](const std::string& key, float* out) -> Status {
    if (!gguf.Has(key)) return Status::Ok();
    KVFLOW_ASSIGN_OR_RETURN(*out, gguf.GetF32(key));
    return Status::Ok();
  };

  if (gguf.Has("general.name")) {
    KVFLOW_ASSIGN_OR_RETURN(c.name, gguf.GetString("general.name"));
  }
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "block_count", &c.num_layers, true));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "embedding_length", &c.hidden_size, true));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "feed_forward_length", &c.intermediate_size, true));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "attention.head_count", &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "attention.head_count_kv", &c.num_kv_heads, false));
  if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "rope.dimension_count", &c.head_dim, false));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "attention.key_length", &c.head_dim, false));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "context_length", &c.max_position_embeddings, false));
  KVFLOW_RETURN_IF_ERROR(read_float(arch + "attention.layer_norm_rms_epsilon", &c.rms_norm_eps));
  KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.freq_base", &c.rope_theta));

  RopeScaling& rope = c.rope_scaling;
  if (gguf.Has(arch + "rope.scaling.type")) {
    KVFLOW_ASSIGN_OR_RETURN(std::string type, gguf.GetString(arch + "rope.scaling.type"));
    if (type == "linear") {
      rope.type = RopeScaling::Type::kLinear;
    } else if (type == "yarn") {
      rope.type = RopeScaling::Type::kYarn;
    } else if (type != "none") {
      return Status::Unsupported(gguf.path() + ": rope scaling type '" + type +
                                 "' is not supported");
    }
    KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.scaling.factor", &rope.factor));
  } else if (gguf.Has(arch + "rope.scale_linear")) {  // the key older converters wrote
    rope.type = RopeScaling::Type::kLinear;
    KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.scale_linear", &rope.factor));
  }
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "rope.scaling.original_context_length",
                                  &rope.original_max_position_embeddings, false));
  KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.scaling.yarn_beta_fast", &rope.beta_fast));
  KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.scaling.yarn_beta_slow", &rope.beta_slow));
  // Phi-3's LongRoPE: llama.cpp's converter stores the factor lists as tensors.
  const TensorInfo* long_factors = gguf.Find("rope_factors_long.weight");
  const TensorInfo* short_factors = gguf.Find("rope_factors_short.weight");
  if (long_factors != nullptr || short_factors != nullptr) {
    if (c.architecture != "phi3") {
      return Status::Unsupported(gguf.path() + ": rope_factors (LongRoPE) in a " + c.architecture + " model");
    }
    if (long_factors == nullptr || short_factors == nullptr) {
      return Status::CorruptFile(gguf.path() + ": LongRoPE needs both rope_factors_long and rope_factors_short");
    }
    rope.type = RopeScaling::Type::kLongRope;
    // The converter writes the cos/sin scale it derived from the HF config.
    KVFLOW_RETURN_IF_ERROR(read_float(arch + "rope.scaling.attn_factor", &rope.attention_factor));
    for (auto [info, out] : {std::pair{long_factors, &rope.long_factor}, std::pair{short_factors, &rope.short_factor}}) {
      if (info->numel() <= 0 || info->numel() > 4096) {
        return Status::CorruptFile(gguf.path() + ": " + info->name + " has " + std::to_string(info->numel()) +
                                   " factors");
      }
      out->resize(static_cast<size_t>(info->numel()));
      KVFLOW_RETURN_IF_ERROR(DequantizeToF32(*info, out->data()));
    }
  }
  if (gguf.Has(arch + "attention.sliding_window")) {
    int window = 0;
    KVFLOW_RETURN_IF_ERROR(read_int(arch + "attention.sliding_window", &window, true));
    // As Hugging Face's mask for the model (llama.cpp runs Phi-3 without its window).
    if (window > 0 && window < c.max_position_embeddings) c.sliding_window = window;
  }
  if (c.architecture == "gemma2" || c.architecture == "gemma3") {
    // As llama.cpp reads Gemma-2 and Gemma-3 (its values where the file has no key). The softmax
    // scale is not in the file: query_pre_attn_scalar is the head size, but hidden / heads for the
    // 27Bs (Gemma-2: 46 layers, Gemma-3: 62). Gemma-3: a global layer every 6, the sliding layers'
    // RoPE base 10000 without scaling, no soft-capping.
    const bool gemma3 = c.architecture == "gemma3";
    c.mlp_activation = MlpActivation::kGeluTanh;
    c.sandwich_norms = true;
    c.embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(c.hidden_size)));
    c.attn_logit_softcap = gemma3 ? 0.0f : 50.0f;
    c.final_logit_softcap = gemma3 ? 0.0f : 30.0f;
    KVFLOW_RETURN_IF_ERROR(read_float(arch + "attn_logit_softcapping", &c.attn_logit_softcap));
    KVFLOW_RETURN_IF_ERROR(read_float(arch + "final_logit_softcapping", &c.final_logit_softcap));
    const bool big = c.num_layers == (gemma3 ? 62 : 46);
    const int scalar = big && c.num_heads > 0 ? c.hidden_size / c.num_heads : c.head_dim;
    if (scalar > 0) c.attention_scale = 1.0f / std::sqrt(static_cast<float>(scalar));
    if (!gguf.Has(arch + "attention.sliding_window") && 4096 < c.max_position_embeddings) c.sliding_window = 4096;
    c.global_layer_interval = gemma3 ? 6 : 2;
    if (gemma3) c.local_rope_theta = 10000.0f;
  }
  if (gguf.Find("rope_freqs.weight") != nullptr) {
    // llama.cpp bakes Llama-3.1 scaling into per-dimension factors that ModelConfig cannot carry;
    // ignoring them would rotate every position wrong.
    return Status::Unsupported(gguf.path() + ": rope_freqs.weight (per-dimension RoPE factors, Llama-3.1 scaling) "
                               "is not supported yet; the safetensors checkpoint with rope_scaling llama3 is");
  }

  if (gguf.Has(arch + "vocab_size")) {
    KVFLOW_RETURN_IF_ERROR(read_int(arch + "vocab_size", &c.vocab_size, true));
  } else if (gguf.Has("tokenizer.ggml.tokens")) {
    KVFLOW_ASSIGN_OR_RETURN(uint64_t n, gguf.GetArrayLength("tokenizer.ggml.tokens"));
    c.vocab_size = static_cast<int>(std::min<uint64_t>(n, std::numeric_limits<int>::max()));
  } else if (const TensorInfo* embedding = gguf.Find("token_embd.weight")) {
    c.vocab_size = static_cast<int>(embedding->shape.front());
  }
  c.tie_word_embeddings = gguf.Find("output.weight") == nullptr;
  // No metadata declares biases: llama.cpp adds each bias tensor it finds. Layer 0 decides for every
  // layer; the weight loader then needs them in all layers (and refuses any it was not told of).
  c.qkv_bias = gguf.Find("blk.0.attn_q.bias") != nullptr;
  c.o_bias = gguf.Find("blk.0.attn_output.bias") != nullptr;
  c.mlp_bias = gguf.Find("blk.0.ffn_gate.bias") != nullptr;
  c.qk_norm = gguf.Find("blk.0.attn_q_norm.weight") != nullptr;
  // llama.cpp writes Mixtral as a llama with experts.
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "expert_count", &c.num_experts, false));
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "expert_used_count", &c.experts_per_token, false));
  c.expert_intermediate_size = c.intermediate_size;
  KVFLOW_RETURN_IF_ERROR(read_int(arch + "expert_feed_forward_length", &c.expert_intermediate_size, false));
  KVFLOW_RETURN_IF_ERROR(
      read_int(arch + "expert_shared_feed_forward_length", &c.shared_expert_intermediate_size, false));
  // llama.cpp's choices for the families without a key for it: Qwen2-MoE keeps the top-k
  // probabilities as they are, Mixtral and Qwen3-MoE renormalize them.
  c.norm_topk_prob = c.architecture != "qwen2moe" && c.architecture != "olmoe";
  if (c.num_experts > 0 && gguf.Find("blk.0.ffn_gate_exps.weight") == nullptr) {
    return Status::Unsupported(gguf.path() + ": a mixture of experts without merged expert tensors (blk.N.ffn_gate_exps; "
                               "older files store one tensor per expert): reconvert it with a current llama.cpp");
  }
  if (c.shared_expert_intermediate_size > 0 && c.architecture != "qwen2moe") {
    return Status::Unsupported(gguf.path() + ": a shared expert in a " + c.architecture + " model");
  }
  for (const char* key : {"expert_shared_count", "expert_gating_func", "expert_weights_norm", "expert_weights_scale",
                          "leading_dense_block_count"}) {
    if (gguf.Has(arch + key)) {
      return Status::Unsupported(gguf.path() + ": " + arch + key +
                                 " (a mixture of experts other than Mixtral's and Qwen's) is not supported yet");
    }
  }
  const bool normed = c.architecture == "qwen3" || c.architecture == "qwen3moe" || c.architecture == "olmoe" ||
                      c.architecture == "gemma3";
  if (normed && !c.qk_norm) {
    return Status::CorruptFile(gguf.path() + ": a " + c.architecture + " model without attn_q_norm.weight");
  }
  c.qk_norm_per_head = c.architecture != "olmoe";
  if (c.qk_norm && !normed) {
    return Status::Unsupported(gguf.path() + ": attn_q_norm.weight in a " + c.architecture + " model");
  }

  KVFLOW_RETURN_IF_ERROR(read_int("tokenizer.ggml.bos_token_id", &c.bos_token_id, false));
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
    int id = -1;
    KVFLOW_RETURN_IF_ERROR(read_int(key, &id, false));
    if (id >= 0 && (c.eos_token_ids.empty() || c.eos_token_ids[0] != id)) {
      c.eos_token_ids.push_back(id);
    }
  }
  return c;
}

Status ModelConfig::Validate() const {
  auto invalid = [](const std::string& what) {
    return Status::InvalidArgument("model config: " + what);
  };
  if (!IsSupportedArchitecture(architecture)) {
    return invalid("architecture '" + architecture + "' is not one of " + kArchitectures);
  }
  const std::pair<const char*, int> sizes[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_layers", num_layers},
      {"num_heads", num_heads},
      {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim},
      {"max_position_embeddings", max_position_embeddings}};
  for (const auto& [name, value] : sizes) {
    if (value <= 0) {
      return invalid(std::string(name) + " must be positive, got " + std::to_string(value));
    }
  }
  if (num_heads % num_kv_heads != 0) {
    return invalid("num_heads " + std::to_string(num_heads) +
                   " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  if (num_experts < 0 || (num_experts > 0 && (experts_per_token < 1 || experts_per_token > num_experts))) {
    return invalid("experts_per_token " + std::to_string(experts_per_token) + " of " + std::to_string(num_experts) +
                   " experts");
  }
  if (num_experts == 0 && (architecture == "mixtral" || architecture.ends_with("moe"))) {
    return invalid("a " + architecture + " model without experts");
  }
  if (num_experts > 0 && expert_intermediate_size <= 0) return invalid("expert_intermediate_size must be positive");
  if (qk_norm && !qk_norm_per_head && num_heads * head_dim != hidden_size) {
    return invalid("a norm over all of q needs heads * head_dim == hidden_size");
  }
  if (shared_expert_intermediate_size < 0) return invalid("shared_expert_intermediate_size must not be negative");
  if (sliding_window < 0 || global_layer_interval < 0) return invalid("sliding_window must not be negative");
  for (const auto& [name, value] : {std::pair<const char*, float>{"attention_scale", attention_scale},
                                    {"attn_logit_softcap", attn_logit_softcap},
                                    {"final_logit_softcap", final_logit_softcap},
                                    {"local_rope_theta", local_rope_theta}}) {
    if (!(value >= 0.0f) || !std::isfinite(value)) return invalid(std::string(name) + " must be finite and not negative");
  }
  if (!(embedding_scale > 0.0f) || !std::isfinite(embedding_scale)) return invalid("embedding_scale must be positive");
  if (head_dim % 2 != 0) {
    return invalid("head_dim " + std::to_string(head_dim) + " is odd; RoPE needs pairs");
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps)) {
    return invalid("rms_norm_eps must be positive");
  }
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) {
    return invalid("rope_theta must be positive");
  }
  if (bos_token_id < -1 || bos_token_id >= vocab_size) {
    return invalid("bos_token_id " + std::to_string(bos_token_id) + " is outside the vocabulary");
  }
  for (int eos : eos_token_ids) {
    if (eos < 0 || eos >= vocab_size) {
      return invalid("eos_token_id " + std::to_string(eos) + " is outside the vocabulary");
    }
  }
  if (vocab_shard_rows < 0 || vocab_shard_first < 0 ||
      (vocab_shard_rows > 0 && int64_t{vocab_shard_first} + vocab_shard_rows > vocab_size)) {
    return invalid("vocabulary shard [" + std::to_string(vocab_shard_first) + ", +" + std::to_string(vocab_shard_rows) +
                   ") is not within the vocabulary of " + std::to_string(vocab_size));
  }
  const RopeScaling& rope = rope_scaling;
  if (rope.type != RopeScaling::Type::kNone && !(rope.factor > 0.0f)) {
    return invalid("rope_scaling factor must be positive");
  }
  if (rope.type == RopeScaling::Type::kLongRope) {
    const size_t half = static_cast<size_t>(head_dim / 2);
    if (rope.short_factor.size() != half || rope.long_factor.size() != half) {
      return invalid("longrope needs head_dim / 2 = " + std::to_string(half) + " short and long factors, got " +
                     std::to_string(rope.short_factor.size()) + " and " + std::to_string(rope.long_factor.size()));
    }
    for (const std::vector<float>* factors : {&rope.short_factor, &rope.long_factor}) {
      for (float f : *factors) {
        if (!(f > 0.0f) || !std::isfinite(f)) return invalid("longrope factors must be positive");
      }
    }
  }
  if (rope.type == RopeScaling::Type::kLlama3 || rope.type == RopeScaling::Type::kYarn ||
      rope.type == RopeScaling::Type::kLongRope) {
    if (rope.original_max_position_embeddings <= 0) {
      return invalid(std::string(RopeScalingName(rope.type)) +
                     " rope_scaling needs original_max_position_embeddings");
    }
  }
  if (rope.type == RopeScaling::Type::kLlama3 &&
      !(rope.low_freq_factor > 0.0f && rope.high_freq_factor > rope.low_freq_factor)) {
    return invalid("llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor");
  }
  return Status::Ok();
}

float ModelConfig::AttentionScale() const {
  return attention_scale > 0.0f ? attention_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

std::string ModelConfig::Describe() const {
  std::ostringstream out;
  out << "model:          " << (name.empty() ? "(unnamed)" : name) << " (" << architecture << ")\n"
      << "layers:         " << num_layers << "\n"
      << "hidden size:    " << hidden_size << " (ffn " << intermediate_size << ")\n"
      << "heads:          " << num_heads << " query, " << num_kv_heads << " key/value, head_dim "
      << head_dim << "\n"
      << "vocab:          " << vocab_size << (tie_word_embeddings ? " (tied embeddings)" : "")
      << "\n"
      << "context:        " << max_position_embeddings << "\n"
      << "rms_norm_eps:   " << rms_norm_eps << "\n"
      << "rope_theta:     " << rope_theta << "\n"
      << "rope_scaling:   " << RopeScalingName(rope_scaling.type);
  switch (rope_scaling.type) {
    case RopeScaling::Type::kNone: break;
    case RopeScaling::Type::kLinear:
    case RopeScaling::Type::kDynamic: out << " factor " << rope_scaling.factor; break;
    case RopeScaling::Type::kLlama3:
      out << " factor " << rope_scaling.factor << ", low/high freq factor "
          << rope_scaling.low_freq_factor << "/" << rope_scaling.high_freq_factor
          << ", original context " << rope_scaling.original_max_position_embeddings;
      break;
    case RopeScaling::Type::kYarn:
      out << " factor " << rope_scaling.factor << ", beta fast/slow " << rope_scaling.beta_fast
          << "/" << rope_scaling.beta_slow << ", original context "
          << rope_scaling.original_max_position_embeddings;
      break;
    case RopeScaling::Type::kLongRope:
      out << ", original context " << rope_scaling.original_max_position_embeddings << ", "
          << (rope_scaling.long_factors ? "long" : "short") << " factors";
      break;
  }
  if (qk_norm) out << "\nq/k norm:       " << (qk_norm_per_head ? "per head" : "over all of q and all of k");
  if (sliding_window > 0) {
    out << "\nsliding window: " << sliding_window << " tokens, "
        << (global_layer_interval > 0 ? "global attention every " + std::to_string(global_layer_interval) + " layers"
                                      : std::string("every layer"));
  }
  if (mlp_activation == MlpActivation::kGeluTanh) out << "\nmlp:            GeGLU (tanh GELU)";
  if (sandwich_norms) out << "\nnorms:          before and after attention and MLP";
  if (attention_scale > 0.0f) out << "\nattn scale:     " << attention_scale;
  if (attn_logit_softcap > 0.0f) out << "\nsoftcap:        attention " << attn_logit_softcap;
  if (final_logit_softcap > 0.0f) out << "\nsoftcap:        logits " << final_logit_softcap;
  if (embedding_scale != 1.0f) out << "\nembed scale:    " << embedding_scale;
  if (local_rope_theta > 0.0f) out << "\nlocal rope:     theta " << local_rope_theta << " on the sliding layers";
  if (num_experts > 0) {
    out << "\nexperts:        " << experts_per_token << " of " << num_experts << " per token, "
        << expert_intermediate_size << " wide" << (norm_topk_prob ? " (weights renormalized)" : "");
    if (shared_expert_intermediate_size > 0) out << ", a shared expert " << shared_expert_intermediate_size << " wide";
  }
  if (qkv_bias || o_bias || mlp_bias) {
    std::string biases;
    if (qkv_bias) biases += " q/k/v";
    if (o_bias) biases += " o";
    if (mlp_bias) biases += " gate/up/down";
    out << "\nbiases:        " << biases;
  }
  out << "\nbos/eos:        " << bos_token_id << " /";
  for (int eos : eos_token_ids) out << " " << eos;
  out << "\n";
  return out.str();
}

}  // namespace kvflow
