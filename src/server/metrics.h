// Prometheus metrics of the server (text exposition format 0.0.4), named as vLLM names them with
// the prefix "kvflow:". Engine gauges and counters come from an EngineStats snapshot at scrape
// time; request latencies are recorded by the HTTP handlers as requests finish.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvflow/engine.h"

namespace kvflow::server {

// A cumulative histogram with fixed upper bounds.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void Observe(double v);
  void Render(const std::string& name, const std::string& help, std::string* out) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket; the last is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();

  // One finished generation request (a choice set): its latencies and how it ended.
  void RecordRequest(double ttft_s, double e2e_s, int64_t completion_tokens, const std::string& finish_reason);
  void RecordCancelled() { cancelled_.fetch_add(1); }
  void RecordFailure() { failed_.fetch_add(1); }
  void RecordHttpStatus(int status);
  std::atomic<int>& in_flight() { return in_flight_; }

  // The engine-wide metrics from `stats`, then the systems' own (Engine::SystemMetrics).
  std::string Render(const EngineStats& stats, std::span<const SystemMetric> system_metrics) const;

 private:
  Histogram ttft_;
  Histogram tpot_;
  Histogram e2e_;
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> success_by_reason_;
  std::map<int, uint64_t> http_by_status_;
  std::atomic<uint64_t> cancelled_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<int> in_flight_{0};
};

}  // namespace kvflow::server
