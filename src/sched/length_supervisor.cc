#include "sched/length_supervisor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

namespace kvflow {
namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int64_t ReserveLength(const LengthBuckets& buckets, ReservationPoint point, int bucket) {
  return point == ReservationPoint::kUpper ? buckets.UpperEdge(bucket)
                                           : (buckets.LowerEdge(bucket) + buckets.UpperEdge(bucket)) / 2;
}

}  // namespace

Result<PredictionOverride> ParsePredictionOverride(std::string_view spec, int num_buckets) {
  PredictionOverride o;
  if (spec.empty() || spec == "none") return o;
  const auto colon = spec.find(':');
  const std::string kind(spec.substr(0, colon));
  const std::string value = colon == std::string_view::npos ? "" : std::string(spec.substr(colon + 1));
  try {
    size_t used = 0;
    if (kind == "scale") {
      const double f = std::stod(value, &used);
      if (used == value.size() && std::isfinite(f) && f > 0 && f <= 1e6) {
        o.scale = f;
        return o;
      }
    } else if (kind == "bucket") {
      const int b = std::stoi(value, &used);
      if (used == value.size() && b >= 0 && b < num_buckets) {
        o.bucket = b;
        return o;
      }
    }
  } catch (const std::exception&) {
  }
  return Status::InvalidArgument("prediction override must be none, scale:F (F > 0) or bucket:B (0 <= B < " +
                                 std::to_string(num_buckets) + "), not '" + std::string(spec) + "'");
}

Result<std::unique_ptr<LengthSupervisor>> MakeLengthSupervisor(std::optional<LengthPredictor> trained,
                                                               const LengthSupervisorOptions& options) {
  LengthPredictor predictor;
  if (trained) {
    predictor = std::move(*trained);
  } else {
    LengthPredictorConfig pc;
    pc.buckets.max_output_len = std::max<int64_t>(1, options.max_model_len);
    predictor = LengthPredictor(pc);
  }
  if (!options.reservation_point.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(predictor.mutable_config().reservation_point,
                            ParseReservationPoint(options.reservation_point));
  }
  LengthSupervisorConfig config;
  config.online_updates = options.online_updates;
  KVFLOW_ASSIGN_OR_RETURN(config.override_predictions,
                          ParsePredictionOverride(options.prediction_override, predictor.config().buckets.num_buckets));
  return std::make_unique<LengthSupervisor>(std::move(predictor), config);
}

LengthSupervisor::LengthSupervisor(LengthPredictor predictor, const LengthSupervisorConfig& config)
    : predictor_(std::move(predictor)), config_(config) {}

void LengthSupervisor::Predict(SequenceGroup& group) {
  const auto start = Clock::now();
  const SchedSequence& seq = *group.seqs.front();
  const std::span<const int32_t> prompt(seq.tokens.data(), static_cast<size_t>(seq.prompt_len));
  LengthPrediction p = predictor_.Predict(prompt);
  const LengthPredictorConfig& c = predictor_.config();
  if (config_.override_predictions.bucket) {
    p.bucket = *config_.override_predictions.bucket;
    p.reserve_len = ReserveLength(c.buckets, c.reservation_point, p.bucket);
  }
  if (config_.override_predictions.scale) {
    p.reserve_len = std::max<int64_t>(1, std::llround(static_cast<double>(p.reserve_len) * *config_.override_predictions.scale));
    p.bucket = c.buckets.BucketOf(std::max<int64_t>(0, p.reserve_len - 1));
  }
  group.predicted_bucket = p.bucket;
  group.predicted_output_len = p.reserve_len;
  ++stats_.predictions;
  stats_.predict_seconds += SecondsSince(start);
}

void LengthSupervisor::OnPrefillHidden(SequenceGroup& group, std::span<const float> hidden) {
  if (!probe_ || static_cast<int64_t>(hidden.size()) != probe_->config().hidden_size) return;
  const auto start = Clock::now();
  const LengthPrediction p = probe_->Predict(hidden);
  const LengthBuckets& buckets = predictor_.config().buckets;
  if (group.predicted_output_len != p.reserve_len) ++stats_.probe_resized;
  group.predicted_output_len = p.reserve_len;
  group.predicted_bucket = buckets.BucketOf(std::max<int64_t>(0, p.reserve_len - 1));
  // A probe whose online step is 0 (train-probe found learning online did not pay) keeps nothing.
  if (config_.online_updates && probe_->config().online_learning_rate > 0) {
    group.prompt_hidden.assign(hidden.begin(), hidden.end());
  }
  ++stats_.probe_predictions;
  stats_.probe_seconds += SecondsSince(start);
}

void LengthSupervisor::OnReservationExhausted(const SequenceGroup&) { ++stats_.reservation_misses; }

void LengthSupervisor::OnFinished(const SequenceGroup& group, int64_t output_len, bool natural_end) {
  if (group.predicted_bucket < 0 || group.seqs.empty()) return;
  const LengthBuckets& buckets = predictor_.config().buckets;
  const int seen = buckets.BucketOf(output_len);
  // A request cut at max_tokens would have run on: its true bucket is at least `seen`, known
  // exactly only when that is already the last bucket.
  const bool known = natural_end || seen == buckets.num_buckets - 1;
  const bool under = seen > group.predicted_bucket;  // certain even for a cut request
  if (under) ++stats_.under_predicted;
  if (!known) return;
  ++stats_.compared;
  const bool over = seen < group.predicted_bucket;
  if (over) ++stats_.over_predicted;
  if (!under && !over) ++stats_.correct;
  if (!config_.online_updates) return;
  const LengthPredictorConfig& c = predictor_.config();
  const float weight = under || over ? c.online_weight_mispredicted : c.online_weight_correct;
  if (weight <= 0) return;
  const auto start = Clock::now();
  const SchedSequence& seq = *group.seqs.front();
  predictor_.Update(std::span<const int32_t>(seq.tokens.data(), static_cast<size_t>(seq.prompt_len)), output_len,
                    weight);
  ++stats_.online_updates;
  // The probe learns from the same request with the same weight: the reservation it set is the one
  // judged above.
  if (probe_ && !group.prompt_hidden.empty()) {
    probe_->Update(group.prompt_hidden, output_len, weight);
    ++stats_.probe_online_updates;
  }
  stats_.update_seconds += SecondsSince(start);
}

}  // namespace kvflow
