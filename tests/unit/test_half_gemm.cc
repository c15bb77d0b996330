// fp16 / bf16 weight kernels (backend/cpu/half_gemm.h) on every path this CPU has, against a double
// reference on the widened weights; and a tiny model stored as bf16 safetensors and as an F16 GGUF,
// whose weights stay 16-bit in the default mode (dtype auto) and give the logits of the exact fp32
// mode (dtype f32) up to float summation order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend_factory.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/half_gemm.h"
#include "engine_test_util.h"
#include "kvflow/engine.h"
#include "forward/llama_model.h"
#include "model/llama_weights.h"
#include "model/tiny_random.h"
#include "model_file_writers.h"
#include "util/thread_pool.h"

namespace kvflow {
namespace {

using test::Bytes;
using test::RunLogits;

// The test's own conversions (model_file_writers.h: _Float16 and a shift), not the code under test.
float Widen(DType t, uint16_t bits) { return t == DType::kBF16 ? test::Bf16BitsToFloat(bits) : test::HalfBitsToFloat(bits); }
uint16_t Narrow(DType t, float f) { return t == DType::kBF16 ? test::FloatToBf16Bits(f) : test::FloatToHalfBits(f); }

// Weights with a spread of magnitudes: mostly N(0, 1), some large (fp16: up to ~3e4; bf16: ~1e20),
// some tiny (fp16 subnormals; bf16 ~1e-20), some exact zeros, both signs.
std::vector<uint16_t> RandomWeights(DType t, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 19);
  const bool bf16 = t == DType::kBF16;
  std::vector<uint16_t> w(n);
  for (uint16_t& bits : w) {
    float v = normal(rng);
    switch (kind(rng)) {
      case 0: v *= bf16 ? 1e20f : 3e4f / 4; break;
      case 1: v *= bf16 ? 1e-20f : 3e-6f; break;  // fp16: below 2^-14, subnormal
      case 2: v = 0.0f; break;
      default: break;
    }
    if (!bf16) v = std::clamp(v, -65000.0f, 65000.0f);
    bits = Narrow(t, v);
  }
  return w;
}

struct PathCase {
  const char* cap;  // LimitHalfKernelIsa argument
  int64_t sgemm_min_rows;
  bool bf16_dot = false;  // SetHalfBf16DotProducts (bf16 weights only)
  std::string Name() const {
    return std::string(cap ? cap : "best") + (sgemm_min_rows ? "+sgemm" : "") + (bf16_dot ? "+bf16dot" : "");
  }
};

// The paths this CPU can run: each kernel ISA with the direct tiles, and the widen-then-sgemm path.
std::vector<PathCase> Paths() {
  std::vector<PathCase> paths = {{"portable", 0}};
  const char* previous = cpu::LimitHalfKernelIsa("avx2");
  const bool avx2 = std::string(cpu::HalfKernelIsa()) == "avx2";
  cpu::LimitHalfKernelIsa(nullptr);
  const bool avx512 = std::string(cpu::HalfKernelIsa()) == "avx512";
  cpu::LimitHalfKernelIsa(previous);
  if (avx2) paths.push_back({"avx2", 0});
  if (avx512) paths.push_back({"avx512", 0});
  paths.push_back({nullptr, 1});  // sgemm for every M, widening on the best path
  if (cpu::HalfBf16DotAvailable()) paths.push_back({"avx512", 0, true});
  return paths;
}

class HalfGemmPaths : public ::testing::Test {
 protected:
  void TearDown() override {
    cpu::LimitHalfKernelIsa(nullptr);
    cpu::SetHalfBf16DotProducts(false);
    cpu::SetHalfSgemmMinRows(saved_sgemm_rows_);
  }
  int64_t saved_sgemm_rows_ = cpu::SetHalfSgemmMinRows(0);
};

TEST_F(HalfGemmPaths, MatchTheWidenedWeightsInDouble) {
  const std::vector<PathCase> paths = Paths();
  std::printf("  paths:");
  for (const PathCase& p : paths) std::printf(" %s", p.Name().c_str());
  std::printf("\n");
  // (N, K): K below, at and above the vector widths and not a multiple of them; N not a multiple of
  // the 4-row tiles.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1}, {5, 7}, {13, 37}, {33, 100}, {7, 16}, {19, 344}, {64, 256}};
  ThreadPool pool(2);
  for (DType t : {DType::kF16, DType::kBF16}) {
    for (const PathCase& path : paths) {
      if (path.bf16_dot && t != DType::kBF16) continue;
      cpu::LimitHalfKernelIsa(path.cap);
      cpu::SetHalfSgemmMinRows(path.sgemm_min_rows);
      cpu::SetHalfBf16DotProducts(path.bf16_dot);
      double worst_ratio = 0.0, worst_rel = 0.0;
      for (const auto& [N, K] : shapes) {
        const std::vector<uint16_t> w = RandomWeights(t, static_cast<size_t>(N * K), static_cast<uint32_t>(N * 131 + K));
        for (int64_t M : {1, 3, 17, 64}) {
          const std::vector<float> x = test::RandomFloats(static_cast<size_t>(M * K), static_cast<uint32_t>(M + K));
          for (bool threaded : {false, true}) {
            ScopedThreadPool use(threaded ? &pool : nullptr);
            const int64_t ldy = N + 3;  // a row stride wider than N: the padding stays untouched
            std::vector<float> y(static_cast<size_t>(M * ldy), -7.0f);
            cpu::HalfMatmul(t, x.data(), M, K, reinterpret_cast<const uint8_t*>(w.data()), N, y.data(), ldy);
            for (int64_t m = 0; m < M; ++m) {
              for (int64_t n = 0; n < N; ++n) {
                double want = 0.0, magnitude = 0.0;
                for (int64_t k = 0; k < K; ++k) {
                  const double p = double(Widen(t, w[n * K + k])) * x[m * K + k];
                  want += p;
                  magnitude += std::fabs(p);
                }
                const double got = y[m * ldy + n];
                // fp32 products and their summation: |error| <= (K + 1) * 2^-24 * sum |products| (loose
                // worst case; the ratio to it is reported).
                // bf16 dot products round each activation to bf16 first (relative error <= 2^-8).
                const double bound =
                    std::max(1e-30, (double(K + 1) * 0x1p-24 + (path.bf16_dot ? 0x1p-8 : 0.0)) * magnitude);
                const double err = std::fabs(got - want);
                worst_ratio = std::max(worst_ratio, err / bound);
                if (magnitude > 0) worst_rel = std::max(worst_rel, err / magnitude);
                ASSERT_LE(err, bound) << DTypeName(t) << " " << path.Name() << " M " << M << " N " << N << " K " << K << " m " << m
                                      << " n " << n << " got " << got << " want " << want;
              }
              for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(y[m * ldy + n], -7.0f);
            }
          }
        }
      }
      std::printf("  %-4s %-15s: max |error| / sum|w*x| = %.2e (%.3f of the bound)\n", DTypeName(t),
                  path.Name().c_str(), worst_rel, worst_ratio);
    }
  }
}

TEST_F(HalfGemmPaths, ZeroLengthRowsGiveZeros) {
  std::vector<float> y(6, 5.0f);
  const uint16_t w = 0;
  cpu::HalfMatmul(DType::kF16, nullptr, 2, 0, reinterpret_cast<const uint8_t*>(&w), 3, y.data(), 3);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

// Every fp16 and bf16 bit pattern widens as the test's conversions do, bit for bit (NaNs: to NaN).
TEST_F(HalfGemmPaths, WideningIsBitExactOnEveryPath) {
  std::vector<uint16_t> all(65536 + 5);  // + 5: a tail past the vector width
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(all.size());
  for (const PathCase& path : Paths()) {
    cpu::LimitHalfKernelIsa(path.cap);
    for (DType t : {DType::kF16, DType::kBF16}) {
      cpu::HalfToFloatRow(t, reinterpret_cast<const uint8_t*>(all.data()), static_cast<int64_t>(all.size()), out.data());
      for (size_t i = 0; i < all.size(); ++i) {
        const float want = Widen(t, all[i]);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(out[i])) << DTypeName(t) << " " << i;
        } else {
          ASSERT_EQ(std::memcmp(&out[i], &want, sizeof(float)), 0) << DTypeName(t) << " " << i << " " << cpu::HalfKernelIsa();
        }
      }
    }
  }
}

// ---- whole model -------------------------------------------------------------------------------

// tiny-random's tensors narrowed to `t` (every tensor, norms included, as a bf16 checkpoint has them).
Bytes Narrowed(const TensorInfo& info, DType t) {
  std::vector<float> f(static_cast<size_t>(info.numel()));
  EXPECT_TRUE(DequantizeToF32(info, f.data()).ok());
  std::vector<uint16_t> bits(f.size());
  for (size_t i = 0; i < f.size(); ++i) bits[i] = Narrow(t, f[i]);
  return test::ToBytes(bits);
}

void WriteBf16Safetensors(const ModelFiles& tiny, const test::ScratchDir& dir) {
  const ModelConfig& c = tiny.config;
  nlohmann::json config = {{"architectures", {"LlamaForCausalLM"}},
                           {"model_type", "llama"},
                           {"hidden_size", c.hidden_size},
                           {"intermediate_size", c.intermediate_size},
                           {"num_hidden_layers", c.num_layers},
                           {"num_attention_heads", c.num_heads},
                           {"num_key_value_heads", c.num_kv_heads},
                           {"head_dim", c.head_dim},
                           {"vocab_size", c.vocab_size},
                           {"max_position_embeddings", c.max_position_embeddings},
                           {"rms_norm_eps", c.rms_norm_eps},
                           {"rope_theta", c.rope_theta},
                           {"tie_word_embeddings", false},
                           {"torch_dtype", "bfloat16"},
                           {"bos_token_id", 256},
                           {"eos_token_id", 256}};
  test::WriteFile(dir.File("config.json"), config.dump());
  test::SafetensorsWriter w;
  for (const std::string& name : tiny.tensors->Names()) {
    const TensorInfo& info = *tiny.tensors->Find(name);
    w.AddTensor(name, "BF16", info.shape, Narrowed(info, DType::kBF16));
  }
  test::WriteFile(dir.File("model.safetensors"), w.Build());
}

// GGUF names for tiny-random's HF names.
std::string GgufName(const std::string& hf) {
  static const std::pair<const char*, const char*> kMap[] = {
      {"model.embed_tokens.weight", "token_embd.weight"}, {"lm_head.weight", "output.weight"},
      {"model.norm.weight", "output_norm.weight"},        {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"}, {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},       {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},  {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},            {"mlp.down_proj.weight", "ffn_down.weight"}};
  for (const auto& [from, to] : kMap) {
    if (hf == from) return to;
  }
  const std::string layers = "model.layers.";
  const size_t dot = hf.find('.', layers.size());
  const std::string rest = GgufName(hf.substr(dot + 1));
  return "blk." + hf.substr(layers.size(), dot - layers.size()) + "." + rest;
}

// An F16 GGUF (F32 norms, as llama.cpp's convert writes them) with a byte-level tokenizer, so the
// engine can run it.
void WriteF16Gguf(const ModelFiles& tiny, const std::string& path) {
  const ModelConfig& c = tiny.config;
  test::GgufWriter w = test::TinyLlamaGgufMetadata("tiny-f16", c.num_layers, c.hidden_size, c.intermediate_size,
                                                   c.num_heads, c.num_kv_heads, c.rope_theta, c.rms_norm_eps);
  for (const std::string& name : tiny.tensors->Names()) {
    const TensorInfo& info = *tiny.tensors->Find(name);
    if (info.shape.size() == 1) {
      w.AddTensor(GgufName(name), test::kGgmlF32, info.shape,
                  Bytes(info.data, info.data + info.nbytes));
    } else {
      w.AddTensor(GgufName(name), test::kGgmlF16, info.shape, Narrowed(info, DType::kF16));
    }
  }
  test::WriteFile(path, w.Build());
}

// Loads `files` both ways, checks the formats, and compares the logits of a 40-token prefill and
// a decode step (M = 1).
void ExpectSixteenBitMatchesF32(const ModelFiles& files, DType want, const char* what) {
  const ModelConfig& c = files.config;
  auto half = LoadLlamaWeights(*files.tensors, c, files.gguf_rope_permuted, WeightFormat::kKeepQuantized);
  ASSERT_TRUE(half.ok()) << half.status().ToString();
  auto f32 = LoadLlamaWeights(*files.tensors, c, files.gguf_rope_permuted, WeightFormat::kF32);
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  EXPECT_TRUE(f32->all_f32());
  EXPECT_FALSE(half->all_f32());
  const std::string name = DTypeName(want);
  EXPECT_EQ(half->embed.FormatName(), name);
  EXPECT_EQ(half->lm_head.FormatName(), name);
  for (const LlamaLayerWeights& l : half->layers) {
    EXPECT_EQ(l.wqkv.FormatName(), name);
    EXPECT_EQ(l.wo.FormatName(), name);
    EXPECT_EQ(l.w_gate_up.FormatName(), name);
    EXPECT_EQ(l.w_down.FormatName(), name);
    EXPECT_EQ(l.wqkv.bytes() * 2, l.wqkv.rows * l.wqkv.cols * sizeof(float));
  }
  EXPECT_LT(half->bytes(), f32->bytes() * 6 / 10);
  // The same rows either way (embedding lookups widen exactly).
  std::vector<float> a(static_cast<size_t>(c.hidden_size)), b(a.size());
  for (int64_t r : {int64_t{0}, int64_t{200}, int64_t{c.vocab_size - 1}}) {
    half->embed.DequantizeRow(r, a.data());
    f32->embed.DequantizeRow(r, b.data());
    EXPECT_EQ(a, b) << r;
  }

  std::mt19937 rng(5);
  std::vector<int32_t> tokens(41);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % c.vocab_size);
  const std::vector<float> want_logits = RunLogits(c, std::move(f32).value(), tokens);
  const std::vector<float> got = RunLogits(c, std::move(half).value(), tokens);
  ASSERT_EQ(got.size(), want_logits.size());
  double max_err = 0.0, max_logit = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    max_err = std::max(max_err, std::fabs(double(got[i]) - want_logits[i]));
    max_logit = std::max(max_logit, std::fabs(double(want_logits[i])));
  }
  std::printf("  %s: %s weights vs fp32 mode, %zu logits: max |error| %.3g (largest |logit| %.3g)\n", what,
              name.c_str(), got.size(), max_err, max_logit);
  // Same weight values and exact products: only the float summation order differs.
  EXPECT_LT(max_err, 1e-4 * max_logit) << what;
}

TEST(HalfWeights, Bf16SafetensorsStayBf16AndMatchTheFp32Mode) {
  auto tiny = MakeTinyRandomModel().value();
  test::ScratchDir dir("bf16_model");
  WriteBf16Safetensors(tiny, dir);
  auto files = OpenModelFiles(dir.path());
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(files->tensors->Find("model.layers.0.mlp.down_proj.weight")->dtype, DType::kBF16);
  ExpectSixteenBitMatchesF32(*files, DType::kBF16, "bf16 safetensors");
}

TEST(HalfWeights, F16GgufStaysF16AndMatchesTheFp32Mode) {
  auto tiny = MakeTinyRandomModel().value();
  test::ScratchDir dir("f16_gguf");
  WriteF16Gguf(tiny, dir.File("tiny-f16.gguf"));
  auto files = OpenModelFiles(dir.File("tiny-f16.gguf"));
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(files->tensors->Find("blk.0.attn_q.weight")->dtype, DType::kF16);
  ExpectSixteenBitMatchesF32(*files, DType::kF16, "F16 GGUF");
}

// Through the engine: dtype auto keeps F16 (and, with kv_cache_dtype auto, an fp16 KV cache, as for
// quantized weights); f32 widens everything. With the same KV element type the two modes give the
// same greedy tokens and prompt logprobs up to summation order.
TEST(HalfWeights, EngineAutoKeepsF16) {
  auto tiny = MakeTinyRandomModel().value();
  test::ScratchDir dir("f16_engine");
  const std::string path = dir.File("tiny-f16.gguf");
  WriteF16Gguf(tiny, path);
  {
    auto files = OpenModelFiles(path).value();
    for (const char* dtype : {"auto", "f32"}) {
      EngineConfig c;
      c.model = path;
      c.dtype = dtype;
      c.num_threads = 2;
      c.num_kv_blocks = 16;
      c.max_model_len = 128;
      auto weights = LoadWeightsFor(files, c);
      ASSERT_TRUE(weights.ok()) << weights.status().ToString();
      const bool f32 = std::string(dtype) == "f32";
      EXPECT_EQ(weights->layers[0].wqkv.FormatName(), f32 ? "F32" : "F16");
      auto backend = CreateBackend(c, false, files.config, std::move(weights).value());
      ASSERT_TRUE(backend.ok()) << backend.status().ToString();
      const std::string described = (*backend)->Describe();
      std::printf("  dtype %s: %s\n", dtype, described.c_str());
      EXPECT_NE(described.find(f32 ? "fp32 KV" : "fp16 KV"), std::string::npos) << described;
      if (!f32) EXPECT_NE(described.find("F16 ("), std::string::npos) << described;
    }
  }
  SamplingParams p = test::Greedy(16);
  p.prompt_logprobs = 0;
  const std::string prompt = "fp16 weights stay sixteen bits";
  RequestOutput outputs[2];
  for (int i = 0; i < 2; ++i) {
    EngineConfig c;
    c.model = path;
    c.dtype = i == 0 ? "auto" : "f32";
    c.kv_cache_dtype = "f32";
    c.num_threads = 2;
    c.max_num_seqs = 4;
    auto engine = Engine::Create(c);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto out = (*engine)->Generate(prompt, p);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    outputs[i] = std::move(out).value();
  }
  EXPECT_EQ(outputs[0].first().tokens, outputs[1].first().tokens);
  ASSERT_EQ(outputs[0].prompt_logprobs.size(), outputs[1].prompt_logprobs.size());
  double max_err = 0.0;
  for (size_t i = 0; i < outputs[0].prompt_logprobs.size(); ++i) {
    max_err = std::max(max_err, std::fabs(double(outputs[0].prompt_logprobs[i].logprob) -
                                          outputs[1].prompt_logprobs[i].logprob));
  }
  std::printf("  engine, F16 weights vs fp32 mode: max |prompt logprob error| %.3g\n", max_err);
  EXPECT_LT(max_err, 1e-3);
}

}  // namespace
}  // namespace kvflow
