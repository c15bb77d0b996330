#include "model/pipeline_stage_split.h"

#include <string>

namespace kvflow {

Status CheckPipelineSplit(const ModelConfig& config, int stages) {
  if (stages < 1) return Status::InvalidArgument("pipeline parallel size must be at least 1, got " + std::to_string(stages));
  if (stages > config.num_layers) {
    return Status::InvalidArgument("pipeline parallel size " + std::to_string(stages) + " is more than the model's " +
                                   std::to_string(config.num_layers) + " layers (every stage needs one)");
  }
  return Status::Ok();
}

PipelineStageRange StageOf(const ModelConfig& config, int stage, int stages) {
  const int base = config.num_layers / stages, extra = config.num_layers % stages;
  PipelineStageRange r;
  r.stage = stage;
  r.num_stages = stages;
  r.num_layers = base + (stage < extra ? 1 : 0);
  r.first_layer = stage * base + (stage < extra ? stage : extra);
  return r;
}

ModelConfig StageConfig(const ModelConfig& config, const PipelineStageRange& range) {
  ModelConfig c = config;
  c.first_layer = config.first_layer + range.first_layer;
  c.num_layers = range.num_layers;
  return c;
}

}  // namespace kvflow
