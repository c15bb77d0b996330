#include "sched/length_predictor.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "kvflow/tokenizer.h"
#include "util/checksummed_file.h"
#include "util/hash.h"

namespace kvflow {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kMagic = "KVFLOWLP";
// Names the feature map; a file whose features were hashed differently must not load.
constexpr const char* kFeatureScheme = "token-1gram+2gram/splitmix64/l2+log2-prompt-len/v1";
// Distinct salts keep a unigram and a bigram from sharing a slot systematically.
constexpr uint64_t kUnigramSalt = 0x6c70756e69677261ULL;  // "lpunigra"
constexpr uint64_t kBigramSalt = 0x6c70626967726d73ULL;   // "lpbigrms"
// AdaGrad: a start value for the squared-gradient sums keeps the first steps from being lr * sign(g).
constexpr float kAdaGradInitialAccumulator = 0.1f;

// FNV-1a: the tokenizer fingerprint; fixed so files stay comparable.
struct Fnv1a64 {
  uint64_t h = 0xcbf29ce484222325ULL;
  void Add(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  uint64_t Final() const { return SplitMix64(h); }
};

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int LengthBin(size_t prompt_len) {
  const int bin = std::bit_width(static_cast<uint64_t>(prompt_len) + 1) - 1;  // floor(log2(len + 1))
  return std::min(bin, LengthPredictor::kNumLengthBins - 1);
}


LengthPredictorConfig Clamped(LengthPredictorConfig c) {
  using C = LengthPredictorConfig;
  c.hash_bits = std::clamp(c.hash_bits, C::kMinHashBits, C::kMaxHashBits);
  c.buckets.num_buckets = std::clamp(c.buckets.num_buckets, C::kMinBuckets, C::kMaxBuckets);
  c.buckets.max_output_len = std::clamp<int64_t>(c.buckets.max_output_len, 1, C::kMaxOutputLen);
  return c;
}

}  // namespace

void ReproducibleShuffle(std::vector<size_t>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng() % i);
    std::swap(v[i - 1], v[j]);
  }
}

// ---- buckets and config -----------------------------------------------------------------------

int LengthBuckets::BucketOf(int64_t output_len) const {
  if (output_len <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(output_len / width(), num_buckets - 1));
}

Result<ReservationPoint> ParseReservationPoint(std::string_view name) {
  if (name == "upper") return ReservationPoint::kUpper;
  if (name == "middle") return ReservationPoint::kMiddle;
  return Status::InvalidArgument("unknown reservation point '" + std::string(name) + "' (upper or middle)");
}

const char* ReservationPointName(ReservationPoint point) {
  return point == ReservationPoint::kUpper ? "upper" : "middle";
}

Status LengthPredictorConfig::Validate() const {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("length predictor: " + what); };
  if (hash_bits < kMinHashBits || hash_bits > kMaxHashBits) {
    return bad("hash_bits " + std::to_string(hash_bits) + " is outside [" + std::to_string(kMinHashBits) + ", " +
               std::to_string(kMaxHashBits) + "]");
  }
  if (buckets.num_buckets < kMinBuckets || buckets.num_buckets > kMaxBuckets) {
    return bad("num_buckets " + std::to_string(buckets.num_buckets) + " is outside [" + std::to_string(kMinBuckets) +
               ", " + std::to_string(kMaxBuckets) + "]");
  }
  if (buckets.max_output_len < 1 || buckets.max_output_len > kMaxOutputLen) {
    return bad("max_output_len " + std::to_string(buckets.max_output_len) + " is outside [1, 2^30]");
  }
  if (epochs < 0) return bad("epochs must be >= 0");
  for (auto [name, v] : {std::pair{"learning_rate", learning_rate}, std::pair{"l2", l2},
                         std::pair{"online_learning_rate", online_learning_rate},
                         std::pair{"online_weight_correct", online_weight_correct},
                         std::pair{"online_weight_mispredicted", online_weight_mispredicted}}) {
    if (!std::isfinite(v) || v < 0) return bad(std::string(name) + " must be finite and >= 0");
  }
  return Status::Ok();
}

// ---- model ------------------------------------------------------------------------------------

LengthPredictor::LengthPredictor(const LengthPredictorConfig& config) : config_(Clamped(config)) {
  const size_t k = static_cast<size_t>(config_.buckets.num_buckets);
  weights_.assign(static_cast<size_t>(num_feature_rows()) * k, 0.0f);
  bias_.assign(k, 0.0f);
}

std::vector<LengthPredictor::Feature> LengthPredictor::Featurize(std::span<const int32_t> prompt) const {
  const uint64_t mask = (uint64_t{1} << config_.hash_bits) - 1;
  std::vector<Feature> f;
  f.reserve(prompt.size() * 2 + 1);
  for (size_t i = 0; i < prompt.size(); ++i) {
    const uint64_t cur = static_cast<uint32_t>(prompt[i]);
    f.push_back({static_cast<uint32_t>(SplitMix64(kUnigramSalt ^ cur) & mask), 1.0f});
    if (i > 0) {
      const uint64_t prev = static_cast<uint32_t>(prompt[i - 1]);
      f.push_back({static_cast<uint32_t>(SplitMix64(kBigramSalt ^ ((prev << 32) | cur)) & mask), 1.0f});
    }
  }
  std::sort(f.begin(), f.end(), [](const Feature& a, const Feature& b) { return a.row < b.row; });
  size_t out = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (out > 0 && f[out - 1].row == f[i].row) {
      f[out - 1].value += f[i].value;
    } else {
      f[out++] = f[i];
    }
  }
  f.resize(out);
  double norm2 = 0;
  for (const Feature& x : f) norm2 += static_cast<double>(x.value) * x.value;
  if (norm2 > 0) {
    const float inv = static_cast<float>(1.0 / std::sqrt(norm2));
    for (Feature& x : f) x.value *= inv;
  }
  // The length block lies after every hash slot, so it stays last and the vector stays sorted.
  f.push_back({static_cast<uint32_t>((uint64_t{1} << config_.hash_bits) + LengthBin(prompt.size())), 1.0f});
  return f;
}

void LengthPredictor::Forward(const std::vector<Feature>& features, std::vector<float>& probs) const {
  const int k = config_.buckets.num_buckets;
  std::vector<double> logits(bias_.begin(), bias_.end());
  for (const Feature& x : features) {
    const float* w = &weights_[static_cast<size_t>(x.row) * k];
    for (int b = 0; b < k; ++b) logits[b] += static_cast<double>(x.value) * w[b];
  }
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double& l : logits) sum += (l = std::exp(l - max_logit));
  probs.resize(k);
  for (int b = 0; b < k; ++b) probs[b] = static_cast<float>(logits[b] / sum);
}

LengthPrediction LengthPredictor::FromProbabilities(const std::vector<float>& probs) const {
  LengthPrediction p;
  // max_element takes the first of equal maxima: an untrained predictor says bucket 0.
  p.bucket = static_cast<int>(std::max_element(probs.begin(), probs.end()) - probs.begin());
  p.probability = probs[p.bucket];
  const LengthBuckets& b = config_.buckets;
  p.reserve_len = config_.reservation_point == ReservationPoint::kUpper ? b.UpperEdge(p.bucket)
                                                                        : b.LowerEdge(p.bucket) + b.width() / 2;
  return p;
}

std::vector<float> LengthPredictor::Probabilities(std::span<const int32_t> prompt) const {
  std::vector<float> probs;
  Forward(Featurize(prompt), probs);
  return probs;
}

LengthPrediction LengthPredictor::Predict(std::span<const int32_t> prompt) const {
  return FromProbabilities(Probabilities(prompt));
}

TrainReport LengthPredictor::Train(const std::vector<LengthExample>& examples) {
  const auto start = std::chrono::steady_clock::now();
  const int k = config_.buckets.num_buckets;
  TrainReport report;
  report.epochs = config_.epochs;
  report.examples = static_cast<int64_t>(examples.size());

  std::vector<std::vector<Feature>> features;
  std::vector<int> labels;
  features.reserve(examples.size());
  for (const LengthExample& e : examples) {
    features.push_back(Featurize(e.prompt));
    labels.push_back(config_.buckets.BucketOf(e.output_len));
  }
  std::vector<float> grad_sq_w(weights_.size(), kAdaGradInitialAccumulator);
  std::vector<float> grad_sq_b(bias_.size(), kAdaGradInitialAccumulator);
  std::vector<size_t> order(examples.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937_64 rng(config_.seed);
  std::vector<float> probs;
  std::vector<float> grad(k);
  const float lr = config_.learning_rate;
  const float l2 = config_.l2;

  for (int epoch = 0; epoch < config_.epochs; ++epoch) {
    ReproducibleShuffle(order, rng);
    double loss = 0, total_weight = 0;
    for (size_t idx : order) {
      const float weight = examples[idx].weight;
      if (!(weight > 0)) continue;
      Forward(features[idx], probs);
      const int label = labels[idx];
      loss += -weight * std::log(std::max(probs[label], 1e-30f));
      total_weight += weight;
      for (int b = 0; b < k; ++b) grad[b] = weight * (probs[b] - (b == label ? 1.0f : 0.0f));
      // Lazy L2: only the rows this example touches decay, so a step costs O(features x buckets).
      for (const Feature& x : features[idx]) {
        float* w = &weights_[static_cast<size_t>(x.row) * k];
        float* g2 = &grad_sq_w[static_cast<size_t>(x.row) * k];
        for (int b = 0; b < k; ++b) {
          const float g = x.value * grad[b] + l2 * w[b];
          g2[b] += g * g;
          w[b] -= lr * g / std::sqrt(g2[b]);
        }
      }
      for (int b = 0; b < k; ++b) {
        grad_sq_b[b] += grad[b] * grad[b];
        bias_[b] -= lr * grad[b] / std::sqrt(grad_sq_b[b]);
      }
    }
    report.epoch_loss.push_back(total_weight > 0 ? loss / total_weight : 0.0);
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

void LengthPredictor::Update(std::span<const int32_t> prompt, int64_t output_len, float weight) {
  if (!(weight > 0) || !std::isfinite(weight)) return;
  const int k = config_.buckets.num_buckets;
  const std::vector<Feature> features = Featurize(prompt);
  std::vector<float> probs;
  Forward(features, probs);
  const int label = config_.buckets.BucketOf(output_len);
  const float step = config_.online_learning_rate * weight;
  for (const Feature& x : features) {
    float* w = &weights_[static_cast<size_t>(x.row) * k];
    for (int b = 0; b < k; ++b) w[b] -= step * x.value * (probs[b] - (b == label ? 1.0f : 0.0f));
  }
  for (int b = 0; b < k; ++b) bias_[b] -= step * (probs[b] - (b == label ? 1.0f : 0.0f));
  ++num_online_updates_;
}

// ---- file -------------------------------------------------------------------------------------

Status LengthPredictor::Save(const std::string& path) const {
  const LengthPredictorConfig& c = config_;
  Json header = {
      {"format", "kvflow length predictor"},
      {"features", kFeatureScheme},
      {"max_output_len", c.buckets.max_output_len},
      {"num_buckets", c.buckets.num_buckets},
      {"hash_bits", c.hash_bits},
      {"length_bins", kNumLengthBins},
      {"reservation_point", ReservationPointName(c.reservation_point)},
      {"training", {{"seed", c.seed}, {"epochs", c.epochs}, {"learning_rate", c.learning_rate}, {"l2", c.l2}}},
      {"online",
       {{"learning_rate", c.online_learning_rate},
        {"weight_correct", c.online_weight_correct},
        {"weight_mispredicted", c.online_weight_mispredicted},
        {"num_updates", num_online_updates_}}},
      {"tokenizer_fingerprint", tokenizer_fingerprint_},
      {"description", description_},
      {"num_weights", weights_.size()},
      {"num_bias", bias_.size()},
  };
  std::string payload(reinterpret_cast<const char*>(weights_.data()), weights_.size() * sizeof(float));
  payload.append(reinterpret_cast<const char*>(bias_.data()), bias_.size() * sizeof(float));
  return WriteFileAtomically(path, PackChecksummedFile(kMagic, kFormatVersion, header.dump(), payload));
}

Result<LengthPredictor> LengthPredictor::Load(const std::string& path) {
  auto corrupt = [&](const std::string& why) { return Status::CorruptFile(path + ": " + why); };
  using C = LengthPredictorConfig;
  const uint64_t max_payload = sizeof(float) * ((uint64_t{1} << C::kMaxHashBits) + kNumLengthBins + 1) *
                               static_cast<uint64_t>(C::kMaxBuckets);
  KVFLOW_ASSIGN_OR_RETURN(const ChecksummedFile file,
                          ReadChecksummedFile(path, kMagic, kFormatVersion, max_payload, "length predictor"));

  LengthPredictorConfig config;
  std::string fingerprint, description;
  int64_t num_updates = 0;
  uint64_t num_weights = 0, num_bias = 0;
  try {
    const Json h = Json::parse(file.header());
    if (!h.is_object()) return corrupt("header is not a JSON object");
    if (h.value("features", "") != kFeatureScheme) {
      return corrupt("feature scheme '" + h.value("features", "") + "', this build computes '" + kFeatureScheme + "'");
    }
    config.buckets.max_output_len = h.at("max_output_len").get<int64_t>();
    config.buckets.num_buckets = h.at("num_buckets").get<int>();
    config.hash_bits = h.at("hash_bits").get<int>();
    if (h.at("length_bins").get<int>() != kNumLengthBins) return corrupt("unexpected number of length bins");
    auto point = ParseReservationPoint(h.at("reservation_point").get<std::string>());
    if (!point.ok()) return corrupt(point.status().message());
    config.reservation_point = point.value();
    const Json& t = h.at("training");
    config.seed = t.at("seed").get<uint64_t>();
    config.epochs = t.at("epochs").get<int>();
    config.learning_rate = t.at("learning_rate").get<float>();
    config.l2 = t.at("l2").get<float>();
    const Json& o = h.at("online");
    config.online_learning_rate = o.at("learning_rate").get<float>();
    config.online_weight_correct = o.at("weight_correct").get<float>();
    config.online_weight_mispredicted = o.at("weight_mispredicted").get<float>();
    num_updates = o.at("num_updates").get<int64_t>();
    fingerprint = h.at("tokenizer_fingerprint").get<std::string>();
    description = h.at("description").get<std::string>();
    num_weights = h.at("num_weights").get<uint64_t>();
    num_bias = h.at("num_bias").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    return corrupt(std::string("bad header: ") + e.what());
  }
  if (Status st = config.Validate(); !st.ok()) return corrupt(st.message());

  // The header's sizes must agree with each other and with the bytes present before anything is
  // allocated from them.
  const uint64_t k = static_cast<uint64_t>(config.buckets.num_buckets);
  const uint64_t rows = (uint64_t{1} << config.hash_bits) + kNumLengthBins;
  if (num_weights != rows * k || num_bias != k) {
    return corrupt("weight counts " + std::to_string(num_weights) + " + " + std::to_string(num_bias) +
                   " do not match hash_bits " + std::to_string(config.hash_bits) + " and " + std::to_string(k) +
                   " buckets");
  }
  const uint64_t payload = (num_weights + num_bias) * sizeof(float);
  if (payload != file.payload_len) {
    return corrupt("file size " + std::to_string(file.bytes.size()) + " does not match the header's weight counts");
  }

  LengthPredictor predictor(config);
  const char* p = file.payload();
  std::memcpy(predictor.weights_.data(), p, num_weights * sizeof(float));
  std::memcpy(predictor.bias_.data(), p + num_weights * sizeof(float), num_bias * sizeof(float));
  for (const auto* v : {&predictor.weights_, &predictor.bias_}) {
    for (float x : *v) {
      if (!std::isfinite(x)) return corrupt("non-finite weight");
    }
  }
  predictor.tokenizer_fingerprint_ = std::move(fingerprint);
  predictor.description_ = std::move(description);
  predictor.num_online_updates_ = num_updates;
  return predictor;
}

// ---- evaluation -------------------------------------------------------------------------------

LengthEvaluation Evaluate(const LengthPredictor& predictor, const std::vector<LengthExample>& examples) {
  std::vector<int> predicted(examples.size());
  std::vector<int64_t> lens(examples.size());
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < examples.size(); ++i) predicted[i] = predictor.Predict(examples[i].prompt).bucket;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t i = 0; i < examples.size(); ++i) lens[i] = examples[i].output_len;
  LengthEvaluation ev = ScoreBucketPredictions(predictor.config().buckets, predicted, lens);
  if (!examples.empty()) ev.mean_predict_us = seconds * 1e6 / static_cast<double>(examples.size());
  return ev;
}

LengthEvaluation EvaluateOnline(LengthPredictor& predictor, const std::vector<LengthExample>& examples) {
  const LengthPredictorConfig& c = predictor.config();
  std::vector<int> predicted(examples.size());
  std::vector<int64_t> lens(examples.size());
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < examples.size(); ++i) {
    predicted[i] = predictor.Predict(examples[i].prompt).bucket;
    lens[i] = examples[i].output_len;
    const bool missed = predicted[i] != c.buckets.BucketOf(lens[i]);
    predictor.Update(examples[i].prompt, lens[i], missed ? c.online_weight_mispredicted : c.online_weight_correct);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LengthEvaluation ev = ScoreBucketPredictions(c.buckets, predicted, lens);
  if (!examples.empty()) ev.mean_predict_us = seconds * 1e6 / static_cast<double>(examples.size());
  return ev;
}

LengthEvaluation ScoreBucketPredictions(const LengthBuckets& buckets, std::span<const int> predicted,
                                        std::span<const int64_t> output_lens) {
  const int k = buckets.num_buckets;
  LengthEvaluation ev;
  ev.examples = static_cast<int64_t>(predicted.size());
  ev.confusion.assign(k, std::vector<int64_t>(k, 0));
  if (predicted.empty()) return ev;
  int64_t correct = 0, miss_distance = 0;
  std::vector<int64_t> true_counts(k, 0);
  for (size_t i = 0; i < predicted.size(); ++i) {
    const int truth = buckets.BucketOf(output_lens[i]);
    ++ev.confusion[truth][predicted[i]];
    ++true_counts[truth];
    if (predicted[i] == truth) {
      ++correct;
    } else {
      miss_distance += std::abs(predicted[i] - truth);
      (predicted[i] < truth ? ev.under_predictions : ev.over_predictions)++;
    }
  }
  const double n = static_cast<double>(predicted.size());
  ev.accuracy = static_cast<double>(correct) / n;
  const int64_t misses = ev.examples - correct;
  ev.mean_miss_distance = misses > 0 ? static_cast<double>(miss_distance) / static_cast<double>(misses) : 0.0;
  ev.majority_accuracy = static_cast<double>(*std::max_element(true_counts.begin(), true_counts.end())) / n;
  return ev;
}

std::string TokenizerFingerprint(const Tokenizer& tokenizer) {
  Fnv1a64 h;
  const int32_t vocab = tokenizer.vocab_size();
  for (int32_t i = 0; i < vocab; ++i) {
    const std::string& text = tokenizer.token_text(i);
    const uint64_t len = text.size();  // the length first: "ab"+"c" and "a"+"bc" differ
    h.Add(&len, sizeof(len));
    h.Add(text.data(), text.size());
  }
  return "vocab" + std::to_string(vocab) + "-" + Hex64(h.Final());
}

}  // namespace kvflow
