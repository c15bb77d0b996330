// The calibrate subcommand: times Engine::Step() on prefill and decode batches and fits the sim's cost model.
#include "serving/calibrate.h"

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

#include "serving/cost_model.h"
#include "serving/report.h"

namespace kvflow::bench::serving {

namespace {

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
}  // namespace

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

}  // namespace kvflow::bench::serving
