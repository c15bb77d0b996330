// S3's supervisor, the part that lives beside the scheduler: it predicts every request's output
// length at arrival (the s3 policy reserves prompt + prediction), counts mispredictions — the
// reservations the scheduler found exhausted (it preempts and doubles them itself) and, at the end,
// the buckets that were too short or too long — and retrains the predictor online from completed
// requests, the mispredicted ones weighing more. Plain C++, driven by the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kvflow/status.h"
#include "sched/length_predictor.h"
#include "sched/length_probe.h"
#include "sched/sequence_group.h"

namespace kvflow {

// Evaluation only: distorts every prediction to show what mispredictions cost and that the
// supervisor recovers. "scale:F" multiplies the reserved length by F; "bucket:B" always predicts
// bucket B.
struct PredictionOverride {
  std::optional<double> scale;
  std::optional<int> bucket;
};
Result<PredictionOverride> ParsePredictionOverride(std::string_view spec, int num_buckets);

struct LengthSupervisorConfig {
  bool online_updates = true;
  PredictionOverride override_predictions;
};

struct LengthSupervisorStats {
  int64_t predictions = 0;
  int64_t compared = 0;         // finished requests whose true bucket is known
  int64_t correct = 0;
  int64_t under_predicted = 0;  // true bucket above the predicted one
  int64_t over_predicted = 0;
  int64_t reservation_misses = 0;  // exhausted reservations: each one a preemption
  int64_t online_updates = 0;
  double predict_seconds = 0;  // in Predict, on the engine thread
  double update_seconds = 0;   // in the online updates
  int64_t probe_predictions = 0;  // reservations the probe set after a prefill
  int64_t probe_resized = 0;      // of those, the ones that differ from the predictor's
  double probe_seconds = 0;
  int64_t probe_online_updates = 0;  // the probe's online steps (their time is in update_seconds)
};

// What a supervisor is made from: a trained predictor, or none (an untrained one whose buckets span
// `max_model_len`, learning online only), plus the options the engine and the benchmark share.
struct LengthSupervisorOptions {
  int64_t max_model_len = 2048;
  std::string reservation_point;  // "upper" or "middle"; empty: the predictor's own
  bool online_updates = true;
  std::string prediction_override;  // ParsePredictionOverride's syntax; empty: none
};

class LengthSupervisor;
Result<std::unique_ptr<LengthSupervisor>> MakeLengthSupervisor(std::optional<LengthPredictor> trained,
                                                               const LengthSupervisorOptions& options);

class LengthSupervisor {
 public:
  LengthSupervisor(LengthPredictor predictor, const LengthSupervisorConfig& config);

  // Sets group.predicted_output_len and predicted_bucket from its prompt.
  void Predict(SequenceGroup& group);
  // The hidden-state probe: the predictor still reserves at arrival (the probe needs the prefill),
  // and OnPrefillHidden re-sizes the reservation once the prompt has run.
  void set_probe(LengthProbe probe) { probe_.emplace(std::move(probe)); }
  bool has_probe() const { return probe_.has_value(); }
  // `hidden`: the final-norm hidden state of the prompt's last token (its first output's logit
  // row). Replaces group.predicted_output_len with the probe's, and predicted_bucket with the
  // predictor's bucket of it (so OnFinished judges the reservation actually held). With online
  // updates and a probe whose online step is not 0, keeps `hidden` in the group: OnFinished trains
  // the probe on it too.
  void OnPrefillHidden(SequenceGroup& group, std::span<const float> hidden);
  // The scheduler preempted `group` because a sequence outgrew its reservation.
  void OnReservationExhausted(const SequenceGroup& group);
  // A request that completed: `output_len` is its longest sequence's output; `natural_end` says it
  // stopped by itself (EOS or a stop), so output_len is its true length rather than a cut at
  // max_tokens or the context. Cancelled and failed requests are not reported. With online updates
  // the predictor, and the probe where it predicted, each take one step on a request whose true
  // bucket is known.
  void OnFinished(const SequenceGroup& group, int64_t output_len, bool natural_end);

  const LengthSupervisorStats& stats() const { return stats_; }
  const LengthPredictor& predictor() const { return predictor_; }
  const LengthProbe* probe() const { return probe_ ? &*probe_ : nullptr; }

 private:
  LengthPredictor predictor_;
  std::optional<LengthProbe> probe_;
  LengthSupervisorConfig config_;
  LengthSupervisorStats stats_;
};

}  // namespace kvflow
