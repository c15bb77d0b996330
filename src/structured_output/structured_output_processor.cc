#include "structured_output/structured_output_processor.h"

#include <algorithm>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "util/thread_pool.h"

namespace kvflow {

StructuredOutputProcessor::StructuredOutputProcessor(const Tokenizer& tokenizer, int64_t vocab_size,
                                                     std::vector<int32_t> eos_token_ids,
                                                     GrammarCompiler::Options options)
    : tokenizer_(tokenizer), vocab_size_(vocab_size), eos_token_ids_(std::move(eos_token_ids)), options_(options) {}

StructuredOutputProcessor::~StructuredOutputProcessor() = default;

Result<const GrammarCompiler*> StructuredOutputProcessor::Compiler() const {
  std::call_once(compiler_once_, [this] {
    auto compiler = GrammarCompiler::Create(tokenizer_, vocab_size_, eos_token_ids_, options_);
    if (compiler.ok()) {
      compiler_ = std::move(compiler).value();
    } else {
      compiler_status_ = compiler.status();
    }
  });
  if (!compiler_) return compiler_status_;
  return static_cast<const GrammarCompiler*>(compiler_.get());
}

Status StructuredOutputProcessor::Validate(const SamplingParams& params, int64_t vocab_size) const {
  if (!params.structured_output) return Status::Ok();
  KVFLOW_ASSIGN_OR_RETURN(const GrammarCompiler* compiler, Compiler());
  if (vocab_size != compiler->vocab_size()) {
    return Status::Internal("structured output: the grammar compiler covers " + std::to_string(compiler->vocab_size()) +
                            " tokens, the model " + std::to_string(vocab_size));
  }
  return compiler->Check(*params.structured_output);
}

void StructuredOutputProcessor::AllowOnlyEos(TokenConstraint& constraint, int64_t vocab_size) const {
  std::vector<uint32_t> mask(static_cast<size_t>((vocab_size + 31) / 32), 0u);
  for (int32_t t : eos_token_ids_) {
    if (t >= 0 && t < vocab_size) mask[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
  }
  constraint.AllowOnly(mask);
}

void StructuredOutputProcessor::CatchUp(Sequence& seq, std::span<const int32_t> output, uint64_t key) const {
  const size_t common = static_cast<size_t>(
      std::mismatch(seq.consumed.begin(), seq.consumed.end(), output.begin(), output.end()).first - seq.consumed.begin());
  if (common == seq.consumed.size() && common == output.size()) return;  // already there: the mask stands
  seq.mask_ready = false;
  if (common < seq.consumed.size()) {
    if (common == output.size()) {
      // The output is a prefix of what was consumed (drafts rejected): roll back to it.
      if (seq.accepted > common) {
        seq.matcher->Rollback(static_cast<int>(seq.accepted - common));
        seq.accepted = common;
      }
      seq.consumed.resize(common);
    } else {
      // Another output altogether: walk it from the start.
      seq.matcher->Reset();
      seq.consumed.clear();
      seq.accepted = 0;
    }
  }
  for (size_t i = seq.consumed.size(); i < output.size(); ++i) {
    const int32_t token = output[i];
    if (seq.accepted == seq.consumed.size()) {
      if (!seq.matcher->IsTerminated() && seq.matcher->AcceptToken(token)) {
        ++seq.accepted;
      } else {
        // Only a constraint that allowed nothing (min_tokens banning the EOS a complete grammar
        // needs, say) lets such a token through: from here on only EOS is allowed.
        spdlog::warn("structured output: sequence {} left its grammar at output token {} (id {}); only EOS is "
                     "allowed from here",
                     key, i, token);
      }
    }
    seq.consumed.push_back(token);
  }
}

StructuredOutputProcessor::Sequence* StructuredOutputProcessor::Find(const LogitsContext& ctx,
                                                                     const GrammarCompiler& compiler) const {
  auto [it, inserted] = sequences_.try_emplace(ctx.sequence_key);
  Sequence& seq = it->second;
  if (inserted) {
    auto matcher = compiler.NewMatcher(*ctx.params.structured_output);
    if (matcher.ok()) {
      seq.matcher = std::move(matcher).value();
    } else {
      spdlog::error("structured output: sequence {}: {}", ctx.sequence_key, matcher.status().ToString());
    }
  }
  return seq.matcher ? &seq : nullptr;
}

bool StructuredOutputProcessor::Update(Sequence& seq, const LogitsContext& ctx) const {
  CatchUp(seq, ctx.output, ctx.sequence_key);
  if (seq.accepted < seq.consumed.size() || seq.matcher->IsTerminated()) return false;
  if (!seq.mask_ready) {
    seq.mask.resize(static_cast<size_t>(seq.matcher->MaskWords()));
    seq.mask_constrains = seq.matcher->FillNextTokenMask(seq.mask);
    seq.mask_ready = true;
  }
  return true;
}

void StructuredOutputProcessor::Prepare(std::span<const LogitsContext> rows) const {
  // One constrained row: Constrain fills it as fast. None: the compiler is not even made.
  const auto constrained = std::count_if(rows.begin(), rows.end(),
                                         [](const LogitsContext& ctx) { return ctx.params.structured_output.has_value(); });
  if (constrained < 2) return;
  auto compiler = Compiler();
  if (!compiler.ok()) return;
  std::vector<std::pair<Sequence*, const LogitsContext*>> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const LogitsContext& ctx : rows) {
      if (!ctx.params.structured_output || ctx.vocab_size != compiler.value()->vocab_size()) continue;
      if (Sequence* seq = Find(ctx, *compiler.value())) work.emplace_back(seq, &ctx);
    }
  }
  // Each row has a sequence (and a matcher) of its own, and nothing is inserted meanwhile, so the
  // rows run in parallel without the lock.
  std::call_once(pool_once_, [this] {
    pool_ = std::make_unique<ThreadPool>(std::clamp(UsableCores(), 1, 8));
  });
  pool_->ParallelFor(static_cast<int64_t>(work.size()), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) (void)Update(*work[i].first, *work[i].second);
  }, 1);
}

void StructuredOutputProcessor::Constrain(const LogitsContext& ctx, TokenConstraint& constraint) const {
  if (!ctx.params.structured_output) return;
  auto compiler = Compiler();
  if (!compiler.ok()) {  // Validate refused the request already; never leave it unconstrained
    AllowOnlyEos(constraint, ctx.vocab_size);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  Sequence* seq = ctx.vocab_size == compiler.value()->vocab_size() ? Find(ctx, *compiler.value()) : nullptr;
  if (seq == nullptr || !Update(*seq, ctx)) {
    AllowOnlyEos(constraint, ctx.vocab_size);
    return;
  }
  if (seq->mask_constrains) constraint.AllowOnly(seq->mask);
}

void StructuredOutputProcessor::Fork(uint64_t parent_key, uint64_t child_key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto parent = sequences_.find(parent_key);
  if (parent == sequences_.end() || !parent->second.matcher) return;  // the child builds its own
  Sequence child;
  child.matcher = parent->second.matcher->Fork();
  child.consumed = parent->second.consumed;
  child.accepted = parent->second.accepted;
  child.mask = parent->second.mask;
  child.mask_ready = parent->second.mask_ready;
  child.mask_constrains = parent->second.mask_constrains;
  sequences_[child_key] = std::move(child);
}

void StructuredOutputProcessor::Forget(uint64_t sequence_key) const {
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.erase(sequence_key);
}

size_t StructuredOutputProcessor::num_sequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequences_.size();
}

}  // namespace kvflow
