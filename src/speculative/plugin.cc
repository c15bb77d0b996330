#include "speculative/plugin.h"

#include "speculative/draft_model.h"
#include "speculative/ngram_drafter.h"

namespace kvflow {
namespace {

NgramDrafterConfig NgramConfig(const EngineConfig& c) {
  return {c.speculative.num_tokens, c.speculative.ngram.max, c.speculative.ngram.min};
}

void DefaultNumTokens(EngineConfig& c) {
  if (c.speculative.num_tokens == 0) c.speculative.num_tokens = 4;
}

}  // namespace

Status RegisterSpeculativeDrafters(SystemRegistry& registry) {
  DrafterPlugin ngram;
  ngram.info.name = "ngram";
  ngram.info.label = "speculative decoding (ngram)";
  ngram.info.complete = DefaultNumTokens;
  ngram.info.validate = [](const EngineConfig& c) -> Status {
    if (!c.speculative.model.empty()) {
      return Status::InvalidArgument("speculative_model is for speculative_method draft_model (or triforce with "
                                     "triforce_draft draft_model), not ngram");
    }
    return NgramConfig(c).Validate();
  };
  ngram.create = [](const DrafterContext& ctx) -> Result<std::unique_ptr<Drafter>> {
    return std::unique_ptr<Drafter>(std::make_unique<NgramDrafter>(NgramConfig(ctx.config)));
  };
  KVFLOW_RETURN_IF_ERROR(registry.Register(std::move(ngram)));

  DrafterPlugin draft;
  draft.info.name = "draft_model";
  draft.info.label = "speculative decoding (draft_model)";
  draft.info.complete = DefaultNumTokens;
  draft.info.validate = [](const EngineConfig& c) -> Status {
    if (c.speculative.model.empty()) {
      return Status::InvalidArgument("speculative_method draft_model needs speculative_model (--speculative-model)");
    }
    if (c.speculative.num_tokens < 1) return Status::InvalidArgument("num_speculative_tokens must be >= 1");
    return Status::Ok();
  };
  draft.create_draft_backend = [](const EngineConfig& c, const Backend& target, const ModelConfig& model,
                                  const Tokenizer& tokenizer) {
    return CreateDraftModelBackend(c, target, model, tokenizer,
                                   DraftModel::ScratchBlocks(c.speculative.num_tokens, c.max_num_seqs, c.block_size));
  };
  draft.create = [](const DrafterContext& ctx) -> Result<std::unique_ptr<Drafter>> {
    return std::unique_ptr<Drafter>(std::make_unique<DraftModel>(*ctx.draft_backend, ctx.num_target_blocks,
                                                                 ctx.config.speculative.num_tokens,
                                                                 ctx.config.max_num_seqs));
  };
  return registry.Register(std::move(draft));
}

}  // namespace kvflow
