// kvflow::Engine — load a model, add requests, step, stream tokens.
//
//   auto engine = kvflow::Engine::Create({.model = "smollm2-135m"}).value();
//   kvflow::SamplingParams p;  p.temperature = 0;  p.max_tokens = 32;
//   auto out = engine->Generate("The capital of France is", p);
//   std::cout << out->text;
//
// An Engine is driven by one thread at a time (the server runs it on its own thread). Several
// requests decode together: every Step() runs one batch holding prefill chunks and decode tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvflow/config.h"
#include "kvflow/engine_config.h"
#include "kvflow/models.h"
#include "kvflow/request.h"
#include "kvflow/sampling.h"
#include "kvflow/status.h"
#include "kvflow/tokenizer.h"

namespace kvflow {

// One sample of a counter or gauge a system exposes (the server's /metrics renders them as they
// come, grouping samples of one name under one HELP and TYPE).
struct SystemMetric {
  std::string name;    // "kvflow:host_prefix_cache_hit_blocks_total"
  std::string help;
  bool counter = true;  // else a gauge
  double value = 0.0;
  std::string labels;  // Prometheus labels without braces, e.g. position="0"; empty: none
};

// One rank's own time in the steps run across the ranks (ModelParallelStats::per_rank).
struct RankStepStats {
  int rank = 0;
  int stage = 0;        // its pipeline stage
  int tensor_rank = 0;  // its place in the stage's tensor-parallel group
  int64_t microbatches = 0;      // batches it ran its layers on
  double forward_seconds = 0;    // in its layers, the waits below included
  double all_reduce_seconds = 0;  // of that, in the layers' all-reduces (waiting for the slowest rank)
  int64_t all_reduce_bytes = 0;
  double residual_wait_seconds = 0;  // of that, waiting for the stage before's residual stream
  double residual_send_seconds = 0;  // handing the residual stream to the next stage
};

// Tensor and pipeline parallelism's communication, seen from the driver rank
// (EngineConfig::tensor_parallel_size or pipeline_parallel_size > 1).
struct ModelParallelStats {
  int ranks = 1;
  int tensor_parallel_size = 1;
  int pipeline_parallel_size = 1;
  int64_t steps = 0;              // steps run across the ranks
  int batches_in_flight = 1;      // steps the driver keeps in the pipeline at once
  // Steps the driver started while an earlier one was still in the later stages.
  int64_t overlapped_steps = 0;
  int64_t microbatches = 0;       // batches sent to the workers (a step's micro-batches each)
  int64_t all_reduces = 0;        // two a layer a step, and the embedding's (tensor parallelism)
  int64_t all_reduce_bytes = 0;   // this rank's part of each sum
  double all_reduce_seconds = 0;  // in the sums, waiting for the slowest rank included
  double send_seconds = 0;        // sending the steps' block moves and batches
  // Pipeline parallelism: the driver's residual sends to the second stage, and its wait for the
  // last stage's logits once its own layers have run (the later stages' time it does not overlap);
  // under tensor parallelism alone, its wait for the other ranks' columns of the logits.
  int64_t residual_bytes = 0;
  double residual_send_seconds = 0;
  double logits_wait_seconds = 0;
  // Seconds the driver spent in steps run across the ranks, all of it (its own layers included).
  double step_seconds = 0;
  // Of those, in its own layers (RankStepStats::forward_seconds of rank 0).
  double forward_seconds = 0;
  // A rank's waits for the stage before (always 0 on rank 0, the first stage; per_rank has the others').
  double residual_wait_seconds = 0;
  // Every rank's own time, in rank order (rank 0's as of now; the workers' as of their last report,
  // which rank 0 asks for after its first step and then at most once a second).
  std::vector<RankStepStats> per_rank;
};

struct EngineStats {
  int num_waiting = 0;  // requests
  int num_running = 0;
  int num_swapped = 0;
  int num_running_seqs = 0;
  int kv_blocks_total = 0;
  int kv_blocks_free = 0;       // allocatable, including unused prefix-cache blocks
  int kv_blocks_cached = 0;     // unused blocks kept for prefix hits
  int64_t kv_blocks_logical = 0;  // blocks the running sequences would hold without sharing
  int host_blocks_total = 0;
  int host_blocks_free = 0;
  // Of full prompt blocks admitted with prefix caching on, those not computed in the engine's
  // steps: found on the device or supplied by a KV connector (the host tier, a prefill across ranks).
  double prefix_cache_hit_rate = 0.0;
  int64_t prefix_cache_queried_blocks = 0;  // full prompt blocks looked up in the device prefix cache
  int64_t prefix_cache_hit_blocks = 0;      // of those, found there (host_prefix_cache: the next tier's)
  int64_t prompt_tokens_processed = 0;
  int64_t generated_tokens = 0;
  int64_t num_preemptions = 0;  // recompute + swap
  int64_t num_preemptions_swap = 0;
  int64_t blocks_swapped_out = 0;
  int64_t blocks_swapped_in = 0;
  int64_t blocks_copied = 0;    // copy-on-write
  int64_t num_steps = 0;
  S3Stats s3;
  SpecDecodeStats spec;
  KvSelectionStats kv_selection;
  KvOffloadStats kv_offload;
  HostPrefixCacheStats host_prefix_cache;
  ModelParallelStats model_parallel;
};

// What one Step() did.
// What one Step() did: the sequences and tokens of the step it started, and how many steps ended.
// One step at a time, a step starts and ends in the same call; with batches in flight (pipeline
// parallelism) a call may only start a step (num_steps_completed 0), or only end the oldest one
// (num_seqs 0).
struct StepResult {
  int num_seqs = 0;
  int num_prefill_tokens = 0;
  int num_decode_tokens = 0;
  int num_steps_completed = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const EngineConfig& config);
  virtual ~Engine() = default;

  // Queues a request. `on_event` is called from Step() for each new token and once at the end.
  virtual Result<RequestId> AddRequest(const std::string& prompt, const SamplingParams& params,
                                       StreamCallback on_event = {}) = 0;
  virtual Result<RequestId> AddRequest(std::vector<int32_t> prompt_tokens, const SamplingParams& params,
                                       StreamCallback on_event = {}) = 0;
  // The checks AddRequest makes (parameters, prompt ids, lengths, limits) without queuing anything.
  // Reads only the configuration, so any thread may call it while another drives the engine.
  virtual Status ValidateRequest(const std::vector<int32_t>& prompt_tokens, const SamplingParams& params) const = 0;
  // Stops a request and frees its KV blocks; its callback receives FinishReason::kCancelled.
  virtual Status Cancel(RequestId id) = 0;

  // Runs one iteration: schedules a batch, runs the model, samples, streams.
  virtual Result<StepResult> Step() = 0;
  virtual bool HasUnfinishedRequests() const = 0;

  // Runs requests to completion (together, in one batch when they fit). With n > 1 every
  // completion is in RequestOutput::outputs.
  virtual Result<RequestOutput> Generate(const std::string& prompt, const SamplingParams& params,
                                         StreamCallback on_event = {}) = 0;
  virtual Result<std::vector<RequestOutput>> Generate(const std::vector<std::string>& prompts,
                                                      const SamplingParams& params) = 0;

  virtual const ModelConfig& model_config() const = 0;
  virtual const EngineConfig& config() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual EngineStats stats() const = 0;
  // Every registered system's metrics, derived by the system itself from `stats` (zero when it is
  // off). Reads nothing else, so any thread may call it.
  virtual std::vector<SystemMetric> SystemMetrics(const EngineStats& stats) const = 0;
  virtual std::string Describe() const = 0;
};

}  // namespace kvflow
