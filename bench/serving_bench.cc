// Trace-driven serving benchmark after the vLLM paper (§6.2, Fig. 12): one request trace replayed
// with Poisson arrivals against the paged scheduler (vLLM) and the Orca baselines under the same KV
// memory budget, reporting latency and throughput per request rate and the rate each policy
// sustains.
//
//   sim        drives the engine's core (its Scheduler, BlockManager and step protocol) on a virtual
//              clock; every step takes the time a cost model gives (analytic A100/OPT-13B, or
//              coefficients fitted on this CPU)
//   real       drives the real Engine on this CPU in wall-clock time
//   http       sends the trace to kvflow-server (streamed /v1/completions, one connection per
//              request), started with the real executor's engine configuration or attached (--url)
//   compare    real and http back to back on the same trace and rates: the HTTP server's overhead
//   calibrate  times Engine::Step() on prefill and decode batches and fits the sim's cost model
//
//   kvflow_bench_serving sim --trace sharegpt --cost-model a100-opt13b --rates 0.5,1,1.5,2
//   kvflow_bench_serving calibrate --model tiny-random
//   kvflow_bench_serving real --trace alpaca --model tiny-random --num-requests 64 --rates 2,4
//       --num-device-blocks 128 --max-model-len 512
//   kvflow_bench_serving compare --trace alpaca --model tiny-random --num-requests 200 --rates 4,8,inf
//       --num-device-blocks 256 --max-model-len 1024 --num-threads 1
//
// Rate "inf" sends every request at t = 0.
//
// Results go to bench/results/serving_<trace>_<executor>[_<tag>].{json,md} (compare:
// serving_<trace>_http_vs_library[_<tag>]); bench/serving_report.py draws them.
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

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
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

#include "serving/common.h"
#include "serving/trace.h"
#include "serving/cost_model.h"
#include "serving/run_record.h"
#include "serving/simulated_executor.h"
#include "serving/real_executor.h"
#include "serving/http_executor.h"
#include "serving/report.h"
#include "serving/calibrate.h"

using namespace kvflow::bench::serving;

namespace {
Result<Trace> BuildTrace(const SweepOptions& opt, const ModelChoice* tokenizer) {
  Result<Trace> trace = opt.trace == "alpaca"
                            ? LoadAlpacaTrace(opt.alpaca_path, opt.num_requests, opt.seed,
                                              opt.serving.max_model_len, *tokenizer, opt.held_out_from)
                            : Result<Trace>(MakeShareGptTrace(opt.num_requests, opt.seed, opt.serving.max_model_len));
  if (trace.ok()) trace->unit_arrivals = UnitPoissonArrivals(opt.num_requests, opt.seed + 1);
  return trace;
}

using RunFn = std::function<Result<RunRecord>(const Trace&, double rate, const std::string& policy)>;

// `before_write`, when given, completes the report (the http executor adds how its server exited).
int RunSweep(const std::string& executor, const Json& executor_info, const SweepOptions& opt,
             const std::vector<std::string>& argv, const Trace& trace, const RunFn& run_one,
             const std::function<void(Json&)>& before_write = {}) {
  std::vector<double> rates = opt.rates;
  std::sort(rates.begin(), rates.end());
  Json runs = Json::array();
  int64_t failed = 0;
  for (const std::string& policy : opt.policies) {
    for (double rate : rates) {
      auto run = run_one(trace, rate, policy);
      if (!run.ok()) {
        spdlog::error("{} at {} req/s: {}", policy, rate, run.status().ToString());
        return 1;
      }
      Json summary = Summarize(run.value());
      failed += summary["failed"].get<int64_t>();
      std::fprintf(stderr, "[%s %s] %-11s %6.2f req/s: %lld done, %lld failed, norm. latency %s s/tok, %lld steps, %.1f s wall\n",
                   executor.c_str(), trace.name.c_str(), policy.c_str(), rate,
                   static_cast<long long>(summary["completed"].get<int64_t>()),
                   static_cast<long long>(summary["failed"].get<int64_t>()),
                   Cell(summary["normalized_latency_s_per_token"]).c_str(),
                   static_cast<long long>(summary["num_steps"].get<int64_t>()), run->wall_s);
      runs.push_back(std::move(summary));
    }
  }
  Json report;
  report["benchmark"] = "kvflow serving";
  report["command"] = Join(argv, " ");
  report["provenance"] = kvflow::bench::Provenance(argv);
  report["executor"] = executor_info;
  report["executor"]["name"] = executor;
  report["trace"] = trace.info;
  report["arrival_seed"] = opt.seed + 1;
  report["rates_req_s"] = Json::array();
  for (double rate : rates) report["rates_req_s"].push_back(RateJson(rate));
  report["policies"] = opt.policies;
  report["config"] = opt.serving.ToJson();
  Json bound_info;
  report["sustainable_rate_req_s"] = SustainableRates(runs, opt, bound_info);
  report["latency_bound"] = bound_info;
  report["ratios"] = Ratios(report["sustainable_rate_req_s"]);
  report["runs"] = runs;
  if (before_write) before_write(report);

  const std::string md = Markdown(report);
  std::fputs(md.c_str(), stdout);
  const fs::path base = fs::path(opt.out_dir) / BaseName(trace.name, executor, opt.tag);
  for (const auto& [ext, text] : {std::pair{".json", report.dump(2) + "\n"}, std::pair{".md", md}}) {
    if (Status st = WriteFile(base.string() + ext, text); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
  }
  std::fprintf(stderr, "wrote %s.json and .md\n", base.c_str());
  if (opt.require_complete && failed > 0) {
    std::fprintf(stderr, "FAILED: %lld request(s) did not complete\n", static_cast<long long>(failed));
    return 3;
  }
  return 0;
}

// Loads the trace, or says why not: 77 (skipped) when the Alpaca dataset is absent.
std::optional<int> TraceUnavailable(const SweepOptions& opt) {
  std::error_code ec;
  if (opt.trace == "alpaca" && !fs::exists(opt.alpaca_path, ec)) {
    std::fprintf(stderr, "skipping the alpaca trace: dataset %s not found (pass --alpaca-path)\n",
                 opt.alpaca_path.c_str());
    return kExitSkipped;
  }
  return std::nullopt;
}

int RunSim(SweepOptions& opt, bool tokenizer_explicit, const std::vector<std::string>& argv) {
  if (auto code = TraceUnavailable(opt)) return *code;
  auto cost = MakeCostModel(opt.cost_model);
  if (!cost.ok()) {
    spdlog::error("--cost-model: {}", cost.status().ToString());
    return 2;
  }
  if (opt.serving.num_device_blocks == 0) {
    if (!cost->kv_budget_tokens) {
      spdlog::error("--num-device-blocks is required with cost model {} (it models no device memory)", cost->name);
      return 2;
    }
    opt.serving.num_device_blocks = static_cast<int>(*cost->kv_budget_tokens / opt.serving.block_size);
  }
  if (opt.serving.num_host_blocks < 0) opt.serving.num_host_blocks = opt.serving.num_device_blocks;
  std::optional<ModelChoice> tokenizer;
  if (opt.trace == "alpaca") {
    auto chosen = ChooseModel(opt.tokenizer, tokenizer_explicit);
    if (!chosen.ok()) {
      spdlog::error("--tokenizer: {}", chosen.status().ToString());
      return 2;
    }
    tokenizer = chosen.value();
  }
  auto trace = BuildTrace(opt, tokenizer ? &*tokenizer : nullptr);
  if (!trace.ok()) {
    spdlog::error("{}", trace.status().ToString());
    return 1;
  }
  std::optional<kvflow::LengthPredictor> predictor;
  if (!opt.serving.length_predictor.empty()) {
    auto loaded = kvflow::LengthPredictor::Load(opt.serving.length_predictor);
    if (!loaded.ok()) {
      spdlog::error("--length-predictor: {}", loaded.status().ToString());
      return 2;
    }
    predictor = std::move(loaded.value());
    if (tokenizer) {
      auto files = OpenModel(*tokenizer);
      if (files.ok() && files->tokenizer && !predictor->tokenizer_fingerprint().empty() &&
          predictor->tokenizer_fingerprint() != kvflow::TokenizerFingerprint(*files->tokenizer)) {
        spdlog::error("--length-predictor {} was trained on another tokenizer than {}", opt.serving.length_predictor,
                      tokenizer->name);
        return 2;
      }
    }
  }
  const Json executor{{"description", "virtual clock; step time from the " + cost->description},
                      {"cost_model", cost->ToJson()}};
  return RunSweep("sim", executor, opt, argv, trace.value(),
                  [&](const Trace& t, double rate, const std::string& policy) {
                    return Simulate(t, rate, policy, opt.serving, cost.value(), predictor ? &*predictor : nullptr);
                  });
}

// The model and trace of the executors that run the real engine (real, http, compare); or the
// exit code to leave with.
struct ModelAndTrace {
  ModelChoice model;
  Trace trace;
};

std::variant<ModelAndTrace, int> PrepareModelAndTrace(SweepOptions& opt, bool model_explicit) {
  if (auto code = TraceUnavailable(opt)) return *code;
  WarnIfOmpSpins();
  if (opt.serving.num_device_blocks == 0) {
    spdlog::error("--num-device-blocks is required (the KV budget every run shares)");
    return 2;
  }
  if (opt.serving.num_host_blocks < 0) opt.serving.num_host_blocks = opt.serving.num_device_blocks;
  auto model = ChooseModel(opt.model, model_explicit);
  if (!model.ok()) {
    spdlog::error("--model: {}", model.status().ToString());
    return 2;
  }
  auto trace = BuildTrace(opt, &model.value());
  if (!trace.ok()) {
    spdlog::error("{}", trace.status().ToString());
    return 1;
  }
  return ModelAndTrace{model.value(), std::move(trace.value())};
}

int RunReal(SweepOptions& opt, bool model_explicit, const std::vector<std::string>& argv) {
  auto prepared = PrepareModelAndTrace(opt, model_explicit);
  if (const int* code = std::get_if<int>(&prepared)) return *code;
  const ModelChoice* model = &std::get<ModelAndTrace>(prepared).model;
  const Trace* trace = &std::get<ModelAndTrace>(prepared).trace;
  const Json executor{{"description", "real Engine on the CPU (wall clock): " + model->name + " on " + CpuName()},
                      {"model", model->name},
                      {"model_path", model->path},
                      {"machine", MachineJson(opt.num_threads)}};
  return RunSweep("real", executor, opt, argv, *trace,
                  [&](const Trace& t, double rate, const std::string& policy) {
                    return RunEngine(t, rate, policy, opt.serving, *model, opt.num_threads);
                  });
}

// ---- http and compare -------------------------------------------------------------------------

// What the http and compare executors share: the model, the trace, and a server with the real
// executor's engine configuration (or an attached one).
struct HttpSetup {
  ModelChoice model;
  Trace trace;
  ServerSession server;
};

// Returns the setup, or the exit code to leave with.
std::variant<HttpSetup, int> PrepareHttp(SweepOptions& opt, const HttpOptions& http, bool model_explicit) {
  auto prepared = PrepareModelAndTrace(opt, model_explicit);
  if (const int* code = std::get_if<int>(&prepared)) return *code;
  const ModelChoice* model = &std::get<ModelAndTrace>(prepared).model;
  Trace* trace = &std::get<ModelAndTrace>(prepared).trace;
  if (http.url.empty()) {
    const std::string binary = http.server_binary.empty() ? DefaultServerBinary() : http.server_binary;
    std::error_code ec;
    if (!fs::exists(binary, ec)) {
      std::fprintf(stderr, "skipping: no kvflow-server at %s (build the kvflow-server target, or pass "
                           "--server-binary or --url)\n", binary.c_str());
      return kExitSkipped;
    }
  }
  auto server = OpenServerSession(http, opt.serving, *model, opt.num_threads, trace->requests.size(),
                                  opt.out_dir);
  if (!server.ok()) {
    spdlog::error("{}", server.status().ToString());
    return 1;
  }
  if (Status st = WarmUpServer(server.value()); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 1;
  }
  return HttpSetup{*model, std::move(*trace), std::move(server.value())};
}

std::string ClientDescription() {
  return "one thread blocked in ppoll(), one HTTP/1.1 connection per request, POST /v1/completions with token-id "
         "prompts, greedy, ignore_eos, stream + include_usage";
}

// Stops a server the benchmark started; returns how it ended (recorded in the report).
Json StopServer(ServerSession& s, double timeout_s) {
  if (!s.process) return nullptr;
  const std::string how = s.process->Stop(timeout_s);
  std::fprintf(stderr, "kvflow-server: %s\n", how.c_str());
  if (!s.process->exit_clean()) spdlog::warn("kvflow-server did not exit cleanly after SIGTERM: {}", how);
  return Json{{"after_sigterm", how}, {"clean", s.process->exit_clean()}};
}

// Failed requests or an unclean server exit are the server's faults: exit code 3 (after the reports).
int ServingExitCode(int64_t failed, bool clean_exit) {
  if (failed > 0) std::fprintf(stderr, "FAILED: %lld request(s) failed (see first_error in the report)\n",
                               static_cast<long long>(failed));
  if (!clean_exit) std::fprintf(stderr, "FAILED: kvflow-server did not exit with code 0 after SIGTERM\n");
  return failed > 0 || !clean_exit ? 3 : 0;
}

int RunHttp(SweepOptions& opt, const HttpOptions& http, bool model_explicit, const std::vector<std::string>& argv) {
  auto prepared = PrepareHttp(opt, http, model_explicit);
  if (const int* code = std::get_if<int>(&prepared)) return *code;
  HttpSetup& setup = std::get<HttpSetup>(prepared);
  ServerSession& server = setup.server;
  const Json executor{{"description", "kvflow-server over HTTP (" + server.endpoint.url() + "), " + setup.model.name +
                                          " on " + CpuName() + "; client: " + ClientDescription()},
                      {"model", setup.model.name},
                      {"model_path", setup.model.path},
                      {"machine", MachineJson(opt.num_threads)},
                      {"server", server.info}};
  int64_t failed = 0;
  bool clean_exit = true;
  const int code = RunSweep(
      "http", executor, opt, argv, setup.trace,
      [&](const Trace& t, double rate, const std::string&) -> Result<RunRecord> {
        KVFLOW_RETURN_IF_ERROR(WarmUpServer(server));
        auto run = RunHttpReplay(t, rate, server, http.run_timeout_s, opt.serving.preemption_mode);
        if (run.ok()) failed += std::count_if(run->requests.begin(), run->requests.end(),
                                              [](const RequestTiming& r) { return r.failed; });
        return run;
      },
      [&](Json& report) {
        report["executor"]["server"]["exit"] = StopServer(server, http.shutdown_timeout_s);
        clean_exit = server.process == nullptr || server.process->exit_clean();
      });
  return code != 0 ? code : ServingExitCode(failed, clean_exit);
}

int RunCompare(SweepOptions& opt, const HttpOptions& http, bool model_explicit, const std::vector<std::string>& argv) {
  auto prepared = PrepareHttp(opt, http, model_explicit);
  if (const int* code = std::get_if<int>(&prepared)) return *code;
  HttpSetup& setup = std::get<HttpSetup>(prepared);
  ServerSession& server = setup.server;
  std::vector<double> rates = opt.rates;
  std::sort(rates.begin(), rates.end());
  Json runs = Json::array();
  for (double rate : rates) {
    for (int repeat = 1; repeat <= http.repeats; ++repeat) {
      const double server_cpu_idle_before = server.CpuSeconds();
      auto lib = RunEngine(setup.trace, rate, "paged", opt.serving, setup.model, opt.num_threads);
      if (!lib.ok()) {
        spdlog::error("library at {} req/s: {}", RateLabel(rate), lib.status().ToString());
        return 1;
      }
      if (server.process) lib->extra["idle_server_cpu_s"] = server.CpuSeconds() - server_cpu_idle_before;
      if (Status st = WarmUpServer(server); !st.ok()) {
        spdlog::error("{}", st.ToString());
        return 1;
      }
      auto srv = RunHttpReplay(setup.trace, rate, server, http.run_timeout_s, opt.serving.preemption_mode);
      if (!srv.ok()) {
        spdlog::error("server at {} req/s: {}", RateLabel(rate), srv.status().ToString());
        return 1;
      }
      Json l = Summarize(lib.value()), s = Summarize(srv.value());
      l.erase("policy");
      s.erase("policy");
      const Json tok_ratio = SafeRatio(s["throughput_output_tok_s"], l["throughput_output_tok_s"]);
      Json cmp{{"throughput_req_ratio", SafeRatio(s["throughput_req_s"], l["throughput_req_s"])},
               {"throughput_tok_ratio", tok_ratio},
               {"http_overhead", tok_ratio.is_null() ? Json(nullptr) : Json(1.0 - tok_ratio.get<double>())},
               {"ttft_p50_delta_s", Difference(s["ttft_s"]["p50"], l["ttft_s"]["p50"])},
               {"ttft_p99_delta_s", Difference(s["ttft_s"]["p99"], l["ttft_s"]["p99"])},
               {"tpot_p50_delta_s", Difference(s["tpot_s"]["p50"], l["tpot_s"]["p50"])},
               {"e2e_p50_delta_s", Difference(s["e2e_s"]["p50"], l["e2e_s"]["p50"])}};
      auto side_line = [](const Json& j) {
        return Cell(j["completed"]) + "/" + Cell(j["num_requests"]) + " done, " +
               Fixed(j["throughput_output_tok_s"], 0) + " tok/s, TTFT p50 " + Cell(j["ttft_s"]["p50"]) + " s";
      };
      std::fprintf(stderr, "[compare %s] %5s req/s: library %s; server %s; server/library throughput %s\n",
                   setup.trace.name.c_str(),
                   (RateLabel(rate) + (http.repeats > 1 ? " #" + std::to_string(repeat) : "")).c_str(),
                   side_line(l).c_str(), side_line(s).c_str(), Cell(tok_ratio, 3).c_str());
      for (const Json* side : {&l, &s}) {
        if ((*side)["other_load_cores"].is_number() && (*side)["other_load_cores"].get<double>() > 0.2) {
          spdlog::warn("other processes used {:.2f} cores during the {} run at {} req/s: not a clean comparison",
                       (*side)["other_load_cores"].get<double>(), side == &l ? "library" : "server", RateLabel(rate));
        }
      }
      Json run{{"rate_req_s", RateJson(rate)}};
      if (http.repeats > 1) run["repeat"] = repeat;
      run["library"] = l;
      run["server"] = s;
      run["comparison"] = cmp;
      runs.push_back(std::move(run));
    }
  }
  Json report;
  report["benchmark"] = "kvflow serving: HTTP server vs library";
  report["command"] = Join(argv, " ");
  report["provenance"] = kvflow::bench::Provenance(argv);
  report["model"] = setup.model.name;
  report["model_path"] = setup.model.path;
  report["machine"] = MachineJson(opt.num_threads);
  report["trace"] = setup.trace.info;
  report["arrival_seed"] = opt.seed + 1;
  report["rates_req_s"] = Json::array();
  for (double rate : rates) report["rates_req_s"].push_back(RateJson(rate));
  report["config"] = opt.serving.ToJson();
  report["repeats"] = http.repeats;
  report["server"] = server.info;
  report["client"] = ClientDescription();
  report["runs"] = runs;
  report["server_exit"] = StopServer(server, http.shutdown_timeout_s);

  const std::string md = CompareMarkdown(report);
  std::fputs(md.c_str(), stdout);
  const fs::path base = fs::path(opt.out_dir) / BaseName(setup.trace.name, "http_vs_library", opt.tag);
  for (const auto& [ext, text] : {std::pair{".json", report.dump(2) + "\n"}, std::pair{".md", md}}) {
    if (Status st = WriteFile(base.string() + ext, text); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
  }
  std::fprintf(stderr, "wrote %s.json and .md\n", base.c_str());
  int64_t failed = 0;
  for (const Json& r : runs) failed += r["library"]["failed"].get<int64_t>() + r["server"]["failed"].get<int64_t>();
  return ServingExitCode(failed, server.process == nullptr || server.process->exit_clean());
}

// ---- command line ---------------------------------------------------------------------------

// CLI::PositiveNumber reports a failure with its range spelled out up to DBL_MAX; this one says
// what is wrong.
CLI::Validator Positive() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        return end != value.c_str() && *end == '\0' && v > 0 ? "" : "'" + value + "' is not a number > 0";
      },
      "> 0", "POSITIVE");
}

CLI::Validator NonNegative() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        return end != value.c_str() && *end == '\0' && v >= 0 ? "" : "'" + value + "' is not a number >= 0";
      },
      ">= 0", "NONNEGATIVE");
}

void AddSweepOptions(CLI::App* cmd, SweepOptions& opt) {
  cmd->add_option("--trace", opt.trace, "Request trace: sharegpt (synthetic ShareGPT-like lengths) or alpaca")
      ->check(CLI::IsMember({"sharegpt", "alpaca"}))
      ->capture_default_str();
  cmd->add_option("--alpaca-path", opt.alpaca_path,
                  "Alpaca JSON list of {instruction, input, output}; exit code 77 when missing")
      ->capture_default_str();
  cmd->add_option("--num-requests", opt.num_requests, "Requests in the trace")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--seed", opt.seed, "Seed of the trace sample and lengths (arrivals use seed + 1)")
      ->capture_default_str();
  cmd->add_option("--rates", opt.rates, "Comma-separated request rates (req/s) of the Poisson arrivals")
      ->delimiter(',')
      ->check(Positive())
      ->capture_default_str();
  std::vector<std::string> policy_names = kvflow::SchedulingPolicyNames();
  policy_names.push_back("s3+probe");
  cmd->add_option("--policies", opt.policies, "Comma-separated scheduling policies: " + Join(policy_names, ", ") +
                                                   " (s3+probe: s3 with --length-probe, real executor only)")
      ->delimiter(',')
      ->check(CLI::IsMember(policy_names))
      ->capture_default_str();
  cmd->add_flag("--require-complete", opt.require_complete, "Exit with code 3 when any request failed");
  cmd->add_option("--held-out-from", opt.held_out_from,
                  "Alpaca: draw the trace from the test_indices of this kvflow-length-predictor train report "
                  "(repeated as needed)");
  cmd->add_option("--length-predictor", opt.serving.length_predictor,
                  "s3: predictor file (kvflow-length-predictor train); none: untrained, learning online");
  cmd->add_option("--length-probe", opt.serving.length_probe,
                  "s3+probe: hidden-state probe file (kvflow-length-predictor train-probe) for the served model");
  cmd->add_option("--prediction-override", opt.serving.prediction_override,
                  "s3, robustness: distort every prediction: scale:F or bucket:B");
  cmd->add_flag("!--no-online-updates", opt.serving.online_updates, "s3: do not retrain the predictor online");
  cmd->add_option("--length-reservation", opt.serving.reservation_point,
                  "s3: reserve the upper or middle edge of the predicted bucket (default: the predictor's)")
      ->check(CLI::IsMember({"upper", "middle"}));
  cmd->add_option("--num-device-blocks", opt.serving.num_device_blocks,
                  "KV blocks on the device, shared by all policies (sim default: the cost model's KV budget)")
      ->check(Positive());
  cmd->add_option("--num-host-blocks", opt.serving.num_host_blocks,
                  "Swap space in blocks (0: no swapping; preemption then recomputes; -1: as many as the device)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()))
      ->capture_default_str();
  cmd->add_option("--block-size", opt.serving.block_size, "Tokens per KV block")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--max-num-seqs", opt.serving.max_num_seqs, "Sequences in one batch")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", opt.serving.max_num_batched_tokens, "Tokens in one batch")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-model-len", opt.serving.max_model_len,
                  "Prompt + output limit; longer trace requests are cut (the prompt gives way to the output)")
      ->check(CLI::Range(2, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--preemption-mode", opt.serving.preemption_mode,
                  "auto (recompute single sequences, swap groups), swap, or recompute")
      ->check(CLI::IsMember({"auto", "swap", "recompute"}))
      ->capture_default_str();
  cmd->add_option("--latency-bound-factor", opt.latency_bound_factor,
                  "Sustainable-rate bound: this many times paged's normalized latency at the lowest rate")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--latency-bound", opt.latency_bound,
                  "Sustainable-rate bound in s/token; overrides --latency-bound-factor")
      ->check(Positive());
  cmd->add_option("--out-dir", opt.out_dir, "Where serving_<trace>_<executor>[_<tag>].{json,md} go")
      ->capture_default_str();
  cmd->add_option("--tag", opt.tag, "Suffix of the output file names, to keep several runs of one trace apart");
}

}  // namespace

int main(int argc, char** argv) {
  // Logs to stderr: stdout carries the Markdown report.
  spdlog::set_default_logger(spdlog::stderr_color_mt("serving"));
  spdlog::set_level(spdlog::level::warn);
  const std::vector<std::string> args(argv, argv + argc);

  CLI::App app{"kvflow serving benchmark: replays a request trace with Poisson arrivals against the paged "
               "scheduler and the Orca baselines under one KV memory budget"};
  app.require_subcommand(1);

  SweepOptions sweep;
  CLI::App* sim = app.add_subcommand("sim", "Scheduler + block manager on a virtual clock with a step cost model");
  AddSweepOptions(sim, sweep);
  sim->add_option("--cost-model", sweep.cost_model,
                  "a100-opt13b (analytic, OPT-13B fp16 on one A100-40GB), S3's models on one A100-80GB "
                  "(analytic: a100-80g:gpt-j-6b, a100-80g:llama-13b, a100-80g:gpt-neox-20b, a100-80g:llama-33b) "
                  "or cpu-measured:<json from calibrate>")
      ->capture_default_str();
  CLI::Option* tokenizer_opt =
      sim->add_option("--tokenizer", sweep.tokenizer,
                      "Model whose tokenizer measures Alpaca lengths (default falls back to tiny-random, byte-level)")
          ->capture_default_str();

  CLI::App* real = app.add_subcommand("real", "The real Engine on this CPU, in wall-clock time");
  AddSweepOptions(real, sweep);
  CLI::Option* real_model_opt =
      real->add_option("--model", sweep.model, "Model path or short name (default falls back to tiny-random)")
          ->capture_default_str();
  real->add_option("--num-threads", sweep.num_threads, "CPU threads (0: all cores)")
      ->check(NonNegative())
      ->capture_default_str();

  HttpOptions http;
  auto add_http_options = [&](CLI::App* cmd) {
    AddSweepOptions(cmd, sweep);
    cmd->add_option("--model", sweep.model, "Model path or short name (default falls back to tiny-random)")
        ->capture_default_str();
    cmd->add_option("--num-threads", sweep.num_threads, "CPU threads of the engine (server --threads; 0: all cores)")
        ->check(NonNegative())
        ->capture_default_str();
    cmd->add_option("--server-binary", http.server_binary,
                    "kvflow-server to start (default: <build>/kvflow-server beside this binary's bench/ dir; "
                    "exit code 77 when missing)");
    cmd->add_option("--url", http.url, "Attach to a running server at http://HOST:PORT instead of starting one");
    cmd->add_option("--served-model-name", http.served_model_name,
                    "\"model\" of the requests (default: the --model name; attached: the first of /v1/models)");
    cmd->add_option("--api-key", http.api_key, "Bearer token for /v1/* (default: $KVFLOW_API_KEY)");
    cmd->add_option("--server-arg", http.server_args, "Extra argument for the started server (repeatable)")
        ->allow_extra_args(false);
    cmd->add_option("--server-log", http.server_log,
                    "Where the started server's stdout/stderr go (default: a file in the temp dir)");
    cmd->add_option("--startup-timeout", http.startup_timeout_s, "Seconds for the server to start listening")
        ->check(Positive())
        ->capture_default_str();
    cmd->add_option("--run-timeout", http.run_timeout_s, "Seconds one rate's replay may take")
        ->check(Positive())
        ->capture_default_str();
    cmd->add_option("--shutdown-timeout", http.shutdown_timeout_s, "Seconds for the server to exit after SIGTERM")
        ->check(Positive())
        ->capture_default_str();
  };
  CLI::App* http_cmd = app.add_subcommand(
      "http", "kvflow-server over HTTP (streamed /v1/completions), started with the real executor's engine "
              "configuration or attached with --url; policy paged only");
  add_http_options(http_cmd);
  CLI::App* compare_cmd = app.add_subcommand(
      "compare", "The real executor (library) and the http executor (server) back to back on the same trace and "
                 "rates; writes serving_<trace>_http_vs_library[_<tag>].{json,md}");
  add_http_options(compare_cmd);
  compare_cmd->add_option("--repeats", http.repeats, "Library + server runs per rate (the ratio's spread)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();

  CalibrationOptions calib;
  CLI::App* calibrate =
      app.add_subcommand("calibrate", "Times Engine::Step() on this CPU and fits the sim's cost model");
  CLI::Option* calib_model_opt =
      calibrate->add_option("--model", calib.model, "Model path or short name (default falls back to tiny-random)")
          ->capture_default_str();
  calibrate->add_option("--prefill-lens", calib.prefill_lens, "Comma-separated prompt lengths of one-sequence prefills")
      ->delimiter(',')
      ->check(Positive())
      ->capture_default_str();
  calibrate->add_option("--decode-batches", calib.decode_batches, "Comma-separated decode batch sizes")
      ->delimiter(',')
      ->check(Positive())
      ->capture_default_str();
  calibrate->add_option("--decode-contexts", calib.decode_contexts, "Comma-separated decode context lengths")
      ->delimiter(',')
      ->check(Positive())
      ->capture_default_str();
  calibrate->add_option("--reps", calib.reps, "Timed repetitions per shape (after one warm-up)")
      ->check(Positive())
      ->capture_default_str();
  calibrate->add_option("--num-threads", calib.num_threads, "CPU threads (0: all cores)")
      ->check(NonNegative())
      ->capture_default_str();
  calibrate->add_option("--out-dir", calib.out_dir, "Where serving_costmodel_<model>.json goes")->capture_default_str();

  CLI11_PARSE(app, argc, argv);
  if (sim->parsed()) return RunSim(sweep, tokenizer_opt->count() > 0, args);
  if (real->parsed()) return RunReal(sweep, real_model_opt->count() > 0, args);
  for (CLI::App* cmd : {http_cmd, compare_cmd}) {
    if (!cmd->parsed()) continue;
    if (cmd->get_option("--policies")->count() > 0 && sweep.policies != std::vector<std::string>{"paged"}) {
      spdlog::error("--policies: the {} executor runs the server's scheduler, paged only", cmd->get_name());
      return 2;
    }
    sweep.policies = {"paged"};
    const bool model_explicit = cmd->get_option("--model")->count() > 0;
    return cmd == http_cmd ? RunHttp(sweep, http, model_explicit, args)
                           : RunCompare(sweep, http, model_explicit, args);
  }
  return RunCalibrate(calib, calib_model_opt->count() > 0, args);
}
