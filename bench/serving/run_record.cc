// One serving run's record (per-request timings, per-step stats), the serving configuration, and the run's JSON summary.
#include "serving/run_record.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include "bench_files.h"
#include "engine/engine_core.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "sched/length_predictor.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"
#include "sched/scheduler.h"
#include "sched/sequence_group.h"
#include "util/alpaca.h"

namespace kvflow::bench::serving {

RunRecord NewRunRecord(const Trace& trace, double rate, const std::string& policy) {
  RunRecord run;
  run.policy = policy;
  run.rate = rate;
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    RequestTiming t;
    t.arrival_s = trace.unit_arrivals[i] / rate;
    t.output_len = trace.requests[i].output_len;
    run.requests.push_back(t);
  }
  return run;
}
Json RateJson(double rate) { return std::isinf(rate) ? Json("inf") : Json(rate); }
double RateFromJson(const Json& v) {
  return v.is_string() ? std::numeric_limits<double>::infinity() : v.get<double>();
}
std::string RateLabel(double rate) { return std::isinf(rate) ? "inf" : Sig3(rate); }
double Percentile(const std::vector<double>& sorted, double q) {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}
Json Distribution(std::vector<double> v) {
  if (v.empty()) return Json{{"p50", nullptr}, {"p90", nullptr}, {"p99", nullptr}, {"mean", nullptr}};
  std::sort(v.begin(), v.end());
  return Json{{"p50", Percentile(v, 0.5)}, {"p90", Percentile(v, 0.9)}, {"p99", Percentile(v, 0.99)},
              {"mean", std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size())}};
}
Json Summarize(const RunRecord& run) {
  std::vector<double> ttft, tpot, normalized, latency;
  int64_t completed = 0, failed = 0, output_tokens = 0;
  double first_arrival = std::numeric_limits<double>::infinity(), last_finish = 0;
  for (const RequestTiming& t : run.requests) {
    first_arrival = std::min(first_arrival, t.arrival_s);
    if (t.failed) {
      ++failed;
      continue;
    }
    ++completed;
    output_tokens += t.output_len;
    last_finish = std::max(last_finish, t.finish_s);
    latency.push_back(t.finish_s - t.arrival_s);
    normalized.push_back((t.finish_s - t.arrival_s) / static_cast<double>(t.output_len));
    ttft.push_back(t.first_token_s - t.arrival_s);
    if (t.output_len > 1) tpot.push_back((t.finish_s - t.first_token_s) / static_cast<double>(t.output_len - 1));
  }
  const double duration = completed > 0 ? last_finish - first_arrival : 0.0;
  auto mean = [](const std::vector<double>& v) -> Json {
    if (v.empty()) return nullptr;
    return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  };
  auto per_step = [&](double total, int64_t samples) -> Json {
    if (samples == 0) return nullptr;
    return total / static_cast<double>(samples);
  };
  Json j{{"policy", run.policy},
         {"rate_req_s", RateJson(run.rate)},
         {"num_requests", run.requests.size()},
         {"completed", completed},
         {"failed", failed},
         {"duration_s", duration},
         {"throughput_req_s", duration > 0 ? completed / duration : 0.0},
         {"throughput_output_tok_s", duration > 0 ? static_cast<double>(output_tokens) / duration : 0.0},
         {"normalized_latency_s_per_token", mean(normalized)},
         {"mean_latency_s", mean(latency)},
         {"ttft_s", Distribution(ttft)},
         {"tpot_s", Distribution(tpot)},
         {"e2e_s", Distribution(latency)},
         {"avg_batch_seqs", per_step(run.steps.batch_seqs, run.steps.steps)},
         {"num_steps", run.steps.steps},
         {"mean_step_s", per_step(run.steps.busy_s, run.steps.steps)},
         {"preemptions", {{"recompute", run.preemptions_recompute}, {"swap", run.preemptions_swap}}},
         {"kv_used_block_fraction", per_step(run.steps.kv_used_fraction, run.steps.steps)},
         {"kv_filled_token_fraction", per_step(run.steps.kv_filled_fraction, run.steps.kv_filled_samples)},
         {"wall_s", run.wall_s}};
  if (!run.first_error.empty()) j["first_error"] = run.first_error;
  for (const auto& [key, value] : run.extra.items()) j[key] = value;
  return j;
}

}  // namespace kvflow::bench::serving
