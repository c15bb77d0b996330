// Tensor parallelism over a communicator: rank 0 (the driver) runs the engine on its share of the
// model and drives the other ranks (the workers), which run every step's share in lockstep.
//
// Start-up: the driver builds its backend, sends each worker the settings that fix the shapes of
// its pools (max_model_len, block counts); each worker builds its own and answers with what it
// built, and the driver refuses the job where a worker differs (another model, dtype or split).
// Each step: the block moves (if any), then the batch, to every worker, before the driver runs them.
// Inside each layer the ranks sum the row-parallel projections' partial outputs (AllReduceSum).
//
// Faults: every wait has the communicator's timeout, so a rank that dies or hangs fails the step in
// flight (its requests get the error) and every later one, and the server and CLI end the job
// (TensorParallelGroupFailed); never a silent hang.
#pragma once

#include <memory>
#include <string>

#include "distributed/communicator.h"
#include "engine/model_parallel.h"
#include "engine/system_registry.h"
#include "kvflow/engine_config.h"

namespace kvflow::tp {

// The driver's parts over `ctx.communicator` (null: the process's world), whose size must be
// ctx.config.tensor_parallel_size and whose rank must be 0.
Result<ModelParallelParts> CreateTensorParallelDriver(const ModelParallelContext& ctx);

// A worker rank: builds its share of `config`'s model once the driver says how, then runs the
// driver's steps until it says stop or goes away. Returns the error that ended it, Ok after a stop;
// `ready` (optional) tells whether it got as far as answering the driver.
Status RunTensorParallelWorker(const EngineConfig& config, dist::Communicator& comm,
                               double timeout_s = dist::kDefaultCommTimeoutSeconds, bool* ready = nullptr);

// For the server's and the CLI's main: with tensor_parallel_size > 1, a process that is not rank 0
// of the MPI job runs the worker and returns true when it ends (the caller exits; a worker that
// fails ends the whole job: the driver cannot go on without its share). Rank 0, and every process
// when tensor parallelism is off, returns false and goes on.
Result<bool> RunTensorParallelWorkerIfNotDriver(const EngineConfig& config);

}  // namespace kvflow::tp
