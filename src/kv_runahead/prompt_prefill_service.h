// KV-Runahead in the serving path: an mpirun job whose last rank runs the engine (HTTP, scheduling,
// decoding) and whose other ranks are prefill workers. A prompt of at least
// EngineConfig::prefill_parallel_min_tokens tokens is prefilled across every rank
// (chain_prefill.h) into the blocks the last rank's engine admitted it with (engine/
// prompt_prefill_connector.h); shorter prompts never leave the last rank.
//
// Protocol (all between the last rank L and each worker w, on the job's communicator):
//   at start   w -> L  hello: the worker's model shape and KV format, which must equal L's, and
//                      whether it can take the K/V in device memory over NCCL
//   a prefill  L -> w  command [kPrefill, method, tag_base, transport, bounds 0..P], then w's chunk
//              tokens; then the layers' K/V flow as chain_prefill.h says, under tags tag_base + layer
//   at the end L -> w  command [kStop, ...]
// The K/V travel over NCCL from device buffers when every rank runs a CUDA backend and kvflow was
// built with NCCL (one GPU per rank: the rank's --device); otherwise over the job's communicator
// from host buffers. The first prefill that uses NCCL opens its world on every rank (collective),
// after the command and the tokens went out, and every later one reuses it.
// A failure anywhere (a worker that errs, a peer that times out) fails that prefill, which the
// engine then computes on its own, and turns distributed prefill off for good: the workers' state is
// unknown after it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "backend/backend.h"
#include "kv_runahead/chain_prefill.h"
#include "distributed/communicator.h"
#include "distributed/world.h"
#include "kv_runahead/partition_table.h"
#include "engine/prompt_prefiller.h"
#include "kvflow/engine_config.h"

namespace kvflow::dist {

// The engine's side (the last rank). Not thread-safe: the engine's thread calls it.
class DistributedPromptPrefiller final : public PromptPrefiller {
 public:
  // Waits (up to `timeout_s`) for every worker's hello and checks it against `backend` and the
  // engine's max_model_len (a worker must hold a whole prompt).
  static Result<std::unique_ptr<DistributedPromptPrefiller>> Create(Communicator& comm, Backend& backend,
                                                                    int64_t max_model_len,
                                                                    PrefillMethod method, int64_t min_tokens,
                                                                    std::optional<PartitionTable> table,
                                                                    double timeout_s = kDefaultCommTimeoutSeconds);
  // Tells the workers to stop.
  ~DistributedPromptPrefiller() override;

  int64_t TokensToPrefill(std::span<const int32_t> prompt, int block_size) const override;
  Status Prefill(std::span<const int32_t> prompt, int64_t num_tokens, std::span<const BlockId> block_table) override;
  std::string Describe() const override;

 private:
  DistributedPromptPrefiller(Communicator& comm, Backend& backend, PrefillMethod method, int64_t min_tokens,
                             std::optional<PartitionTable> table, double timeout_s, bool device_transport);
  Status SendCommand(int worker, std::span<const int64_t> command);

  Communicator& comm_;
  bool device_transport_;                     // the K/V go over NCCL (opened at the first prefill)
  std::unique_ptr<Communicator> kv_comm_;     // that NCCL world, once open
  Backend& backend_;
  PrefillMethod method_;
  int64_t min_tokens_;
  std::optional<PartitionTable> table_;
  double timeout_s_;
  int64_t prefills_ = 0;
  bool broken_ = false;
  DistributedPrefillStats last_stats_;
};

// A backend of `config`'s model on this rank whose pool holds one prompt of `max_tokens` tokens
// (0 or more than the model's context length: that length), as a prefill worker or a measuring
// rank needs: no swap space, resident KV.
Result<std::unique_ptr<Backend>> CreatePrefillRankBackend(EngineConfig config, int64_t max_tokens);

// A worker rank (every rank but the last): builds its own backend for `config`'s model, says hello,
// then runs the last rank's prefills until it says stop or goes away. Returns the error that ended
// it, Ok after a stop; `ready` (optional) tells whether it got as far as its hello.
Status RunPrefillWorker(const EngineConfig& config, Communicator& comm,
                        double timeout_s = kDefaultCommTimeoutSeconds, bool* ready = nullptr);

// For the server's and the CLI's main: with config.prefill_parallel set, a process that is not the
// job's last rank runs the prefill worker and returns true when it ends (the caller exits); the
// last rank, and every process when prefill_parallel is off, returns false and goes on. A worker
// that cannot start (no model, no memory) ends the whole job (AbortJob): the last rank would wait
// for it. One that fails later returns its error; the last rank serves on alone.
Result<bool> RunPrefillWorkerIfNotLastRank(const EngineConfig& config);

// The engine's prefiller for config.prefill_parallel over `comm` (null: the process's world).
Result<std::unique_ptr<PromptPrefiller>> CreatePromptPrefiller(const EngineConfig& config, Backend& backend,
                                                               Communicator* comm);

}  // namespace kvflow::dist
