// S3's output-length probe: classifies a prompt's output length into the predictor's buckets
// (sched/length_predictor.h) from the served model's own hidden state of the prompt's last token,
// the final-norm output the LM head reads after the prefill (Backend::ReadFinalHidden). The
// engine computes that vector anyway, so the probe needs no second model: its cost is one small
// dense layer (or two) per request.
//
// Model: the hidden vector standardized per dimension (the training set's mean and standard
// deviation, stored in the file), then either multinomial logistic regression (hidden_units 0) or
// one ReLU layer of hidden_units units followed by the softmax layer. Trained offline by
// `kvflow-length-predictor train-probe` with Adam over seeded minibatches (bit-identical given the
// seed on every standard library: the shuffle and the initialisation draw from mt19937_64 through
// our own transforms); updated online by plain SGD steps.
//
// The probe reads one model's hidden space: the file records the model's fingerprint and hidden
// size, and CheckModel refuses another model's.
//
// File (little-endian): "KVFLOWLH", u32 version, u64 header length, the JSON header (buckets,
// hidden size, hidden units, reservation point, hyper-parameters, model fingerprint, description,
// parameter count), float32 mean [hidden], std [hidden], then per layer weights [in][out] and bias
// [out], and a u64 checksum of every byte before it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvflow/status.h"
#include "sched/length_predictor.h"

namespace kvflow {

struct LengthProbeConfig {
  // Limits Load enforces, so a corrupt header cannot ask for an absurd allocation.
  static constexpr int64_t kMaxHiddenSize = 1 << 16;
  static constexpr int kMaxHiddenUnits = 4096;

  LengthBuckets buckets;
  int64_t hidden_size = 0;  // the model's hidden size: the probe's input width
  int hidden_units = 0;     // 0: linear (logistic regression); else one ReLU layer this wide
  ReservationPoint reservation_point = ReservationPoint::kUpper;

  // Offline training: Adam over seeded minibatches; the seed also draws the initial weights.
  uint64_t seed = 0;
  int epochs = 60;
  int batch_size = 32;
  float learning_rate = 1e-3f;
  float l2 = 1e-3f;  // on the weights, not the biases

  // Online updates: plain SGD on one completed request.
  float online_learning_rate = 1e-3f;

  Status Validate() const;
};

// One labelled prompt: its last-token hidden state and the length the model generated.
struct ProbeExample {
  std::vector<float> hidden;
  int64_t output_len = 0;
  float weight = 1.0f;
};

// Predict and Probabilities only read the parameters: any number of threads may call them
// together, but not while Train or Update runs.
class LengthProbe {
 public:
  static constexpr uint32_t kFormatVersion = 1;

  // Identity standardization; zero weights for a linear probe (every bucket equally likely), small
  // seeded random ones for a hidden layer. The config must Validate.
  explicit LengthProbe(const LengthProbeConfig& config);

  // Reads a file written by Save. A truncated, corrupt or foreign file is a CorruptFile error.
  static Result<LengthProbe> Load(const std::string& path);
  Status Save(const std::string& path) const;
  // InvalidArgument unless the probe was trained on a model with this fingerprint and hidden size
  // (an empty stored fingerprint is not checked; the hidden size always is).
  Status CheckModel(const std::string& model_fingerprint, int64_t hidden_size) const;

  // `hidden` must have config().hidden_size floats.
  LengthPrediction Predict(std::span<const float> hidden) const;
  std::vector<float> Probabilities(std::span<const float> hidden) const;

  // Sets the standardization from the examples, then trains from the current weights. Examples
  // whose hidden vector has the wrong width are skipped.
  TrainReport Train(const std::vector<ProbeExample>& examples);
  // One online SGD step on one completed request; `weight` scales the step.
  void Update(std::span<const float> hidden, int64_t output_len, float weight);

  const LengthProbeConfig& config() const { return config_; }
  LengthProbeConfig& mutable_config() { return config_; }
  const std::string& model_fingerprint() const { return model_fingerprint_; }
  void set_model_fingerprint(std::string fp) { model_fingerprint_ = std::move(fp); }
  const std::string& description() const { return description_; }
  void set_description(std::string d) { description_ = std::move(d); }
  int64_t num_online_updates() const { return num_online_updates_; }
  int64_t num_parameters() const;

 private:
  struct Dense {
    int64_t in = 0, out = 0;
    std::vector<float> w;  // [in][out]
    std::vector<float> b;  // [out]
  };
  // Activations of one example: the standardized input, the hidden layer's (post-ReLU) output,
  // the softmax.
  struct Pass {
    std::vector<float> x, h;
    std::vector<double> logits;
    std::vector<float> probs;
  };
  void Forward(std::span<const float> hidden, Pass& pass) const;
  // Adds the gradients of weight * cross-entropy at `label` into `grads` (one per layer).
  void Backward(const Pass& pass, int label, float weight, std::vector<Dense>& grads) const;
  LengthPrediction FromProbabilities(const std::vector<float>& probs) const;

  LengthProbeConfig config_;
  std::vector<float> mean_, inv_std_;  // [hidden_size]: x = (hidden - mean) * inv_std
  std::vector<Dense> layers_;          // one (linear) or two (ReLU hidden layer, then softmax)
  std::string model_fingerprint_;
  std::string description_;
  int64_t num_online_updates_ = 0;
};

// Accuracy figures of a probe on a labelled set (the predictor's LengthEvaluation).
LengthEvaluation EvaluateProbe(const LengthProbe& probe, const std::vector<ProbeExample>& examples);
// Prequential ("test, then train") figures, as the supervisor learns online: each example, in order,
// is predicted and then learnt from in one Update, weighted as the supervisor weighs a completed
// request (`weight_mispredicted` when the predicted bucket was wrong). Leaves `probe` updated;
// mean_predict_us counts the prediction and the update.
LengthEvaluation EvaluateProbeOnline(LengthProbe& probe, const std::vector<ProbeExample>& examples,
                                     float weight_correct, float weight_mispredicted);

}  // namespace kvflow
