// Serving-benchmark traces: the synthetic ShareGPT-like workload, the Alpaca trace loaded from its dataset, Poisson arrivals.
#include "serving/trace.h"

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
#include "chat_template/chat_template.h"
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

namespace kvflow::bench::serving {

std::vector<double> UnitPoissonArrivals(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(1.0);
  std::vector<double> arrivals(n);
  double t = 0.0;
  for (double& a : arrivals) a = t += gap(rng);
  return arrivals;
}
namespace {

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
}  // namespace

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

namespace {

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

// `n` entries of seeded shuffles of `pool`, one whole shuffle after another (a pool smaller than
// the trace is replayed).
template <typename T>
std::vector<T> RepeatedShuffles(const std::vector<T>& pool, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> order;
  while (order.size() < n) {
    std::vector<T> pass = pool;
    std::shuffle(pass.begin(), pass.end(), rng);
    order.insert(order.end(), pass.begin(), pass.end());
  }
  return order;
}

// A label JSONL of kvflow-length-predictor label --chat: each prompt as one user message in the
// model's chat template, its output length the one the model generated greedily.
Result<Trace> LoadLabelsTrace(const std::string& path, size_t num_requests, uint64_t seed, int64_t max_model_len,
                              const ModelChoice& tokenizer_model, const std::string& held_out_from) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open the label file " + path);
  std::map<int64_t, std::pair<std::string, int64_t>> labels;  // Alpaca index -> prompt, output length
  std::string line;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const Json j = Json::parse(line);
      labels[j.at("index").get<int64_t>()] = {j.at("prompt").get<std::string>(), j.at("output_len").get<int64_t>()};
    } catch (const Json::exception& e) {
      return Status::CorruptFile(path + ": " + e.what());
    }
  }
  if (labels.empty()) return Status::CorruptFile(path + ": no labelled prompts");
  std::vector<int64_t> pool;
  if (held_out_from.empty()) {
    for (const auto& [index, _] : labels) pool.push_back(index);
  } else {
    KVFLOW_ASSIGN_OR_RETURN(std::vector<size_t> held_out, LoadHeldOutIndices(held_out_from));
    for (size_t i : held_out) {
      if (!labels.count(static_cast<int64_t>(i))) {
        return Status::CorruptFile(held_out_from + ": index " + std::to_string(i) + " is not labelled in " + path);
      }
      pool.push_back(static_cast<int64_t>(i));
    }
  }
  KVFLOW_ASSIGN_OR_RETURN(kvflow::ModelFiles files, OpenModel(tokenizer_model));
  if (!files.tokenizer) return Status::NotFound("no tokenizer in " + tokenizer_model.path);
  const kvflow::Tokenizer& tok = *files.tokenizer;
  KVFLOW_ASSIGN_OR_RETURN(kvflow::ChatTemplate chat, kvflow::ChatTemplate::Create(tok.chat_template(), "", ""));

  const std::vector<int64_t> order = RepeatedShuffles(pool, num_requests, seed);
  Trace trace;
  trace.name = "alpaca";
  int64_t truncated = 0;
  for (size_t i = 0; i < num_requests; ++i) {
    const auto& [prompt, output_len] = labels.at(order[i]);
    KVFLOW_ASSIGN_OR_RETURN(std::string rendered, chat.Render(kvflow::ChatTemplateInput::User(prompt)));
    TraceRequest r;
    r.prompt = tok.Encode(rendered, tok.add_bos());
    r.output_len = std::max<int64_t>(1, output_len);
    truncated += FitToModelLen(r.prompt, r.output_len, max_model_len);
    trace.requests.push_back(std::move(r));
  }
  trace.info = Json{{"name", "alpaca"},
                    {"source", path},
                    {"labels", "the model's own greedy output lengths (kvflow-length-predictor label --chat)"},
                    {"dataset_entries", labels.size()},
                    {"sampling", held_out_from.empty() ? "seeded shuffles of every labelled prompt"
                                                        : "the held-out prompts of " + held_out_from + " (" +
                                                              std::to_string(pool.size()) +
                                                              "), seeded shuffles, repeated as needed"},
                    {"seed", seed},
                    {"prompt", "instruction + (\"\\n\" + input if non-empty), one user message in the chat template"},
                    {"tokenizer", tokenizer_model.name},
                    {"tokenizer_path", tokenizer_model.path}};
  AddRealizedStats(trace, truncated);
  return trace;
}

}  // namespace

// Alpaca: prompt = instruction (+ "\n" + input), output = the reference output, both tokenized;
// a seeded random sample of the dataset (a label JSONL: the model's own output lengths).
Result<Trace> LoadAlpacaTrace(const std::string& path, size_t num_requests, uint64_t seed, int64_t max_model_len,
                              const ModelChoice& tokenizer_model, const std::string& held_out_from) {
  if (path.size() > 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0) {
    return LoadLabelsTrace(path, num_requests, seed, max_model_len, tokenizer_model, held_out_from);
  }
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

  const std::vector<size_t> order = RepeatedShuffles(pool, num_requests, seed);
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

}  // namespace kvflow::bench::serving
