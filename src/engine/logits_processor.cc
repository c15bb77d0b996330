#include "engine/logits_processor.h"

#include <string>

namespace kvflow {

Status LogitsProcessors::Validate(const SamplingParams& params, int64_t vocab_size) const {
  for (const auto& p : processors_) KVFLOW_RETURN_IF_ERROR(p->Validate(params, vocab_size));
  return Status::Ok();
}

bool LogitsProcessors::Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const {
  constraint.Clear();
  for (const auto& p : processors_) p->Constrain(ctx, constraint);
  return !constraint.empty();
}

bool LogitsProcessors::HandlesStructuredOutput() const {
  for (const auto& p : processors_) {
    if (p->HandlesStructuredOutput()) return true;
  }
  return false;
}

bool LogitsProcessors::Costly(const SamplingParams& params) const {
  for (const auto& p : processors_) {
    if (p->Costly(params)) return true;
  }
  return false;
}

void LogitsProcessors::Prepare(std::span<const LogitsContext> rows) const {
  for (const auto& p : processors_) p->Prepare(rows);
}

void LogitsProcessors::Fork(uint64_t parent_key, uint64_t child_key) const {
  for (const auto& p : processors_) p->Fork(parent_key, child_key);
}

void LogitsProcessors::Forget(uint64_t sequence_key) const {
  for (const auto& p : processors_) p->Forget(sequence_key);
}

namespace {

class MinTokensProcessor final : public LogitsProcessor {
 public:
  explicit MinTokensProcessor(std::vector<int32_t> eos) : eos_(std::move(eos)) {}
  const char* name() const override { return "min_tokens"; }
  void Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const override {
    if (static_cast<int64_t>(ctx.output.size()) >= ctx.params.min_tokens) return;
    constraint.Ban(ctx.params.stop_token_ids);
    if (!ctx.params.ignore_eos) constraint.Ban(eos_);
  }

 private:
  std::vector<int32_t> eos_;
};

class LogitBiasProcessor final : public LogitsProcessor {
 public:
  const char* name() const override { return "logit_bias"; }
  Status Validate(const SamplingParams& params, int64_t vocab_size) const override {
    for (const auto& [token, bias] : params.logit_bias) {
      if (token < 0 || token >= vocab_size) {
        return Status::InvalidArgument("logit_bias names token " + std::to_string(token) +
                                       ", outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
      }
    }
    return Status::Ok();
  }
  void Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const override {
    for (const auto& [token, bias] : ctx.params.logit_bias) constraint.AddBias(token, bias);
  }
};

}  // namespace

std::unique_ptr<LogitsProcessor> MakeMinTokensProcessor(std::vector<int32_t> eos_token_ids) {
  return std::make_unique<MinTokensProcessor>(std::move(eos_token_ids));
}

std::unique_ptr<LogitsProcessor> MakeLogitBiasProcessor() { return std::make_unique<LogitBiasProcessor>(); }

}  // namespace kvflow
