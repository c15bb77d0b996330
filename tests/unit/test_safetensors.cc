#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "model/model_config.h"
#include "model/safetensors.h"
#include "model/tensor_source.h"
#include "model_file_writers.h"

namespace kvflow {
namespace {

using nlohmann::json;
using test::Bytes;
using test::SafetensorsWriter;

std::vector<float> Dequantize(const TensorInfo& info) {
  std::vector<float> out(info.numel());
  Status st = DequantizeToF32(info, out.data());
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

struct SampleTensors {
  std::vector<float> f32 = test::RandomFloats(6, 20);
  std::vector<float> f16 = test::RandomFloats(12, 21);
  std::vector<float> bf16 = test::RandomFloats(5, 22);

  SafetensorsWriter Writer() const {
    std::vector<uint16_t> f16_bits, bf16_bits;
    for (float f : f16) f16_bits.push_back(test::FloatToHalfBits(f));
    for (float f : bf16) bf16_bits.push_back(test::FloatToBf16Bits(f));
    SafetensorsWriter w;
    w.SetMetadata("format", "pt");
    w.AddTensor("model.norm.weight", "F32", {6}, test::ToBytes(f32));
    w.AddTensor("model.layers.0.mlp.up_proj.weight", "F16", {3, 4}, test::ToBytes(f16_bits));
    w.AddTensor("lm_head.weight", "BF16", {5, 1}, test::ToBytes(bf16_bits));
    return w;
  }
};

class SafetensorsTest : public ::testing::Test {
 protected:
  std::string Write(const Bytes& bytes, const std::string& name = "") {
    std::string path =
        dir_.File(name.empty() ? "model" + std::to_string(files_++) + ".safetensors" : name);
    test::WriteFile(path, bytes);
    return path;
  }

  // Opening must fail with `code`; returns the message, which must name the file.
  std::string ExpectFailure(const Bytes& bytes, StatusCode code) {
    return test::ExpectOpenFailure(Write(bytes), code,
                                   [](const std::string& p) { return SafetensorsSource::OpenFile(p); });
  }

  // Tampers with one field of one tensor's header entry.
  Bytes WithEntryField(const std::string& tensor, const std::string& field, json value) {
    SafetensorsWriter w = SampleTensors().Writer();
    w.header()[tensor][field] = std::move(value);
    return w.Build();
  }

  test::ScratchDir dir_{"safetensors"};
  int files_ = 0;
};

TEST_F(SafetensorsTest, RoundTripsTensors) {
  SampleTensors sample;
  std::string path = Write(sample.Writer().Build());
  Result<std::unique_ptr<SafetensorsSource>> opened = SafetensorsSource::OpenFile(path);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  const SafetensorsSource& s = **opened;
  EXPECT_EQ(s.Names().size(), 3u);  // __metadata__ is not a tensor
  EXPECT_EQ(s.Find("__metadata__"), nullptr);
  EXPECT_NE(s.Describe().find("3 tensors"), std::string::npos) << s.Describe();

  const TensorInfo* norm = s.Find("model.norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype, DType::kF32);
  EXPECT_EQ(norm->shape, (std::vector<int64_t>{6}));
  EXPECT_EQ(norm->file, path);
  EXPECT_EQ(Dequantize(*norm), sample.f32);

  const TensorInfo* up = s.Find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->dtype, DType::kF16);
  EXPECT_EQ(up->shape, (std::vector<int64_t>{3, 4}));
  std::vector<float> f16 = Dequantize(*up);
  for (size_t i = 0; i < f16.size(); ++i) {
    EXPECT_EQ(f16[i], test::HalfBitsToFloat(test::FloatToHalfBits(sample.f16[i])));
  }

  const TensorInfo* head = s.Find("lm_head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->dtype, DType::kBF16);
  EXPECT_EQ(head->shape, (std::vector<int64_t>{5, 1}));
  std::vector<float> bf16 = Dequantize(*head);
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(bf16[i], test::Bf16BitsToFloat(test::FloatToBf16Bits(sample.bf16[i])));
  }
}

TEST_F(SafetensorsTest, EveryTruncationFailsCleanly) {
  Bytes full = SampleTensors().Writer().Build();
  for (size_t cut = 0; cut < full.size(); ++cut) {
    SCOPED_TRACE("truncated to " + std::to_string(cut) + " bytes");
    ExpectFailure(Bytes(full.begin(), full.begin() + cut), StatusCode::kCorruptFile);
  }
}

TEST_F(SafetensorsTest, RejectsBadHeaders) {
  SafetensorsWriter w = SampleTensors().Writer();
  Bytes huge_length = w.Build();
  uint64_t length = uint64_t{1} << 62;
  std::memcpy(huge_length.data(), &length, sizeof(length));
  ExpectFailure(huge_length, StatusCode::kCorruptFile);
  ExpectFailure(w.BuildWith("{\"a\": {\"dtype\": "), StatusCode::kCorruptFile);
  ExpectFailure(w.BuildWith("[1, 2, 3]"), StatusCode::kCorruptFile);
  ExpectFailure(w.BuildWith("{\"a\": 5}"), StatusCode::kCorruptFile);
  ExpectFailure(w.BuildWith("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}"),
                StatusCode::kCorruptFile);
  ExpectFailure(Bytes{1, 2, 3}, StatusCode::kCorruptFile);
}

TEST_F(SafetensorsTest, RejectsInconsistentEntries) {
  const std::string norm = "model.norm.weight";
  std::string message =
      ExpectFailure(WithEntryField(norm, "data_offsets", {0, 1u << 30}), StatusCode::kCorruptFile);
  EXPECT_NE(message.find(norm), std::string::npos) << message;
  ExpectFailure(WithEntryField(norm, "data_offsets", {8, 4}), StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "data_offsets", {-4, 20}), StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "data_offsets", {0, 20}),
                StatusCode::kCorruptFile);  // 5 floats, shape 6
  ExpectFailure(WithEntryField(norm, "shape", {7}), StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "shape", {-6}), StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "shape", {1.5}), StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "shape", {uint64_t{1} << 40, uint64_t{1} << 40}),
                StatusCode::kCorruptFile);
  ExpectFailure(WithEntryField(norm, "dtype", 4), StatusCode::kCorruptFile);
  // Two tensors claiming the same bytes.
  SafetensorsWriter w = SampleTensors().Writer();
  w.header()["model.norm.weight"]["data_offsets"] = w.header()["lm_head.weight"]["data_offsets"];
  w.header()["model.norm.weight"]["shape"] = {2};
  ExpectFailure(w.Build(), StatusCode::kCorruptFile);
}

TEST_F(SafetensorsTest, RefusesUnsupportedDtypes) {
  SafetensorsWriter w;
  w.AddTensor("position_ids", "I64", {2}, Bytes(16, 1));
  std::string message = ExpectFailure(w.Build(), StatusCode::kUnsupported);
  EXPECT_NE(message.find("position_ids"), std::string::npos) << message;
  EXPECT_NE(message.find("I64"), std::string::npos) << message;
}

// ---- sharded checkpoints ----------------------------------------------------------------------

class SafetensorsShardsTest : public SafetensorsTest {
 protected:
  // Two shards: "a" and "b" in the first, "c" in the second.
  void SetUp() override {
    SafetensorsWriter first, second;
    first.AddTensor("a", "F32", {2}, test::ToBytes(a_));
    first.AddTensor("b", "F32", {1}, test::ToBytes(test::RandomFloats(1, 31)));
    second.AddTensor("c", "F32", {3}, test::ToBytes(c_));
    Write(first.Build(), "model-00001-of-00002.safetensors");
    Write(second.Build(), "model-00002-of-00002.safetensors");
    index_ = {{"metadata", {{"total_size", 24}}},
              {"weight_map",
               {{"a", "model-00001-of-00002.safetensors"},
                {"b", "model-00001-of-00002.safetensors"},
                {"c", "model-00002-of-00002.safetensors"}}}};
  }

  Result<std::unique_ptr<SafetensorsSource>> OpenIndex(const json& index) {
    test::WriteFile(index_path_, index.dump());
    return SafetensorsSource::OpenIndex(index_path_);
  }

  std::vector<float> a_ = test::RandomFloats(2, 30);
  std::vector<float> c_ = test::RandomFloats(3, 32);
  json index_;
  std::string index_path_ = dir_.File("model.safetensors.index.json");
};

TEST_F(SafetensorsShardsTest, OpensAllShards) {
  Result<std::unique_ptr<SafetensorsSource>> s = OpenIndex(index_);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->Names().size(), 3u);
  EXPECT_NE((*s)->Describe().find("2 shards"), std::string::npos) << (*s)->Describe();
  EXPECT_EQ(Dequantize(*(*s)->Find("a")), a_);
  EXPECT_EQ(Dequantize(*(*s)->Find("c")), c_);
  EXPECT_EQ((*s)->Find("c")->file, dir_.File("model-00002-of-00002.safetensors"));
}

TEST_F(SafetensorsShardsTest, RejectsBrokenIndexes) {
  json missing_shard = index_;
  missing_shard["weight_map"]["d"] = "model-00003-of-00003.safetensors";
  Status st = OpenIndex(missing_shard).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("model-00003-of-00003.safetensors"), std::string::npos)
      << st.message();

  json wrong_shard = index_;
  wrong_shard["weight_map"]["c"] = "model-00001-of-00002.safetensors";
  st = OpenIndex(wrong_shard).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile) << st.ToString();
  EXPECT_NE(st.message().find("'c'"), std::string::npos) << st.message();

  json escaping = index_;
  escaping["weight_map"]["c"] = "../model-00002-of-00002.safetensors";
  EXPECT_EQ(OpenIndex(escaping).status().code(), StatusCode::kCorruptFile);

  EXPECT_EQ(OpenIndex(json{{"metadata", {}}}).status().code(), StatusCode::kCorruptFile);
  EXPECT_EQ(OpenIndex(json{{"weight_map", {{"a", 3}}}}).status().code(), StatusCode::kCorruptFile);
  test::WriteFile(index_path_, std::string("{ not json"));
  st = SafetensorsSource::OpenIndex(index_path_).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile);
  EXPECT_NE(st.message().find(index_path_), std::string::npos);
}

// ---- config.json ------------------------------------------------------------------------------

json LlamaConfigJson() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 64},
          {"intermediate_size", 160},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 2},
          {"vocab_size", 100},
          {"max_position_embeddings", 131072},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"rope_scaling",
           {{"rope_type", "llama3"},
            {"factor", 8.0},
            {"low_freq_factor", 1.0},
            {"high_freq_factor", 4.0},
            {"original_max_position_embeddings", 8192}}},
          {"tie_word_embeddings", true},
          {"bos_token_id", 1},
          {"eos_token_id", {2, 3}},
          {"head_dim", nullptr}};
}

class ModelConfigTest : public ::testing::Test {
 protected:
  Result<ModelConfig> Parse(const json& config) {
    test::WriteFile(path_, config.dump());
    return ModelConfigFromHfJson(path_);
  }
  test::ScratchDir dir_{"config"};
  std::string path_ = dir_.File("config.json");
};

TEST_F(ModelConfigTest, ReadsLlamaConfig) {
  Result<ModelConfig> c = Parse(LlamaConfigJson());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "llama");
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 160);
  EXPECT_EQ(c->num_layers, 2);
  EXPECT_EQ(c->num_heads, 8);
  EXPECT_EQ(c->num_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 8);  // null head_dim: hidden / heads
  EXPECT_EQ(c->vocab_size, 100);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 8.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c->rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{2, 3}));
  EXPECT_TRUE(c->Validate().ok()) << c->Validate().ToString();
  std::string description = c->Describe();
  EXPECT_NE(description.find("llama3"), std::string::npos) << description;
  EXPECT_NE(description.find("8 query, 2 key/value"), std::string::npos) << description;
}

TEST_F(ModelConfigTest, AppliesDefaultsAndVariants) {
  json config = LlamaConfigJson();
  for (const char* key : {"num_key_value_heads", "rope_scaling", "tie_word_embeddings",
                          "rope_theta", "max_position_embeddings", "bos_token_id"}) {
    config.erase(key);
  }
  config["architectures"] = {"MistralForCausalLM"};
  config["head_dim"] = 16;
  config["eos_token_id"] = 2;
  Result<ModelConfig> c = Parse(config);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "mistral");
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{2}));

  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_EQ(Parse(config)->rope_scaling.type, RopeScaling::Type::kLinear);
  config["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  EXPECT_EQ(Parse(config)->rope_scaling.type, RopeScaling::Type::kDynamic);
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"beta_fast", 16.0}};
  c = Parse(config);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_FLOAT_EQ(c->rope_scaling.beta_fast, 16.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 2048);
  config["rope_scaling"] = {{"rope_type", "longrope"}};
  EXPECT_EQ(Parse(config).status().code(), StatusCode::kUnsupported);
}

// HF Llama's bias flags: attention_bias puts biases on q, k, v and o_proj, mlp_bias on gate, up and
// down_proj. What kvflow's Llama would compute wrong is refused.
TEST_F(ModelConfigTest, BiasFlagsAndTheSlidingWindow) {
  Result<ModelConfig> plain = Parse(LlamaConfigJson());
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->qkv_bias || plain->o_bias || plain->mlp_bias);
  for (const char* flag : {"attention_bias", "mlp_bias"}) {
    json config = LlamaConfigJson();
    config[flag] = true;
    Result<ModelConfig> c = Parse(config);
    ASSERT_TRUE(c.ok()) << flag << ": " << c.status().ToString();
    const bool attention = std::string(flag) == "attention_bias";
    EXPECT_EQ(c->qkv_bias, attention) << flag;
    EXPECT_EQ(c->o_bias, attention) << flag;
    EXPECT_EQ(c->mlp_bias, !attention) << flag;
    EXPECT_NE(c->Describe().find(attention ? "biases:         q/k/v o" : "biases:         gate/up/down"),
              std::string::npos)
        << c->Describe();
    config[flag] = "yes";
    EXPECT_EQ(Parse(config).status().code(), StatusCode::kCorruptFile) << flag;
    // Mistral's modeling code has no biases: a config that asks for them is refused, not guessed.
    config[flag] = true;
    config["architectures"] = {"MistralForCausalLM"};
    const Status st = Parse(config).status();
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << flag;
    EXPECT_NE(st.message().find(flag), std::string::npos) << st.message();
  }
  // A sliding window is Mistral's (and Phi-3's, Mixtral's) attention, masked per query; the context
  // stays the model's. Hugging Face's Llama has no window: the field is ignored there, as it does.
  json mistral = LlamaConfigJson();
  mistral["sliding_window"] = 4096;
  Result<ModelConfig> c = Parse(mistral);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->sliding_window, 0) << "LlamaForCausalLM has no sliding window";
  mistral["architectures"] = {"MistralForCausalLM"};
  c = Parse(mistral);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_EQ(c->max_position_embeddings, LlamaConfigJson()["max_position_embeddings"].get<int>());
  EXPECT_NE(c->Describe().find("sliding window: 4096 tokens"), std::string::npos) << c->Describe();
  mistral["sliding_window"] = c->max_position_embeddings;  // a window as long as the context: none
  EXPECT_EQ(Parse(mistral)->sliding_window, 0);
  // Qwen's per-layer window (use_sliding_window from max_window_layers) is refused.
  json qwen = LlamaConfigJson();
  qwen["architectures"] = {"Qwen2ForCausalLM"};
  qwen["sliding_window"] = 4096;
  qwen["use_sliding_window"] = true;
  EXPECT_EQ(Parse(qwen).status().code(), StatusCode::kUnsupported);
}

// Qwen2: q/k/v biases always (no flag), no o bias; a sliding_window that use_sliding_window leaves
// off. Qwen3: per-head q/k norms, attention_bias for q/k/v/o together. Phi-3 below. Other
// families' flags, and what kvflow does not implement, are refused.
TEST_F(ModelConfigTest, FamiliesTakeTheirOwnFields) {
  json qwen2 = LlamaConfigJson();
  qwen2["architectures"] = {"Qwen2ForCausalLM"};
  qwen2["sliding_window"] = 256;
  qwen2["use_sliding_window"] = false;
  Result<ModelConfig> c = Parse(qwen2);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "qwen2");
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias || c->mlp_bias || c->qk_norm);
  EXPECT_EQ(c->max_position_embeddings, 131072) << "the window is off";
  qwen2["attention_bias"] = true;
  EXPECT_EQ(Parse(qwen2).status().code(), StatusCode::kUnsupported);

  json qwen3 = LlamaConfigJson();
  qwen3["architectures"] = {"Qwen3ForCausalLM"};
  c = Parse(qwen3);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "qwen3");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias || c->o_bias);
  EXPECT_NE(c->Describe().find("q/k norm"), std::string::npos) << c->Describe();
  qwen3["attention_bias"] = true;
  c = Parse(qwen3);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qkv_bias && c->o_bias);
  qwen3["mlp_bias"] = true;
  EXPECT_EQ(Parse(qwen3).status().code(), StatusCode::kUnsupported);

  // Phi-3: fused projections (read whole by the loader), no biases, RoPE on whole heads only;
  // partial rotary factors and biases are refused.
  json phi3 = LlamaConfigJson();
  phi3["architectures"] = {"Phi3ForCausalLM"};
  phi3.erase("rope_scaling");
  phi3["sliding_window"] = 2047;
  c = Parse(phi3);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "phi3");
  EXPECT_EQ(c->sliding_window, 2047) << "HF Phi-3 masks to its window";
  EXPECT_EQ(c->max_position_embeddings, 131072) << "the window is a mask, not the context";
  for (const auto& [key, value] : {std::pair<const char*, json>{"partial_rotary_factor", 0.75},
                                   {"attention_bias", true},
                                   {"attention_bias", true}}) {
    json bad = phi3;
    bad[key] = value;
    const Status refused_phi3 = Parse(bad).status();
    EXPECT_EQ(refused_phi3.code(), StatusCode::kUnsupported) << key;
  }
  // LongRoPE: both factor lists, head_dim / 2 long, and the original context beside them.
  json longrope = phi3;
  const int half = 64 / 8 / 2;  // hidden_size / heads / 2
  longrope["original_max_position_embeddings"] = 4096;
  longrope["rope_scaling"] = {{"type", "longrope"},
                              {"short_factor", std::vector<float>(static_cast<size_t>(half), 1.0f)},
                              {"long_factor", std::vector<float>(static_cast<size_t>(half), 4.0f)}};
  c = Parse(longrope);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLongRope);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_TRUE(c->rope_scaling.long_factors);
  longrope["rope_scaling"]["long_factor"] = {1.0, 2.0};
  c = Parse(longrope);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->Validate().code(), StatusCode::kInvalidArgument) << "too few long factors";
  longrope["rope_scaling"].erase("long_factor");
  EXPECT_FALSE(Parse(longrope).ok()) << "no long factors";

  // Mixtral: num_local_experts and num_experts_per_tok are required, the top-k renormalized.
  json mixtral = LlamaConfigJson();
  mixtral["architectures"] = {"MixtralForCausalLM"};
  mixtral["num_local_experts"] = 8;
  mixtral["num_experts_per_tok"] = 2;
  c = Parse(mixtral);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "mixtral");
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->experts_per_token, 2);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_NE(c->Describe().find("2 of 8 per token"), std::string::npos) << c->Describe();
  mixtral["num_experts_per_tok"] = 9;
  EXPECT_FALSE(Parse(mixtral)->Validate().ok());
  mixtral.erase("num_local_experts");
  EXPECT_EQ(Parse(mixtral).status().code(), StatusCode::kCorruptFile);

  // Qwen2-MoE / Qwen3-MoE: experts of moe_intermediate_size, norm_topk_prob as configured (default
  // off), Qwen2-MoE's shared expert; dense layers among the experts are refused.
  json qwen_moe = LlamaConfigJson();
  qwen_moe["architectures"] = {"Qwen2MoeForCausalLM"};
  qwen_moe["num_experts"] = 60;
  qwen_moe["num_experts_per_tok"] = 4;
  qwen_moe["moe_intermediate_size"] = 1408;
  qwen_moe["shared_expert_intermediate_size"] = 5632;
  c = Parse(qwen_moe);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "qwen2moe");
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_EQ(c->expert_intermediate_size, 1408);
  EXPECT_EQ(c->shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_NE(c->Describe().find("a shared expert 5632 wide"), std::string::npos) << c->Describe();
  qwen_moe["architectures"] = {"Qwen3MoeForCausalLM"};
  qwen_moe["norm_topk_prob"] = true;
  qwen_moe.erase("shared_expert_intermediate_size");
  c = Parse(qwen_moe);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->qk_norm && c->norm_topk_prob);
  EXPECT_EQ(c->shared_expert_intermediate_size, 0);
  for (const auto& [key, value] : {std::pair<const char*, json>{"mlp_only_layers", json::array({0})},
                                   {"decoder_sparse_step", 2}}) {
    json mixed = qwen_moe;
    mixed[key] = value;
    EXPECT_EQ(Parse(mixed).status().code(), StatusCode::kUnsupported) << key;
  }

  // OLMoE: experts of intermediate_size, one norm over all of q and one over all of k.
  json olmoe = LlamaConfigJson();
  olmoe["architectures"] = {"OlmoeForCausalLM"};
  olmoe["num_experts"] = 64;
  olmoe["num_experts_per_tok"] = 8;
  c = Parse(olmoe);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "olmoe");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qk_norm_per_head);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_EQ(c->expert_intermediate_size, c->intermediate_size);
  EXPECT_NE(c->Describe().find("over all of q"), std::string::npos) << c->Describe();
  olmoe["clip_qkv"] = 8.0;
  EXPECT_EQ(Parse(olmoe).status().code(), StatusCode::kUnsupported);

  json gelu = LlamaConfigJson();
  gelu["hidden_act"] = "gelu_pytorch_tanh";
  const Status st = Parse(gelu).status();
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("gelu_pytorch_tanh"), std::string::npos) << st.message();

  json deepseek = LlamaConfigJson();
  deepseek["architectures"] = {"DeepseekV3ForCausalLM"};
  const Status refused = Parse(deepseek).status();
  EXPECT_EQ(refused.code(), StatusCode::kUnsupported);
  EXPECT_NE(refused.message().find("Gemma2ForCausalLM"), std::string::npos) << "names what it runs: " << refused.message();
}

// Gemma-2: Gemma2Config's defaults where the file is silent (tied embeddings, caps of 50 and 30, a
// 4096 window on the even layers, query_pre_attn_scalar 224), null turning a cap or the window off,
// and only its own activation.
TEST_F(ModelConfigTest, Gemma2TakesItsConfigAndDefaults) {
  json gemma = LlamaConfigJson();
  gemma["architectures"] = {"Gemma2ForCausalLM"};
  gemma.erase("tie_word_embeddings");
  gemma.erase("rope_scaling");
  gemma["head_dim"] = 256;
  gemma["hidden_activation"] = "gelu_pytorch_tanh";
  Result<ModelConfig> c = Parse(gemma);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "gemma2");
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_TRUE(c->sandwich_norms);
  EXPECT_EQ(c->mlp_activation, MlpActivation::kGeluTanh);
  EXPECT_FLOAT_EQ(c->embedding_scale, std::sqrt(static_cast<float>(c->hidden_size)));
  EXPECT_FLOAT_EQ(c->AttentionScale(), 1.0f / std::sqrt(224.0f));
  EXPECT_EQ(c->attn_logit_softcap, 50.0f);
  EXPECT_EQ(c->final_logit_softcap, 30.0f);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_EQ(c->LayerWindow(0), 4096);
  EXPECT_EQ(c->LayerWindow(1), 0) << "odd layers attend globally";
  EXPECT_EQ(c->ReleasableWindow(), 0) << "global layers need every block";
  EXPECT_NE(c->Describe().find("GeGLU"), std::string::npos) << c->Describe();

  gemma["attn_logit_softcapping"] = nullptr;
  gemma["sliding_window"] = nullptr;
  gemma["query_pre_attn_scalar"] = 144;
  c = Parse(gemma);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->attn_logit_softcap, 0.0f);
  EXPECT_EQ(c->final_logit_softcap, 30.0f);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->LayerWindow(0), 0);
  EXPECT_FLOAT_EQ(c->AttentionScale(), 1.0f / 12.0f);

  for (const auto& [key, value] : {std::pair<const char*, json>{"hidden_activation", "gelu"},
                                   {"attention_bias", true},
                                   {"final_logit_softcapping", -1.0},
                                   {"query_pre_attn_scalar", 0}}) {
    json bad = gemma;
    bad[key] = value;
    EXPECT_FALSE(Parse(bad).ok()) << key;
  }
}

// Gemma-3's text model: q/k norms per head, a global layer every 6 (or as layer_types lists them,
// if periodic), the sliding layers' own RoPE base, no soft-capping by default.
TEST_F(ModelConfigTest, Gemma3TakesItsConfigAndDefaults) {
  json gemma = LlamaConfigJson();
  gemma["architectures"] = {"Gemma3ForCausalLM"};
  gemma["model_type"] = "gemma3_text";
  gemma.erase("rope_scaling");
  gemma["num_hidden_layers"] = 12;
  gemma["sliding_window"] = 512;
  gemma["rope_theta"] = 1000000.0;
  gemma["rope_local_base_freq"] = 10000.0;
  gemma["attn_logit_softcapping"] = nullptr;
  gemma["final_logit_softcapping"] = nullptr;
  Result<ModelConfig> c = Parse(gemma);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "gemma3");
  EXPECT_TRUE(c->qk_norm && c->qk_norm_per_head && c->sandwich_norms && c->tie_word_embeddings);
  EXPECT_EQ(c->attn_logit_softcap, 0.0f);
  EXPECT_EQ(c->final_logit_softcap, 0.0f);
  EXPECT_EQ(c->local_rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(c->AttentionScale(), 1.0f / 16.0f) << "query_pre_attn_scalar defaults to 256";
  for (int layer = 0; layer < 12; ++layer) {
    EXPECT_EQ(c->IsGlobalLayer(layer), layer == 5 || layer == 11) << layer;
    EXPECT_EQ(c->LayerWindow(layer), c->IsGlobalLayer(layer) ? 0 : 512) << layer;
  }
  json types = json::array();
  for (int layer = 0; layer < 12; ++layer) types.push_back((layer + 1) % 6 ? "sliding_attention" : "full_attention");
  gemma["layer_types"] = types;
  EXPECT_TRUE(Parse(gemma).ok());
  gemma["layer_types"][3] = "full_attention";
  EXPECT_EQ(Parse(gemma).status().code(), StatusCode::kUnsupported);
}

TEST_F(ModelConfigTest, RejectsBadConfigs) {
  json other = LlamaConfigJson();
  other["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_EQ(Parse(other).status().code(), StatusCode::kUnsupported);

  json missing = LlamaConfigJson();
  missing.erase("hidden_size");
  Status st = Parse(missing).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile);
  EXPECT_NE(st.message().find("hidden_size"), std::string::npos) << st.message();

  json wrong_type = LlamaConfigJson();
  wrong_type["num_hidden_layers"] = "two";
  EXPECT_EQ(Parse(wrong_type).status().code(), StatusCode::kCorruptFile);
  wrong_type["num_hidden_layers"] = 2.5;
  EXPECT_EQ(Parse(wrong_type).status().code(), StatusCode::kCorruptFile);

  test::WriteFile(path_, std::string("{\"hidden_size\": "));
  st = ModelConfigFromHfJson(path_).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile);
  EXPECT_NE(st.message().find(path_), std::string::npos);
  EXPECT_EQ(ModelConfigFromHfJson(dir_.File("absent.json")).status().code(), StatusCode::kNotFound);
}

TEST_F(ModelConfigTest, ValidateCatchesInconsistencies) {
  ModelConfig c = Parse(LlamaConfigJson()).value();
  ASSERT_TRUE(c.Validate().ok());
  ModelConfig bad = c;
  bad.num_kv_heads = 3;
  EXPECT_EQ(bad.Validate().code(), StatusCode::kInvalidArgument);
  bad = c;
  bad.num_layers = 0;
  EXPECT_NE(bad.Validate().message().find("num_layers"), std::string::npos);
  bad = c;
  bad.eos_token_ids = {100};
  EXPECT_FALSE(bad.Validate().ok());
  bad = c;
  bad.rope_scaling.high_freq_factor = 0.5f;
  EXPECT_FALSE(bad.Validate().ok());
  bad = c;
  bad.rms_norm_eps = 0;
  EXPECT_FALSE(bad.Validate().ok());
}

// ---- OpenModelFiles on Hugging Face layouts
// -------------------------------------------------------

class SafetensorsModelDirTest : public ::testing::Test {
 protected:
  void WriteCheckpoint(bool sharded) {
    json config = LlamaConfigJson();
    config["vocab_size"] = 16;
    config["hidden_size"] = 8;
    config["num_attention_heads"] = 2;
    config["num_key_value_heads"] = 1;
    test::WriteFile(dir_.File("config.json"), config.dump());
    SafetensorsWriter w;
    w.AddTensor("model.embed_tokens.weight", "F32", {16, 8},
                test::ToBytes(test::RandomFloats(128, 40)));
    if (!sharded) {
      test::WriteFile(dir_.File("model.safetensors"), w.Build());
      return;
    }
    test::WriteFile(dir_.File("shard.safetensors"), w.Build());
    json index = {{"weight_map", {{"model.embed_tokens.weight", "shard.safetensors"}}}};
    test::WriteFile(dir_.File("model.safetensors.index.json"), index.dump());
  }
  test::ScratchDir dir_{"hfdir"};
};

TEST_F(SafetensorsModelDirTest, OpensDirectoryFileAndIndex) {
  WriteCheckpoint(/*sharded=*/false);
  for (const std::string& path : {dir_.path(), dir_.File("model.safetensors")}) {
    Result<ModelFiles> files = OpenModelFiles(path);
    ASSERT_TRUE(files.ok()) << path << ": " << files.status().ToString();
    EXPECT_EQ(files->config.hidden_size, 8);
    EXPECT_FALSE(files->gguf_rope_permuted);
    EXPECT_EQ(files->tokenizer, nullptr);  // no tokenizer.json
    EXPECT_NE(files->tensors->Find("model.embed_tokens.weight"), nullptr);
  }
  std::filesystem::remove(dir_.File("model.safetensors"));
  WriteCheckpoint(/*sharded=*/true);
  for (const std::string& path : {dir_.path(), dir_.File("model.safetensors.index.json")}) {
    Result<ModelFiles> files = OpenModelFiles(path);
    ASSERT_TRUE(files.ok()) << path << ": " << files.status().ToString();
    EXPECT_NE(files->tensors->Describe().find("1 shards"), std::string::npos);
  }
}

TEST_F(SafetensorsModelDirTest, ReportsWhatIsMissing) {
  Status st = OpenModelFiles(dir_.File("nothing-here")).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find(".gguf"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("config.json"), std::string::npos) << st.message();

  st = OpenModelFiles(dir_.path()).status();  // empty directory
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.message();

  WriteCheckpoint(/*sharded=*/false);
  std::filesystem::remove(dir_.File("config.json"));
  st = OpenModelFiles(dir_.File("model.safetensors")).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("config.json"), std::string::npos) << st.message();
}

TEST_F(SafetensorsModelDirTest, RejectsEmbeddingThatContradictsConfig) {
  WriteCheckpoint(/*sharded=*/false);
  json config = json::parse(std::ifstream(dir_.File("config.json")));
  config["vocab_size"] = 17;
  test::WriteFile(dir_.File("config.json"), config.dump());
  Status st = OpenModelFiles(dir_.path()).status();
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile) << st.ToString();
  EXPECT_NE(st.message().find("model.embed_tokens.weight"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace kvflow
