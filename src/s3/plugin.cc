#include "s3/plugin.h"

#include <optional>

#include <spdlog/spdlog.h>

#include "sched/length_predictor.h"
#include "sched/length_probe.h"

namespace kvflow {
namespace {

// The length predictor (loaded, or untrained with buckets over max_model_len) and its supervisor.
Result<std::unique_ptr<LengthSupervisor>> CreateLengthSupervisor(const EngineConfig& config,
                                                                 const EvaluationOptions& evaluation,
                                                                 const Tokenizer& tokenizer, const ModelConfig& model) {
  std::optional<LengthPredictor> trained;
  if (config.s3.length_predictor.empty()) {
    spdlog::warn("s3 without a length predictor: every request starts in the shortest bucket and the predictor "
                 "learns online from completed requests (train one with kvflow-length-predictor train)");
  } else {
    KVFLOW_ASSIGN_OR_RETURN(trained, LengthPredictor::Load(config.s3.length_predictor));
    const std::string fingerprint = TokenizerFingerprint(tokenizer);
    if (!trained->tokenizer_fingerprint().empty() && trained->tokenizer_fingerprint() != fingerprint) {
      return Status::InvalidArgument("length predictor " + config.s3.length_predictor +
                                     " was trained on another tokenizer's token ids (fingerprint " +
                                     trained->tokenizer_fingerprint() + ", this model's " + fingerprint + ")");
    }
  }
  KVFLOW_ASSIGN_OR_RETURN(auto supervisor,
                          MakeLengthSupervisor(std::move(trained),
                                               {config.max_model_len, config.s3.reservation_point,
                                                config.s3.online_updates,
                                                evaluation.length_prediction_override}));
  if (!config.s3.length_probe.empty()) {
    KVFLOW_ASSIGN_OR_RETURN(LengthProbe probe, LengthProbe::Load(config.s3.length_probe));
    if (Status st = probe.CheckModel(LengthProbeModelFingerprint(model, tokenizer), model.hidden_size); !st.ok()) {
      return Status::InvalidArgument(config.s3.length_probe + ": " + st.message());
    }
    spdlog::info("s3: length probe {} ({} hidden units, {} buckets of {} tokens) re-sizes reservations after the "
                 "prefill; online step {}",
                 config.s3.length_probe, probe.config().hidden_units, probe.config().buckets.num_buckets,
                 probe.config().buckets.width(),
                 !config.s3.online_updates                    ? std::string("off")
                 : probe.config().online_learning_rate > 0 ? std::to_string(probe.config().online_learning_rate)
                                                            : std::string("0 (the probe file's: no online updates)"));
    supervisor->set_probe(std::move(probe));
  }
  const LengthPredictorConfig& pc = supervisor->predictor().config();
  spdlog::info("s3: length predictor {}: {} buckets of {} tokens, reserving the {} edge; online updates {}",
               config.s3.length_predictor.empty() ? "untrained" : config.s3.length_predictor, pc.buckets.num_buckets,
               pc.buckets.width(), ReservationPointName(pc.reservation_point),
               config.s3.online_updates ? "on" : "off");
  return supervisor;
}

void AddS3Metrics(const EngineStats& s, std::vector<SystemMetric>& out) {
  AddCounter(out, "kvflow:s3_length_predictions_total", "Output lengths predicted at arrival.",
             static_cast<double>(s.s3.predictions));
  const std::string misses = "Finished requests whose output fell outside the predicted bucket.";
  out.push_back({"kvflow:s3_mispredictions_total", misses, true, static_cast<double>(s.s3.under_predicted),
                 "direction=\"under\""});
  out.push_back({"kvflow:s3_mispredictions_total", misses, true, static_cast<double>(s.s3.over_predicted),
                 "direction=\"over\""});
  AddCounter(out, "kvflow:s3_reservation_preemptions_total",
             "Preemptions of sequences that outgrew their KV reservation (each doubles it).",
             static_cast<double>(s.s3.reservation_preemptions));
  AddCounter(out, "kvflow:s3_predictor_updates_total", "Online training steps of the length predictor.",
             static_cast<double>(s.s3.online_updates));
  const std::string seconds = "Engine-thread time in the length predictor.";
  out.push_back({"kvflow:s3_predictor_seconds_total", seconds, true, s.s3.predict_seconds, "phase=\"predict\""});
  out.push_back({"kvflow:s3_predictor_seconds_total", seconds, true, s.s3.update_seconds, "phase=\"update\""});
  out.push_back({"kvflow:s3_predictor_seconds_total", seconds, true, s.s3.probe_seconds, "phase=\"probe\""});
  AddCounter(out, "kvflow:s3_probe_updates_total", "Online training steps of the hidden-state length probe.",
             static_cast<double>(s.s3.probe_online_updates));
  AddCounter(out, "kvflow:s3_probe_resizes_total", "Reservations the hidden-state probe changed after a prefill.",
             static_cast<double>(s.s3.probe_resized));
  AddCounter(out, "kvflow:s3_probe_released_blocks_total",
             "KV blocks given back to the pool when the hidden-state probe shrank a reservation.",
             static_cast<double>(s.s3.probe_released_blocks));
}

}  // namespace

std::string LengthProbeModelFingerprint(const ModelConfig& config, const Tokenizer& tokenizer) {
  return config.architecture + "-L" + std::to_string(config.num_layers) + "-H" + std::to_string(config.hidden_size) +
         "-I" + std::to_string(config.intermediate_size) + "-A" + std::to_string(config.num_heads) + "/" +
         std::to_string(config.num_kv_heads) + "-" + TokenizerFingerprint(tokenizer);
}

Status RegisterS3(SystemRegistry& registry) {
  SchedulingPolicyPlugin s3;
  s3.info.name = "s3";
  s3.info.label = "S3 (length-aware scheduling)";
  s3.info.validate_when_off = [](const EngineConfig& c) {
    if (!c.s3.length_predictor.empty()) {
      spdlog::warn("length predictor {} ignored: only the s3 scheduling policy uses one", c.s3.length_predictor);
    }
    if (!c.s3.length_probe.empty()) {
      spdlog::warn("length probe {} ignored: only the s3 scheduling policy uses one", c.s3.length_probe);
    }
    return Status::Ok();
  };
  s3.info.metrics = AddS3Metrics;
  s3.create = [](const SchedulingContext& ctx) -> Result<SchedulingParts> {
    SchedulingParts parts;
    KVFLOW_ASSIGN_OR_RETURN(parts.policy, MakeSchedulingPolicy("s3"));
    KVFLOW_ASSIGN_OR_RETURN(parts.supervisor, CreateLengthSupervisor(ctx.config, ctx.evaluation, ctx.tokenizer, ctx.model));
    return parts;
  };
  KVFLOW_RETURN_IF_ERROR(registry.Register(std::move(s3)));

  // The paper's oracle: reservations from the true output lengths the evaluation hands in.
  SchedulingPolicyPlugin oracle;
  oracle.info.name = "s3-oracle";
  oracle.info.label = "S3 with an oracle predictor (evaluation)";
  oracle.create = [](const SchedulingContext&) -> Result<SchedulingParts> {
    SchedulingParts parts;
    KVFLOW_ASSIGN_OR_RETURN(parts.policy, MakeSchedulingPolicy("s3-oracle"));
    return parts;
  };
  return registry.Register(std::move(oracle));
}

}  // namespace kvflow
