// S3's output-length predictor: classifies a prompt's output length into buckets of width
// max_output_len / num_buckets (S3: 10 buckets of max_seq_len / 10) and turns the bucket into the
// length the scheduler reserves KV for.
//
// Model: multinomial logistic regression over hashed token n-grams of the prompt (unigrams and
// bigrams of token ids, hashed into 2^hash_bits slots, each prompt's counts scaled to unit L2
// norm) plus a one-hot of the prompt length's log2 bin. A prediction is one sparse dot product per
// bucket: a few microseconds for a typical prompt, against S3's 3.7 ms for DistilBERT on an A100,
// and it needs neither the served model nor a GPU. It is trained offline by
// `kvflow-length-predictor train` and updated online (one SGD step per completed request) by the
// S3 supervisor. Training and updates are deterministic given the seed.
//
// Token ids are those of the served model's tokenizer; the file records the tokenizer's
// fingerprint so a predictor trained for another vocabulary is refused at load.
//
// File (little-endian): "KVFLOWLP", u32 version, u64 header length, the JSON header (buckets,
// hashing, reservation point, hyper-parameters, tokenizer fingerprint, description, weight counts),
// float32 weights [rows][num_buckets], float32 bias [num_buckets], and a u64 checksum of every
// byte before it (so a flipped byte anywhere, even inside the description, is caught at load).
#pragma once

#include <array>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvflow/status.h"

namespace kvflow {

class Tokenizer;

// 10 buckets of width ceil(max_output_len / num_buckets); lengths at or beyond the last bucket's
// lower edge fall in the last bucket.
struct LengthBuckets {
  int64_t max_output_len = 2048;
  int num_buckets = 10;

  int64_t width() const { return (max_output_len + num_buckets - 1) / num_buckets; }
  int BucketOf(int64_t output_len) const;
  int64_t LowerEdge(int bucket) const { return bucket * width(); }
  int64_t UpperEdge(int bucket) const { return (bucket + 1) * width(); }
};

// Which length of the predicted bucket the scheduler reserves.
enum class ReservationPoint { kUpper, kMiddle };
Result<ReservationPoint> ParseReservationPoint(std::string_view name);  // "upper", "middle"
const char* ReservationPointName(ReservationPoint point);

struct LengthPredictorConfig {
  // Limits Load enforces, so a corrupt header cannot ask for an absurd allocation.
  static constexpr int kMinHashBits = 8;
  static constexpr int kMaxHashBits = 24;
  static constexpr int kMinBuckets = 2;
  static constexpr int kMaxBuckets = 1000;
  static constexpr int64_t kMaxOutputLen = int64_t{1} << 30;

  LengthBuckets buckets;
  int hash_bits = 16;  // 2^16 feature slots x 10 buckets x 4 bytes = 2.5 MiB
  ReservationPoint reservation_point = ReservationPoint::kUpper;

  // Offline training: AdaGrad over shuffled epochs (shuffle seeded by `seed`).
  uint64_t seed = 0;
  int epochs = 20;
  float learning_rate = 0.5f;
  float l2 = 1e-6f;

  // Online updates: plain SGD, so an update costs the same however long the server has run.
  float online_learning_rate = 0.1f;
  float online_weight_correct = 1.0f;       // a completed request the predictor got right
  float online_weight_mispredicted = 4.0f;  // S3 retrains on its mistakes: they weigh more

  // InvalidArgument for values outside the limits above or non-finite / negative rates.
  Status Validate() const;
};

struct LengthExample {
  std::vector<int32_t> prompt;
  int64_t output_len = 0;
  float weight = 1.0f;  // scales this example's loss in Train
};

struct LengthPrediction {
  int bucket = 0;
  int64_t reserve_len = 0;  // output tokens to reserve (the configured point of the bucket)
  float probability = 0;    // of the predicted bucket
};

struct TrainReport {
  int epochs = 0;
  int64_t examples = 0;
  std::vector<double> epoch_loss;  // mean weighted cross-entropy per epoch
  double seconds = 0;
};

// Predict and Probabilities only read the weights: any number of threads may call them together,
// but not while Train or Update runs.
class LengthPredictor {
 public:
  // Prompt-length bins of the one-hot block: bin = floor(log2(prompt tokens + 1)), the last bin
  // also taking every longer prompt.
  static constexpr int kNumLengthBins = 20;
  static constexpr uint32_t kFormatVersion = 1;

  // Zero weights: every bucket equally likely, the prediction is bucket 0 until trained. A config
  // outside the limits of LengthPredictorConfig is clamped into them (Validate it first to refuse it).
  explicit LengthPredictor(const LengthPredictorConfig& config = {});

  // Reads a file written by Save. A truncated, corrupt or foreign file is a CorruptFile error.
  static Result<LengthPredictor> Load(const std::string& path);
  Status Save(const std::string& path) const;

  LengthPrediction Predict(std::span<const int32_t> prompt) const;
  std::vector<float> Probabilities(std::span<const int32_t> prompt) const;

  // Offline training from the current weights (normally zero).
  TrainReport Train(const std::vector<LengthExample>& examples);
  // One online SGD step on one completed request; `weight` scales the step.
  void Update(std::span<const int32_t> prompt, int64_t output_len, float weight);

  const LengthPredictorConfig& config() const { return config_; }
  LengthPredictorConfig& mutable_config() { return config_; }
  // Identifies the tokenizer the token ids come from (TokenizerFingerprint); empty: unchecked.
  const std::string& tokenizer_fingerprint() const { return tokenizer_fingerprint_; }
  void set_tokenizer_fingerprint(std::string fp) { tokenizer_fingerprint_ = std::move(fp); }
  // Free-form provenance (dataset, split, accuracy) kept in the file's header.
  const std::string& description() const { return description_; }
  void set_description(std::string d) { description_ = std::move(d); }
  int64_t num_online_updates() const { return num_online_updates_; }
  int64_t num_feature_rows() const { return (int64_t{1} << config_.hash_bits) + kNumLengthBins; }
  // Raw parameters, [num_feature_rows()][num_buckets] and [num_buckets] (tests compare them).
  const std::vector<float>& weights() const { return weights_; }
  const std::vector<float>& bias() const { return bias_; }

 private:
  struct Feature {
    uint32_t row = 0;
    float value = 0;
  };
  // The prompt's sparse feature vector, sorted by row, duplicates merged.
  std::vector<Feature> Featurize(std::span<const int32_t> prompt) const;
  // Softmax over the buckets into `probs` (num_buckets entries).
  void Forward(const std::vector<Feature>& features, std::vector<float>& probs) const;
  LengthPrediction FromProbabilities(const std::vector<float>& probs) const;

  LengthPredictorConfig config_;
  std::vector<float> weights_;  // [2^hash_bits + num length bins][num_buckets]
  std::vector<float> bias_;     // [num_buckets]
  std::string tokenizer_fingerprint_;
  std::string description_;
  int64_t num_online_updates_ = 0;
};

// Accuracy figures on a labelled set.
struct LengthEvaluation {
  int64_t examples = 0;
  double accuracy = 0;                 // predicted bucket == true bucket
  double mean_miss_distance = 0;       // |predicted - true| in buckets, over the misses
  double majority_accuracy = 0;        // always predicting the most common true bucket
  int64_t under_predictions = 0;       // predicted bucket below the true one (the supervisor repairs these)
  int64_t over_predictions = 0;
  std::vector<std::vector<int64_t>> confusion;  // [true bucket][predicted bucket]
  double mean_predict_us = 0;          // per prompt, on this CPU
};
LengthEvaluation Evaluate(const LengthPredictor& predictor, const std::vector<LengthExample>& examples);
// Prequential ("test, then train") figures, as S3's supervisor learns online: each example, in order,
// is predicted and then learnt from in one Update weighted by the predictor's online weights (a
// mispredicted one more). Leaves `predictor` updated; mean_predict_us counts prediction and update.
LengthEvaluation EvaluateOnline(LengthPredictor& predictor, const std::vector<LengthExample>& examples);
// The scores of predicted against true output lengths (same order); mean_predict_us is left to the
// caller. Shared by the n-gram predictor's and the hidden-state probe's evaluations.
LengthEvaluation ScoreBucketPredictions(const LengthBuckets& buckets, std::span<const int> predicted,
                                        std::span<const int64_t> output_lens);

// Fisher-Yates with `rng`: the same order on every standard library (std::shuffle's is
// unspecified), so training and the tool's splits are reproducible anywhere.
void ReproducibleShuffle(std::vector<size_t>& v, std::mt19937_64& rng);

// A short stable string identifying a tokenizer's vocabulary.
std::string TokenizerFingerprint(const Tokenizer& tokenizer);

}  // namespace kvflow
