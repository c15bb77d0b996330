// Serving-benchmark reports: sweep options, sustainable rates, and the Markdown tables of a sweep and of a library-vs-server comparison.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "serving/common.h"
#include "serving/run_record.h"

namespace kvflow::bench::serving {

// ---- sweep, sustainable rates, reports --------------------------------------------------------

struct SweepOptions {
  std::string trace = "sharegpt";
  std::string alpaca_path = fs::path(kDefaultAlpacaPath).lexically_normal().string();
  size_t num_requests = 1000;
  uint64_t seed = 0;
  std::vector<double> rates{1.0};
  std::vector<std::string> policies{"paged", "orca-max", "orca-pow2", "orca-oracle"};
  ServingConfig serving;
  double latency_bound_factor = 4.0;
  double latency_bound = 0.0;  // s/token; > 0 overrides the factor
  std::string out_dir = kResultsDir;
  std::string tag;
  // Alpaca: only the prompts this predictor training report held out.
  std::string held_out_from;
  bool require_complete = false;  // exit 3 when any request failed (smoke tests)
  // sim
  std::string cost_model = "a100-opt13b";
  std::string tokenizer = kDefaultModel;
  // real
  std::string model = kDefaultModel;
  int num_threads = 0;
};

// The highest tested rate r such that at every tested rate up to r all requests completed and the
// normalized latency stayed within the bound.
Json SustainableRates(const Json& runs, const SweepOptions& opt, Json& bound_info);

Json Ratios(const Json& sustainable);

std::string Cell(const Json& v, int decimals = -1);

std::string Markdown(const Json& report);

Status WriteFile(const fs::path& path, const std::string& text);

std::string BaseName(const std::string& trace, const std::string& executor, const std::string& tag);

Json SafeRatio(const Json& num, const Json& den);

Json Difference(const Json& a, const Json& b);

std::string CompareMarkdown(const Json& report);

}  // namespace kvflow::bench::serving
