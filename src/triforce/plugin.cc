#include "triforce/plugin.h"

#include "speculative/draft_model.h"
#include "triforce/triforce_drafter.h"

namespace kvflow {
namespace {

TriForceConfig Config(const EngineConfig& c) {
  TriForceConfig t = TriForceConfig::FromOptions(c.speculative, c.max_num_seqs);
  t.kv_offload = c.kv_offload.enabled;
  return t;
}

}  // namespace

Status RegisterTriForce(SystemRegistry& registry) {
  DrafterPlugin p;
  p.info.name = "triforce";
  p.info.label = "speculative decoding (triforce)";
  p.info.complete = [](EngineConfig& c) {
    // The retrieval cache drafts well enough to amortize a longer verification than n-gram's.
    if (c.speculative.num_tokens == 0) c.speculative.num_tokens = 8;
  };
  p.info.validate = [](const EngineConfig& c) -> Status {
    KVFLOW_RETURN_IF_ERROR(Config(c).Validate());
    const bool bottom_model = c.speculative.triforce.draft == "draft_model";
    if (bottom_model && c.speculative.model.empty()) {
      return Status::InvalidArgument("triforce_draft draft_model needs speculative_model (--speculative-model)");
    }
    if (c.kv_offload.enabled && c.speculative.triforce.draft == "streaming") {
      return Status::InvalidArgument(
          "triforce_draft streaming reads the target's own recent window, which kv_offload keeps in host memory; "
          "with kv_offload use triforce_draft ngram or draft_model (whose cache stays on the device)");
    }
    if (!bottom_model && !c.speculative.model.empty()) {
      return Status::InvalidArgument("speculative_model is for speculative_method draft_model (or triforce with "
                                     "triforce_draft draft_model), not triforce with triforce_draft " +
                                     c.speculative.triforce.draft);
    }
    return Status::Ok();
  };
  p.create_draft_backend = [](const EngineConfig& c, const Backend& target, const ModelConfig& model,
                              const Tokenizer& tokenizer) {
    return CreateDraftModelBackend(c, target, model, tokenizer,
                                   TriForceDrafter::DraftScratchBlocks(Config(c), c.block_size));
  };
  p.target_scratch_blocks = [](const EngineConfig& c) {
    return TriForceDrafter::TargetScratchBlocks(Config(c), c.block_size);
  };
  p.target_scratch_use = "drafting lanes";
  p.create = [](const DrafterContext& ctx) -> Result<std::unique_ptr<Drafter>> {
    if (ctx.target.As<KvBlockScoring>() == nullptr) {
      return Status::Unsupported("triforce scores the target's KV blocks to build its retrieval cache; " +
                                 ctx.target.Describe() + " has no block scoring");
    }
    // Over an offloaded pool the scratch (lanes, copies for the middle) stays on the device.
    if (OffloadedKvPool* pool = ctx.target.As<OffloadedKvPool>()) {
      KVFLOW_RETURN_IF_ERROR(pool->KeepResident(ctx.num_target_blocks - ctx.target_scratch_blocks));
    }
    return std::unique_ptr<Drafter>(std::make_unique<TriForceDrafter>(
        Config(ctx.config), ctx.target, ctx.num_target_blocks - ctx.target_scratch_blocks, ctx.draft_backend,
        ctx.target.kv_layout().num_blocks));
  };
  p.info.metrics = [](const EngineStats& s, std::vector<SystemMetric>& out) {
    // TriForce's middle level (the target over its retrieval cache) and its bottom drafter.
    AddCounter(out, "kvflow:triforce_middle_passes_total", "Sequence passes of the target over a retrieval cache.",
               static_cast<double>(s.spec.middle_passes));
    AddCounter(out, "kvflow:triforce_middle_draft_tokens_total", "Bottom drafts the retrieval level verified.",
               static_cast<double>(s.spec.middle_draft_tokens));
    AddCounter(out, "kvflow:triforce_middle_accepted_tokens_total", "Bottom drafts the retrieval level kept.",
               static_cast<double>(s.spec.middle_accepted_tokens));
    AddCounter(out, "kvflow:triforce_bottom_passes_total", "Sequence passes of a model-based bottom drafter.",
               static_cast<double>(s.spec.bottom_passes));
    AddCounter(out, "kvflow:triforce_retrieval_builds_total", "Retrieval caches built or rebuilt.",
               static_cast<double>(s.spec.retrieval_builds));
    AddCounter(out, "kvflow:triforce_resident_copied_blocks_total",
               "KV blocks copied to the device for the retrieval level to read (--kv-offload).",
               static_cast<double>(s.spec.retrieval_copied_blocks));
    AddCounter(out, "kvflow:triforce_plain_steps_total",
               "Sequence steps decoded without drafts because TriForce would not pay (short context, low acceptance).",
               static_cast<double>(s.spec.plain_steps));
    AddGauge(out, "kvflow:triforce_retrieval_caches", "Sequences holding a retrieval cache.",
               static_cast<double>(s.spec.retrieval_caches));
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
