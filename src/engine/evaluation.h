// Evaluation-only knobs, kept out of the public API: what a trace replay knows about a request
// beyond its prompt, and distorted length predictions for S3's robustness runs. The serving
// benchmark and the tests use them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/observed_kv_selector.h"
#include "kvflow/engine.h"

namespace kvflow {
namespace dist {
class Communicator;
}

// What the scheduler may know about a request beyond its prompt: the true output length (trace
// replays; what the Orca oracle baselines reserve) or a predicted one (S3).
struct RequestHints {
  std::optional<int64_t> true_output_len;
  std::optional<int64_t> predicted_output_len;
  // Trace replays that set max_tokens to the true length: the scheduler sees the context limit
  // instead, so a reservation cannot learn the true length from max_tokens.
  bool hide_max_tokens = false;
};

struct EvaluationOptions {
  // s3: distorts every length prediction, "scale:F" or "bucket:B" (see ParsePredictionOverride).
  std::string length_prediction_override;
  // prefill_parallel's ranks (tests: an in-process world whose other ranks run RunPrefillWorker);
  // null: the process's MPI world. Not owned.
  dist::Communicator* prefill_communicator = nullptr;
  // model_parallel_ranks() ranks (tests: an in-process world whose other ranks run
  // RunModelParallelWorker); null: the process's MPI world. Not owned.
  dist::Communicator* model_parallel_communicator = nullptr;
  // The same ranks' device transport for CUDA ranks (a CUDA peer world); null: NCCL. Not owned.
  dist::Communicator* model_parallel_device_communicator = nullptr;
  // KV selection tests: told what every layer's attention reads under the engine's KV selector
  // (engine/observed_kv_selector.h); unset: nothing is observed.
  KvReadObserver kv_read_observer;
};

// An Engine that also takes requests with hints.
class EvaluationEngine : public Engine {
 public:
  virtual Result<RequestId> AddRequestWithHints(std::vector<int32_t> prompt_tokens, const SamplingParams& params,
                                                StreamCallback on_event, const RequestHints& hints) = 0;
};

class SystemRegistry;

// An engine with the systems of `registry` (systems/builtin_systems.h: Engine::Create's, and
// CreateEvaluationEngine with the evaluation options), which must outlive the engine.
Result<std::unique_ptr<EvaluationEngine>> CreateEngineWithSystems(const EngineConfig& config,
                                                                  const SystemRegistry& registry,
                                                                  const EvaluationOptions& options);

}  // namespace kvflow
