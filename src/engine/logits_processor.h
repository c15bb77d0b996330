// The logits-processor seam: what one sequence may sample at one position. Each processor narrows
// a TokenConstraint (sampling/token_constraint.h: bans, an allowed-token bitmask, biases) from the
// request's parameters and the tokens generated before that position (under speculative
// verification: the drafts kept so far), so it stays in step with every decoding strategy: a
// position after a rejected draft is never asked about, and a rolled-back position is asked again.
// The CPU sampler applies the constraint, and so does the CUDA sampling kernel (device sampling).
// Built in, in this order: min_tokens (EOS and stop tokens banned until min_tokens were generated)
// and logit_bias (OpenAI's). Structured output (src/structured_output, registered as a system)
// plugs in after them; it keeps state per sequence (LogitsContext::sequence_key), which the engine
// forks with the sequence (Fork) and drops when the sequence ends (Forget).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvflow/sampling.h"
#include "kvflow/status.h"
#include "sampling/token_constraint.h"

namespace kvflow {

struct LogitsContext {
  const SamplingParams& params;
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;  // generated before this position
  int64_t vocab_size = 0;
  // The sequence asked about (its scheduler SeqId): unique in the engine for the sequence's life,
  // so a processor may keep state per sequence (parallel samples and beams each have their own).
  uint64_t sequence_key = 0;
};

class LogitsProcessor {
 public:
  virtual ~LogitsProcessor() = default;
  virtual const char* name() const = 0;
  // Refuses what a request asks of this processor that it cannot do (checked before the request
  // is queued).
  virtual Status Validate(const SamplingParams& params, int64_t vocab_size) const { return Status::Ok(); }
  // Narrows `constraint` for the position after ctx.output. Called on the engine's thread, or on
  // a helper thread while the engine's thread waits for the forward pass (never two at once); a
  // position may be asked about again, and the output may shrink (a rejected draft) or change.
  virtual void Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const = 0;
  // Called once per step, before any Constrain of that step, with the plain decode rows it will
  // be asked about: a processor may compute all their constraints at once (structured output
  // fills the masks of a batch in parallel), Constrain then finds them. Same threads as Constrain.
  virtual void Prepare(std::span<const LogitsContext> rows) const {}
  // Whether constraining a request with these parameters costs real work (a grammar's mask): the
  // engine then computes the step's constraints while the forward pass runs.
  virtual bool Costly(const SamplingParams& params) const { return false; }
  // Whether it implements SamplingParams::structured_output (the engine refuses such a request
  // when none does).
  virtual bool HandlesStructuredOutput() const { return false; }
  // Sequence `child` starts as a copy of `parent` (parallel sampling, beam search): per-sequence
  // state may be copied rather than rebuilt.
  virtual void Fork(uint64_t parent_key, uint64_t child_key) const {}
  // The sequence ended (finished, failed or cancelled): drop what is kept for it.
  virtual void Forget(uint64_t sequence_key) const {}
};

// The engine's processors, applied in order.
class LogitsProcessors {
 public:
  void Add(std::unique_ptr<LogitsProcessor> processor) {
    processors_.push_back(processor.get());
    owned_.push_back(std::move(processor));
  }
  // A processor owned elsewhere (a system's); it must outlive this.
  void Add(const LogitsProcessor* processor) { processors_.push_back(processor); }
  Status Validate(const SamplingParams& params, int64_t vocab_size) const;
  // Clears `constraint` and lets every processor narrow it; false when nothing constrains the
  // position (the sampler's fast path).
  bool Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const;
  bool HandlesStructuredOutput() const;
  void Prepare(std::span<const LogitsContext> rows) const;
  bool Costly(const SamplingParams& params) const;
  void Fork(uint64_t parent_key, uint64_t child_key) const;
  void Forget(uint64_t sequence_key) const;

 private:
  std::vector<std::unique_ptr<LogitsProcessor>> owned_;
  std::vector<const LogitsProcessor*> processors_;
};

// EOS (`eos_token_ids`, unless ignore_eos) and stop token ids are banned until min_tokens tokens
// were generated.
std::unique_ptr<LogitsProcessor> MakeMinTokensProcessor(std::vector<int32_t> eos_token_ids);
// SamplingParams::logit_bias, added to the logits.
std::unique_ptr<LogitsProcessor> MakeLogitBiasProcessor();

}  // namespace kvflow
