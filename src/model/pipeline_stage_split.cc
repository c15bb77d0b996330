#include "model/pipeline_stage_split.h"

#include <algorithm>
#include <string>
#include <vector>

namespace kvflow {
namespace {

// vLLM's get_pp_indices: equal counts, the first `layers % stages` stages one more.
std::vector<int> EqualCounts(int layers, int stages) {
  std::vector<int> counts(static_cast<size_t>(stages), layers / stages);
  for (int s = 0; s < layers % stages; ++s) ++counts[static_cast<size_t>(s)];
  return counts;
}

// The most any stage of `counts` costs, the head's cost on the last.
double MaxStageCost(const std::vector<int>& counts, double layer, double head) {
  double worst = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    worst = std::max(worst, counts[s] * layer + (s + 1 == counts.size() ? head : 0.0));
  }
  return worst;
}

}  // namespace

double PipelineLayerCost(const ModelConfig& c) {
  const double hidden = c.hidden_size;
  const double q = static_cast<double>(c.num_heads) * c.head_dim, kv = static_cast<double>(c.num_kv_heads) * c.head_dim;
  double mlp = 3.0 * hidden * c.intermediate_size;
  if (c.num_experts > 0) {
    mlp = 3.0 * hidden * c.expert_intermediate_size * c.experts_per_token + hidden * c.num_experts +
          3.0 * hidden * c.shared_expert_intermediate_size;
  }
  return hidden * (q + 2 * kv) + q * hidden + mlp;
}

double PipelineHeadCost(const ModelConfig& c) { return static_cast<double>(c.vocab_size) * c.hidden_size; }

Status CheckPipelineSplit(const ModelConfig& config, int stages, const std::vector<int>& requested) {
  if (stages < 1) return Status::InvalidArgument("pipeline parallel size must be at least 1, got " + std::to_string(stages));
  if (stages > config.num_layers) {
    return Status::InvalidArgument("pipeline parallel size " + std::to_string(stages) + " is more than the model's " +
                                   std::to_string(config.num_layers) + " layers (every stage needs one)");
  }
  if (requested.empty()) return Status::Ok();
  std::string given;
  long total = 0;
  bool positive = true;
  for (int n : requested) {
    given += (given.empty() ? "" : ",") + std::to_string(n);
    total += n;
    positive = positive && n >= 1;
  }
  if (static_cast<int>(requested.size()) != stages || !positive || total != config.num_layers) {
    return Status::InvalidArgument("--pipeline-layer-split " + given + ": give " + std::to_string(stages) +
                                   " layer counts (one a stage), each at least 1, adding up to the model's " +
                                   std::to_string(config.num_layers) + " layers");
  }
  return Status::Ok();
}

std::vector<int> PipelineLayerCounts(const ModelConfig& config, int stages, const std::vector<int>& requested) {
  if (!requested.empty()) return requested;
  const int layers = config.num_layers;
  std::vector<int> equal = EqualCounts(layers, stages);
  if (stages == 1) return equal;
  const double layer = PipelineLayerCost(config), head = PipelineHeadCost(config);
  // The last stage's load with k layers is k * layer + head; the others share the rest equally.
  // The smallest possible maximum: try every layer count for the last stage, the most first (of
  // splits as good, the one that leaves the last stage least idle).
  double best = MaxStageCost(equal, layer, head);
  std::vector<int> best_counts = equal;
  for (int last = layers - (stages - 1); last >= 1; --last) {
    std::vector<int> counts = EqualCounts(layers - last, stages - 1);
    counts.push_back(last);
    const double cost = MaxStageCost(counts, layer, head);
    // Strictly better only: where the head changes nothing the split stays vLLM's.
    if (cost < best * (1 - 1e-9)) {
      best = cost;
      best_counts = std::move(counts);
    }
  }
  return best_counts;
}

PipelineStageRange StageOf(const ModelConfig& config, int stage, int stages, const std::vector<int>& requested) {
  const std::vector<int> counts = PipelineLayerCounts(config, stages, requested);
  PipelineStageRange r;
  r.stage = stage;
  r.num_stages = stages;
  r.num_layers = counts[static_cast<size_t>(stage)];
  for (int s = 0; s < stage; ++s) r.first_layer += counts[static_cast<size_t>(s)];
  return r;
}

ModelConfig StageConfig(const ModelConfig& config, const PipelineStageRange& range) {
  ModelConfig c = config;
  c.first_layer = config.first_layer + range.first_layer;
  c.num_layers = range.num_layers;
  return c;
}

}  // namespace kvflow
