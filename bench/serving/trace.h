// Serving-benchmark traces: the synthetic ShareGPT-like workload, the Alpaca trace loaded from its dataset, Poisson arrivals.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "serving/common.h"

namespace kvflow::bench::serving {

// ---- traces ---------------------------------------------------------------------------------

struct TraceRequest {
  std::vector<int32_t> prompt;
  int64_t output_len = 0;
};

struct Trace {
  std::string name;  // "sharegpt" or "alpaca"
  Json info;         // source, parameters, tokenizer, realized length statistics
  std::vector<TraceRequest> requests;
  // Poisson arrival times at 1 req/s. Every rate divides these, so all rates (and all policies)
  // replay the same requests in the same order.
  std::vector<double> unit_arrivals;
};

std::vector<double> UnitPoissonArrivals(size_t n, uint64_t seed);

// ShareGPT-like lengths: lognormal, with the means of the vLLM paper's ShareGPT trace (input 161,
// output 338 tokens), clipped to [4, 1024] each. Token ids are synthetic (any id works: only
// lengths matter to the scheduler, and these ids are valid in every model's vocabulary).
Trace MakeShareGptTrace(size_t num_requests, uint64_t seed, int64_t max_model_len);

// `path`: the Alpaca JSON list (output lengths: the reference outputs'), or a label JSONL of
// kvflow-length-predictor label --chat (chat-template prompts, the model's own output lengths).
Result<Trace> LoadAlpacaTrace(const std::string& path, size_t num_requests, uint64_t seed, int64_t max_model_len,
                              const ModelChoice& tokenizer_model, const std::string& held_out_from = "");

}  // namespace kvflow::bench::serving
