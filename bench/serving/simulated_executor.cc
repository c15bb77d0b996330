// The sim executor: the engine's core (Scheduler, BlockManager, step protocol) driven on a virtual clock, each step costed by a CostModel.
#include "serving/simulated_executor.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include "bench_files.h"
#include "engine/engine_core.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "sched/length_predictor.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"
#include "sched/scheduler.h"
#include "sched/sequence_group.h"
#include "util/alpaca.h"

namespace kvflow::bench::serving {

namespace {

// S3's supervisor for a run of the s3 policy: the predictor (a copy, so every run starts from the
// same weights) or an untrained one over max_model_len; nullptr for other policies.
Result<std::unique_ptr<kvflow::LengthSupervisor>> MakeSupervisor(const std::string& policy, const ServingConfig& cfg,
                                                                  const kvflow::LengthPredictor* predictor) {
  if (policy != "s3") return std::unique_ptr<kvflow::LengthSupervisor>();
  return kvflow::MakeLengthSupervisor(predictor ? std::optional(*predictor) : std::nullopt,
                                      {cfg.max_model_len, cfg.reservation_point, cfg.online_updates,
                                       cfg.prediction_override});
}
}  // namespace

Json SupervisorJson(const kvflow::LengthSupervisorStats& s) {
  return Json{{"predictions", s.predictions},
              {"compared", s.compared},
              {"correct", s.correct},
              {"bucket_accuracy", s.compared > 0 ? Json(static_cast<double>(s.correct) / s.compared) : Json(nullptr)},
              {"under_predicted", s.under_predicted},
              {"over_predicted", s.over_predicted},
              {"reservation_preemptions", s.reservation_misses},
              {"online_updates", s.online_updates},
              {"predict_s", s.predict_seconds},
              {"update_s", s.update_seconds},
              {"predict_us_per_request", s.predictions > 0 ? Json(1e6 * s.predict_seconds / s.predictions) : Json(nullptr)},
              {"update_us_per_step", s.online_updates > 0 ? Json(1e6 * s.update_seconds / s.online_updates) : Json(nullptr)}};
}
Status CostModelExecutor::Run(const kvflow::SchedulerOutput& out, std::span<const kvflow::LogitsMode>,
           const kvflow::DeviceSampling* sampling,
           kvflow::ExecutorOutput& result) {
  StepShape shape, first_time;  // first_time: the step without recomputation and swaps
  shape.swapped_blocks = static_cast<int64_t>(out.swap_in.size() + out.swap_out.size());
  swapped_blocks_ += shape.swapped_blocks;
  for (const kvflow::ScheduledSeq& s : out.scheduled) {
    shape.AddSequence(s.seq->num_computed, s.num_tokens);
    int64_t& high_water = high_water_[s.seq->id];
    const int64_t redo = std::clamp<int64_t>(high_water - s.seq->num_computed, 0, s.num_tokens);
    recomputed_tokens_ += redo;
    if (s.num_tokens > redo) first_time.AddSequence(s.seq->num_computed + redo, s.num_tokens - redo);
    high_water = std::max(high_water, s.seq->num_computed + s.num_tokens);
  }
  last_step_s_ = cost_.StepSeconds(shape, block_size_);
  penalty_s_ += last_step_s_ - cost_.StepSeconds(first_time, block_size_);
  now_ += last_step_s_;
  ran_ = !out.empty();
  changed_ = !out.rejected.empty() || out.num_preempted_recompute + out.num_preempted_swap > 0;
  if (out.empty()) return Status::Ok();
  if (sampling == nullptr) return Status::Unsupported("the serving simulator samples plain requests only");
  kvflow::SampledToken token;
  token.token = kSimulatedToken;
  result.sampled.assign(sampling->rows.size(), {token});
  return Status::Ok();
}

Json CostModelExecutor::PenaltyJson() const {
  return Json{{"recomputed_tokens", recomputed_tokens_}, {"swapped_blocks", swapped_blocks_},
              {"modelled_s", penalty_s_}};
}

void SimObserver::OnStepComputed(const kvflow::SchedulerOutput& sched) {
  int64_t stored_tokens = 0;
  for (const kvflow::SequenceGroup* group : core_.scheduler().running()) {
    for (const auto& seq : group->seqs) {
      if (seq->status == kvflow::SeqStatus::kRunning) stored_tokens += seq->num_computed;
    }
  }
  const kvflow::BlockManager& blocks = core_.block_manager();
  const int used = blocks.device().num_used();
  run_.steps.Add(executor_.last_step_seconds(), static_cast<int>(sched.scheduled.size()),
                 static_cast<double>(used) / blocks.device().num_blocks(),
                 used > 0 ? std::optional<double>(static_cast<double>(stored_tokens) / (used * blocks.block_size()))
                          : std::nullopt);
}

void SimObserver::OnRequestFinished(const kvflow::SequenceGroup& group) {
  const kvflow::LengthSupervisor* supervisor = core_.length_supervisor();
  if (!supervisor) return;
  const kvflow::LengthBuckets& b = supervisor->predictor().config().buckets;
  mispredicted_[index_.at(group.request_id)] = b.BucketOf(group.seqs.front()->output_len()) != group.predicted_bucket;
}

Json SimObserver::MispredictionDeciles() const {
  const size_t n = mispredicted_.size();
  Json deciles = Json::array();
  for (size_t d = 0; d < 10 && n >= 10; ++d) {
    int64_t wrong = 0, seen = 0;
    for (size_t i = d * n / 10; i < (d + 1) * n / 10; ++i) {
      if (mispredicted_[i] < 0) continue;
      ++seen;
      wrong += mispredicted_[i];
    }
    deciles.push_back(seen > 0 ? Json(static_cast<double>(wrong) / static_cast<double>(seen)) : Json(nullptr));
  }
  return deciles;
}

Result<RunRecord> Simulate(const Trace& trace, double rate, const std::string& policy_name, const ServingConfig& cfg,
                           const CostModel& cost, const kvflow::LengthPredictor* predictor) {
  KVFLOW_ASSIGN_OR_RETURN(auto policy, kvflow::MakeSchedulingPolicy(policy_name));
  KVFLOW_ASSIGN_OR_RETURN(kvflow::PreemptionMode preemption, kvflow::ParsePreemptionMode(cfg.preemption_mode));
  KVFLOW_ASSIGN_OR_RETURN(auto supervisor, MakeSupervisor(policy_name, cfg, predictor));
  kvflow::EngineCoreConfig config;
  config.scheduler = kvflow::SchedulerConfig{cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, preemption};
  config.blocks = kvflow::BlockManagerConfig{cfg.block_size, cfg.num_device_blocks, cfg.num_host_blocks,
                                             /*enable_prefix_caching=*/false};
  config.warn_on_preemption = false;
  kvflow::EngineCore core(config, std::move(policy), std::move(supervisor), /*tokenizer=*/nullptr);
  CostModelExecutor executor(cost, cfg.block_size);

  const auto wall_start = Clock::now();
  RunRecord run = NewRunRecord(trace, rate, policy_name);
  SimObserver observer(core, executor, run);
  core.set_observer(&observer);
  const size_t n = run.requests.size();
  size_t next = 0, settled = 0;
  int64_t idle_steps = 0;  // consecutive steps that ran nothing
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.ignore_eos = true;
  while (settled < n) {
    for (; next < n && run.requests[next].arrival_s <= executor.now(); ++next) {
      RequestTiming& t = run.requests[next];
      auto on_event = [&t, &run, &settled, &executor, generated = int64_t{0}](const kvflow::StreamEvent& e) mutable {
        if (!e.tokens.empty() && t.first_token_s < 0) t.first_token_s = executor.now();
        generated += static_cast<int64_t>(e.tokens.size());
        if (!e.request_finished) return;
        ++settled;
        t.failed = e.finish_reason == kvflow::FinishReason::kError || generated != t.output_len;
        if (!t.failed) t.finish_s = executor.now();
        if (t.failed && run.first_error.empty()) {
          run.first_error = !e.error.ok() ? e.error.ToString()
                                          : "generated " + std::to_string(generated) + " tokens, expected " +
                                                std::to_string(t.output_len);
        }
      };
      params.max_tokens = static_cast<int>(t.output_len);
      kvflow::RequestHints hints;
      hints.true_output_len = t.output_len;
      hints.hide_max_tokens = true;
      auto id = core.AddRequest(trace.requests[next].prompt, params, std::move(on_event), hints, t.arrival_s);
      if (!id.ok()) {
        t.failed = true;
        if (run.first_error.empty()) run.first_error = id.status().ToString();
        ++settled;
        continue;
      }
      observer.Track(id.value(), next);
    }
    if (!core.HasUnfinishedRequests()) {
      if (next < n) executor.AdvanceTo(run.requests[next].arrival_s);
      continue;
    }
    KVFLOW_RETURN_IF_ERROR(core.Step(executor).status());
    if (!executor.ran()) {
      // Nothing ran. Fine while rejections or preemptions change the state; otherwise the scheduler
      // holds work it will never schedule.
      if (core.HasUnfinishedRequests() && (!executor.changed() || ++idle_steps > static_cast<int64_t>(n))) {
        return Status::Internal("the scheduler stalled at t=" + Fixed(executor.now(), 3) + " s with " +
                                std::to_string(next - settled) + " requests in flight and nothing scheduled");
      }
      continue;
    }
    idle_steps = 0;
  }
  const kvflow::SchedulerStats stats = core.scheduler().stats();
  run.preemptions_recompute = stats.num_preemptions_recompute;
  run.preemptions_swap = stats.num_preemptions_swap;
  run.wall_s = SecondsSince(wall_start);
  run.extra["preemption_penalty"] = executor.PenaltyJson();
  run.extra["preemption_penalty"]["reservation_preemptions"] = stats.num_reservation_preemptions;
  if (const kvflow::LengthSupervisor* supervisor = core.length_supervisor()) {
    run.extra["s3"] = SupervisorJson(supervisor->stats());
    run.extra["s3"]["misprediction_rate_by_arrival_decile"] = observer.MispredictionDeciles();
  }
  return run;
}

}  // namespace kvflow::bench::serving
