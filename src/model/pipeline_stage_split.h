// Pipeline parallelism's split of one model into `stages` runs of consecutive layers, as vLLM's
// get_pp_indices does: stage s holds its layers (the first stages one more each when the count does
// not divide), the first stage the embedding, the last the final norm and the LM head (and the
// embedding too when the head is tied to it): a rank loads that share alone (WeightSelection,
// model/llama_weights.h).
#pragma once

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

// InvalidArgument unless every one of `stages` stages gets at least one layer.
Status CheckPipelineSplit(const ModelConfig& config, int stages);
// Stage `stage`'s layers; needs CheckPipelineSplit.
PipelineStageRange StageOf(const ModelConfig& config, int stage, int stages);
// The config stage `range` computes with: its layers (num_layers), numbered from
// ModelConfig::first_layer so that per-layer patterns stay the whole model's.
ModelConfig StageConfig(const ModelConfig& config, const PipelineStageRange& range);

}  // namespace kvflow
