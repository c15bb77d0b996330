// Pipeline parallelism's split of one model into `stages` runs of consecutive layers: the first
// stage holds the embedding, the last the final norm and the LM head (and the embedding too when
// the head is tied to it), and a rank loads its share alone (WeightSelection, model/llama_weights.h).
// The layers are shared out by cost, counted in a token's multiply-adds: the LM head costs the last
// stage vocab x hidden (a fifth of SmolLM2-135M), so where that matters the last stage gets fewer
// layers, as many as makes the busiest stage (the pipeline's pace) the least busy. Where it does
// not, the split is vLLM's get_pp_indices: equal counts, the first stages one more.
#pragma once

#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"

namespace kvflow {

struct PipelineStageRange {
  int stage = 0;
  int num_stages = 1;
  int first_layer = 0;  // in the whole model
  int num_layers = 0;
  bool first() const { return stage == 0; }
  bool last() const { return stage == num_stages - 1; }
};

// A token's multiply-adds in one layer (attention projections and MLP; a mixture of experts': the
// router and the experts a token goes to), and in the LM head.
double PipelineLayerCost(const ModelConfig& config);
double PipelineHeadCost(const ModelConfig& config);

// InvalidArgument unless every one of `stages` stages gets at least one layer and `requested` (the
// user's layer counts, --pipeline-layer-split; empty: by cost) has one count a stage, each at least 1,
// adding up to the model's layers.
Status CheckPipelineSplit(const ModelConfig& config, int stages, const std::vector<int>& requested = {});
// Each stage's layer count, in stage order (the same on every rank: it depends on the config alone);
// needs CheckPipelineSplit.
// `requested`, when given, is taken as it is.
std::vector<int> PipelineLayerCounts(const ModelConfig& config, int stages, const std::vector<int>& requested = {});
// Stage `stage`'s layers; needs CheckPipelineSplit.
PipelineStageRange StageOf(const ModelConfig& config, int stage, int stages, const std::vector<int>& requested = {});
// The config stage `range` computes with: its layers (num_layers), numbered from
// ModelConfig::first_layer so that per-layer patterns stay the whole model's.
ModelConfig StageConfig(const ModelConfig& config, const PipelineStageRange& range);

}  // namespace kvflow
