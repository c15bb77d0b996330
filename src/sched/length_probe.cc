#include "sched/length_probe.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "util/checksummed_file.h"
#include "util/hash.h"

namespace kvflow {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kMagic = "KVFLOWLH";
// Names the input: a file made for another input must not load.
constexpr const char* kInputScheme = "final-norm hidden state of the last prompt token, standardized/v1";
// A dimension that never varies in training is centred, not scaled up.
constexpr float kMinStd = 1e-6f;
constexpr double kAdamBeta1 = 0.9, kAdamBeta2 = 0.999, kAdamEps = 1e-8;

void AppendFloats(std::string& out, const std::vector<float>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// A uniform double in [0, 1) from the top 53 bits: the same on every standard library
// (std::uniform_real_distribution's and std::normal_distribution's outputs are not).
double Uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

double StandardNormal(std::mt19937_64& rng) {
  const double u1 = 1.0 - Uniform01(rng);  // (0, 1]: log is finite
  const double u2 = Uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

Status LengthProbeConfig::Validate() const {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("length probe: " + what); };
  using P = LengthPredictorConfig;
  if (buckets.num_buckets < P::kMinBuckets || buckets.num_buckets > P::kMaxBuckets) {
    return bad("num_buckets " + std::to_string(buckets.num_buckets) + " is outside [" +
               std::to_string(P::kMinBuckets) + ", " + std::to_string(P::kMaxBuckets) + "]");
  }
  if (buckets.max_output_len < 1 || buckets.max_output_len > P::kMaxOutputLen) {
    return bad("max_output_len " + std::to_string(buckets.max_output_len) + " is outside [1, 2^30]");
  }
  if (hidden_size < 1 || hidden_size > kMaxHiddenSize) {
    return bad("hidden_size " + std::to_string(hidden_size) + " is outside [1, " + std::to_string(kMaxHiddenSize) +
               "]");
  }
  if (hidden_units < 0 || hidden_units > kMaxHiddenUnits) {
    return bad("hidden_units " + std::to_string(hidden_units) + " is outside [0, " +
               std::to_string(kMaxHiddenUnits) + "]");
  }
  if (epochs < 0) return bad("epochs must be >= 0");
  if (batch_size < 1) return bad("batch_size must be >= 1");
  for (auto [name, v] : {std::pair{"learning_rate", learning_rate}, std::pair{"l2", l2},
                         std::pair{"online_learning_rate", online_learning_rate}}) {
    if (!std::isfinite(v) || v < 0) return bad(std::string(name) + " must be finite and >= 0");
  }
  return Status::Ok();
}

LengthProbe::LengthProbe(const LengthProbeConfig& config) : config_(config) {
  const int64_t H = std::clamp<int64_t>(config_.hidden_size, 1, LengthProbeConfig::kMaxHiddenSize);
  const int64_t U = std::clamp(config_.hidden_units, 0, LengthProbeConfig::kMaxHiddenUnits);
  const int64_t K = std::clamp(config_.buckets.num_buckets, LengthPredictorConfig::kMinBuckets,
                               LengthPredictorConfig::kMaxBuckets);
  config_.hidden_size = H;
  config_.hidden_units = static_cast<int>(U);
  config_.buckets.num_buckets = static_cast<int>(K);
  mean_.assign(H, 0.0f);
  inv_std_.assign(H, 1.0f);
  auto dense = [](int64_t in, int64_t out) {
    Dense d;
    d.in = in;
    d.out = out;
    d.w.assign(static_cast<size_t>(in * out), 0.0f);
    d.b.assign(static_cast<size_t>(out), 0.0f);
    return d;
  };
  if (U == 0) {
    layers_.push_back(dense(H, K));
    return;
  }
  // He initialisation for the ReLU layer, Glorot-sized for the softmax layer, both seeded.
  layers_.push_back(dense(H, U));
  layers_.push_back(dense(U, K));
  std::mt19937_64 rng(SplitMix64(config_.seed ^ 0x6c656e70726f6265ULL));  // "lenprobe"
  for (Dense& d : layers_) {
    const double scale = &d == &layers_.front() ? std::sqrt(2.0 / static_cast<double>(d.in))
                                                : std::sqrt(1.0 / static_cast<double>(d.in));
    for (float& w : d.w) w = static_cast<float>(scale * StandardNormal(rng));
  }
}

int64_t LengthProbe::num_parameters() const {
  int64_t n = 0;
  for (const Dense& d : layers_) n += static_cast<int64_t>(d.w.size() + d.b.size());
  return n;
}

Status LengthProbe::CheckModel(const std::string& model_fingerprint, int64_t hidden_size) const {
  if (hidden_size != config_.hidden_size) {
    return Status::InvalidArgument("length probe reads hidden states of width " + std::to_string(config_.hidden_size) +
                                   ", this model's are " + std::to_string(hidden_size));
  }
  if (!model_fingerprint_.empty() && model_fingerprint_ != model_fingerprint) {
    return Status::InvalidArgument("length probe was trained on another model's hidden states (" + model_fingerprint_ +
                                   ", this model is " + model_fingerprint + ")");
  }
  return Status::Ok();
}

// ---- model ------------------------------------------------------------------------------------

void LengthProbe::Forward(std::span<const float> hidden, Pass& pass) const {
  const int64_t H = config_.hidden_size;
  pass.x.resize(H);
  for (int64_t i = 0; i < H; ++i) pass.x[i] = (hidden[i] - mean_[i]) * inv_std_[i];
  const std::vector<float>* in = &pass.x;
  if (layers_.size() == 2) {
    const Dense& d = layers_[0];
    pass.h.assign(d.b.begin(), d.b.end());
    for (int64_t i = 0; i < d.in; ++i) {
      const float xi = pass.x[i];
      if (xi == 0.0f) continue;
      const float* w = &d.w[static_cast<size_t>(i * d.out)];
      for (int64_t j = 0; j < d.out; ++j) pass.h[j] += xi * w[j];
    }
    for (float& v : pass.h) v = std::max(v, 0.0f);
    in = &pass.h;
  }
  const Dense& o = layers_.back();
  pass.logits.assign(o.b.begin(), o.b.end());
  for (int64_t i = 0; i < o.in; ++i) {
    const double xi = (*in)[i];
    if (xi == 0.0) continue;
    const float* w = &o.w[static_cast<size_t>(i * o.out)];
    for (int64_t j = 0; j < o.out; ++j) pass.logits[j] += xi * w[j];
  }
  const double max_logit = *std::max_element(pass.logits.begin(), pass.logits.end());
  double sum = 0;
  for (double l : pass.logits) sum += std::exp(l - max_logit);
  pass.probs.resize(o.out);
  for (int64_t j = 0; j < o.out; ++j) pass.probs[j] = static_cast<float>(std::exp(pass.logits[j] - max_logit) / sum);
}

void LengthProbe::Backward(const Pass& pass, int label, float weight, std::vector<Dense>& grads) const {
  const Dense& o = layers_.back();
  Dense& go = grads.back();
  std::vector<float> dlogits(o.out);
  for (int64_t j = 0; j < o.out; ++j) dlogits[j] = weight * (pass.probs[j] - (j == label ? 1.0f : 0.0f));
  const std::vector<float>& in = layers_.size() == 2 ? pass.h : pass.x;
  for (int64_t i = 0; i < o.in; ++i) {
    const float xi = in[i];
    if (xi == 0.0f) continue;
    float* g = &go.w[static_cast<size_t>(i * o.out)];
    for (int64_t j = 0; j < o.out; ++j) g[j] += xi * dlogits[j];
  }
  for (int64_t j = 0; j < o.out; ++j) go.b[j] += dlogits[j];
  if (layers_.size() == 1) return;
  // Through the ReLU into the first layer.
  const Dense& d = layers_[0];
  Dense& gd = grads[0];
  std::vector<float> dh(d.out, 0.0f);
  for (int64_t u = 0; u < d.out; ++u) {
    if (pass.h[u] <= 0.0f) continue;
    const float* w = &o.w[static_cast<size_t>(u * o.out)];
    float s = 0;
    for (int64_t j = 0; j < o.out; ++j) s += w[j] * dlogits[j];
    dh[u] = s;
  }
  for (int64_t i = 0; i < d.in; ++i) {
    const float xi = pass.x[i];
    if (xi == 0.0f) continue;
    float* g = &gd.w[static_cast<size_t>(i * d.out)];
    for (int64_t u = 0; u < d.out; ++u) g[u] += xi * dh[u];
  }
  for (int64_t u = 0; u < d.out; ++u) gd.b[u] += dh[u];
}

LengthPrediction LengthProbe::FromProbabilities(const std::vector<float>& probs) const {
  LengthPrediction p;
  p.bucket = static_cast<int>(std::max_element(probs.begin(), probs.end()) - probs.begin());
  p.probability = probs[p.bucket];
  const LengthBuckets& b = config_.buckets;
  p.reserve_len = config_.reservation_point == ReservationPoint::kUpper ? b.UpperEdge(p.bucket)
                                                                        : b.LowerEdge(p.bucket) + b.width() / 2;
  return p;
}

std::vector<float> LengthProbe::Probabilities(std::span<const float> hidden) const {
  if (static_cast<int64_t>(hidden.size()) != config_.hidden_size) {
    return std::vector<float>(config_.buckets.num_buckets, 1.0f / static_cast<float>(config_.buckets.num_buckets));
  }
  Pass pass;
  Forward(hidden, pass);
  return pass.probs;
}

LengthPrediction LengthProbe::Predict(std::span<const float> hidden) const {
  return FromProbabilities(Probabilities(hidden));
}

TrainReport LengthProbe::Train(const std::vector<ProbeExample>& all) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t H = config_.hidden_size;
  std::vector<const ProbeExample*> examples;
  for (const ProbeExample& e : all) {
    if (static_cast<int64_t>(e.hidden.size()) == H && e.weight > 0 && std::isfinite(e.weight)) examples.push_back(&e);
  }
  TrainReport report;
  report.epochs = config_.epochs;
  report.examples = static_cast<int64_t>(examples.size());
  if (examples.empty()) return report;

  // Standardization from the training set, in double so the order of the sums does not matter much.
  std::vector<double> sum(H, 0.0), sum_sq(H, 0.0);
  for (const ProbeExample* e : examples) {
    for (int64_t i = 0; i < H; ++i) {
      sum[i] += e->hidden[i];
      sum_sq[i] += static_cast<double>(e->hidden[i]) * e->hidden[i];
    }
  }
  const double n = static_cast<double>(examples.size());
  for (int64_t i = 0; i < H; ++i) {
    const double mean = sum[i] / n;
    const double var = std::max(0.0, sum_sq[i] / n - mean * mean);
    mean_[i] = static_cast<float>(mean);
    inv_std_[i] = 1.0f / std::max(static_cast<float>(std::sqrt(var)), kMinStd);
  }

  std::vector<Dense> grads = layers_, m = layers_, v = layers_;
  auto zero = [](std::vector<Dense>& ds) {
    for (Dense& d : ds) {
      std::fill(d.w.begin(), d.w.end(), 0.0f);
      std::fill(d.b.begin(), d.b.end(), 0.0f);
    }
  };
  zero(m);
  zero(v);
  std::vector<size_t> order(examples.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 rng(config_.seed);
  Pass pass;
  int64_t step = 0;
  const double lr = config_.learning_rate, l2 = config_.l2;
  for (int epoch = 0; epoch < config_.epochs; ++epoch) {
    ReproducibleShuffle(order, rng);
    double loss = 0, total_weight = 0;
    for (size_t begin = 0; begin < order.size(); begin += static_cast<size_t>(config_.batch_size)) {
      const size_t end = std::min(order.size(), begin + static_cast<size_t>(config_.batch_size));
      zero(grads);
      double batch_weight = 0;
      for (size_t k = begin; k < end; ++k) {
        const ProbeExample& e = *examples[order[k]];
        Forward(e.hidden, pass);
        const int label = config_.buckets.BucketOf(e.output_len);
        loss += -e.weight * std::log(std::max(pass.probs[label], 1e-30f));
        total_weight += e.weight;
        batch_weight += e.weight;
        Backward(pass, label, e.weight, grads);
      }
      // Adam on the batch's mean gradient plus L2 on the weights.
      ++step;
      const double c1 = 1.0 - std::pow(kAdamBeta1, static_cast<double>(step));
      const double c2 = 1.0 - std::pow(kAdamBeta2, static_cast<double>(step));
      const double inv_batch = 1.0 / batch_weight;
      for (size_t l = 0; l < layers_.size(); ++l) {
        auto adam = [&](std::vector<float>& p, const std::vector<float>& g, std::vector<float>& mm,
                        std::vector<float>& vv, double decay) {
          for (size_t i = 0; i < p.size(); ++i) {
            const double gi = g[i] * inv_batch + decay * p[i];
            mm[i] = static_cast<float>(kAdamBeta1 * mm[i] + (1 - kAdamBeta1) * gi);
            vv[i] = static_cast<float>(kAdamBeta2 * vv[i] + (1 - kAdamBeta2) * gi * gi);
            p[i] -= static_cast<float>(lr * (mm[i] / c1) / (std::sqrt(vv[i] / c2) + kAdamEps));
          }
        };
        adam(layers_[l].w, grads[l].w, m[l].w, v[l].w, l2);
        adam(layers_[l].b, grads[l].b, m[l].b, v[l].b, 0.0);
      }
    }
    report.epoch_loss.push_back(total_weight > 0 ? loss / total_weight : 0.0);
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

void LengthProbe::Update(std::span<const float> hidden, int64_t output_len, float weight) {
  if (!(weight > 0) || !std::isfinite(weight) || static_cast<int64_t>(hidden.size()) != config_.hidden_size) return;
  Pass pass;
  Forward(hidden, pass);
  std::vector<Dense> grads = layers_;
  for (Dense& d : grads) {
    std::fill(d.w.begin(), d.w.end(), 0.0f);
    std::fill(d.b.begin(), d.b.end(), 0.0f);
  }
  Backward(pass, config_.buckets.BucketOf(output_len), weight, grads);
  const float step = config_.online_learning_rate;
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (size_t i = 0; i < layers_[l].w.size(); ++i) layers_[l].w[i] -= step * grads[l].w[i];
    for (size_t i = 0; i < layers_[l].b.size(); ++i) layers_[l].b[i] -= step * grads[l].b[i];
  }
  ++num_online_updates_;
}

// ---- file -------------------------------------------------------------------------------------

Status LengthProbe::Save(const std::string& path) const {
  const LengthProbeConfig& c = config_;
  std::vector<float> stddev(inv_std_.size());
  for (size_t i = 0; i < stddev.size(); ++i) stddev[i] = 1.0f / inv_std_[i];
  Json header = {
      {"format", "kvflow length probe"},
      {"input", kInputScheme},
      {"max_output_len", c.buckets.max_output_len},
      {"num_buckets", c.buckets.num_buckets},
      {"hidden_size", c.hidden_size},
      {"hidden_units", c.hidden_units},
      {"activation", "relu"},
      {"reservation_point", ReservationPointName(c.reservation_point)},
      {"training",
       {{"seed", c.seed},
        {"epochs", c.epochs},
        {"batch_size", c.batch_size},
        {"learning_rate", c.learning_rate},
        {"l2", c.l2},
        {"optimizer", "adam"}}},
      {"online", {{"learning_rate", c.online_learning_rate}, {"num_updates", num_online_updates_}}},
      {"model_fingerprint", model_fingerprint_},
      {"description", description_},
      {"num_parameters", num_parameters()},
  };
  std::string payload;
  AppendFloats(payload, mean_);
  AppendFloats(payload, stddev);
  for (const Dense& d : layers_) {
    AppendFloats(payload, d.w);
    AppendFloats(payload, d.b);
  }
  return WriteFileAtomically(path, PackChecksummedFile(kMagic, kFormatVersion, header.dump(), payload));
}

Result<LengthProbe> LengthProbe::Load(const std::string& path) {
  auto corrupt = [&](const std::string& why) { return Status::CorruptFile(path + ": " + why); };
  using C = LengthProbeConfig;
  const uint64_t max_params = 2 * C::kMaxHiddenSize + (C::kMaxHiddenSize + 1) * C::kMaxHiddenUnits +
                              (C::kMaxHiddenUnits + 1) * static_cast<uint64_t>(LengthPredictorConfig::kMaxBuckets);
  KVFLOW_ASSIGN_OR_RETURN(const ChecksummedFile file,
                          ReadChecksummedFile(path, kMagic, kFormatVersion, sizeof(float) * max_params, "length probe"));

  LengthProbeConfig config;
  std::string fingerprint, description;
  int64_t num_updates = 0;
  uint64_t num_params = 0;
  try {
    const Json h = Json::parse(file.header());
    if (!h.is_object()) return corrupt("header is not a JSON object");
    if (h.value("input", "") != kInputScheme) {
      return corrupt("input '" + h.value("input", "") + "', this build reads '" + kInputScheme + "'");
    }
    if (h.value("activation", "") != "relu") return corrupt("unknown activation");
    config.buckets.max_output_len = h.at("max_output_len").get<int64_t>();
    config.buckets.num_buckets = h.at("num_buckets").get<int>();
    config.hidden_size = h.at("hidden_size").get<int64_t>();
    config.hidden_units = h.at("hidden_units").get<int>();
    auto point = ParseReservationPoint(h.at("reservation_point").get<std::string>());
    if (!point.ok()) return corrupt(point.status().message());
    config.reservation_point = point.value();
    const Json& t = h.at("training");
    config.seed = t.at("seed").get<uint64_t>();
    config.epochs = t.at("epochs").get<int>();
    config.batch_size = t.at("batch_size").get<int>();
    config.learning_rate = t.at("learning_rate").get<float>();
    config.l2 = t.at("l2").get<float>();
    const Json& o = h.at("online");
    config.online_learning_rate = o.at("learning_rate").get<float>();
    num_updates = o.at("num_updates").get<int64_t>();
    fingerprint = h.at("model_fingerprint").get<std::string>();
    description = h.at("description").get<std::string>();
    num_params = h.at("num_parameters").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {
    return corrupt(std::string("bad header: ") + e.what());
  }
  if (Status st = config.Validate(); !st.ok()) return corrupt(st.message());

  // The header's sizes must agree with each other and with the bytes present before anything is
  // allocated from them.
  const uint64_t H = static_cast<uint64_t>(config.hidden_size), U = static_cast<uint64_t>(config.hidden_units);
  const uint64_t K = static_cast<uint64_t>(config.buckets.num_buckets);
  const uint64_t expected_params = U == 0 ? (H + 1) * K : (H + 1) * U + (U + 1) * K;
  if (num_params != expected_params) {
    return corrupt("parameter count " + std::to_string(num_params) + " does not match hidden size " +
                   std::to_string(H) + ", " + std::to_string(U) + " hidden units and " + std::to_string(K) +
                   " buckets");
  }
  if ((2 * H + num_params) * sizeof(float) != file.payload_len) {
    return corrupt("file size " + std::to_string(file.bytes.size()) + " does not match the header's parameter count");
  }

  LengthProbe probe(config);
  const char* p = file.payload();
  auto read = [&p](std::vector<float>& v) {
    std::memcpy(v.data(), p, v.size() * sizeof(float));
    p += v.size() * sizeof(float);
  };
  std::vector<float> stddev(H);
  read(probe.mean_);
  read(stddev);
  for (Dense& d : probe.layers_) {
    read(d.w);
    read(d.b);
  }
  for (size_t i = 0; i < H; ++i) {
    if (!std::isfinite(probe.mean_[i]) || !std::isfinite(stddev[i]) || !(stddev[i] > 0)) {
      return corrupt("bad standardization (non-finite mean or non-positive deviation)");
    }
    probe.inv_std_[i] = 1.0f / stddev[i];
  }
  for (const Dense& d : probe.layers_) {
    for (const auto* v : {&d.w, &d.b}) {
      for (float x : *v) {
        if (!std::isfinite(x)) return corrupt("non-finite weight");
      }
    }
  }
  probe.model_fingerprint_ = std::move(fingerprint);
  probe.description_ = std::move(description);
  probe.num_online_updates_ = num_updates;
  return probe;
}

// ---- evaluation -------------------------------------------------------------------------------

LengthEvaluation EvaluateProbe(const LengthProbe& probe, const std::vector<ProbeExample>& examples) {
  std::vector<int> predicted(examples.size());
  std::vector<int64_t> lens(examples.size());
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < examples.size(); ++i) predicted[i] = probe.Predict(examples[i].hidden).bucket;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t i = 0; i < examples.size(); ++i) lens[i] = examples[i].output_len;
  LengthEvaluation ev = ScoreBucketPredictions(probe.config().buckets, predicted, lens);
  if (!examples.empty()) ev.mean_predict_us = seconds * 1e6 / static_cast<double>(examples.size());
  return ev;
}

LengthEvaluation EvaluateProbeOnline(LengthProbe& probe, const std::vector<ProbeExample>& examples,
                                     float weight_correct, float weight_mispredicted) {
  const LengthBuckets& buckets = probe.config().buckets;
  std::vector<int> predicted(examples.size());
  std::vector<int64_t> lens(examples.size());
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < examples.size(); ++i) {
    predicted[i] = probe.Predict(examples[i].hidden).bucket;
    lens[i] = examples[i].output_len;
    const bool missed = predicted[i] != buckets.BucketOf(lens[i]);
    probe.Update(examples[i].hidden, lens[i], missed ? weight_mispredicted : weight_correct);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LengthEvaluation ev = ScoreBucketPredictions(buckets, predicted, lens);
  if (!examples.empty()) ev.mean_predict_us = seconds * 1e6 / static_cast<double>(examples.size());
  return ev;
}

}  // namespace kvflow
