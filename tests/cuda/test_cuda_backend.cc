// The CUDA backend end to end, against the CPU reference backend:
//   - logits of the same batches (prefill with every row's logits, chunked prefill mixed with
//     decode, decode steps) within tolerance, with the CPU running on the same fp16/bf16-rounded
//     weights so that only activation rounding and summation order differ;
//   - greedy generations of the CUDA engine equal to the CPU engine's (tiny-random here; SmolLM2
//     when its GGUF is present and a real GPU runs the test);
//   - preemption by swap and by recompute, prefix caching, and CUDA graphs vs eager steps leave the
//     greedy outputs unchanged;
//   - InfiniGen's and H2O's token selections: attention over per-KV-head selections and the host
//     reads the selectors make against the CPU backend; the selectors in the CUDA engine (selecting
//     everything is full attention; InfiniGen selects like the CPU engine's);
//   - impossible configurations fail with clear errors.
// In the emulator build (label emu) this runs the backend's host code, every kernel and the CUDA
// graph path on the CPU; on a GPU (label gpu) the real thing.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <numeric>
#include <random>

#include <unistd.h>

#include "forward/llama_model.h"
#include "backend/backend_factory.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/kv_block_select.h"
#include "backend/cuda/cuda_backend.h"
#include "moe.h"
#include "engine_test_util.h"
#include "kv_selection_oracle.h"
#include "kv_transfer_check.h"
#include "gpu_test_util.h"
#include "infinigen/calibration.h"
#include "infinigen/skew_file.h"
#include "kvflow/engine.h"
#include "model/llama_weights.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "sampling/sampler.h"
#include "structured_output/grammar_compiler.h"
#include <nlohmann/json.hpp>
#include "util/half.h"

namespace kvflow {
namespace {

using test::Greedy;

// tiny-random, or with `biases` the same model with random biases on every projection, or with
// `qk_norm` as a Qwen3 (per-head q/k norms).
LlamaWeights TinyWeights(ModelConfig* config, bool biases = false, bool qk_norm = false) {
  auto files = MakeTinyRandomModel(0x6b76666c6f77, 4, biases, qk_norm).value();
  *config = files.config;
  return LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
}

// Rounds every weight to the device dtype, so the CPU reference computes with the same weights.
void RoundWeights(LlamaWeights& w, cuda::DType t) {
  auto round = [t](std::vector<float>& v) { test::ToDeviceBytes(v, t); };
  auto round_matrix = [&](WeightMatrix& m) {
    if (!m.empty()) round(m.f32());
  };
  round_matrix(w.embed);
  round(w.final_norm);
  round_matrix(w.lm_head);
  for (auto& l : w.layers) {
    round(l.attn_norm);
    round_matrix(l.wqkv);
    round_matrix(l.wo);
    round(l.ffn_norm);
    round_matrix(l.w_gate_up);
    round_matrix(l.w_down);
    round(l.q_norm);  // 16-bit on the device like the other norms
    round(l.k_norm);
    round_matrix(l.router);
    for (auto& m : l.expert_gate_up) round_matrix(m);
    for (auto& m : l.expert_down) round_matrix(m);
    round_matrix(l.shared_gate_up);
    round_matrix(l.shared_down);
    round(l.shared_gate);
    round(l.post_attn_norm);
    round(l.post_ffn_norm);
  }
}

// The tiny model as a Gemma: Gemma-2's GeGLU, post-attention and post-MLP norms (random around 1),
// scaled embeddings, a softmax scale of its own, soft caps on the scores (2, below their spread, so
// it changes them) and on the logits (4), sliding layers (window 13) between global ones; Gemma-3
// (`gemma3`, with the tiny model's per-head q/k norms): no soft caps, and the sliding layers' own
// RoPE base (10000 against the global layers' 1e6).
void MakeGemma(ModelConfig& c, LlamaWeights& w, bool gemma3) {
  std::mt19937 rng(gemma3 ? 83 : 84);
  c.architecture = gemma3 ? "gemma3" : "gemma2";
  c.mlp_activation = MlpActivation::kGeluTanh;
  c.sandwich_norms = true;
  c.embedding_scale = std::sqrt(static_cast<float>(c.hidden_size));
  c.attention_scale = 1.0f / std::sqrt(48.0f);
  c.sliding_window = 13;
  c.global_layer_interval = 2;
  if (gemma3) {
    c.rope_theta = 1e6f;
    c.local_rope_theta = 10000.0f;
  } else {
    c.attn_logit_softcap = 2.0f;
    c.final_logit_softcap = 4.0f;
  }
  std::uniform_real_distribution<float> u(0.8f, 1.2f);
  for (LlamaLayerWeights& l : w.layers) {
    l.post_attn_norm.resize(static_cast<size_t>(c.hidden_size));
    l.post_ffn_norm.resize(static_cast<size_t>(c.hidden_size));
    for (float& x : l.post_attn_norm) x = u(rng);
    for (float& x : l.post_ffn_norm) x = u(rng);
  }
}

// The tiny model with its MLPs replaced by mixtures of random experts: Mixtral's (4 experts as wide
// as the MLP, top 2, renormalized) or Qwen2-MoE's (8 experts 96 wide, top 2 as routed, and a shared
// expert 128 wide behind a sigmoid gate).
void MakeMoe(ModelConfig& c, LlamaWeights& w, bool qwen) {
  std::mt19937 rng(qwen ? 81 : 82);
  c.architecture = qwen ? "qwen2moe" : "mixtral";
  c.num_experts = qwen ? 8 : 4;
  c.experts_per_token = 2;
  c.expert_intermediate_size = qwen ? 96 : c.intermediate_size;
  c.shared_expert_intermediate_size = qwen ? 128 : 0;
  c.norm_topk_prob = !qwen;
  const int64_t H = c.hidden_size, F = c.expert_intermediate_size, Fs = c.shared_expert_intermediate_size;
  auto random = [&](int64_t rows, int64_t cols) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const float s = std::sqrt(3.0f / static_cast<float>(cols));
    WeightPart part;
    part.rows = rows;
    part.f32.resize(static_cast<size_t>(rows * cols));
    for (float& x : part.f32) x = s * u(rng);
    WeightMatrix m;
    m.cols = cols;
    m.Append(std::move(part));
    return m;
  };
  for (LlamaLayerWeights& l : w.layers) {
    l.w_gate_up = {};
    l.w_down = {};
    l.router = random(c.num_experts, H);
    l.expert_gate_up.clear();
    l.expert_down.clear();
    for (int e = 0; e < c.num_experts; ++e) {
      l.expert_gate_up.push_back(random(2 * F, H));
      l.expert_down.push_back(random(H, F));
    }
    if (Fs > 0) {
      l.shared_gate_up = random(2 * Fs, H);
      l.shared_down = random(H, Fs);
      l.shared_gate = random(1, H).f32();
    }
  }
}

// A batch builder over a shuffled pool: each sequence owns the blocks it has touched.
class BatchPlanner {
 public:
  BatchPlanner(int num_blocks, int block_size, uint32_t seed) : block_size_(block_size) {
    free_.resize(static_cast<size_t>(num_blocks));
    std::iota(free_.begin(), free_.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  // Adds `tokens` new tokens of sequence `seq` (whose context so far is `cached` tokens).
  void Add(ForwardBatch& b, int seq, const std::vector<int32_t>& tokens, LogitsMode logits) {
    auto& table = tables_[seq];
    int& len = lens_[seq];
    SequenceSlice s;
    s.token_offset = static_cast<int32_t>(b.tokens.size());
    s.num_tokens = static_cast<int32_t>(tokens.size());
    for (int32_t t : tokens) {
      b.tokens.push_back(t);
      b.positions.push_back(len++);
    }
    s.context_len = len;
    while (static_cast<int>(table.size()) * block_size_ < len) {
      table.push_back(free_.back());
      free_.pop_back();
    }
    s.block_table = table;
    s.logits = logits;
    b.seqs.push_back(s);
  }

 private:
  int block_size_;
  std::vector<BlockId> free_;
  std::map<int, std::vector<BlockId>> tables_;
  std::map<int, int> lens_;
};

std::vector<int32_t> RandomTokens(std::mt19937& rng, int n, int vocab) {
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = d(rng);
  return v;
}

std::vector<int32_t> ArgmaxRows(const std::vector<float>& logits, int vocab) {
  std::vector<int32_t> out;
  for (size_t r = 0; r * vocab < logits.size(); ++r) {
    const float* row = logits.data() + r * vocab;
    out.push_back(static_cast<int32_t>(std::max_element(row, row + vocab) - row));
  }
  return out;
}

// The model families the tiny model comes as: Llama, Llama with every bias, Qwen3 (q/k norms) with
// every bias, Mistral with a sliding window of 13 tokens (the prompts and decodes run past it),
// Phi-3's LongRoPE (the long factors of a context 4 times the original: the RoPE table both
// backends share, with its cos/sin scale).
// Mixtral and Qwen2-MoE: MakeMoe's experts in place of the MLPs; Qwen3-MoE: the Qwen3 (per-head q/k
// norms) with Mixtral's experts (top 2, renormalized); OLMoE: Qwen2-MoE's experts without the shared
// one and one q/k norm over all heads; Gemma-2 and Gemma-3: MakeGemma's.
enum class TinyFamily {
  kLlama, kBiases, kQwen3, kSlidingWindow, kLongRope, kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe, kGemma2, kGemma3
};

// (dtype, CUDA graphs, family): biases stay fp32 on the device, added after each GEMM.
class CudaBackendLogits : public ::testing::TestWithParam<std::tuple<cuda::DType, bool, TinyFamily>> {};

TEST_P(CudaBackendLogits, MatchCpuBackendOnTinyRandom) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const auto [dtype, graphs, family] = GetParam();
  const bool moe = family == TinyFamily::kMixtral || family == TinyFamily::kQwen2Moe ||
                   family == TinyFamily::kQwen3Moe || family == TinyFamily::kOlmoe;
  const bool gemma = family == TinyFamily::kGemma2 || family == TinyFamily::kGemma3;
  const bool biases = family == TinyFamily::kBiases || family == TinyFamily::kQwen3 ||
                      family == TinyFamily::kSlidingWindow || family == TinyFamily::kLongRope;
  const bool qk_norm = family == TinyFamily::kQwen3 || family == TinyFamily::kGemma3 ||
                       family == TinyFamily::kQwen3Moe || family == TinyFamily::kOlmoe;
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config, biases, qk_norm);
  ASSERT_EQ(config.qkv_bias && config.o_bias && config.mlp_bias, biases);
  ASSERT_EQ(config.qk_norm, qk_norm);
  if (family == TinyFamily::kSlidingWindow) {
    config.architecture = "mistral";
    config.sliding_window = 13;
  }
  if (family == TinyFamily::kLongRope) {
    config.architecture = "phi3";
    RopeScaling& rope = config.rope_scaling;
    rope.type = RopeScaling::Type::kLongRope;
    rope.original_max_position_embeddings = 1024;  // of 4096: cos and sin scaled by 1.095
    for (int i = 0; i < config.head_dim / 2; ++i) {
      rope.short_factor.push_back(1.0f + 0.05f * static_cast<float>(i));
      rope.long_factor.push_back(1.0f + 0.5f * static_cast<float>(i));
    }
    ASSERT_TRUE(config.Validate().ok());
  }
  if (gemma) {
    MakeGemma(config, weights, family == TinyFamily::kGemma3);
    ASSERT_TRUE(config.Validate().ok()) << config.Validate().ToString();
  }
  if (moe) {
    const bool qwen2_style = family == TinyFamily::kQwen2Moe || family == TinyFamily::kOlmoe;
    MakeMoe(config, weights, qwen2_style);
    if (family == TinyFamily::kQwen3Moe) config.architecture = "qwen3moe";
    if (family == TinyFamily::kOlmoe) {
      config.architecture = "olmoe";
      config.shared_expert_intermediate_size = 0;
      config.qk_norm_per_head = false;  // one norm over all of q, one over all of k
      std::mt19937 rng(85);
      std::uniform_real_distribution<float> u(0.8f, 1.2f);
      for (LlamaLayerWeights& l : weights.layers) {
        l.shared_gate_up = {};
        l.shared_down = {};
        l.shared_gate.clear();
        l.q_norm.resize(static_cast<size_t>(config.num_heads * config.head_dim));
        l.k_norm.resize(static_cast<size_t>(config.num_kv_heads * config.head_dim));
        for (float& x : l.q_norm) x = u(rng);
        for (float& x : l.k_norm) x = u(rng);
      }
    }
    ASSERT_TRUE(config.Validate().ok()) << config.Validate().ToString();
  }
  RoundWeights(weights, dtype);
  const int kBlocks = 64, kBlockSize = 16;
  KvCacheLayout layout{config.num_layers, kBlocks, config.num_kv_heads, kBlockSize, config.head_dim};
  auto cpu = CpuBackend::Create(config, weights, layout, 0, 2);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  CudaBackendOptions o;
  o.dtype = dtype == cuda::DType::kF16 ? "fp16" : "bf16";
  o.block_size = kBlockSize;
  o.num_kv_blocks = kBlocks;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 128;
  o.max_model_len = 256;
  o.enable_cuda_graphs = graphs;
  auto gpu = CreateCudaBackend(config, weights, o);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  std::printf("  %s\n", gpu.value()->Describe().c_str());

  // Activation rounding of 16-bit formats over 4 layers: relative to the logit scale.
  const double tol = dtype == cuda::DType::kF16 ? 1e-2 : 6e-2;
  std::mt19937 rng(5);
  // The same slices for both backends (they only read block ids).
  BatchPlanner planner(kBlocks, kBlockSize, 99);
  auto step = [&](const ForwardBatch& b, const std::string& what) {
    std::vector<float> ref, got;
    ASSERT_TRUE(LlamaModel(*cpu.value()).Forward(b, ref).ok());
    const Status st = LlamaModel(*gpu.value()).Forward(b, got);
    ASSERT_TRUE(st.ok()) << st.ToString();
    double scale = 0.0;
    for (float x : ref) scale = std::max(scale, static_cast<double>(std::fabs(x)));
    // On a GPU (tensor cores round otherwise than the emulator) a mixture of experts may route a
    // near-tied token to another expert than the CPU: at most one such row per step is set aside,
    // counted and printed. On the emulator every row is held to the tolerance.
    const size_t V = static_cast<size_t>(config.vocab_size);
    if (moe && !test::IsEmulator()) {
      size_t worst_row = 0;
      double worst = -1.0;
      for (size_t r = 0; r * V < ref.size(); ++r) {
        double d = 0.0;
        for (size_t v = 0; v < V; ++v) d = std::max(d, static_cast<double>(std::fabs(got[r * V + v] - ref[r * V + v])));
        if (d > worst) worst = d, worst_row = r;
      }
      if (worst > tol * scale) {
        std::printf("  %s: row %zu set aside as a routing flip (max|d| %.3g)\n", what.c_str(), worst_row, worst);
        got.erase(got.begin() + static_cast<std::ptrdiff_t>(worst_row * V), got.begin() + static_cast<std::ptrdiff_t>((worst_row + 1) * V));
        ref.erase(ref.begin() + static_cast<std::ptrdiff_t>(worst_row * V), ref.begin() + static_cast<std::ptrdiff_t>((worst_row + 1) * V));
      }
    }
    // Relative error is meaningless for logits near zero: the bound is relative to the logit scale.
    if (!ref.empty()) test::ExpectClose(what, got, ref, tol * scale, 1e30);
    // Greedy choices agree wherever the reference's top two are not a near-tie.
    const auto a = ArgmaxRows(got, config.vocab_size), r = ArgmaxRows(ref, config.vocab_size);
    int agree = 0;
    for (size_t i = 0; i < a.size(); ++i) agree += a[i] == r[i];
    EXPECT_GE(agree, static_cast<int>(a.size()) * 9 / 10) << what;
  };

  {  // Prefill of three prompts, every row's logits.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 5, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 1, RandomTokens(rng, 17, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 2, RandomTokens(rng, 40, config.vocab_size), LogitsMode::kLast);
    step(b, "prefill 5 + 17 (all rows) + 40");
  }
  {  // Chunked prefill of a new prompt next to decode tokens.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 3, RandomTokens(rng, 23, config.vocab_size), LogitsMode::kNone);
    planner.Add(b, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    step(b, "decode + first prefill chunk");
  }
  {
    ForwardBatch b;
    planner.Add(b, 3, RandomTokens(rng, 30, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 2, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    step(b, "second prefill chunk + decode");
  }
  for (int i = 0; i < 6; ++i) {  // Pure decode steps (CUDA graphs when enabled).
    ForwardBatch b;
    for (int seq = 0; seq < 4; ++seq) planner.Add(b, seq, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    step(b, "decode step " + std::to_string(i) + " of 4 sequences");
  }
  for (int i = 0; i < 3; ++i) {  // A smaller decode batch: another graph bucket.
    ForwardBatch b;
    planner.Add(b, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    step(b, "decode step " + std::to_string(i) + " of 1 sequence");
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndGraphs, CudaBackendLogits,
                         ::testing::Values(std::make_tuple(cuda::DType::kF16, true, TinyFamily::kLlama),
                                           std::make_tuple(cuda::DType::kBF16, true, TinyFamily::kLlama),
                                           std::make_tuple(cuda::DType::kF16, false, TinyFamily::kLlama),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kBiases),
                                           std::make_tuple(cuda::DType::kBF16, false, TinyFamily::kBiases),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kQwen3),
                                           std::make_tuple(cuda::DType::kBF16, false, TinyFamily::kQwen3),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kSlidingWindow),
                                           std::make_tuple(cuda::DType::kBF16, false, TinyFamily::kSlidingWindow),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kLongRope),
                                           // The MoEs in fp16 only: in bf16 the router reads a hidden
                                           // state rounded to 8 bits, and near-tied experts flip
                                           // between the backends (2 and 5 of 78 rows, one token's
                                           // expert each), as they would against HF. The bf16
                                           // grouped GEMM is checked in test_moe.cc.
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kMixtral),
                                           std::make_tuple(cuda::DType::kF16, false, TinyFamily::kMixtral),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kQwen2Moe),
                                           std::make_tuple(cuda::DType::kF16, false, TinyFamily::kQwen2Moe),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kQwen3Moe),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kOlmoe),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kGemma2),
                                           std::make_tuple(cuda::DType::kBF16, false, TinyFamily::kGemma2),
                                           std::make_tuple(cuda::DType::kF16, true, TinyFamily::kGemma3)),
                         [](const auto& info) {
                           const TinyFamily f = std::get<2>(info.param);
                           return std::string(cuda::DTypeName(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_graphs" : "_eager") +
                                  (f == TinyFamily::kBiases         ? "_biases"
                                   : f == TinyFamily::kQwen3        ? "_qwen3"
                                   : f == TinyFamily::kSlidingWindow ? "_sliding_window"
                                   : f == TinyFamily::kLongRope      ? "_longrope"
                                   : f == TinyFamily::kMixtral       ? "_mixtral"
                                   : f == TinyFamily::kQwen2Moe      ? "_qwen2moe"
                                   : f == TinyFamily::kQwen3Moe      ? "_qwen3moe"
                                   : f == TinyFamily::kOlmoe         ? "_olmoe"
                                   : f == TinyFamily::kGemma2        ? "_gemma2"
                                   : f == TinyFamily::kGemma3        ? "_gemma3"
                                                                     : "");
                         });

// A small backend: 8 blocks of 16 tokens, contexts of up to 64.
CudaBackendOptions SmallOptions(int max_num_seqs = 1, int max_num_batched_tokens = 16) {
  CudaBackendOptions o;
  o.block_size = 16;
  o.num_kv_blocks = 8;
  o.max_num_seqs = max_num_seqs;
  o.max_num_batched_tokens = max_num_batched_tokens;
  o.max_model_len = 64;
  return o;
}

// What the CUDA backend refuses for `config`, on a one-sequence backend: Unsupported, naming `what`.
void ExpectRefused(const ModelConfig& config, const std::string& what) {
  auto gpu = CreateCudaBackendWithRandomWeights(config, SmallOptions(), 1);
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(gpu.status().message().find(what), std::string::npos) << gpu.status().ToString();
}

// A mixture of experts beyond the MoE kernels' limits is refused naming the limit, not run.
TEST(CudaBackend, RefusesMixturesOfExpertsBeyondItsKernels) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  TinyWeights(&config);
  config.architecture = "mixtral";
  config.num_experts = cuda::kMoeMaxExperts + 1;
  config.experts_per_token = 2;
  config.expert_intermediate_size = config.intermediate_size;
  ExpectRefused(config, "at most 1024 experts");
  config.num_experts = 8;
  config.expert_intermediate_size = 100;  // rows of 200 bytes: not 16-byte aligned
  ExpectRefused(config, "multiples of 8");
}

// An expert matrix of the wrong shape is refused naming it, not copied over its neighbour's slot.
TEST(CudaBackend, RefusesMisshapenExperts) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  MakeMoe(config, weights, /*qwen=*/false);
  WeightMatrix& down = weights.layers[1].expert_down[3];
  down.rows -= 8;
  down.parts[0].rows -= 8;
  down.parts[0].f32.resize(static_cast<size_t>(down.rows * down.cols));
  auto gpu = CreateCudaBackend(config, weights, SmallOptions());
  ASSERT_FALSE(gpu.ok());
  EXPECT_NE(gpu.status().message().find("layer 1 expert 3"), std::string::npos) << gpu.status().ToString();
}

// The random-weight path (random:<shape>) fills every tensor of a mixture of experts with a shared
// expert and of a Gemma-2 on the device: a prefill and a decode step give finite, varied logits.
TEST(CudaBackend, RandomWeightMoeAndGemmaRun) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (const bool gemma : {false, true}) {
    ModelConfig config;
    LlamaWeights weights = TinyWeights(&config);
    if (gemma) {
      MakeGemma(config, weights, /*gemma3=*/false);
    } else {
      MakeMoe(config, weights, /*qwen=*/true);
    }
    auto gpu = CreateCudaBackendWithRandomWeights(config, SmallOptions(2, 32), 7);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    BatchPlanner planner(8, 16, 3);
    std::mt19937 rng(8);
    for (int step = 0; step < 2; ++step) {
      ForwardBatch b;
      planner.Add(b, 0, RandomTokens(rng, step == 0 ? 20 : 1, config.vocab_size), LogitsMode::kLast);
      std::vector<float> logits;
      const Status st = LlamaModel(*gpu.value()).Forward(b, logits);
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_EQ(logits.size(), static_cast<size_t>(config.vocab_size));
      const auto [lo, hi] = std::minmax_element(logits.begin(), logits.end());
      for (float x : logits) ASSERT_TRUE(std::isfinite(x)) << config.architecture;
      EXPECT_GT(*hi - *lo, 1e-3f) << config.architecture << ": constant logits";
      if (gemma) EXPECT_LE(*hi, config.final_logit_softcap) << "the final soft cap";
    }
  }
}

// The small CUDA backends the tests make: a pool of `blocks` blocks of `block_size` tokens, at most 4
// sequences of 256 tokens, `step_tokens` tokens a step.
CudaBackendOptions SmallCudaOptions(const std::string& dtype, int blocks, int block_size, int step_tokens) {
  CudaBackendOptions o;
  o.dtype = dtype;
  o.block_size = block_size;
  o.num_kv_blocks = blocks;
  o.max_num_seqs = 4;
  o.max_num_batched_tokens = step_tokens;
  o.max_model_len = 256;
  return o;
}

// The same weights on the CPU backend and the CUDA backend, each with a pool of `blocks` blocks
// (at most 4 sequences of 256 tokens, 128 tokens a step).
std::pair<std::unique_ptr<CpuBackend>, std::unique_ptr<Backend>> CpuAndCudaBackends(const ModelConfig& config,
                                                                                 const LlamaWeights& weights,
                                                                                 cuda::DType dtype, int blocks,
                                                                                 int block_size) {
  KvCacheLayout layout{config.num_layers, blocks, config.num_kv_heads, block_size, config.head_dim};
  const CudaBackendOptions o = SmallCudaOptions(cuda::DTypeName(dtype), blocks, block_size, 128);
  return {CpuBackend::Create(config, weights, layout, 0, 2).value(), CreateCudaBackend(config, weights, o).value()};
}

// KV views (issue 13): a block subset of each sequence's table, for decode and prefill slices,
// gives the CPU backend's logits over the same subset; the same view as an explicit slot list
// (gathered into scratch blocks) gives exactly the block subset's logits; a host hook runs on every
// step even where graphs would be replayed.
class CountingHooks : public LayerHooks {
 public:
  Status BeforeAttention(const LayerContext& ctx) override {
    ++calls;
    return Status::Ok();
  }
  int calls = 0;
};

TEST(CudaBackendViews, BlockSubsetsMatchCpuAndEqualTheirSlotViews) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  RoundWeights(weights, cuda::DType::kF16);
  const int kBlocks = 48, kBlockSize = 16;
  auto [cpu, gpu] = CpuAndCudaBackends(config, weights, cuda::DType::kF16, kBlocks, kBlockSize);
  std::mt19937 rng(8);
  BatchPlanner planner(kBlocks, kBlockSize, 17);
  std::vector<std::vector<BlockId>> tables(2);
  {  // Two prompts of 3 and 4 blocks, the same K/V in both backends.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 40, config.vocab_size), LogitsMode::kNone);
    planner.Add(b, 1, RandomTokens(rng, 60, config.vocab_size), LogitsMode::kNone);
    std::vector<float> unused;
    ASSERT_TRUE(LlamaModel(*cpu).Forward(b, unused).ok());
    ASSERT_TRUE(LlamaModel(*gpu).Forward(b, unused).ok());
    tables[0] = b.seqs[0].block_table;
    tables[1] = b.seqs[1].block_table;
  }
  // Sequence 0 decodes over blocks {0, 2} of its table (the token lands in block 2); sequence 1
  // prefills 4 more tokens (filling block 3) over blocks {1, 3} (retrieval-style: blocks 0 and 2
  // left out).
  ForwardBatch b;
  planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
  planner.Add(b, 1, RandomTokens(rng, 4, config.vocab_size), LogitsMode::kAll);
  b.seqs[0].view = KvView::BlockSubset({tables[0][0], tables[0][2]}, kBlockSize + (41 - 2 * kBlockSize));
  b.seqs[1].view = KvView::BlockSubset({tables[1][1], tables[1][3]}, 2 * kBlockSize);
  std::vector<float> ref, got;
  ASSERT_TRUE(LlamaModel(*cpu).Forward(b, ref).ok());
  const Status st = LlamaModel(*gpu).Forward(b, got);
  ASSERT_TRUE(st.ok()) << st.ToString();
  double scale = 0.0;
  for (float x : ref) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  test::ExpectClose("block-subset views", got, ref, 1e-2 * scale, 1e30);

  // The same step with the full tables differs: the subset really changed what attention read.
  ForwardBatch full = b;
  for (auto& s : full.seqs) s.view = KvView::Full();
  std::vector<float> full_logits;
  ASSERT_TRUE(LlamaModel(*cpu).Forward(full, full_logits).ok());
  double diff = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(ref[i] - full_logits[i])));
  EXPECT_GT(diff, 1e-3 * scale);

  // Sequence 0's block subset as the explicit list of its slots: gathered in view order into
  // scratch blocks, the decode kernel reads exactly the same K/V in the same order (the step
  // rewrites its own K/V with the same values).
  ForwardBatch slots = b;
  std::vector<int64_t> s0;
  ViewSlots(slots.seqs[0], kBlockSize, s0);
  slots.seqs[0].view = KvView::Slots(s0);
  std::vector<float> got_slots;
  const Status via_slots = LlamaModel(*gpu).Forward(slots, got_slots);
  ASSERT_TRUE(via_slots.ok()) << via_slots.ToString();
  EXPECT_EQ(got_slots, got) << "a slot view of a block subset's slots gives the block subset's logits";

  // Graph-eligible decode steps with a host hook: the hook sees every step (no replay skips it).
  CountingHooks hooks;
  for (int i = 0; i < 3; ++i) {
    ForwardBatch d;
    planner.Add(d, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    ASSERT_TRUE(LlamaModel(*gpu, &hooks).Forward(d, got).ok());
  }
  EXPECT_EQ(hooks.calls, 3 * config.num_layers);
}

// TriForce's chunk scoring on the backends (ScoreKvBlocks / ReadKvBlockScores /
// SelectTopKvBlocks): a hook scores every sequence's blocks before each layer's attention (after
// WriteKv, so the step's own token counts) on the CPU and the CUDA backend. The scores agree within
// the 16-bit activation rounding (the CUDA backend's Q and K are fp16/bf16, the CPU's fp32; the
// kernels themselves are checked tightly in test_kv_block_select.cc); the CUDA selection equals
// cpu::SelectTopKvBlocks on the CUDA backend's own scores, index for index.
class ChunkScoringHooks : public LayerHooks {
 public:
  Status BeforeAttention(const LayerContext& ctx) override {
    return ctx.backend.As<KvBlockScoring>()->ScoreKvBlocks(ctx.layer, jobs);
  }
  std::vector<KvBlockScoreJob> jobs;
  bool claim_capturable = false;
  bool capturable() const override { return claim_capturable; }
};

TEST(CudaBackendChunkScores, MatchCpuBackendAndSelectLikeTheCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (cuda::DType dtype : {cuda::DType::kF16, cuda::DType::kBF16}) {
    SCOPED_TRACE(cuda::DTypeName(dtype));
    ModelConfig config;
    LlamaWeights weights = TinyWeights(&config);
    RoundWeights(weights, dtype);
    const int kBlocks = 48, kBlockSize = 16;
    auto [cpu, gpu] = CpuAndCudaBackends(config, weights, dtype, kBlocks, kBlockSize);
    std::mt19937 rng(31);
    BatchPlanner planner(kBlocks, kBlockSize, 23);
    {  // Prompts of 70 and 45 tokens: the same K in both backends' pools (shuffled blocks).
      ForwardBatch b;
      planner.Add(b, 0, RandomTokens(rng, 70, config.vocab_size), LogitsMode::kNone);
      planner.Add(b, 1, RandomTokens(rng, 45, config.vocab_size), LogitsMode::kNone);
      std::vector<float> unused;
      ASSERT_TRUE(LlamaModel(*cpu).Forward(b, unused).ok());
      ASSERT_TRUE(LlamaModel(*gpu).Forward(b, unused).ok());
    }
    // Scoring needs a step: outside one it is refused.
    ChunkScoringHooks hooks;
    EXPECT_FALSE(gpu->As<KvBlockScoring>()->ScoreKvBlocks(0, hooks.jobs).ok());

    // A decode step of both sequences; each one's last row scores all its blocks (the last one
    // partial: 71 and 46 tokens), at offsets with a gap between them.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    int64_t size = 0;
    for (const SequenceSlice& s : b.seqs) {
      KvBlockScoreJob job;
      job.row = s.token_offset + s.num_tokens - 1;
      job.blocks = s.block_table;
      job.num_tokens = s.context_len;
      job.score_offset = size + 2;
      size = job.score_offset + static_cast<int64_t>(job.blocks.size());
      hooks.jobs.push_back(job);
    }
    // Reset grows the buffer and zeroes it (the GPU's fresh memory would be NaN otherwise).
    ASSERT_TRUE(cpu->As<KvBlockScoring>()->ResetKvBlockScores(size).ok());
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->ResetKvBlockScores(size).ok());
    std::vector<float> unused;
    ASSERT_TRUE(LlamaModel(*cpu, &hooks).Forward(b, unused).ok());
    const Status st = LlamaModel(*gpu, &hooks).Forward(b, unused);
    ASSERT_TRUE(st.ok()) << st.ToString();

    std::vector<float> ref(static_cast<size_t>(size)), got(static_cast<size_t>(size));
    ASSERT_TRUE(cpu->As<KvBlockScoring>()->ReadKvBlockScores(0, ref).ok());
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->ReadKvBlockScores(0, got).ok());
    EXPECT_FALSE(gpu->As<KvBlockScoring>()->ReadKvBlockScores(1, got).ok()) << "a read past the buffer is refused";
    double max_abs = 0.0;
    for (const KvBlockScoreJob& job : hooks.jobs) {
      double mass = 0.0;
      for (size_t i = 0; i < job.blocks.size(); ++i) {
        const size_t at = static_cast<size_t>(job.score_offset) + i;
        max_abs = std::max(max_abs, std::fabs(double(got[at]) - ref[at]));
        mass += got[at];
      }
      // Every layer's every query head adds a softmax: num_layers x num_heads in all.
      EXPECT_NEAR(mass, config.num_layers * config.num_heads, 1e-4);
    }
    for (int64_t i : {0, 1}) EXPECT_EQ(got[static_cast<size_t>(i)], 0.0f) << "score outside every job";
    std::printf("  chunk scores %s, %d layers x %d heads, %d + %d blocks: max|gpu - cpu| = %.3g%s\n",
                cuda::DTypeName(dtype), config.num_layers, config.num_heads,
                static_cast<int>(hooks.jobs[0].blocks.size()), static_cast<int>(hooks.jobs[1].blocks.size()),
                max_abs, test::IsEmulator() ? "  [emulator]" : "");
    // Scores lie in [0, num_layers x num_heads]; 16-bit Q and K move each softmax a little.
    // (Measured: fp16 3e-3, bf16 2e-2 of the 8 here.)
    EXPECT_LT(max_abs, (dtype == cuda::DType::kF16 ? 2e-3 : 1e-2) * config.num_layers * config.num_heads);

    // Selection on the backend: the CPU reference's indices on the same (the GPU's) scores.
    const int64_t n0 = static_cast<int64_t>(hooks.jobs[0].blocks.size());
    const int64_t n1 = static_cast<int64_t>(hooks.jobs[1].blocks.size());
    const std::vector<KvBlockSelectJob> select = {
        {hooks.jobs[0].score_offset, static_cast<int32_t>(n0), 1, 1, 3},
        {hooks.jobs[1].score_offset, static_cast<int32_t>(n1), 0, 1, 2},
        {hooks.jobs[0].score_offset, static_cast<int32_t>(n0), 3, 3, 4},   // forced blocks fill k
        {hooks.jobs[1].score_offset, static_cast<int32_t>(n1), 1, 0, 10},  // k beyond the blocks
        {0, static_cast<int32_t>(size), 0, 0, 5},                         // across both (and the zeros)
        {0, 0, 1, 1, 2},                                                  // no blocks
    };
    std::vector<int32_t> want, chosen = {42};
    cpu::SelectTopKvBlocks(select, got, want);
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->SelectTopKvBlocks(select, chosen).ok());
    EXPECT_EQ(chosen, want);
    // Where the choice does not depend on the scores (forced blocks fill k; k covers every block)
    // both backends choose alike.
    std::vector<int32_t> cpu_chosen;
    ASSERT_TRUE(cpu->As<KvBlockScoring>()->SelectTopKvBlocks(std::span(select).subspan(2, 2), cpu_chosen).ok());
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->SelectTopKvBlocks(std::span(select).subspan(2, 2), chosen).ok());
    EXPECT_EQ(chosen, cpu_chosen);
    // Jobs outside the buffer are refused.
    const std::vector<KvBlockSelectJob> bad = {{size - 1, 2, 0, 0, 1}};
    EXPECT_FALSE(gpu->As<KvBlockScoring>()->SelectTopKvBlocks(bad, chosen).ok());

    // Reset zeroes the scores again.
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->ResetKvBlockScores(size).ok());
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->ReadKvBlockScores(0, got).ok());
    EXPECT_EQ(*std::max_element(got.begin(), got.end()), 0.0f);

    // Hooks that wrongly claim to be capturable on graph-eligible decode steps: a graph would replay
    // the first step's jobs, so the backend refuses to capture the scoring and runs the steps
    // eagerly; every step still scores (the same blocks: sequence 1 reaches 48 tokens, a full last block).
    hooks.claim_capturable = true;
    ASSERT_TRUE(cpu->As<KvBlockScoring>()->ResetKvBlockScores(size).ok());
    for (int step = 0; step < 2; ++step) {
      ForwardBatch d;
      planner.Add(d, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
      planner.Add(d, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
      for (size_t j = 0; j < hooks.jobs.size(); ++j) {
        ASSERT_EQ(d.seqs[j].block_table, hooks.jobs[j].blocks);
        hooks.jobs[j].num_tokens = d.seqs[j].context_len;
      }
      ASSERT_TRUE(LlamaModel(*cpu, &hooks).Forward(d, unused).ok());
      const Status graph_step = LlamaModel(*gpu, &hooks).Forward(d, unused);
      ASSERT_TRUE(graph_step.ok()) << graph_step.ToString();
    }
    ASSERT_TRUE(cpu->As<KvBlockScoring>()->ReadKvBlockScores(0, ref).ok());
    ASSERT_TRUE(gpu->As<KvBlockScoring>()->ReadKvBlockScores(0, got).ok());
    double graph_max_abs = 0.0, total = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      graph_max_abs = std::max(graph_max_abs, std::fabs(double(got[i]) - ref[i]));
      total += got[i];
    }
    EXPECT_NEAR(total, 2.0 * hooks.jobs.size() * config.num_layers * config.num_heads, 1e-3);
    std::printf("  chunk scores %s over 2 graph-eligible decode steps: max|gpu - cpu| = %.3g\n", cuda::DTypeName(dtype),
                graph_max_abs);
    EXPECT_LT(graph_max_abs, (dtype == cuda::DType::kF16 ? 6e-3 : 3e-2) * config.num_layers * config.num_heads);
  }
}

// Token- and layer-range transfers between the device pool and the pinned host pool (2D copies).
TEST(CudaBackendBlocks, TransferredKvDecodesLikeTheOriginal) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  CudaBackendOptions o;
  o.dtype = "bf16";
  o.block_size = 8;
  o.num_kv_blocks = 16;
  o.num_host_blocks = 4;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 64;
  o.max_model_len = 64;
  auto gpu = CreateCudaBackend(config, weights, o).value();
  test::ExpectTransferredKvDecodesAlike(*gpu, 6);
}

// KV-Runahead's wire format on CUDA (Backend::PackKv / UnpackKv, kv_runahead/chain_prefill.h): a layer's
// K/V packed from one backend's pool and unpacked at other slots of a second backend (another
// rank) decode exactly alike, and the packed values are the CPU backend's within fp16 rounding of
// the computation.
TEST(CudaBackendBlocks, PackedKvUnpacksOnAnotherRankAndMatchesCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  RoundWeights(weights, cuda::DType::kF16);
  CudaBackendOptions o;
  o.dtype = "fp16";
  o.block_size = 16;
  o.num_kv_blocks = 32;
  o.num_host_blocks = 0;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 128;
  o.max_model_len = 256;
  auto sender = CreateCudaBackend(config, weights, o).value();
  auto receiver = CreateCudaBackend(config, weights, o).value();
  KvCacheLayout layout{config.num_layers, 32, config.num_kv_heads, 16, config.head_dim};
  auto cpu = CpuBackend::Create(config, weights, layout, 0, 2, cpu::KvElement::kF16).value();
  std::mt19937 rng(17);
  const std::vector<int32_t> prompt = RandomTokens(rng, 70, config.vocab_size);
  const std::vector<BlockId> table_a = {3, 9, 1, 12, 7}, table_b = {20, 2, 31, 5, 14};
  auto prefill = [&](Backend& backend, const std::vector<BlockId>& table) {
    ForwardBatch b;
    b.tokens = prompt;
    for (int i = 0; i < 70; ++i) b.positions.push_back(i);
    SequenceSlice slice;
    slice.num_tokens = 70;
    slice.context_len = 70;
    slice.block_table = table;
    slice.logits = LogitsMode::kNone;
    b.seqs.push_back(slice);
    std::vector<float> unused;
    const Status st = LlamaModel(backend).Forward(b, unused);
    ASSERT_TRUE(st.ok()) << st.ToString();
  };
  prefill(*sender, table_a);
  prefill(*cpu, table_a);
  std::vector<int64_t> slots_a, slots_b;
  for (int pos = 0; pos < 70; ++pos) {
    slots_a.push_back(SlotOf(table_a, pos, 16));
    slots_b.push_back(SlotOf(table_b, pos, 16));
  }
  std::vector<std::byte> packed(static_cast<size_t>(KvPackBytes(*sender, 70))), from_cpu(packed.size());
  double max_err = 0.0, max_ref = 0.0;
  for (int layer = 0; layer < config.num_layers; ++layer) {
    ASSERT_TRUE(sender->As<KvPacking>()->PackKv(layer, slots_a, packed).ok());
    ASSERT_TRUE(cpu->As<KvPacking>()->PackKv(layer, slots_a, from_cpu).ok());
    const auto* ours = reinterpret_cast<const uint16_t*>(packed.data());
    const auto* ref = reinterpret_cast<const uint16_t*>(from_cpu.data());
    for (size_t i = 0; i < packed.size() / 2; ++i) {
      max_err = std::max(max_err, std::fabs(double(HalfBitsToFloat(ours[i])) - HalfBitsToFloat(ref[i])));
      max_ref = std::max(max_ref, std::fabs(double(HalfBitsToFloat(ref[i]))));
    }
    const Status st = receiver->As<KvPacking>()->UnpackKv(layer, slots_b, packed);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  std::printf("  packed fp16 K/V, CUDA vs CPU backend: max|diff| = %.3g (max|K/V| %.3g)\n", max_err, max_ref);
  EXPECT_GT(max_ref, 0.1) << "the pool holds real K/V";
  // fp16 weights and activations on the device, fp32 on the CPU: a few fp16 ulps of the largest.
  EXPECT_LT(max_err, 1e-2 * max_ref);
  // One decode step over the moved cache: the same logits as over the original.
  auto decode = [&](Backend& backend, const std::vector<BlockId>& table) {
    ForwardBatch b;
    b.tokens = {prompt[5]};
    b.positions = {70};
    SequenceSlice slice;
    slice.num_tokens = 1;
    slice.context_len = 71;
    slice.block_table = table;
    b.seqs.push_back(slice);
    std::vector<float> logits;
    const Status st = LlamaModel(backend).Forward(b, logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return logits;
  };
  EXPECT_EQ(decode(*sender, table_a), decode(*receiver, table_b));
  std::vector<std::byte> small(packed.size() - 2);
  EXPECT_EQ(sender->As<KvPacking>()->PackKv(0, slots_a, small).code(), StatusCode::kInvalidArgument);
}

// Explicit slot views (KvView::kSlots) on CUDA: each layer gathers them into scratch blocks and the
// attention kernels run over synthetic tables into it. Sinks + window and shuffled slot subsets,
// for decode and prefill slices, next to slices reading the pool (full and block-subset views) in
// the same step, and an all-decode step that graphs would otherwise replay: the CPU backend's
// logits. Views needing more scratch than max_gathered_tokens are refused clearly.

// Prefills prompts of 50, 70 and 30 tokens (sequences 0, 1, 2) through both backends, so their
// pools hold the same K/V.
void PrefillSameKv(Backend& cpu, Backend& gpu, BatchPlanner& planner, std::mt19937& rng, int vocab) {
  ForwardBatch b;
  planner.Add(b, 0, RandomTokens(rng, 50, vocab), LogitsMode::kNone);
  planner.Add(b, 1, RandomTokens(rng, 70, vocab), LogitsMode::kNone);
  planner.Add(b, 2, RandomTokens(rng, 30, vocab), LogitsMode::kNone);
  std::vector<float> unused;
  ASSERT_TRUE(LlamaModel(cpu).Forward(b, unused).ok());
  const Status st = LlamaModel(gpu).Forward(b, unused);
  ASSERT_TRUE(st.ok()) << st.ToString();
}

TEST(CudaBackendViews, SlotViewsMatchCpuForDecodeAndPrefill) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  RoundWeights(weights, cuda::DType::kF16);
  const int kBlocks = 64, kBlockSize = 16;
  KvCacheLayout layout{config.num_layers, kBlocks, config.num_kv_heads, kBlockSize, config.head_dim};
  auto cpu = CpuBackend::Create(config, weights, layout, 0, 2).value();
  CudaBackendOptions o = SmallCudaOptions("fp16", kBlocks, kBlockSize, 160);
  o.max_gathered_tokens = 90;  // 6 blocks of scratch
  auto gpu = CreateCudaBackend(config, weights, o).value();
  std::mt19937 rng(31);
  BatchPlanner planner(kBlocks, kBlockSize, 23);
  PrefillSameKv(*cpu, *gpu, planner, rng, config.vocab_size);  // prompts of 50, 70 and 30 tokens
  if (::testing::Test::HasFatalFailure()) return;
  auto slot = [&](const SequenceSlice& s, int pos) {
    return static_cast<int64_t>(s.block_table[static_cast<size_t>(pos / kBlockSize)]) * kBlockSize + pos % kBlockSize;
  };
  // `keep` of the slice's earlier tokens in random order, then its own tokens in order.
  auto shuffled = [&](const SequenceSlice& s, int keep) {
    std::vector<int64_t> v;
    for (int pos = 0; pos < s.context_len - s.num_tokens; ++pos) v.push_back(slot(s, pos));
    std::shuffle(v.begin(), v.end(), rng);
    v.resize(static_cast<size_t>(keep));
    for (int pos = s.context_len - s.num_tokens; pos < s.context_len; ++pos) v.push_back(slot(s, pos));
    return KvView::Slots(v);
  };
  auto sinks_and_window = [&](const SequenceSlice& s, int sinks, int window) {
    return KvView::SinksAndWindow(s.block_table, s.context_len, sinks, window, kBlockSize);
  };
  double worst = 0.0;
  auto step = [&](const ForwardBatch& b, const std::string& what) {
    std::vector<float> ref, got;
    ASSERT_TRUE(LlamaModel(*cpu).Forward(b, ref).ok());
    const Status st = LlamaModel(*gpu).Forward(b, got);
    ASSERT_TRUE(st.ok()) << what << ": " << st.ToString();
    double scale = 0.0;
    for (float x : ref) scale = std::max(scale, static_cast<double>(std::fabs(x)));
    test::ExpectClose(what, got, ref, 1e-2 * scale, 1e30);
    const test::ErrorStats e = test::CompareArrays(got, ref);
    worst = std::max(worst, e.max_abs / scale);
  };

  ForwardBatch last;
  {  // Mixed: gathered decode and prefill next to a full-view decode.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 1, RandomTokens(rng, 5, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 2, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    b.seqs[0].view = sinks_and_window(b.seqs[0], 4, 20);  // 24 of 51 tokens
    b.seqs[1].view = shuffled(b.seqs[1], 25);             // 30 of 75 tokens
    step(b, "slot views: sinks+window decode, shuffled prefill, full decode");
  }
  {  // Only decode slices (graph-eligible but for the slot views): runs eagerly.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    b.seqs[0].view = sinks_and_window(b.seqs[0], 4, 16);
    b.seqs[1].view = shuffled(b.seqs[1], 40);
    step(b, "slot views: all-decode step");
    last = b;
  }
  {  // More gather blocks than max_gathered_tokens (6) provides, though each view alone fits.
    ForwardBatch big = last;
    big.seqs[0].view = sinks_and_window(big.seqs[0], 4, 40);  // 44 tokens: 3 blocks
    big.seqs[1].view = shuffled(big.seqs[1], 49);             // 50 tokens: 4 blocks
    std::vector<float> unused;
    const Status refused = LlamaModel(*gpu).Forward(big, unused);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("max_gathered_tokens"), std::string::npos) << refused.ToString();
    std::printf("  oversize slot views -> %s\n", refused.ToString().c_str());
  }
  {  // Gathered prefills next to a pool prefill and a block-subset decode; views that end mid-block.
    ForwardBatch b;
    planner.Add(b, 2, RandomTokens(rng, 6, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 0, RandomTokens(rng, 3, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 1, RandomTokens(rng, 9, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 3, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);  // a new 1-token sequence
    b.seqs[0].view = sinks_and_window(b.seqs[0], 8, 25);  // 33 of 37 tokens: 3 scratch blocks
    b.seqs[2].view = shuffled(b.seqs[2], 17);             // 26 of 87 tokens: 2 scratch blocks
    b.seqs[3].view = KvView::BlockSubset({b.seqs[3].block_table[0]}, 1);
    step(b, "slot views: gathered prefills, pool prefill and block-subset decode");

    // The views mattered: the same step over full views gives other logits (CPU only, last step).
    ForwardBatch full = b;
    for (auto& sl : full.seqs) sl.view = KvView::Full();
    std::vector<float> with_views, without;
    ASSERT_TRUE(LlamaModel(*cpu).Forward(b, with_views).ok());
    ASSERT_TRUE(LlamaModel(*cpu).Forward(full, without).ok());
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < with_views.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(with_views[i] - without[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(with_views[i])));
    }
    EXPECT_GT(diff, 1e-2 * scale);
  }
  std::printf("  slot views: worst max|d| / logit scale = %.3g\n", worst);
}

// ---- token selections (InfiniGen, H2O) ------------------------------------------------------------

// Per layer: the selections attention reads, and what the step's activations held after it.
class SelectionProbe : public LayerHooks {
 public:
  std::vector<KvHeadSelection> selection;
  std::vector<std::vector<float>> attention;       // per layer: kAttention of every row
  std::vector<std::vector<float>> speculative_qkv; // per layer: kSpeculativeQkv of every row

  std::span<const KvHeadSelection> AttentionSelection(const LayerContext&) override { return selection; }
  Status AfterAttention(const LayerContext& ctx) override {
    const ModelConfig& mc = ctx.backend.model_config();
    const int64_t rows = static_cast<int64_t>(ctx.batch.tokens.size());
    auto read = [&](Activation which, std::vector<std::vector<float>>& into) -> Status {
      into.resize(static_cast<size_t>(mc.num_layers));
      std::vector<float>& out = into[static_cast<size_t>(ctx.layer)];
      out.assign(static_cast<size_t>(rows * ActivationWidth(mc, which)), 0.0f);
      return ctx.backend.ReadActivationRows(which, 0, rows, out);
    };
    KVFLOW_RETURN_IF_ERROR(read(Activation::kAttention, attention));
    // InfiniGen's mid-layer projection: the layer's norm of the residual into the second QKV buffer
    // (kHidden is free once the QKV projection has read it).
    KVFLOW_RETURN_IF_ERROR(ctx.backend.RmsNorm(ctx.layer, LayerWeight::kAttnNorm, /*add_delta=*/false));
    KVFLOW_RETURN_IF_ERROR(ctx.backend.Linear(ctx.layer, LayerWeight::kQkv, Activation::kHidden,
                                              Activation::kSpeculativeQkv));
    return read(Activation::kSpeculativeQkv, speculative_qkv);
  }
};

// AttentionOverSelection, ReadActivationRows, ReadKv and the second QKV buffer against the CPU
// backend on the same (fp16-rounded) weights: decode slices over random per-KV-head selections (in
// random order, each head its own tokens), next to a prefill slice over its own view, then a prefill
// slice over a selection of its own; each layer's attention output and the logits compared.
TEST(CudaBackend, AttentionOverSelectionMatchesCpu) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  RoundWeights(weights, cuda::DType::kF16);
  const int kBlocks = 64, kBlockSize = 16, KV = config.num_kv_heads;
  KvCacheLayout layout{config.num_layers, kBlocks, config.num_kv_heads, kBlockSize, config.head_dim};
  auto cpu = CpuBackend::Create(config, weights, layout, 0, 2).value();
  CudaBackendOptions o = SmallCudaOptions("fp16", kBlocks, kBlockSize, 160);
  auto gpu = CreateCudaBackend(config, weights, o).value();
  std::mt19937 rng(41);
  BatchPlanner planner(kBlocks, kBlockSize, 29);
  PrefillSameKv(*cpu, *gpu, planner, rng, config.vocab_size);  // prompts of 50, 70 and 30 tokens
  if (::testing::Test::HasFatalFailure()) return;
  auto slot = [&](const SequenceSlice& s, int pos) {
    return static_cast<int64_t>(s.block_table[static_cast<size_t>(pos / kBlockSize)]) * kBlockSize + pos % kBlockSize;
  };
  // Per KV head `keep` of the slice's earlier tokens in random order, then its own tokens in order.
  auto select = [&](const SequenceSlice& s, int keep) {
    KvHeadSelection sel;
    sel.per_head = keep + s.num_tokens;
    for (int h = 0; h < KV; ++h) {
      std::vector<int64_t> earlier;
      for (int pos = 0; pos < s.context_len - s.num_tokens; ++pos) earlier.push_back(slot(s, pos));
      std::shuffle(earlier.begin(), earlier.end(), rng);
      sel.slots.insert(sel.slots.end(), earlier.begin(), earlier.begin() + keep);
      for (int pos = s.context_len - s.num_tokens; pos < s.context_len; ++pos) sel.slots.push_back(slot(s, pos));
    }
    return sel;
  };

  double worst_attention = 0.0, worst_logits = 0.0, worst_projection = 0.0;
  auto step = [&](const ForwardBatch& b, std::vector<KvHeadSelection> selection, const std::string& what) {
    SelectionProbe on_cpu, on_gpu;
    on_cpu.selection = selection;
    on_gpu.selection = selection;
    std::vector<float> ref, got;
    ASSERT_TRUE(LlamaModel(*cpu, &on_cpu).Forward(b, ref).ok());
    const Status st = LlamaModel(*gpu, &on_gpu).Forward(b, got);
    ASSERT_TRUE(st.ok()) << what << ": " << st.ToString();
    for (int l = 0; l < config.num_layers; ++l) {
      const auto& r = on_cpu.attention[static_cast<size_t>(l)];
      double scale = 0.0;
      for (float x : r) scale = std::max(scale, static_cast<double>(std::fabs(x)));
      const test::ErrorStats e = test::CompareArrays(on_gpu.attention[static_cast<size_t>(l)], r);
      EXPECT_LT(e.max_abs, 2e-2 * scale) << what << ", layer " << l;
      worst_attention = std::max(worst_attention, e.max_abs / scale);
      const auto& pr = on_cpu.speculative_qkv[static_cast<size_t>(l)];
      double pscale = 0.0;
      for (float x : pr) pscale = std::max(pscale, static_cast<double>(std::fabs(x)));
      const test::ErrorStats pe = test::CompareArrays(on_gpu.speculative_qkv[static_cast<size_t>(l)], pr);
      EXPECT_LT(pe.max_abs, 2e-2 * pscale) << what << ", layer " << l << " (speculative QKV)";
      worst_projection = std::max(worst_projection, pe.max_abs / pscale);
    }
    double scale = 0.0;
    for (float x : ref) scale = std::max(scale, static_cast<double>(std::fabs(x)));
    test::ExpectClose(what, got, ref, 2e-2 * scale, 1e30);
    worst_logits = std::max(worst_logits, test::CompareArrays(got, ref).max_abs / scale);

    // The selections mattered: the same step over the views gives other attention (CPU).
    SelectionProbe plain;
    plain.selection.assign(b.seqs.size(), KvHeadSelection{});
    std::vector<float> unused;
    ASSERT_TRUE(LlamaModel(*cpu, &plain).Forward(b, unused).ok());
    const test::ErrorStats moved = test::CompareArrays(plain.attention.back(), on_cpu.attention.back());
    EXPECT_GT(moved.max_abs, 1e-2) << what;
  };

  {  // Two decode slices over selections, a prefill slice over its whole table.
    ForwardBatch b;
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 2, RandomTokens(rng, 7, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 1, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    std::vector<KvHeadSelection> selection(3);
    selection[0] = select(b.seqs[0], 20);  // 21 of 51 tokens: 2 scratch blocks
    selection[2] = select(b.seqs[2], 33);  // 34 of 71 tokens: 3 scratch blocks
    step(b, selection, "selections: 2 selected decodes + a prefill over its view");
  }
  {  // A prefill slice over a selection of its own, next to a decode over its view and a selected decode.
    ForwardBatch b;
    planner.Add(b, 1, RandomTokens(rng, 5, config.vocab_size), LogitsMode::kAll);
    planner.Add(b, 2, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    planner.Add(b, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);
    std::vector<KvHeadSelection> selection(3);
    selection[0] = select(b.seqs[0], 16);  // 21 of 76 tokens
    selection[2] = select(b.seqs[2], 1);   // 2 of 52 tokens
    step(b, selection, "selections: a selected prefill, a decode over its view, a selected decode");
  }
  {  // ReadKv: K and V rows of scattered slots, layer 1, as fp32.
    std::vector<int64_t> slots;
    for (int i = 0; i < 37; ++i) slots.push_back(static_cast<int64_t>(rng() % (kBlocks * kBlockSize)));
    double worst = 0.0;
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<float> ref(slots.size() * KV * config.head_dim), got(ref.size());
      ASSERT_TRUE(cpu->ReadKv(1, kv, slots, ref).ok());
      const Status st = gpu->ReadKv(1, kv, slots, got);
      ASSERT_TRUE(st.ok()) << st.ToString();
      double scale = 0.0;
      for (float x : ref) scale = std::max(scale, static_cast<double>(std::fabs(x)));
      worst = std::max(worst, test::CompareArrays(got, ref).max_abs / std::max(scale, 1e-30));
    }
    std::printf("  ReadKv (K and V, 37 scattered slots): worst max|d| / scale = %.3g\n", worst);
    EXPECT_LT(worst, 1e-2);
  }
  std::printf("  selections: worst max|d| / scale: attention %.3g, speculative QKV %.3g, logits %.3g\n",
              worst_attention, worst_projection, worst_logits);
}

// Copy-on-write and swap round trips move exactly the blocks asked for.
TEST(CudaBackendBlocks, CopyAndSwapRoundTripsPreserveTheCache) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  CudaBackendOptions o;
  o.dtype = "fp16";
  o.block_size = 8;
  o.num_kv_blocks = 32;
  o.num_host_blocks = 16;
  o.max_num_seqs = 4;
  o.max_num_batched_tokens = 64;
  o.max_model_len = 64;
  auto gpu = CreateCudaBackend(config, weights, o).value();
  BatchPlanner planner(32, 8, 3);
  std::mt19937 rng(8);
  ForwardBatch b;
  planner.Add(b, 0, RandomTokens(rng, 37, config.vocab_size), LogitsMode::kLast);
  std::vector<float> before, after;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(b, before).ok());
  const std::vector<BlockId> table = b.seqs[0].block_table;  // 5 blocks

  // Swap the blocks out, scribble over them with another sequence, swap back: same next logits.
  std::vector<BlockMove> out, in;
  for (size_t i = 0; i < table.size(); ++i) {
    out.push_back({table[i], static_cast<BlockId>(i + 3)});
    in.push_back({static_cast<BlockId>(i + 3), table[i]});
  }
  ASSERT_TRUE(gpu->CopyBlocks(out, BlockCopyKind::kDeviceToHost).ok());
  ForwardBatch scribble;
  {
    SequenceSlice s;
    s.num_tokens = 37;
    s.context_len = 37;
    s.block_table = table;
    s.logits = LogitsMode::kNone;
    auto toks = RandomTokens(rng, 37, config.vocab_size);
    for (int i = 0; i < 37; ++i) {
      scribble.tokens.push_back(toks[static_cast<size_t>(i)]);
      scribble.positions.push_back(i);
    }
    scribble.seqs.push_back(s);
  }
  std::vector<float> unused;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(scribble, unused).ok());
  ASSERT_TRUE(gpu->CopyBlocks(in, BlockCopyKind::kHostToDevice).ok());
  ForwardBatch next;
  SequenceSlice s;
  s.num_tokens = 1;
  s.context_len = 38;
  s.block_table = table;
  s.logits = LogitsMode::kLast;
  next.tokens = {7};
  next.positions = {37};
  next.seqs = {s};
  ASSERT_TRUE(LlamaModel(*gpu).Forward(next, after).ok());

  // Reference: the same decode on an untouched copy (CoW the blocks to fresh ids, decode there).
  std::vector<BlockMove> cow;
  std::vector<BlockId> copy_table;
  for (size_t i = 0; i < table.size(); ++i) {
    const BlockId dst = 31 - static_cast<BlockId>(i);
    ASSERT_EQ(std::count(table.begin(), table.end(), dst), 0) << "choose other test blocks";
    cow.push_back({table[i], dst});
    copy_table.push_back(dst);
  }
  ASSERT_TRUE(gpu->CopyBlocks(cow, BlockCopyKind::kDeviceToDevice).ok());
  next.seqs[0].block_table = copy_table;
  std::vector<float> via_copy;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(next, via_copy).ok());
  EXPECT_EQ(after, via_copy) << "a copy-on-write copy decodes exactly like the original";
  EXPECT_EQ(after.size(), static_cast<size_t>(config.vocab_size));
  for (float x : after) ASSERT_TRUE(std::isfinite(x));
}

// Sampling on the device picks exactly what the CPU Sampler picks from the same logits with the
// same uniform draws: greedy, temperature, top-k, top-p, min-p, penalties, suppressed tokens.
TEST(CudaBackendSampling, DeviceSamplingEqualsHostSamplerOnTheSameLogits) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  CudaBackendOptions o;
  o.dtype = "fp16";
  o.num_kv_blocks = 64;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 128;
  o.max_model_len = 256;
  auto gpu = CreateCudaBackend(config, weights, o).value();
  ASSERT_TRUE(gpu->SupportsDeviceSampling());
  std::vector<SamplingParams> params(6);
  params[0].temperature = 0.0f;
  params[1].temperature = 0.8f;
  params[2].top_k = 20;
  params[2].logprobs = 5;
  params[3].top_p = 0.7f;
  params[3].repetition_penalty = 1.3f;
  params[4].min_p = 0.05f;
  params[4].frequency_penalty = 0.5f;
  params[4].presence_penalty = 0.3f;
  params[5].temperature = 1.3f;
  params[5].top_k = 50;
  params[5].top_p = 0.9f;
  params[5].logprobs = 3;
  std::mt19937 rng(17);
  BatchPlanner planner(64, 16, 5);
  std::vector<std::vector<int32_t>> history(params.size());
  int checked = 0;
  for (int step = 0; step < 5; ++step) {
    ForwardBatch b;
    for (size_t i = 0; i < params.size(); ++i) {
      const int n = step == 0 ? 9 + static_cast<int>(i) : 1;
      auto toks = RandomTokens(rng, n, config.vocab_size);
      history[i].insert(history[i].end(), toks.begin(), toks.end());
      planner.Add(b, static_cast<int>(i), toks, LogitsMode::kLast);
    }
    std::vector<float> logits;
    ASSERT_TRUE(LlamaModel(*gpu).Forward(b, logits).ok());
    std::vector<DeviceSampleRow> rows;
    std::vector<SampledToken> want;
    const std::vector<int32_t> suppress = {3, 5, 7};
    // Row 1 bans tokens, row 2 has a mask and biases (the logits processors' constraint).
    TokenConstraint banned, masked;
    banned.Ban(suppress);
    std::vector<uint32_t> mask((static_cast<size_t>(config.vocab_size) + 31) / 32, 0x5555aaaau);
    masked.AllowOnly(mask);
    masked.AddBias(4, 3.0f);
    masked.AddBias(9, -2.0f);
    for (size_t i = 0; i < params.size(); ++i) {
      const uint64_t seed = 1000 * step + i;
      std::span<const int32_t> prompt(history[i].data(), 9 + i), output(history[i].data() + 9 + i,
                                                                        history[i].size() - 9 - i);
      std::vector<float> row(logits.begin() + i * config.vocab_size, logits.begin() + (i + 1) * config.vocab_size);
      Sampler host(params[i], seed);
      const TokenConstraint* constraint = i == 1 ? &banned : i == 2 ? &masked : nullptr;
      want.push_back(host.Sample(row, prompt, output, constraint));
      DeviceSampleRow r;
      r.params = &params[i];
      r.uniform = params[i].greedy() ? 0.0 : Sampler(params[i], seed).NextUniform();
      r.prompt = prompt;
      r.output = output;
      r.constraint = constraint;
      rows.push_back(r);
    }
    std::vector<SampledToken> got;
    const Status st = LlamaModel(*gpu).ForwardAndSample(b, rows, got);  // the same step again: same logits
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].token, want[i].token) << "step " << step << " row " << i;
      EXPECT_NEAR(got[i].logprob, want[i].logprob, 1e-4) << "step " << step << " row " << i;
      ASSERT_EQ(got[i].top_logprobs.size(), want[i].top_logprobs.size());
      for (size_t j = 0; j < want[i].top_logprobs.size(); ++j) {
        EXPECT_EQ(got[i].top_logprobs[j].token, want[i].top_logprobs[j].token);
        EXPECT_NEAR(got[i].top_logprobs[j].logprob, want[i].top_logprobs[j].logprob, 1e-4);
      }
      ++checked;
    }
  }
  std::printf("  %d device-sampled tokens equal to the CPU Sampler's\n", checked);
}

// ---- engine level ---------------------------------------------------------------------------------

const std::vector<std::string> kPrompts = {
    "You are a helpful assistant. What is a block table?", "Name three colours.", "1 2 3 4 5 6 7 8 9 10",
    "You are a helpful assistant. What is a block table? Explain copy-on-write."};

using Outputs = std::vector<std::vector<int32_t>>;

// How the engine tests decode: greedy, or sampled (temperature 0.8, top-p 0.95, top-k 40, a
// repetition penalty) with request i seeded 1000 + i, so that a lossless feature must reproduce the
// sampled tokens too, not only the argmax.
enum class Decoding { kGreedy, kSeeded };
SamplingParams Params(Decoding d, int max_tokens, size_t request) {
  SamplingParams p = Greedy(max_tokens);
  if (d == Decoding::kSeeded) {
    p.temperature = 0.8f;
    p.top_p = 0.95f;
    p.top_k = 40;
    p.repetition_penalty = 1.1f;
    p.seed = 1000 + request;
  }
  return p;
}
const char* Name(Decoding d) { return d == Decoding::kGreedy ? "greedy" : "seeded sampling"; }

Outputs RunEngine(EngineConfig c, int max_tokens, EngineStats* stats = nullptr, Decoding decoding = Decoding::kGreedy) {
  auto created = Engine::Create(c);
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  if (!created.ok()) return {};
  auto engine = std::move(created).value();
  Outputs out(kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    auto id = engine->AddRequest(kPrompts[i], Params(decoding, max_tokens, i), [&out, i](const StreamEvent& e) {
      EXPECT_TRUE(e.error.ok()) << e.error.ToString();
      for (const auto& t : e.tokens) out[i].push_back(t.token);
    });
    EXPECT_TRUE(id.ok());
  }
  while (engine->HasUnfinishedRequests()) {
    auto st = engine->Step();
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    if (!st.ok()) break;
  }
  if (stats) *stats = engine->stats();
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total) << "device blocks leaked";
  return out;
}

EngineConfig CudaConfig(const std::string& model, const std::string& dtype = "fp16") {
  EngineConfig c;
  c.model = model;
  c.device = "cuda";
  c.dtype = dtype;
  c.num_threads = 2;
  c.num_kv_blocks = 256;  // fixed, so the emulator does not size a pool from its fake 8 GiB
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 256;
  c.max_model_len = 512;
  return c;
}

// Number of leading tokens two generations share.
size_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

void ExpectGreedyMatchesCpu(const std::string& model, int tokens) {
  EngineConfig cpu = CudaConfig(model);
  cpu.device = "cpu";
  cpu.dtype = "f32";  // the exact reference
  const Outputs ref = RunEngine(cpu, tokens);
  const Outputs got = RunEngine(CudaConfig(model, "fp16"), tokens);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t same = CommonPrefix(ref[i], got[i]);
    std::printf("  %s prompt %zu: CUDA (fp16) and CPU (fp32) greedy tokens agree for %zu of %d\n", model.c_str(), i,
                same, tokens);
    EXPECT_EQ(same, static_cast<size_t>(tokens)) << "prompt " << i;
  }
}

TEST(CudaEngine, GreedyMatchesCpuEngineOnTinyRandom) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ExpectGreedyMatchesCpu("tiny-random", 32);
}

TEST(CudaEngine, GreedyMatchesCpuEngineOnSmolLM2) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (test::IsEmulator()) GTEST_SKIP() << "SmolLM2 is too slow for the CUDA emulator; runs on a GPU";
  const std::string gguf = std::string(KVFLOW_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(gguf)) GTEST_SKIP() << "no " << gguf << " (tools/fetch-model)";
  ExpectGreedyMatchesCpu(gguf, 32);
}

// Seeded sampled tokens of two CUDA paths that compute the same distribution with other kernels or
// on another sampler. The emulator runs every path in the same arithmetic, so there they are the
// same tokens. On a GPU, fp16 kernels of other shapes (a several-token verification slice against
// one-token steps) and the host sampler against the device one round differently, and a draw near a
// probability boundary may go the other way (seen on an H200, 2026-11-27: n-gram speculation's
// tokens parted after the first 32); a wrong row or random stream parts ways at the first draws, so there
// every request must share at least its first 8 tokens. The shares are printed.
void ExpectSameSeededTokens(const std::string& what, const Outputs& got, const Outputs& expected) {
  if (test::IsEmulator()) {
    EXPECT_EQ(got, expected) << what;
    return;
  }
  ASSERT_EQ(got.size(), expected.size()) << what;
  std::string per_prompt;
  for (size_t i = 0; i < expected.size(); ++i) {
    const size_t shared = CommonPrefix(got[i], expected[i]);
    per_prompt += (i ? ", " : "") + std::to_string(shared) + "/" + std::to_string(expected[i].size());
    EXPECT_GE(shared, std::min<size_t>(8, expected[i].size())) << what << ", prompt " << i;
    EXPECT_EQ(got[i].size(), expected[i].size()) << what << ", prompt " << i;
  }
  std::printf("  %s, seeded sampling: shared tokens %s\n", what.c_str(), per_prompt.c_str());
}

// Multi-token verification on CUDA: n-gram drafts run with their sequence's next token (a
// several-token slice with every row's logits, sampled on the host) and give the same tokens as
// plain CUDA decoding (which samples on the device and replays graphs), greedy and seeded: one-hot
// drafts are verified by the sequence's own sampler, so a seed gives the same tokens either way
// (ExpectSameSeededTokens: to the bit on the emulator).
TEST(CudaEngine, SpeculativeDecodingKeepsGreedyAndSeededOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int kTokens = 40;
  for (const Decoding d : {Decoding::kGreedy, Decoding::kSeeded}) {
    const Outputs reference = RunEngine(CudaConfig("tiny-random"), kTokens, nullptr, d);
    EngineConfig spec = CudaConfig("tiny-random");
    spec.speculative.method = "ngram";
    spec.speculative.num_tokens = 4;
    EngineStats stats;
    const Outputs got = RunEngine(spec, kTokens, &stats, d);
    if (d == Decoding::kGreedy) EXPECT_EQ(got, reference) << Name(d);
    else ExpectSameSeededTokens("n-gram speculation", got, reference);
    std::printf("  %s: drafts %lld, draft tokens %lld, accepted %lld\n", Name(d), (long long)stats.spec.num_drafts,
                (long long)stats.spec.num_draft_tokens, (long long)stats.spec.num_accepted_tokens);
    EXPECT_GT(stats.spec.num_draft_tokens, 0) << Name(d);
  }
}

// The logits processors' constraint through the CUDA engine's device sampler (the kernel against
// the CPU Sampler on the same logits is CudaBackendSampling.DeviceSamplingEqualsHostSamplerOnTheSameLogits):
// a +100 bias forces its token, a -100 bias bans the tokens an unbiased run chose, greedy and seeded.
TEST(CudaEngine, LogitBiasOnTheDeviceSampler) {
  KVFLOW_SKIP_WITHOUT_GPU();
  auto run = [](const SamplingParams& base, bool vary_seed, EngineStats* stats) {
    auto engine = Engine::Create(CudaConfig("tiny-random"));
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    Outputs out(kPrompts.size());
    if (!engine.ok()) return out;
    for (size_t i = 0; i < kPrompts.size(); ++i) {
      SamplingParams p = base;
      if (vary_seed) p.seed = 1000 + i;
      EXPECT_TRUE(engine.value()->AddRequest(kPrompts[i], p, [&out, i](const StreamEvent& e) {
        for (const auto& t : e.tokens) out[i].push_back(t.token);
      }).ok());
    }
    while (engine.value()->HasUnfinishedRequests()) {
      if (!engine.value()->Step().ok()) break;
    }
    if (stats) *stats = engine.value()->stats();
    return out;
  };
  for (const Decoding d : {Decoding::kGreedy, Decoding::kSeeded}) {
    SamplingParams p = Params(d, 16, 0);
    p.seed.reset();
    const Outputs unbiased = run(p, d == Decoding::kSeeded, nullptr);
    SamplingParams banned = p;
    for (const auto& out : unbiased) {
      for (int32_t t : out) banned.logit_bias.push_back({t, -100.0f});
    }
    for (const auto& out : run(banned, d == Decoding::kSeeded, nullptr)) {
      ASSERT_FALSE(out.empty());
      for (int32_t t : out) {
        for (const auto& u : unbiased) EXPECT_EQ(std::count(u.begin(), u.end(), t), 0) << Name(d) << " token " << t;
      }
    }
    SamplingParams forced = p;
    forced.logit_bias = {{42, 100.0f}};
    for (const auto& out : run(forced, d == Decoding::kSeeded, nullptr)) {
      ASSERT_EQ(out.size(), 16u);
      for (int32_t t : out) EXPECT_EQ(t, 42) << Name(d);
    }
  }
}

// Structured output sampled on the device: the grammar masks, computed on a helper thread while the
// forward pass runs (DeviceSampling::await_constraints), reach the sampling kernel. In a batch that
// mixes two constrained requests with a free one, greedy tokens equal the CPU engine's (fp32, host
// sampling, masks filled after the forward pass) and the constrained outputs parse as the schema
// says; seeded, they parse too (their tokens are the device's draws).
TEST(CudaEngine, StructuredOutputOnTheDeviceSampler) {
  KVFLOW_SKIP_WITHOUT_GPU();
  if (!StructuredOutputAvailable()) GTEST_SKIP() << "kvflow was built without xgrammar";
  StructuredOutput schema;
  schema.kind = StructuredOutput::Kind::kJsonSchema;
  schema.any_whitespace = false;
  schema.spec = R"({"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                    "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["name", "n"]})";
  auto run = [&](EngineConfig c, Decoding d, EngineStats* stats) {
    auto engine = Engine::Create(c);
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    std::vector<std::string> texts(3);
    if (!engine.ok()) return texts;
    for (size_t i = 0; i < 3; ++i) {
      SamplingParams p = Params(d, 40, i);
      if (i > 0) {
        p.structured_output = schema;
        p.ignore_eos = false;
      }
      EXPECT_TRUE(engine.value()->AddRequest(kPrompts[i], p, [&texts, i](const StreamEvent& e) {
        texts[i] += e.text_delta;
      }).ok());
    }
    while (engine.value()->HasUnfinishedRequests()) {
      if (!engine.value()->Step().ok()) break;
    }
    if (stats) *stats = engine.value()->stats();
    return texts;
  };
  EngineConfig cpu = CudaConfig("tiny-random");
  cpu.device = "cpu";
  cpu.dtype = "f32";
  EngineStats stats;
  for (const Decoding d : {Decoding::kGreedy, Decoding::kSeeded}) {
    const std::vector<std::string> got = run(CudaConfig("tiny-random"), d, &stats);
    for (size_t i = 1; i < 3; ++i) {
      const auto j = nlohmann::json::parse(got[i], nullptr, false);
      ASSERT_TRUE(j.is_object()) << Name(d) << ": " << got[i];
      EXPECT_TRUE(j.contains("name") && j["name"].is_string() && j.contains("n") && j["n"].is_number_integer())
          << Name(d) << ": " << got[i];
    }
    if (d == Decoding::kGreedy) {
      EXPECT_EQ(got, run(cpu, d, nullptr)) << "the CUDA engine's greedy tokens under the grammar";
    }
  }
}

// Sampled drafts (a draft model, TriForce) draw from their own random stream, so a seed gives other
// tokens than plain decoding; what must hold is that the device runs the same rejection sampling as
// the CPU engine, consuming the same uniforms: seeded tokens equal the CPU (fp32) engine's with the
// same configuration and seeds until fp16 moves a draw across a probability boundary, or (TriForce)
// fp16 chunk scores pick another retrieval cache, which changes the middle's distribution and so
// the draws after it. A wrong row, level or random stream parts ways at the first drafted token, so
// every request must share at least its first 8 tokens with the CPU's; the shares are printed (on
// an H200, TriForce with the streaming bottom shared 77 of 160, so no overall share is demanded).
void ExpectSeededMatchesCpu(const std::string& what, EngineConfig cuda, int tokens) {
  const Outputs got = RunEngine(cuda, tokens, nullptr, Decoding::kSeeded);
  EXPECT_EQ(RunEngine(cuda, tokens, nullptr, Decoding::kSeeded), got) << what << ": a seed repeats its tokens";
  EngineConfig cpu = cuda;
  cpu.device = "cpu";
  cpu.dtype = "f32";
  const Outputs ref = RunEngine(cpu, tokens, nullptr, Decoding::kSeeded);
  ASSERT_EQ(ref.size(), got.size());
  size_t shared = 0, total = 0;
  std::string per_prompt;
  for (size_t i = 0; i < ref.size(); ++i) {
    shared += CommonPrefix(ref[i], got[i]);
    total += ref[i].size();
    per_prompt += (i ? ", " : "") + std::to_string(CommonPrefix(ref[i], got[i])) + "/" + std::to_string(ref[i].size());
  }
  std::printf("  %s, seeded sampling: CUDA (fp16) and CPU (fp32) share %zu of %zu tokens (%s)\n", what.c_str(), shared,
              total, per_prompt.c_str());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_GE(CommonPrefix(ref[i], got[i]), std::min<size_t>(8, ref[i].size())) << what << ", prompt " << i;
  }
}

// TriForce on the tiny model: gamma2 4, gamma1 2, an 8-token retrieval cache, drafting from the
// start, a 4 + 8 streaming window; the draft model's bottom runs tiny-random-draft.
EngineConfig TriForceOn(EngineConfig c, const std::string& bottom) {
  c.speculative.method = "triforce";
  c.speculative.num_tokens = 4;
  c.speculative.triforce.draft = bottom;
  c.speculative.triforce.draft_tokens = 2;
  c.speculative.triforce.budget = 8;
  c.speculative.triforce.min_context = 0;
  c.speculative.triforce.sinks = 4;
  c.speculative.triforce.window = 8;
  if (bottom == "draft_model") c.speculative.model = "tiny-random-draft";
  return c;
}

// TriForce on the device: chunks scored and selected by the kernels inside the engine's pass, the
// middle level reading its retrieval cache as a block-table subset through the paged kernels (its
// lane filled by a KV transfer), the bottom drafting from a StreamingLLM view: greedy outputs stay
// those of plain CUDA decoding, for every bottom drafter.
TEST(CudaEngine, TriForceKeepsGreedyOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int kTokens = 40;
  EngineConfig base = CudaConfig("tiny-random");
  base.block_size = 8;
  const Outputs reference = RunEngine(base, kTokens);
  for (const char* bottom : {"ngram", "streaming", "draft_model"}) {
    const EngineConfig tri = TriForceOn(base, bottom);
    EngineStats stats;
    EXPECT_EQ(RunEngine(tri, kTokens, &stats), reference) << bottom;
    std::printf("  %s bottom: top kept %lld of %lld; middle passes %lld kept %lld of %lld bottom drafts; builds %lld\n",
                bottom, (long long)stats.spec.num_accepted_tokens, (long long)stats.spec.num_draft_tokens,
                (long long)stats.spec.middle_passes, (long long)stats.spec.middle_accepted_tokens,
                (long long)stats.spec.middle_draft_tokens, (long long)stats.spec.retrieval_builds);
    EXPECT_GT(stats.spec.middle_passes, 0) << bottom;
    EXPECT_GE(stats.spec.retrieval_builds, static_cast<int64_t>(kPrompts.size())) << bottom;
    ExpectSeededMatchesCpu(std::string("TriForce, ") + bottom + " bottom", tri, kTokens);
  }
}

// TriForce over an offloaded pool on the device: verification steps stream the host pool through
// the staging buffers, the middle level reads retrieval copies kept in the resident arena, the
// draft model's pool stays on the device. Greedy outputs stay those of plain resident CUDA decoding
// and seeded sampling draws what TriForce over the resident pool draws.
TEST(CudaEngine, TriForceOverAnOffloadedPoolKeepsOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int kTokens = 40;
  EngineConfig base = CudaConfig("tiny-random");
  base.block_size = 8;
  const Outputs reference = RunEngine(base, kTokens);
  for (const char* bottom : {"ngram", "draft_model"}) {
    EngineConfig tri = TriForceOn(base, bottom);
    tri.speculative.triforce.rebuild_stride = 32;  // over the offloaded pool: copy regions of 1 + 5 blocks
    tri.num_kv_blocks = 512;                       // room for them
    tri.preemption_mode = "recompute";             // an offloaded pool has no swap space
    // Offloaded steps run eagerly; so does the resident run, so that the seeded comparison sees only
    // the offload: a CUDA graph's decode grid is sized for max_model_len, an eager step's for its
    // context, so their split-KV sums differ in the last bits and a seeded draw at a near-tie can flip.
    tri.enforce_eager = true;
    EngineConfig offloaded = tri;
    offloaded.kv_offload.enabled = true;
    EngineStats stats, resident;
    EXPECT_EQ(RunEngine(offloaded, kTokens, &stats), reference) << bottom;
    EXPECT_EQ(RunEngine(tri, kTokens, &resident), reference) << bottom;
    // The same chunk scores (read from the staging buffers there), so the same retrieval caches and
    // the same drafts at every level.
    EXPECT_EQ(stats.spec.num_draft_tokens, resident.spec.num_draft_tokens) << bottom;
    EXPECT_EQ(stats.spec.num_accepted_tokens, resident.spec.num_accepted_tokens) << bottom;
    EXPECT_EQ(stats.spec.middle_accepted_tokens, resident.spec.middle_accepted_tokens) << bottom;
    EXPECT_EQ(stats.spec.retrieval_builds, resident.spec.retrieval_builds) << bottom;
    std::printf("  offloaded, %s bottom: top kept %lld of %lld; middle passes %lld; %lld blocks copied to the "
                "resident arena; %.2f MiB fetched for verification\n",
                bottom, (long long)stats.spec.num_accepted_tokens, (long long)stats.spec.num_draft_tokens,
                (long long)stats.spec.middle_passes, (long long)stats.spec.retrieval_copied_blocks,
                stats.kv_offload.bytes_fetched / double(1 << 20));
    EXPECT_GT(stats.spec.middle_passes, 0) << bottom;
    EXPECT_GT(stats.spec.retrieval_copied_blocks, 0) << bottom;
    EXPECT_GT(stats.kv_offload.bytes_fetched, 0) << bottom;
    EXPECT_EQ(RunEngine(offloaded, kTokens, nullptr, Decoding::kSeeded), RunEngine(tri, kTokens, nullptr, Decoding::kSeeded))
        << bottom << ": seeded sampling over the offloaded pool";
  }
}

// random:<shape> models: the engine on weights the backend generates (speed at real sizes). The
// same seed gives the same tokens, and TriForce stays lossless on them as on any weights.
TEST(CudaEngine, RandomShapeModelIsDeterministicAndTriForceStaysLossless) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int kTokens = 24;
  EngineConfig base = CudaConfig("random:tiny");
  base.block_size = 8;
  const Outputs first = RunEngine(base, kTokens);
  ASSERT_EQ(first.size(), kPrompts.size());
  for (const auto& tokens : first) EXPECT_FALSE(tokens.empty());
  EXPECT_EQ(RunEngine(base, kTokens), first) << "same seed, same weights, same greedy tokens";
  EngineConfig tri = base;
  tri.speculative.method = "triforce";
  tri.speculative.num_tokens = 4;
  tri.speculative.triforce.draft_tokens = 2;
  tri.speculative.triforce.budget = 8;
  tri.speculative.triforce.min_context = 0;
  EngineStats stats;
  EXPECT_EQ(RunEngine(tri, kTokens, &stats), first);
  EXPECT_GT(stats.spec.middle_passes, 0);
}

// ---- InfiniGen and H2O on the device ----------------------------------------------------------------

// A skewing file for tiny-random, calibrated once on the CPU backend (as `kvflow skew` would).
const std::string& TinySkewFile() {
  // Removed at exit.
  struct TempFile {
    std::string path;
    ~TempFile() { std::filesystem::remove(path); }
  };
  static const TempFile file{[] {
    const std::string p = (std::filesystem::temp_directory_path() /
                           ("kvflow_cuda_test_" + std::to_string(::getpid()) + "_tiny.infinigen")).string();
    auto files = OpenModelFiles("tiny-random");
    EXPECT_TRUE(files.ok()) << files.status().ToString();
    EngineConfig c;
    c.model = "tiny-random";
    c.num_threads = 2;
    c.dtype = "f32";
    c.max_model_len = 256;
    c.num_kv_blocks = 256 / c.block_size + 2;
    c.num_host_kv_blocks = 0;
    auto weights = LoadWeightsFor(files.value(), c);
    EXPECT_TRUE(weights.ok()) << weights.status().ToString();
    auto backend = CreateBackend(c, true, files->config, std::move(weights.value()));
    EXPECT_TRUE(backend.ok()) << backend.status().ToString();
    std::mt19937 rng(9);
    std::vector<int32_t> text(256);
    for (int32_t& t : text) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(files->config.vocab_size - 10)) + 5;
    SkewCalibrationOptions options;
    options.partial_ratio = 0.3;  // the margins for 16-bit arithmetic below were set on these scores
    auto table = CalibrateSkew(*backend.value(), text, options);
    EXPECT_TRUE(table.ok()) << table.status().ToString();
    EXPECT_TRUE(WriteSkewTable(table.value(), p).ok());
    return p;
  }()};
  return file.path;
}

// Tokens of prompts of 90, 37 and 150 tokens decoded together, and the engine's selection stats.
Outputs RunSelectionEngine(EngineConfig c, KvSelectionStats* stats = nullptr, KvOffloadStats* offload = nullptr,
                           Decoding decoding = Decoding::kGreedy) {
  c.kv_selection.infinigen.skew_file = TinySkewFile();
  auto created = Engine::Create(c);
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  if (!created.ok()) return {};
  auto engine = std::move(created).value();
  std::vector<std::vector<int32_t>> prompts;
  for (auto [n, seed] : {std::pair{90, 1u}, {37, 2u}, {150, 3u}}) {
    std::mt19937 rng(seed);
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % 246u) + 5;
    prompts.push_back(std::move(p));
  }
  const Outputs out = test::GenerateAll(*engine, prompts, Params(decoding, 24, 0), decoding == Decoding::kSeeded);
  if (stats) *stats = engine->stats().kv_selection;
  if (offload) *offload = engine->stats().kv_offload;
  EXPECT_EQ(engine->stats().kv_blocks_free, engine->stats().kv_blocks_total) << "device blocks leaked";
  return out;
}

// The rule the device's kernels run: KV-head max counting, nothing forced (the engine's default
// counts per query head, which speculates on the host).
void UseDeviceRule(EngineConfig& c) {
  c.kv_selection.infinigen.count_rule = "kv-head-max";
  c.kv_selection.infinigen.sink_tokens = 0;
  c.kv_selection.infinigen.recent_tokens = 0;
}

// Selecting every token reads exactly what full attention reads, in the same order: the same greedy
// tokens as the same CUDA engine without selection (whose decode steps replay CUDA graphs; the
// selectors' steps run eagerly).
TEST(CudaEngine, KvSelectionEverythingEqualsFullAttention) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (const char* dtype : {"fp16", "bf16"}) {
    const Outputs expected = RunSelectionEngine(CudaConfig("tiny-random", dtype));
    ASSERT_EQ(expected.size(), 3u);
    KvSelectionStats s;
    // Both speculation points: the selector's projection runs mid-layer (after the MLP's gate_up)
    // or before attention.
    for (const char* point : {"after-attention", "layer-input"}) {
      EngineConfig infinigen = CudaConfig("tiny-random", dtype);
      infinigen.kv_selection.method = "infinigen";
      UseDeviceRule(infinigen);
      infinigen.kv_selection.infinigen.alpha = 1e6;
      infinigen.kv_selection.infinigen.max_fraction = 1.0;
      infinigen.kv_selection.infinigen.speculate_from = point;
      EXPECT_EQ(RunSelectionEngine(infinigen, &s), expected) << dtype << ", " << point;
      EXPECT_GT(s.decode_tokens, 0);
      EXPECT_GT(s.layer_reads_selected, 0);
      EXPECT_EQ(s.tokens_selected, s.tokens_available);
      std::printf("  %s, infinigen (%s), everything: %lld decode tokens, %lld selected reads\n", dtype, point,
                  (long long)s.decode_tokens, (long long)s.layer_reads_selected);
    }
    EngineConfig h2o = CudaConfig("tiny-random", dtype);
    h2o.kv_selection.method = "h2o";
    h2o.kv_selection.h2o.budget = 1.0;
    EXPECT_EQ(RunSelectionEngine(h2o, &s), expected) << dtype << ", h2o";
    EXPECT_GT(s.layer_reads_selected, 0);
    EXPECT_EQ(s.tokens_selected, s.tokens_available);
  }
}

// The CUDA engine's selectors select like the CPU engine's: the same decode steps and selected
// reads, and selection fractions close (16-bit arithmetic may move a score across the margin).
TEST(CudaEngine, KvSelectionMatchesTheCpuSelector) {
  KVFLOW_SKIP_WITHOUT_GPU();
  EngineConfig gpu = CudaConfig("tiny-random");
  gpu.kv_selection.method = "infinigen";
  UseDeviceRule(gpu);
  gpu.kv_selection.infinigen.alpha = 2.0;
  gpu.kv_selection.infinigen.max_fraction = 0.3;
  EngineConfig cpu = gpu;
  cpu.device = "cpu";
  cpu.dtype = "f32";
  KvSelectionStats on_cpu, on_gpu;
  const Outputs cpu_tokens = RunSelectionEngine(cpu, &on_cpu);
  const Outputs gpu_tokens = RunSelectionEngine(gpu, &on_gpu);
  for (const auto& [name, s] : {std::pair{"CPU (f32)", on_cpu}, {"CUDA (fp16)", on_gpu}}) {
    std::printf("  %-12s decode tokens %lld, selected reads %lld, full reads %lld, %.2f%% of the tokens, "
                "%.2f%% of the bytes\n",
                name, (long long)s.decode_tokens, (long long)s.layer_reads_selected, (long long)s.layer_reads_full,
                100.0 * s.selection_fraction(), 100.0 * static_cast<double>(s.bytes_read) / static_cast<double>(s.bytes_full));
  }
  size_t same = 0, total = 0;
  for (size_t i = 0; i < cpu_tokens.size() && i < gpu_tokens.size(); ++i) {
    same += CommonPrefix(cpu_tokens[i], gpu_tokens[i]);
    total += cpu_tokens[i].size();
  }
  std::printf("  greedy tokens: CUDA and CPU agree on %zu of %zu (common prefixes)\n", same, total);
  EXPECT_GT(on_gpu.decode_tokens, 0);
  EXPECT_EQ(on_gpu.decode_tokens, on_cpu.decode_tokens);
  EXPECT_EQ(on_gpu.layer_reads_selected, on_cpu.layer_reads_selected);
  EXPECT_NEAR(on_gpu.selection_fraction(), on_cpu.selection_fraction(), 0.05);
  EXPECT_LT(on_gpu.bytes_read, on_gpu.bytes_full);

  // H2O keeps its budget on the device as on the CPU: every layer reads about a quarter.
  gpu.kv_selection.method = cpu.kv_selection.method = "h2o";
  gpu.kv_selection.h2o.budget = cpu.kv_selection.h2o.budget = 0.25;
  RunSelectionEngine(cpu, &on_cpu);
  RunSelectionEngine(gpu, &on_gpu);
  std::printf("  h2o 0.25: CPU %.2f%%, CUDA %.2f%% of the tokens\n", 100.0 * on_cpu.selection_fraction(),
              100.0 * on_gpu.selection_fraction());
  EXPECT_EQ(on_gpu.layer_reads_selected, on_cpu.layer_reads_selected);
  EXPECT_NEAR(on_gpu.selection_fraction(), on_cpu.selection_fraction(), 0.02);
}

// The device's InfiniGen reads, token by token, against the CPU reference (kv_selection_oracle.h):
// at every decode step, layer >= 1 and KV head of three sequences, the tokens the CUDA engine's
// attention read are those the CPU (fp32) recomputation of the rule picks from a replay of the same
// tokens, except where fp16 scores moved a token across the cutoff (within 2e-2 of it, in at most
// a tenth of the reads); the CPU replay over exactly those reads gives the engine's logprobs within
// fp16's error.
TEST(CudaEngine, InfiniGenReadsAreTheCpuRulesChoice) {
  KVFLOW_SKIP_WITHOUT_GPU();
  EngineConfig c = CudaConfig("tiny-random");
  c.kv_selection.method = "infinigen";
  c.kv_selection.infinigen.alpha = 2.0;
  c.kv_selection.infinigen.max_fraction = 0.3;
  c.kv_selection.infinigen.skew_file = TinySkewFile();
  UseDeviceRule(c);
  test::InfiniGenOracleOptions o;
  o.score_margin = 2e-2;
  o.max_near_tie_share = 0.1;
  o.logprob_tolerance = 5e-2;
  o.max_argmax_differences = 2;
  test::ExpectInfiniGenReadsFollowTheRule(c, o);
}

// DeviceKvSpeculation's bad calls: clear errors (wrong skew sizes, calls outside a step or before the
// set-up, slices, rows, chunks and caps out of range, attention over a speculation never made), and
// the backend keeps serving: a plain step afterwards gives the same logits as before them.
TEST(CudaBackend, DeviceSpeculationRefusesBadCallsAndKeepsServing) {
  KVFLOW_SKIP_WITHOUT_GPU();
  ModelConfig config;
  LlamaWeights weights = TinyWeights(&config);
  const int kBlocks = 32, kBlockSize = 16, L = config.num_layers, KV = config.num_kv_heads, D = config.head_dim;
  CudaBackendOptions o = SmallCudaOptions("fp16", kBlocks, kBlockSize, 160);
  auto gpu = CreateCudaBackend(config, weights, o).value();
  auto* device = gpu->As<DeviceKvSpeculation>();
  ASSERT_NE(device, nullptr);
  const int P = 8, kChunks = 4;
  std::mt19937 rng(77);
  std::vector<float> matrices(static_cast<size_t>(L) * KV * D * D);
  test::FillNormal(matrices, rng, 0.1f);
  std::vector<int32_t> columns;
  for (int i = 0; i < L * KV; ++i) {
    for (int c = 0; c < P; ++c) columns.push_back(c * 3);
  }
  DeviceKvSpeculation::Setup setup;
  setup.num_partial_columns = P;
  setup.matrices = std::span<const float>(matrices).first(matrices.size() - 1);
  setup.columns = columns;
  setup.num_chunks = kChunks;
  setup.alpha = 2.0f;
  EXPECT_EQ(device->SetUpSpeculation(setup).code(), StatusCode::kInvalidArgument);  // one float short
  setup.matrices = matrices;
  std::vector<DeviceKvSpeculation::ExtendJob> none;
  EXPECT_EQ(device->ExtendPartialKeys(1, none).code(), StatusCode::kInternal);  // outside a step
  ASSERT_TRUE(device->SetUpSpeculation(setup).ok());
  EXPECT_EQ(device->SetUpSpeculation(setup).code(), StatusCode::kInternal);  // once

  BatchPlanner planner(kBlocks, kBlockSize, 5);
  ForwardBatch prefill;
  planner.Add(prefill, 0, RandomTokens(rng, 40, config.vocab_size), LogitsMode::kLast);
  std::vector<float> unused;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(prefill, unused).ok());
  ForwardBatch decode;
  planner.Add(decode, 0, RandomTokens(rng, 1, config.vocab_size), LogitsMode::kLast);  // context 41
  std::vector<float> before;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(decode, before).ok());

  // Inside a step, at layer 0 (after WriteKv): every bad job is refused, naming what.
  struct Misuse final : LayerHooks {
    DeviceKvSpeculation* device = nullptr;
    std::vector<int32_t> chunks = {0, 1}, bad_chunk = {0, 7};
    std::vector<std::pair<std::string, Status>> seen;
    Status BeforeAttention(const LayerContext& ctx) override {
      if (ctx.layer != 0) return Status::Ok();
      using J = DeviceKvSpeculation;
      auto extend = [&](int32_t slice, std::span<const int32_t> c, int32_t from, int32_t to) {
        const J::ExtendJob job{{slice, c}, from, to};
        return device->ExtendPartialKeys(1, std::span<const J::ExtendJob>(&job, 1));
      };
      auto speculate = [&](int32_t slice, std::span<const int32_t> c, int32_t candidates, int32_t cap) {
        const J::SpeculateJob job{{slice, c}, candidates, cap};
        return device->Speculate(1, std::span<const J::SpeculateJob>(&job, 1));
      };
      seen.push_back({"slice out of the batch", extend(3, chunks, 0, 10)});
      seen.push_back({"rows past the context", extend(0, chunks, 0, 42)});
      seen.push_back({"rows past the chunks", extend(0, std::span<const int32_t>(chunks).first(0), 0, 10)});
      seen.push_back({"a chunk outside the cache", extend(0, bad_chunk, 0, 100)});
      seen.push_back({"candidates past the cached tokens", speculate(0, chunks, 41, 5)});
      seen.push_back({"a cap above the candidates", speculate(0, chunks, 40, 41)});
      seen.push_back({"a cap of 0", speculate(0, chunks, 40, 0)});
      return Status::Ok();
    }
  } misuse;
  misuse.device = device;
  std::vector<float> during;
  ASSERT_TRUE(LlamaModel(*gpu, &misuse).Forward(decode, during).ok());
  ASSERT_EQ(misuse.seen.size(), 7u);
  for (const auto& [what, st] : misuse.seen) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.ToString();
    std::printf("  %-34s -> %s\n", what.c_str(), st.ToString().c_str());
  }

  // Attention reading a device speculation that was never made: an error, not a read of stale indices.
  struct Unmade final : LayerHooks {
    std::vector<KvHeadSelection> selection;
    std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override {
      return ctx.layer == 1 ? std::span<const KvHeadSelection>(selection) : std::span<const KvHeadSelection>{};
    }
  } unmade;
  unmade.selection.resize(1);
  unmade.selection[0].per_head = 5;
  unmade.selection[0].speculated = true;
  const Status st = LlamaModel(*gpu, &unmade).Forward(decode, during);
  EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
  EXPECT_NE(st.message().find("not made for it"), std::string::npos) << st.ToString();

  // Still serving: the same decode step again gives the same logits.
  std::vector<float> after;
  ASSERT_TRUE(LlamaModel(*gpu).Forward(decode, after).ok());
  EXPECT_EQ(after, before);
  std::vector<int32_t> counts;
  EXPECT_TRUE(device->TakeSpeculatedCounts(counts).ok());
  EXPECT_TRUE(counts.empty()) << "no speculation ran";
}

// InfiniGen's speculation on the device (the default on CUDA: partial keys, scores and selection in
// kernels, the selection never crossing to the host) against the host path on the same backend:
// the same decode steps and selected reads, the same tokens selected but where the device's fp32
// sums (FMA contraction, cosf) move a score across the cutoff, the same greedy tokens; with the
// pool offloaded, the selected rows prefetched on the copy stream (the same outputs again, and
// fewer bytes over the bus than the views would need). A host pool cap keeps the host path (auto).
TEST(CudaEngine, InfiniGenOnTheDeviceSelectsAsOnTheHost) {
  KVFLOW_SKIP_WITHOUT_GPU();
  EngineConfig host = CudaConfig("tiny-random");
  host.kv_selection.method = "infinigen";
  UseDeviceRule(host);
  host.kv_selection.infinigen.alpha = 2.0;
  host.kv_selection.infinigen.max_fraction = 0.3;
  host.kv_selection.infinigen.speculate_on = "host";
  EngineConfig device = host;
  device.kv_selection.infinigen.speculate_on = "device";
  for (const char* point : {"after-attention", "layer-input"}) {
    host.kv_selection.infinigen.speculate_from = device.kv_selection.infinigen.speculate_from = point;
    KvSelectionStats on_host, on_device, offloaded_sel;
    const Outputs expected = RunSelectionEngine(host, &on_host);
    const Outputs got = RunSelectionEngine(device, &on_device);
    std::printf("  %s: host %lld selected reads, %.3f%% of the tokens; device %lld, %.3f%%\n", point,
                (long long)on_host.layer_reads_selected, 100.0 * on_host.selection_fraction(),
                (long long)on_device.layer_reads_selected, 100.0 * on_device.selection_fraction());
    EXPECT_EQ(got, expected) << point;
    EXPECT_EQ(on_device.decode_tokens, on_host.decode_tokens);
    EXPECT_EQ(on_device.layer_reads_selected, on_host.layer_reads_selected);
    EXPECT_GT(on_device.layer_reads_selected, 0);
    EXPECT_NEAR(static_cast<double>(on_device.tokens_selected), static_cast<double>(on_host.tokens_selected),
                0.01 * static_cast<double>(on_host.tokens_selected));
    EXPECT_LT(on_device.bytes_read, on_device.bytes_full);

    EngineConfig offloaded = device;
    offloaded.kv_offload.enabled = true;
    KvOffloadStats moved, moved_full;
    EXPECT_EQ(RunSelectionEngine(offloaded, &offloaded_sel, &moved), got) << point << ", offloaded";
    EXPECT_EQ(offloaded_sel.tokens_selected, on_device.tokens_selected);
    EngineConfig full = offloaded;
    full.kv_selection.method = "";
    RunSelectionEngine(full, nullptr, &moved_full);
    std::printf("  %s, offloaded: %lld prefetches, %.2f MiB fetched against %.2f MiB for full attention\n", point,
                (long long)moved.prefetches, moved.bytes_fetched / double(1 << 20),
                moved_full.bytes_fetched / double(1 << 20));
    EXPECT_GT(moved.prefetches, 0);
    EXPECT_LT(moved.bytes_fetched, moved_full.bytes_fetched);
    const Outputs sampled = RunSelectionEngine(device, nullptr, nullptr, Decoding::kSeeded);
    EXPECT_EQ(RunSelectionEngine(offloaded, nullptr, nullptr, Decoding::kSeeded), sampled) << point << ", seeded";
  }
  // Asked for the device where it cannot be: a clear refusal.
  EngineConfig capped = device;
  capped.kv_selection.infinigen.host_kv_tokens = 60;
  capped.kv_selection.infinigen.skew_file = TinySkewFile();
  auto refused = Engine::Create(capped);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("host KV pool cap"), std::string::npos) << refused.status().ToString();
}

// The KV pool offloaded to pinned host memory: attention reads two layers' staging buffers, views
// prefetched on the copy stream and selections gathered from the host pool. It moves bytes: the same
// greedy tokens as the resident pool, and the same seeded sampled tokens (ExpectSameSeededTokens:
// to the bit on the emulator; on an H200, full attention, whose resident decode steps replay CUDA
// graphs while the offloaded ones run eagerly, parted once after 15 tokens), for full attention,
// InfiniGen (also under a host pool cap) and H2O.
TEST(CudaEngine, KvOffloadKeepsGreedyAndSeededOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (const char* selection : {"", "infinigen", "h2o", "infinigen-capped"}) {
    EngineConfig resident = CudaConfig("tiny-random");
    const bool capped = std::string(selection) == "infinigen-capped";
    resident.kv_selection.method = capped ? "infinigen" : selection;
    resident.kv_selection.infinigen.host_kv_tokens = capped ? 60 : 0;  // prefill chunks then read their live tokens
    resident.kv_selection.infinigen.alpha = 2.0;
    resident.kv_selection.h2o.budget = 0.3;
    EngineConfig offloaded = resident;
    offloaded.kv_offload.enabled = true;
    KvSelectionStats resident_sel, offloaded_sel;
    KvOffloadStats moved;
    const Outputs expected = RunSelectionEngine(resident, &resident_sel);
    ASSERT_EQ(expected.size(), 3u);
    EXPECT_EQ(RunSelectionEngine(offloaded, &offloaded_sel, &moved), expected) << "selection '" << selection << "'";
    EXPECT_EQ(offloaded_sel.tokens_selected, resident_sel.tokens_selected);
    EXPECT_GT(moved.bytes_fetched, 0);
    EXPECT_GT(moved.bytes_written, 0);
    EXPECT_GT(moved.prefetches + moved.on_demand_fetches, 0);
    std::printf("  offload, selection '%s': %.2f MiB fetched (%lld prefetched layers, %lld on demand), %.2f MiB written\n",
                selection, moved.bytes_fetched / double(1 << 20), (long long)moved.prefetches,
                (long long)moved.on_demand_fetches, moved.bytes_written / double(1 << 20));
    const Outputs sampled = RunSelectionEngine(resident, nullptr, nullptr, Decoding::kSeeded);
    EXPECT_NE(sampled, expected) << "sampling draws other tokens than greedy";
    ExpectSameSeededTokens(std::string("offload, selection '") + selection + "'",
                           RunSelectionEngine(offloaded, nullptr, nullptr, Decoding::kSeeded), sampled);
  }
}

// Two KV caches on the device: a draft model whose pool follows the target's block tables, its
// drafts written to scratch slots and read through gathered-slot views. The target drafting for
// itself keeps the greedy outputs and has nearly every draft accepted (fp16: a near-tie may flip).
TEST(CudaEngine, DraftModelKeepsGreedyOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int kTokens = 40;
  const Outputs reference = RunEngine(CudaConfig("tiny-random"), kTokens);
  EngineConfig spec = CudaConfig("tiny-random");
  spec.speculative.model = "tiny-random";
  spec.speculative.num_tokens = 3;
  EngineStats stats;
  EXPECT_EQ(RunEngine(spec, kTokens, &stats), reference);
  std::printf("  draft tokens %lld, accepted %lld\n", (long long)stats.spec.num_draft_tokens,
              (long long)stats.spec.num_accepted_tokens);
  EXPECT_GT(stats.spec.num_draft_tokens, 0);
  EXPECT_GE(stats.spec.num_accepted_tokens, stats.spec.num_draft_tokens * 9 / 10);
  EngineConfig layer_skip = CudaConfig("tiny-random");
  layer_skip.speculative.model = "tiny-random-draft";  // rejections, so residual draws on the device path
  layer_skip.speculative.num_tokens = 3;
  ExpectSeededMatchesCpu("draft model", layer_skip, kTokens);
}

void ExpectPreemptionPrefixCachingAndGraphsKeepOutputs(Decoding d) {
  const int kTokens = 24;
  const Outputs reference = RunEngine(CudaConfig("tiny-random"), kTokens, nullptr, d);

  EngineConfig eager = CudaConfig("tiny-random");
  eager.enforce_eager = true;
  EXPECT_EQ(RunEngine(eager, kTokens, nullptr, d), reference) << "eager steps = CUDA graph steps";

  for (const std::string mode : {"swap", "recompute"}) {
    EngineConfig tiny = CudaConfig("tiny-random");
    tiny.block_size = 8;
    tiny.num_kv_blocks = 14;  // far less than the batch needs at once
    tiny.max_model_len = 0;
    tiny.preemption_mode = mode;
    EngineStats stats;
    EXPECT_EQ(RunEngine(tiny, kTokens, &stats, d), reference) << "preemption by " << mode;
    EXPECT_GT(stats.num_preemptions, 0) << mode;
    if (mode == "swap") EXPECT_GT(stats.blocks_swapped_in, 0);
  }

  EngineConfig cached = CudaConfig("tiny-random");
  cached.enable_prefix_caching = true;
  cached.block_size = 8;
  cached.max_num_batched_tokens = 32;  // later prompts are admitted after earlier ones computed
  EngineStats stats;
  EXPECT_EQ(RunEngine(cached, kTokens, &stats, d), reference) << "prefix caching";
  EXPECT_GT(stats.prefix_cache_hit_rate, 0.0);
}

// Eager steps, preemption by swap and by recompute, and prefix caching give the tokens of plain CUDA
// decoding with graphs, greedy and seeded.
TEST(CudaEngine, PreemptionPrefixCachingAndGraphsKeepGreedyAndSeededOutputs) {
  KVFLOW_SKIP_WITHOUT_GPU();
  for (const Decoding d : {Decoding::kGreedy, Decoding::kSeeded}) {
    SCOPED_TRACE(Name(d));
    ExpectPreemptionPrefixCachingAndGraphsKeepOutputs(d);
  }
}

TEST(CudaEngine, ImpossibleConfigurationsFailClearly) {
  EngineConfig c = CudaConfig("tiny-random");
  c.device = "cuda:7";
  auto e = Engine::Create(c);
  ASSERT_FALSE(e.ok());
  std::printf("  cuda:7 -> %s\n", e.status().ToString().c_str());

  c = CudaConfig("tiny-random");
  c.device = "gpu";
  e = Engine::Create(c);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);

  c = CudaConfig("tiny-random");
  c.gpu_memory_utilization = 1.5;
  EXPECT_FALSE(Engine::Create(c).ok());

  c = CudaConfig("tiny-random");
  c.block_size = 4;  // the attention kernels take 8, 16 or 32
  e = Engine::Create(c);
  ASSERT_FALSE(e.ok());
  std::printf("  block_size 4 -> %s\n", e.status().ToString().c_str());
  if (cuda::DeviceCount() > 0) EXPECT_EQ(e.status().code(), StatusCode::kUnsupported);

  if (cuda::DeviceCount() > 0) {
    // A budget that cannot hold the weights and one full context.
    c = CudaConfig("tiny-random");
    c.num_kv_blocks = 0;
    c.gpu_memory_utilization = 0.0001;
    e = Engine::Create(c);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), StatusCode::kOutOfMemory);
    std::printf("  gpu_memory_utilization 0.0001 -> %s\n", e.status().ToString().c_str());
  }
}

}  // namespace
}  // namespace kvflow
