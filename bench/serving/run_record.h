// One serving run's record (per-request timings, per-step stats), the serving configuration, and the run's JSON summary.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "serving/common.h"
#include "serving/trace.h"

namespace kvflow::bench::serving {

// ---- runs and metrics -----------------------------------------------------------------------

struct ServingConfig {
  int block_size = 16;
  int num_device_blocks = 0;
  int num_host_blocks = 0;
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;
  int max_model_len = 2048;
  std::string preemption_mode = "auto";
  // s3: the length predictor (empty: untrained, learning online), its online updates, and
  // injected mispredictions ("scale:F", "bucket:B").
  std::string length_predictor;
  std::string reservation_point;  // "upper" or "middle"; empty: the predictor's
  bool online_updates = true;
  std::string prediction_override;
  // The real executor's policy "s3+probe": s3 with this hidden-state length probe re-sizing each
  // reservation after the prefill.
  std::string length_probe;

  Json ToJson() const {
    return Json{{"block_size", block_size},         {"num_device_blocks", num_device_blocks},
                {"num_host_blocks", num_host_blocks}, {"max_num_seqs", max_num_seqs},
                {"max_num_batched_tokens", max_num_batched_tokens}, {"max_model_len", max_model_len},
                {"preemption_mode", preemption_mode}, {"prefix_caching", false},
                {"length_predictor", length_predictor.empty() ? Json("untrained") : Json(length_predictor)},
                {"length_reservation_point", reservation_point.empty() ? Json("predictor's") : Json(reservation_point)},
                {"length_online_updates", online_updates},
                {"length_probe", length_probe.empty() ? Json(nullptr) : Json(length_probe)},
                {"prediction_override", prediction_override.empty() ? Json(nullptr) : Json(prediction_override)}};
  }
};

struct RequestTiming {
  double arrival_s = 0;
  double first_token_s = -1;  // -1: no token yet
  double finish_s = -1;
  int64_t output_len = 0;
  bool failed = false;
};

// Per-step averages.
struct StepStats {
  int64_t steps = 0;
  double batch_seqs = 0;
  double kv_used_fraction = 0;  // used device blocks / all
  // Tokens whose KV is stored / (used blocks * block_size); only the sim can see it.
  double kv_filled_fraction = 0;
  int64_t kv_filled_samples = 0;

  double busy_s = 0;  // time spent in steps

  void Add(double step_s, int num_seqs, double used_fraction, std::optional<double> filled_fraction) {
    ++steps;
    busy_s += step_s;
    batch_seqs += num_seqs;
    kv_used_fraction += used_fraction;
    if (filled_fraction) {
      kv_filled_fraction += *filled_fraction;
      ++kv_filled_samples;
    }
  }
};

struct RunRecord {
  std::string policy;
  // Executor-specific figures merged into the run's summary (CPU time, HTTP details).
  Json extra = Json::object();
  double rate = 0;
  std::vector<RequestTiming> requests;
  StepStats steps;
  int64_t preemptions_recompute = 0;
  int64_t preemptions_swap = 0;
  std::string first_error;
  double wall_s = 0;
};

RunRecord NewRunRecord(const Trace& trace, double rate, const std::string& policy);

// Rates are numbers in the reports, except "inf" (every request arrives at t = 0), which JSON has
// no number for.
Json RateJson(double rate);

double RateFromJson(const Json& v);

std::string RateLabel(double rate);

// Linear interpolation between closest ranks (numpy's default).
double Percentile(const std::vector<double>& sorted, double q);

Json Distribution(std::vector<double> v);

Json Summarize(const RunRecord& run);

}  // namespace kvflow::bench::serving
