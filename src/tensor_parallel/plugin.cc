#include "tensor_parallel/plugin.h"

#include "tensor_parallel/tensor_parallel_service.h"

namespace kvflow {

Status RegisterTensorParallel(SystemRegistry& registry) {
  ModelParallelPlugin p;
  p.info.name = kTensorParallel;
  p.info.label = "tensor parallelism";
  // The workers run the model's plain layers on the steps' batches: what reads or moves KV beyond
  // the swap and copy-on-write moves, or runs a second model, has no path to them yet.
  p.info.excludes = {
      {"kv_connector", "the workers' shares of the KV cache would not be saved or loaded"},
      {"kv_selector", "the selection runs on the driver's heads alone"},
      {"drafter", "speculative decoding's lanes and draft passes are not mirrored to the workers yet"},
      {"prefiller", "a prompt prefilled across ranks would fill only the driver's share"},
      {"draft model", "a draft model would run on the driver alone"},
  };
  p.info.validate = [](const EngineConfig& c) -> Status {
    if (c.device != "cpu") {
      return Status::Unsupported("tensor parallelism runs CPU ranks over MPI; CUDA ranks over NCCL (device " + c.device +
                                 ") are not implemented yet");
    }
    return Status::Ok();
  };
  p.info.metrics = [](const EngineStats& stats, std::vector<SystemMetric>& out) {
    const ModelParallelStats& m = stats.model_parallel;
    AddGauge(out, "kvflow:tensor_parallel_ranks", "Ranks the model is split across (1: whole)", m.ranks);
    AddCounter(out, "kvflow:tensor_parallel_steps_total", "Batches rank 0 sent its tensor-parallel workers",
               static_cast<double>(m.steps));
    AddCounter(out, "kvflow:tensor_parallel_all_reduce_seconds_total",
               "Rank 0's seconds in the layers' all-reduces (waiting for the slowest rank included)",
               m.all_reduce_seconds);
    AddCounter(out, "kvflow:tensor_parallel_all_reduce_bytes_total", "Rank 0's bytes into the layers' all-reduces",
               static_cast<double>(m.all_reduce_bytes));
    AddCounter(out, "kvflow:tensor_parallel_send_seconds_total", "Rank 0's seconds sending steps to its workers",
               m.send_seconds);
  };
  p.create = [](const ModelParallelContext& ctx) { return tp::CreateTensorParallelDriver(ctx); };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
