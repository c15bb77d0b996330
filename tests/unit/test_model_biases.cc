// Projection biases (HF attention_bias: q, k, v and o_proj; mlp_bias: gate, up and down_proj; the
// same tensors in GGUF files) on the CPU backend, fp32 and quantized: every bias changes the logits,
// zero biases change nothing, a GGUF file (llama.cpp's permuted q/k rows and biases) computes what
// the HF-named checkpoint does, and every mismatch between the config and the tensors is refused
// with an error that names what is wrong. Exactness against transformers is
// tests/reference/test_llama_reference.py's (the "biases" tiny model).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "backend/cpu/cpu_backend.h"
#include "forward/llama_model.h"
#include "model/llama_weights.h"
#include "model/tiny_random.h"
#include "model_file_writers.h"

namespace kvflow {
namespace {

// Prefill of all but the last token (every row's logits) in two chunks, then one decode step.
std::vector<float> RunLogits(const ModelConfig& config, LlamaWeights w, const std::vector<int32_t>& tokens) {
  KvCacheLayout layout{config.num_layers, 8, config.num_kv_heads, 16, config.head_dim};
  auto created = CpuBackend::Create(config, std::move(w), layout, 0, 2);
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  if (!created.ok()) return {};
  LlamaModel model(**created);
  const std::vector<BlockId> table = {3, 1, 6, 0};
  std::vector<float> all;
  const int32_t n = static_cast<int32_t>(tokens.size());
  const int32_t bounds[] = {0, (n - 1) / 2, n - 1, n};
  for (int step = 0; step < 3; ++step) {
    ForwardBatch b;
    SequenceSlice s;
    for (int32_t t = bounds[step]; t < bounds[step + 1]; ++t) {
      b.tokens.push_back(tokens[static_cast<size_t>(t)]);
      b.positions.push_back(t);
    }
    s.num_tokens = bounds[step + 1] - bounds[step];
    s.context_len = bounds[step + 1];
    s.block_table = table;
    s.logits = LogitsMode::kAll;
    b.seqs.push_back(s);
    std::vector<float> logits;
    const Status st = model.Forward(b, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

std::vector<int32_t> Tokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

// A source that hides some tensors of another, or shows one with another shape.
class EditedSource final : public TensorSource {
 public:
  explicit EditedSource(const TensorSource& inner) : inner_(inner) {}
  void Hide(const std::string& name) { hidden_.insert(name); }
  void Reshape(const std::string& name, std::vector<int64_t> shape) {
    TensorInfo info = *inner_.Find(name);
    info.shape = std::move(shape);
    int64_t n = 1;
    for (int64_t d : info.shape) n *= d;
    info.nbytes = static_cast<size_t>(n) * sizeof(float);
    storage_[name] = std::vector<float>(static_cast<size_t>(n), 0.5f);
    info.data = reinterpret_cast<const uint8_t*>(storage_[name].data());
    reshaped_[name] = info;
  }
  const TensorInfo* Find(const std::string& name) const override {
    if (hidden_.contains(name)) return nullptr;
    if (auto it = reshaped_.find(name); it != reshaped_.end()) return &it->second;
    return inner_.Find(name);
  }
  std::vector<std::string> Names() const override {
    std::vector<std::string> names;
    for (const std::string& n : inner_.Names()) {
      if (!hidden_.contains(n)) names.push_back(n);
    }
    return names;
  }
  std::string Describe() const override { return "edited " + inner_.Describe(); }

 private:
  const TensorSource& inner_;
  std::set<std::string> hidden_;
  std::map<std::string, TensorInfo> reshaped_;
  std::map<std::string, std::vector<float>> storage_;
};

// Which slice of a layer's biases to keep (the rest zeroed).
enum class Part { kQ, kK, kV, kO, kGate, kUp, kDown };

void KeepOnly(LlamaWeights& w, const ModelConfig& c, Part part) {
  const size_t q = static_cast<size_t>(c.num_heads) * c.head_dim, kv = static_cast<size_t>(c.num_kv_heads) * c.head_dim;
  const size_t F = static_cast<size_t>(c.intermediate_size);
  for (LlamaLayerWeights& l : w.layers) {
    auto zero_except = [](std::vector<float>& v, size_t begin, size_t end) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (i < begin || i >= end) v[i] = 0.0f;
      }
    };
    zero_except(l.bqkv, part == Part::kQ ? 0 : part == Part::kK ? q : part == Part::kV ? q + kv : 0,
                part == Part::kQ ? q : part == Part::kK ? q + kv : part == Part::kV ? q + 2 * kv : 0);
    zero_except(l.bo, 0, part == Part::kO ? l.bo.size() : 0);
    zero_except(l.b_gate_up, part == Part::kGate ? 0 : part == Part::kUp ? F : 0,
                part == Part::kGate ? F : part == Part::kUp ? 2 * F : 0);
    zero_except(l.b_down, 0, part == Part::kDown ? l.b_down.size() : 0);
  }
}

TEST(ModelBiases, EveryBiasChangesTheLogitsAndZeroBiasesChangeNothing) {
  auto plain_files = MakeTinyRandomModel().value();
  auto biased_files = MakeTinyRandomModel(0x6b76666c6f77, 4, /*biases=*/true).value();
  const ModelConfig& plain_config = plain_files.config;
  const ModelConfig& c = biased_files.config;
  ASSERT_TRUE(c.qkv_bias && c.o_bias && c.mlp_bias);
  const LlamaWeights plain = LoadLlamaWeights(*plain_files.tensors, plain_config, false).value();
  const LlamaWeights biased = LoadLlamaWeights(*biased_files.tensors, c, false).value();
  EXPECT_EQ(biased.num_parameters() - plain.num_parameters(),
            static_cast<size_t>(c.num_layers) * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 2 * c.hidden_size +
                                                 2 * c.intermediate_size));
  const std::vector<int32_t> tokens = Tokens(37, c.vocab_size, 3);
  const std::vector<float> want_plain = RunLogits(plain_config, plain, tokens);
  const std::vector<float> with_biases = RunLogits(c, biased, tokens);
  double scale = 0.0;
  for (float x : want_plain) scale = std::max(scale, std::fabs(double(x)));
  const double moved = MaxAbsDiff(with_biases, want_plain);
  std::printf("  max |logit| %.2f; all biases move the logits by up to %.3f\n", scale, moved);
  EXPECT_GT(moved, 0.05 * scale);

  // Zero biases: the same logits as the model without them, bit for bit (x + 0 == x).
  LlamaWeights zeroed = biased;
  for (LlamaLayerWeights& l : zeroed.layers) {
    for (auto* v : {&l.bqkv, &l.bo, &l.b_gate_up, &l.b_down}) std::fill(v->begin(), v->end(), 0.0f);
  }
  EXPECT_EQ(MaxAbsDiff(RunLogits(c, std::move(zeroed), tokens), want_plain), 0.0);

  // Each part alone (q, k and v of the fused bias; o; gate and up of the fused one; down) is used.
  const char* names[] = {"q", "k", "v", "o", "gate", "up", "down"};
  for (Part part : {Part::kQ, Part::kK, Part::kV, Part::kO, Part::kGate, Part::kUp, Part::kDown}) {
    LlamaWeights one = biased;
    KeepOnly(one, c, part);
    const double d = MaxAbsDiff(RunLogits(c, std::move(one), tokens), want_plain);
    std::printf("  %-4s bias alone moves the logits by up to %.4f\n", names[static_cast<int>(part)], d);
    EXPECT_GT(d, 1e-3 * scale) << names[static_cast<int>(part)];
  }
}

TEST(ModelBiases, ConfigAndTensorsMustAgree) {
  auto files = MakeTinyRandomModel(0x6b76666c6f77, 2, /*biases=*/true).value();
  const ModelConfig& c = files.config;
  ASSERT_TRUE(LoadLlamaWeights(*files.tensors, c, false).ok());

  // Declared but missing: NotFound, naming the tensor and what declared it.
  for (const char* missing : {"model.layers.1.self_attn.k_proj.bias", "model.layers.0.self_attn.o_proj.bias",
                              "model.layers.1.mlp.up_proj.bias", "model.layers.0.mlp.down_proj.bias"}) {
    EditedSource source(*files.tensors);
    source.Hide(missing);
    for (WeightFormat format : {WeightFormat::kF32, WeightFormat::kKeepQuantized}) {
      const Status st = LoadLlamaWeights(source, c, false, format).status();
      EXPECT_EQ(st.code(), StatusCode::kNotFound) << missing << ": " << st.ToString();
      EXPECT_NE(st.message().find(missing), std::string::npos) << st.message();
      const bool mlp = std::string(missing).find("mlp") != std::string::npos;
      EXPECT_NE(st.message().find(mlp ? "mlp_bias" : "attention_bias"), std::string::npos) << st.message();
    }
  }
  // A wrong shape: InvalidArgument, naming the tensor and both shapes.
  {
    EditedSource source(*files.tensors);
    source.Reshape("model.layers.1.self_attn.q_proj.bias", {c.num_heads * c.head_dim + 1});
    const Status st = LoadLlamaWeights(source, c, false).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("q_proj.bias"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("[129]"), std::string::npos) << st.message();
  }
  // Present but not declared: Unsupported, naming the tensors (the bias-free config of a biased
  // checkpoint; a Qwen2-style q/k/v-only checkpoint under a Llama config).
  for (int declared = 0; declared < 3; ++declared) {
    ModelConfig undeclared = c;
    undeclared.qkv_bias = declared == 1;
    undeclared.o_bias = declared == 1;
    undeclared.mlp_bias = declared == 2;
    for (WeightFormat format : {WeightFormat::kF32, WeightFormat::kKeepQuantized}) {
      const Status st = LoadLlamaWeights(*files.tensors, undeclared, false, format).status();
      EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
      EXPECT_NE(st.message().find(declared == 2 ? "attn" : "mlp"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find(".bias"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find("attention_bias"), std::string::npos) << st.message();
    }
  }
  // A backend checks that the biases it is given are the ones the config declares.
  LlamaWeights w = LoadLlamaWeights(*files.tensors, c, false).value();
  KvCacheLayout layout{c.num_layers, 8, c.num_kv_heads, 16, c.head_dim};
  ModelConfig no_mlp = c;
  no_mlp.mlp_bias = false;
  Status st = CpuBackend::Create(no_mlp, w, layout, 0, 1).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("gate/up bias"), std::string::npos) << st.message();
  w.layers[1].bo.pop_back();
  st = CpuBackend::Create(c, std::move(w), layout, 0, 1).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("layer 1's o bias"), std::string::npos) << st.message();
}

// ---- GGUF ---------------------------------------------------------------------------------------

// llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): each head's rows (or bias
// entries) go from HF's halves (s * half + j) to interleaved pairs (2j + s).
std::vector<float> PermuteForGguf(const std::vector<float>& hf, int heads, int head_dim, int64_t cols) {
  std::vector<float> out(hf.size());
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h) {
    for (int j = 0; j < half; ++j) {
      for (int s = 0; s < 2; ++s) {
        const int64_t from = static_cast<int64_t>(h) * head_dim + s * half + j;
        const int64_t to = static_cast<int64_t>(h) * head_dim + 2 * j + s;
        std::copy_n(hf.begin() + from * cols, cols, out.begin() + to * cols);
      }
    }
  }
  return out;
}

std::vector<float> TensorValues(const TensorSource& source, const std::string& name) {
  const TensorInfo* info = source.Find(name);
  EXPECT_NE(info, nullptr) << name;
  std::vector<float> v(static_cast<size_t>(info->numel()));
  EXPECT_TRUE(DequantizeToF32(*info, v.data()).ok());
  return v;
}

struct GgufOptions {
  bool qkv_bias = true, o_bias = true, mlp_bias = true;
  bool f16_k_bias = false;    // store blk.N.attn_k.bias as F16 (dequantized at load)
  std::string drop;           // a GGUF tensor name to leave out
};

// tiny-random with biases as llama.cpp would write it: GGUF names, permuted q/k rows and biases.
void WriteTinyGguf(const ModelFiles& hf, const std::string& path, const GgufOptions& o) {
  const ModelConfig& c = hf.config;
  test::GgufWriter w = test::TinyLlamaGgufMetadata("tiny-biases", c.num_layers, c.hidden_size, c.intermediate_size,
                                                   c.num_heads, c.num_kv_heads, c.rope_theta, c.rms_norm_eps);

  const TensorSource& src = *hf.tensors;
  auto add = [&](const std::string& gguf_name, const std::string& hf_name, std::vector<float> values,
                 bool f16 = false) {
    if (gguf_name == o.drop) return;
    std::vector<int64_t> shape = src.Find(hf_name)->shape;
    if (!f16) {
      w.AddTensor(gguf_name, test::kGgmlF32, shape, test::ToBytes(values));
      return;
    }
    std::vector<uint16_t> half;
    for (float x : values) half.push_back(test::FloatToHalfBits(x));
    w.AddTensor(gguf_name, test::kGgmlF16, shape, test::ToBytes(half));
  };
  auto copy = [&](const std::string& gguf_name, const std::string& hf_name) {
    add(gguf_name, hf_name, TensorValues(src, hf_name));
  };
  const int64_t H = c.hidden_size;
  copy("token_embd.weight", "model.embed_tokens.weight");
  copy("output.weight", "lm_head.weight");
  copy("output_norm.weight", "model.norm.weight");
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".", g = "blk." + std::to_string(i) + ".";
    copy(g + "attn_norm.weight", p + "input_layernorm.weight");
    copy(g + "ffn_norm.weight", p + "post_attention_layernorm.weight");
    add(g + "attn_q.weight", p + "self_attn.q_proj.weight",
        PermuteForGguf(TensorValues(src, p + "self_attn.q_proj.weight"), c.num_heads, c.head_dim, H));
    add(g + "attn_k.weight", p + "self_attn.k_proj.weight",
        PermuteForGguf(TensorValues(src, p + "self_attn.k_proj.weight"), c.num_kv_heads, c.head_dim, H));
    copy(g + "attn_v.weight", p + "self_attn.v_proj.weight");
    copy(g + "attn_output.weight", p + "self_attn.o_proj.weight");
    copy(g + "ffn_gate.weight", p + "mlp.gate_proj.weight");
    copy(g + "ffn_up.weight", p + "mlp.up_proj.weight");
    copy(g + "ffn_down.weight", p + "mlp.down_proj.weight");
    if (o.qkv_bias) {
      add(g + "attn_q.bias", p + "self_attn.q_proj.bias",
          PermuteForGguf(TensorValues(src, p + "self_attn.q_proj.bias"), c.num_heads, c.head_dim, 1));
      add(g + "attn_k.bias", p + "self_attn.k_proj.bias",
          PermuteForGguf(TensorValues(src, p + "self_attn.k_proj.bias"), c.num_kv_heads, c.head_dim, 1),
          o.f16_k_bias);
      copy(g + "attn_v.bias", p + "self_attn.v_proj.bias");
    }
    if (o.o_bias) copy(g + "attn_output.bias", p + "self_attn.o_proj.bias");
    if (o.mlp_bias) {
      copy(g + "ffn_gate.bias", p + "mlp.gate_proj.bias");
      copy(g + "ffn_up.bias", p + "mlp.up_proj.bias");
      copy(g + "ffn_down.bias", p + "mlp.down_proj.bias");
    }
  }
  test::WriteFile(path, w.Build());
}

TEST(ModelBiases, GgufFileComputesWhatTheHfCheckpointDoes) {
  test::ScratchDir dir("gguf_biases");
  auto hf = MakeTinyRandomModel(0x6b76666c6f77, 2, /*biases=*/true).value();
  const LlamaWeights hf_weights = LoadLlamaWeights(*hf.tensors, hf.config, false).value();
  const std::vector<int32_t> tokens = Tokens(29, hf.config.vocab_size, 5);

  struct Case {
    const char* name;
    GgufOptions options;
  };
  GgufOptions qkv_only;
  qkv_only.o_bias = qkv_only.mlp_bias = false;
  GgufOptions f16_k;
  f16_k.f16_k_bias = true;
  for (const Case& k : {Case{"all biases", GgufOptions{}}, Case{"q/k/v biases only", qkv_only},
                        Case{"k bias stored as f16", f16_k}}) {
    const std::string path = dir.File("tiny.gguf");
    WriteTinyGguf(hf, path, k.options);
    auto files = OpenModelFiles(path);
    ASSERT_TRUE(files.ok()) << k.name << ": " << files.status().ToString();
    EXPECT_TRUE(files->gguf_rope_permuted);
    EXPECT_EQ(files->config.qkv_bias, k.options.qkv_bias) << k.name;
    EXPECT_EQ(files->config.o_bias, k.options.o_bias) << k.name;
    EXPECT_EQ(files->config.mlp_bias, k.options.mlp_bias) << k.name;
    auto w = LoadLlamaWeights(*files->tensors, files->config, files->gguf_rope_permuted);
    ASSERT_TRUE(w.ok()) << k.name << ": " << w.status().ToString();

    // What the GGUF means, on the HF side: its biases (unused ones zeroed, the k bias rounded to f16).
    LlamaWeights want = hf_weights;
    const size_t q = static_cast<size_t>(hf.config.num_heads) * hf.config.head_dim;
    const size_t kv = static_cast<size_t>(hf.config.num_kv_heads) * hf.config.head_dim;
    for (LlamaLayerWeights& l : want.layers) {
      if (!k.options.o_bias) std::fill(l.bo.begin(), l.bo.end(), 0.0f);
      if (!k.options.mlp_bias) {
        std::fill(l.b_gate_up.begin(), l.b_gate_up.end(), 0.0f);
        std::fill(l.b_down.begin(), l.b_down.end(), 0.0f);
      }
      if (k.options.f16_k_bias) {
        for (size_t i = q; i < q + kv; ++i) l.bqkv[i] = test::HalfBitsToFloat(test::FloatToHalfBits(l.bqkv[i]));
      }
    }
    // Unpermuted exactly: the same fused q|k|v bias as the HF checkpoint's.
    if (k.options.f16_k_bias) EXPECT_EQ(w->layers[1].bqkv, want.layers[1].bqkv) << k.name;
    if (!k.options.f16_k_bias) EXPECT_EQ(w->layers[1].bqkv, hf_weights.layers[1].bqkv) << k.name;
    const double d = MaxAbsDiff(RunLogits(files->config, std::move(w.value()), tokens),
                                RunLogits(hf.config, std::move(want), tokens));
    std::printf("  GGUF %-22s vs the HF checkpoint: max |dlogit| %.2e\n", k.name, d);
    EXPECT_EQ(d, 0.0) << k.name;  // the same fp32 values in the same order
  }

  // Incomplete groups are refused with the tensor's name: a missing k bias (q's declares the
  // group), and a down bias without gate/up biases (nothing declares it).
  struct Bad {
    GgufOptions options;
    StatusCode code;
    const char* name;
  };
  GgufOptions no_k;
  no_k.drop = "blk.1.attn_k.bias";
  GgufOptions down_only;
  down_only.drop = "blk.0.ffn_gate.bias";
  for (const Bad& b : {Bad{no_k, StatusCode::kNotFound, "blk.1.attn_k.bias"},
                       Bad{down_only, StatusCode::kUnsupported, "ffn_"}}) {
    const std::string path = dir.File("bad.gguf");
    WriteTinyGguf(hf, path, b.options);
    auto files = OpenModelFiles(path);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    const Status st = LoadLlamaWeights(*files->tensors, files->config, files->gguf_rope_permuted).status();
    EXPECT_EQ(st.code(), b.code) << st.ToString();
    EXPECT_NE(st.message().find(b.name), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace kvflow
