// KV selection (issue 16): attention over per-KV-head token selections against a dense reference,
// InfiniGen's skewing file (round trip, every corruption refused) and calibration on a model, and
// the InfiniGen and H2O selectors inside the engine: exact when they select everything, reading
// what their rules say otherwise, per-request opt-out, clear errors; InfiniGen's capped host KV
// pool: no change under a cap the context fits, evicted tokens never read again, the victims each
// policy names.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <tuple>

#include "backend/backend_factory.h"
#include "backend/cpu/paged_attention.h"
#include "engine_test_util.h"
#include "kv_selection_oracle.h"
#include "kv_selection_test_util.h"
#include "h2o/h2o_selector.h"
#include "infinigen/calibration.h"
#include "infinigen/infinigen_selector.h"
#include "infinigen/partial_keys.h"
#include "infinigen/speculation.h"
#include "infinigen/skew_file.h"
#include "infinigen/skewing.h"
#include "forward/llama_model.h"
#include "model/rope.h"
#include "model/tensor_source.h"

namespace kvflow {
namespace {

// ---- attention over per-head selections ------------------------------------------------------------

TEST(KvHeadSelectionAttention, MatchesDenseReferencePerKvHead) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_blocks = 12;
  layout.block_size = 4;
  layout.num_kv_heads = 2;
  layout.head_dim = 16;
  const int NH = 6, KV = 2, D = 16, group = NH / KV;
  std::vector<float> keys(layout.layer_stride()), values(layout.layer_stride());
  for (float& x : keys) x = normal(rng);
  for (float& x : values) x = normal(rng);
  // Two sequences of one decode token each: contexts 13 and 9, tables in scrambled block order.
  ForwardBatch batch;
  const std::vector<std::vector<BlockId>> tables = {{7, 2, 9, 0}, {5, 11, 3}};
  const std::vector<int32_t> contexts = {13, 9};
  for (size_t s = 0; s < 2; ++s) {
    SequenceSlice slice;
    slice.token_offset = static_cast<int32_t>(s);
    slice.num_tokens = 1;
    slice.context_len = contexts[s];
    slice.block_table = tables[s];
    batch.seqs.push_back(slice);
    batch.tokens.push_back(1);
    batch.positions.push_back(contexts[s] - 1);
  }
  auto slot = [&](size_t s, int32_t pos) {
    return static_cast<int64_t>(tables[s][static_cast<size_t>(pos / 4)]) * 4 + pos % 4;
  };
  // Per KV head its own random subset of the earlier tokens (equal counts), the own token last.
  std::vector<std::vector<int64_t>> lists(2 * KV);
  std::vector<std::vector<int32_t>> positions(2 * KV);
  for (size_t s = 0; s < 2; ++s) {
    for (int g = 0; g < KV; ++g) {
      std::vector<int32_t> all(static_cast<size_t>(contexts[s] - 1));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(5);
      std::sort(all.begin(), all.end());
      all.push_back(contexts[s] - 1);
      positions[s * KV + g] = all;
      for (int32_t p : all) lists[s * KV + g].push_back(slot(s, p));
    }
  }
  std::vector<float> query(static_cast<size_t>(2 * NH * D)), out(query.size(), 0.0f);
  for (float& x : query) x = normal(rng);
  cpu::AttentionIo io;
  io.query = query.data();
  io.query_row_stride = NH * D;
  io.out = out.data();
  io.out_row_stride = NH * D;
  const float scale = 0.25f;
  cpu::PagedAttention(batch, lists, layout, NH, io, keys.data(), values.data(), scale);
  double worst = 0.0;
  for (size_t s = 0; s < 2; ++s) {
    for (int h = 0; h < NH; ++h) {
      const int g = h / group;
      const std::vector<int32_t>& pos = positions[s * KV + g];
      std::vector<double> w(pos.size());
      double max = -1e300, sum = 0.0;
      for (size_t i = 0; i < pos.size(); ++i) {
        const size_t at = layout.offset(static_cast<int>(slot(s, pos[i]) / 4), g, static_cast<int>(slot(s, pos[i]) % 4));
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(query[(s * NH + h) * D + d]) * keys[at + d];
        w[i] = dot * scale;
        max = std::max(max, w[i]);
      }
      for (double& x : w) sum += (x = std::exp(x - max));
      for (int d = 0; d < D; ++d) {
        double o = 0.0;
        for (size_t i = 0; i < pos.size(); ++i) {
          const size_t at = layout.offset(static_cast<int>(slot(s, pos[i]) / 4), g, static_cast<int>(slot(s, pos[i]) % 4));
          o += w[i] / sum * values[at + d];
        }
        worst = std::max(worst, std::abs(o - out[(s * NH + h) * D + d]));
      }
    }
  }
  std::printf("per-head selection attention vs double reference: max |error| %.3g\n", worst);
  EXPECT_LT(worst, 1e-5);
}

TEST(KvHeadSelectionAttention, ValidationRefusesMalformedSelections) {
  KvCacheLayout layout;
  layout.num_layers = 1;
  layout.num_blocks = 4;
  layout.block_size = 4;
  layout.num_kv_heads = 2;
  layout.head_dim = 8;
  ForwardBatch batch;
  SequenceSlice slice;
  slice.num_tokens = 1;
  slice.context_len = 5;
  slice.block_table = {0, 1};
  batch.seqs.push_back(slice);
  std::vector<KvHeadSelection> sel(1);
  EXPECT_TRUE(ValidateKvHeadSelections(sel, batch, layout).ok());  // per_head 0: the view
  sel[0].per_head = 2;
  sel[0].slots = {0, 4, 1};  // 3 slots for 2 heads x 2
  EXPECT_EQ(ValidateKvHeadSelections(sel, batch, layout).code(), StatusCode::kInvalidArgument);
  sel[0].slots = {0, 4, 1, 99};  // outside the pool
  EXPECT_EQ(ValidateKvHeadSelections(sel, batch, layout).code(), StatusCode::kInvalidArgument);
  sel[0].slots = {0, 4, 1, 4};
  EXPECT_TRUE(ValidateKvHeadSelections(sel, batch, layout).ok());
  EXPECT_FALSE(ValidateKvHeadSelections({}, batch, layout).ok());  // one per slice
}

// ---- the skewing file --------------------------------------------------------------------------------

ModelConfig SmallConfig() {
  ModelConfig c;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.name = "small";
  return c;
}

SkewTable RandomTable(const ModelConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  SkewTable t;
  t.num_layers = c.num_layers;
  t.num_heads = c.num_heads;
  t.num_kv_heads = c.num_kv_heads;
  t.head_dim = c.head_dim;
  t.num_partial_columns = 3;
  t.calibration_tokens = 100;
  t.partial_ratio = 0.3;
  t.model_name = c.name;
  for (int i = 0; i < c.num_layers * c.num_kv_heads; ++i) {
    std::vector<float> q(static_cast<size_t>(40 * c.head_dim));
    for (float& x : q) x = normal(rng);
    t.heads.push_back({SkewingMatrix(q, 40, c.head_dim), {0, 2, 5}});
  }
  return t;
}

using test::TempPath;

std::vector<char> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteBytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(InfiniGenSkewFile, RoundTripsExactly) {
  const ModelConfig c = SmallConfig();
  const SkewTable t = RandomTable(c, 1);
  const std::string path = TempPath("roundtrip.infinigen");
  ASSERT_TRUE(WriteSkewTable(t, path).ok());
  auto r = ReadSkewTable(path, c);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model_name, "small");
  EXPECT_EQ(r->num_partial_columns, 3);
  EXPECT_EQ(r->calibration_tokens, 100);
  ASSERT_EQ(r->heads.size(), t.heads.size());
  for (size_t i = 0; i < t.heads.size(); ++i) {
    EXPECT_EQ(r->heads[i].matrix, t.heads[i].matrix);
    EXPECT_EQ(r->heads[i].columns, t.heads[i].columns);
  }
  std::filesystem::remove(path);
}

TEST(InfiniGenSkewFile, RefusesMissingCorruptTruncatedAndOtherModelsFiles) {
  const ModelConfig c = SmallConfig();
  const std::string path = TempPath("corrupt.infinigen");
  auto missing = ReadSkewTable(path + ".absent", c);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("kvflow skew"), std::string::npos);

  ASSERT_TRUE(WriteSkewTable(RandomTable(c, 2), path).ok());
  const std::vector<char> good = ReadBytes(path);
  // A flipped byte anywhere in the body.
  for (size_t at : {size_t{3}, size_t{40}, good.size() / 2, good.size() - 9}) {
    std::vector<char> bad = good;
    bad[at] ^= 0x20;
    WriteBytes(path, bad);
    auto r = ReadSkewTable(path, c);
    EXPECT_FALSE(r.ok()) << "flipped byte " << at;
    EXPECT_TRUE(r.status().code() == StatusCode::kCorruptFile || r.status().code() == StatusCode::kInvalidArgument);
  }
  // Truncated.
  WriteBytes(path, std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 3)));
  EXPECT_EQ(ReadSkewTable(path, c).status().code(), StatusCode::kCorruptFile);
  WriteBytes(path, {});
  EXPECT_EQ(ReadSkewTable(path, c).status().code(), StatusCode::kCorruptFile);
  // Another model's file.
  WriteBytes(path, good);
  ModelConfig other = c;
  other.num_layers = 3;
  auto wrong = ReadSkewTable(path, other);
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("not this one"), std::string::npos) << wrong.status().message();
  // A well-formed file (valid checksum) whose matrix is not orthogonal, or whose columns repeat.
  SkewTable t = RandomTable(c, 3);
  t.heads[1].matrix[5] += 0.5f;
  ASSERT_TRUE(WriteSkewTable(t, path).ok());
  auto skewed = ReadSkewTable(path, c);
  EXPECT_EQ(skewed.status().code(), StatusCode::kCorruptFile);
  EXPECT_NE(skewed.status().message().find("orthogonal"), std::string::npos);
  t = RandomTable(c, 3);
  t.heads[2].columns = {1, 1, 4};
  ASSERT_TRUE(WriteSkewTable(t, path).ok());
  EXPECT_EQ(ReadSkewTable(path, c).status().code(), StatusCode::kCorruptFile);
  std::filesystem::remove(path);
}

using test::RandomTokens;

std::unique_ptr<Backend> TinyBackend(int tokens) { return test::TinyCpuBackend(tokens); }

TEST(InfiniGenCalibration, SkewsEveryLayerAndKeepsScoresOnTheModel) {
  auto backend = TinyBackend(256);
  const ModelConfig& mc = backend->model_config();
  SkewCalibrationOptions o;
  o.partial_ratio = 0.3;
  o.chunk_tokens = 64;
  int layers_done = 0;
  o.on_layers = [&](int done, int) { layers_done = done; };
  auto t = CalibrateSkew(*backend, RandomTokens(200, 5, mc.vocab_size), o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(layers_done, mc.num_layers);
  EXPECT_EQ(t->num_partial_columns, static_cast<int>(std::ceil(0.3 * mc.head_dim)));
  ASSERT_EQ(t->heads.size(), static_cast<size_t>(mc.num_layers * mc.num_kv_heads));
  // Written and read back through the checks; q A (k A)^T = q k^T for fresh random vectors.
  const std::string path = TempPath("tiny.infinigen");
  ASSERT_TRUE(WriteSkewTable(t.value(), path).ok());
  auto back = ReadSkewTable(path, mc);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const int D = mc.head_dim;
  double worst = 0.0;
  for (const SkewHead& h : back->heads) {
    std::vector<float> q(static_cast<size_t>(D)), k(static_cast<size_t>(D));
    for (float& x : q) x = normal(rng);
    for (float& x : k) x = normal(rng);
    double plain = 0.0;
    for (int d = 0; d < D; ++d) plain += static_cast<double>(q[d]) * k[d];
    std::vector<float> qs = q, ks = k;
    ApplySkew(qs, 1, D, h.matrix);
    ApplySkew(ks, 1, D, h.matrix);
    double skewed = 0.0;
    for (int d = 0; d < D; ++d) skewed += static_cast<double>(qs[d]) * ks[d];
    worst = std::max(worst, std::abs(plain - skewed));
  }
  std::printf("calibrated skew on tiny-random: max |q.k - qA.kA| %.3g\n", worst);
  EXPECT_LT(worst, 1e-4);
  // Too little text is refused.
  EXPECT_FALSE(CalibrateSkew(*backend, RandomTokens(8, 5, mc.vocab_size), o).ok());
  std::filesystem::remove(path);
}

// ---- the selectors in the engine ------------------------------------------------------------------

class KvSelectionEngine : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skew_path_ = new std::string(TempPath("engine.infinigen"));
    test::WriteTinySkewFile(*skew_path_);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*skew_path_);
    delete skew_path_;
  }

  static EngineConfig Config(const std::string& method) {
    EngineConfig c;
    c.dtype = "f32";
    c.kv_selection.method = method;
    c.kv_selection.infinigen.skew_file = *skew_path_;
    return c;
  }

  // Greedy tokens of a few prompts of different lengths, decoded together.
  static std::vector<std::vector<int32_t>> Run(Engine& engine, std::optional<bool> selection = {}) {
    SamplingParams p = test::Greedy(24);
    p.kv_selection = selection;
    return test::GenerateAll(engine, test::ThreePrompts(), p, false);
  }

  // The engine-level oracle's engines: the tiny model, 2 threads, exact (fp32) KV.
  static EngineConfig OracleConfig(const std::string& method) {
    EngineConfig c = Config(method);
    c.model = "tiny-random";
    c.num_threads = 2;
    c.kv_cache_dtype = "f32";
    return c;
  }

  static std::string* skew_path_;
};
std::string* KvSelectionEngine::skew_path_ = nullptr;

TEST_F(KvSelectionEngine, InfiniGenSelectingEverythingIsExactlyFullAttention) {
  auto full = test::MakeEngine(Config(""));
  ASSERT_TRUE(full);
  const auto expected = Run(*full);
  for (const char* point : {"after-attention", "layer-input", "oracle"}) {
    EngineConfig c = Config("infinigen");
    c.kv_selection.infinigen.alpha = 1e6;
    c.kv_selection.infinigen.max_fraction = 1.0;
    c.kv_selection.infinigen.speculate_from = point;
    auto all = test::MakeEngine(c);
    ASSERT_TRUE(all);
    EXPECT_EQ(Run(*all), expected) << point;
    const KvSelectionStats s = all->stats().kv_selection;
    const int layers = all->model_config().num_layers;
    EXPECT_GT(s.decode_tokens, 0);
    EXPECT_EQ(s.layer_reads_full, s.decode_tokens);  // layer 0
    EXPECT_EQ(s.layer_reads_selected, s.decode_tokens * (layers - 1));
    EXPECT_EQ(s.tokens_selected, s.tokens_available);
    EXPECT_EQ(s.bytes_read, s.bytes_full);
  }
}

TEST_F(KvSelectionEngine, SelectorsReadEveryKvElementType) {
  // The selectors read keys back from the pool (partial keys, H2O's scores): fp16 and 4-bit too.
  for (const char* dtype : {"f16", "q4"}) {
    EngineConfig plain = Config("");
    plain.kv_cache_dtype = dtype;
    auto full = test::MakeEngine(plain);
    EngineConfig c = Config("infinigen");
    c.kv_cache_dtype = dtype;
    c.kv_selection.infinigen.alpha = 1e6;
    c.kv_selection.infinigen.max_fraction = 1.0;
    auto all = test::MakeEngine(c);
    EngineConfig h = Config("h2o");
    h.kv_cache_dtype = dtype;
    h.kv_selection.h2o.budget = 0.3;
    auto h2o = test::MakeEngine(h);
    ASSERT_TRUE(full && all && h2o);
    EXPECT_EQ(Run(*all), Run(*full)) << dtype;
    Run(*h2o);
    EXPECT_GT(h2o->stats().kv_selection.decode_tokens, 0) << dtype;
    EXPECT_LT(h2o->stats().kv_selection.selection_fraction(), 0.4) << dtype;
  }
}

TEST_F(KvSelectionEngine, InfiniGenReadsWhatItsRulesAllow) {
  EngineConfig c = Config("infinigen");
  c.kv_selection.infinigen.alpha = 2.0;
  c.kv_selection.infinigen.max_fraction = 0.2;
  auto engine = test::MakeEngine(c);
  ASSERT_TRUE(engine);
  const auto outs = Run(*engine);
  for (const auto& o : outs) EXPECT_EQ(o.size(), 24u);
  const KvSelectionStats s = engine->stats().kv_selection;
  EXPECT_EQ(s.decode_tokens, 3 * 23);  // every decode step after the prompt's last token
  // Each selected read takes at most 20% of the earlier tokens (at least 1) plus the step's own.
  EXPECT_GT(s.tokens_selected, 0);
  EXPECT_LE(s.tokens_selected, static_cast<int64_t>(0.2 * s.tokens_available) + 2 * s.layer_reads_selected);
  EXPECT_LT(s.bytes_read, s.bytes_full);
  std::printf("infinigen on tiny-random, alpha 2: %.1f%% of the cached tokens at selected layers, %.1f%% of the bytes\n",
              100.0 * s.selection_fraction(), 100.0 * static_cast<double>(s.bytes_read) / static_cast<double>(s.bytes_full));
}

TEST_F(KvSelectionEngine, RequestsOptOut) {
  auto full = test::MakeEngine(Config(""));
  EngineConfig c = Config("infinigen");
  c.kv_selection.infinigen.alpha = 1.0;
  c.kv_selection.infinigen.max_fraction = 0.1;
  auto engine = test::MakeEngine(c);
  ASSERT_TRUE(full && engine);
  EXPECT_EQ(Run(*engine, false), Run(*full));
  EXPECT_EQ(engine->stats().kv_selection.decode_tokens, 0);
  // And opt in where the engine's default is off.
  c.kv_selection.apply_by_default = false;
  auto opt_in = test::MakeEngine(c);
  ASSERT_TRUE(opt_in);
  Run(*opt_in);
  EXPECT_EQ(opt_in->stats().kv_selection.decode_tokens, 0);
  Run(*opt_in, true);
  EXPECT_GT(opt_in->stats().kv_selection.decode_tokens, 0);
}

TEST_F(KvSelectionEngine, H2OKeepingEverythingIsExactlyFullAttention) {
  auto full = test::MakeEngine(Config(""));
  EngineConfig c = Config("h2o");
  c.kv_selection.h2o.budget = 1.0;
  auto all = test::MakeEngine(c);
  ASSERT_TRUE(full && all);
  EXPECT_EQ(Run(*all), Run(*full));
  const KvSelectionStats s = all->stats().kv_selection;
  EXPECT_EQ(s.tokens_selected, s.tokens_available);
}

TEST_F(KvSelectionEngine, H2OKeepsItsBudget) {
  EngineConfig c = Config("h2o");
  c.kv_selection.h2o.budget = 0.25;
  auto engine = test::MakeEngine(c);
  ASSERT_TRUE(engine);
  Run(*engine);
  const KvSelectionStats s = engine->stats().kv_selection;
  const int layers = engine->model_config().num_layers;
  EXPECT_EQ(s.layer_reads_selected, s.decode_tokens * layers);  // every layer, layer 0 included
  // ceil(0.25 * context) kept (the step's own among them) + the step's own: about a quarter.
  EXPECT_GT(s.selection_fraction(), 0.24);
  EXPECT_LT(s.selection_fraction(), 0.30);
}

TEST_F(KvSelectionEngine, RefusesMissingSkewFileAndBadSettings) {
  EngineConfig c = Config("infinigen");
  c.kv_selection.infinigen.skew_file = *skew_path_ + ".absent";
  auto missing = test::CreateTinyEngine(c);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("kvflow skew"), std::string::npos) << missing.status().message();
  for (auto bad : std::vector<std::function<void(EngineConfig&)>>{
           [](EngineConfig& e) { e.kv_selection.method = "quest"; },
           [](EngineConfig& e) { e.kv_selection.infinigen.alpha = 0; },
           [](EngineConfig& e) { e.kv_selection.infinigen.speculate_from = "layer-output"; },
           [](EngineConfig& e) { e.kv_selection.infinigen.max_fraction = 1.5; },
           [](EngineConfig& e) { e.kv_selection.infinigen.speculate_on = "gpu"; },
           [](EngineConfig& e) {  // the device cannot keep the host pool's eviction state
             e.kv_selection.infinigen.speculate_on = "device";
             e.kv_selection.infinigen.host_kv_tokens = 100;
           },
           [](EngineConfig& e) { e.kv_selection.h2o.budget = 0; },
           [](EngineConfig& e) { e.kv_selection.infinigen.count_rule = "per-head"; },
           [](EngineConfig& e) { e.kv_selection.infinigen.dense_layers = 0; },
           [](EngineConfig& e) { e.kv_selection.infinigen.sink_tokens = -1; },
           [](EngineConfig& e) { e.kv_selection.infinigen.recent_tokens = -2; },
           [](EngineConfig& e) { e.kv_selection.infinigen.max_tokens = -1; },
           [](EngineConfig& e) {  // the oracle reads the whole cache to choose: no host pool cap
             e.kv_selection.infinigen.speculate_from = "oracle";
             e.kv_selection.infinigen.host_kv_tokens = 100;
           },
           [](EngineConfig& e) { e.speculative.method = "ngram"; },
       }) {
    EngineConfig e = Config("infinigen");
    bad(e);
    auto r = test::CreateTinyEngine(e);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
  // Speculation on the device asked of a backend without it (the CPU's): refused, naming it; auto
  // keeps the host path there.
  EngineConfig device = Config("infinigen");
  device.kv_selection.infinigen.speculate_on = "device";
  auto on_device = test::CreateTinyEngine(device);
  ASSERT_FALSE(on_device.ok());
  EXPECT_EQ(on_device.status().code(), StatusCode::kUnsupported) << on_device.status().ToString();
  EXPECT_NE(on_device.status().message().find("no device speculation"), std::string::npos)
      << on_device.status().ToString();
  // The selectors run on CUDA too (tests/cuda/test_cuda_backend.cc): the config is no longer refused
  // for it (without a GPU the backend itself may still be unavailable).
  EngineConfig cuda = Config("h2o");
  cuda.device = "cuda";
  auto on_cuda = test::CreateTinyEngine(cuda);
  if (!on_cuda.ok()) {
    EXPECT_EQ(on_cuda.status().message().find("kv_selection"), std::string::npos) << on_cuda.status().ToString();
  }
}


// ---- InfiniGen's capped host KV pool -----------------------------------------------------------------

TEST_F(KvSelectionEngine, InfiniGenHostPoolAtLeastTheContextChangesNothing) {
  EngineConfig plain = Config("infinigen");
  plain.kv_selection.infinigen.alpha = 2.0;
  plain.kv_selection.infinigen.max_fraction = 0.2;
  auto uncapped = test::MakeEngine(plain);
  ASSERT_TRUE(uncapped);
  const auto expected = Run(*uncapped);
  const KvSelectionStats want = uncapped->stats().kv_selection;
  // The longest sequence (150 + 24 tokens) pools 150 + 22 by its last step, whose own is the 173rd.
  for (int cap : {150 + 24, 150 + 22}) {
    for (const char* policy : {"counter", "lru", "fifo"}) {
      SCOPED_TRACE(std::string(policy) + " " + std::to_string(cap));
      EngineConfig c = plain;
      c.kv_selection.infinigen.host_kv_tokens = cap;
      c.kv_selection.infinigen.eviction = policy;
      auto capped = test::MakeEngine(c);
      ASSERT_TRUE(capped);
      EXPECT_EQ(Run(*capped), expected);
      const KvSelectionStats s = capped->stats().kv_selection;
      EXPECT_EQ(s.tokens_evicted, 0);
      EXPECT_EQ(s.tokens_selected, want.tokens_selected);
      EXPECT_EQ(s.tokens_available, want.tokens_available);
      EXPECT_EQ(s.bytes_read, want.bytes_read);
      EXPECT_EQ(s.layer_reads_full, want.layer_reads_full);
    }
  }
}

TEST_F(KvSelectionEngine, InfiniGenHostPoolEvictsPastItsCap) {
  for (int cap : {150 + 21, 64, 1}) {
    EngineConfig c = Config("infinigen");
    c.kv_selection.infinigen.alpha = 1e6;  // every speculated layer reads all it may: the live tokens
    c.kv_selection.infinigen.max_fraction = 1.0;
    c.kv_selection.infinigen.host_kv_tokens = cap;
    auto engine = test::MakeEngine(c);
    ASSERT_TRUE(engine);
    const auto outs = Run(*engine);
    for (const auto& o : outs) EXPECT_EQ(o.size(), 24u);
    const KvSelectionStats s = engine->stats().kv_selection;
    const int layers = engine->model_config().num_layers;
    // Prompts of 90, 37 and 150 tokens and 23 decode steps: the last one's pool admitted every token
    // before its own, P + 22, and evicted all past the cap, at every layer.
    int64_t evicted = 0;
    for (int prompt : {90, 37, 150}) evicted += std::max(0, prompt + 22 - cap);
    EXPECT_EQ(s.tokens_evicted, evicted * layers) << cap;
    // Each speculated read took the live tokens (at most the cap) and the step's own: all it could.
    EXPECT_EQ(s.tokens_selected, s.tokens_available) << cap;
    EXPECT_LE(s.tokens_selected, s.layer_reads_selected * (cap + 1)) << cap;
    EXPECT_LT(s.bytes_read, s.bytes_full) << cap;
  }
}

TEST_F(KvSelectionEngine, RefusesBadHostPoolSettings) {
  struct Bad {
    std::function<void(EngineConfig&)> set;
    const char* names;
  };
  for (const Bad& bad : std::vector<Bad>{
           {[](EngineConfig& e) { e.kv_selection.infinigen.host_kv_tokens = -1; }, "infinigen_host_kv_tokens must be >= 0"},
           {[](EngineConfig& e) { e.kv_selection.infinigen.eviction = "lfu"; }, "infinigen_eviction"},
           {[](EngineConfig& e) { e.kv_selection.infinigen.host_kv_tokens = 100, e.kv_selection.method = "h2o"; }, "kv_selection infinigen"},
           {[](EngineConfig& e) { e.kv_selection.infinigen.host_kv_tokens = 100, e.kv_selection.method = ""; }, "kv_selection infinigen"},
       }) {
    EngineConfig e = Config("infinigen");
    bad.set(e);
    auto r = test::CreateTinyEngine(e);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(bad.names), std::string::npos) << r.status().message();
  }
}

// An InfiniGenSelector driven step by step over the tiny model: one sequence (id 1) whose block table
// is the identity (a slot is its position), and what each layer's attention read, checked at read
// time against the selector's evicted positions.
class HostPoolDriver : private LayerHooks {
 public:
  struct Read {
    int layer = 0;
    int32_t first_new = 0;                       // the step's first position
    int32_t context = 0;                         // positions before the step's end
    bool view = false;                           // the whole cache (no selection)
    std::vector<std::vector<int32_t>> per_head;  // positions, as listed (the step's own last)
    // The distinct earlier positions any KV head read, ascending.
    std::vector<int32_t> Fetched() const {
      std::vector<int32_t> out;
      if (view) {
        out.resize(static_cast<size_t>(first_new));
        std::iota(out.begin(), out.end(), 0);
        return out;
      }
      for (const auto& head : per_head) {
        for (int32_t p : head) {
          if (p < first_new) out.push_back(p);
        }
      }
      std::sort(out.begin(), out.end());
      out.erase(std::unique(out.begin(), out.end()), out.end());
      return out;
    }
  };

  HostPoolDriver(const InfiniGenConfig& config, const std::string& skew_path, int max_tokens)
      : backend_(TinyBackend(max_tokens)),
        selector_(config, ReadSkewTable(skew_path, backend_->model_config()).value(), *backend_),
        model_(*backend_, this),
        cap_(config.host_kv_tokens) {}

  // One step of `n` new tokens at the end of the sequence (a prefill chunk, or a decode step when n
  // is 1), or from position `from` on (recomputation).
  void Step(int n, int from = -1) {
    const int32_t first = from >= 0 ? from : length_;
    const int bs = backend_->kv_layout().block_size;
    ForwardBatch batch;
    batch.tokens = RandomTokens(n, static_cast<uint32_t>(first + 7), backend_->model_config().vocab_size);
    batch.positions.resize(static_cast<size_t>(n));
    std::iota(batch.positions.begin(), batch.positions.end(), first);
    SequenceSlice slice;
    slice.num_tokens = n;
    slice.context_len = first + n;
    slice.block_table.resize(static_cast<size_t>((slice.context_len + bs - 1) / bs));
    std::iota(slice.block_table.begin(), slice.block_table.end(), 0);
    batch.seqs.push_back(slice);
    const int64_t seq_id = 1;
    const uint8_t selecting = 1;
    inner_ = selector_.ForStep(batch, {&seq_id, 1}, {&selecting, 1});
    ASSERT_NE(inner_, nullptr);
    std::vector<float> logits;
    const Status st = model_.Forward(batch, logits);
    ASSERT_TRUE(st.ok()) << st.ToString();
    length_ = slice.context_len;
  }

  InfiniGenSelector& selector() { return selector_; }
  const std::vector<Read>& reads() const { return reads_; }
  int num_layers() const { return backend_->model_config().num_layers; }

 private:
  Status BeforeAttention(const LayerContext& ctx) override { return inner_->BeforeAttention(ctx); }
  Status AfterMlpInput(const LayerContext& ctx) override { return inner_->AfterMlpInput(ctx); }
  Status AfterAttention(const LayerContext& ctx) override { return inner_->AfterAttention(ctx); }
  std::span<const KvHeadSelection> AttentionSelection(const LayerContext& ctx) override {
    const std::span<const KvHeadSelection> sel = inner_->AttentionSelection(ctx);
    const SequenceSlice& slice = ctx.batch.seqs[0];
    Read r;
    r.layer = ctx.layer;
    r.first_new = slice.context_len - slice.num_tokens;
    r.context = slice.context_len;
    r.view = sel.empty() || sel[0].per_head == 0;
    const int KV = backend_->model_config().num_kv_heads;
    for (int g = 0; !r.view && g < KV; ++g) {
      const auto first = sel[0].slots.begin() + static_cast<std::ptrdiff_t>(g) * sel[0].per_head;
      r.per_head.emplace_back(first, first + sel[0].per_head);
      // The step's own tokens end every head's list.
      for (int32_t j = 0; j < slice.num_tokens; ++j) {
        EXPECT_EQ(r.per_head.back()[static_cast<size_t>(sel[0].per_head - slice.num_tokens + j)], r.first_new + j);
      }
    }
    // Nothing read was evicted at this layer, and the layer's pool holds at most the cap.
    const std::vector<int32_t> evicted = selector_.EvictedPositions(1, ctx.layer);
    std::vector<int32_t> both;
    const std::vector<int32_t> fetched = r.Fetched();
    std::set_intersection(fetched.begin(), fetched.end(), evicted.begin(), evicted.end(), std::back_inserter(both));
    EXPECT_TRUE(both.empty()) << "layer " << ctx.layer << " at position " << r.first_new << " read evicted position "
                              << both.front();
    const HostKvEviction* pool = selector_.HostPool(1, ctx.layer);
    EXPECT_NE(pool, nullptr);
    if (pool != nullptr) EXPECT_LE(pool->size(), cap_);
    reads_.push_back(std::move(r));
    return sel;
  }

  std::unique_ptr<Backend> backend_;
  InfiniGenSelector selector_;
  LlamaModel model_;
  int64_t cap_;
  LayerHooks* inner_ = nullptr;
  int32_t length_ = 0;
  std::vector<Read> reads_;
};

// The pool as the paper describes it, replayed from what the layers read: a token joins in the first
// step after its own, before the layer reads (evicting the victim when full); every earlier token a
// read took counts as fetched once. Counts never saturate here (the tests check).
struct PoolReplay {
  struct Entry {
    int count = 0;
    int64_t inserted = 0, used = 0;
  };
  HostEvictionPolicy policy;
  int64_t cap;
  std::map<int32_t, Entry> live;
  std::vector<int32_t> evicted;
  int32_t admitted = 0;
  int64_t tick = 0;

  void Admit(int32_t upto) {
    for (; admitted < upto; ++admitted) {
      if (static_cast<int64_t>(live.size()) >= cap) {
        auto victim = live.begin();
        for (auto it = live.begin(); it != live.end(); ++it) {
          const Entry &e = it->second, &v = victim->second;
          const bool earlier = policy == HostEvictionPolicy::kCounter ? std::tie(e.count, e.inserted) < std::tie(v.count, v.inserted)
                               : policy == HostEvictionPolicy::kLru   ? e.used < v.used
                                                                      : e.inserted < v.inserted;
          if (earlier) victim = it;
        }
        evicted.push_back(victim->first);
        live.erase(victim);
      }
      live[admitted] = {0, ++tick, tick};
    }
  }
  void Fetch(const std::vector<int32_t>& positions) {
    for (int32_t p : positions) {
      Entry& e = live.at(p);
      ++e.count;
      e.used = ++tick;
    }
  }
};

class InfiniGenHostPool : public KvSelectionEngine {
 protected:
  static InfiniGenConfig PoolConfig(HostEvictionPolicy policy, int cap, double alpha, double max_fraction) {
    InfiniGenConfig c;
    c.alpha = alpha;
    c.max_fraction = max_fraction;
    c.host_kv_tokens = cap;
    c.eviction = policy;
    return c;
  }
};

TEST_F(InfiniGenHostPool, LayersNeverReadEvictedTokensAndEvictWhatThePolicySays) {
  const int cap = 24;
  for (HostEvictionPolicy policy : {HostEvictionPolicy::kCounter, HostEvictionPolicy::kLru, HostEvictionPolicy::kFifo}) {
    SCOPED_TRACE(HostEvictionPolicyName(policy));
    HostPoolDriver driver(PoolConfig(policy, cap, 2.0, 0.5), *skew_path_, 256);
    driver.Step(40);  // a prompt in two chunks: the second reads the first's live tokens
    driver.Step(8);
    for (int i = 0; i < 60; ++i) driver.Step(1);
    const int layers = driver.num_layers();
    std::vector<PoolReplay> replay(static_cast<size_t>(layers), PoolReplay{policy, cap, {}, {}, 0, 0});
    int64_t capped_layer0_reads = 0;
    for (const HostPoolDriver::Read& r : driver.reads()) {
      PoolReplay& pool = replay[static_cast<size_t>(r.layer)];
      pool.Admit(r.first_new);
      const std::vector<int32_t> fetched = r.Fetched();
      // A read takes live tokens only; one that takes everything (layer 0, prefill chunks) takes
      // every live one.
      for (int32_t p : fetched) ASSERT_TRUE(pool.live.contains(p)) << "layer " << r.layer << " read " << p;
      const bool speculated = r.layer > 0 && r.context - r.first_new == 1;
      if (!speculated) {
        EXPECT_EQ(fetched.size(), pool.live.size()) << "layer " << r.layer << " at " << r.first_new;
        if (r.layer == 0 && !r.view) ++capped_layer0_reads;
      } else {
        // At most max_fraction of the live tokens (at least 1), and the step's own.
        const size_t most = static_cast<size_t>(std::max(1.0, std::floor(0.5 * static_cast<double>(pool.live.size()))));
        for (const auto& head : r.per_head) EXPECT_LE(head.size(), most + 1);
      }
      pool.Fetch(fetched);
    }
    // Every read of layer 0 from the second chunk on (the first to evict) took the live tokens.
    EXPECT_EQ(capped_layer0_reads, 1 + 60);
    int64_t evicted = 0;
    for (int layer = 0; layer < layers; ++layer) {
      SCOPED_TRACE("layer " + std::to_string(layer));
      PoolReplay& pool = replay[static_cast<size_t>(layer)];
      pool.Admit(40 + 8 + 59);  // the last step's pool: every token before its own
      std::vector<int32_t> want = pool.evicted;
      std::sort(want.begin(), want.end());
      EXPECT_EQ(driver.selector().EvictedPositions(1, layer), want);
      EXPECT_EQ(static_cast<int64_t>(want.size()), 40 + 8 + 59 - cap);
      const HostKvEviction* live = driver.selector().HostPool(1, layer);
      ASSERT_NE(live, nullptr);
      EXPECT_EQ(live->size(), cap);
      EXPECT_EQ(live->halvings(), 0);
      // The counts the selector kept are the fetches the reads made.
      for (const auto& [p, e] : pool.live) EXPECT_EQ(live->count(p), static_cast<uint32_t>(e.count)) << p;
      evicted += static_cast<int64_t>(want.size());
    }
    KvSelectionStats s;
    driver.selector().AddStats(s);
    EXPECT_EQ(s.tokens_evicted, evicted);
  }
}

TEST_F(InfiniGenHostPool, FifoEvictsTheOldestAndRecomputationDropsLaterEntries) {
  HostPoolDriver driver(PoolConfig(HostEvictionPolicy::kFifo, 8, 1e6, 1.0), *skew_path_, 64);
  driver.Step(5);
  for (int i = 0; i < 10; ++i) driver.Step(1);  // the last at position 14: positions 0..13 pooled
  const std::vector<int32_t> oldest = {0, 1, 2, 3, 4, 5};
  for (int layer = 0; layer < driver.num_layers(); ++layer) {
    EXPECT_EQ(driver.selector().EvictedPositions(1, layer), oldest) << layer;
  }
  // The last step read the 8 newest earlier tokens and its own, at every layer.
  const std::vector<int32_t> newest = {6, 7, 8, 9, 10, 11, 12, 13, 14};
  const auto& reads = driver.reads();
  for (size_t i = reads.size() - static_cast<size_t>(driver.num_layers()); i < reads.size(); ++i) {
    ASSERT_FALSE(reads[i].view);
    EXPECT_EQ(reads[i].per_head[0], newest) << "layer " << reads[i].layer;
  }
  // Positions 10.. recomputed (3 tokens): they leave the pool without evicting anything, and the
  // chunk reads what is left and its own.
  KvSelectionStats before;
  driver.selector().AddStats(before);
  driver.Step(3, 10);
  KvSelectionStats after;
  driver.selector().AddStats(after);
  EXPECT_EQ(after.tokens_evicted, before.tokens_evicted);
  for (int layer = 0; layer < driver.num_layers(); ++layer) {
    EXPECT_EQ(driver.selector().EvictedPositions(1, layer), oldest) << layer;
    EXPECT_EQ(driver.selector().HostPool(1, layer)->size(), 4) << layer;
  }
  const std::vector<int32_t> kept_and_own = {6, 7, 8, 9, 10, 11, 12};
  for (size_t i = reads.size() - static_cast<size_t>(driver.num_layers()); i < reads.size(); ++i) {
    ASSERT_FALSE(reads[i].view);
    EXPECT_EQ(reads[i].per_head[0], kept_and_own) << "layer " << reads[i].layer;
  }
}

TEST_F(InfiniGenHostPool, CounterKeepsTheTokensFetchedMost) {
  // Under FIFO the oldest go whatever the reads; the counter policy keeps old tokens the
  // speculation keeps choosing and evicts newer ones it fetched less.
  const int cap = 24;
  HostPoolDriver counter(PoolConfig(HostEvictionPolicy::kCounter, cap, 2.0, 0.3), *skew_path_, 256);
  HostPoolDriver fifo(PoolConfig(HostEvictionPolicy::kFifo, cap, 2.0, 0.3), *skew_path_, 256);
  for (HostPoolDriver* d : {&counter, &fifo}) {
    d->Step(32);
    for (int i = 0; i < 40; ++i) d->Step(1);
  }
  int layers_keeping_old_tokens = 0;
  for (int layer = 0; layer < counter.num_layers(); ++layer) {
    const std::vector<int32_t> evicted = counter.selector().EvictedPositions(1, layer);
    const HostKvEviction* pool = counter.selector().HostPool(1, layer);
    ASSERT_NE(pool, nullptr);
    ASSERT_FALSE(evicted.empty());
    ASSERT_EQ(pool->halvings(), 0);
    // When the newest evicted token went, every live token older than it had been fetched more
    // often (an equal count would have made the older one the victim): so it was fetched.
    bool kept_old = false;
    for (int32_t p = 0; p < evicted.back(); ++p) {
      if (!pool->count(p).has_value()) continue;
      EXPECT_GT(pool->count(p).value(), 0u) << "layer " << layer << " kept " << p << ", never fetched";
      kept_old = true;
    }
    if (layer > 0) layers_keeping_old_tokens += kept_old ? 1 : 0;  // layer 0 fetches every live token
    // FIFO: exactly the oldest.
    std::vector<int32_t> oldest(static_cast<size_t>(32 + 39 - cap));
    std::iota(oldest.begin(), oldest.end(), 0);
    EXPECT_EQ(fifo.selector().EvictedPositions(1, layer), oldest) << layer;
  }
  EXPECT_GT(layers_keeping_old_tokens, 0);
}


// The oracle the selection counters cannot give (kv_selection_oracle.h): InfiniGen in the engine
// (three sequences decoded together, shuffled block tables, a partial selection at every layer but
// the first) reads, at every decode step, layer and KV head, exactly the tokens an independent
// recomputation of its rule picks for that sequence and layer; attention over exactly those tokens,
// replayed on a fresh backend, reproduces the engine's logprobs, which full attention does not; and
// a selector wired to the next layer's or another sequence's reads would disagree.
TEST_F(KvSelectionEngine, InfiniGenReadsAreTheRulesChoiceAndReproduceTheLogits) {
  EngineConfig c = OracleConfig("infinigen");
  c.kv_selection.infinigen.alpha = 2.0;
  c.kv_selection.infinigen.max_fraction = 0.3;
  test::ExpectInfiniGenReadsFollowTheRule(c, {});
}

// The same for the other rules: each query head counted against its own max and a KV head reading
// the union of its query heads' tokens (tiny-random: 2 query heads per KV head), sinks and a recent
// window forced in, a cap in tokens, and the first two layers dense.
TEST_F(KvSelectionEngine, InfiniGenQueryHeadRuleReadsTheUnionWithSinksAndRecentTokens) {
  EngineConfig c = OracleConfig("infinigen");
  c.kv_selection.infinigen.alpha = 2.0;
  c.kv_selection.infinigen.count_rule = "query-heads";
  c.kv_selection.infinigen.dense_layers = 2;
  c.kv_selection.infinigen.sink_tokens = 2;
  c.kv_selection.infinigen.recent_tokens = 3;
  c.kv_selection.infinigen.max_tokens = 12;
  test::ExpectInfiniGenReadsFollowTheRule(c, {});
}

// The oracle: every layer past the dense ones reads the tokens its own query scores best against
// its whole keys (the test's own dot products, in double as the selector's).
TEST_F(KvSelectionEngine, InfiniGenOracleReadsTheTrueTopTokens) {
  EngineConfig c = OracleConfig("infinigen");
  c.kv_selection.infinigen.alpha = 2.0;
  c.kv_selection.infinigen.max_fraction = 0.3;
  c.kv_selection.infinigen.speculate_from = "oracle";
  test::ExpectInfiniGenReadsFollowTheRule(c, {});
  c.kv_selection.infinigen.count_rule = "query-heads";
  c.kv_selection.infinigen.dense_layers = 2;
  test::ExpectInfiniGenReadsFollowTheRule(c, {});
}

// H2O's reads at the engine level (recorded as in kv_selection_oracle.h): at every decode step,
// layer and KV head it reads at most its budget of the context, the step's own token last and the
// one before it, never a token it evicted (each read lies within the same head's previous read plus
// that step's token), and attention over exactly those reads, replayed on a fresh backend,
// reproduces the engine's logprobs, which full attention does not.
TEST_F(KvSelectionEngine, H2OReadsKeepTheBudgetNeverReturnAndReproduceTheLogits) {
  EngineConfig c = OracleConfig("h2o");
  c.kv_selection.h2o.budget = 0.3;
  test::RecordedRun run;
  test::RecordRun(c, run);
  if (HasFatalFailure()) return;
  const H2OConfig h2o = H2OConfig::FromOptions(c.kv_selection);
  int64_t reads = 0, continued = 0;
  for (const auto& [key, heads] : run.reads) {
    const auto& [seq, position, layer] = key;
    if (heads.empty()) continue;
    ++reads;
    const auto previous = run.reads.find({seq, position - 1, layer});
    for (size_t g = 0; g < heads.size(); ++g) {
      const auto& head = heads[g];
      ASSERT_FALSE(head.empty());
      EXPECT_EQ(head.back(), position) << "the step's own token, last";
      EXPECT_LE(static_cast<int32_t>(head.size()) - 1, h2o.Budget(position + 1)) << "position " << position;
      EXPECT_NE(std::find(head.begin(), head.end(), position - 1), head.end()) << "the most recent token";
      if (previous == run.reads.end() || previous->second.empty()) continue;
      ++continued;
      std::vector<int32_t> allowed = previous->second[g];  // its own token (position - 1) included
      std::sort(allowed.begin(), allowed.end());
      for (size_t k = 0; k + 1 < head.size(); ++k) {
        EXPECT_TRUE(std::binary_search(allowed.begin(), allowed.end(), head[k]))
            << "sequence " << seq << ", layer " << layer << ", head " << g << ": position " << head[k]
            << " read again after its eviction at position " << position;
      }
    }
  }
  test::ReplayFit fit, full;
  test::ReplayAll(c, run, nullptr, fit, full);
  const auto [other_differs, other_compared] = test::ReadsOfOtherSequencesDiffer(run);
  std::printf("  h2o 0.3: %lld decode reads (%lld head reads continuing one), replayed logprobs within %.2g of the "
              "engine's, %lld argmax differ (full attention moves them by up to %.2g); against another sequence's "
              "reads %lld of %lld differ\n",
              (long long)reads, (long long)continued, fit.max_logprob_error, (long long)fit.argmax_differs,
              full.max_logprob_error, (long long)other_differs, (long long)other_compared);
  EXPECT_EQ(reads, int64_t(run.prompts.size()) * 23 * run.model.num_layers) << "every decode step and layer";
  EXPECT_GT(continued, 0);
  EXPECT_LT(fit.max_logprob_error, 1e-4);
  EXPECT_EQ(fit.argmax_differs, 0);
  EXPECT_GT(full.max_logprob_error, 1e-3);
  EXPECT_GT(other_differs, other_compared * 9 / 10);
}

}  // namespace
}  // namespace kvflow
