#include "engine/decoding/speculative_sampling.h"

#include <vector>

#include <spdlog/spdlog.h>

#include "engine/decoding/sampling.h"
#include "engine/engine_core.h"
#include "sampling/rejection_sampler.h"

namespace kvflow {

namespace {
// The drafter's sampler draws from its own stream, so the target's stays as plain decoding has it.
constexpr uint64_t kDraftSeedSalt = 0x9e3779b97f4a7c15ULL;
}  // namespace

SpeculativeSampling::SpeculativeSampling(int num_speculative_tokens, const SamplingParams& params, uint64_t seed)
    : k_(num_speculative_tokens), draft_sampler_(params, seed ^ kDraftSeedSalt) {}

void SpeculativeSampling::BeforeStep(EngineCore& core, RequestState& req) {
  job_.seq = nullptr;
  job_.drafts.clear();
  job_.probs.clear();
  for (auto& st : req.seqs) {
    SchedSequence& seq = *st->seq;
    seq.draft_tokens.clear();
    // Only a decoding sequence (prompt computed, one token to run) drafts; drafts past max_tokens
    // could never be kept.
    if (st->finish != FinishReason::kNone || seq.status != SeqStatus::kRunning || seq.num_uncomputed() != 1 ||
        seq.num_computed < seq.prompt_len) {
      continue;
    }
    const int64_t room = req.params.max_tokens - seq.output_len() - 1;
    if (room <= 0) continue;
    job_.params = &req.params;
    job_.max_drafts = static_cast<int>(std::min<int64_t>(room, k_));
    job_.sampler = &draft_sampler_;
    core.QueueDraft(job_, seq);
  }
}

void SpeculativeSampling::OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) {
  for (const SeqLogits& r : rows) {
    const size_t V = r.logits.size() / (r.drafts.size() + 1);
    SeqState& seq = *r.seq;
    if (r.drafts.empty()) {
      SampleAndAppend(core, req, seq, r.logits);
      continue;
    }
    std::vector<SampledToken> tokens;
    int64_t accepted = 0;
    // One-hot (n-gram) drafts are verified by plain sampling (sampling/rejection_sampler.h), unless a
    // mutation test installed a wrong rule, which only VerifyDraft applies.
    if (!job_.probs.empty() || ActiveRejectionRule(VerifySite::kTarget) != RejectionRule::kResidual) {
      tokens = VerifySampledDrafts(core, req, seq, r, accepted);
    } else {
      // Row i is the target's distribution after the drafts before i: sample it as plain decoding
      // would (the history for penalties and min_tokens includes the drafts kept so far).
      std::vector<int32_t> output(seq.output().begin(), seq.output().end());
      TokenConstraint constraint;
      for (size_t i = 0; i <= r.drafts.size(); ++i) {
        const TokenConstraint* allowed = core.Constrain(req.params, seq, output, constraint);
        std::span<float> row = r.logits.subspan(i * V, V);
        tokens.push_back(seq.sampler.Sample(row, seq.prompt(), output, allowed));
        if (i == r.drafts.size() || tokens.back().token != r.drafts[i]) break;
        output.push_back(tokens.back().token);
        ++accepted;
      }
    }
    core.AppendTokens(req, seq, tokens);
    if (Status st = core.CommitDrafts(req, seq, *r.step, static_cast<int64_t>(r.drafts.size()), accepted); !st.ok()) {
      spdlog::error("speculative decoding: {}", st.ToString());
    }
  }
}

std::vector<SampledToken> SpeculativeSampling::VerifySampledDrafts(EngineCore& core, RequestState& req,
                                                                   SeqState& seq, const SeqLogits& r,
                                                                   int64_t& accepted) {
  const size_t V = r.logits.size() / (r.drafts.size() + 1);
  std::vector<SampledToken> tokens;
  std::vector<int32_t> output(seq.output().begin(), seq.output().end());
  std::vector<float> p;
  TokenConstraint constraint;
  for (size_t i = 0; i <= r.drafts.size(); ++i) {
    const TokenConstraint* allowed = core.Constrain(req.params, seq, output, constraint);
    std::span<float> row = r.logits.subspan(i * V, V);
    seq.sampler.Distribution(row, seq.prompt(), output, allowed, p);
    if (i == r.drafts.size()) {  // every draft kept: one more token from the target
      tokens.push_back(seq.sampler.Report(row, seq.sampler.DrawFrom(p)));
      break;
    }
    // The drafts that ran are the first ones the drafter proposed, in order (no probabilities:
    // one-hot drafts).
    const std::span<const float> q =
        job_.probs.empty() ? std::span<const float>() : std::span<const float>(job_.probs.data() + i * V, V);
    const double u_accept = seq.sampler.NextUniform();
    const double u_resample = seq.sampler.NextUniform();
    const DraftVerdict verdict = VerifyDraft(p, q, r.drafts[i], u_accept, u_resample);
    tokens.push_back(seq.sampler.Report(row, verdict.token));
    if (!verdict.accepted) break;
    output.push_back(verdict.token);
    ++accepted;
  }
  return tokens;
}

}  // namespace kvflow
