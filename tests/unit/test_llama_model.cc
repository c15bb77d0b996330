// The one Llama forward (forward/llama_model.h) on the CPU backend: its per-layer hooks, the
// explicit slot mapping (a token's KV slot is not tied to its position), KV views (block subsets,
// explicit slots, sinks + window) against plain attention over the same tokens, and attention's
// log-sum-exp, with which two partial attentions over disjoint KV sets merge into the whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/paged_attention.h"
#include "kv_transfer_check.h"
#include "forward/llama_model.h"
#include "model/tiny_random.h"

namespace kvflow {
namespace {

struct TinyModel {
  ModelConfig config;
  std::unique_ptr<CpuBackend> backend;
  std::vector<float> wo0;  // layer 0's output projection, [hidden][heads * head_dim], fp32
};

TinyModel MakeTiny(int num_blocks, int block_size, int num_host_blocks = 0) {
  auto files = MakeTinyRandomModel().value();
  TinyModel m;
  m.config = files.config;
  LlamaWeights w = LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
  if (w.layers[0].wo.is_f32()) m.wo0 = w.layers[0].wo.f32();
  KvCacheLayout layout{m.config.num_layers, num_blocks, m.config.num_kv_heads, block_size, m.config.head_dim};
  m.backend = CpuBackend::Create(m.config, std::move(w), layout, num_host_blocks, 2).value();
  return m;
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, int n, int vocab) {
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = d(rng);
  return v;
}

// One sequence's prefill of `tokens` with every row's logits.
ForwardBatch Prefill(const std::vector<int32_t>& tokens, const std::vector<BlockId>& table) {
  ForwardBatch b;
  b.tokens = tokens;
  b.positions.resize(tokens.size());
  std::iota(b.positions.begin(), b.positions.end(), 0);
  SequenceSlice s;
  s.num_tokens = static_cast<int32_t>(tokens.size());
  s.context_len = s.num_tokens;
  s.block_table = table;
  s.logits = LogitsMode::kAll;
  b.seqs.push_back(s);
  return b;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

class RecordingHooks : public LayerHooks {
 public:
  Status BeforeAttention(const LayerContext& ctx) override {
    events.push_back("before " + std::to_string(ctx.layer));
    // K/V of this layer are already in the cache: the first token's key is not NaN.
    auto* cpu = static_cast<CpuBackend*>(&ctx.backend);
    seen_qkv_row0.push_back(cpu->activation(Activation::kQkv)[0]);
    if (ctx.layer == fail_at) return Status::Internal("hook failed at layer " + std::to_string(ctx.layer));
    return Status::Ok();
  }
  Status AfterAttention(const LayerContext& ctx) override {
    events.push_back("after " + std::to_string(ctx.layer));
    return Status::Ok();
  }
  std::vector<std::string> events;
  std::vector<float> seen_qkv_row0;
  int fail_at = -1;
};

TEST(LlamaModel, HooksRunAroundEveryLayersAttentionAndCanFailTheStep) {
  TinyModel m = MakeTiny(16, 16);
  std::mt19937 rng(1);
  const ForwardBatch b = Prefill(RandomTokens(rng, 9, m.config.vocab_size), {3});
  std::vector<float> plain, hooked;
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, plain).ok());
  RecordingHooks hooks;
  ASSERT_TRUE(LlamaModel(*m.backend, &hooks).Forward(b, hooked).ok());
  std::vector<std::string> want;
  for (int l = 0; l < m.config.num_layers; ++l) {
    want.push_back("before " + std::to_string(l));
    want.push_back("after " + std::to_string(l));
  }
  EXPECT_EQ(hooks.events, want);
  for (float x : hooks.seen_qkv_row0) EXPECT_TRUE(std::isfinite(x));
  EXPECT_EQ(MaxAbsDiff(plain, hooked), 0.0) << "hooks that do nothing change nothing";

  RecordingHooks failing;
  failing.fail_at = 1;
  const Status st = LlamaModel(*m.backend, &failing).Forward(b, hooked);
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("layer 1"), std::string::npos);
  EXPECT_EQ(failing.events.back(), "before 1");
}

// The points tensor parallelism will sum partial projections at: after the output projection and
// after the down projection, each with that projection's output in kDelta, in layer order.
class ProjectionHooks : public LayerHooks {
 public:
  Status AfterAttention(const LayerContext& ctx) override { return Record("attention", ctx, Activation::kAttention); }
  Status AfterAttentionOutput(const LayerContext& ctx) override { return Record("o_proj", ctx, Activation::kDelta); }
  Status AfterMlpInput(const LayerContext& ctx) override { return Record("mlp_input", ctx, Activation::kGateUp); }
  Status AfterMlpOutput(const LayerContext& ctx) override { return Record("down_proj", ctx, Activation::kDelta); }
  Status Record(const std::string& what, const LayerContext& ctx, Activation a) {
    events.push_back(what + " " + std::to_string(ctx.layer));
    const int64_t width = ActivationWidth(ctx.backend.model_config(), a);
    rows.emplace_back(static_cast<size_t>(width));
    return ctx.backend.ReadActivationRows(a, 0, 1, rows.back());
  }
  std::vector<std::string> events;
  std::vector<std::vector<float>> rows;
};

TEST(LlamaModel, ProjectionHookPointsSeeEachProjectionsOutput) {
  TinyModel m = MakeTiny(16, 16);
  std::mt19937 rng(3);
  const ForwardBatch b = Prefill(RandomTokens(rng, 9, m.config.vocab_size), {3});
  std::vector<float> plain, hooked;
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, plain).ok());
  ProjectionHooks hooks;
  ASSERT_TRUE(LlamaModel(*m.backend, &hooks).Forward(b, hooked).ok());
  std::vector<std::string> want;
  for (int l = 0; l < m.config.num_layers; ++l) {
    for (const char* p : {"attention ", "o_proj ", "mlp_input ", "down_proj "}) want.push_back(p + std::to_string(l));
  }
  ASSERT_EQ(hooks.events, want);
  EXPECT_EQ(MaxAbsDiff(plain, hooked), 0.0);
  for (int l = 0; l < m.config.num_layers; ++l) {
    const auto& o_proj = hooks.rows[static_cast<size_t>(4 * l + 1)];
    const auto& down_proj = hooks.rows[static_cast<size_t>(4 * l + 3)];
    // kDelta was rewritten by the down projection between the two points.
    EXPECT_GT(MaxAbsDiff(o_proj, down_proj), 0.0) << "layer " << l;
    for (float x : o_proj) ASSERT_TRUE(std::isfinite(x));
  }
  // The o_proj output is the output projection of the attention row (fp32 weights: exact up to
  // summation order).
  const std::vector<float>& attention = hooks.rows[0];
  const std::vector<float>& o_proj = hooks.rows[1];
  std::vector<float> expect(o_proj.size(), 0.0f);
  const std::vector<float>& wo = m.wo0;
  ASSERT_EQ(wo.size(), o_proj.size() * attention.size()) << "the tiny model's weights load as fp32";
  for (size_t r = 0; r < expect.size(); ++r) {
    double acc = 0.0;
    for (size_t c = 0; c < attention.size(); ++c) acc += double(wo[r * attention.size() + c]) * attention[c];
    expect[r] = static_cast<float>(acc);
  }
  EXPECT_LT(MaxAbsDiff(expect, o_proj), 1e-4);
}

// The same prompt written to slots scattered over the pool in a shuffled order, read back through
// a slots view in position order, gives the logits of the plain block-table layout.
TEST(LlamaModel, ExplicitSlotMappingDecouplesSlotsFromPositions) {
  const int kBlockSize = 8, kBlocks = 12;
  TinyModel m = MakeTiny(kBlocks, kBlockSize);
  std::mt19937 rng(2);
  const std::vector<int32_t> prompt = RandomTokens(rng, 21, m.config.vocab_size);
  std::vector<float> reference, scattered;
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(Prefill(prompt, {4, 9, 1}), reference).ok());

  // Slots anywhere outside the plain layout's blocks, in random order.
  const std::vector<BlockId> plain_blocks = {4, 9, 1};
  std::vector<int64_t> slots;
  for (int64_t slot = 0; slot < kBlocks * kBlockSize; ++slot) {
    if (std::find(plain_blocks.begin(), plain_blocks.end(), slot / kBlockSize) == plain_blocks.end()) slots.push_back(slot);
  }
  std::shuffle(slots.begin(), slots.end(), rng);
  const int64_t free_slot = slots[prompt.size()];
  slots.resize(prompt.size());
  ForwardBatch b = Prefill(prompt, {0, 1, 2});  // the table is not what is read or written
  b.slot_mapping = slots;
  b.seqs[0].view = KvView::Slots(slots);
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, scattered).ok());
  EXPECT_LT(MaxAbsDiff(reference, scattered), 1e-5);

  // A decode step continues it: its token goes to yet another free slot.
  ForwardBatch d;
  d.tokens = {RandomTokens(rng, 1, m.config.vocab_size)[0]};
  d.positions = {static_cast<int32_t>(prompt.size())};
  SequenceSlice s;
  s.num_tokens = 1;
  s.context_len = static_cast<int32_t>(prompt.size()) + 1;
  s.block_table = {4, 9, 1};
  ForwardBatch d_plain = d;
  d_plain.seqs.push_back(s);
  std::vector<int64_t> next(slots.begin(), slots.end());
  next.push_back(free_slot);
  d.slot_mapping = {free_slot};
  s.view = KvView::Slots(next);
  d.seqs.push_back(s);
  std::vector<float> step_ref, step_scattered;
  // Both layouts still hold the prompt: they share no block.
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(d_plain, step_ref).ok());
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(d, step_scattered).ok());
  EXPECT_LT(MaxAbsDiff(step_ref, step_scattered), 1e-5);
}

TEST(LlamaModel, FullTableViewsInEveryFormAgree) {
  const int kBlockSize = 4;
  TinyModel m = MakeTiny(16, kBlockSize);
  std::mt19937 rng(3);
  const std::vector<int32_t> prompt = RandomTokens(rng, 14, m.config.vocab_size);
  const std::vector<BlockId> table = {7, 2, 11, 5};
  std::vector<float> full, subset, slots;
  ForwardBatch b = Prefill(prompt, table);
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, full).ok());
  b.seqs[0].view = KvView::BlockSubset(table, 14);
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, subset).ok());
  std::vector<int64_t> s;
  ViewSlots(Prefill(prompt, table).seqs[0], kBlockSize, s);
  b.seqs[0].view = KvView::Slots(s);
  ASSERT_TRUE(LlamaModel(*m.backend).Forward(b, slots).ok());
  EXPECT_EQ(MaxAbsDiff(full, subset), 0.0);
  EXPECT_EQ(MaxAbsDiff(full, slots), 0.0);
}

TEST(LlamaModel, BadViewsAndSlotsAreRefused) {
  TinyModel m = MakeTiny(4, 4);
  std::vector<float> logits;
  ForwardBatch b = Prefill({1, 2, 3}, {0});
  b.seqs[0].view = KvView::BlockSubset({9}, 3);
  EXPECT_EQ(LlamaModel(*m.backend).Forward(b, logits).code(), StatusCode::kInvalidArgument);
  b.seqs[0].view = KvView::Slots({0, 1});  // fewer entries than the step's tokens
  EXPECT_EQ(LlamaModel(*m.backend).Forward(b, logits).code(), StatusCode::kInvalidArgument);
  b.seqs[0].view = KvView::Slots({0, 1, 999});
  EXPECT_EQ(LlamaModel(*m.backend).Forward(b, logits).code(), StatusCode::kInvalidArgument);
  b.seqs[0].view = KvView::Full();
  b.slot_mapping = {0, 1};
  EXPECT_EQ(LlamaModel(*m.backend).Forward(b, logits).code(), StatusCode::kInvalidArgument);
  b.slot_mapping = {0, 1, 16};
  EXPECT_EQ(LlamaModel(*m.backend).Forward(b, logits).code(), StatusCode::kInvalidArgument);
}

TEST(LlamaModel, TransferredKvDecodesLikeTheOriginal) {
  TinyModel m = MakeTiny(12, 8, 3);
  test::ExpectTransferredKvDecodesAlike(*m.backend, 4);
}

// ---- attention over views, against attention in double over the same tokens ------------------

struct AttentionFixture {
  int num_heads = 6, num_kv_heads = 2, head_dim = 16, block_size = 4;
  KvCacheLayout layout;
  std::vector<float> kc, vc;
  std::mt19937 rng{11};

  explicit AttentionFixture(int num_blocks) {
    layout = KvCacheLayout{1, num_blocks, num_kv_heads, block_size, head_dim};
    std::normal_distribution<float> normal(0.0f, 1.0f);
    kc.resize(layout.layer_stride());
    vc.resize(layout.layer_stride());
    for (float& x : kc) x = normal(rng);
    for (float& x : vc) x = normal(rng);
  }
  std::vector<float> Queries(int rows) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(rows * num_heads * head_dim));
    for (float& x : q) x = normal(rng);
    return q;
  }
  // Softmax attention of query row `t` head `h` over `slots`, in double.
  std::vector<double> Dense(const float* q, const std::vector<int64_t>& slots, int h, double* lse) const {
    const int kvh = h / (num_heads / num_kv_heads);
    const double scale = 1.0 / std::sqrt(double(head_dim));
    std::vector<double> s(slots.size()), out(static_cast<size_t>(head_dim), 0.0);
    double mx = -INFINITY;
    for (size_t j = 0; j < slots.size(); ++j) {
      const float* k = kc.data() + layout.offset(int(slots[j] / block_size), kvh, int(slots[j] % block_size));
      double dot = 0.0;
      for (int d = 0; d < head_dim; ++d) dot += double(q[d]) * k[d];
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double den = 0.0;
    for (double& x : s) den += (x = std::exp(x - mx));
    for (size_t j = 0; j < slots.size(); ++j) {
      const float* v = vc.data() + layout.offset(int(slots[j] / block_size), kvh, int(slots[j] % block_size));
      for (int d = 0; d < head_dim; ++d) out[size_t(d)] += s[j] / den * v[d];
    }
    if (lse) *lse = mx + std::log(den);
    return out;
  }
};

// Decode slices (one query each) over sinks + window and block-subset views.
TEST(PagedAttentionViews, SinksWindowAndBlockSubsetsMatchDenseAttention) {
  AttentionFixture f(24);
  const std::vector<BlockId> table = {5, 17, 2, 9, 21, 0, 13};  // 27 tokens in 7 blocks of 4
  const int32_t ctx = 27;
  ForwardBatch b;
  b.tokens = {0, 0, 0};
  b.positions = {ctx - 1, ctx - 1, ctx - 1};
  std::vector<std::vector<int64_t>> expected_slots;
  auto add = [&](KvView view) {
    SequenceSlice s;
    s.token_offset = static_cast<int32_t>(b.seqs.size());
    s.num_tokens = 1;
    s.context_len = ctx;
    s.block_table = table;
    s.view = std::move(view);
    std::vector<int64_t> slots;
    ViewSlots(s, f.block_size, slots);
    expected_slots.push_back(slots);
    b.seqs.push_back(std::move(s));
  };
  add(KvView::SinksAndWindow(table, ctx, 4, 6, f.block_size));     // 4 sinks + 6 recent tokens
  add(KvView::BlockSubset({5, 9, 13}, 11));                          // blocks 0, 3 and the current one
  add(KvView::SinksAndWindow(table, ctx, 20, 20, f.block_size));    // overlapping: every token
  ASSERT_EQ(expected_slots[0].size(), 10u);
  EXPECT_EQ(expected_slots[0].front(), 5 * 4);                           // token 0
  EXPECT_EQ(expected_slots[0].back(), 13 * 4 + 2);                       // token 26
  ASSERT_EQ(expected_slots[2].size(), static_cast<size_t>(ctx));
  const std::vector<float> q = f.Queries(3);
  std::vector<float> out(q.size()), lse(static_cast<size_t>(3 * f.num_heads));
  cpu::AttentionIo io{q.data(), f.num_heads * f.head_dim, out.data(), f.num_heads * f.head_dim, lse.data()};
  cpu::PagedAttention(b, expected_slots, f.layout, f.num_heads, io, f.kc.data(), f.vc.data(),
                      1.0f / std::sqrt(float(f.head_dim)));
  double max_err = 0.0, max_lse_err = 0.0;
  for (int t = 0; t < 3; ++t) {
    for (int h = 0; h < f.num_heads; ++h) {
      double ref_lse = 0.0;
      const auto ref = f.Dense(q.data() + (t * f.num_heads + h) * f.head_dim, expected_slots[size_t(t)], h, &ref_lse);
      for (int d = 0; d < f.head_dim; ++d) {
        max_err = std::max(max_err, std::fabs(ref[size_t(d)] - out[size_t((t * f.num_heads + h) * f.head_dim + d)]));
      }
      max_lse_err = std::max(max_lse_err, std::fabs(ref_lse - lse[size_t(t * f.num_heads + h)]));
    }
  }
  std::printf("  views vs dense attention: max |err| %.3g, log-sum-exp max |err| %.3g\n", max_err, max_lse_err);
  EXPECT_LT(max_err, 1e-5);
  EXPECT_LT(max_lse_err, 1e-5);
}

// Attention over the first part of a context and over the rest, merged by their log-sum-exps,
// equals attention over the whole context.
TEST(PagedAttentionViews, TwoHalvesMergedByLogSumExpEqualTheWhole) {
  AttentionFixture f(80);
  std::vector<int64_t> all(80 * 4);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), f.rng);
  const std::vector<int> lens = {1, 37, 90, 150};
  const int S = static_cast<int>(lens.size());
  ForwardBatch b;
  std::vector<std::vector<int64_t>> whole, first, second;
  size_t next = 0;
  for (int s = 0; s < S; ++s) {
    const std::vector<int64_t> slots(all.begin() + long(next), all.begin() + long(next + size_t(lens[s])));
    next += size_t(lens[s]);
    const size_t split = slots.size() / 3;
    whole.push_back(slots);
    first.emplace_back(slots.begin(), slots.begin() + long(split));
    second.emplace_back(slots.begin() + long(split), slots.end());
    SequenceSlice sl;
    sl.token_offset = s;
    sl.num_tokens = 1;
    sl.context_len = lens[s];
    sl.view = KvView::Slots(slots);
    b.seqs.push_back(sl);
    b.tokens.push_back(0);
    b.positions.push_back(lens[s] - 1);
  }
  const int W = f.num_heads * f.head_dim;
  const std::vector<float> q = f.Queries(S);
  const float scale = 1.0f / std::sqrt(float(f.head_dim));
  auto run = [&](const std::vector<std::vector<int64_t>>& views, std::vector<float>& out, std::vector<float>& lse) {
    out.assign(q.size(), 0.0f);
    lse.assign(size_t(S * f.num_heads), 0.0f);
    cpu::AttentionIo io{q.data(), W, out.data(), W, lse.data()};
    cpu::PagedAttention(b, views, f.layout, f.num_heads, io, f.kc.data(), f.vc.data(), scale);
  };
  std::vector<float> o_all, l_all, o_a, l_a, o_b, l_b;
  run(whole, o_all, l_all);
  run(first, o_a, l_a);
  run(second, o_b, l_b);
  // The one-token sequence has an empty first part: its side has no mass.
  for (int h = 0; h < f.num_heads; ++h) l_a[size_t(h)] = -INFINITY;
  std::vector<float> merged(q.size()), merged_lse(l_all.size());
  cpu::MergeAttentionStates(o_a.data(), l_a.data(), o_b.data(), l_b.data(), S * f.num_heads, f.head_dim,
                            merged.data(), merged_lse.data());
  const double err = MaxAbsDiff(merged, o_all), lse_err = MaxAbsDiff(merged_lse, l_all);
  std::printf("  merged halves vs whole: max |err| %.3g, log-sum-exp max |err| %.3g\n", err, lse_err);
  EXPECT_LT(err, 1e-5);
  EXPECT_LT(lse_err, 1e-5);
}

}  // namespace
}  // namespace kvflow
