// The http executor: a kvflow-server started or attached, and the trace replayed against it over streamed /v1/completions.
#include "serving/http_executor.h"

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

#include "serving/real_executor.h"

namespace kvflow::bench::serving {

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

Result<std::unique_ptr<ServerProcess>> ServerProcess::Start(const std::string& binary, const std::vector<std::string>& args,
                                                    const std::vector<std::pair<std::string, std::string>>& env,
                                                    const fs::path& log_path, double timeout_s) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->log_path_ = log_path;
  std::error_code ec;
  fs::create_directories(log_path.parent_path(), ec);
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return Status::IoError(ErrnoText("cannot open " + log_path.string()));
  std::vector<std::string> argv_s{binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    return Status::IoError(ErrnoText("fork"));
  }
  if (pid == 0) {
    // The server must not outlive the benchmark (SIGTERM lets it shut down cleanly).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    execv(binary.c_str(), argv.data());
    std::fprintf(stderr, "exec %s: %s\n", binary.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(log_fd);
  server->pid_ = pid;

  const auto start = Clock::now();
  const std::string marker = "listening on http://";
  while (true) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      server->pid_ = -1;
      return Status::Internal("kvflow-server exited during startup (" + DescribeExit(status) + "); log " +
                              log_path.string() + ":\n" + server->LogTail(2000));
    }
    const std::string log = server->Log();
    if (const size_t at = log.find(marker); at != std::string::npos) {
      const size_t end = log.find_first_of(" \t\r\n", at + marker.size());
      if (end != std::string::npos) {
        auto ep = ParseUrl(log.substr(at + marker.size() - 7, end - (at + marker.size() - 7)));
        if (!ep.ok()) return Status::Internal("cannot parse the server's listening line: " + ep.status().ToString());
        server->endpoint_ = ep.value();
        break;
      }
    }
    if (SecondsSince(start) > timeout_s) {
      return Status::Internal("kvflow-server printed no 'listening on http://HOST:PORT' within " +
                              Fixed(timeout_s, 0) + " s; log " + log_path.string() + ":\n" + server->LogTail(2000));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server->startup_s_ = SecondsSince(start);
  return server;
}

std::string ServerProcess::Stop(double timeout_s) {
  if (pid_ <= 0) return "not running";
  kill(pid_, SIGTERM);
  const auto start = Clock::now();
  int status = 0;
  while (waitpid(pid_, &status, WNOHANG) != pid_) {
    if (SecondsSince(start) > timeout_s) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      pid_ = -1;
      return "did not exit within " + Fixed(timeout_s, 0) + " s of SIGTERM; killed";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  pid_ = -1;
  exit_clean_ = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return DescribeExit(status) + " " + Fixed(SecondsSince(start), 2) + " s after SIGTERM";
}

double ServerProcess::CpuSeconds() const {
  std::ifstream in("/proc/" + std::to_string(pid_) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0.0;
  std::istringstream fields(stat.substr(paren + 2));
  std::string f;
  double utime = 0, stime = 0;
  for (int i = 3; fields >> f; ++i) {  // field 3 is the state; 14 utime, 15 stime
    if (i == 14) utime = std::strtod(f.c_str(), nullptr);
    if (i == 15) {
      stime = std::strtod(f.c_str(), nullptr);
      break;
    }
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string ServerProcess::Log() const {
  std::ifstream in(log_path_);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string ServerProcess::LogTail(size_t bytes) const {
  const std::string log = Log();
  return log.size() <= bytes ? log : "..." + log.substr(log.size() - bytes);
}

std::string ServerProcess::DescribeExit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::string DefaultServerBinary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);  // <build>/bench/kvflow_bench_serving
  if (ec) return "kvflow-server";
  return (self.parent_path().parent_path() / "kvflow-server").string();
}
namespace {

// The server's engine flags for `cfg`: exactly what MakeEngineConfig gives the real executor.
Result<std::vector<std::string>> ServerEngineArgs(const ServingConfig& cfg, const ModelChoice& model,
                                                  int num_threads, size_t num_requests, const std::string& binary) {
  std::vector<std::string> args{"--model", model.path,
                                "--served-model-name", model.name,
                                "--host", "127.0.0.1",
                                "--port", "0",
                                "--device", "cpu",
                                "--num-kv-blocks", std::to_string(cfg.num_device_blocks),
                                "--block-size", std::to_string(cfg.block_size),
                                "--max-num-seqs", std::to_string(cfg.max_num_seqs),
                                "--max-num-batched-tokens", std::to_string(cfg.max_num_batched_tokens),
                                "--max-model-len", std::to_string(cfg.max_model_len),
                                "--preemption-mode", cfg.preemption_mode,
                                "--threads", std::to_string(num_threads),
                                "--seed", "0",
                                // Every trace request may wait at once (rate inf): none may get 503.
                                "--max-queue-len", std::to_string(std::max<size_t>(256, num_requests + 16)),
                                "--max-connections", std::to_string(std::max<size_t>(512, num_requests + 64))};
  // The host (swap) pool in blocks, like EngineConfig::num_host_kv_blocks. Without that flag only
  // an empty pool can be asked for exactly (--swap-space 0).
  bool has_host_blocks_flag = false;
  {
    int pipe_fds[2];
    if (pipe(pipe_fds) == 0) {
      const pid_t pid = fork();
      if (pid == 0) {
        dup2(pipe_fds[1], STDOUT_FILENO);
        dup2(pipe_fds[1], STDERR_FILENO);
        close(pipe_fds[0]);
        execl(binary.c_str(), binary.c_str(), "--help", static_cast<char*>(nullptr));
        _exit(127);
      }
      close(pipe_fds[1]);
      std::string help;
      char buf[4096];
      for (ssize_t r; (r = read(pipe_fds[0], buf, sizeof(buf))) > 0;) help.append(buf, static_cast<size_t>(r));
      close(pipe_fds[0]);
      if (pid > 0) waitpid(pid, nullptr, 0);
      has_host_blocks_flag = help.find("--num-host-kv-blocks") != std::string::npos;
    }
  }
  if (has_host_blocks_flag) {
    args.insert(args.end(), {"--num-host-kv-blocks", std::to_string(cfg.num_host_blocks)});
  } else if (cfg.num_host_blocks == 0) {
    args.insert(args.end(), {"--swap-space", "0"});
  } else {
    return Status::InvalidArgument("--num-host-blocks " + std::to_string(cfg.num_host_blocks) + ": " + binary +
                                   " has no --num-host-kv-blocks flag, so only an empty swap pool (0) matches the "
                                   "library's configuration exactly");
  }
  return args;
}

// Checks the server's pools and context length against `cfg` (reads /v1/models and /metrics).
std::vector<std::string> CheckServerConfig(const ServerSession& s, const ServingConfig& cfg, Json& seen) {
  std::vector<std::string> problems;
  auto models = HttpCall(s.endpoint, "GET", "/v1/models", "", s.api_key, 10);
  if (!models.ok() || models->status != 200) {
    problems.push_back("GET /v1/models failed: " +
                       (models.ok() ? "HTTP " + std::to_string(models->status) : models.status().ToString()));
  } else {
    const Json j = Json::parse(models->body, nullptr, false);
    bool found = false;
    if (j.is_object() && j.contains("data") && j["data"].is_array()) {
      for (const Json& m : j["data"]) {
        if (!m.is_object() || m.value("id", "") != s.model_name) continue;
        found = true;
        seen["max_model_len"] = m.value("max_model_len", Json(nullptr));
        if (!m.contains("max_model_len") || !m["max_model_len"].is_number_integer() ||
            m["max_model_len"].get<int64_t>() != cfg.max_model_len) {
          problems.push_back("max_model_len " + m.value("max_model_len", Json(nullptr)).dump() + ", expected " +
                             std::to_string(cfg.max_model_len));
        }
      }
    }
    if (!found) problems.push_back("GET /v1/models does not list '" + s.model_name + "': " + models->body);
  }
  auto metrics = s.Metrics();
  if (!metrics.ok()) {
    problems.push_back(metrics.status().ToString());
    return problems;
  }
  const std::pair<const char*, int> expected[] = {{"kvflow:kv_cache_blocks_total", cfg.num_device_blocks},
                                                  {"kvflow:host_kv_cache_blocks_total", cfg.num_host_blocks}};
  for (const auto& [name, want] : expected) {
    const auto v = MetricValue(metrics.value(), name);
    seen[name] = v ? Json(*v) : Json(nullptr);
    if (!v || *v != want) {
      problems.push_back(std::string(name) + " = " + (v ? Fixed(*v, 0) : "absent") + ", expected " +
                         std::to_string(want));
    }
  }
  return problems;
}
}  // namespace

Result<ServerSession> OpenServerSession(const HttpOptions& http, const ServingConfig& cfg, const ModelChoice& model,
                                        int num_threads, size_t num_requests, const std::string& out_dir) {
  ServerSession s;
  s.api_key = http.api_key;
  if (s.api_key.empty()) {
    if (const char* k = std::getenv("KVFLOW_API_KEY")) s.api_key = k;
  }
  if (!http.url.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(s.endpoint, ParseUrl(http.url));
    s.info = Json{{"mode", "attached"}, {"url", s.endpoint.url()}};
  } else {
    const std::string binary = http.server_binary.empty() ? DefaultServerBinary() : http.server_binary;
    std::error_code ec;
    if (!fs::exists(binary, ec)) {
      return Status::NotFound("no kvflow-server at " + binary +
                              " (build the kvflow-server target, or pass --server-binary or --url)");
    }
    KVFLOW_ASSIGN_OR_RETURN(std::vector<std::string> args,
                            ServerEngineArgs(cfg, model, num_threads, num_requests, binary));
    args.insert(args.end(), http.server_args.begin(), http.server_args.end());
    const fs::path log = http.server_log.empty()
                             ? fs::temp_directory_path() / ("kvflow_bench_server_" + std::to_string(getpid()) + ".log")
                             : fs::path(http.server_log);
    // kvflow-server applies --threads on its main thread (omp_set_num_threads), but its engine
    // thread steps with OpenMP's default team (all cores). OMP_NUM_THREADS gives the engine thread
    // the library's thread count too; harmless once the server sets it on the engine thread.
    std::vector<std::pair<std::string, std::string>> env;
    if (num_threads > 0 && std::getenv("OMP_NUM_THREADS") == nullptr) {
      env.emplace_back("OMP_NUM_THREADS", std::to_string(num_threads));
    }
    std::string env_text;
    for (const auto& [name, value] : env) env_text += name + "=" + value + " ";
    std::fprintf(stderr, "starting %s%s %s\n", env_text.c_str(), binary.c_str(), Join(args, " ").c_str());
    KVFLOW_ASSIGN_OR_RETURN(s.process, ServerProcess::Start(binary, args, env, log, http.startup_timeout_s));
    s.endpoint = s.process->endpoint();
    s.info = Json{{"mode", "started by the benchmark"},
                  {"binary", fs::weakly_canonical(binary, ec).string()},
                  {"args", args},
                  {"env", env_text.empty() ? Json(nullptr) : Json(env_text.substr(0, env_text.size() - 1))},
                  {"url", s.endpoint.url()},
                  {"log", log.string()}};
  }
  (void)out_dir;
  // Ready once /health says 200.
  const auto start = Clock::now();
  std::string last;
  while (true) {
    auto health = HttpCall(s.endpoint, "GET", "/health", "", s.api_key, 5);
    if (health.ok() && health->status == 200) break;
    last = health.ok() ? "HTTP " + std::to_string(health->status) : health.status().ToString();
    if (SecondsSince(start) > http.startup_timeout_s) {
      return Status::Internal("GET " + s.endpoint.url() + "/health not 200 within " +
                              Fixed(http.startup_timeout_s, 0) + " s: " + last);
    }
    if (s.process && waitpid(s.process->pid(), nullptr, WNOHANG) == s.process->pid()) {
      return Status::Internal("kvflow-server exited before /health answered 200");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (s.process) s.info["startup_s"] = s.process->startup_s();

  // The served name: ours, or the attached server's (first listed) unless given.
  s.model_name = http.served_model_name.empty() ? model.name : http.served_model_name;
  if (!s.process && http.served_model_name.empty()) {
    auto models = HttpCall(s.endpoint, "GET", "/v1/models", "", s.api_key, 10);
    if (models.ok() && models->status == 200) {
      const Json j = Json::parse(models->body, nullptr, false);
      if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty()) {
        s.model_name = j["data"][0].value("id", s.model_name);
      }
    }
  }
  s.info["served_model_name"] = s.model_name;
  Json seen = Json::object();
  const std::vector<std::string> problems = CheckServerConfig(s, cfg, seen);
  s.info["observed"] = seen;
  if (!problems.empty()) {
    if (s.process) {
      return Status::Internal("the server's configuration differs from the library's: " + Join(problems, "; "));
    }
    for (const std::string& p : problems) spdlog::warn("attached server: {}", p);
    s.warnings = problems;
    s.info["config_mismatches"] = problems;
  }
  return s;
}
Status WarmUpServer(const ServerSession& s) {
  const Json body{{"model", s.model_name}, {"prompt", "warm-up"}, {"max_tokens", 4}, {"temperature", 0},
                  {"ignore_eos", true}};
  KVFLOW_ASSIGN_OR_RETURN(HttpResponse r, HttpCall(s.endpoint, "POST", "/v1/completions", body.dump(), s.api_key, 120));
  if (r.status != 200) return Status::Internal("warm-up request: HTTP " + std::to_string(r.status) + ": " + r.body);
  return Status::Ok();
}
namespace {

// Waits until the server holds no request and every KV block is free again. Returns what is left
// over after `timeout_s` (empty: idle).
std::string WaitServerIdle(const ServerSession& s, double timeout_s) {
  const auto start = Clock::now();
  std::string why;
  while (true) {
    auto metrics = s.Metrics();
    if (!metrics.ok()) return metrics.status().ToString();
    const std::string& m = metrics.value();
    auto get = [&](const char* name) { return MetricValue(m, name).value_or(-1.0); };
    const double running = get("kvflow:num_requests_running"), waiting = get("kvflow:num_requests_waiting"),
                 swapped = get("kvflow:num_requests_swapped"), in_flight = get("kvflow:num_requests_in_flight"),
                 total = get("kvflow:kv_cache_blocks_total"), free_blocks = get("kvflow:kv_cache_blocks_free");
    if (running == 0 && waiting == 0 && swapped == 0 && in_flight == 0 && free_blocks == total) return "";
    why = "running " + Fixed(running, 0) + ", waiting " + Fixed(waiting, 0) + ", swapped " + Fixed(swapped, 0) +
          ", in flight " + Fixed(in_flight, 0) + ", KV blocks free " + Fixed(free_blocks, 0) + " of " +
          Fixed(total, 0);
    if (SecondsSince(start) > timeout_s) return why;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}
}  // namespace

Result<RunRecord> RunHttpReplay(const Trace& trace, double rate, const ServerSession& server, double timeout_s,
                                const std::string& preemption_mode) {
  RunRecord run = NewRunRecord(trace, rate, "paged");
  const size_t n = run.requests.size();
  RaiseFileLimit(n);
  socklen_t addr_len = 0;
  KVFLOW_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(server.endpoint, addr_len));
  // Every request's bytes, built before the clock starts.
  std::vector<std::string> requests(n);
  for (size_t i = 0; i < n; ++i) {
    const Json body{{"model", server.model_name},
                    {"prompt", trace.requests[i].prompt},
                    {"max_tokens", trace.requests[i].output_len},
                    {"temperature", 0},
                    {"ignore_eos", true},
                    {"stream", true},
                    {"stream_options", {{"include_usage", true}}}};
    requests[i] = HttpRequestText(server.endpoint, "POST", "/v1/completions", body.dump(), server.api_key, true);
  }
  auto metrics_before = server.Metrics();
  const double server_cpu_before = server.CpuSeconds();
  const double client_cpu_before = ProcessCpuSeconds();
  const double machine_before = MachineBusyCpuSeconds();

  std::vector<std::unique_ptr<StreamConn>> conns(n);
  std::vector<StreamConn*> active;
  std::vector<double> send_lag;
  std::map<std::string, int64_t> failure_reasons;
  std::map<int, int64_t> status_codes;
  int64_t token_events = 0, empty_text_events = 0, completed_tokens = 0;
  size_t next = 0, settled = 0;
  const auto start = Clock::now();

  auto settle = [&](StreamConn& c, double now) {
    RequestTiming& t = run.requests[c.index];
    const int64_t want_prompt = static_cast<int64_t>(trace.requests[c.index].prompt.size());
    if (c.http.headers_done()) ++status_codes[c.http.status()];
    if (c.http.failed()) c.Problem(c.http.error());
    if (c.http.headers_done() && c.http.status() != 200) {
      std::string message = c.error_body.substr(0, 300);
      const Json j = Json::parse(c.error_body, nullptr, false);
      if (j.is_object() && j.contains("error") && j["error"].is_object()) {
        message = j["error"].value("message", message);
      }
      c.error = "HTTP " + std::to_string(c.http.status()) + ": " + message;
    } else if (c.error.empty()) {
      if (!c.http.done()) c.Problem("the response did not end");
      else if (c.sse.pending()) c.Problem("the stream ended inside an event");
      else if (c.finish_reason.empty()) c.Problem("no event with a finish_reason");
      else if (c.finish_reason != "length") c.Problem("finish_reason '" + c.finish_reason + "', expected 'length'");
      else if (c.completion_tokens < 0) c.Problem("no usage chunk (stream_options.include_usage)");
      else if (c.completion_tokens != t.output_len) {
        c.Problem("usage.completion_tokens " + std::to_string(c.completion_tokens) + " != max_tokens " +
                  std::to_string(t.output_len));
      } else if (c.prompt_tokens != want_prompt) {
        c.Problem("usage.prompt_tokens " + std::to_string(c.prompt_tokens) + " != " + std::to_string(want_prompt) +
                  " prompt ids sent");
      } else if (!c.saw_done) {
        c.Problem("no data: [DONE]");
      }
    }
    if (!c.error.empty()) {
      t.failed = true;
      if (run.first_error.empty()) run.first_error = "request " + std::to_string(c.index) + ": " + c.error;
      // Reasons grouped: by status code, or with their numbers left out.
      std::string kind;
      if (c.http.headers_done() && c.http.status() != 200) {
        kind = "HTTP " + std::to_string(c.http.status());
      } else {
        for (char ch : c.error) {
          if (!std::isdigit(static_cast<unsigned char>(ch))) kind += ch;
          else if (kind.empty() || kind.back() != 'N') kind += 'N';
        }
      }
      ++failure_reasons[kind.substr(0, 120)];
    } else {
      completed_tokens += t.output_len;
      if (t.finish_s < 0) t.finish_s = now;
    }
    token_events += c.token_events;
    empty_text_events += c.empty_text_events;
    if (c.sent_s >= 0) send_lag.push_back(c.sent_s - t.arrival_s);
    if (c.fd >= 0) close(c.fd);
    c.fd = -1;
    ++settled;
  };

  auto launch = [&](size_t i, double now) {
    auto c = std::make_unique<StreamConn>();
    c->index = i;
    StreamConn* raw = c.get();
    RequestTiming& t = run.requests[i];
    raw->sse.on_data = [raw, &t](const std::string& data) {
      const double now = raw->recv_s;
      if (raw->saw_done) {
        raw->Problem("data after [DONE]");
        return;
      }
      if (data == "[DONE]") {
        raw->saw_done = true;
        return;
      }
      const Json j = Json::parse(data, nullptr, false);
      if (!j.is_object()) {
        raw->Problem("SSE data is not a JSON object: " + data.substr(0, 120));
        return;
      }
      if (j.contains("error")) {
        raw->Problem("error event: " + j["error"].dump().substr(0, 200));
        return;
      }
      if (j.contains("choices") && j["choices"].is_array()) {
        for (const Json& choice : j["choices"]) {
          if (!choice.is_object()) continue;
          ++raw->token_events;
          const Json* text = choice.contains("text") ? &choice["text"] : nullptr;
          if (text == nullptr || !text->is_string() || text->get_ref<const std::string&>().empty()) {
            ++raw->empty_text_events;
          }
          if (t.first_token_s < 0) t.first_token_s = now;
          if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
            if (!raw->finish_reason.empty()) raw->Problem("two events with a finish_reason");
            raw->finish_reason = choice["finish_reason"].get<std::string>();
            t.finish_s = now;
          }
        }
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        raw->completion_tokens = j["usage"].value("completion_tokens", int64_t{-1});
        raw->prompt_tokens = j["usage"].value("prompt_tokens", int64_t{-1});
      }
    };
    raw->http.on_body = [raw](std::string_view bytes) {
      if (raw->http.status() == 200 && raw->http.Header("content-type").rfind("text/event-stream", 0) == 0) {
        raw->sse.Feed(bytes);
      } else {
        if (raw->http.status() == 200) raw->Problem("HTTP 200 but Content-Type '" + raw->http.Header("content-type") +
                                                    "', expected text/event-stream");
        if (raw->error_body.size() < 65536) raw->error_body.append(bytes.data(), bytes.size());
      }
    };
    conns[i] = std::move(c);
    raw->fd = OpenSocket(addr, addr_len, /*nonblocking=*/true);
    if (raw->fd < 0) {
      raw->Problem(ErrnoText("connect"));
      settle(*raw, now);
      return;
    }
    active.push_back(raw);
  };

  double now = 0.0;
  std::vector<pollfd> fds;
  char buf[65536];
  while (settled < n) {
    now = SecondsSince(start);
    for (; next < n && run.requests[next].arrival_s <= now; ++next) launch(next, now);
    if (now > timeout_s) {
      for (StreamConn* c : active) {
        c->Problem("no end of the stream within --run-timeout " + Fixed(timeout_s, 0) + " s");
        settle(*c, now);
      }
      active.clear();
      for (; next < n; ++next) {
        run.requests[next].failed = true;
        ++settled;
      }
      break;
    }
    if (active.empty() && next < n) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(run.requests[next].arrival_s)));
      continue;
    }
    fds.clear();
    for (StreamConn* c : active) {
      const bool writing = c->written < requests[c->index].size();
      fds.push_back(pollfd{c->fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
    }
    double wait_s = std::min(1.0, timeout_s - now);
    if (next < n) wait_s = std::min(wait_s, run.requests[next].arrival_s - now);
    wait_s = std::max(0.0, wait_s);
    timespec ts{static_cast<time_t>(wait_s), static_cast<long>(1e9 * (wait_s - std::floor(wait_s)))};
    const int ready = ppoll(fds.data(), fds.size(), &ts, nullptr);
    if (ready < 0 && errno != EINTR) return Status::IoError(ErrnoText("ppoll"));
    if (ready <= 0) continue;
    bool any_settled = false;
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      StreamConn& c = *active[k];
      const std::string& request = requests[c.index];
      if (c.written < request.size()) {
        if (!c.connected) {
          int err = 0;
          socklen_t len = sizeof(err);
          getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err != 0) {
            c.Problem(std::string("connect: ") + std::strerror(err));
            settle(c, SecondsSince(start));
            any_settled = true;
            continue;
          }
          c.connected = true;
        }
        const ssize_t w = send(c.fd, request.data() + c.written, request.size() - c.written, MSG_NOSIGNAL);
        if (w < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (w < 0) {
          c.Problem(ErrnoText("send"));
          settle(c, SecondsSince(start));
          any_settled = true;
          continue;
        }
        c.written += static_cast<size_t>(w);
        if (c.written == request.size()) c.sent_s = SecondsSince(start);
        continue;
      }
      // Readable (or hung up): drain the socket.
      bool finished = false;
      while (!finished) {
        const ssize_t r = recv(c.fd, buf, sizeof(buf), 0);
        now = SecondsSince(start);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EAGAIN) break;
        if (r < 0) {
          c.Problem(ErrnoText("recv"));
          finished = true;
        } else if (r == 0) {
          c.http.Eof();
          finished = true;
        } else {
          c.recv_s = now;
          c.http.Feed(std::string_view(buf, static_cast<size_t>(r)));
          finished = c.http.done() || c.http.failed();
        }
      }
      if (finished) {
        settle(c, now);
        any_settled = true;
      }
    }
    if (any_settled) {
      active.erase(std::remove_if(active.begin(), active.end(), [](StreamConn* c) { return c->fd < 0; }),
                   active.end());
    }
  }
  run.wall_s = SecondsSince(start);
  const double client_cpu = ProcessCpuSeconds() - client_cpu_before;
  const double server_cpu = server.CpuSeconds() - server_cpu_before;
  const double machine_busy = MachineBusyCpuSeconds() - machine_before;

  // Server-side counters over the run; preemptions by the mode (the server reports one total; with
  // n = 1, auto preempts by recomputation).
  const std::string idle = WaitServerIdle(server, 5.0);
  auto metrics_after = server.Metrics();
  Json server_side = Json::object();
  if (metrics_before.ok() && metrics_after.ok()) {
    auto delta = [&](const char* name) -> Json {
      const auto a = MetricValue(metrics_before.value(), name), b = MetricValue(metrics_after.value(), name);
      if (!a || !b) return nullptr;
      return *b - *a;
    };
    server_side = Json{{"preemptions", delta("kvflow:num_preemptions_total")},
                       {"generation_tokens", delta("kvflow:generation_tokens_total")},
                       {"prompt_tokens", delta("kvflow:prompt_tokens_total")},
                       {"request_success", delta("kvflow:request_success_total")},
                       {"request_failure", delta("kvflow:request_failure_total")},
                       {"request_cancelled", delta("kvflow:request_cancelled_total")}};
    if (server_side["prompt_tokens"].is_number()) {
      run.extra["prefill_tokens"] = static_cast<int64_t>(server_side["prompt_tokens"].get<double>());
    }
    const Json& p = server_side["preemptions"];
    if (p.is_number()) {
      (preemption_mode == "swap" ? run.preemptions_swap : run.preemptions_recompute) =
          static_cast<int64_t>(p.get<double>());
    }
  }
  Json statuses = Json::object();
  for (const auto& [code, count] : status_codes) statuses[std::to_string(code)] = count;
  run.extra["http"] = Json{{"send_lag_s", Distribution(send_lag)},
                           {"token_events", token_events},
                           {"token_events_per_output_token",
                            completed_tokens > 0 ? Json(static_cast<double>(token_events) /
                                                        static_cast<double>(completed_tokens))
                                                 : Json(nullptr)},
                           {"empty_text_events", empty_text_events},
                           {"status_codes", statuses},
                           {"failure_reasons", failure_reasons},
                           {"server_counters", server_side},
                           {"server_idle_after_run", idle.empty() ? Json(true) : Json(idle)}};
  run.extra["client_cpu_s"] = client_cpu;
  if (server.process) run.extra["server_cpu_s"] = server_cpu;
  run.extra["machine_busy_cpu_s"] = machine_busy;
  // Attached servers are other load too (their CPU is not known here).
  run.extra["other_load_cores"] = OtherLoadCores(machine_busy, client_cpu + server_cpu, run.wall_s);
  if (!idle.empty()) spdlog::warn("the server is not idle 5 s after the run: {}", idle);
  return run;
}

}  // namespace kvflow::bench::serving
