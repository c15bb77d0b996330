// The http executor: a kvflow-server started or attached, and the trace replayed against it over streamed /v1/completions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "serving/common.h"
#include "serving/trace.h"
#include "serving/run_record.h"
#include "serving/http_client.h"

namespace kvflow::bench::serving {

// A kvflow-server this benchmark started: stderr and stdout go to a log file, from which the
// listening line gives the port.
class ServerProcess {
 public:
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess();

  // `env`: NAME=VALUE pairs added to the server's environment.
  static Result<std::unique_ptr<ServerProcess>> Start(const std::string& binary, const std::vector<std::string>& args,
                                                      const std::vector<std::pair<std::string, std::string>>& env,
                                                      const fs::path& log_path, double timeout_s);

  // SIGTERM, then waits up to timeout_s for the exit (SIGKILL after that). Returns how it ended.
  std::string Stop(double timeout_s);

  // User + system CPU seconds of the server (all its threads) so far.
  double CpuSeconds() const;

  std::string Log() const;
  std::string LogTail(size_t bytes) const;

  const Endpoint& endpoint() const { return endpoint_; }
  pid_t pid() const { return pid_; }
  double startup_s() const { return startup_s_; }
  bool exit_clean() const { return exit_clean_; }
  const fs::path& log_path() const { return log_path_; }

  static std::string DescribeExit(int status);

 private:
  ServerProcess() = default;
  pid_t pid_ = -1;
  fs::path log_path_;
  Endpoint endpoint_;
  double startup_s_ = 0;
  bool exit_clean_ = false;
};

struct HttpOptions {
  std::string url;                // attach to this server instead of starting one
  std::string server_binary;      // default: <build>/kvflow-server beside this binary's bench/ dir
  std::vector<std::string> server_args;  // appended to the server's command line
  std::string served_model_name;  // attached servers: default from GET /v1/models
  std::string api_key;            // default: $KVFLOW_API_KEY
  std::string server_log;         // default: <out-dir>/server logs under the temp dir
  double startup_timeout_s = 300;
  double run_timeout_s = 3600;
  double shutdown_timeout_s = 60;
  int repeats = 1;  // compare: library + server runs per rate
};

std::string DefaultServerBinary();

// The server a run talks to: started here (the real executor's engine configuration) or attached.
struct ServerSession {
  Endpoint endpoint;
  std::string model_name;  // "model" of every request
  std::string api_key;
  std::unique_ptr<ServerProcess> process;  // null when attached
  Json info;                               // for the report
  std::vector<std::string> warnings;       // config mismatches seen on an attached server

  double CpuSeconds() const { return process ? process->CpuSeconds() : 0.0; }

  Result<std::string> Metrics() const {
    KVFLOW_ASSIGN_OR_RETURN(HttpResponse r, HttpCall(endpoint, "GET", "/metrics", "", api_key, 10));
    if (r.status != 200) return Status::Internal("GET /metrics: HTTP " + std::to_string(r.status));
    return r.body;
  }
};

Result<ServerSession> OpenServerSession(const HttpOptions& http, const ServingConfig& cfg, const ModelChoice& model,
                                        int num_threads, size_t num_requests, const std::string& out_dir);

// Mirrors RunEngine's warm-up: one short greedy request.
Status WarmUpServer(const ServerSession& s);

// One streamed request in flight.
struct StreamConn {
  size_t index = 0;
  int fd = -1;
  size_t written = 0;
  bool connected = false;
  double sent_s = -1;  // request fully written
  double recv_s = -1;  // when the bytes being parsed arrived
  HttpResponseParser http;
  SseParser sse;
  std::string error_body;  // of a non-200 response
  bool saw_done = false;   // data: [DONE]
  int64_t token_events = 0;
  int64_t empty_text_events = 0;
  std::string finish_reason;
  int64_t completion_tokens = -1;
  int64_t prompt_tokens = -1;
  std::string error;  // the first problem seen
  void Problem(const std::string& why) {
    if (error.empty()) error = why;
  }
};

// Replays the trace against the server: request i is sent at its arrival time on its own connection.
Result<RunRecord> RunHttpReplay(const Trace& trace, double rate, const ServerSession& server, double timeout_s,
                                const std::string& preemption_mode);

}  // namespace kvflow::bench::serving
