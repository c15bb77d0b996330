// Tensor and pipeline parallelism over a communicator: the job's tensor_parallel_size x
// pipeline_parallel_size ranks form a grid, rank r = stage * tp + tp_rank. Stage s holds a run of
// the layers (model/pipeline_stage_split.h); inside a stage the tp ranks split each layer's heads
// and MLP width (model/tensor_parallel_shard.h) and sum the row-parallel projections' partial
// outputs (AllReduceSum over the stage's group; CUDA ranks sum their device buffers over NCCL).
// Rank 0 (the driver: stage 0, tp rank 0) runs the
// engine on its share; the other ranks (the workers) run every step's share with it.
//
// Start-up: the driver builds its backend, sends each worker the settings that fix the shapes of
// its pools (max_model_len, block counts); each worker builds its own and answers with what it
// built, and the driver refuses the job where a worker differs (another model, dtype or split).
// Each step: the block moves (if any) to every worker; then the batch, cut into micro-batches under
// pipeline parallelism: each goes to every worker, and stage s's tp rank i runs it once the residual
// stream comes from stage s-1's tp rank i, then sends it on to stage s+1's; the last stage's tp rank
// 0 sends the logits back to the driver. Stage s works on micro-batch k while stage s+1 works on k-1.
// With batches in flight (the default under pipeline parallelism) a step is one micro-batch and the
// driver does not wait for its logits: it starts the next steps (SubmitStep) and takes the oldest
// step's logits (CollectStep) once P are in flight; every rank runs the messages in order.
//
// Faults: every wait has the communicator's timeout, so a rank that dies or hangs fails the step in
// flight (its requests get the error) and every later one, and the server and CLI end the job;
// never a silent hang.
#pragma once

#include <memory>
#include <string>

#include "distributed/communicator.h"
#include "engine/model_parallel.h"
#include "engine/system_registry.h"
#include "kvflow/engine_config.h"

namespace kvflow::mp {

// The driver's parts over `ctx.communicator` (null: the process's world), whose size must be
// ctx.config.model_parallel_ranks() and whose rank must be 0.
Result<ModelParallelParts> CreateModelParallelDriver(const ModelParallelContext& ctx);

// A worker rank: builds its share of `config`'s model once the driver says how, then runs the
// driver's steps until it says stop or goes away. Returns the error that ended it, Ok after a stop;
// `ready` (optional) tells whether it got as far as answering the driver.
// CUDA ranks sum over `device_comm` (the same ranks' device transport; null: NCCL over `comm`).
Status RunModelParallelWorker(const EngineConfig& config, dist::Communicator& comm,
                              double timeout_s = dist::kDefaultCommTimeoutSeconds, bool* ready = nullptr,
                              dist::Communicator* device_comm = nullptr);

// For the server's and the CLI's main: with model_parallel_ranks() > 1, a process that is not rank
// 0 of the MPI job runs the worker and returns true when it ends (the caller exits; a worker that
// fails ends the whole job: the driver cannot go on without its share). Rank 0, and every process
// when the model is whole, returns false and goes on.
Result<bool> RunModelParallelWorkerIfNotDriver(const EngineConfig& config);

}  // namespace kvflow::mp
