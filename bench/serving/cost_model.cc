// The serving simulator's cost model: step time from a step's shape (analytic A100 models or coefficients fitted on this machine).
#include "serving/cost_model.h"

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

namespace kvflow::bench::serving {

namespace {

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
}  // namespace

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

}  // namespace kvflow::bench::serving
