// The scheduler side of a KV connector (vLLM's KVConnectorBase_V1, scheduler role): something
// that supplies or keeps KV outside the device pool's prefix cache. At admission the block manager
// asks each connector, in order, how many more leading prompt tokens it can supply past the
// device's prefix hits; the request's blocks for those tokens are allocated as usual and the
// connector is told which they are. At the end of every schedule it hands the connector the
// cached device blocks that allocation reclaimed (so their content can be saved before anything
// overwrites it) and takes the block moves the connector planned for the step. The worker side
// (engine/kv_connector.h) carries them out before the step's forward pass: every connector's
// saves first, then every connector's loads. Plain C++: no backend.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_allocator.h"

namespace kvflow {

class KvConnectorScheduler;

// The moves one connector planned for a step. Host block ids index the backend's host pool.
struct KvConnectorMoves {
  const KvConnectorScheduler* connector = nullptr;
  std::vector<BlockMove> save;  // device -> host, before the step writes anything
  std::vector<BlockMove> load;  // host -> device, after every connector's saves
  bool empty() const { return save.empty() && load.empty(); }
};

class KvConnectorScheduler {
 public:
  virtual ~KvConnectorScheduler() = default;

  // Of `tokens` (a prompt being admitted), whose first `num_cached` tokens the device (or an
  // earlier connector) supplies, how many more leading tokens this connector supplies: whole
  // blocks, never the last token (it must run to give logits). 0: none. Changes nothing a later
  // call could see, except what UpdateStateAfterAlloc, which follows a non-zero answer at once,
  // takes over.
  virtual int64_t NumMatchedTokens(std::span<const int32_t> tokens, int64_t num_cached) = 0;
  // The admission went ahead: `blocks` are the fresh device blocks of tokens [first_token,
  // first_token + blocks.size() * block_size), which this connector now owes the step.
  virtual void UpdateStateAfterAlloc(std::span<const int32_t> tokens, int64_t first_token,
                                     std::span<const BlockId> blocks) = 0;
  // Whether it wants the content of reclaimed cached device blocks (OnEvicted).
  virtual bool WantsEvictions() const { return false; }
  // Cached device blocks reclaimed since the last call, content intact until the step runs.
  virtual void OnEvicted(std::span<const EvictedBlock> blocks) {}
  // The moves planned since the last call (for the step being scheduled).
  virtual KvConnectorMoves TakeStepMoves() = 0;
};

}  // namespace kvflow
