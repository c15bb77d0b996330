// What every piece of the serving benchmark shares: aliases, exit codes, result paths, number formatting, the machine description and the model choice.
#include "serving/common.h"

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
#include "util/thread_pool.h"

namespace kvflow::bench::serving {

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}
std::string Join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}
std::string Fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}
std::string Sig3(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}
std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown CPU";
}
Json MachineJson(int num_threads) {
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  return Json{{"cpu", CpuName()},
              {"hardware_threads", std::thread::hardware_concurrency()},
              {"engine_threads", num_threads > 0 ? num_threads : UsableCores()},
              {"omp_wait_policy", wait_policy ? wait_policy : "(unset)"}};
}
void WarnIfOmpSpins() {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    spdlog::warn("OMP_WAIT_POLICY is unset; for CPU timings run with OMP_WAIT_POLICY=passive");
  }
}
Result<ModelChoice> ChooseModel(const std::string& requested, bool explicitly_requested) {
  auto path = kvflow::ResolveModel(requested);
  if (!path.ok()) {
    if (explicitly_requested) return path.status();
    spdlog::warn("model '{}' not found (tools/fetch-model downloads it); using the built-in tiny-random model",
                 requested);
    return ModelChoice{kvflow::kTinyRandomName, kvflow::kTinyRandomName};
  }
  std::string name = requested;
  std::error_code ec;
  if (fs::exists(requested, ec)) {
    name = fs::path(requested).stem().string();
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  }
  return ModelChoice{name, path.value()};
}
Result<kvflow::ModelFiles> OpenModel(const ModelChoice& model) {
  if (model.path == kvflow::kTinyRandomName) return kvflow::MakeTinyRandomModel();
  return kvflow::OpenModelFiles(model.path);
}

}  // namespace kvflow::bench::serving
