// The real executor: a trace replayed against the in-process kvflow::Engine in wall-clock time.
#include "serving/real_executor.h"

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

#include "serving/simulated_executor.h"

namespace kvflow::bench::serving {

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}
double MachineBusyCpuSeconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return (user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
}
Json OtherLoadCores(double machine_busy_s, double own_cpu_s, double wall_s) {
  if (wall_s <= 0) return nullptr;
  return std::max(0.0, machine_busy_s - own_cpu_s) / wall_s;
}
namespace {

kvflow::EngineConfig MakeEngineConfig(const ServingConfig& cfg, const ModelChoice& model, const std::string& policy,
                                      int num_threads) {
  kvflow::EngineConfig ec;
  ec.model = model.path;
  ec.block_size = cfg.block_size;
  ec.num_kv_blocks = cfg.num_device_blocks;
  ec.num_host_kv_blocks = cfg.num_host_blocks;
  ec.max_num_seqs = cfg.max_num_seqs;
  ec.max_num_batched_tokens = cfg.max_num_batched_tokens;
  ec.max_model_len = cfg.max_model_len;
  ec.preemption_mode = cfg.preemption_mode;
  const bool probe = policy == "s3+probe";
  ec.scheduling_policy = probe ? "s3" : policy;
  ec.num_threads = num_threads;
  if (ec.scheduling_policy == "s3") {
    ec.s3.length_predictor = cfg.length_predictor;
    ec.s3.online_updates = cfg.online_updates;
    ec.s3.reservation_point = cfg.reservation_point;
  }
  if (probe) ec.s3.length_probe = cfg.length_probe;
  return ec;
}
}  // namespace

Result<RunRecord> RunEngine(const Trace& trace, double rate, const std::string& policy, const ServingConfig& cfg,
                            const ModelChoice& model, int num_threads) {
  kvflow::EvaluationOptions evaluation;
  const bool s3 = policy == "s3" || policy == "s3+probe";
  if (policy == "s3+probe" && cfg.length_probe.empty()) return Status::InvalidArgument("s3+probe needs --length-probe");
  if (s3) evaluation.length_prediction_override = cfg.prediction_override;
  KVFLOW_ASSIGN_OR_RETURN(auto engine, kvflow::CreateEvaluationEngine(MakeEngineConfig(cfg, model, policy, num_threads),
                                                                      evaluation));
  if (engine->config().max_model_len != cfg.max_model_len) {
    return Status::InvalidArgument("--max-model-len " + std::to_string(cfg.max_model_len) + " exceeds the model's " +
                                   std::to_string(engine->config().max_model_len));
  }
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  params.max_tokens = 4;
  // One short request first so that first-touch costs do not land on the trace's first requests.
  KVFLOW_RETURN_IF_ERROR(engine->Generate(std::vector<std::string>{"warm-up"}, params).status());
  const kvflow::EngineStats before = engine->stats();

  RunRecord run = NewRunRecord(trace, rate, policy);
  const size_t n = run.requests.size();
  std::vector<int64_t> generated(n, 0);
  size_t next = 0, settled = 0;
  const double cpu_before = ProcessCpuSeconds();
  const double machine_before = MachineBusyCpuSeconds();
  const auto start = Clock::now();
  while (settled < n) {
    for (; next < n && run.requests[next].arrival_s <= SecondsSince(start); ++next) {
      RequestTiming& t = run.requests[next];
      int64_t& count = generated[next];
      auto on_event = [&t, &run, &settled, &count, start](const kvflow::StreamEvent& e) {
        const double now = SecondsSince(start);
        if (!e.tokens.empty() && t.first_token_s < 0) t.first_token_s = now;
        count += static_cast<int64_t>(e.tokens.size());
        if (!e.request_finished) return;
        t.finish_s = now;
        t.failed = e.finish_reason == kvflow::FinishReason::kError || e.finish_reason == kvflow::FinishReason::kCancelled;
        if (t.failed && run.first_error.empty()) run.first_error = e.error.ToString();
        if (!t.failed && count != t.output_len) {  // ignore_eos + max_tokens: exactly output_len tokens
          t.failed = true;
          if (run.first_error.empty()) {
            run.first_error =
                "generated " + std::to_string(count) + " tokens, expected " + std::to_string(t.output_len);
          }
        }
        ++settled;
      };
      params.max_tokens = static_cast<int>(t.output_len);
      kvflow::RequestHints hints;
      hints.true_output_len = t.output_len;
      hints.hide_max_tokens = true;  // max_tokens is the true length here: not for the scheduler's eyes
      auto id = engine->AddRequestWithHints(trace.requests[next].prompt, params, std::move(on_event), hints);
      if (!id.ok()) {
        t.failed = true;
        if (run.first_error.empty()) run.first_error = id.status().ToString();
        ++settled;
      }
    }
    if (!engine->HasUnfinishedRequests()) {
      if (next < n) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(run.requests[next].arrival_s)));
      }
      continue;
    }
    const auto step_start = Clock::now();
    auto step = engine->Step();
    const double step_s = SecondsSince(step_start);
    if (!step.ok()) return step.status();
    if (step->num_seqs == 0) continue;
    const kvflow::EngineStats s = engine->stats();
    run.steps.Add(step_s, step->num_seqs, static_cast<double>(s.kv_blocks_total - s.kv_blocks_free) / s.kv_blocks_total,
                  std::nullopt);
  }
  run.wall_s = SecondsSince(start);
  run.extra["process_cpu_s"] = ProcessCpuSeconds() - cpu_before;
  run.extra["machine_busy_cpu_s"] = MachineBusyCpuSeconds() - machine_before;
  run.extra["other_load_cores"] =
      OtherLoadCores(run.extra["machine_busy_cpu_s"], run.extra["process_cpu_s"], run.wall_s);
  const kvflow::EngineStats after = engine->stats();
  run.extra["prefill_tokens"] = after.prompt_tokens_processed - before.prompt_tokens_processed;
  run.preemptions_swap = after.num_preemptions_swap - before.num_preemptions_swap;
  run.preemptions_recompute = after.num_preemptions - before.num_preemptions - run.preemptions_swap;
  run.extra["preemption_penalty"] = Json{{"reservation_preemptions", after.s3.reservation_preemptions - before.s3.reservation_preemptions}};
  if (s3) {
    kvflow::LengthSupervisorStats l;
    l.predictions = after.s3.predictions - before.s3.predictions;
    l.correct = after.s3.correct - before.s3.correct;
    l.under_predicted = after.s3.under_predicted - before.s3.under_predicted;
    l.over_predicted = after.s3.over_predicted - before.s3.over_predicted;
    l.compared = after.s3.compared - before.s3.compared;
    l.reservation_misses = after.s3.reservation_preemptions - before.s3.reservation_preemptions;
    l.online_updates = after.s3.online_updates - before.s3.online_updates;
    l.predict_seconds = after.s3.predict_seconds - before.s3.predict_seconds;
    l.update_seconds = after.s3.update_seconds - before.s3.update_seconds;
    run.extra["s3"] = SupervisorJson(l);
    run.extra["s3"]["probe_predictions"] = after.s3.probe_predictions - before.s3.probe_predictions;
    run.extra["s3"]["probe_resized"] = after.s3.probe_resized - before.s3.probe_resized;
    run.extra["s3"]["probe_released_blocks"] = after.s3.probe_released_blocks - before.s3.probe_released_blocks;
    run.extra["s3"]["probe_online_updates"] = after.s3.probe_online_updates - before.s3.probe_online_updates;
    run.extra["s3"]["probe_seconds"] = after.s3.probe_seconds - before.s3.probe_seconds;
  }
  return run;
}

}  // namespace kvflow::bench::serving
