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

#ifndef KVFLOW_SOURCE_DIR
#define KVFLOW_SOURCE_DIR "."
#endif

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using kvflow::Result;
using kvflow::Status;

// ctest's "skipped" exit code: the trace's dataset is not on this machine.
constexpr int kExitSkipped = 77;
constexpr const char* kDefaultModel = "smollm2-135m";
const std::string kResultsDir = KVFLOW_SOURCE_DIR "/bench/results";
const std::string kDefaultAlpacaPath = KVFLOW_SOURCE_DIR "/../shared/datasets/alpaca/alpaca_5000.json";

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

// Three significant digits for values spanning orders of magnitude (latencies in seconds).
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
              {"engine_threads", num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency())},
              {"omp_wait_policy", wait_policy ? wait_policy : "(unset)"}};
}

// Busy-waiting OpenMP threads steal the cores other processes share with the timed engine.
void WarnIfOmpSpins() {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    spdlog::warn("OMP_WAIT_POLICY is unset; for CPU timings run with OMP_WAIT_POLICY=passive");
  }
}

// ---- models ---------------------------------------------------------------------------------

// The model (or tokenizer) a run uses, named as file names and reports name it.
struct ModelChoice {
  std::string name;  // short name, file stem, or "tiny-random"
  std::string path;  // resolved file, or "tiny-random"
};

// Resolves `requested`. The default model falls back to the built-in tiny-random model (whose
// tokenizer is byte-level) when its file is absent; an explicitly requested one must exist.
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

std::vector<double> UnitPoissonArrivals(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(1.0);
  std::vector<double> arrivals(n);
  double t = 0.0;
  for (double& a : arrivals) a = t += gap(rng);
  return arrivals;
}

// Clips a request to max_model_len: the output keeps at most max_model_len - 1 tokens and the
// prompt gives way to it. Returns whether anything was cut.
bool FitToModelLen(std::vector<int32_t>& prompt, int64_t& output_len, int64_t max_model_len) {
  const int64_t output = std::min(output_len, max_model_len - 1);
  const int64_t input = std::min<int64_t>(static_cast<int64_t>(prompt.size()), max_model_len - output);
  const bool cut = output != output_len || input != static_cast<int64_t>(prompt.size());
  output_len = output;
  prompt.resize(static_cast<size_t>(input));
  return cut;
}

Json LengthStats(std::vector<int64_t> lengths) {
  std::sort(lengths.begin(), lengths.end());
  const double mean = std::accumulate(lengths.begin(), lengths.end(), 0.0) / static_cast<double>(lengths.size());
  return Json{{"mean", mean}, {"median", lengths[lengths.size() / 2]}, {"min", lengths.front()},
              {"max", lengths.back()}};
}

void AddRealizedStats(Trace& trace, int64_t num_truncated) {
  std::vector<int64_t> inputs, outputs;
  for (const TraceRequest& r : trace.requests) {
    inputs.push_back(static_cast<int64_t>(r.prompt.size()));
    outputs.push_back(r.output_len);
  }
  trace.info["num_requests"] = trace.requests.size();
  trace.info["input_len"] = LengthStats(inputs);
  trace.info["output_len"] = LengthStats(outputs);
  trace.info["num_truncated_to_max_model_len"] = num_truncated;
}

double NormalCdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

// Mean of exp(N(mu, sigma^2)) clipped to [lo, hi].
double ClippedLogNormalMean(double mu, double sigma, double lo, double hi) {
  const double a = (std::log(lo) - mu) / sigma, b = (std::log(hi) - mu) / sigma;
  const double inside = std::exp(mu + sigma * sigma / 2) * (NormalCdf(b - sigma) - NormalCdf(a - sigma));
  return lo * NormalCdf(a) + inside + hi * (1.0 - NormalCdf(b));
}

// A lognormal length distribution clipped to [lo, hi] whose clipped mean is `mean`.
struct ClippedLogNormal {
  double mean = 0, sigma = 0, lo = 0, hi = 0;
  double mu = 0;  // solved

  ClippedLogNormal(double mean_, double sigma_, double lo_, double hi_) : mean(mean_), sigma(sigma_), lo(lo_), hi(hi_) {
    // The clipped mean grows monotonically with mu: bisect.
    double low = std::log(lo) - 8 * sigma, high = std::log(hi) + 8 * sigma;
    for (int i = 0; i < 200; ++i) {
      const double mid = (low + high) / 2;
      (ClippedLogNormalMean(mid, sigma, lo, hi) < mean ? low : high) = mid;
    }
    mu = (low + high) / 2;
  }
  int64_t Sample(std::mt19937_64& rng) const {
    const double x = std::exp(mu + sigma * std::normal_distribution<double>()(rng));
    return std::llround(std::clamp(x, lo, hi));
  }
  Json ToJson() const {
    return Json{{"distribution", "lognormal, clipped"}, {"mu", mu}, {"sigma", sigma},
                {"clip", {lo, hi}}, {"target_mean", mean}};
  }
};

// ShareGPT-like lengths: lognormal, with the means of the vLLM paper's ShareGPT trace (input 161,
// output 338 tokens), clipped to [4, 1024] each. Token ids are synthetic (any id works: only
// lengths matter to the scheduler, and these ids are valid in every model's vocabulary).
Trace MakeShareGptTrace(size_t num_requests, uint64_t seed, int64_t max_model_len) {
  const ClippedLogNormal input(161, 1.0, 4, 1024), output(338, 1.0, 4, 1024);
  std::mt19937_64 rng(seed);
  Trace trace;
  trace.name = "sharegpt";
  int64_t truncated = 0;
  for (size_t i = 0; i < num_requests; ++i) {
    TraceRequest r;
    const int64_t input_len = input.Sample(rng);
    r.output_len = output.Sample(rng);
    for (int64_t j = 0; j < input_len; ++j) r.prompt.push_back(static_cast<int32_t>(3 + (131 * i + 7 * j) % 250));
    truncated += FitToModelLen(r.prompt, r.output_len, max_model_len);
    trace.requests.push_back(std::move(r));
  }
  trace.info = Json{{"name", "sharegpt"},
                    {"source", "synthetic ShareGPT-like lengths (means of the vLLM paper's ShareGPT: input 161, "
                               "output 338 tokens)"},
                    {"seed", seed},
                    {"input_distribution", input.ToJson()},
                    {"output_distribution", output.ToJson()},
                    {"tokenizer", "none (synthetic token ids)"}};
  AddRealizedStats(trace, truncated);
  return trace;
}

// Alpaca: prompt = instruction (+ "\n" + input), output = the reference output, both tokenized;
// a seeded random sample of the dataset.
// The dataset indices a length predictor's training report held out (its "test_indices").
Result<std::vector<size_t>> LoadHeldOutIndices(const std::string& report_path) {
  std::ifstream in(report_path);
  if (!in) return Status::NotFound("cannot open the predictor report " + report_path);
  try {
    const Json j = Json::parse(in);
    const Json* list = j.contains("test_indices") ? &j["test_indices"]
                       : j.contains("split") && j["split"].contains("test_indices") ? &j["split"]["test_indices"]
                                                                                   : nullptr;
    if (!list || !list->is_array() || list->empty()) {
      return Status::CorruptFile(report_path + ": no test_indices list (write it with kvflow-length-predictor train)");
    }
    return list->get<std::vector<size_t>>();
  } catch (const Json::exception& e) {
    return Status::CorruptFile(report_path + ": " + e.what());
  }
}

Result<Trace> LoadAlpacaTrace(const std::string& path, size_t num_requests, uint64_t seed, int64_t max_model_len,
                              const ModelChoice& tokenizer_model, const std::string& held_out_from = "") {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open the Alpaca dataset " + path);
  Json data;
  try {
    data = Json::parse(in);
  } catch (const Json::exception& e) {
    return Status::CorruptFile(path + ": " + e.what());
  }
  if (!data.is_array() || data.empty()) return Status::CorruptFile(path + ": expected a non-empty JSON list");
  // The pool: the whole dataset, or the prompts a length predictor never saw in training. A held-out
  // pool smaller than the trace is replayed in fresh shuffles (S3's throughput runs need thousands).
  std::vector<size_t> pool(data.size());
  std::iota(pool.begin(), pool.end(), 0);
  if (!held_out_from.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(pool, LoadHeldOutIndices(held_out_from));
    for (size_t i : pool) {
      if (i >= data.size()) return Status::CorruptFile(held_out_from + ": index " + std::to_string(i) + " is outside " + path);
    }
  } else if (num_requests > data.size()) {
    return Status::InvalidArgument("--num-requests " + std::to_string(num_requests) + " exceeds the " +
                                   std::to_string(data.size()) + " entries of " + path);
  }
  KVFLOW_ASSIGN_OR_RETURN(kvflow::ModelFiles files, OpenModel(tokenizer_model));
  if (!files.tokenizer) return Status::NotFound("no tokenizer in " + tokenizer_model.path);
  const kvflow::Tokenizer& tok = *files.tokenizer;

  std::mt19937_64 rng(seed);
  std::vector<size_t> order;
  while (order.size() < num_requests) {
    std::vector<size_t> pass = pool;
    std::shuffle(pass.begin(), pass.end(), rng);
    order.insert(order.end(), pass.begin(), pass.end());
  }
  Trace trace;
  trace.name = "alpaca";
  int64_t truncated = 0;
  for (size_t i = 0; i < num_requests; ++i) {
    const Json& e = data[order[i]];
    const std::string prompt = kvflow::AlpacaPrompt(e.value("instruction", ""), e.value("input", ""));
    TraceRequest r;
    r.prompt = tok.Encode(prompt, tok.add_bos());
    r.output_len = std::max<int64_t>(1, static_cast<int64_t>(tok.Encode(e.value("output", ""), false).size()));
    if (r.prompt.empty()) r.prompt.push_back(tok.bos_id() >= 0 ? tok.bos_id() : 0);
    truncated += FitToModelLen(r.prompt, r.output_len, max_model_len);
    trace.requests.push_back(std::move(r));
  }
  trace.info = Json{{"name", "alpaca"},
                    {"source", path},
                    {"dataset_entries", data.size()},
                    {"sampling", held_out_from.empty() ? "seeded shuffle, first num_requests"
                                                        : "the held-out prompts of " + held_out_from + " (" +
                                                              std::to_string(pool.size()) +
                                                              "), seeded shuffles, repeated as needed"},
                    {"seed", seed},
                    {"prompt", "instruction + (\"\\n\" + input if non-empty)"},
                    {"tokenizer", tokenizer_model.name},
                    {"tokenizer_path", tokenizer_model.path}};
  AddRealizedStats(trace, truncated);
  return trace;
}

// ---- cost model -----------------------------------------------------------------------------

struct StepShape {
  int64_t batched_tokens = 0;
  int64_t context_tokens = 0;  // over scheduled sequences: num_computed + num_tokens
  int64_t num_seqs = 0;
  // Query-key pairs of attention: over the new tokens, each one's context (num_computed + i + 1).
  // Equal to context_tokens for decode; grows with the square of a prefill.
  int64_t attention_pairs = 0;
  int64_t swapped_blocks = 0;  // swap-out + swap-in

  void AddSequence(int64_t num_computed, int64_t num_tokens) {
    ++num_seqs;
    batched_tokens += num_tokens;
    context_tokens += num_computed + num_tokens;
    attention_pairs += num_tokens * num_computed + num_tokens * (num_tokens + 1) / 2;
  }
};

// t = c0 + c_token * batched_tokens + c_context * context_tokens + c_seq * num_seqs
//     + c_attention_pair * attention_pairs (+ c_swap_token * swapped tokens)
// The pair term is beyond the four-term model: on the CPU every prefill query reads its whole
// prefix, so prefill time grows with the square of its length.
struct CostModel {
  std::string name;
  std::string description;  // one line for tables and figures
  double c0_s = 0, c_token_s = 0, c_context_s = 0, c_seq_s = 0, c_attention_pair_s = 0;
  double c_swap_token_s = 0;  // 0 where swapping is not modelled
  std::optional<int64_t> kv_budget_tokens;  // what the modelled device leaves for KV, when known
  Json details;

  double StepSeconds(const StepShape& s, int block_size) const {
    return (s.num_seqs > 0 ? c0_s : 0.0) + c_token_s * static_cast<double>(s.batched_tokens) +
           c_context_s * static_cast<double>(s.context_tokens) + c_seq_s * static_cast<double>(s.num_seqs) +
           c_attention_pair_s * static_cast<double>(s.attention_pairs) + c_swap_token_s * static_cast<double>(s.swapped_blocks * block_size);
  }
  Json ToJson() const {
    Json j{{"name", name},
           {"description", description},
           {"coefficients",
            {{"c0_s", c0_s}, {"c_token_s", c_token_s}, {"c_context_s", c_context_s}, {"c_seq_s", c_seq_s},
             {"c_attention_pair_s", c_attention_pair_s}, {"c_swap_token_s", c_swap_token_s}}}};
    if (kv_budget_tokens) j["kv_budget_tokens"] = *kv_budget_tokens;
    j["details"] = details;
    return j;
  }
};

// OPT-13B fp16 on one A100-40GB, from bandwidth and FLOP rates (not measured): every step reads
// the weights once, each batched token costs 2 * params FLOPs, each context token's K and V are
// read once. The KV budget is what 90% of the GPU leaves beside the weights.
CostModel A100Opt13bCostModel() {
  constexpr double kWeightBytes = 26e9, kHbmBytesPerS = 1.5e12, kParams = 13e9, kFlopsPerS = 150e12;
  constexpr double kLayers = 40, kHidden = 5120, kBytesPerElement = 2;
  constexpr double kKvBytesPerToken = 2 * kLayers * kHidden * kBytesPerElement;  // K and V: 800 KiB
  constexpr double kGpuBytes = 40e9, kGpuMemoryUtilization = 0.9, kPcieBytesPerS = 25e9;
  CostModel m;
  m.name = "a100-opt13b";
  m.description = "analytic cost model (not measured): OPT-13B fp16 on 1x A100-40GB";
  m.c0_s = kWeightBytes / kHbmBytesPerS;
  m.c_token_s = 2 * kParams / kFlopsPerS;
  m.c_context_s = kKvBytesPerToken / kHbmBytesPerS;
  m.c_swap_token_s = kKvBytesPerToken / kPcieBytesPerS;
  m.kv_budget_tokens = static_cast<int64_t>((kGpuBytes * kGpuMemoryUtilization - kWeightBytes) / kKvBytesPerToken);
  m.details = Json{{"kind", "analytic"},
                   {"weights_bytes", kWeightBytes},
                   {"hbm_bytes_per_s_effective", kHbmBytesPerS},
                   {"flops_per_token", 2 * kParams},
                   {"flops_per_s_effective", kFlopsPerS},
                   {"kv_bytes_per_token", kKvBytesPerToken},
                   {"kv_budget", "(40 GB * 0.9 - 26 GB) / kv_bytes_per_token"},
                   {"pcie_bytes_per_s_for_swap", kPcieBytesPerS},
                   {"c_seq", "0: per-sequence overhead not modelled"},
                   {"c_attention_pair", "0: prefill attention FLOPs (4 * 40 * 5120 per pair) are < 2% of the "
                                        "weight FLOPs at these lengths"}};
  return m;
}

// S3's models (its Table 1, with each model's real shape) in fp16 on one A100-80GB, the paper's
// setup, from bandwidth and FLOP rates (not measured): the weights are read once per step, each
// batched token costs 2 * params FLOPs, each context token's K and V are read once. The KV budget
// is the 80 GB less the weights, which reproduces Orca's batch sizes in S3's Table 2 (max
// reservation of 2048 tokens: GPT-J 72 vs 69.94, LLaMA-13B 32 vs 31.61, GPT-NeoX 17 vs 16.89,
// LLaMA-33B 4.6 vs 4).
struct S3ModelShape {
  const char* name;
  const char* description;
  double params;
  int layers;
  int hidden;
};
constexpr S3ModelShape kS3ModelShapes[] = {
    {"gpt-j-6b", "GPT-J 6B", 6.05e9, 28, 4096},
    {"llama-13b", "LLaMA 13B", 13.0e9, 40, 5120},
    {"gpt-neox-20b", "GPT-NeoX 20B", 20.6e9, 44, 6144},
    {"llama-33b", "LLaMA 33B", 32.5e9, 60, 6656},
};

CostModel A100x80ShapeCostModel(const S3ModelShape& shape) {
  constexpr double kHbmBytesPerS = 1.6e12, kFlopsPerS = 200e12, kGpuBytes = 80e9, kPcieBytesPerS = 12e9;
  constexpr double kBytesPerElement = 2;
  const double weight_bytes = shape.params * kBytesPerElement;
  const double kv_bytes_per_token = 2.0 * shape.layers * shape.hidden * kBytesPerElement;
  CostModel m;
  m.name = std::string("a100-80g:") + shape.name;
  m.description = std::string("analytic cost model (not measured): ") + shape.description + " fp16 on 1x A100-80GB";
  m.c0_s = weight_bytes / kHbmBytesPerS;
  m.c_token_s = 2 * shape.params / kFlopsPerS;
  m.c_context_s = kv_bytes_per_token / kHbmBytesPerS;
  m.c_swap_token_s = kv_bytes_per_token / kPcieBytesPerS;
  m.kv_budget_tokens = static_cast<int64_t>((kGpuBytes - weight_bytes) / kv_bytes_per_token);
  m.details = Json{{"kind", "analytic"},
                   {"model", shape.description},
                   {"params", shape.params},
                   {"layers", shape.layers},
                   {"hidden", shape.hidden},
                   {"weights_bytes", weight_bytes},
                   {"hbm_bytes_per_s_effective", kHbmBytesPerS},
                   {"flops_per_token", 2 * shape.params},
                   {"flops_per_s_effective", kFlopsPerS},
                   {"kv_bytes_per_token", kv_bytes_per_token},
                   {"kv_budget", "(80 GB - weights) / kv_bytes_per_token"},
                   {"pcie_bytes_per_s_for_swap", kPcieBytesPerS},
                   {"pcie", "PCIe 4.0 x8 as in S3's server (~12 GB/s effective)"}};
  return m;
}

Result<CostModel> LoadMeasuredCostModel(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open cost model " + path + " (write one with the calibrate subcommand)");
  Json j;
  try {
    j = Json::parse(in);
    CostModel m;
    m.name = "cpu-measured:" + path;
    const Json& c = j.at("coefficients");
    m.c0_s = c.at("c0_s");
    m.c_token_s = c.at("c_token_s");
    m.c_context_s = c.at("c_context_s");
    m.c_seq_s = c.at("c_seq_s");
    m.c_attention_pair_s = c.at("c_attention_pair_s");
    const Json& fit = j.at("fit");
    m.description = "cpu-measured cost model: " + j.at("model").get<std::string>() + " Engine::Step on " +
                    j.at("machine").at("cpu").get<std::string>() + " (fit rms rel. err " +
                    Fixed(100 * fit.at("rms_relative_error").get<double>(), 1) + "%; swaps not timed)";
    m.details = Json{{"kind", "measured"}, {"file", path}, {"model", j.at("model")}, {"machine", j.at("machine")},
                     {"fit", fit}};
    return m;
  } catch (const Json::exception& e) {
    return Status::CorruptFile(path + ": " + e.what());
  }
}

Result<CostModel> MakeCostModel(const std::string& spec) {
  if (spec == "a100-opt13b") return A100Opt13bCostModel();
  for (const S3ModelShape& shape : kS3ModelShapes) {
    if (spec == std::string("a100-80g:") + shape.name) return A100x80ShapeCostModel(shape);
  }
  const std::string prefix = "cpu-measured:";
  if (spec.rfind(prefix, 0) == 0 && spec.size() > prefix.size()) return LoadMeasuredCostModel(spec.substr(prefix.size()));
  std::string shapes;
  for (const S3ModelShape& shape : kS3ModelShapes) shapes += std::string(", a100-80g:") + shape.name;
  return Status::InvalidArgument("unknown cost model '" + spec + "' (a100-opt13b" + shapes +
                                 ", or cpu-measured:<calibration json>)");
}

// ---- runs and metrics -----------------------------------------------------------------------

struct ServingConfig {
  int block_size = 16;
  int num_device_blocks = 0;
  int num_host_blocks = 0;
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;
  int max_model_len = 2048;
  std::string preemption_mode = "auto";
  // s3: the length predictor (empty: untrained, learning online), its online updates, and
  // injected mispredictions ("scale:F", "bucket:B").
  std::string length_predictor;
  std::string reservation_point;  // "upper" or "middle"; empty: the predictor's
  bool online_updates = true;
  std::string prediction_override;

  Json ToJson() const {
    return Json{{"block_size", block_size},         {"num_device_blocks", num_device_blocks},
                {"num_host_blocks", num_host_blocks}, {"max_num_seqs", max_num_seqs},
                {"max_num_batched_tokens", max_num_batched_tokens}, {"max_model_len", max_model_len},
                {"preemption_mode", preemption_mode}, {"prefix_caching", false},
                {"length_predictor", length_predictor.empty() ? Json("untrained") : Json(length_predictor)},
                {"length_reservation_point", reservation_point.empty() ? Json("predictor's") : Json(reservation_point)},
                {"length_online_updates", online_updates},
                {"prediction_override", prediction_override.empty() ? Json(nullptr) : Json(prediction_override)}};
  }
};

struct RequestTiming {
  double arrival_s = 0;
  double first_token_s = -1;  // -1: no token yet
  double finish_s = -1;
  int64_t output_len = 0;
  bool failed = false;
};

// Per-step averages.
struct StepStats {
  int64_t steps = 0;
  double batch_seqs = 0;
  double kv_used_fraction = 0;  // used device blocks / all
  // Tokens whose KV is stored / (used blocks * block_size); only the sim can see it.
  double kv_filled_fraction = 0;
  int64_t kv_filled_samples = 0;

  double busy_s = 0;  // time spent in steps

  void Add(double step_s, int num_seqs, double used_fraction, std::optional<double> filled_fraction) {
    ++steps;
    busy_s += step_s;
    batch_seqs += num_seqs;
    kv_used_fraction += used_fraction;
    if (filled_fraction) {
      kv_filled_fraction += *filled_fraction;
      ++kv_filled_samples;
    }
  }
};

struct RunRecord {
  std::string policy;
  // Executor-specific figures merged into the run's summary (CPU time, HTTP details).
  Json extra = Json::object();
  double rate = 0;
  std::vector<RequestTiming> requests;
  StepStats steps;
  int64_t preemptions_recompute = 0;
  int64_t preemptions_swap = 0;
  std::string first_error;
  double wall_s = 0;
};

RunRecord NewRunRecord(const Trace& trace, double rate, const std::string& policy) {
  RunRecord run;
  run.policy = policy;
  run.rate = rate;
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    RequestTiming t;
    t.arrival_s = trace.unit_arrivals[i] / rate;
    t.output_len = trace.requests[i].output_len;
    run.requests.push_back(t);
  }
  return run;
}

// Rates are numbers in the reports, except "inf" (every request arrives at t = 0), which JSON has
// no number for.
Json RateJson(double rate) { return std::isinf(rate) ? Json("inf") : Json(rate); }
double RateFromJson(const Json& v) {
  return v.is_string() ? std::numeric_limits<double>::infinity() : v.get<double>();
}
std::string RateLabel(double rate) { return std::isinf(rate) ? "inf" : Sig3(rate); }

// Linear interpolation between closest ranks (numpy's default).
double Percentile(const std::vector<double>& sorted, double q) {
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Json Distribution(std::vector<double> v) {
  if (v.empty()) return Json{{"p50", nullptr}, {"p90", nullptr}, {"p99", nullptr}, {"mean", nullptr}};
  std::sort(v.begin(), v.end());
  return Json{{"p50", Percentile(v, 0.5)}, {"p90", Percentile(v, 0.9)}, {"p99", Percentile(v, 0.99)},
              {"mean", std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size())}};
}

Json Summarize(const RunRecord& run) {
  std::vector<double> ttft, tpot, normalized, latency;
  int64_t completed = 0, failed = 0, output_tokens = 0;
  double first_arrival = std::numeric_limits<double>::infinity(), last_finish = 0;
  for (const RequestTiming& t : run.requests) {
    first_arrival = std::min(first_arrival, t.arrival_s);
    if (t.failed) {
      ++failed;
      continue;
    }
    ++completed;
    output_tokens += t.output_len;
    last_finish = std::max(last_finish, t.finish_s);
    latency.push_back(t.finish_s - t.arrival_s);
    normalized.push_back((t.finish_s - t.arrival_s) / static_cast<double>(t.output_len));
    ttft.push_back(t.first_token_s - t.arrival_s);
    if (t.output_len > 1) tpot.push_back((t.finish_s - t.first_token_s) / static_cast<double>(t.output_len - 1));
  }
  const double duration = completed > 0 ? last_finish - first_arrival : 0.0;
  auto mean = [](const std::vector<double>& v) -> Json {
    if (v.empty()) return nullptr;
    return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  };
  auto per_step = [&](double total, int64_t samples) -> Json {
    if (samples == 0) return nullptr;
    return total / static_cast<double>(samples);
  };
  Json j{{"policy", run.policy},
         {"rate_req_s", RateJson(run.rate)},
         {"num_requests", run.requests.size()},
         {"completed", completed},
         {"failed", failed},
         {"duration_s", duration},
         {"throughput_req_s", duration > 0 ? completed / duration : 0.0},
         {"throughput_output_tok_s", duration > 0 ? static_cast<double>(output_tokens) / duration : 0.0},
         {"normalized_latency_s_per_token", mean(normalized)},
         {"mean_latency_s", mean(latency)},
         {"ttft_s", Distribution(ttft)},
         {"tpot_s", Distribution(tpot)},
         {"e2e_s", Distribution(latency)},
         {"avg_batch_seqs", per_step(run.steps.batch_seqs, run.steps.steps)},
         {"num_steps", run.steps.steps},
         {"mean_step_s", per_step(run.steps.busy_s, run.steps.steps)},
         {"preemptions", {{"recompute", run.preemptions_recompute}, {"swap", run.preemptions_swap}}},
         {"kv_used_block_fraction", per_step(run.steps.kv_used_fraction, run.steps.steps)},
         {"kv_filled_token_fraction", per_step(run.steps.kv_filled_fraction, run.steps.kv_filled_samples)},
         {"wall_s", run.wall_s}};
  if (!run.first_error.empty()) j["first_error"] = run.first_error;
  for (const auto& [key, value] : run.extra.items()) j[key] = value;
  return j;
}

// ---- sim executor ---------------------------------------------------------------------------

constexpr int32_t kSimulatedToken = 1;  // what the sim "samples"; only lengths matter

// S3's supervisor for a run of the s3 policy: the predictor (a copy, so every run starts from the
// same weights) or an untrained one over max_model_len; nullptr for other policies.
Result<std::unique_ptr<kvflow::LengthSupervisor>> MakeSupervisor(const std::string& policy, const ServingConfig& cfg,
                                                                  const kvflow::LengthPredictor* predictor) {
  if (policy != "s3") return std::unique_ptr<kvflow::LengthSupervisor>();
  return kvflow::MakeLengthSupervisor(predictor ? std::optional(*predictor) : std::nullopt,
                                      {cfg.max_model_len, cfg.reservation_point, cfg.online_updates,
                                       cfg.prediction_override});
}

Json SupervisorJson(const kvflow::LengthSupervisorStats& s) {
  return Json{{"predictions", s.predictions},
              {"compared", s.compared},
              {"correct", s.correct},
              {"bucket_accuracy", s.compared > 0 ? Json(static_cast<double>(s.correct) / s.compared) : Json(nullptr)},
              {"under_predicted", s.under_predicted},
              {"over_predicted", s.over_predicted},
              {"reservation_preemptions", s.reservation_misses},
              {"online_updates", s.online_updates},
              {"predict_s", s.predict_seconds},
              {"update_s", s.update_seconds},
              {"predict_us_per_request", s.predictions > 0 ? Json(1e6 * s.predict_seconds / s.predictions) : Json(nullptr)},
              {"update_us_per_step", s.online_updates > 0 ? Json(1e6 * s.update_seconds / s.online_updates) : Json(nullptr)}};
}

// The sim's executor: no model. Each step takes the time the cost model gives for its shape, on a
// virtual clock, and every sequence "samples" kSimulatedToken.
//
// Preemption penalty: the modelled time of recomputing KV a sequence had already computed once (its
// high-water mark) and of swapping, i.e. what a step costs beyond the same step without that work.
class CostModelExecutor final : public kvflow::Executor {
 public:
  CostModelExecutor(const CostModel& cost, int block_size) : cost_(cost), block_size_(block_size) {}

  bool SupportsSampling() const override { return true; }
  // Swaps are charged in Run, with the rest of the step.
  Status MoveBlocks(const kvflow::SchedulerOutput&) override { return Status::Ok(); }

  Status Run(const kvflow::SchedulerOutput& out, std::span<const kvflow::LogitsMode>,
             std::optional<std::span<const kvflow::DeviceSampleRow>> sample_rows,
             kvflow::ExecutorOutput& result) override {
    StepShape shape, first_time;  // first_time: the step without recomputation and swaps
    shape.swapped_blocks = static_cast<int64_t>(out.swap_in.size() + out.swap_out.size());
    swapped_blocks_ += shape.swapped_blocks;
    for (const kvflow::ScheduledSeq& s : out.scheduled) {
      shape.AddSequence(s.seq->num_computed, s.num_tokens);
      int64_t& high_water = high_water_[s.seq->id];
      const int64_t redo = std::clamp<int64_t>(high_water - s.seq->num_computed, 0, s.num_tokens);
      recomputed_tokens_ += redo;
      if (s.num_tokens > redo) first_time.AddSequence(s.seq->num_computed + redo, s.num_tokens - redo);
      high_water = std::max(high_water, s.seq->num_computed + s.num_tokens);
    }
    last_step_s_ = cost_.StepSeconds(shape, block_size_);
    penalty_s_ += last_step_s_ - cost_.StepSeconds(first_time, block_size_);
    now_ += last_step_s_;
    ran_ = !out.empty();
    changed_ = !out.rejected.empty() || out.num_preempted_recompute + out.num_preempted_swap > 0;
    if (out.empty()) return Status::Ok();
    if (!sample_rows) return Status::Unsupported("the serving simulator samples plain requests only");
    kvflow::SampledToken token;
    token.token = kSimulatedToken;
    result.sampled.assign(sample_rows->size(), {token});
    return Status::Ok();
  }

  double now() const { return now_; }
  void AdvanceTo(double t) { now_ = std::max(now_, t); }
  double last_step_seconds() const { return last_step_s_; }
  // Whether the last step ran anything, and whether it changed the scheduler's state otherwise
  // (rejections, preemptions).
  bool ran() const { return ran_; }
  bool changed() const { return changed_; }
  Json PenaltyJson() const {
    return Json{{"recomputed_tokens", recomputed_tokens_}, {"swapped_blocks", swapped_blocks_},
                {"modelled_s", penalty_s_}};
  }

 private:
  const CostModel& cost_;
  const int block_size_;
  double now_ = 0.0;
  double last_step_s_ = 0.0;
  bool ran_ = false;
  bool changed_ = false;
  std::unordered_map<kvflow::SeqId, int64_t> high_water_;  // most KV ever computed per sequence
  int64_t recomputed_tokens_ = 0, swapped_blocks_ = 0;
  double penalty_s_ = 0.0;
};

// What the sim measures inside the core: per-step batch size and KV use, and (s3) whether each
// finished request's predicted length bucket was right.
class SimObserver final : public kvflow::EngineCoreObserver {
 public:
  SimObserver(const kvflow::EngineCore& core, const CostModelExecutor& executor, RunRecord& run)
      : core_(core), executor_(executor), run_(run), mispredicted_(run.requests.size(), -1) {}

  // Request `id` is trace request `index` (arrival order).
  void Track(kvflow::RequestId id, size_t index) { index_.emplace(id, index); }

  void OnStepComputed(const kvflow::SchedulerOutput& sched) override {
    int64_t stored_tokens = 0;
    for (const kvflow::SequenceGroup* group : core_.scheduler().running()) {
      for (const auto& seq : group->seqs) {
        if (seq->status == kvflow::SeqStatus::kRunning) stored_tokens += seq->num_computed;
      }
    }
    const kvflow::BlockManager& blocks = core_.block_manager();
    const int used = blocks.device().num_used();
    run_.steps.Add(executor_.last_step_seconds(), static_cast<int>(sched.scheduled.size()),
                   static_cast<double>(used) / blocks.device().num_blocks(),
                   used > 0 ? std::optional<double>(static_cast<double>(stored_tokens) / (used * blocks.block_size()))
                            : std::nullopt);
  }

  void OnRequestFinished(const kvflow::SequenceGroup& group) override {
    const kvflow::LengthSupervisor* supervisor = core_.length_supervisor();
    if (!supervisor) return;
    const kvflow::LengthBuckets& b = supervisor->predictor().config().buckets;
    mispredicted_[index_.at(group.request_id)] = b.BucketOf(group.seqs.front()->output_len()) != group.predicted_bucket;
  }

  // Whether online retraining converges: the misprediction rate per tenth of the requests, in
  // arrival order (a prediction is made at arrival, so only later arrivals can profit).
  Json MispredictionDeciles() const {
    const size_t n = mispredicted_.size();
    Json deciles = Json::array();
    for (size_t d = 0; d < 10 && n >= 10; ++d) {
      int64_t wrong = 0, seen = 0;
      for (size_t i = d * n / 10; i < (d + 1) * n / 10; ++i) {
        if (mispredicted_[i] < 0) continue;
        ++seen;
        wrong += mispredicted_[i];
      }
      deciles.push_back(seen > 0 ? Json(static_cast<double>(wrong) / static_cast<double>(seen)) : Json(nullptr));
    }
    return deciles;
  }

 private:
  const kvflow::EngineCore& core_;
  const CostModelExecutor& executor_;
  RunRecord& run_;
  std::unordered_map<kvflow::RequestId, size_t> index_;
  std::vector<int8_t> mispredicted_;  // per trace request; -1: not finished (or not s3)
};

// Replays the trace through the engine's core (the real Scheduler and BlockManager, the same step
// protocol as the engine) with the cost-model executor instead of a model. Every request runs to
// its true length: max_tokens is that length, hidden from the scheduler (which sees the context
// limit), and EOS is ignored. The s3 policy runs with its supervisor, as in the engine.
Result<RunRecord> Simulate(const Trace& trace, double rate, const std::string& policy_name, const ServingConfig& cfg,
                           const CostModel& cost, const kvflow::LengthPredictor* predictor) {
  KVFLOW_ASSIGN_OR_RETURN(auto policy, kvflow::MakeSchedulingPolicy(policy_name));
  KVFLOW_ASSIGN_OR_RETURN(kvflow::PreemptionMode preemption, kvflow::ParsePreemptionMode(cfg.preemption_mode));
  KVFLOW_ASSIGN_OR_RETURN(auto supervisor, MakeSupervisor(policy_name, cfg, predictor));
  kvflow::EngineCoreConfig config;
  config.scheduler = kvflow::SchedulerConfig{cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, preemption};
  config.blocks = kvflow::BlockManagerConfig{cfg.block_size, cfg.num_device_blocks, cfg.num_host_blocks,
                                             /*enable_prefix_caching=*/false};
  config.warn_on_preemption = false;
  kvflow::EngineCore core(config, std::move(policy), std::move(supervisor), /*tokenizer=*/nullptr);
  CostModelExecutor executor(cost, cfg.block_size);

  const auto wall_start = Clock::now();
  RunRecord run = NewRunRecord(trace, rate, policy_name);
  SimObserver observer(core, executor, run);
  core.set_observer(&observer);
  const size_t n = run.requests.size();
  size_t next = 0, settled = 0;
  int64_t idle_steps = 0;  // consecutive steps that ran nothing
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  while (settled < n) {
    for (; next < n && run.requests[next].arrival_s <= executor.now(); ++next) {
      RequestTiming& t = run.requests[next];
      auto on_event = [&t, &run, &settled, &executor, generated = int64_t{0}](const kvflow::StreamEvent& e) mutable {
        if (!e.tokens.empty() && t.first_token_s < 0) t.first_token_s = executor.now();
        generated += static_cast<int64_t>(e.tokens.size());
        if (!e.request_finished) return;
        ++settled;
        t.failed = e.finish_reason == kvflow::FinishReason::kError || generated != t.output_len;
        if (!t.failed) t.finish_s = executor.now();
        if (t.failed && run.first_error.empty()) {
          run.first_error = !e.error.ok() ? e.error.ToString()
                                          : "generated " + std::to_string(generated) + " tokens, expected " +
                                                std::to_string(t.output_len);
        }
      };
      params.max_tokens = static_cast<int>(t.output_len);
      kvflow::RequestHints hints;
      hints.true_output_len = t.output_len;
      hints.hide_max_tokens = true;
      auto id = core.AddRequest(trace.requests[next].prompt, params, std::move(on_event), hints, t.arrival_s);
      if (!id.ok()) {
        t.failed = true;
        if (run.first_error.empty()) run.first_error = id.status().ToString();
        ++settled;
        continue;
      }
      observer.Track(id.value(), next);
    }
    if (!core.HasUnfinishedRequests()) {
      if (next < n) executor.AdvanceTo(run.requests[next].arrival_s);
      continue;
    }
    KVFLOW_RETURN_IF_ERROR(core.Step(executor).status());
    if (!executor.ran()) {
      // Nothing ran. Fine while rejections or preemptions change the state; otherwise the scheduler
      // holds work it will never schedule.
      if (core.HasUnfinishedRequests() && (!executor.changed() || ++idle_steps > static_cast<int64_t>(n))) {
        return Status::Internal("the scheduler stalled at t=" + Fixed(executor.now(), 3) + " s with " +
                                std::to_string(next - settled) + " requests in flight and nothing scheduled");
      }
      continue;
    }
    idle_steps = 0;
  }
  const kvflow::SchedulerStats stats = core.scheduler().stats();
  run.preemptions_recompute = stats.num_preemptions_recompute;
  run.preemptions_swap = stats.num_preemptions_swap;
  run.wall_s = SecondsSince(wall_start);
  run.extra["preemption_penalty"] = executor.PenaltyJson();
  run.extra["preemption_penalty"]["reservation_preemptions"] = stats.num_reservation_preemptions;
  if (const kvflow::LengthSupervisor* supervisor = core.length_supervisor()) {
    run.extra["s3"] = SupervisorJson(supervisor->stats());
    run.extra["s3"]["misprediction_rate_by_arrival_decile"] = observer.MispredictionDeciles();
  }
  return run;
}

// ---- real executor --------------------------------------------------------------------------

// User + system CPU time of this process (all threads).
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// CPU seconds all processes on the machine have used (/proc/stat: everything but idle and iowait),
// to tell how much of a run's time other work took on shared cores.
double MachineBusyCpuSeconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  return (user + nice + system + irq + softirq + steal) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The rest of the machine's load over a run, in cores: busy CPU beyond `own_cpu_s`, per second.
Json OtherLoadCores(double machine_busy_s, double own_cpu_s, double wall_s) {
  if (wall_s <= 0) return nullptr;
  return std::max(0.0, machine_busy_s - own_cpu_s) / wall_s;
}

kvflow::EngineConfig MakeEngineConfig(const ServingConfig& cfg, const ModelChoice& model, const std::string& policy,
                                      int num_threads) {
  kvflow::EngineConfig ec;
  ec.model = model.path;
  ec.block_size = cfg.block_size;
  ec.num_kv_blocks = cfg.num_device_blocks;
  ec.num_host_kv_blocks = cfg.num_host_blocks;
  ec.max_num_seqs = cfg.max_num_seqs;
  ec.max_num_batched_tokens = cfg.max_num_batched_tokens;
  ec.max_model_len = cfg.max_model_len;
  ec.preemption_mode = cfg.preemption_mode;
  ec.scheduling_policy = policy;
  ec.num_threads = num_threads;
  if (policy == "s3") {
    ec.s3.length_predictor = cfg.length_predictor;
    ec.s3.online_updates = cfg.online_updates;
    ec.s3.reservation_point = cfg.reservation_point;
  }
  return ec;
}

// Replays the trace against the Engine in wall-clock time: each request is added once its arrival
// time has passed, the engine steps while it has work and sleeps until the next arrival when idle.
Result<RunRecord> RunEngine(const Trace& trace, double rate, const std::string& policy, const ServingConfig& cfg,
                            const ModelChoice& model, int num_threads) {
  kvflow::EvaluationOptions evaluation;
  if (policy == "s3") evaluation.length_prediction_override = cfg.prediction_override;
  KVFLOW_ASSIGN_OR_RETURN(auto engine, kvflow::CreateEvaluationEngine(MakeEngineConfig(cfg, model, policy, num_threads),
                                                                      evaluation));
  if (engine->config().max_model_len != cfg.max_model_len) {
    return Status::InvalidArgument("--max-model-len " + std::to_string(cfg.max_model_len) + " exceeds the model's " +
                                   std::to_string(engine->config().max_model_len));
  }
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  params.max_tokens = 4;
  // One short request first so that first-touch costs do not land on the trace's first requests.
  KVFLOW_RETURN_IF_ERROR(engine->Generate(std::vector<std::string>{"warm-up"}, params).status());
  const kvflow::EngineStats before = engine->stats();

  RunRecord run = NewRunRecord(trace, rate, policy);
  const size_t n = run.requests.size();
  std::vector<int64_t> generated(n, 0);
  size_t next = 0, settled = 0;
  const double cpu_before = ProcessCpuSeconds();
  const double machine_before = MachineBusyCpuSeconds();
  const auto start = Clock::now();
  while (settled < n) {
    for (; next < n && run.requests[next].arrival_s <= SecondsSince(start); ++next) {
      RequestTiming& t = run.requests[next];
      int64_t& count = generated[next];
      auto on_event = [&t, &run, &settled, &count, start](const kvflow::StreamEvent& e) {
        const double now = SecondsSince(start);
        if (!e.tokens.empty() && t.first_token_s < 0) t.first_token_s = now;
        count += static_cast<int64_t>(e.tokens.size());
        if (!e.request_finished) return;
        t.finish_s = now;
        t.failed = e.finish_reason == kvflow::FinishReason::kError || e.finish_reason == kvflow::FinishReason::kCancelled;
        if (t.failed && run.first_error.empty()) run.first_error = e.error.ToString();
        if (!t.failed && count != t.output_len) {  // ignore_eos + max_tokens: exactly output_len tokens
          t.failed = true;
          if (run.first_error.empty()) {
            run.first_error =
                "generated " + std::to_string(count) + " tokens, expected " + std::to_string(t.output_len);
          }
        }
        ++settled;
      };
      params.max_tokens = static_cast<int>(t.output_len);
      kvflow::RequestHints hints;
      hints.true_output_len = t.output_len;
      hints.hide_max_tokens = true;  // max_tokens is the true length here: not for the scheduler's eyes
      auto id = engine->AddRequestWithHints(trace.requests[next].prompt, params, std::move(on_event), hints);
      if (!id.ok()) {
        t.failed = true;
        if (run.first_error.empty()) run.first_error = id.status().ToString();
        ++settled;
      }
    }
    if (!engine->HasUnfinishedRequests()) {
      if (next < n) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(run.requests[next].arrival_s)));
      }
      continue;
    }
    const auto step_start = Clock::now();
    auto step = engine->Step();
    const double step_s = SecondsSince(step_start);
    if (!step.ok()) return step.status();
    if (step->num_seqs == 0) continue;
    const kvflow::EngineStats s = engine->stats();
    run.steps.Add(step_s, step->num_seqs, static_cast<double>(s.kv_blocks_total - s.kv_blocks_free) / s.kv_blocks_total,
                  std::nullopt);
  }
  run.wall_s = SecondsSince(start);
  run.extra["process_cpu_s"] = ProcessCpuSeconds() - cpu_before;
  run.extra["machine_busy_cpu_s"] = MachineBusyCpuSeconds() - machine_before;
  run.extra["other_load_cores"] =
      OtherLoadCores(run.extra["machine_busy_cpu_s"], run.extra["process_cpu_s"], run.wall_s);
  const kvflow::EngineStats after = engine->stats();
  run.extra["prefill_tokens"] = after.prompt_tokens_processed - before.prompt_tokens_processed;
  run.preemptions_swap = after.num_preemptions_swap - before.num_preemptions_swap;
  run.preemptions_recompute = after.num_preemptions - before.num_preemptions - run.preemptions_swap;
  run.extra["preemption_penalty"] = Json{{"reservation_preemptions", after.s3.reservation_preemptions - before.s3.reservation_preemptions}};
  if (policy == "s3") {
    kvflow::LengthSupervisorStats l;
    l.predictions = after.s3.predictions - before.s3.predictions;
    l.correct = after.s3.correct - before.s3.correct;
    l.under_predicted = after.s3.under_predicted - before.s3.under_predicted;
    l.over_predicted = after.s3.over_predicted - before.s3.over_predicted;
    l.compared = after.s3.compared - before.s3.compared;
    l.reservation_misses = after.s3.reservation_preemptions - before.s3.reservation_preemptions;
    l.online_updates = after.s3.online_updates - before.s3.online_updates;
    l.predict_seconds = after.s3.predict_seconds - before.s3.predict_seconds;
    l.update_seconds = after.s3.update_seconds - before.s3.update_seconds;
    run.extra["s3"] = SupervisorJson(l);
  }
  return run;
}

// ---- http executor: the trace against kvflow-server -------------------------------------------
//
// One connection per request (HTTP/1.1, Connection: close), all driven by one thread blocked in
// ppoll(): the client wakes for a socket's bytes or the next arrival, never spins. Each request is
// POST /v1/completions with the prompt's token ids, streamed: TTFT is the first SSE event with a
// choice in it, the finish the event with a finish_reason, and the usage chunk must report exactly
// the trace's output length.

struct Endpoint {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string url() const { return "http://" + host + ":" + std::to_string(port); }
};

Result<Endpoint> ParseUrl(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t colon = rest.rfind(':');
  Endpoint ep;
  if (colon == std::string::npos || rest.find('/') != std::string::npos) {
    return Status::InvalidArgument("expected http://HOST:PORT, got '" + url + "'");
  }
  ep.host = rest.substr(0, colon);
  char* end = nullptr;
  const long port = std::strtol(rest.c_str() + colon + 1, &end, 10);
  if (ep.host.empty() || *end != '\0' || port <= 0 || port > 65535) {
    return Status::InvalidArgument("expected http://HOST:PORT, got '" + url + "'");
  }
  ep.port = static_cast<int>(port);
  return ep;
}

Result<sockaddr_storage> Resolve(const Endpoint& ep, socklen_t& len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(ep.host.c_str(), std::to_string(ep.port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) return Status::NotFound("cannot resolve " + ep.host + ": " + gai_strerror(rc));
  sockaddr_storage addr{};
  std::memcpy(&addr, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  return addr;
}

std::string ErrnoText(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Incremental HTTP/1.1 response parser: status line, headers, then a Content-Length, chunked or
// close-delimited body, handed to on_body as it is decoded.
class HttpResponseParser {
 public:
  std::function<void(std::string_view)> on_body;

  void Feed(std::string_view data) {
    buf_.append(data.data(), data.size());
    Process();
  }
  // The peer closed the connection.
  void Eof() {
    if (state_ == St::kClose) {
      state_ = St::kDone;
    } else if (state_ != St::kDone && state_ != St::kError) {
      Fail("connection closed before the end of the response");
    }
  }
  bool done() const { return state_ == St::kDone; }
  bool failed() const { return state_ == St::kError; }
  bool headers_done() const { return headers_done_; }
  const std::string& error() const { return error_; }
  int status() const { return status_; }
  std::string Header(const std::string& lower_name) const {
    for (const auto& [k, v] : headers_) {
      if (k == lower_name) return v;
    }
    return "";
  }

 private:
  enum class St { kStatus, kHeaders, kChunkSize, kChunkData, kChunkEnd, kTrailers, kLength, kClose, kDone, kError };

  void Fail(const std::string& why) {
    if (state_ != St::kError) error_ = why;
    state_ = St::kError;
  }

  // Takes one line (through "\n", without "\r\n") from the buffer.
  bool Line(std::string& line) {
    const size_t nl = buf_.find('\n', pos_);
    if (nl == std::string::npos) {
      if (buf_.size() - pos_ > 65536) Fail("header or chunk-size line over 64 KiB");
      return false;
    }
    line.assign(buf_, pos_, nl - pos_);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    pos_ = nl + 1;
    return true;
  }

  void Body(size_t n) {
    if (on_body && n > 0) on_body(std::string_view(buf_).substr(pos_, n));
    pos_ += n;
  }

  void StartBody() {
    headers_done_ = true;
    if (status_ / 100 == 1) {  // 100 Continue and friends: the real response follows
      headers_.clear();
      headers_done_ = false;
      state_ = St::kStatus;
      return;
    }
    const std::string te = Lower(Header("transfer-encoding"));
    const std::string cl = Header("content-length");
    if (te.find("chunked") != std::string::npos) {
      state_ = St::kChunkSize;
    } else if (!cl.empty()) {
      remaining_ = std::strtoull(cl.c_str(), nullptr, 10);
      state_ = remaining_ == 0 ? St::kDone : St::kLength;
    } else if (status_ == 204 || status_ == 304) {
      state_ = St::kDone;
    } else {
      state_ = St::kClose;
    }
  }

  void Process() {
    std::string line;
    bool progress = true;
    while (progress && state_ != St::kDone && state_ != St::kError) {
      progress = false;
      switch (state_) {
        case St::kStatus:
          if (!Line(line)) break;
          if (line.rfind("HTTP/1.", 0) != 0 || line.size() < 12) {
            Fail("bad status line '" + line.substr(0, 80) + "'");
            break;
          }
          status_ = std::atoi(line.c_str() + 9);
          state_ = St::kHeaders;
          progress = true;
          break;
        case St::kHeaders:
          if (!Line(line)) break;
          progress = true;
          if (line.empty()) {
            StartBody();
          } else if (const size_t colon = line.find(':'); colon != std::string::npos) {
            const size_t v = line.find_first_not_of(" \t", colon + 1);
            headers_.emplace_back(Lower(line.substr(0, colon)), v == std::string::npos ? "" : line.substr(v));
          } else {
            Fail("bad header line '" + line.substr(0, 80) + "'");
          }
          break;
        case St::kChunkSize: {
          if (!Line(line)) break;
          char* end = nullptr;
          remaining_ = std::strtoull(line.c_str(), &end, 16);
          if (end == line.c_str()) {
            Fail("bad chunk size line '" + line.substr(0, 80) + "'");
            break;
          }
          state_ = remaining_ == 0 ? St::kTrailers : St::kChunkData;
          progress = true;
          break;
        }
        case St::kChunkData: {
          const size_t n = std::min<uint64_t>(remaining_, buf_.size() - pos_);
          if (n == 0) break;
          Body(n);
          remaining_ -= n;
          if (remaining_ == 0) state_ = St::kChunkEnd;
          progress = true;
          break;
        }
        case St::kChunkEnd:
          if (!Line(line)) break;
          if (!line.empty()) {
            Fail("chunk data longer than its size");
            break;
          }
          state_ = St::kChunkSize;
          progress = true;
          break;
        case St::kTrailers:
          if (!Line(line)) break;
          if (line.empty()) state_ = St::kDone;
          progress = true;
          break;
        case St::kLength: {
          const size_t n = std::min<uint64_t>(remaining_, buf_.size() - pos_);
          if (n == 0) break;
          Body(n);
          remaining_ -= n;
          if (remaining_ == 0) state_ = St::kDone;
          progress = true;
          break;
        }
        case St::kClose:
          if (pos_ < buf_.size()) Body(buf_.size() - pos_);
          break;
        case St::kDone:
        case St::kError:
          break;
      }
    }
    buf_.erase(0, pos_);
    pos_ = 0;
  }

  St state_ = St::kStatus;
  std::string buf_;
  size_t pos_ = 0;
  int status_ = 0;
  bool headers_done_ = false;
  std::vector<std::pair<std::string, std::string>> headers_;
  uint64_t remaining_ = 0;
  std::string error_;
};

// Server-sent events: hands each event's data (its "data:" lines joined by "\n") to on_data.
class SseParser {
 public:
  std::function<void(const std::string&)> on_data;

  void Feed(std::string_view bytes) {
    buf_.append(bytes.data(), bytes.size());
    size_t pos = 0;
    for (size_t nl; (nl = buf_.find('\n', pos)) != std::string::npos; pos = nl + 1) {
      std::string_view line(buf_.data() + pos, nl - pos);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) {
        if (has_data_) on_data(data_);
        data_.clear();
        has_data_ = false;
      } else if (line.rfind("data:", 0) == 0) {
        std::string_view value = line.substr(5);
        if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
        if (has_data_) data_ += '\n';
        data_.append(value.data(), value.size());
        has_data_ = true;
      }  // comments (":") and other fields (event:, id:, retry:) carry nothing here
    }
    buf_.erase(0, pos);
  }
  bool pending() const { return has_data_ || !buf_.empty(); }

 private:
  std::string buf_, data_;
  bool has_data_ = false;
};

std::string HttpRequestText(const Endpoint& ep, const std::string& method, const std::string& path,
                            const std::string& body, const std::string& api_key, bool stream) {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: " + ep.host + ":" + std::to_string(ep.port) +
                  "\r\nUser-Agent: kvflow-bench-serving\r\nConnection: close\r\n";
  if (stream) r += "Accept: text/event-stream\r\n";
  if (!api_key.empty()) r += "Authorization: Bearer " + api_key + "\r\n";
  if (!body.empty() || method == "POST") {
    r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  return r + "\r\n" + body;
}

int OpenSocket(const sockaddr_storage& addr, socklen_t len, bool nonblocking) {
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 && errno != EINPROGRESS) {
    const int saved = errno;
    close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

struct HttpResponse {
  int status = 0;
  std::string content_type;
  std::string body;
};

// One blocking request/response (control calls: /health, /metrics, /v1/models, warm-up).
Result<HttpResponse> HttpCall(const Endpoint& ep, const std::string& method, const std::string& path,
                              const std::string& body, const std::string& api_key, double timeout_s) {
  socklen_t len = 0;
  KVFLOW_ASSIGN_OR_RETURN(sockaddr_storage addr, Resolve(ep, len));
  const int fd = OpenSocket(addr, len, /*nonblocking=*/false);
  if (fd < 0) return Status::IoError(ErrnoText("connect to " + ep.url()));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>(1e6 * (timeout_s - static_cast<double>(tv.tv_sec)));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  const std::string request = HttpRequestText(ep, method, path, body, api_key, false);
  for (size_t off = 0; off < request.size();) {
    const ssize_t w = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (w <= 0) {
      const std::string why = ErrnoText("send to " + ep.url() + path);
      close(fd);
      return Status::IoError(why);
    }
    off += static_cast<size_t>(w);
  }
  HttpResponseParser parser;
  HttpResponse out;
  parser.on_body = [&out](std::string_view b) { out.body.append(b.data(), b.size()); };
  char buf[16384];
  while (!parser.done() && !parser.failed()) {
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string why = ErrnoText(method + " " + ep.url() + path);
      close(fd);
      return Status::IoError(why);
    }
    if (r == 0) {
      parser.Eof();
      break;
    }
    parser.Feed(std::string_view(buf, static_cast<size_t>(r)));
  }
  close(fd);
  if (parser.failed()) return Status::IoError(method + " " + ep.url() + path + ": " + parser.error());
  out.status = parser.status();
  out.content_type = parser.Header("content-type");
  return out;
}

// Sum of a Prometheus metric's samples (over all label sets); nullopt when absent.
std::optional<double> MetricValue(const std::string& text, const std::string& name) {
  std::optional<double> sum;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string_view line(text.data() + pos, nl - pos);
    pos = nl + 1;
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string_view::npos) continue;
    const std::string value(line.substr(space + 1));
    sum = sum.value_or(0.0) + std::strtod(value.c_str(), nullptr);
  }
  return sum;
}

// Raises the open-file limit to its hard limit: one socket per in-flight request.
void RaiseFileLimit(size_t needed) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= needed + 64) return;
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
}

// A kvflow-server this benchmark started: stderr and stdout go to a log file, from which the
// listening line gives the port.
class ServerProcess {
 public:
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  // `env`: NAME=VALUE pairs added to the server's environment.
  static Result<std::unique_ptr<ServerProcess>> Start(const std::string& binary, const std::vector<std::string>& args,
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

  // SIGTERM, then waits up to timeout_s for the exit (SIGKILL after that). Returns how it ended.
  std::string Stop(double timeout_s) {
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

  // User + system CPU seconds of the server (all its threads) so far.
  double CpuSeconds() const {
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

  std::string Log() const {
    std::ifstream in(log_path_);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::string LogTail(size_t bytes) const {
    const std::string log = Log();
    return log.size() <= bytes ? log : "..." + log.substr(log.size() - bytes);
  }

  const Endpoint& endpoint() const { return endpoint_; }
  pid_t pid() const { return pid_; }
  double startup_s() const { return startup_s_; }
  bool exit_clean() const { return exit_clean_; }
  const fs::path& log_path() const { return log_path_; }

  static std::string DescribeExit(int status) {
    if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
    return "status " + std::to_string(status);
  }

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

std::string DefaultServerBinary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);  // <build>/bench/kvflow_bench_serving
  if (ec) return "kvflow-server";
  return (self.parent_path().parent_path() / "kvflow-server").string();
}

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

// Mirrors RunEngine's warm-up: one short greedy request.
Status WarmUpServer(const ServerSession& s) {
  const Json body{{"model", s.model_name}, {"prompt", "warm-up"}, {"max_tokens", 4}, {"temperature", 0},
                  {"ignore_eos", true}};
  KVFLOW_ASSIGN_OR_RETURN(HttpResponse r, HttpCall(s.endpoint, "POST", "/v1/completions", body.dump(), s.api_key, 120));
  if (r.status != 200) return Status::Internal("warm-up request: HTTP " + std::to_string(r.status) + ": " + r.body);
  return Status::Ok();
}

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

const Json* FindRun(const Json& runs, const std::string& policy, double rate) {
  for (const Json& r : runs) {
    if (r["policy"] == policy && RateFromJson(r["rate_req_s"]) == rate) return &r;
  }
  return nullptr;
}

// The highest tested rate r such that at every tested rate up to r all requests completed and the
// normalized latency stayed within the bound.
Json SustainableRates(const Json& runs, const SweepOptions& opt, Json& bound_info) {
  std::vector<double> rates = opt.rates;
  std::sort(rates.begin(), rates.end());
  double bound = opt.latency_bound;
  if (bound > 0) {
    bound_info = Json{{"rule", "fixed bound on normalized latency (--latency-bound)"}, {"bound_s_per_token", bound}};
  } else {
    // The reference is paged at the lowest rate, or the best policy there when paged is not run.
    double reference = std::numeric_limits<double>::infinity();
    std::string reference_policy;
    for (const std::string& p : opt.policies) {
      const Json* r = FindRun(runs, p, rates.front());
      if (!r || r->at("normalized_latency_s_per_token").is_null()) continue;
      const double v = r->at("normalized_latency_s_per_token");
      if (p == "paged" || (reference_policy != "paged" && v < reference)) {
        reference = v;
        reference_policy = p;
      }
    }
    bound = opt.latency_bound_factor * reference;
    bound_info = Json{{"rule", Fixed(opt.latency_bound_factor, 1) + "x the normalized latency of " + reference_policy +
                                   " at the lowest tested rate (" + Fixed(rates.front(), 2) + " req/s)"},
                      {"factor", opt.latency_bound_factor},
                      {"reference_policy", reference_policy},
                      {"reference_s_per_token", reference},
                      {"bound_s_per_token", bound}};
  }
  bound_info["sustainable_rate"] =
      "highest tested rate r such that at every tested rate <= r all requests completed and normalized latency "
      "<= bound";
  Json sustainable = Json::object();
  for (const std::string& p : opt.policies) {
    Json best = nullptr;
    for (double rate : rates) {
      const Json* r = FindRun(runs, p, rate);
      if (!r || r->at("failed").get<int64_t>() > 0 || r->at("normalized_latency_s_per_token").is_null() ||
          r->at("normalized_latency_s_per_token").get<double>() > bound) {
        break;
      }
      best = RateJson(rate);
    }
    sustainable[p] = best;
  }
  return sustainable;
}

Json Ratios(const Json& sustainable) {
  Json ratios = Json::object();
  if (!sustainable.contains("paged")) return ratios;
  for (const auto& [policy, rate] : sustainable.items()) {
    if (policy == "paged") continue;
    const bool defined = !rate.is_null() && !sustainable["paged"].is_null() && RateFromJson(rate) > 0 &&
                         !rate.is_string() && !sustainable["paged"].is_string();
    ratios["paged/" + policy] =
        defined ? Json(RateFromJson(sustainable["paged"]) / RateFromJson(rate)) : Json(nullptr);
  }
  return ratios;
}

std::string Cell(const Json& v, int decimals = -1) {
  if (v.is_null()) return "n/a";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  return decimals < 0 ? Sig3(v.get<double>()) : Fixed(v.get<double>(), decimals);
}

std::string Percent(const Json& v) { return v.is_null() ? "n/a" : Fixed(100 * v.get<double>(), 1) + "%"; }

std::string Triple(const Json& d) { return Cell(d["p50"]) + " / " + Cell(d["p90"]) + " / " + Cell(d["p99"]); }

std::string Markdown(const Json& report) {
  std::string md = "# Serving benchmark: " + report["trace"]["name"].get<std::string>() + " trace, " +
                   report["executor"]["name"].get<std::string>() + " executor\n\n";
  md += "- executor: " + report["executor"]["description"].get<std::string>() + "\n";
  if (report["executor"].contains("server") && report["executor"]["server"].contains("args")) {
    const auto args = report["executor"]["server"]["args"].get<std::vector<std::string>>();
    md += "- server: `kvflow-server " + Join(args, " ") + "`\n";
  }
  const Json& t = report["trace"];
  md += "- trace: " + t["source"].get<std::string>() + "; " + std::to_string(t["num_requests"].get<int64_t>()) +
        " requests, Poisson arrivals (seed " + std::to_string(report["arrival_seed"].get<uint64_t>()) +
        "); tokenizer: " + t["tokenizer"].get<std::string>() + "\n";
  md += "- lengths (tokens): input mean " + Fixed(t["input_len"]["mean"], 1) + " (max " + Cell(t["input_len"]["max"]) +
        "), output mean " + Fixed(t["output_len"]["mean"], 1) + " (max " + Cell(t["output_len"]["max"]) + "); " +
        Cell(t["num_truncated_to_max_model_len"]) + " truncated to max_model_len\n";
  const Json& c = report["config"];
  md += "- KV budget: " + Cell(c["num_device_blocks"]) + " blocks x " + Cell(c["block_size"]) + " tokens; swap " +
        Cell(c["num_host_blocks"]) + " blocks; max_num_seqs " + Cell(c["max_num_seqs"]) + ", max_num_batched_tokens " +
        Cell(c["max_num_batched_tokens"]) + ", max_model_len " + Cell(c["max_model_len"]) + ", preemption " +
        c["preemption_mode"].get<std::string>() + "\n\n";
  md += "Normalized latency = mean over requests of end-to-end latency / output tokens. TTFT and TPOT in seconds "
        "(p50 / p90 / p99). KV used = allocated device blocks / all; KV filled = tokens with stored KV / allocated "
        "block capacity (both averaged over steps).\n\n";
  md += "| policy | rate (req/s) | done / failed | req/s | output tok/s | norm. latency (s/tok) | TTFT (s) | TPOT (s) "
        "| avg batch | steps | preemptions | KV used | KV filled | duration (s) |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    md += "| " + r["policy"].get<std::string>() + " | " + RateLabel(RateFromJson(r["rate_req_s"])) + " | " +
          Cell(r["completed"]) +
          " / " + Cell(r["failed"]) + " | " + Fixed(r["throughput_req_s"], 2) + " | " +
          Fixed(r["throughput_output_tok_s"], 0) + " | " + Cell(r["normalized_latency_s_per_token"]) + " | " +
          Triple(r["ttft_s"]) + " | " + Triple(r["tpot_s"]) + " | " + Cell(r["avg_batch_seqs"], 1) + " | " +
          Cell(r["num_steps"]) + " | " + std::to_string(r["preemptions"]["recompute"].get<int64_t>() + r["preemptions"]["swap"].get<int64_t>()) +
          " | " + Percent(r["kv_used_block_fraction"]) + " | " + Percent(r["kv_filled_token_fraction"]) + " | " +
          Fixed(r["duration_s"], 1) + " |\n";
  }
  // S3: what the predictor and its supervisor did, and what preemption cost.
  std::string s3;
  for (const Json& r : report["runs"]) {
    const bool has_penalty = r.contains("preemption_penalty") && r["preemption_penalty"].contains("modelled_s");
    if (!r.contains("s3") && !has_penalty) continue;
    const Json none = Json::object();
    const Json& l = r.contains("s3") ? r["s3"] : none;
    const double duration = r["duration_s"].get<double>();
    auto share = [&](double seconds) { return duration > 0 ? Fixed(100 * seconds / duration, 2) + "%" : "n/a"; };
    const double overhead = l.empty() ? 0.0 : l["predict_s"].get<double>() + l["update_s"].get<double>();
    s3 += "| " + r["policy"].get<std::string>() + " | " + RateLabel(RateFromJson(r["rate_req_s"])) + " | " +
          (l.empty() ? "-" : Percent(l["bucket_accuracy"])) + " | " +
          (l.empty() ? "-" : Cell(l["under_predicted"]) + " / " + Cell(l["over_predicted"])) + " | " +
          Cell(r["preemption_penalty"]["reservation_preemptions"]) + " | " +
          (has_penalty ? share(r["preemption_penalty"]["modelled_s"].get<double>()) : "n/a") + " | " +
          (l.empty() ? "-" : Cell(l["predict_us_per_request"], 1) + " / " + Cell(l["update_us_per_step"], 1)) + " | " +
          (l.empty() ? "-" : share(overhead)) + " |\n";
  }
  if (!s3.empty()) {
    md += "\nS3: bucket accuracy of the predictions at arrival (finished requests), mispredicted requests (under / "
          "over), preemptions of exhausted reservations, the preemption penalty (recomputing KV already computed "
          "once, and swapping) as a share of the run, and the predictor's cost on this CPU (predict per request / "
          "online update per step, and their total as a share of the run).\n\n";
    md += "| policy | rate | bucket accuracy | under / over | reservation preemptions | penalty | predictor us | "
          "predictor overhead |\n|---|---|---|---|---|---|---|---|\n" + s3;
  }
  const Json& bound = report["latency_bound"];
  md += "\nSustainable rate: " + bound["sustainable_rate"].get<std::string>() + "; bound = " +
        bound["rule"].get<std::string>() + " = " + Sig3(bound["bound_s_per_token"]) + " s/token.\n\n";
  md += "| policy | sustainable rate (req/s) | paged / policy |\n|---|---|---|\n";
  for (const auto& [policy, rate] : report["sustainable_rate_req_s"].items()) {
    const std::string key = "paged/" + policy;
    const std::string ratio =
        policy == "paged" ? "1" : report["ratios"].contains(key) ? Cell(report["ratios"][key], 2) : "n/a";
    md += "| " + policy + " | " + (rate.is_null() ? "n/a" : RateLabel(RateFromJson(rate))) + " | " + ratio + " |\n";
  }
  return md;
}

Status WriteFile(const fs::path& path, const std::string& text) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return Status::IoError("cannot write " + path.string());
  return Status::Ok();
}

std::string BaseName(const std::string& trace, const std::string& executor, const std::string& tag) {
  return "serving_" + trace + "_" + executor + (tag.empty() ? "" : "_" + tag);
}

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

Json SafeRatio(const Json& num, const Json& den) {
  if (!num.is_number() || !den.is_number() || den.get<double>() == 0) return nullptr;
  return num.get<double>() / den.get<double>();
}

Json Difference(const Json& a, const Json& b) {
  if (!a.is_number() || !b.is_number()) return nullptr;
  return a.get<double>() - b.get<double>();
}

std::string Ms(const Json& seconds) { return seconds.is_null() ? "n/a" : Sig3(1e3 * seconds.get<double>()); }

// "inf", or "inf #2" for the second of repeated runs.
std::string RunLabel(const Json& run) {
  return RateLabel(RateFromJson(run["rate_req_s"])) +
         (run.contains("repeat") ? " #" + std::to_string(run["repeat"].get<int>()) : "");
}

std::string CompareMarkdown(const Json& report) {
  const Json& t = report["trace"];
  const Json& c = report["config"];
  const Json& m = report["machine"];
  std::string md = "# Serving benchmark: kvflow-server (HTTP) vs the library, " + t["name"].get<std::string>() +
                   " trace, " + report["model"].get<std::string>() + "\n\n";
  md += "- library: `real` executor, kvflow::Engine driven in-process (wall clock), policy paged\n";
  const std::string server_args =
      report["server"].contains("args")
          ? ": `" + (report["server"].value("env", Json(nullptr)).is_string()
                         ? report["server"]["env"].get<std::string>() + " "
                         : std::string()) +
                "kvflow-server " + Join(report["server"]["args"].get<std::vector<std::string>>(), " ") + "`"
          : "";
  md += "- server: `http` executor, " + report["server"]["url"].get<std::string>() + " (" +
        report["server"]["mode"].get<std::string>() + ")" + server_args + "\n";
  md += "- client: " + report["client"].get<std::string>() + "\n";
  md += "- machine: " + m["cpu"].get<std::string>() + ", " + Cell(m["hardware_threads"]) + " hardware threads, " +
        "engine threads " + Cell(m["engine_threads"]) + ", OMP_WAIT_POLICY " +
        m["omp_wait_policy"].get<std::string>() + "; the client, the server and the library share these cores\n";
  md += "- trace: " + t["source"].get<std::string>() + "; " + std::to_string(t["num_requests"].get<int64_t>()) +
        " requests, Poisson arrivals (seed " + std::to_string(report["arrival_seed"].get<uint64_t>()) +
        "; rate inf = all at t = 0); tokenizer " + t["tokenizer"].get<std::string>() + "; input mean " +
        Fixed(t["input_len"]["mean"], 1) + " (max " + Cell(t["input_len"]["max"]) + "), output mean " +
        Fixed(t["output_len"]["mean"], 1) + " (max " + Cell(t["output_len"]["max"]) + ") tokens\n";
  md += "- engine (both): KV " + Cell(c["num_device_blocks"]) + " blocks x " + Cell(c["block_size"]) +
        " tokens; swap " + Cell(c["num_host_blocks"]) + " blocks; max_num_seqs " + Cell(c["max_num_seqs"]) +
        ", max_num_batched_tokens " + Cell(c["max_num_batched_tokens"]) + ", max_model_len " +
        Cell(c["max_model_len"]) + ", preemption " + c["preemption_mode"].get<std::string>() + "\n";
  md += "- order: per rate (and repeat), the library run, then the server run (one server for all rates; a "
        "warm-up request before each run on both sides)\n\n";
  md += "TTFT: arrival (scheduled send time) to the first token (library: the engine's stream callback; server: "
        "the first SSE event with a choice, as the client reads it). TPOT = (finish - first token) / (output tokens "
        "- 1). e2e = finish - arrival. Throughput = completed requests (output tokens) / (last finish - first "
        "arrival). A server request counts as failed unless it streams to finish_reason \"length\" with "
        "usage.completion_tokens = the trace's output length. CPU = user + system seconds over the run "
        "(library: the benchmark process; server: the server process + the client). Prefill tokens = prompt "
        "tokens the engine processed, recomputation after preemption included. Other load = CPU that other "
        "processes on the machine used during the run, in cores (0 on an otherwise idle machine); runs with other "
        "load are not clean comparisons.\n\n";
  md += "| rate (req/s) | side | done / failed | req/s | output tok/s | TTFT p50 / p90 / p99 (s) | "
        "TPOT p50 / p90 / p99 (s) | e2e p50 / p99 (s) | preemptions | prefill tokens | CPU (s) | "
        "other load (cores) | duration (s) |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    const std::string rate = RunLabel(r);
    for (const char* side : {"library", "server"}) {
      const Json& s = r[side];
      const std::string cpu =
          std::string(side) == "library"
              ? Cell(s["process_cpu_s"], 1)
              : (s.contains("server_cpu_s") ? Cell(s["server_cpu_s"], 1) + " + " : std::string("? + ")) +
                    Cell(s["client_cpu_s"], 1) + " client";
      md += "| " + rate + " | " + side + " | " + Cell(s["completed"]) + " / " + Cell(s["failed"]) + " | " +
            Fixed(s["throughput_req_s"], 2) + " | " + Fixed(s["throughput_output_tok_s"], 0) + " | " +
            Triple(s["ttft_s"]) + " | " + Triple(s["tpot_s"]) + " | " + Cell(s["e2e_s"]["p50"]) + " / " +
            Cell(s["e2e_s"]["p99"]) + " | " +
            std::to_string(s["preemptions"]["recompute"].get<int64_t>() + s["preemptions"]["swap"].get<int64_t>()) +
            " | " + Cell(s.value("prefill_tokens", Json(nullptr))) + " | " + cpu + " | " +
            Cell(s["other_load_cores"], 2) + " | " + Fixed(s["duration_s"], 1) + " |\n";
    }
  }
  md += "\n| rate (req/s) | server / library req/s | server / library output tok/s | HTTP overhead (1 - ratio) | "
        "TTFT p50 server - library (ms) | TPOT p50 server - library (ms) | e2e p50 server - library (ms) | "
        "SSE events per output token |\n";
  md += "|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    const Json& cmp = r["comparison"];
    md += "| " + RunLabel(r) + " | " + Cell(cmp["throughput_req_ratio"], 3) + " | " +
          Cell(cmp["throughput_tok_ratio"], 3) + " | " + Percent(cmp["http_overhead"]) + " | " +
          Ms(cmp["ttft_p50_delta_s"]) + " | " + Ms(cmp["tpot_p50_delta_s"]) + " | " + Ms(cmp["e2e_p50_delta_s"]) +
          " | " + Cell(r["server"]["http"]["token_events_per_output_token"], 3) + " |\n";
  }
  if (report["repeats"].get<int>() > 1) {
    md += "\nOver the " + std::to_string(report["repeats"].get<int>()) + " repeats of each rate:\n\n"
          "| rate (req/s) | server / library output tok/s: median (min - max) | HTTP overhead: median |\n"
          "|---|---|---|\n";
    for (const Json& rate : report["rates_req_s"]) {
      std::vector<double> ratios;
      for (const Json& r : report["runs"]) {
        if (r["rate_req_s"] == rate && r["comparison"]["throughput_tok_ratio"].is_number()) {
          ratios.push_back(r["comparison"]["throughput_tok_ratio"].get<double>());
        }
      }
      if (ratios.empty()) continue;
      std::sort(ratios.begin(), ratios.end());
      const double median = Percentile(ratios, 0.5);
      md += "| " + RateLabel(RateFromJson(rate)) + " | " + Fixed(median, 3) + " (" + Fixed(ratios.front(), 3) + " - " +
            Fixed(ratios.back(), 3) + ") | " + Fixed(100 * (1 - median), 1) + "% |\n";
    }
  }
  bool any_failed = false;
  for (const Json& r : report["runs"]) {
    for (const char* side : {"library", "server"}) {
      if (r[side]["failed"].get<int64_t>() == 0) continue;
      any_failed = true;
      md += "\n- rate " + RunLabel(r) + ", " + side + ": " +
            Cell(r[side]["failed"]) + " failed; first: " + r[side].value("first_error", std::string("?"));
      if (r[side].contains("http")) md += "; reasons " + r[side]["http"]["failure_reasons"].dump();
    }
  }
  if (any_failed) md += "\n";
  if (!report["server_exit"].is_null()) {
    md += "\nServer exit after SIGTERM: " + report["server_exit"]["after_sigterm"].get<std::string>() + ".\n";
  }
  return md;
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

// ---- calibrate ------------------------------------------------------------------------------

struct CalibrationOptions {
  std::string model = kDefaultModel;
  std::vector<int> prefill_lens{16, 32, 64, 128, 256, 512};
  std::vector<int> decode_batches{1, 2, 4, 8, 16, 32};
  std::vector<int> decode_contexts{64, 128, 256, 512};
  int reps = 7;
  int num_threads = 0;
  std::string out_dir = kResultsDir;
};

struct CalibrationSample {
  std::string kind;  // "prefill" or "decode"
  StepShape shape;
  std::vector<double> seconds;  // one per repetition
  double median_s = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

std::vector<int32_t> CalibrationPrompt(int len, int salt, int vocab_size) {
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int i = 0; i < len; ++i) p[static_cast<size_t>(i)] = 3 + (7 * i + 131 * salt) % (vocab_size - 3);
  return p;
}

Result<double> TimedStep(kvflow::Engine& engine, kvflow::StepResult& result) {
  const auto start = Clock::now();
  auto step = engine.Step();
  const double seconds = SecondsSince(start);
  if (!step.ok()) return step.status();
  result = step.value();
  return seconds;
}

// One sequence's whole prompt in one step (the request asks for one token, so it ends there).
Result<CalibrationSample> MeasurePrefill(kvflow::Engine& engine, int len, int reps) {
  CalibrationSample sample{"prefill", {}, {}, 0};
  sample.shape.AddSequence(0, len);
  kvflow::SamplingParams p;
  p.temperature = 0.0f;
  p.ignore_eos = true;
  p.max_tokens = 1;
  for (int rep = 0; rep <= reps; ++rep) {  // repetition 0 warms up
    KVFLOW_RETURN_IF_ERROR(
        engine.AddRequest(CalibrationPrompt(len, rep, engine.model_config().vocab_size), p).status());
    kvflow::StepResult r;
    KVFLOW_ASSIGN_OR_RETURN(double seconds, TimedStep(engine, r));
    if (r.num_prefill_tokens != len || r.num_seqs != 1 || engine.HasUnfinishedRequests()) {
      return Status::Internal("prefill of " + std::to_string(len) + " tokens did not run as one step");
    }
    if (rep > 0) sample.seconds.push_back(seconds);
  }
  sample.median_s = Median(sample.seconds);
  return sample;
}

// `batch` sequences of `context` tokens each, prefilled untimed, then `reps` timed decode steps
// after one warm-up step. A long prefill runs in chunks, so the sequences that start decoding
// first run ahead: `max_new_tokens` must cover that lead plus the timed steps.
Result<CalibrationSample> MeasureDecode(kvflow::Engine& engine, int batch, int context, int reps,
                                        int max_new_tokens) {
  CalibrationSample sample{"decode", {}, {}, 0};
  kvflow::SamplingParams p;
  p.temperature = 0.0f;
  p.ignore_eos = true;
  p.max_tokens = max_new_tokens;
  std::vector<int64_t> generated(static_cast<size_t>(batch), 0);
  std::vector<kvflow::RequestId> ids;
  for (int b = 0; b < batch; ++b) {
    auto id = engine.AddRequest(CalibrationPrompt(context, b, engine.model_config().vocab_size), p,
                                [&generated, b](const kvflow::StreamEvent& e) {
                                  generated[static_cast<size_t>(b)] += static_cast<int64_t>(e.tokens.size());
                                });
    if (!id.ok()) return id.status();
    ids.push_back(id.value());
  }
  auto all_started = [&] { return std::all_of(generated.begin(), generated.end(), [](int64_t g) { return g > 0; }); };
  while (!all_started()) KVFLOW_RETURN_IF_ERROR(engine.Step().status());
  for (int rep = 0; rep <= reps; ++rep) {  // repetition 0 warms up
    StepShape shape;  // the sampled token of each sequence is its one new token
    for (int64_t g : generated) shape.AddSequence(context + g - 1, 1);
    kvflow::StepResult r;
    KVFLOW_ASSIGN_OR_RETURN(double seconds, TimedStep(engine, r));
    if (r.num_decode_tokens != batch || r.num_prefill_tokens != 0) {
      return Status::Internal("decode of batch " + std::to_string(batch) + " did not run as one step");
    }
    if (rep > 0) sample.seconds.push_back(seconds);
    // Contexts grow by a token per step: the sample stands for the middle timed step.
    if (rep == (reps + 1) / 2) sample.shape = shape;
  }
  sample.median_s = Median(sample.seconds);
  for (kvflow::RequestId id : ids) KVFLOW_RETURN_IF_ERROR(engine.Cancel(id));
  return sample;
}

constexpr int kNumTerms = 5;
constexpr std::array<const char*, kNumTerms> kTermNames{"c0_s", "c_token_s", "c_context_s", "c_seq_s",
                                                        "c_attention_pair_s"};
using Terms = std::array<double, kNumTerms>;

Terms Features(const StepShape& s) {
  return {1.0, static_cast<double>(s.batched_tokens), static_cast<double>(s.context_tokens),
          static_cast<double>(s.num_seqs), static_cast<double>(s.attention_pairs)};
}

// Least squares of relative error (rows weighted by 1 / measured time, so short decode steps count
// as much as long prefills) over the coefficients in `active`; the others are 0.
Terms WeightedFit(const std::vector<CalibrationSample>& samples, const std::array<bool, kNumTerms>& active) {
  constexpr int n = kNumTerms;
  // Normal equations over column-scaled features (pairs reach 10^5, the constant is 1).
  Terms scale;
  scale.fill(1.0);
  for (const auto& s : samples) {
    const Terms x = Features(s.shape);
    for (int k = 0; k < n; ++k) scale[k] = std::max(scale[k], x[k]);
  }
  double a[n][n + 1] = {};  // [A^T A | A^T b]
  for (const auto& s : samples) {
    const Terms x = Features(s.shape);
    const double w = 1.0 / s.median_s;
    for (int i = 0; i < n; ++i) {
      for (int k = 0; k < n; ++k) a[i][k] += w * x[i] / scale[i] * w * x[k] / scale[k];
      a[i][n] += w * x[i] / scale[i] * w * s.median_s;
    }
  }
  for (int i = 0; i < n; ++i) {  // an inactive coefficient is pinned to 0
    if (active[i]) continue;
    for (int k = 0; k <= n; ++k) a[i][k] = 0;
    for (int k = 0; k < n; ++k) a[k][i] = 0;
    a[i][i] = 1;
  }
  for (int col = 0; col < n; ++col) {  // Gauss-Jordan with partial pivoting
    int pivot = col;
    for (int r = col + 1; r < n; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
    }
    std::swap(a[col], a[pivot]);
    for (int r = 0; r < n; ++r) {
      if (r == col || a[col][col] == 0) continue;
      const double f = a[r][col] / a[col][col];
      for (int k = col; k <= n; ++k) a[r][k] -= f * a[col][k];
    }
  }
  Terms c{};
  for (int i = 0; i < n; ++i) c[i] = active[i] && a[i][i] != 0 ? a[i][n] / a[i][i] / scale[i] : 0.0;
  return c;
}

// Non-negative fit: the most negative coefficient is clamped to 0 and the rest refitted, until
// none is negative.
Terms FitCostModel(const std::vector<CalibrationSample>& samples, std::vector<std::string>& clamped) {
  std::array<bool, kNumTerms> active;
  active.fill(true);
  while (true) {
    const Terms c = WeightedFit(samples, active);
    int most_negative = -1;
    for (int k = 0; k < kNumTerms; ++k) {
      if (active[k] && c[k] < 0 && (most_negative < 0 || c[k] < c[most_negative])) most_negative = k;
    }
    if (most_negative < 0) return c;
    active[most_negative] = false;
    clamped.push_back(kTermNames[most_negative]);
  }
}

double Predict(const Terms& c, const StepShape& shape) {
  const Terms x = Features(shape);
  return std::inner_product(c.begin(), c.end(), x.begin(), 0.0);
}

int RunCalibrate(const CalibrationOptions& opt, bool model_explicit, const std::vector<std::string>& argv) {
  WarnIfOmpSpins();
  auto model = ChooseModel(opt.model, model_explicit);
  if (!model.ok()) {
    spdlog::error("--model: {}", model.status().ToString());
    return 2;
  }
  const int max_batch = *std::max_element(opt.decode_batches.begin(), opt.decode_batches.end());
  const int max_context = std::max(*std::max_element(opt.decode_contexts.begin(), opt.decode_contexts.end()),
                                   *std::max_element(opt.prefill_lens.begin(), opt.prefill_lens.end()));
  kvflow::EngineConfig ec;
  ec.model = model->path;
  ec.max_num_seqs = max_batch;
  ec.max_num_batched_tokens = std::max(2048, max_context);
  const int max_new_tokens = max_batch * max_context / ec.max_num_batched_tokens + opt.reps + 8;
  ec.max_model_len = max_context + max_new_tokens;
  ec.num_kv_blocks = max_batch * kvflow::BlocksForTokens(ec.max_model_len, ec.block_size) + 16;
  ec.num_threads = opt.num_threads;
  auto engine = kvflow::Engine::Create(ec);
  if (!engine.ok()) {
    spdlog::error("{}", engine.status().ToString());
    return 1;
  }
  std::fprintf(stderr, "calibrating %s (%s)\n", model->name.c_str(), engine.value()->Describe().c_str());

  std::vector<CalibrationSample> samples;
  auto measure = [&](Result<CalibrationSample> s) {
    if (!s.ok()) {
      spdlog::error("{}", s.status().ToString());
      return false;
    }
    std::fprintf(stderr, "  %-7s tokens %4lld, context %6lld, seqs %3lld: %.3f ms\n", s->kind.c_str(),
                 static_cast<long long>(s->shape.batched_tokens), static_cast<long long>(s->shape.context_tokens),
                 static_cast<long long>(s->shape.num_seqs), 1e3 * s->median_s);
    samples.push_back(std::move(s.value()));
    return true;
  };
  for (int len : opt.prefill_lens) {
    if (!measure(MeasurePrefill(*engine.value(), len, opt.reps))) return 1;
  }
  for (int context : opt.decode_contexts) {
    for (int batch : opt.decode_batches) {
      if (!measure(MeasureDecode(*engine.value(), batch, context, opt.reps, max_new_tokens))) return 1;
    }
  }

  std::vector<std::string> clamped;
  const Terms c = FitCostModel(samples, clamped);
  double sum_sq = 0, max_rel = 0;
  Json sample_json = Json::array();
  std::string table =
      "| kind | batched tokens | context tokens | attention pairs | seqs | measured (ms) | model (ms) | error |\n"
      "|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : samples) {
    const double predicted = Predict(c, s.shape);
    const double rel = (predicted - s.median_s) / s.median_s;
    sum_sq += rel * rel;
    max_rel = std::max(max_rel, std::abs(rel));
    sample_json.push_back(Json{{"kind", s.kind},
                               {"batched_tokens", s.shape.batched_tokens},
                               {"context_tokens", s.shape.context_tokens},
                               {"attention_pairs", s.shape.attention_pairs},
                               {"num_seqs", s.shape.num_seqs},
                               {"median_s", s.median_s},
                               {"predicted_s", predicted},
                               {"seconds", s.seconds}});
    table += "| " + s.kind + " | " + std::to_string(s.shape.batched_tokens) + " | " +
             std::to_string(s.shape.context_tokens) + " | " + std::to_string(s.shape.attention_pairs) + " | " +
             std::to_string(s.shape.num_seqs) + " | " +
             Fixed(1e3 * s.median_s, 3) + " | " + Fixed(1e3 * predicted, 3) + " | " + Fixed(100 * rel, 1) + "% |\n";
  }
  const double rms = std::sqrt(sum_sq / static_cast<double>(samples.size()));
  Json coefficients = Json::object();
  for (int k = 0; k < kNumTerms; ++k) coefficients[kTermNames[k]] = c[k];
  Json report{{"cost_model", "cpu-measured"},
              {"command", Join(argv, " ")},
              {"provenance", kvflow::bench::Provenance(argv)},
              {"model", model->name},
              {"model_path", model->path},
              {"engine", engine.value()->Describe()},
              {"machine", MachineJson(opt.num_threads)},
              {"formula", "t = c0 + c_token * batched_tokens + c_context * sum(context_len) + c_seq * num_seqs + "
                          "c_attention_pair * sum over new tokens of their context"},
              {"coefficients", coefficients},
              {"fit",
               {{"method", "least squares of relative error over per-shape medians; negative coefficients clamped "
                           "to 0 and the rest refitted"},
                {"clamped_to_zero", clamped},
                {"rms_relative_error", rms},
                {"max_relative_error", max_rel},
                {"repetitions_per_shape", opt.reps}}},
              {"samples", sample_json}};
  std::printf("# Cost model fit: %s on %s\n\nt = %.4g + %.4g * tokens + %.4g * context + %.4g * seqs + %.4g * "
              "attention pairs (s); rms relative error %.1f%%, max %.1f%%\n\n%s",
              model->name.c_str(), CpuName().c_str(), c[0], c[1], c[2], c[3], c[4], 100 * rms, 100 * max_rel,
              table.c_str());
  const fs::path path = fs::path(opt.out_dir) / ("serving_costmodel_" + model->name + ".json");
  if (Status st = WriteFile(path, report.dump(2) + "\n"); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 1;
  }
  std::fprintf(stderr, "wrote %s\n", path.c_str());
  return 0;
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
  cmd->add_option("--policies", opt.policies, "Comma-separated scheduling policies: " +
                                                   Join(kvflow::SchedulingPolicyNames(), ", "))
      ->delimiter(',')
      ->check(CLI::IsMember(kvflow::SchedulingPolicyNames()))
      ->capture_default_str();
  cmd->add_flag("--require-complete", opt.require_complete, "Exit with code 3 when any request failed");
  cmd->add_option("--held-out-from", opt.held_out_from,
                  "Alpaca: draw the trace from the test_indices of this kvflow-length-predictor train report "
                  "(repeated as needed)");
  cmd->add_option("--length-predictor", opt.serving.length_predictor,
                  "s3: predictor file (kvflow-length-predictor train); none: untrained, learning online");
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
