#include "triforce/plugin.h"

#include "speculative/draft_model.h"
#include "triforce/triforce_drafter.h"

namespace kvflow {
namespace {

TriForceConfig Config(const EngineConfig& c) { return TriForceConfig::FromOptions(c.speculative, c.max_num_seqs); }

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
    return std::unique_ptr<Drafter>(std::make_unique<TriForceDrafter>(
        Config(ctx.config), ctx.target, ctx.num_target_blocks - ctx.target_scratch_blocks, ctx.draft_backend,
        ctx.target.kv_layout().num_blocks));
  };
  return registry.Register(std::move(p));
}

}  // namespace kvflow
