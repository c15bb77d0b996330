// The worker side of a KV connector (vLLM's KVConnectorBase_V1, worker role): it carries out, on
// a backend, the KV movement its scheduler side (kv/kv_connector_scheduler.h) planned for a step, and may act
// inside the step's passes layer by layer. The engine runs every connector's Save, then every
// connector's Load, then the copy-on-write copies, before the forward pass, on the target's
// backend and on every follower's (a draft model's pool follows the target's block tables). The
// connectors the engine runs, in order:
//   swap               the scheduler's preemption by swap: swap-out saves, swap-in loads
//   host_prefix_cache  evicted prefix blocks saved to host memory and loaded back on a hit
//   kv_offload         the KV pool in host memory: each layer's reads fetched during the layer
//                      before (per-layer loads through its hooks; no block moves)
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "forward/llama_model.h"
#include "kv/kv_connector_scheduler.h"
#include "kvflow/engine.h"
#include "sched/scheduler.h"

namespace kvflow {

class KvConnector {
 public:
  virtual ~KvConnector() = default;
  virtual std::string name() const = 0;
  // One line for the engine's log.
  virtual std::string Describe() const { return name(); }

  // Its scheduler side, which the block manager consults (null: it plans no block moves of its
  // own). Owned by the connector.
  virtual KvConnectorScheduler* scheduler_side() { return nullptr; }
  // The step's saves (device -> host) on `backend`; `moves` is what its scheduler side planned for
  // the step (null: nothing).
  virtual Status Save(const SchedulerOutput& step, const KvConnectorMoves* moves, Backend& backend) {
    return Status::Ok();
  }
  // The step's loads (host -> device), after every connector's saves.
  virtual Status Load(const SchedulerOutput& step, const KvConnectorMoves* moves, Backend& backend) {
    return Status::Ok();
  }
  // Hooks around every other feature's in the target's passes, for loads that follow the layers
  // (null: none).
  virtual WrappingHooks* layer_hooks() { return nullptr; }
  // Adds its counters to the engine's.
  virtual void AddStats(EngineStats& stats) const {}
};

// The scheduler's swap-out and swap-in (SchedulerOutput::swap_out, swap_in) as a connector.
class SwapConnector final : public KvConnector {
 public:
  std::string name() const override { return "swap"; }
  Status Save(const SchedulerOutput& step, const KvConnectorMoves*, Backend& backend) override {
    return backend.CopyBlocks(step.swap_out, BlockCopyKind::kDeviceToHost);
  }
  Status Load(const SchedulerOutput& step, const KvConnectorMoves*, Backend& backend) override {
    return backend.CopyBlocks(step.swap_in, BlockCopyKind::kHostToDevice);
  }
};

}  // namespace kvflow
