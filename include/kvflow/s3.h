// S3 (scheduling_policy "s3"): reserve each request's prompt plus its predicted output length,
// pack batches first-fit decreasing, and on a misprediction preempt and double the reservation.
// Its configuration (EngineConfig::s3) and counters (EngineStats::s3).
#pragma once

#include <cstdint>
#include <string>

namespace kvflow {

struct S3Config {
  // The output-length predictor (written by kvflow-length-predictor train). Empty: start from an
  // untrained predictor and learn from completed requests.
  std::string length_predictor;
  bool online_updates = true;     // retrain on completed requests
  std::string reservation_point;  // "upper" or "middle" of the bucket; empty: the predictor file's
  // The hidden-state length probe (written by kvflow-length-predictor train-probe) for the served
  // model. Empty: none. With one, the predictor reserves at admission and the probe re-sizes each
  // request's reservation once its prefill has run (CPU backend).
  std::string length_probe;
};

// Zero under other policies.
struct S3Stats {
  int64_t predictions = 0;
  int64_t compared = 0;         // finished requests whose true length bucket is known
  int64_t under_predicted = 0;  // finished requests whose output outgrew the predicted bucket
  int64_t over_predicted = 0;
  int64_t correct = 0;
  int64_t reservation_preemptions = 0;  // preemptions of exhausted reservations (one per miss)
  int64_t online_updates = 0;
  double predict_seconds = 0;
  double update_seconds = 0;
  int64_t probe_predictions = 0;  // reservations the length probe set after a prefill
  int64_t probe_resized = 0;      // of those, reservations it changed
  int64_t probe_released_blocks = 0;  // KV blocks given back to the pool when it shrank one
  double probe_seconds = 0;
  int64_t probe_online_updates = 0;  // online training steps of the length probe
};

}  // namespace kvflow
