// Registers S3's scheduling policies: "s3" (length-aware admission with the output-length predictor
// and its supervisor, sched/length_supervisor.h) and "s3-oracle" (the evaluation's oracle lengths).
// The policy and the predictor are mechanism in sched/; this folder wires them into the engine.
#pragma once

#include <string>

#include "engine/system_registry.h"

namespace kvflow {

Status RegisterS3(SystemRegistry& registry);

// Identifies the hidden space a length probe (sched/length_probe.h) reads: the model's architecture
// and shape and its tokenizer's vocabulary. Two fine-tunes of one base model are not told apart.
std::string LengthProbeModelFingerprint(const ModelConfig& config, const Tokenizer& tokenizer);

}  // namespace kvflow
