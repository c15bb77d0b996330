// Helpers shared by the benchmarks: whole files (spec_decode_bench.cc, triforce_bench.cc) and the
// comma-separated lists of their options (triforce, kv_selection, cuda).
#pragma once

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

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

}  // namespace kvflow::bench
