// S3's output-length predictor: bucket arithmetic, learning a synthetic length rule, bit-identical
// training, the file format's round trip and its refusal of damaged files, online updates.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "kvflow/tokenizer.h"
#include "sched/length_predictor.h"
#include "util/hash.h"

namespace kvflow {
namespace {

namespace fs = std::filesystem;

// ---- buckets ----------------------------------------------------------------------------------

TEST(LengthBuckets, S3EdgesFor2048) {
  LengthBuckets b{2048, 10};
  EXPECT_EQ(b.width(), 205);  // ceil(204.8)
  EXPECT_EQ(b.BucketOf(0), 0);
  EXPECT_EQ(b.BucketOf(-3), 0);
  EXPECT_EQ(b.BucketOf(204), 0);
  EXPECT_EQ(b.BucketOf(205), 1);
  EXPECT_EQ(b.BucketOf(1844), 8);
  EXPECT_EQ(b.BucketOf(1845), 9);
  EXPECT_EQ(b.BucketOf(2047), 9);
  EXPECT_EQ(b.BucketOf(2048), 9);
  EXPECT_EQ(b.BucketOf(1'000'000), 9);  // beyond max_output_len: still the last bucket
  EXPECT_EQ(b.LowerEdge(0), 0);
  EXPECT_EQ(b.UpperEdge(0), 205);
  EXPECT_EQ(b.LowerEdge(9), 1845);
  EXPECT_EQ(b.UpperEdge(9), 2050);
}

TEST(LengthBuckets, MaxLenNotDivisibleByTen) {
  LengthBuckets b{512, 10};
  EXPECT_EQ(b.width(), 52);
  EXPECT_EQ(b.BucketOf(51), 0);
  EXPECT_EQ(b.BucketOf(52), 1);
  EXPECT_EQ(b.BucketOf(467), 8);
  EXPECT_EQ(b.BucketOf(468), 9);
  EXPECT_EQ(b.BucketOf(511), 9);
  EXPECT_EQ(b.BucketOf(512), 9);
  LengthBuckets small{15, 10};  // width 2: the last bucket's lower edge (18) lies past the max
  EXPECT_EQ(small.width(), 2);
  EXPECT_EQ(small.BucketOf(14), 7);
  EXPECT_EQ(small.BucketOf(17), 8);
  EXPECT_EQ(small.BucketOf(18), 9);
  LengthBuckets exact{10, 10};
  EXPECT_EQ(exact.width(), 1);
  EXPECT_EQ(exact.BucketOf(9), 9);
  EXPECT_EQ(exact.BucketOf(10), 9);
}

TEST(LengthPredictorConfig, ParseReservationPoint) {
  EXPECT_EQ(ParseReservationPoint("upper").value(), ReservationPoint::kUpper);
  EXPECT_EQ(ParseReservationPoint("middle").value(), ReservationPoint::kMiddle);
  for (const char* bad : {"", "Upper", "lower", "upper ", "mid"}) {
    auto p = ParseReservationPoint(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_STREQ(ReservationPointName(ReservationPoint::kMiddle), "middle");
}

TEST(LengthPredictorConfig, ValidateRefusesOutOfRange) {
  EXPECT_TRUE(LengthPredictorConfig{}.Validate().ok());
  LengthPredictorConfig c;
  c.hash_bits = 40;
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  c = {};
  c.buckets.num_buckets = 1;
  EXPECT_FALSE(c.Validate().ok());
  c = {};
  c.learning_rate = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(c.Validate().ok());
}

// ---- a synthetic rule -------------------------------------------------------------------------

// Ten "topic" tokens, one per bucket; every prompt holds one topic token (once or twice) among
// 3-40 noise tokens, and its output length is uniform within the topic's bucket.
constexpr int32_t kTopicBase = 100;
constexpr int32_t kNoiseBase = 1000;
constexpr int32_t kNumNoise = 2000;

std::vector<LengthExample> SyntheticExamples(size_t n, const LengthBuckets& buckets, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto below = [&](uint64_t m) { return static_cast<int64_t>(rng() % m); };
  std::vector<LengthExample> out;
  for (size_t i = 0; i < n; ++i) {
    const int topic = static_cast<int>(below(buckets.num_buckets));
    LengthExample e;
    const int64_t len = 3 + below(38);
    for (int64_t t = 0; t < len; ++t) e.prompt.push_back(kNoiseBase + static_cast<int32_t>(below(kNumNoise)));
    for (int64_t copies = 1 + below(2); copies > 0; --copies) {
      e.prompt.insert(e.prompt.begin() + below(e.prompt.size() + 1), kTopicBase + topic);
    }
    e.output_len = buckets.LowerEdge(topic) + below(buckets.width());
    out.push_back(std::move(e));
  }
  return out;
}

LengthPredictorConfig SmallConfig() {
  LengthPredictorConfig c;
  c.buckets = {512, 10};
  c.hash_bits = 12;
  c.epochs = 5;
  c.seed = 7;
  return c;
}

TEST(LengthPredictor, UntrainedPredictsBucketZeroUniformly) {
  LengthPredictor p(SmallConfig());
  const std::vector<int32_t> prompt = {1, 2, 3, 4};
  const LengthPrediction pred = p.Predict(prompt);
  EXPECT_EQ(pred.bucket, 0);
  EXPECT_EQ(pred.reserve_len, 52);
  EXPECT_FLOAT_EQ(pred.probability, 0.1f);
  for (float x : p.Probabilities(prompt)) EXPECT_FLOAT_EQ(x, 0.1f);
  EXPECT_EQ(p.Predict(std::vector<int32_t>{}).bucket, 0);  // an empty prompt is no error
}

TEST(LengthPredictor, LearnsTopicRuleOnHeldOutPrompts) {
  LengthPredictorConfig c = SmallConfig();
  const auto train = SyntheticExamples(2000, c.buckets, 1);
  const auto test = SyntheticExamples(500, c.buckets, 2);
  LengthPredictor p(c);
  const TrainReport report = p.Train(train);
  ASSERT_EQ(report.epoch_loss.size(), 5u);
  EXPECT_LT(report.epoch_loss.back(), report.epoch_loss.front());
  const LengthEvaluation ev = Evaluate(p, test);
  EXPECT_GE(ev.accuracy, 0.95) << "under " << ev.under_predictions << " over " << ev.over_predictions;
  EXPECT_EQ(ev.examples, 500);
  EXPECT_LT(ev.majority_accuracy, 0.2);
  int64_t total = 0;
  for (const auto& row : ev.confusion) {
    for (int64_t v : row) total += v;
  }
  EXPECT_EQ(total, 500);
  EXPECT_GT(ev.mean_predict_us, 0.0);
  // The reservation of a correct prediction covers the true length.
  const LengthPrediction pred = p.Predict(test[0].prompt);
  if (pred.bucket == c.buckets.BucketOf(test[0].output_len)) EXPECT_GT(pred.reserve_len, test[0].output_len);
}

TEST(LengthPredictor, MiddleReservationPoint) {
  LengthPredictorConfig c = SmallConfig();
  c.reservation_point = ReservationPoint::kMiddle;
  LengthPredictor p(c);
  EXPECT_EQ(p.Predict(std::vector<int32_t>{5}).reserve_len, 26);
}

TEST(LengthPredictor, TrainingIsBitIdentical) {
  const LengthPredictorConfig c = SmallConfig();
  const auto train = SyntheticExamples(600, c.buckets, 3);
  LengthPredictor a(c), b(c);
  const TrainReport ra = a.Train(train);
  const TrainReport rb = b.Train(train);
  ASSERT_EQ(a.weights().size(), b.weights().size());
  EXPECT_EQ(std::memcmp(a.weights().data(), b.weights().data(), a.weights().size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.bias().data(), b.bias().data(), a.bias().size() * sizeof(float)), 0);
  EXPECT_EQ(ra.epoch_loss, rb.epoch_loss);
  const auto test = SyntheticExamples(50, c.buckets, 4);
  for (const auto& e : test) {
    EXPECT_EQ(a.Predict(e.prompt).bucket, b.Predict(e.prompt).bucket);
    EXPECT_EQ(a.Probabilities(e.prompt), b.Probabilities(e.prompt));
  }
  // The seed is used: another shuffle gives other weights.
  LengthPredictorConfig other = c;
  other.seed = c.seed + 1;
  LengthPredictor d(other);
  d.Train(train);
  EXPECT_NE(std::memcmp(a.weights().data(), d.weights().data(), a.weights().size() * sizeof(float)), 0);
}

TEST(LengthPredictor, OnlineUpdateMovesTowardTheLabel) {
  LengthPredictorConfig c = SmallConfig();
  LengthPredictor p(c);
  p.Train(SyntheticExamples(1000, c.buckets, 5));
  // A topic-2 prompt whose request actually ran into bucket 7.
  std::vector<int32_t> prompt = {kNoiseBase + 1, kTopicBase + 2, kNoiseBase + 5, kNoiseBase + 9};
  ASSERT_EQ(p.Predict(prompt).bucket, 2);
  const int64_t actual = c.buckets.LowerEdge(7) + 3;
  const float before = p.Probabilities(prompt)[7];
  p.Update(prompt, actual, c.online_weight_mispredicted);
  EXPECT_GT(p.Probabilities(prompt)[7], before);
  EXPECT_EQ(p.num_online_updates(), 1);
  int updates = 1;
  while (p.Predict(prompt).bucket != 7 && updates < 100) {
    p.Update(prompt, actual, c.online_weight_mispredicted);
    ++updates;
  }
  EXPECT_EQ(p.Predict(prompt).bucket, 7) << "after " << updates << " updates";
  EXPECT_EQ(p.num_online_updates(), updates);
  p.Update(prompt, actual, 0.0f);  // a zero weight is no step
  EXPECT_EQ(p.num_online_updates(), updates);
}

// The prequential evaluation predicts, then learns, in order, with the predictor's online weights:
// its confusion and the predictor it leaves equal a hand-written loop's.
TEST(LengthPredictor, OnlineEvaluationPredictsThenLearnsInOrder) {
  LengthPredictorConfig c = SmallConfig();
  LengthPredictor trained(c);
  trained.Train(SyntheticExamples(300, c.buckets, 6));
  std::vector<LengthExample> stream = SyntheticExamples(200, c.buckets, 7);
  for (LengthExample& e : stream) e.output_len = std::min<int64_t>(c.buckets.max_output_len - 1, e.output_len * 2);
  LengthPredictor online = trained;
  const LengthEvaluation ev = EvaluateOnline(online, stream);
  LengthPredictor by_hand = trained;
  std::vector<std::vector<int64_t>> confusion(c.buckets.num_buckets, std::vector<int64_t>(c.buckets.num_buckets, 0));
  for (const LengthExample& e : stream) {
    const int predicted = by_hand.Predict(e.prompt).bucket;
    const int truth = c.buckets.BucketOf(e.output_len);
    ++confusion[truth][predicted];
    by_hand.Update(e.prompt, e.output_len, predicted == truth ? c.online_weight_correct : c.online_weight_mispredicted);
  }
  EXPECT_EQ(ev.confusion, confusion);
  EXPECT_EQ(online.num_online_updates(), 200);
  EXPECT_EQ(online.Probabilities(stream.front().prompt), by_hand.Probabilities(stream.front().prompt));
  EXPECT_GT(ev.accuracy, Evaluate(trained, stream).accuracy);  // the lengths moved: learning pays
}

// ---- file format ------------------------------------------------------------------------------

class LengthPredictorFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("kvflow_lp_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::create_directories(dir_);
    LengthPredictorConfig c = SmallConfig();
    c.hash_bits = 8;  // a small file, so every header byte can be flipped quickly
    trained_ = LengthPredictor(c);
    trained_.Train(SyntheticExamples(300, c.buckets, 6));
    trained_.Update(std::vector<int32_t>{kTopicBase, kNoiseBase}, 300, 1.0f);
    trained_.set_tokenizer_fingerprint("vocab49152-0123456789abcdef");
    trained_.set_description("unit test \"predictor\"");
    path_ = (dir_ / "p.lp").string();
    ASSERT_TRUE(trained_.Save(path_).ok());
    std::ifstream in(path_, std::ios::binary);
    bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    std::memcpy(&header_len_, bytes_.data() + 12, sizeof(header_len_));
  }
  void TearDown() override { fs::remove_all(dir_); }

  Status LoadBytes(const std::string& bytes) {
    const std::string path = (dir_ / "bad.lp").string();
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    auto p = LengthPredictor::Load(path);
    return p.ok() ? Status::Ok() : p.status();
  }

  static uint64_t Checksum(const std::string& bytes) {  // the format's: FNV-1a 64, then SplitMix64
    uint64_t h = 0xcbf29ce484222325ULL;
    for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
    return SplitMix64(h);
  }

  // The file rebuilt around an edited header and payload, with a correct length and checksum, so
  // the checks behind the checksum are the ones exercised.
  std::string Rebuild(const nlohmann::json& header, std::string payload) const {
    const std::string text = header.dump();
    std::string out = bytes_.substr(0, 12);
    const uint64_t len = text.size();
    out.append(reinterpret_cast<const char*>(&len), sizeof(len));
    out += text;
    out += payload;
    const uint64_t sum = Checksum(out);
    out.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
    return out;
  }
  nlohmann::json Header() const { return nlohmann::json::parse(bytes_.substr(20, header_len_)); }
  std::string Payload() const { return bytes_.substr(20 + header_len_, bytes_.size() - 20 - header_len_ - 8); }

  fs::path dir_;
  std::string path_;
  std::string bytes_;
  uint64_t header_len_ = 0;
  LengthPredictor trained_;
};

TEST_F(LengthPredictorFile, RoundTripGivesIdenticalProbabilities) {
  auto loaded = LengthPredictor::Load(path_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const LengthPredictor& p = loaded.value();
  EXPECT_EQ(p.config().hash_bits, 8);
  EXPECT_EQ(p.config().buckets.max_output_len, 512);
  EXPECT_EQ(p.config().seed, 7u);
  EXPECT_EQ(p.config().epochs, 5);
  EXPECT_EQ(p.config().learning_rate, trained_.config().learning_rate);
  EXPECT_EQ(p.tokenizer_fingerprint(), "vocab49152-0123456789abcdef");
  EXPECT_EQ(p.description(), "unit test \"predictor\"");
  EXPECT_EQ(p.num_online_updates(), 1);
  EXPECT_EQ(p.weights(), trained_.weights());
  EXPECT_EQ(p.bias(), trained_.bias());
  for (const auto& e : SyntheticExamples(30, p.config().buckets, 8)) {
    EXPECT_EQ(p.Probabilities(e.prompt), trained_.Probabilities(e.prompt));
  }
  EXPECT_TRUE(LoadBytes(Rebuild(Header(), Payload())).ok());  // the test's rebuild is faithful
}

TEST_F(LengthPredictorFile, MissingFileIsNotFound) {
  EXPECT_EQ(LengthPredictor::Load((dir_ / "absent.lp").string()).status().code(), StatusCode::kNotFound);
}

TEST_F(LengthPredictorFile, TruncatedFileIsCorrupt) {
  for (size_t len : {size_t{0}, size_t{7}, size_t{8}, size_t{19}, size_t{20}, size_t{20 + header_len_ / 2},
                     size_t{20 + header_len_}, bytes_.size() / 2, bytes_.size() - 8, bytes_.size() - 1}) {
    const Status st = LoadBytes(bytes_.substr(0, len));
    EXPECT_EQ(st.code(), StatusCode::kCorruptFile) << len << ": " << st.ToString();
  }
  EXPECT_EQ(LoadBytes(bytes_ + "x").code(), StatusCode::kCorruptFile);
}

TEST_F(LengthPredictorFile, WrongMagicIsCorrupt) {
  std::string bad = bytes_;
  bad[0] = 'G';
  const Status st = LoadBytes(bad);
  EXPECT_EQ(st.code(), StatusCode::kCorruptFile);
  EXPECT_NE(st.message().find("magic"), std::string::npos) << st.message();
  EXPECT_EQ(LoadBytes("GGUF and then some garbage that is long enough").code(), StatusCode::kCorruptFile);
}

TEST_F(LengthPredictorFile, EveryFlippedHeaderByteIsCorrupt) {
  for (size_t i = 0; i < 20 + header_len_; ++i) {
    for (unsigned char mask : {0x01, 0x80}) {
      std::string bad = bytes_;
      bad[i] = static_cast<char>(bad[i] ^ mask);
      const Status st = LoadBytes(bad);
      ASSERT_EQ(st.code(), StatusCode::kCorruptFile) << "byte " << i << " ^ " << int{mask} << ": " << st.ToString();
    }
  }
}

TEST_F(LengthPredictorFile, NonFiniteWeightsAreCorrupt) {
  for (float bad_value : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::string payload = Payload();
    std::memcpy(payload.data() + 4 * 17, &bad_value, sizeof(float));
    const Status st = LoadBytes(Rebuild(Header(), payload));
    EXPECT_EQ(st.code(), StatusCode::kCorruptFile);
    EXPECT_NE(st.message().find("non-finite"), std::string::npos) << st.message();
  }
}

TEST_F(LengthPredictorFile, HugeOrInconsistentSizesAreCorrupt) {
  const auto with = [&](const char* key, nlohmann::json value) {
    nlohmann::json h = Header();
    h[key] = std::move(value);
    return LoadBytes(Rebuild(h, Payload()));
  };
  EXPECT_EQ(with("hash_bits", 60).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("hash_bits", 24).code(), StatusCode::kCorruptFile);  // in range, but not the bytes present
  EXPECT_EQ(with("hash_bits", -1).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("num_buckets", 1'000'000'000).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("num_buckets", 0).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("num_weights", uint64_t{1} << 62).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("num_bias", 11).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("max_output_len", -5).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("hash_bits", "sixteen").code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("reservation_point", "lower").code(), StatusCode::kCorruptFile);
  EXPECT_EQ(with("features", "something else").code(), StatusCode::kCorruptFile);
  nlohmann::json no_training = Header();
  no_training.erase("training");
  EXPECT_EQ(LoadBytes(Rebuild(no_training, Payload())).code(), StatusCode::kCorruptFile);
  EXPECT_EQ(LoadBytes(Rebuild(nlohmann::json::array({1, 2}), Payload())).code(), StatusCode::kCorruptFile);
  // A header length that points far past the file.
  std::string bad = bytes_;
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(bad.data() + 12, &huge, sizeof(huge));
  EXPECT_EQ(LoadBytes(bad).code(), StatusCode::kCorruptFile);
}

// ---- tokenizer fingerprint --------------------------------------------------------------------

class ListTokenizer : public Tokenizer {
 public:
  explicit ListTokenizer(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {}
  std::vector<int32_t> Encode(std::string_view, bool, bool) const override { return {}; }
  std::string TokenBytes(int32_t, bool) const override { return {}; }
  std::string DecodeBytes(const std::vector<int32_t>&, bool) const override { return {}; }
  std::string Decode(const std::vector<int32_t>&, bool) const override { return {}; }
  std::string DecodePieces(const std::vector<int32_t>&, bool) const override { return {}; }
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const override { return -1; }
  int32_t eos_id() const override { return -1; }
  bool add_bos() const override { return false; }
  bool is_special(int32_t) const override { return false; }
  const std::string& token_text(int32_t id) const override { return tokens_[static_cast<size_t>(id)]; }
  int32_t token_id(std::string_view) const override { return -1; }
  const std::string& chat_template() const override { return empty_; }

 private:
  std::vector<std::string> tokens_;
  std::string empty_;
};

TEST(LengthPredictorFingerprint, DependsOnEveryTokenText) {
  const std::string a = TokenizerFingerprint(ListTokenizer({"a", "b", "cd"}));
  EXPECT_EQ(a, TokenizerFingerprint(ListTokenizer({"a", "b", "cd"})));
  EXPECT_EQ(a.rfind("vocab3-", 0), 0u) << a;
  EXPECT_NE(a, TokenizerFingerprint(ListTokenizer({"a", "b", "ce"})));
  EXPECT_NE(a, TokenizerFingerprint(ListTokenizer({"a", "bc", "d"})));
  EXPECT_NE(a, TokenizerFingerprint(ListTokenizer({"a", "b", "cd", "e"})));
}

}  // namespace
}  // namespace kvflow
