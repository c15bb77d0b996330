// xgrammar behind kvflow's types: a GrammarCompiler over kvflow's tokenizer that compiles a
// StructuredOutput (kvflow/sampling.h) into a grammar, cached, and the GrammarMatcher that walks one
// sequence's output through it and says which tokens may come next. Nothing of xgrammar shows in
// this header, so a kvflow built without xgrammar (KVFLOW_XGRAMMAR=OFF, or .cache/xgrammar not
// fetched) compiles the same callers: there Create refuses with NoXgrammarStatus().
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvflow/sampling.h"
#include "kvflow/status.h"
#include "kvflow/tokenizer.h"

namespace kvflow {

// Whether this kvflow was built with xgrammar (CMake option KVFLOW_XGRAMMAR).
bool StructuredOutputAvailable();
// The refusal of a structured-output request by a kvflow built without xgrammar, saying how to get it.
Status NoXgrammarStatus();

// One sequence's walk through a compiled grammar. Not thread-safe; copy it with Fork.
class GrammarMatcher {
 public:
  ~GrammarMatcher();
  // Advances over `token`; false (and no change) when the grammar does not allow it. Accepting
  // a stop token once the grammar is complete terminates the matcher.
  bool AcceptToken(int32_t token);
  // The tokens allowed next, bit t of word t / 32 (TokenConstraint's layout), into `mask` of
  // MaskWords() words; false when every token is allowed (nothing to apply).
  bool FillNextTokenMask(std::span<uint32_t> mask);
  // Undoes the last `num_tokens` accepted tokens (at most the number accepted since the last Reset).
  void Rollback(int num_tokens);
  // Back to the start of the grammar.
  void Reset();
  // The grammar is complete and a stop token was accepted.
  bool IsTerminated() const;
  // The grammar is complete (a stop token may come next).
  bool IsCompleted() const;
  std::unique_ptr<GrammarMatcher> Fork() const;
  int64_t MaskWords() const;

 private:
  friend class GrammarCompiler;
  struct Impl;
  explicit GrammarMatcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class GrammarCompiler {
 public:
  struct Options {
    // Threads xgrammar may use to compile one grammar.
    int max_threads = 4;
    // The cache of compiled grammars (xgrammar's own, keyed by kind and spec): its bound in bytes,
    // least recently used evicted first.
    int64_t cache_bytes = int64_t{256} << 20;
  };

  // A compiler for a model of `vocab_size` logits whose tokens are `tokenizer`'s (ids past the
  // tokenizer's vocabulary are never allowed) and whose sequences end with `stop_token_ids` (EOS).
  // The tokenizer is read here only.
  static Result<std::unique_ptr<GrammarCompiler>> Create(const Tokenizer& tokenizer, int64_t vocab_size,
                                                         std::vector<int32_t> stop_token_ids, const Options& options);
  static Result<std::unique_ptr<GrammarCompiler>> Create(const Tokenizer& tokenizer, int64_t vocab_size,
                                                         std::vector<int32_t> stop_token_ids) {
    return Create(tokenizer, vocab_size, std::move(stop_token_ids), Options());
  }
  ~GrammarCompiler();

  // Compiles `so` (or finds it in the cache): InvalidArgument naming what is wrong for a spec
  // xgrammar refuses. Any thread may call it.
  Status Check(const StructuredOutput& so) const;
  // A matcher at the start of `so`'s grammar (compiled or from the cache).
  Result<std::unique_ptr<GrammarMatcher>> NewMatcher(const StructuredOutput& so) const;

  int64_t vocab_size() const;
  const std::vector<int32_t>& stop_token_ids() const;
  // What the cache of compiled grammars holds now, in bytes.
  int64_t cache_size_bytes() const;

 private:
  struct Impl;
  explicit GrammarCompiler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// kChoice: the EBNF grammar (xgrammar's dialect) whose language is exactly the strings of `choices_json`, a
// JSON array of strings; InvalidArgument otherwise.
Result<std::string> ChoiceGrammar(const std::string& choices_json);

}  // namespace kvflow
