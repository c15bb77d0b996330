// kvflow-server: an OpenAI-compatible HTTP server over kvflow::AsyncEngine.
//
//   kvflow-server --model smollm2-135m --port 8000
//   curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
//        -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16}'
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "kv_runahead/prompt_prefill_service.h"
#include "model_parallel/model_parallel_service.h"
#include "distributed/world.h"
#include "cli/engine_flags.h"
#include "kvflow/async_engine.h"
#include "server/http_server.h"
#include "server/openai_server.h"

namespace {

struct Options {
  kvflow::EngineConfig engine;
  kvflow::AsyncEngineOptions async;
  kvflow::server::HttpServerOptions http;
  kvflow::server::OpenAiServerOptions api;
  double swap_space_gib = 4.0;
  double shutdown_timeout_s = 30.0;
  bool verbose = false;
};

// Signals may land on any thread (OpenBLAS starts its own before main), so they are caught by a
// handler on whichever thread gets them and passed to the main thread through a pipe.
int g_signal_pipe[2] = {-1, -1};
// Written to the signal pipe by the job-broken handler (no signal has this number).
constexpr char kJobBroken = 127;
std::atomic<int> g_signals_seen{0};

void OnSignal(int sig) {
  if (g_signals_seen.fetch_add(1) > 0) {  // a second signal while draining means "now"
    constexpr char kMessage[] = "kvflow-server: second signal: exiting without finishing the requests\n";
    (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    _exit(1);
  }
  const char byte = static_cast<char>(sig);
  (void)!write(g_signal_pipe[1], &byte, 1);
}

int WaitForSignal() {
  char byte = 0;
  while (read(g_signal_pipe[0], &byte, 1) != 1) {
    if (errno != EINTR) return 0;
  }
  return static_cast<unsigned char>(byte);
}

int Serve(Options& opt) {
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) {
    spdlog::error("pipe: {}", std::strerror(errno));
    return 1;
  }
  struct sigaction action {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Under mpirun with --prefill-parallel, every rank but the last is a prefill worker; with
  // --tensor-parallel-size or --pipeline-parallel-size, every rank but rank 0 runs its share of the steps. mpirun forwards
  // SIGTERM to every rank: a worker leaves when the serving rank, shutting down, tells it.
  const bool prefill = !opt.engine.prefill_parallel.method.empty(), split = opt.engine.model_parallel_ranks() > 1;
  if (prefill || split) {
    auto world = kvflow::dist::ProcessWorldCommunicator();
    if (world.ok()) {
      const int rank = world.value()->rank();
      if ((prefill && rank + 1 < world.value()->size()) || (split && rank != 0)) {
        signal(SIGTERM, SIG_IGN);
        signal(SIGINT, SIG_IGN);
      }
    }
  }
  auto worker = kvflow::dist::RunPrefillWorkerIfNotLastRank(opt.engine);
  if (!worker.ok()) {
    spdlog::error("{}", worker.status().ToString());
    return 1;
  }
  if (worker.value()) return 0;
  // Under mpirun with --tensor-parallel-size / --pipeline-parallel-size, every rank but rank 0 runs
  // its share of each step.
  auto split_worker = kvflow::mp::RunModelParallelWorkerIfNotDriver(opt.engine);
  if (!split_worker.ok()) {
    spdlog::error("{}", split_worker.status().ToString());
    return 1;
  }
  if (split_worker.value()) return 0;
  spdlog::info("loading model '{}' on {}", opt.engine.model, opt.engine.device);
  const auto load_start = std::chrono::steady_clock::now();
  auto engine_or = kvflow::AsyncEngine::Create(opt.engine, opt.async);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    // The prefill workers wait for this rank: end the whole job.
    if (!opt.engine.prefill_parallel.method.empty() || opt.engine.model_parallel_ranks() > 1) kvflow::dist::AbortJob(1);
    return 1;
  }
  std::unique_ptr<kvflow::AsyncEngine> engine = std::move(engine_or).value();
  if (opt.api.served_model_name.empty()) opt.api.served_model_name = opt.engine.model;
  if (opt.api.api_key.empty()) {
    if (const char* key = std::getenv("KVFLOW_API_KEY")) opt.api.api_key = key;
  }
  auto api_or = kvflow::server::OpenAiServer::Create(engine.get(), opt.api);
  if (!api_or.ok()) {
    spdlog::error("{}", api_or.status().ToString());
    return 1;
  }
  auto api = std::move(api_or).value();
  kvflow::server::ServerMetrics* metrics = &api->metrics();
  opt.http.on_response = [metrics](int status) { metrics->RecordHttpStatus(status); };
  auto http_or = kvflow::server::HttpServer::Listen(
      opt.http, [&api](const kvflow::server::HttpRequest& req, kvflow::server::HttpExchange& ex) { api->Handle(req, ex); });
  if (!http_or.ok()) {
    spdlog::error("{}", http_or.status().ToString());
    return 1;
  }
  auto http = std::move(http_or).value();
  http->Start();
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  spdlog::info("listening on http://{}:{} | model '{}' ({}) loaded in {:.1f} s{}", opt.http.host, http->port(),
               opt.api.served_model_name, engine->Describe(), load_s,
               opt.api.api_key.empty() ? "" : " | API key required");

  // A tensor-parallel job whose worker stopped answering cannot compute again: its requests fail
  // with the reason, then the job ends (non-zero) instead of serving errors.
  kvflow::dist::SetJobBrokenHandler([](const kvflow::Status& why) {
    spdlog::error("ending the job: {}", why.ToString());
    const char byte = kJobBroken;
    (void)!write(g_signal_pipe[1], &byte, 1);
  });
  const int sig = WaitForSignal();
  const bool broken = sig == kJobBroken;
  spdlog::info("{}: refusing new connections; finishing {} request(s) (deadline {:.0f} s)",
               broken ? "the job is broken" : strsignal(sig), engine->num_unfinished(), opt.shutdown_timeout_s);
  http->StopAccepting();
  api->BeginShutdown();
  engine->Drain(std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(opt.shutdown_timeout_s)));
  http->Shutdown();
  const kvflow::EngineStats s = engine->stats();
  engine.reset();
  spdlog::info("stopped: {} prompt and {} generated tokens served", s.prompt_tokens_processed, s.generated_tokens);
  kvflow::dist::SetJobBrokenHandler(nullptr);
  if (broken) kvflow::dist::AbortJob(1);  // the other ranks may hang: mpirun ends them
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  opt.async.max_queue_len = 256;
  CLI::App app{
      "kvflow-server: OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,\n"
      "/metrics). Flags are spelled as vLLM spells them.\n\n"
      "  kvflow-server --model smollm2-135m --port 8000\n"};
  kvflow::AddEngineFlags(&app, &opt.engine, &opt.swap_space_gib);
  app.add_option("--served-model-name", opt.api.served_model_name, "Model name in the API (default: --model)");
  app.add_option("--host", opt.http.host, "Address to listen on")->default_val("127.0.0.1");
  app.add_option("--port", opt.http.port, "Port (0: any free one)")->default_val(8000);
  app.add_option("--api-key", opt.api.api_key, "Require 'Authorization: Bearer KEY' on /v1 (or env KVFLOW_API_KEY)");
  app.add_option("--chat-template", opt.api.chat_template, "The chat template: chatml, llama3, or a file (Jinja, or a tokenizer_config.json); default: the model's own");
  app.add_option("--tool-call-parser", opt.api.tool_call_parser,
                 "How the model writes tool calls: auto (from the chat template), hermes, qwen3_coder, llama3_json, "
                 "mistral, mistral_args, granite, functionary_v3_2, firefunction_v2, command_r7b, deepseek_r1, "
                 "generic")
      ->default_val("auto");
  app.add_option("--reasoning-parser", opt.api.reasoning_parser,
                 "Return the model's thinking as reasoning_content: auto (from the chat template), deepseek_r1, "
                 "qwen3, command_r7b, none (left in content)")
      ->default_val("auto");
  app.add_option("--seed", opt.engine.seed, "Seed for requests that bring none")->default_val(0);
  app.add_option("--max-queue-len", opt.async.max_queue_len, "Waiting requests beyond which new ones get 503 (0: no limit)")
      ->default_val(256);
  app.add_option("--max-request-body-bytes", opt.http.max_body_bytes, "Larger request bodies get 413")
      ->default_val(size_t{8} << 20);
  app.add_option("--max-connections", opt.http.max_connections, "Open connections beyond which new ones get 503")
      ->default_val(512);
  app.add_option("--shutdown-timeout", opt.shutdown_timeout_s,
                 "Seconds in-flight requests get to finish after SIGTERM before they are cancelled")->default_val(30.0);
  app.add_flag("-v,--verbose", opt.verbose, "Debug logging");
  CLI11_PARSE(app, argc, argv);

  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow-server"));
  spdlog::set_level(opt.verbose ? spdlog::level::debug : spdlog::level::info);
  kvflow::ApplySwapSpace(&opt.engine, opt.swap_space_gib);
  if (opt.shutdown_timeout_s < 0 || opt.http.max_connections < 1 || opt.http.max_body_bytes < 1) {
    spdlog::error("--shutdown-timeout must be >= 0, --max-connections and --max-request-body-bytes >= 1");
    return 2;
  }
  return Serve(opt);
}
