// S3's hidden-state length probe: it learns a separable synthetic problem (linear and with a hidden
// layer), trains bit-identically from a seed, round-trips through its file, and refuses damaged,
// truncated and foreign files and another model's hidden size.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "forward/llama_model.h"
#include "model/tiny_random.h"
#include "sched/length_probe.h"

namespace kvflow {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kHidden = 48;
constexpr int kBuckets = 5;
const LengthBuckets kBucketSpec{500, kBuckets};  // width 100

// Each bucket has a random centre in hidden space; an example is its centre plus noise, scaled and
// shifted per dimension (so standardization matters), and labelled with a length inside the bucket.
struct Synthetic {
  std::vector<std::vector<float>> centres;
  std::vector<float> scale, shift;
};

Synthetic MakeProblem(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.1f, 20.0f);
  Synthetic s;
  s.centres.assign(kBuckets, std::vector<float>(kHidden));
  for (auto& c : s.centres) {
    for (float& x : c) x = 1.5f * normal(rng);
  }
  for (int64_t i = 0; i < kHidden; ++i) {
    s.scale.push_back(uniform(rng));
    s.shift.push_back(uniform(rng) * 5.0f - 50.0f);
  }
  return s;
}

std::vector<ProbeExample> Sample(const Synthetic& s, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> bucket(0, kBuckets - 1), offset(0, 99);
  std::vector<ProbeExample> out;
  for (int k = 0; k < n; ++k) {
    const int b = bucket(rng);
    ProbeExample e;
    e.hidden.resize(kHidden);
    for (int64_t i = 0; i < kHidden; ++i) e.hidden[i] = (s.centres[b][i] + normal(rng)) * s.scale[i] + s.shift[i];
    e.output_len = b * 100 + offset(rng);
    out.push_back(std::move(e));
  }
  return out;
}

LengthProbeConfig Config(int hidden_units) {
  LengthProbeConfig c;
  c.buckets = kBucketSpec;
  c.hidden_size = kHidden;
  c.hidden_units = hidden_units;
  c.seed = 7;
  c.epochs = 30;
  c.learning_rate = 1e-2f;
  c.l2 = 1e-4f;
  return c;
}

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / ("kvflow_length_probe_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(LengthProbe, ConfigValidation) {
  EXPECT_TRUE(Config(0).Validate().ok());
  LengthProbeConfig c = Config(0);
  c.hidden_size = 0;
  EXPECT_FALSE(c.Validate().ok());
  c = Config(0);
  c.hidden_units = -1;
  EXPECT_FALSE(c.Validate().ok());
  c = Config(0);
  c.learning_rate = std::nanf("");
  EXPECT_FALSE(c.Validate().ok());
  c = Config(0);
  c.batch_size = 0;
  EXPECT_FALSE(c.Validate().ok());
}

TEST(LengthProbe, UntrainedPredictsUniformly) {
  const LengthProbe probe(Config(0));
  const std::vector<float> h(kHidden, 3.0f);
  for (float p : probe.Probabilities(h)) EXPECT_FLOAT_EQ(p, 1.0f / kBuckets);
  EXPECT_EQ(probe.Predict(h).bucket, 0);
  EXPECT_EQ(probe.Predict(h).reserve_len, 100);  // the upper edge of bucket 0
  // A vector of the wrong width is not read.
  EXPECT_EQ(probe.Probabilities(std::vector<float>(kHidden + 1, 1.0f)).size(), static_cast<size_t>(kBuckets));
}

class LengthProbeLearns : public ::testing::TestWithParam<int> {};

TEST_P(LengthProbeLearns, SeparableBucketsOnFreshInputs) {
  const Synthetic problem = MakeProblem(std::random_device{}());
  const uint64_t seed = std::random_device{}();
  const auto train = Sample(problem, 600, seed);
  const auto test = Sample(problem, 400, seed + 1);
  LengthProbe probe(Config(GetParam()));
  const TrainReport tr = probe.Train(train);
  ASSERT_EQ(tr.epoch_loss.size(), 30u);
  EXPECT_LT(tr.epoch_loss.back(), tr.epoch_loss.front());
  const LengthEvaluation ev = EvaluateProbe(probe, test);
  EXPECT_EQ(ev.examples, 400);
  // Centres 1.5 sigma apart per dimension over 48 dimensions: the Bayes error is far below 1%.
  EXPECT_GT(ev.accuracy, 0.95) << "majority " << ev.majority_accuracy;
  EXPECT_LT(ev.majority_accuracy, 0.35);
  EXPECT_GT(ev.mean_predict_us, 0.0);
}

INSTANTIATE_TEST_SUITE_P(LengthProbe, LengthProbeLearns, ::testing::Values(0, 16));

TEST(LengthProbe, TrainingIsBitIdenticalGivenTheSeed) {
  const Synthetic problem = MakeProblem(11);
  const auto train = Sample(problem, 200, 12);
  const auto test = Sample(problem, 50, 13);
  for (int units : {0, 8}) {
    LengthProbe a(Config(units)), b(Config(units));
    const TrainReport ra = a.Train(train), rb = b.Train(train);
    EXPECT_EQ(ra.epoch_loss, rb.epoch_loss);
    for (const ProbeExample& e : test) EXPECT_EQ(a.Probabilities(e.hidden), b.Probabilities(e.hidden));
    LengthProbeConfig other = Config(units);
    other.seed = 8;
    LengthProbe c(other);
    EXPECT_NE(c.Train(train).epoch_loss, ra.epoch_loss);
  }
}

TEST(LengthProbe, OnlineUpdateMovesTowardTheLabel) {
  const Synthetic problem = MakeProblem(21);
  LengthProbe probe(Config(0));
  probe.Train(Sample(problem, 200, 22));
  const ProbeExample e = Sample(problem, 1, 23).front();
  const int wrong = (kBucketSpec.BucketOf(e.output_len) + 2) % kBuckets;
  const float before = probe.Probabilities(e.hidden)[wrong];
  probe.mutable_config().online_learning_rate = 0.05f;
  for (int i = 0; i < 5; ++i) probe.Update(e.hidden, wrong * 100 + 50, 1.0f);
  EXPECT_GT(probe.Probabilities(e.hidden)[wrong], before);
  EXPECT_EQ(probe.num_online_updates(), 5);
  probe.Update(std::vector<float>(3, 0.0f), 10, 1.0f);  // the wrong width: ignored
  EXPECT_EQ(probe.num_online_updates(), 5);
}

// The prequential evaluation is "predict, then learn" in order, weighting misses as asked: a probe
// whose workload moved (every bucket's prompts now run one bucket longer) scores near zero held
// still and recovers when it learns as it goes; the figures equal a hand-written loop's.
TEST(LengthProbe, OnlineEvaluationPredictsThenLearnsInOrder) {
  const Synthetic problem = MakeProblem(41);
  LengthProbe trained(Config(0));
  trained.Train(Sample(problem, 300, 42));
  std::vector<ProbeExample> moved = Sample(problem, 600, 43);
  for (ProbeExample& e : moved) e.output_len = (e.output_len + 100) % 500;
  trained.mutable_config().online_learning_rate = 0.02f;

  const LengthEvaluation still = EvaluateProbe(trained, moved);
  LengthProbe online = trained;
  const LengthEvaluation learnt = EvaluateProbeOnline(online, moved, 1.0f, 4.0f);
  std::printf("moved workload: held still %.3f, learning online %.3f\n", still.accuracy, learnt.accuracy);
  EXPECT_LT(still.accuracy, 0.3);
  EXPECT_GT(learnt.accuracy, 0.6);
  EXPECT_EQ(online.num_online_updates(), trained.num_online_updates() + 600);

  LengthProbe by_hand = trained;
  std::vector<std::vector<int64_t>> confusion(kBuckets, std::vector<int64_t>(kBuckets, 0));
  for (const ProbeExample& e : moved) {
    const int predicted = by_hand.Predict(e.hidden).bucket;
    const int truth = kBucketSpec.BucketOf(e.output_len);
    ++confusion[truth][predicted];
    by_hand.Update(e.hidden, e.output_len, predicted == truth ? 1.0f : 4.0f);
  }
  EXPECT_EQ(learnt.confusion, confusion);
  EXPECT_EQ(by_hand.Probabilities(moved.front().hidden), online.Probabilities(moved.front().hidden));
}

class LengthProbeFile : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    const Synthetic problem = MakeProblem(31);
    test_ = Sample(problem, 40, 33);
    LengthProbeConfig c = Config(GetParam());
    c.reservation_point = ReservationPoint::kMiddle;
    probe_ = std::make_unique<LengthProbe>(c);
    probe_->Train(Sample(problem, 200, 32));
    probe_->set_model_fingerprint("llama-L30-H48-test");
    probe_->set_description("unit test");
    path_ = TempPath("probe_" + std::to_string(GetParam()) + ".lh");
    ASSERT_TRUE(probe_->Save(path_).ok());
  }
  void TearDown() override { fs::remove(path_); }

  std::unique_ptr<LengthProbe> probe_;
  std::vector<ProbeExample> test_;
  std::string path_;
};

TEST_P(LengthProbeFile, RoundTripGivesIdenticalPredictions) {
  auto loaded = LengthProbe::Load(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->config().hidden_size, kHidden);
  EXPECT_EQ(loaded->config().hidden_units, GetParam());
  EXPECT_EQ(loaded->config().buckets.max_output_len, 500);
  EXPECT_EQ(loaded->config().reservation_point, ReservationPoint::kMiddle);
  EXPECT_EQ(loaded->model_fingerprint(), "llama-L30-H48-test");
  EXPECT_EQ(loaded->description(), "unit test");
  EXPECT_EQ(loaded->num_parameters(), probe_->num_parameters());
  for (const ProbeExample& e : test_) {
    EXPECT_EQ(loaded->Probabilities(e.hidden), probe_->Probabilities(e.hidden));
    EXPECT_EQ(loaded->Predict(e.hidden).reserve_len, probe_->Predict(e.hidden).reserve_len);
  }
  // Saving the loaded probe writes the same bytes.
  const std::string again = path_ + ".again";
  ASSERT_TRUE(loaded->Save(again).ok());
  EXPECT_EQ(ReadBytes(again), ReadBytes(path_));
  fs::remove(again);
}

TEST_P(LengthProbeFile, RefusesAnotherModel) {
  auto loaded = LengthProbe::Load(path_);
  ASSERT_TRUE(loaded.ok());
  EXPECT_TRUE(loaded->CheckModel("llama-L30-H48-test", kHidden).ok());
  const Status wrong_size = loaded->CheckModel("llama-L30-H48-test", 576);
  EXPECT_FALSE(wrong_size.ok());
  EXPECT_NE(wrong_size.message().find("576"), std::string::npos) << wrong_size.message();
  EXPECT_FALSE(loaded->CheckModel("llama-L24-H48-other", kHidden).ok());
}

TEST_P(LengthProbeFile, RefusesEveryFlippedByteAndEveryTruncation) {
  const std::string good = ReadBytes(path_);
  const std::string bad = path_ + ".bad";
  // Every byte of the preamble and header, then a stride through the weights, and the checksum.
  std::vector<size_t> positions;
  for (size_t i = 0; i < std::min<size_t>(good.size(), 600); ++i) positions.push_back(i);
  for (size_t i = 600; i < good.size(); i += 97) positions.push_back(i);
  for (size_t i = good.size() - 8; i < good.size(); ++i) positions.push_back(i);
  for (size_t pos : positions) {
    std::string bytes = good;
    bytes[pos] = static_cast<char>(bytes[pos] ^ 0x20);
    WriteBytes(bad, bytes);
    auto loaded = LengthProbe::Load(bad);
    ASSERT_FALSE(loaded.ok()) << "flipped byte " << pos << " was accepted";
    EXPECT_EQ(loaded.status().code(), StatusCode::kCorruptFile) << loaded.status().ToString();
  }
  for (size_t len : {size_t{0}, size_t{5}, size_t{20}, good.size() / 2, good.size() - 9, good.size() - 1}) {
    WriteBytes(bad, good.substr(0, len));
    auto loaded = LengthProbe::Load(bad);
    ASSERT_FALSE(loaded.ok()) << "truncated to " << len << " bytes was accepted";
    EXPECT_EQ(loaded.status().code(), StatusCode::kCorruptFile) << loaded.status().ToString();
  }
  fs::remove(bad);
  EXPECT_EQ(LengthProbe::Load(path_ + ".missing").status().code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(LengthProbe, LengthProbeFile, ::testing::Values(0, 8));

// The probe's input: Backend::ReadFinalHidden returns, per logit row, the vector the LM head
// multiplies (logits = output matrix x hidden), and nothing of an earlier step.
TEST(LengthProbe, FinalHiddenIsWhatTheLmHeadReads) {
  auto files = MakeTinyRandomModel().value();
  const ModelConfig config = files.config;
  LlamaWeights w = LoadLlamaWeights(*files.tensors, files.config, files.gguf_rope_permuted).value();
  ASSERT_TRUE(w.output_matrix().is_f32());
  const std::vector<float> head = w.output_matrix().f32();  // [vocab][hidden]
  const int64_t H = config.hidden_size, V = config.vocab_size;
  KvCacheLayout layout{config.num_layers, 16, config.num_kv_heads, 8, config.head_dim};
  auto backend = CpuBackend::Create(config, std::move(w), layout, 0, 2).value();

  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> token(0, static_cast<int>(V) - 1);
  ForwardBatch b;
  for (int seq = 0; seq < 2; ++seq) {
    SequenceSlice s;
    s.token_offset = static_cast<int32_t>(b.tokens.size());
    s.num_tokens = seq == 0 ? 11 : 5;
    s.context_len = s.num_tokens;
    s.block_table = seq == 0 ? std::vector<BlockId>{0, 1} : std::vector<BlockId>{2};
    s.logits = LogitsMode::kLast;
    for (int i = 0; i < s.num_tokens; ++i) {
      b.tokens.push_back(token(rng));
      b.positions.push_back(i);
    }
    b.seqs.push_back(s);
  }
  std::vector<float> logits;
  ASSERT_TRUE(LlamaModel(*backend).Forward(b, logits).ok());
  std::vector<float> hidden(static_cast<size_t>(2 * H));
  ASSERT_TRUE(backend->ReadFinalHidden(0, 2, hidden).ok());
  double max_logit = 0, max_err = 0;
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t v = 0; v < V; ++v) {
      double dot = 0;
      for (int64_t i = 0; i < H; ++i) dot += static_cast<double>(head[v * H + i]) * hidden[r * H + i];
      max_logit = std::max(max_logit, std::fabs(dot));
      max_err = std::max(max_err, std::fabs(dot - logits[r * V + v]));
    }
  }
  ASSERT_GT(max_logit, 0.0);
  EXPECT_LT(max_err, 1e-4 * max_logit) << "max |logit| " << max_logit;
  EXPECT_EQ(backend->ReadFinalHidden(1, 2, hidden).code(), StatusCode::kInvalidArgument);

  // A step without logit rows leaves nothing to read.
  b.seqs[0].logits = LogitsMode::kNone;
  b.seqs[1].logits = LogitsMode::kNone;
  ASSERT_TRUE(LlamaModel(*backend).Forward(b, logits).ok());
  EXPECT_EQ(backend->ReadFinalHidden(0, 1, hidden).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvflow
