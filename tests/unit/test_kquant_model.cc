// A tiny Llama stored as a llama.cpp Q4_K_M-style GGUF (Q4_K with Q6_K for V, the down projection and
// the output, and one Q5_K matrix) loads, and runs exactly as the fp32 GGUF of the weights its blocks
// dequantize to: same weights after loading, same prompt logprobs, same greedy tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>

#include "engine_test_util.h"
#include "kvflow/engine.h"
#include "model/byte_level.h"
#include "model/llama_weights.h"
#include "model/tensor_source.h"
#include "model_file_writers.h"

namespace kvflow {
namespace {

using test::Bytes;

constexpr int kHidden = 256, kHeads = 4, kKvHeads = 2, kHeadDim = 64, kFfn = 512, kLayers = 2;
constexpr int kVocab = 259;  // 256 bytes + 3 specials

test::GgufWriter TinyLlamaMetadata() {
  test::GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("general.name", "tiny-kquant");
  w.Add("llama.block_count", test::kU32, uint32_t{kLayers});
  w.Add("llama.context_length", test::kU32, uint32_t{256});
  w.Add("llama.embedding_length", test::kU32, uint32_t{kHidden});
  w.Add("llama.feed_forward_length", test::kU32, uint32_t{kFfn});
  w.Add("llama.attention.head_count", test::kU32, uint32_t{kHeads});
  w.Add("llama.attention.head_count_kv", test::kU32, uint32_t{kKvHeads});
  w.Add("llama.rope.freq_base", test::kF32, 10000.0f);
  w.Add("llama.attention.layer_norm_rms_epsilon", test::kF32, 1e-5f);
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteLevelSpelling(static_cast<uint8_t>(b)));
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) tokens.push_back(special);
  std::vector<int32_t> types(256, 1);
  types.insert(types.end(), 3, 3);
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "gpt2");
  w.AddStringArray("tokenizer.ggml.tokens", tokens);
  w.AddRaw("tokenizer.ggml.token_type", test::kArray, test::GgufWriter::ArrayOf<int32_t>(test::kI32, types));
  w.Add("tokenizer.ggml.bos_token_id", test::kU32, uint32_t{256});
  w.Add("tokenizer.ggml.eos_token_id", test::kU32, uint32_t{256});
  return w;
}

// Writes the same model twice: K-quant matrices, and fp32 matrices holding what those blocks
// dequantize to (norms are fp32 in both).
class TinyKQuantModel {
 public:
  explicit TinyKQuantModel(const test::ScratchDir& dir)
      : kquant_path_(dir.File("tiny-q4_k_m.gguf")), f32_path_(dir.File("tiny-f32.gguf")) {
    kquant_ = TinyLlamaMetadata();
    f32_ = TinyLlamaMetadata();
    AddMatrix("token_embd.weight", kVocab, kHidden, DType::kQ4_K, 1.0f);
    AddMatrix("output.weight", kVocab, kHidden, DType::kQ6_K, 0.1f);
    AddNorm("output_norm.weight", kHidden);
    const float s = 1.0f / std::sqrt(static_cast<float>(kHidden));
    for (int i = 0; i < kLayers; ++i) {
      const std::string p = "blk." + std::to_string(i) + ".";
      AddNorm(p + "attn_norm.weight", kHidden);
      AddNorm(p + "ffn_norm.weight", kHidden);
      AddMatrix(p + "attn_q.weight", kHeads * kHeadDim, kHidden, DType::kQ4_K, 2 * s);
      AddMatrix(p + "attn_k.weight", kKvHeads * kHeadDim, kHidden, DType::kQ5_K, 2 * s);
      AddMatrix(p + "attn_v.weight", kKvHeads * kHeadDim, kHidden, DType::kQ6_K, s);
      AddMatrix(p + "attn_output.weight", kHidden, kHeads * kHeadDim, DType::kQ4_K, s);
      AddMatrix(p + "ffn_gate.weight", kFfn, kHidden, DType::kQ4_K, s);
      AddMatrix(p + "ffn_up.weight", kFfn, kHidden, DType::kQ4_K, s);
      AddMatrix(p + "ffn_down.weight", kHidden, kFfn, DType::kQ6_K, 1.0f / std::sqrt(static_cast<float>(kFfn)));
    }
    test::WriteFile(kquant_path_, kquant_.Build());
    test::WriteFile(f32_path_, f32_.Build());
  }

  const std::string& kquant_path() const { return kquant_path_; }
  const std::string& f32_path() const { return f32_path_; }

 private:
  std::vector<float> Random(size_t n, float stddev) {
    std::normal_distribution<float> normal(0.0f, stddev);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng_);
    return v;
  }

  void AddNorm(const std::string& name, int64_t n) {
    std::vector<float> v = Random(static_cast<size_t>(n), 0.1f);
    for (float& x : v) x += 1.0f;
    kquant_.AddTensor(name, test::kGgmlF32, {n}, test::ToBytes(v));
    f32_.AddTensor(name, test::kGgmlF32, {n}, test::ToBytes(v));
  }

  void AddMatrix(const std::string& name, int64_t rows, int64_t cols, DType type, float stddev) {
    const std::vector<float> x = Random(static_cast<size_t>(rows * cols), stddev);
    ASSERT_TRUE(type == DType::kQ4_K || type == DType::kQ5_K || type == DType::kQ6_K) << DTypeName(type);
    Bytes blocks = type == DType::kQ4_K   ? test::QuantizeQ4_K(x)
                   : type == DType::kQ5_K ? test::QuantizeQ5_K(x)
                                          : test::QuantizeQ6_K(x);
    const uint32_t ggml_type = type == DType::kQ4_K   ? test::kGgmlQ4_K
                               : type == DType::kQ5_K ? test::kGgmlQ5_K
                                                      : test::kGgmlQ6_K;
    TensorInfo info;
    info.name = name;
    info.dtype = type;
    info.shape = {rows, cols};
    info.data = blocks.data();
    info.nbytes = blocks.size();
    std::vector<float> dequantized(x.size());
    ASSERT_TRUE(DequantizeToF32(info, dequantized.data()).ok());
    kquant_.AddTensor(name, ggml_type, {rows, cols}, std::move(blocks));
    f32_.AddTensor(name, test::kGgmlF32, {rows, cols}, test::ToBytes(dequantized));
  }

  std::string kquant_path_, f32_path_;
  test::GgufWriter kquant_, f32_;
  std::mt19937 rng_{7};
};

TEST(KQuantModel, LoadsAsTheFp32WeightsItsBlocksHold) {
  test::ScratchDir dir("kquant_model");
  TinyKQuantModel model(dir);
  Result<ModelFiles> kquant = OpenModelFiles(model.kquant_path());
  ASSERT_TRUE(kquant.ok()) << kquant.status().ToString();
  EXPECT_EQ(kquant->tensors->Find("blk.0.attn_v.weight")->dtype, DType::kQ6_K);
  EXPECT_EQ(kquant->tensors->Find("blk.1.attn_k.weight")->dtype, DType::kQ5_K);
  Result<ModelFiles> f32 = OpenModelFiles(model.f32_path());
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();

  // With kKeepQuantized too: there are no K-quant kernels yet, so the matrices come out fp32.
  for (WeightFormat format : {WeightFormat::kF32, WeightFormat::kKeepQuantized}) {
    Result<LlamaWeights> a = LoadLlamaWeights(*kquant->tensors, kquant->config, kquant->gguf_rope_permuted, format);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    Result<LlamaWeights> b = LoadLlamaWeights(*f32->tensors, f32->config, f32->gguf_rope_permuted, format);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_TRUE(a->all_f32());
    EXPECT_EQ(a->embed.f32(), b->embed.f32());
    EXPECT_EQ(a->lm_head.f32(), b->lm_head.f32());
    for (int i = 0; i < kLayers; ++i) {
      const LlamaLayerWeights &x = a->layers[i], &y = b->layers[i];
      EXPECT_EQ(x.wqkv.f32(), y.wqkv.f32()) << i;
      EXPECT_EQ(x.wo.f32(), y.wo.f32()) << i;
      EXPECT_EQ(x.w_gate_up.f32(), y.w_gate_up.f32()) << i;
      EXPECT_EQ(x.w_down.f32(), y.w_down.f32()) << i;
    }
  }
}

TEST(KQuantModel, GeneratesWhatTheDequantizedFp32ModelGenerates) {
  test::ScratchDir dir("kquant_engine");
  TinyKQuantModel model(dir);
  SamplingParams p = test::Greedy(24);
  p.prompt_logprobs = 0;
  const std::string prompt = "The K-quants load and generate";
  RequestOutput outputs[2];
  for (int i = 0; i < 2; ++i) {
    EngineConfig c;
    c.model = i == 0 ? model.kquant_path() : model.f32_path();
    c.num_threads = 2;
    c.max_num_seqs = 4;
    Result<std::unique_ptr<Engine>> engine = Engine::Create(c);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    Result<RequestOutput> out = (*engine)->Generate(prompt, p);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    outputs[i] = std::move(out).value();
  }
  const RequestOutput &kquant = outputs[0], &f32 = outputs[1];
  ASSERT_EQ(kquant.first().tokens.size(), 24u);
  EXPECT_EQ(kquant.first().tokens, f32.first().tokens);
  // Not a degenerate model that repeats one token whatever its weights.
  EXPECT_GT(std::set<int32_t>(kquant.first().tokens.begin(), kquant.first().tokens.end()).size(), 3u);
  ASSERT_EQ(kquant.prompt_logprobs.size(), f32.prompt_logprobs.size());
  ASSERT_GT(kquant.prompt_logprobs.size(), 10u);
  for (size_t i = 0; i < kquant.prompt_logprobs.size(); ++i) {
    EXPECT_EQ(kquant.prompt_logprobs[i].logprob, f32.prompt_logprobs[i].logprob) << i;
  }
}

}  // namespace
}  // namespace kvflow
