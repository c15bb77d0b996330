// File helpers shared by the end-to-end benchmarks (spec_decode_bench.cc, triforce_bench.cc).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace kvflow::bench {

// The whole file (empty when it cannot be read: the callers check what they parse).
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace kvflow::bench
