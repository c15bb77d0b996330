#include "model_parallel/plugin.h"

#include "model_parallel/model_parallel_service.h"

namespace kvflow {

Status RegisterModelParallel(SystemRegistry& registry) {
  ModelParallelPlugin p;
  p.info.name = kModelParallel;
  p.info.label = "tensor and pipeline parallelism";
  // The workers run the model's plain layers on the steps' batches: what reads or moves KV beyond
  // the swap and copy-on-write moves, or runs a second model, has no path to them yet.
  p.info.excludes = {
      {"kv_connector", "the workers' shares of the KV cache would not be saved or loaded"},
      {"kv_selector", "the selection runs on the driver's heads and layers alone"},
      {"drafter", "speculative decoding's lanes and draft passes are not mirrored to the workers yet"},
      {"prefiller", "a prompt prefilled across ranks would fill only the driver's share"},
      {"draft model", "a draft model would run on the driver alone"},
  };
  p.info.validate = [](const EngineConfig& c) -> Status {
    if (c.device != "cpu" && c.pipeline_parallel_size > 1) {
      return Status::Unsupported("pipeline parallelism on CUDA ranks (device " + c.device +
                                 ") is not implemented yet: the residual stream would cross the host; tensor "
                                 "parallelism over NCCL is");
    }
    return Status::Ok();
  };
  p.info.metrics = [](const EngineStats& stats, std::vector<SystemMetric>& out) {
    const ModelParallelStats& m = stats.model_parallel;
    AddGauge(out, "kvflow:tensor_parallel_ranks", "Ranks each layer is split across (1: whole)", m.tensor_parallel_size);
    AddGauge(out, "kvflow:pipeline_parallel_stages", "Stages the layers are split into (1: one)", m.pipeline_parallel_size);
    AddCounter(out, "kvflow:model_parallel_steps_total", "Steps rank 0 ran across the ranks", static_cast<double>(m.steps));
    AddCounter(out, "kvflow:model_parallel_step_seconds_total",
               "Rank 0's seconds in steps run across the ranks (its own layers and its waits)", m.step_seconds);
    AddCounter(out, "kvflow:pipeline_parallel_microbatches_total", "Batches rank 0 sent its workers (micro-batches)",
               static_cast<double>(m.microbatches));
    AddGauge(out, "kvflow:pipeline_parallel_batches_in_flight", "Steps rank 0 keeps in the pipeline at once",
             m.batches_in_flight);
    AddCounter(out, "kvflow:pipeline_parallel_overlapped_steps_total",
               "Steps rank 0 started while an earlier one was still in the later stages",
               static_cast<double>(m.overlapped_steps));
    AddCounter(out, "kvflow:tensor_parallel_all_reduce_seconds_total",
               "Rank 0's seconds in the layers' all-reduces (waiting for the slowest rank included)",
               m.all_reduce_seconds);
    AddCounter(out, "kvflow:tensor_parallel_all_reduce_bytes_total", "Rank 0's bytes into the layers' all-reduces",
               static_cast<double>(m.all_reduce_bytes));
    AddCounter(out, "kvflow:model_parallel_send_seconds_total", "Rank 0's seconds sending steps to its workers",
               m.send_seconds);
    AddCounter(out, "kvflow:pipeline_parallel_residual_bytes_total",
               "Bytes of residual stream rank 0 sent the second stage", static_cast<double>(m.residual_bytes));
    AddCounter(out, "kvflow:pipeline_parallel_logits_wait_seconds_total",
               "Rank 0's seconds waiting for logits after its own layers: the last stage's under pipeline parallelism, "
               "the other tensor ranks' vocabulary columns under tensor parallelism alone",
               m.logits_wait_seconds);
    // Each rank's own time (the workers' as of their last report, at most a second old), labelled
    // by rank, stage and tensor rank; a whole model shows rank 0's zeros.
    std::vector<RankStepStats> ranks = m.per_rank;
    if (ranks.empty()) ranks.resize(1);
    struct PerRank {
      const char* name;
      const char* help;
      double (*value)(const RankStepStats&);
    };
    const PerRank per_rank[] = {
        {"kvflow:model_parallel_rank_microbatches_total", "Batches each rank ran its layers on",
         [](const RankStepStats& r) { return static_cast<double>(r.microbatches); }},
        {"kvflow:model_parallel_rank_forward_seconds_total", "Each rank's seconds in its layers, its waits included",
         [](const RankStepStats& r) { return r.forward_seconds; }},
        {"kvflow:model_parallel_rank_all_reduce_seconds_total",
         "Each rank's seconds in its layers' all-reduces (waiting for the slowest rank included)",
         [](const RankStepStats& r) { return r.all_reduce_seconds; }},
        {"kvflow:model_parallel_rank_residual_wait_seconds_total",
         "Each rank's seconds waiting for the residual stream of the stage before (pipeline bubbles)",
         [](const RankStepStats& r) { return r.residual_wait_seconds; }},
        {"kvflow:model_parallel_rank_residual_send_seconds_total",
         "Each rank's seconds handing the residual stream to the next stage",
         [](const RankStepStats& r) { return r.residual_send_seconds; }},
    };
    for (const PerRank& metric : per_rank) {
      for (const RankStepStats& r : ranks) {
        AddCounter(out, metric.name, metric.help, metric.value(r));
        out.back().labels = "rank=\"" + std::to_string(r.rank) + "\",stage=\"" + std::to_string(r.stage) +
                            "\",tensor_rank=\"" + std::to_string(r.tensor_rank) + "\"";
      }
    }
  };
  p.create = [](const ModelParallelContext& ctx) { return mp::CreateModelParallelDriver(ctx); };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
