// Structured output as a logits processor (engine/logits_processor.h): for a request with
// SamplingParams::structured_output, every position's allowed tokens are those its grammar accepts
// after the sequence's output so far (an xgrammar bitmask, TokenConstraint::AllowOnly), and once
// the grammar is complete only EOS. Requests without it are not touched.
//
// One processor serves every sequence of the engine, so each sequence's GrammarMatcher lives in a
// map keyed by LogitsContext::sequence_key. Each Constrain brings the matcher in step with the
// output it is given: tokens past those it consumed are accepted; a shorter output (a rejected
// draft of speculative decoding) rolls it back; an output that is no extension of what it consumed
// rebuilds it from the start. A forked sequence (parallel sampling, beam search) starts from a copy
// of its parent's matcher, and a finished one is forgotten.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine/logits_processor.h"
#include "kvflow/tokenizer.h"
#include "structured_output/grammar_compiler.h"
#include "util/thread_pool.h"

namespace kvflow {

class StructuredOutputProcessor final : public LogitsProcessor {
 public:
  // The GrammarCompiler is built on the first structured-output request (xgrammar indexes the
  // whole vocabulary), from `tokenizer`, which must outlive the processor.
  StructuredOutputProcessor(const Tokenizer& tokenizer, int64_t vocab_size, std::vector<int32_t> eos_token_ids,
                            GrammarCompiler::Options options = {});
  ~StructuredOutputProcessor() override;

  const char* name() const override { return "structured_output"; }
  // Compiles the request's grammar (cached): InvalidArgument naming the fault for a bad schema,
  // regex, choice list or grammar; Unsupported without xgrammar.
  Status Validate(const SamplingParams& params, int64_t vocab_size) const override;
  void Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const override;
  // Walks and fills the masks of a step's rows in parallel on a pool of its own (the backend's
  // threads are idle while the engine samples); Constrain then only copies them.
  void Prepare(std::span<const LogitsContext> rows) const override;
  bool HandlesStructuredOutput() const override { return true; }
  bool Costly(const SamplingParams& params) const override { return params.structured_output.has_value(); }
  void Fork(uint64_t parent_key, uint64_t child_key) const override;
  void Forget(uint64_t sequence_key) const override;

  // The sequences it keeps a matcher for (tests: none once every request ended).
  size_t num_sequences() const;

 private:
  struct Sequence {
    std::unique_ptr<GrammarMatcher> matcher;  // null: no grammar (it failed to compile)
    std::vector<int32_t> consumed;            // the output the matcher was walked over
    // Tokens of `consumed` the matcher accepted: all, unless one left the grammar (then the rest
    // are not fed and only EOS is allowed).
    size_t accepted = 0;
    std::vector<uint32_t> mask;
    // `mask` holds the allowed tokens after `consumed` (filled by Prepare or an earlier Constrain);
    // `mask_constrains` false: every token is allowed there.
    bool mask_ready = false;
    bool mask_constrains = false;
  };
  // The sequence's state, its matcher made on first sight; null when its grammar failed (logged).
  // Call with mu_ held.
  Sequence* Find(const LogitsContext& ctx, const GrammarCompiler& compiler) const;
  // Walks `seq` to `output` and fills its mask unless it is ready; false when only EOS may come.
  bool Update(Sequence& seq, const LogitsContext& ctx) const;

  Result<const GrammarCompiler*> Compiler() const;
  // Walks `seq`'s matcher to `output`.
  void CatchUp(Sequence& seq, std::span<const int32_t> output, uint64_t key) const;
  void AllowOnlyEos(TokenConstraint& constraint, int64_t vocab_size) const;

  const Tokenizer& tokenizer_;
  const int64_t vocab_size_;
  const std::vector<int32_t> eos_token_ids_;
  const GrammarCompiler::Options options_;
  mutable std::once_flag compiler_once_;
  mutable std::unique_ptr<GrammarCompiler> compiler_;
  mutable Status compiler_status_;
  mutable std::mutex mu_;  // guards sequences_
  mutable std::unordered_map<uint64_t, Sequence> sequences_;
  mutable std::once_flag pool_once_;
  mutable std::unique_ptr<ThreadPool> pool_;  // Prepare's, made on the first batch to prepare
};

}  // namespace kvflow
