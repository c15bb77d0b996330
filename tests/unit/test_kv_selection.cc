// KV selection (issue 16): attention over per-KV-head token selections against a dense reference,
// InfiniGen's skewing file (round trip, every corruption refused) and calibration on a model, and
// the InfiniGen and H2O selectors inside the engine: exact when they select everything, reading
// what their rules say otherwise, per-request opt-out, clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/backend_factory.h"
#include "backend/cpu/paged_attention.h"
#include "engine_test_util.h"
#include "infinigen/calibration.h"
#include "infinigen/skew_file.h"
#include "infinigen/skewing.h"
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

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvflow_test_" + std::to_string(::getpid()) + "_" + name)).string();
}

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

// The tiny-random model's backend, with room for `tokens`.
std::unique_ptr<Backend> TinyBackend(int tokens) {
  auto files = OpenModelFiles("tiny-random");
  EXPECT_TRUE(files.ok());
  EngineConfig c;
  c.model = "tiny-random";
  c.num_threads = 2;
  c.dtype = "f32";
  c.max_model_len = tokens;
  c.num_kv_blocks = tokens / c.block_size + 2;
  c.num_host_kv_blocks = 0;
  auto weights = LoadWeightsFor(files.value(), c);
  EXPECT_TRUE(weights.ok());
  auto backend = CreateBackend(c, true, files->config, std::move(weights.value()));
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return std::move(backend).value();
}

std::vector<int32_t> RandomTokens(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 10)) + 5;
  return t;
}

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
    auto backend = TinyBackend(256);
    SkewCalibrationOptions o;
    auto t = CalibrateSkew(*backend, RandomTokens(256, 9, backend->model_config().vocab_size), o);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(WriteSkewTable(t.value(), *skew_path_).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*skew_path_);
    delete skew_path_;
  }

  static EngineConfig Config(const std::string& method) {
    EngineConfig c;
    c.dtype = "f32";
    c.kv_selection = method;
    c.infinigen_skew_file = *skew_path_;
    return c;
  }

  // Greedy tokens of a few prompts of different lengths, decoded together.
  static std::vector<std::vector<int32_t>> Run(Engine& engine, std::optional<bool> selection = {}) {
    std::vector<std::vector<int32_t>> prompts = {RandomTokens(90, 1, 256), RandomTokens(37, 2, 256),
                                                 RandomTokens(150, 3, 256)};
    SamplingParams p = test::Greedy(24);
    p.kv_selection = selection;
    return test::GenerateAll(engine, prompts, p, false);
  }

  static std::string* skew_path_;
};
std::string* KvSelectionEngine::skew_path_ = nullptr;

TEST_F(KvSelectionEngine, InfiniGenSelectingEverythingIsExactlyFullAttention) {
  auto full = test::MakeEngine(Config(""));
  ASSERT_TRUE(full);
  const auto expected = Run(*full);
  for (const char* point : {"after-attention", "layer-input"}) {
    EngineConfig c = Config("infinigen");
    c.infinigen_alpha = 1e6;
    c.infinigen_max_fraction = 1.0;
    c.infinigen_speculate_from = point;
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
    c.infinigen_alpha = 1e6;
    c.infinigen_max_fraction = 1.0;
    auto all = test::MakeEngine(c);
    EngineConfig h = Config("h2o");
    h.kv_cache_dtype = dtype;
    h.h2o_budget = 0.3;
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
  c.infinigen_alpha = 2.0;
  c.infinigen_max_fraction = 0.2;
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
  c.infinigen_alpha = 1.0;
  c.infinigen_max_fraction = 0.1;
  auto engine = test::MakeEngine(c);
  ASSERT_TRUE(full && engine);
  EXPECT_EQ(Run(*engine, false), Run(*full));
  EXPECT_EQ(engine->stats().kv_selection.decode_tokens, 0);
  // And opt in where the engine's default is off.
  c.kv_selection_default = false;
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
  c.h2o_budget = 1.0;
  auto all = test::MakeEngine(c);
  ASSERT_TRUE(full && all);
  EXPECT_EQ(Run(*all), Run(*full));
  const KvSelectionStats s = all->stats().kv_selection;
  EXPECT_EQ(s.tokens_selected, s.tokens_available);
}

TEST_F(KvSelectionEngine, H2OKeepsItsBudget) {
  EngineConfig c = Config("h2o");
  c.h2o_budget = 0.25;
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
  c.infinigen_skew_file = *skew_path_ + ".absent";
  auto missing = test::CreateTinyEngine(c);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("kvflow skew"), std::string::npos) << missing.status().message();
  for (auto bad : std::vector<std::function<void(EngineConfig&)>>{
           [](EngineConfig& e) { e.kv_selection = "quest"; },
           [](EngineConfig& e) { e.infinigen_alpha = 0; },
           [](EngineConfig& e) { e.infinigen_speculate_from = "layer-output"; },
           [](EngineConfig& e) { e.infinigen_max_fraction = 1.5; },
           [](EngineConfig& e) { e.h2o_budget = 0; },
           [](EngineConfig& e) { e.speculative_method = "ngram"; },
       }) {
    EngineConfig e = Config("infinigen");
    bad(e);
    auto r = test::CreateTinyEngine(e);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
  // The selectors run on CUDA too (tests/cuda/test_cuda_backend.cc): the config is no longer refused
  // for it (without a GPU the backend itself may still be unavailable).
  EngineConfig cuda = Config("h2o");
  cuda.device = "cuda";
  auto on_cuda = test::CreateTinyEngine(cuda);
  if (!on_cuda.ok()) {
    EXPECT_EQ(on_cuda.status().message().find("kv_selection"), std::string::npos) << on_cuda.status().ToString();
  }
}

}  // namespace
}  // namespace kvflow
