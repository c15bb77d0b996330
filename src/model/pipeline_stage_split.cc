#include "model/pipeline_stage_split.h"

#include <iterator>
#include <string>
#include <utility>

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

LlamaWeights StageWeights(LlamaWeights whole, const PipelineStageRange& range) {
  LlamaWeights w;
  auto first = whole.layers.begin() + range.first_layer;
  w.layers.assign(std::make_move_iterator(first), std::make_move_iterator(first + range.num_layers));
  const bool tied = whole.lm_head.empty();
  if (range.first() || (range.last() && tied)) w.embed = std::move(whole.embed);
  if (range.last()) {
    w.final_norm = std::move(whole.final_norm);
    w.lm_head = std::move(whole.lm_head);
  }
  return w;
}

}  // namespace kvflow
