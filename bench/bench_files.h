// Helpers shared by the benchmarks: whole files (spec_decode_bench.cc, triforce_bench.cc), the
// comma-separated lists of their options (triforce, kv_selection, cuda) and the provenance object
// every bench/results/*.json carries (tools/check-results-provenance checks it).
#pragma once

#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvflow::bench {

// The whole file (empty when it cannot be read: the callers check what they parse).
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// "a,,b" -> {"a", "b"}: the items of a comma-separated option, empty ones dropped.
inline std::vector<std::string> SplitCommaList(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The first line a shell command prints ("" when it fails or prints nothing).
inline std::string CommandOutputLine(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (p == nullptr) return "";
  char buf[512];
  std::string line = std::fgets(buf, sizeof buf, p) ? buf : "";
  const int rc = ::pclose(p);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return rc == 0 ? line : "";
}

// The argv as run, each argument quoted when the shell would split or expand it.
inline std::string ProvenanceCommand(const std::vector<std::string>& argv) {
  std::string out;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    const bool quote = a.empty() || a.find_first_of(" \t\"'$*?;&|<>()") != std::string::npos;
    if (i) out += ' ';
    out += quote ? "'" + a + "'" : a;
  }
  return out;
}

// `git rev-parse --short HEAD` of the source tree at run time, "-dirty" when tracked files differ
// (the binary may have been built from an older tree: the date and command tell the rest).
inline std::string ProvenanceCommit(const std::string& source_dir) {
  const std::string git = "git -C '" + source_dir + "' ";
  const std::string head = CommandOutputLine(git + "rev-parse --short HEAD");
  if (head.empty()) return "unknown (no git)";
  const std::string dirty = CommandOutputLine(git + "status --porcelain --untracked-files=no");
  return head + (dirty.empty() ? "" : "-dirty");
}

// Facts about the machine that do not name it: CPU model, cores, memory, GPU ("" -> null).
inline nlohmann::json ProvenanceMachine(const std::string& gpu_name = "") {
  std::string cpu = "unknown";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  nlohmann::json memory = nullptr;
  std::ifstream mem("/proc/meminfo");
  for (std::string key; mem >> key;) {
    if (key == "MemTotal:") {
      double kib = 0;
      mem >> kib;
      memory = static_cast<double>(static_cast<long long>(kib / (1 << 20) * 10 + 0.5)) / 10;
      break;
    }
  }
  return {{"cpu", cpu},
          {"cores", std::thread::hardware_concurrency()},
          {"memory_gib", memory},
          {"gpu", gpu_name.empty() ? nlohmann::json(nullptr) : nlohmann::json(gpu_name)}};
}

// The source tree whose commit a result records: the one the benchmark was configured from, else the
// working directory.
inline std::string ProvenanceSourceDir() {
#ifdef KVFLOW_SOURCE_DIR
  return KVFLOW_SOURCE_DIR;
#else
  return ".";
#endif
}

// The "provenance" object: command, commit, date (UTC ISO-8601), machine.
inline nlohmann::json Provenance(const std::vector<std::string>& argv, const std::string& gpu_name = "",
                                 const std::string& source_dir = ProvenanceSourceDir()) {
  char date[32];
  const std::time_t t = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return {{"command", ProvenanceCommand(argv)},
          {"commit", ProvenanceCommit(source_dir)},
          {"date", date},
          {"machine", ProvenanceMachine(gpu_name)}};
}

inline nlohmann::json Provenance(int argc, char** argv, const std::string& gpu_name = "",
                                 const std::string& source_dir = ProvenanceSourceDir()) {
  return Provenance(std::vector<std::string>(argv, argv + argc), gpu_name, source_dir);
}

}  // namespace kvflow::bench
