// The KV offload tier (issue 16, EngineConfig::kv_offload): the pool in host memory, two layers'
// staging buffers, each layer fetching what its attention reads. Offloading moves bytes, never
// changes a number: outputs are bit-identical to the resident pool (full attention, InfiniGen and
// H2O), the bytes fetched are exactly what attention reads, a prefetch that disagrees with what
// attention reads is an error, and what the tier cannot run is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <random>

#include "backend/backend_factory.h"
#include "engine_test_util.h"
#include "kv_selection_test_util.h"
#include "offload/kv_prefetch.h"

namespace kvflow {
namespace {

using test::RandomTokens;

// The tiny-random model's CPU backend with `blocks` blocks (16 tokens each), resident or offloaded.
std::unique_ptr<Backend> TinyBackend(bool offload, int blocks, const std::string& kv_dtype = "f32") {
  return test::TinyCpuBackend((blocks - 2) * 16, offload, kv_dtype);
}

// One sequence over blocks [first_block, first_block + n): `tokens` new tokens after `cached` ones.
SequenceSlice Slice(int32_t token_offset, int32_t tokens, int32_t cached, std::vector<BlockId> table) {
  SequenceSlice s;
  s.token_offset = token_offset;
  s.num_tokens = tokens;
  s.context_len = cached + tokens;
  s.block_table = std::move(table);
  return s;
}

// A selection per slice for one decode token each: per KV head a different scattered subset of
// the cached positions (every third, shifted by the head), then the step's own token.
std::vector<KvHeadSelection> ScatteredSelection(const ForwardBatch& batch, int num_kv_heads, int block_size) {
  std::vector<KvHeadSelection> sel(batch.seqs.size());
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const SequenceSlice& slice = batch.seqs[s];
    const int32_t cached = slice.context_len - 1;
    const int32_t per_head = (cached + 2) / 3 + 1;
    sel[s].per_head = per_head;
    for (int h = 0; h < num_kv_heads; ++h) {
      int32_t taken = 0;
      for (int32_t p = h % 3; taken < per_head - 1; p = (p + 3) % cached) {
        sel[s].slots.push_back(SlotOf(slice.block_table, p, block_size));
        ++taken;
      }
      // Sorted, distinct: positions h%3, h%3+3, ... wrap around at most once for these sizes.
      std::sort(sel[s].slots.end() - (per_head - 1), sel[s].slots.end());
      sel[s].slots.push_back(SlotOf(slice.block_table, cached, block_size));
    }
  }
  return sel;
}

// Layer hooks that make every layer from 1 on read `selection`, prefetched during the layer before
// (as InfiniGen does) or announced only at the layer (`announce` false: attention fetches itself);
// `prefetched_instead` replaces what is announced, to test that a disagreeing prefetch is refused.
class FixedSelection final : public LayerHooks {
 public:
  FixedSelection(std::vector<KvHeadSelection> selection, bool announce)
      : selection_(std::move(selection)), announce_(announce) {}
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override {
    if (ctx.layer == 0) return {};
    return selection_;
  }
  std::optional<std::span<const KvHeadSelection>> UpcomingSelection(int layer) override {
    if (!announce_) return std::nullopt;
    if (!prefetched_instead_.empty()) return std::span<const KvHeadSelection>(prefetched_instead_);
    return std::span<const KvHeadSelection>(selection_);
  }
  std::vector<KvHeadSelection> prefetched_instead_;

 private:
  std::vector<KvHeadSelection> selection_;
  bool announce_;
};

// Runs a prefill of two sequences (37 and 21 tokens, scrambled block tables), then one decode
// token each, the decode under `hooks` (wrapped in the engine's prefetch schedule when offloaded),
// and returns the decode step's logits.
Result<std::vector<float>> PrefillThenDecode(Backend& backend, std::unique_ptr<LayerHooks> (*make_hooks)(const ForwardBatch&, int, int),
                                             KvPrefetchHooks* schedule) {
  const ModelConfig& mc = backend.model_config();
  const int bs = backend.kv_layout().block_size;
  const std::vector<BlockId> table_a = {5, 1, 7}, table_b = {2, 6};
  const std::vector<int32_t> a = RandomTokens(37, 3, mc.vocab_size), b = RandomTokens(21, 4, mc.vocab_size);
  ForwardBatch prefill;
  prefill.tokens = a;
  prefill.tokens.insert(prefill.tokens.end(), b.begin(), b.end());
  for (int i = 0; i < 37; ++i) prefill.positions.push_back(i);
  for (int i = 0; i < 21; ++i) prefill.positions.push_back(i);
  prefill.seqs = {Slice(0, 37, 0, table_a), Slice(37, 21, 0, table_b)};
  LlamaModel model(backend);
  std::vector<float> logits;
  if (schedule) model.set_hooks(schedule->Wrap(nullptr, mc.num_layers));
  KVFLOW_RETURN_IF_ERROR(model.Forward(prefill, logits));
  ForwardBatch decode;
  decode.tokens = RandomTokens(2, 5, mc.vocab_size);
  decode.positions = {37, 21};
  decode.seqs = {Slice(0, 1, 37, table_a), Slice(1, 1, 21, table_b)};
  std::unique_ptr<LayerHooks> hooks = make_hooks ? make_hooks(decode, mc.num_kv_heads, bs) : nullptr;
  model.set_hooks(schedule ? schedule->Wrap(hooks.get(), mc.num_layers) : hooks.get());
  KVFLOW_RETURN_IF_ERROR(model.Forward(decode, logits));
  return logits;
}

std::unique_ptr<LayerHooks> Prefetched(const ForwardBatch& b, int kv, int bs) {
  return std::make_unique<FixedSelection>(ScatteredSelection(b, kv, bs), true);
}
std::unique_ptr<LayerHooks> AtTheLayer(const ForwardBatch& b, int kv, int bs) {
  return std::make_unique<FixedSelection>(ScatteredSelection(b, kv, bs), false);
}
std::unique_ptr<LayerHooks> Disagreeing(const ForwardBatch& b, int kv, int bs) {
  auto hooks = std::make_unique<FixedSelection>(ScatteredSelection(b, kv, bs), true);
  hooks->prefetched_instead_ = ScatteredSelection(b, kv, bs);
  hooks->prefetched_instead_[0].slots[0] += 1;  // one token of one head differs
  return hooks;
}

TEST(KvOffloadBackend, StagesTwoLayersAndComputesBitIdentically) {
  for (const char* dtype : {"f32", "f16", "q4"}) {
    auto resident = TinyBackend(false, 12, dtype);
    auto offloaded = TinyBackend(true, 12, dtype);
    ASSERT_TRUE(resident && offloaded);
    EXPECT_EQ(resident->As<OffloadedKvPool>(), nullptr);
    ASSERT_NE(offloaded->As<OffloadedKvPool>(), nullptr);
    EXPECT_NE(offloaded->Describe().find("staging 2 layers"), std::string::npos) << offloaded->Describe();
    EXPECT_EQ(offloaded->num_host_blocks(), 0);  // no swap space
    for (auto make : {static_cast<std::unique_ptr<LayerHooks> (*)(const ForwardBatch&, int, int)>(nullptr), &Prefetched,
                      &AtTheLayer}) {
      KvPrefetchHooks schedule;
      auto r = PrefillThenDecode(*resident, make, nullptr);
      auto o = PrefillThenDecode(*offloaded, make, &schedule);
      ASSERT_TRUE(r.ok() && o.ok()) << r.status().ToString() << " " << o.status().ToString();
      EXPECT_EQ(r.value(), o.value()) << dtype;  // bit for bit: the same numbers, moved
    }
  }
}

TEST(KvOffloadBackend, FetchesExactlyWhatAttentionReads) {
  auto backend = TinyBackend(true, 12);
  const ModelConfig& mc = backend->model_config();
  const int64_t token_bytes = backend->kv_token_bytes();  // K and V of all KV heads, one layer
  const int64_t row_bytes = token_bytes / mc.num_kv_heads;  // K and V of one KV head
  const int L = mc.num_layers;
  KvPrefetchHooks schedule;
  ASSERT_TRUE(PrefillThenDecode(*backend, &Prefetched, &schedule).ok());
  const KvOffloadStats s = backend->As<OffloadedKvPool>()->kv_offload_stats();
  // Prefill: nothing is cached before the step, so its fetches move nothing; layers 1.. are
  // prefetched, layer 0 fetched on demand. Decode: layer 0 reads the views on demand, whole blocks
  // of the 37 + 21 cached tokens (3 + 2 blocks of 16); layers 1.. read the selections, prefetched,
  // only the selected rows of each KV head.
  const ForwardBatch probe = [] {
    ForwardBatch b;
    b.seqs = {Slice(0, 1, 37, {5, 1, 7}), Slice(1, 1, 21, {2, 6})};
    return b;
  }();
  const auto sel = ScatteredSelection(probe, mc.num_kv_heads, backend->kv_layout().block_size);
  const int64_t selected_rows = static_cast<int64_t>(mc.num_kv_heads) * ((sel[0].per_head - 1) + (sel[1].per_head - 1));
  EXPECT_EQ(s.on_demand_fetches, 2);
  EXPECT_EQ(s.prefetches, 2 * (L - 1));
  EXPECT_EQ(s.bytes_fetched, (3 + 2) * backend->kv_layout().block_size * token_bytes + (L - 1) * selected_rows * row_bytes);
  EXPECT_EQ(s.bytes_written, (37 + 21 + 2) * L * token_bytes);
  EXPECT_GT(s.fetch_seconds, 0.0);
}

// Resident blocks (OffloadedKvPool::KeepResident, TriForce's scratch): a step over them alone
// fetches and writes through nothing and computes what the resident pool computes, views of block
// subsets included; KV transfers reach them from the host pool; a step touching both is refused.
TEST(KvOffloadBackend, ResidentBlocksRunWithoutFetching) {
  auto resident = TinyBackend(false, 12);
  auto offloaded = TinyBackend(true, 12);
  ASSERT_TRUE(resident && offloaded);
  OffloadedKvPool* pool = offloaded->As<OffloadedKvPool>();
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->resident_begin(), offloaded->kv_layout().num_blocks);
  EXPECT_FALSE(pool->KeepResident(13).ok()) << "past the pool";
  ASSERT_TRUE(pool->KeepResident(8).ok());
  EXPECT_EQ(pool->resident_begin(), 8);
  const ModelConfig& mc = offloaded->model_config();
  const std::vector<int32_t> tokens = RandomTokens(40, 8, mc.vocab_size);
  // 24 tokens prefilled into host pool blocks 3, 1, 5 (a normal, fetching step) ...
  auto run = [&](Backend& backend, std::vector<float>& logits) -> Status {
    ForwardBatch prefill;
    prefill.tokens.assign(tokens.begin(), tokens.begin() + 24);
    for (int i = 0; i < 24; ++i) prefill.positions.push_back(i);
    prefill.seqs = {Slice(0, 24, 0, {3, 1})};
    LlamaModel model(backend);
    KVFLOW_RETURN_IF_ERROR(model.Forward(prefill, logits));
    // ... copied to resident blocks 9 and 11 (every layer), then 16 more tokens computed over a
    // block subset of the copies and a resident lane block 10.
    std::vector<KvTransfer> copies(2);
    copies[0].src_block = 3;
    copies[0].dst_block = 9;
    copies[1].src_block = 1;
    copies[1].dst_block = 11;
    for (KvTransfer& t : copies) {
      t.num_tokens = 16;
      t.layer_end = mc.num_layers;
    }
    copies[1].num_tokens = 8;
    KVFLOW_RETURN_IF_ERROR(backend.TransferKv(copies));
    ForwardBatch lane;
    lane.tokens.assign(tokens.begin() + 24, tokens.end());
    SequenceSlice slice = Slice(0, 16, 24, {});
    slice.logits = LogitsMode::kAll;
    // Positions 16..23 sit in block 11; the lane block 10 continues them at offset 8.
    slice.view = KvView::BlockSubset({9, 11, 10}, 40);
    for (int i = 24; i < 40; ++i) {
      lane.positions.push_back(i);
      lane.slot_mapping.push_back(i < 32 ? 11 * 16 + (i - 16) : 10 * 16 + (i - 32));
    }
    lane.seqs = {slice};
    return model.Forward(lane, logits);
  };
  std::vector<float> want, got;
  ASSERT_TRUE(run(*resident, want).ok());
  const KvOffloadStats before_prefill = pool->kv_offload_stats();
  Status st = run(*offloaded, got);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(got, want) << "the same numbers, read from resident blocks";
  const KvOffloadStats after = pool->kv_offload_stats();
  // Only the prefill wrote through (24 tokens, every layer); the resident step fetched nothing.
  EXPECT_EQ(after.bytes_written - before_prefill.bytes_written, 24 * mc.num_layers * offloaded->kv_token_bytes());
  EXPECT_EQ(after.prefetches, before_prefill.prefetches);
  EXPECT_EQ(after.on_demand_fetches - before_prefill.on_demand_fetches, mc.num_layers) << "the prefill's layers only";
  // One slice reading host pool blocks and writing a resident one: refused.
  ForwardBatch mixed;
  mixed.tokens = {tokens[0]};
  mixed.positions = {24};
  mixed.seqs = {Slice(0, 1, 24, {3, 1})};
  mixed.slot_mapping = {10 * 16};
  std::vector<float> logits;
  st = LlamaModel(*offloaded).Forward(mixed, logits);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.ToString();
  EXPECT_FALSE(TinyBackend(false, 12)->As<OffloadedKvPool>()) << "a resident pool has no such capability";
}

TEST(KvOffloadBackend, RefusesAttentionOverOtherTokensThanPrefetched) {
  auto backend = TinyBackend(true, 12);
  KvPrefetchHooks schedule;
  auto r = PrefillThenDecode(*backend, &Disagreeing, &schedule);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("prefetched"), std::string::npos) << r.status().message();
  // A resident pool has nothing to prefetch from: it offers no offloaded pool, and the schedule
  // leaves it alone.
  auto resident = TinyBackend(false, 12);
  EXPECT_EQ(resident->As<OffloadedKvPool>(), nullptr);
  ASSERT_TRUE(PrefillThenDecode(*resident, &Prefetched, &schedule).ok());
}

// ---- in the engine --------------------------------------------------------------------------------

class KvOffloadEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skew_path_ = new std::string(test::TempPath("offload.infinigen"));
    test::WriteTinySkewFile(*skew_path_);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*skew_path_);
    delete skew_path_;
  }

  static EngineConfig Config(bool offload, const std::string& selection = "") {
    EngineConfig c;
    c.dtype = "f32";
    c.kv_offload.enabled = offload;
    c.kv_selection.method = selection;
    c.kv_selection.infinigen.skew_file = *skew_path_;
    c.kv_selection.infinigen.alpha = 2.0;
    c.preemption_mode = "recompute";
    c.max_num_batched_tokens = 64;  // prompts prefill in chunks that read earlier chunks' KV
    return c;
  }

  static std::vector<std::vector<int32_t>> Run(Engine& engine, int n = 1) {
    SamplingParams p = test::Greedy(24);
    p.n = n;
    return test::GenerateAll(engine, test::ThreePrompts(), p, false);
  }

  static std::string* skew_path_;
};
std::string* KvOffloadEngine::skew_path_ = nullptr;

TEST_F(KvOffloadEngine, OffloadedDecodingIsExactlyResidentDecoding) {
  for (const char* selection : {"", "infinigen", "h2o"}) {
    auto resident = test::MakeEngine(Config(false, selection));
    auto offloaded = test::MakeEngine(Config(true, selection));
    ASSERT_TRUE(resident && offloaded);
    EXPECT_EQ(Run(*offloaded), Run(*resident)) << selection;
    const KvOffloadStats o = offloaded->stats().kv_offload;
    EXPECT_GT(o.bytes_fetched, 0) << selection;
    EXPECT_EQ(resident->stats().kv_offload.bytes_fetched, 0);
    // Every processed token's K/V went to the host pool once per layer.
    const EngineStats st = offloaded->stats();
    EXPECT_EQ(o.bytes_written, (st.prompt_tokens_processed + st.generated_tokens - 3) *
                                   offloaded->model_config().num_layers * 2 * offloaded->model_config().num_kv_heads *
                                   offloaded->model_config().head_dim * static_cast<int64_t>(sizeof(float)))
        << selection;
    // Full offload and InfiniGen know each layer's reads a layer ahead; H2O chooses at the layer.
    if (std::string(selection) == "h2o") {
      EXPECT_GT(o.on_demand_fetches, o.prefetches);
    } else {
      EXPECT_GT(o.prefetches, o.on_demand_fetches);
    }
    EXPECT_EQ(offloaded->stats().kv_selection.tokens_selected, resident->stats().kv_selection.tokens_selected);
  }
}

TEST_F(KvOffloadEngine, SampledOutputsAreTheResidentPoolsToo) {
  // The logits are bit-identical, so seeded sampling draws the same tokens: stronger than a
  // distribution test.
  for (const char* selection : {"", "infinigen"}) {
    auto resident = test::MakeEngine(Config(false, selection));
    auto offloaded = test::MakeEngine(Config(true, selection));
    ASSERT_TRUE(resident && offloaded);
    SamplingParams p = test::Greedy(24);
    p.temperature = 1.0f;
    p.top_p = 0.95f;
    const auto expected = test::GenerateAll(*resident, test::ThreePrompts(), p, /*vary_seed=*/true);
    EXPECT_EQ(test::GenerateAll(*offloaded, test::ThreePrompts(), p, /*vary_seed=*/true), expected) << selection;
    EXPECT_NE(expected, test::GenerateAll(*resident, test::ThreePrompts(), test::Greedy(24), false)) << "not sampled";
  }
}

TEST_F(KvOffloadEngine, InfiniGenWithACappedHostPoolIsExactlyResident) {
  // The pool cap evicts tokens; prefill chunks then read their live tokens, chosen at the layer
  // (fetched by attention), decode steps the speculated ones (prefetched).
  EngineConfig resident = Config(false, "infinigen");
  resident.kv_selection.infinigen.host_kv_tokens = 60;
  EngineConfig offload = resident;
  offload.kv_offload.enabled = true;
  auto r = test::MakeEngine(resident);
  auto o = test::MakeEngine(offload);
  ASSERT_TRUE(r && o);
  EXPECT_EQ(Run(*o), Run(*r));
  EXPECT_GT(o->stats().kv_selection.tokens_evicted, 0);
  EXPECT_EQ(o->stats().kv_selection.tokens_evicted, r->stats().kv_selection.tokens_evicted);
  EXPECT_GT(o->stats().kv_offload.prefetches, 0);
}

TEST_F(KvOffloadEngine, InfiniGenFetchesLessThanFullOffload) {
  auto full = test::MakeEngine(Config(true));
  auto infinigen = test::MakeEngine(Config(true, "infinigen"));
  ASSERT_TRUE(full && infinigen);
  Run(*full);
  Run(*infinigen);
  const double ratio = static_cast<double>(infinigen->stats().kv_offload.bytes_fetched) /
                       static_cast<double>(full->stats().kv_offload.bytes_fetched);
  std::printf("tiny-random, alpha 2: InfiniGen fetched %.1f%% of full offload's bytes (prefill included)\n", 100 * ratio);
  EXPECT_LT(ratio, 0.9);
}

TEST_F(KvOffloadEngine, PreemptionAndForksKeepOutputs) {
  // A pool too small for every sequence at once (recompute) and parallel sampling (shared blocks,
  // copy-on-write in the host pool).
  EngineConfig tight = Config(false);
  tight.num_kv_blocks = 20;
  tight.max_model_len = 200;
  EngineConfig tight_offload = tight;
  tight_offload.kv_offload.enabled = true;
  auto resident = test::MakeEngine(tight);
  auto offloaded = test::MakeEngine(tight_offload);
  ASSERT_TRUE(resident && offloaded);
  EXPECT_EQ(Run(*offloaded, 2), Run(*resident, 2));
  EXPECT_GT(offloaded->stats().num_preemptions, 0);
  EXPECT_EQ(offloaded->stats().num_preemptions_swap, 0);
}

// N-gram speculation runs no passes of its own: its verification is a target step of several
// tokens, which the offload tier fetches like a prefill chunk. So the two compose, and each
// output is that of either feature alone.
TEST_F(KvOffloadEngine, ComposesWithNgramSpeculation) {
  EngineConfig plain = Config(false);
  EngineConfig ngram = plain;
  ngram.speculative.method = "ngram";
  EngineConfig offload = Config(true);
  EngineConfig both = offload;
  both.speculative.method = "ngram";
  auto p = test::MakeEngine(plain);
  auto n = test::MakeEngine(ngram);
  auto o = test::MakeEngine(offload);
  auto b = test::MakeEngine(both);
  ASSERT_TRUE(p && n && o && b);
  const auto expected = Run(*p);
  EXPECT_EQ(Run(*n), expected);
  EXPECT_EQ(Run(*o), expected);
  EXPECT_EQ(Run(*b), expected);
  EXPECT_GT(b->stats().spec.num_accepted_tokens, 0) << "no draft was accepted: the pair was not exercised";
  EXPECT_EQ(b->stats().spec.num_accepted_tokens, n->stats().spec.num_accepted_tokens);
  EXPECT_GT(b->stats().kv_offload.bytes_fetched, 0);
  // Sampled: the logits are bit-identical, so seeded draws under speculation are the same with the
  // pool in host memory.
  SamplingParams sampled = test::Greedy(24);
  sampled.temperature = 1.0f;
  EXPECT_EQ(test::GenerateAll(*b, test::ThreePrompts(), sampled, /*vary_seed=*/true),
            test::GenerateAll(*n, test::ThreePrompts(), sampled, /*vary_seed=*/true));
}

// A draft model keeps its own (small) pool on the device while the target's is offloaded: the
// outputs are the draft model's speculation's on a resident pool, greedy and seeded.
TEST_F(KvOffloadEngine, ComposesWithADraftModel) {
  EngineConfig spec = Config(false);
  spec.speculative.model = "tiny-random-draft";
  spec.speculative.num_tokens = 3;
  EngineConfig both = spec;
  both.kv_offload.enabled = true;
  auto p = test::MakeEngine(Config(false));
  auto s = test::MakeEngine(spec);
  auto b = test::MakeEngine(both);
  ASSERT_TRUE(p && s && b);
  const auto expected = Run(*p);
  EXPECT_EQ(Run(*s), expected);
  EXPECT_EQ(Run(*b), expected);
  EXPECT_GT(b->stats().spec.num_draft_tokens, 0) << "the pair was not exercised";
  EXPECT_EQ(b->stats().spec.num_accepted_tokens, s->stats().spec.num_accepted_tokens);
  EXPECT_GT(b->stats().kv_offload.bytes_fetched, 0);
  SamplingParams sampled = test::Greedy(24);
  sampled.temperature = 1.0f;
  EXPECT_EQ(test::GenerateAll(*b, test::ThreePrompts(), sampled, /*vary_seed=*/true),
            test::GenerateAll(*s, test::ThreePrompts(), sampled, /*vary_seed=*/true));
}

TEST_F(KvOffloadEngine, RefusesWhatItCannotRun) {
  for (auto bad : std::vector<std::function<void(EngineConfig&)>>{
           [](EngineConfig& e) {
             e.speculative.method = "triforce";
             e.speculative.triforce.draft = "streaming";
           },
           [](EngineConfig& e) { e.preemption_mode = "swap"; },
       }) {
    EngineConfig e = Config(true);
    bad(e);
    auto r = test::CreateTinyEngine(e);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("kv_offload"), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace kvflow
