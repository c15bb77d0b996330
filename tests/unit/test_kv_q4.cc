// The 4-bit KV cache (cpu::KvElement::kQ4, InfiniGen's INT4 baseline): the Q4_1-style group
// quantization (error within half a step plus the fp16 rounding of scale and minimum, exact bytes for
// a hand-built row), paged attention and chunk scoring over a q4 pool against the same computations
// over an fp32 pool holding the dequantized values, block moves on a q4 CPU backend, and an engine
// whose q4 cache stays close to the fp32 cache; head_dim not a multiple of 32 and CUDA are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "backend/backend_factory.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/kv_block_select.h"
#include "backend/cpu/kv_q4.h"
#include "backend/cpu/paged_attention.h"
#include "engine_test_util.h"
#include "kv_transfer_check.h"
#include "forward/llama_model.h"
#include "model/tiny_random.h"
#include "util/half.h"
#include "util/thread_pool.h"

namespace kvflow {
namespace {

using cpu::KvElement;
using cpu::Q4Group;

// ---- quantization ------------------------------------------------------------------------------

TEST(KvQ4Quantize, RoundTripErrorIsHalfAStepPlusFp16Rounding) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const int kRow = 128;  // 4 groups
  double worst_ratio = 0.0, worst_error = 0.0;
  double normal_squared_error = 0.0, normal_squared_spread = 0.0;  // rows of normal values
  for (int trial = 0; trial < 400; ++trial) {
    // Rows of varied scale and offset: centred, shifted away from zero, tiny, large.
    const float scale = std::pow(10.0f, static_cast<float>(trial % 7) - 3.0f);
    const float shift = trial % 3 == 0 ? 0.0f : 5.0f * scale * uniform(rng);
    std::vector<float> row(kRow);
    for (float& x : row) x = shift + scale * (trial % 2 ? normal(rng) : uniform(rng));
    std::vector<Q4Group> groups(kRow / cpu::kQ4GroupSize);
    cpu::QuantizeQ4(row.data(), kRow, groups.data());
    std::vector<float> back(kRow);
    cpu::DequantizeQ4(groups.data(), kRow, back.data());
    for (size_t g = 0; g < groups.size(); ++g) {
      const float* x = row.data() + g * cpu::kQ4GroupSize;
      const auto [lo, hi] = std::minmax_element(x, x + cpu::kQ4GroupSize);
      const float d = HalfBitsToFloat(groups[g].scale), m = HalfBitsToFloat(groups[g].min);
      const float exact_d = (*hi - m) / 15.0f;
      // Half a step, plus what fp16 rounding of the minimum (values below m clamp to code 0) and of
      // the scale (values above m + 15 d clamp to code 15) leave uncovered, plus fp32 arithmetic.
      const double bound = d / 2.0 + std::fabs(m - *lo) + 15.0 * std::fabs(d - exact_d) +
                           1e-6 * std::max(std::fabs(*lo), std::fabs(*hi));
      for (int j = 0; j < cpu::kQ4GroupSize; ++j) {
        const double error = std::fabs(double(back[g * cpu::kQ4GroupSize + j]) - x[j]);
        ASSERT_LE(error, bound) << "trial " << trial << " group " << g << " value " << j;
        worst_error = std::max(worst_error, error / (*hi - *lo));
        if (trial % 2) {
          normal_squared_error += error * error;
          normal_squared_spread += double(x[j] - shift) * (x[j] - shift);
        }
        worst_ratio = std::max(worst_ratio, error / ((*hi - *lo) / 15.0 / 2.0));
      }
    }
  }
  const double relative_rms = std::sqrt(normal_squared_error / normal_squared_spread);
  std::printf("  q4 round trip: max error %.4f of a group's range, %.4f of half its exact step (max-min)/30; "
              "RMS error %.4f of the standard deviation on normal rows\n",
              worst_error, worst_ratio, relative_rms);
  EXPECT_LT(relative_rms, 0.1);  // a step is ~4.1 sigma / 15 for 32 normal values; uniform error: step / sqrt(12)
  // fp16 rounding of a minimum up to ~6x the spread away from zero adds a few % of a half step.
  EXPECT_LT(worst_ratio, 1.1);
}

TEST(KvQ4Quantize, HandBuiltRowHasExactBytesAndValues) {
  // Group 0: min -1, max 14, so d = 1 and m = -1 exactly; codes are value + 1, rounded to nearest
  // (2.4 -> 2, 4.6 -> 5, 2.5 -> 3: half rounds up). Group 1: constant 0.25 (d = 0). Group 2: a range
  // of 0.31 whose scale 0.31 / 15 is not an fp16 value.
  std::vector<float> row(96);
  for (int j = 0; j < 32; ++j) row[j] = -1.0f + static_cast<float>(j % 16);
  row[3] = -1.0f + 2.4f;
  row[20] = -1.0f + 4.6f;
  row[21] = -1.0f + 2.5f;
  for (int j = 32; j < 64; ++j) row[j] = 0.25f;
  for (int j = 64; j < 96; ++j) row[j] = 0.01f * static_cast<float>(j - 64);
  std::vector<Q4Group> groups(3);
  cpu::QuantizeQ4(row.data(), 96, groups.data());

  EXPECT_EQ(groups[0].scale, 0x3c00);  // 1.0
  EXPECT_EQ(groups[0].min, 0xbc00);    // -1.0
  std::vector<int> codes(32);
  for (int j = 0; j < 32; ++j) codes[j] = j % 16;
  codes[3] = 2;
  codes[20] = 5;
  codes[21] = 3;
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(groups[0].codes[j], codes[j] | (codes[j + 16] << 4)) << j;  // llama.cpp's Q4_1 nibble order
  }
  EXPECT_EQ(groups[1].scale, 0);
  EXPECT_EQ(groups[1].min, FloatToHalfBits(0.25f));
  for (uint8_t c : groups[1].codes) EXPECT_EQ(c, 0);

  std::vector<float> back(96);
  cpu::DequantizeQ4(groups.data(), 96, back.data());
  for (int j = 0; j < 32; ++j) EXPECT_EQ(back[j], -1.0f + static_cast<float>(codes[j])) << j;
  for (int j = 32; j < 64; ++j) EXPECT_EQ(back[j], 0.25f);
  const float* g2 = row.data() + 64;
  const auto [lo, hi] = std::minmax_element(g2, g2 + 32);
  EXPECT_EQ(groups[2].min, FloatToHalfBits(*lo));
  EXPECT_EQ(groups[2].scale, FloatToHalfBits((*hi - HalfBitsToFloat(groups[2].min)) / 15.0f));
  const float d = HalfBitsToFloat(groups[2].scale), m = HalfBitsToFloat(groups[2].min);
  for (int j = 0; j < 32; ++j) {
    const int code = std::clamp(static_cast<int>(std::floor((g2[j] - m) / d + 0.5f)), 0, 15);
    EXPECT_EQ(back[64 + j], m + d * static_cast<float>(code)) << j;
  }
}

TEST(KvQ4Quantize, PoolBytesAndHeadDimCheck) {
  EXPECT_EQ(cpu::KvPoolBytes(KvElement::kF32, 64), 256u);
  EXPECT_EQ(cpu::KvPoolBytes(KvElement::kF16, 64), 128u);
  EXPECT_EQ(cpu::KvPoolBytes(KvElement::kQ4, 64), 40u);            // 0.625 bytes a value
  EXPECT_EQ(cpu::KvPoolBytes(KvElement::kQ4, 3 * 16 * 128), 3840u);  // 3 blocks of 16 rows of 128
  EXPECT_TRUE(cpu::CheckKvElement(KvElement::kQ4, 64).ok());
  EXPECT_TRUE(cpu::CheckKvElement(KvElement::kF16, 48).ok());
  const Status refused = cpu::CheckKvElement(KvElement::kQ4, 48);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.ToString().find("multiple of 32"), std::string::npos) << refused.ToString();
}

// ---- attention and chunk scoring over a q4 pool ------------------------------------------------

struct AttentionCase {
  int num_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> past, fresh;  // per sequence: tokens already cached, new tokens this step
};

// Writes random K/V for every sequence into a q4 pool through WriteKvCache (the past, then the fresh
// tokens), attends the fresh tokens, and compares with the fp32 path over (a) the dequantized pool
// (must agree to float rounding) and (b) the original values (the quantization's own effect).
void CompareWithDequantizedPool(const AttentionCase& c, uint32_t seed, double& max_dequantized_error,
                                double& max_quantization_effect) {
  ThreadPool threads(2);
  ScopedThreadPool use_threads(&threads);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int S = static_cast<int>(c.past.size());
  KvCacheLayout layout{1, 2, c.num_kv_heads, c.block_size, c.head_dim};  // two spare blocks
  std::vector<int> ctx(S);
  for (int s = 0; s < S; ++s) {
    ctx[s] = c.past[s] + c.fresh[s];
    layout.num_blocks += (ctx[s] + c.block_size - 1) / c.block_size;
  }
  std::vector<BlockId> shuffled(static_cast<size_t>(layout.num_blocks));
  std::iota(shuffled.begin(), shuffled.end(), 0);
  std::shuffle(shuffled.begin(), shuffled.end(), rng);

  const size_t elements = layout.layer_stride();
  std::vector<Q4Group> key_q4(elements / cpu::kQ4GroupSize), value_q4(key_q4.size());
  std::vector<float> key_exact(elements), value_exact(elements);
  std::vector<std::vector<BlockId>> tables(S);
  size_t next = 0;
  for (int s = 0; s < S; ++s) {
    const size_t nb = static_cast<size_t>((ctx[s] + c.block_size - 1) / c.block_size);
    tables[s].assign(shuffled.begin() + static_cast<long>(next), shuffled.begin() + static_cast<long>(next + nb));
    next += nb;
  }
  const int64_t row = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  ForwardBatch step;
  for (int phase = 0; phase < 2; ++phase) {
    ForwardBatch batch;
    std::vector<float> keys, values;
    for (int s = 0; s < S; ++s) {
      const int begin = phase == 0 ? 0 : c.past[s], end = phase == 0 ? c.past[s] : ctx[s];
      if (end == begin) continue;
      SequenceSlice slice;
      slice.token_offset = static_cast<int32_t>(batch.tokens.size());
      slice.num_tokens = end - begin;
      slice.context_len = end;
      slice.block_table = tables[s];
      for (int t = begin; t < end; ++t) {
        batch.tokens.push_back(0);
        batch.positions.push_back(t);
        // Per-channel offsets, as real keys have, so groups do not all straddle zero.
        for (int64_t i = 0; i < row; ++i) keys.push_back(normal(rng) + 0.1f * static_cast<float>(i % 17));
        for (int64_t i = 0; i < row; ++i) values.push_back(normal(rng));
      }
      batch.seqs.push_back(slice);
    }
    const std::vector<int64_t> slots = ResolveSlotMapping(batch, layout.block_size);
    cpu::WriteKvCache(slots, layout, keys.data(), values.data(), row, KvElement::kQ4, key_q4.data(), value_q4.data());
    cpu::WriteKvCache(slots, layout, keys.data(), values.data(), row, key_exact.data(), value_exact.data());
    if (phase == 1) step = batch;
  }
  std::vector<float> key_dequantized(elements), value_dequantized(elements);
  cpu::DequantizeQ4(key_q4.data(), static_cast<int64_t>(elements), key_dequantized.data());
  cpu::DequantizeQ4(value_q4.data(), static_cast<int64_t>(elements), value_dequantized.data());

  const size_t T = step.tokens.size();
  std::vector<float> query(T * c.num_heads * c.head_dim);
  for (float& x : query) x = normal(rng);
  std::vector<std::vector<int64_t>> views(step.seqs.size());
  for (size_t s = 0; s < step.seqs.size(); ++s) ViewSlots(step.seqs[s], layout.block_size, views[s]);
  auto attend = [&](KvElement element, const void* keys, const void* values) {
    std::vector<float> out(query.size(), NAN), lse(T * c.num_heads, NAN);
    cpu::AttentionIo io;
    io.query = query.data();
    io.query_row_stride = static_cast<int64_t>(c.num_heads) * c.head_dim;
    io.out = out.data();
    io.out_row_stride = io.query_row_stride;
    io.lse = lse.data();
    cpu::PagedAttention(step, views, layout, c.num_heads, io, element, keys, values,
                        1.0f / std::sqrt(static_cast<float>(c.head_dim)));
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const std::vector<float> q4 = attend(KvElement::kQ4, key_q4.data(), value_q4.data());
  const std::vector<float> dequantized = attend(KvElement::kF32, key_dequantized.data(), value_dequantized.data());
  const std::vector<float> exact = attend(KvElement::kF32, key_exact.data(), value_exact.data());
  for (size_t i = 0; i < q4.size(); ++i) {
    ASSERT_TRUE(std::isfinite(q4[i])) << i;
    max_dequantized_error = std::max(max_dequantized_error, std::fabs(double(q4[i]) - dequantized[i]));
    max_quantization_effect = std::max(max_quantization_effect, std::fabs(double(q4[i]) - exact[i]));
  }
}

TEST(KvQ4Attention, EqualsFp32AttentionOverTheDequantizedPool) {
  const std::vector<AttentionCase> cases = {
      {8, 2, 64, 16, {40, 0, 17, 100}, {1, 23, 5, 9}},  // GQA, decode and prefill mixed
      {4, 4, 128, 8, {13, 3}, {1, 19}},                  // MHA, head_dim 128, small blocks
      {6, 1, 32, 16, {1500}, {2}},                       // MQA, long decode split across partitions
      {12, 3, 96, 16, {0, 64}, {33, 16}},                // head_dim 96: three groups a row
  };
  double max_dequantized_error = 0.0, max_quantization_effect = 0.0;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    CompareWithDequantizedPool(cases[i], 100 + static_cast<uint32_t>(i), max_dequantized_error,
                               max_quantization_effect);
  }
  std::printf("  q4 attention vs fp32 over the dequantized pool: max |diff| %.3g (outputs and lse); "
              "vs the unquantized values: %.3g\n",
              max_dequantized_error, max_quantization_effect);
  EXPECT_LE(max_dequantized_error, 1e-5);
  EXPECT_LT(max_quantization_effect, 0.5);  // 4 bits move outputs of unit-variance values by ~0.1
}

TEST(KvQ4Attention, ChunkScoringReadsDequantizedKeys) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int H = 4, KV = 2, D = 64, bs = 16;
  const KvCacheLayout layout{1, 6, KV, bs, D};
  std::vector<float> keys(layout.layer_stride());
  for (float& x : keys) x = normal(rng);
  std::vector<Q4Group> key_q4(keys.size() / cpu::kQ4GroupSize);
  cpu::QuantizeQ4(keys.data(), static_cast<int64_t>(keys.size()), key_q4.data());
  std::vector<float> dequantized(keys.size());
  cpu::DequantizeQ4(key_q4.data(), static_cast<int64_t>(keys.size()), dequantized.data());
  std::vector<float> query(2 * H * D);
  for (float& x : query) x = normal(rng);
  std::vector<KvBlockScoreJob> jobs(2);
  jobs[0] = {0, {4, 1, 5}, 40, 0};  // last block partly filled
  jobs[1] = {1, {0, 2}, 32, 3};
  std::vector<float> from_q4(5, 0.0f), from_f32(5, 0.0f);
  cpu::ScoreKvBlocks(jobs, layout, H, query.data(), H * D, KvElement::kQ4, key_q4.data(), from_q4);
  cpu::ScoreKvBlocks(jobs, layout, H, query.data(), H * D, KvElement::kF32, dequantized.data(), from_f32);
  for (size_t i = 0; i < from_q4.size(); ++i) {
    EXPECT_GT(from_q4[i], 0.0f) << i;
    EXPECT_FLOAT_EQ(from_q4[i], from_f32[i]) << i;
  }
}

// ---- a q4 CPU backend --------------------------------------------------------------------------

std::unique_ptr<CpuBackend> MakeTinyQ4Backend(int num_blocks, int block_size, int num_host_blocks) {
  auto files = MakeTinyRandomModel().value();
  LlamaWeights w = LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
  KvCacheLayout layout{files.config.num_layers, num_blocks, files.config.num_kv_heads, block_size,
                       files.config.head_dim};
  auto backend = CpuBackend::Create(files.config, std::move(w), layout, num_host_blocks, 2, KvElement::kQ4);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

TEST(KvQ4Backend, TransferredKvDecodesLikeTheOriginal) {
  auto backend = MakeTinyQ4Backend(12, 8, 3);
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->kv_element(), KvElement::kQ4);
  EXPECT_NE(backend->Describe().find("q4 KV pool"), std::string::npos) << backend->Describe();
  test::ExpectTransferredKvDecodesAlike(*backend, 5);
}

// Whole blocks copied device to device, and swapped out to the host and back into other blocks,
// decode exactly as the originals.
TEST(KvQ4Backend, CopiedAndSwappedBlocksDecodeLikeTheOriginal) {
  auto backend = MakeTinyQ4Backend(10, 16, 3);
  ASSERT_NE(backend, nullptr);
  const int vocab = backend->model_config().vocab_size;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> token(0, vocab - 1);
  const int kPrompt = 40;  // blocks of 16, 16 and 8 tokens
  ForwardBatch prefill;
  for (int i = 0; i < kPrompt; ++i) {
    prefill.tokens.push_back(token(rng));
    prefill.positions.push_back(i);
  }
  SequenceSlice s;
  s.num_tokens = kPrompt;
  s.context_len = kPrompt;
  s.block_table = {7, 2, 5};
  s.logits = LogitsMode::kNone;
  prefill.seqs.push_back(s);
  std::vector<float> unused;
  ASSERT_TRUE(LlamaModel(*backend).Forward(prefill, unused).ok());

  const std::vector<BlockMove> copies = {{7, 0}, {2, 1}, {5, 3}};
  ASSERT_TRUE(backend->CopyBlocks(copies, BlockCopyKind::kDeviceToDevice).ok());
  const std::vector<BlockMove> out = {{7, 2}, {2, 0}, {5, 1}}, in = {{2, 4}, {0, 6}, {1, 8}};
  ASSERT_TRUE(backend->CopyBlocks(out, BlockCopyKind::kDeviceToHost).ok());
  ASSERT_TRUE(backend->CopyBlocks(in, BlockCopyKind::kHostToDevice).ok());

  auto decode = [&](const std::vector<BlockId>& table) {
    ForwardBatch d;
    d.tokens = {prefill.tokens[5]};
    d.positions = {kPrompt};
    SequenceSlice one;
    one.num_tokens = 1;
    one.context_len = kPrompt + 1;
    one.block_table = table;
    d.seqs.push_back(one);
    std::vector<float> logits;
    EXPECT_TRUE(LlamaModel(*backend).Forward(d, logits).ok());
    return logits;
  };
  // Each decode writes its token into slot 8 of the table's last block, which none of the others read.
  const std::vector<float> original = decode({7, 2, 5});
  ASSERT_FALSE(original.empty());
  EXPECT_EQ(decode({0, 1, 3}), original) << "copied device to device";
  EXPECT_EQ(decode({4, 6, 8}), original) << "swapped out and back";
}

TEST(KvQ4Backend, HeadDimNotAMultipleOf32IsRefused) {
  auto files = MakeTinyRandomModel().value();
  ModelConfig config = files.config;
  config.head_dim = 48;
  KvCacheLayout layout{config.num_layers, 4, config.num_kv_heads, 16, config.head_dim};
  auto backend = CpuBackend::Create(config, LlamaWeights{}, layout, 0, 1, KvElement::kQ4);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(backend.status().ToString().find("head_dim 48 is not a multiple of 32"), std::string::npos)
      << backend.status().ToString();
  // The factory refuses before sizing the pool.
  EngineConfig engine_config;
  engine_config.kv_cache_dtype = "q4";
  engine_config.num_kv_blocks = 4;
  auto through_factory = CreateBackend(engine_config, false, config, LlamaWeights{});
  ASSERT_FALSE(through_factory.ok());
  EXPECT_NE(through_factory.status().ToString().find("multiple of 32"), std::string::npos)
      << through_factory.status().ToString();
}

// ---- through the engine ------------------------------------------------------------------------

// tiny-random's weights are random, so its logits follow every perturbation of the attention
// outputs: a 4-bit cache (RMS error ~8% of a normal row's spread, KvQ4Quantize) moves its prompt
// logprobs by ~0.3 on average (max ~1.4), hundreds of times what an fp16 cache does, and greedy
// decoding diverges after a token or two. The bounds hold that, and that the q4 path is consistent:
// a prompt prefilled in chunks (later chunks read the earlier chunks' q4 rows) scores as one prefill.
TEST(KvQ4Engine, PromptLogprobsStayCloseToTheFp32Cache) {
  auto files = MakeTinyRandomModel().value();
  ASSERT_EQ(files.config.head_dim % 32, 0) << "tiny-random's head_dim " << files.config.head_dim;
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> token(3, 250);
  std::vector<std::vector<int32_t>> prompts(3);
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompts[i].resize(60 + 40 * i);
    for (auto& t : prompts[i]) t = token(rng);
  }
  const size_t kGenerated = 12;
  struct Run {
    std::vector<std::vector<SampledToken>> prompt_logprobs;
    std::vector<std::vector<int32_t>> generated;
  };
  auto run = [&](const std::string& kv_cache_dtype, int max_num_batched_tokens) {
    EngineConfig c;
    c.kv_cache_dtype = kv_cache_dtype;
    c.max_num_batched_tokens = max_num_batched_tokens;
    Run r;
    r.prompt_logprobs.resize(prompts.size());
    r.generated.resize(prompts.size());
    auto engine = test::MakeEngine(c);
    if (!engine) return r;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SamplingParams p = test::Greedy(static_cast<int>(kGenerated));
      p.prompt_logprobs = 1;
      auto id = engine->AddRequest(prompts[i], p, [&r, i](const StreamEvent& e) {
        if (!e.prompt_logprobs.empty()) r.prompt_logprobs[i] = e.prompt_logprobs;
        for (const auto& t : e.tokens) r.generated[i].push_back(t.token);
      });
      EXPECT_TRUE(id.ok()) << id.status().ToString();
    }
    while (engine->HasUnfinishedRequests()) {
      auto st = engine->Step();
      EXPECT_TRUE(st.ok()) << st.status().ToString();
      if (!st.ok()) break;
    }
    return r;
  };
  struct Deltas {
    double max = 0.0, mean = 0.0;
  };
  auto compare = [&](const Run& a, const Run& b) {
    Deltas d;
    size_t count = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(a.prompt_logprobs[i].size(), prompts[i].size() - 1) << i;
      EXPECT_EQ(b.prompt_logprobs[i].size(), prompts[i].size() - 1) << i;
      for (size_t t = 0; t < std::min(a.prompt_logprobs[i].size(), b.prompt_logprobs[i].size()); ++t) {
        const double delta = std::fabs(double(a.prompt_logprobs[i][t].logprob) - b.prompt_logprobs[i][t].logprob);
        EXPECT_TRUE(std::isfinite(delta)) << i << " " << t;
        d.max = std::max(d.max, delta);
        d.mean += delta;
        ++count;
      }
    }
    d.mean /= static_cast<double>(std::max<size_t>(1, count));
    return d;
  };
  // Chunks of 64 tokens: every prompt but the first prefills in several steps.
  const Run exact = run("f32", 64), f16 = run("f16", 64), q4 = run("q4", 64);
  const Run q4_whole = run("q4", 2048), int4 = run("int4", 64);
  double mean_abs_logprob = 0.0;
  size_t count = 0, same_generated = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const SampledToken& t : exact.prompt_logprobs[i]) mean_abs_logprob += std::fabs(t.logprob);
    count += exact.prompt_logprobs[i].size();
    ASSERT_EQ(q4.generated[i].size(), kGenerated) << i;
    ASSERT_EQ(exact.generated[i].size(), kGenerated) << i;
    for (size_t t = 0; t < kGenerated; ++t) same_generated += q4.generated[i][t] == exact.generated[i][t];
  }
  mean_abs_logprob /= static_cast<double>(count);
  const Deltas q4_vs_f32 = compare(q4, exact), f16_vs_f32 = compare(f16, exact);
  const Deltas chunked_vs_whole = compare(q4, q4_whole), int4_vs_q4 = compare(int4, q4);
  std::printf("  tiny-random, %zu prompt logprobs (mean |logprob| %.3f): q4 vs f32 KV max |dlogprob| %.4f, mean %.4f; "
              "f16 vs f32 max %.4f, mean %.5f; q4 chunked vs whole prefill max %.2g; greedy tokens agree at %zu of %zu\n",
              count, mean_abs_logprob, q4_vs_f32.max, q4_vs_f32.mean, f16_vs_f32.max, f16_vs_f32.mean,
              chunked_vs_whole.max, same_generated, kGenerated * prompts.size());
  EXPECT_LT(q4_vs_f32.max, 2.0);
  EXPECT_LT(q4_vs_f32.mean, 0.1 * mean_abs_logprob);
  EXPECT_GT(q4_vs_f32.mean, f16_vs_f32.mean) << "a 4-bit cache is coarser than fp16: was it used?";
  EXPECT_LT(chunked_vs_whole.max, 1e-3);
  EXPECT_EQ(int4_vs_q4.max, 0.0) << "int4 names the same cache";
}

TEST(KvQ4Engine, CudaAndUnknownNamesAreRefused) {
  EngineConfig cuda;
  cuda.device = "cuda";
  cuda.kv_cache_dtype = "q4";
  auto on_cuda = test::CreateTinyEngine(cuda);
  ASSERT_FALSE(on_cuda.ok());
  EXPECT_EQ(on_cuda.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(on_cuda.status().ToString().find("CPU only"), std::string::npos) << on_cuda.status().ToString();

  EngineConfig unknown;
  unknown.kv_cache_dtype = "q3";
  auto refused = test::CreateTinyEngine(unknown);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().ToString().find("q4"), std::string::npos) << refused.status().ToString();
}

}  // namespace
}  // namespace kvflow
