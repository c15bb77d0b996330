#include "spec/speculative_sampling.h"

#include <vector>

#include <spdlog/spdlog.h>

#include "engine/decoding/sampling.h"
#include "engine/engine_core.h"

namespace kvflow {

void SpeculativeSampling::BeforeStep(EngineCore& core, RequestState& req) {
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
    seq.draft_tokens = drafter_.Propose(seq.tokens, static_cast<int>(std::min<int64_t>(room, INT32_MAX)));
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
    // Row i is the target's distribution after the drafts before i: sample it as plain decoding
    // would (the history for penalties and min_tokens includes the drafts kept so far).
    std::vector<SampledToken> tokens;
    std::vector<int32_t> output(seq.output().begin(), seq.output().end());
    int64_t accepted = 0;
    for (size_t i = 0; i <= r.drafts.size(); ++i) {
      const std::vector<int32_t> suppress = core.SuppressedTokens(req.params, static_cast<int64_t>(output.size()));
      std::span<float> row = r.logits.subspan(i * V, V);
      tokens.push_back(seq.sampler.Sample(row, seq.prompt(), output, suppress));
      if (i == r.drafts.size() || tokens.back().token != r.drafts[i]) break;
      output.push_back(tokens.back().token);
      ++accepted;
    }
    core.AppendTokens(req, seq, tokens);
    if (Status st = core.CommitDrafts(req, seq, *r.step, static_cast<int64_t>(r.drafts.size()), accepted); !st.ok()) {
      spdlog::error("speculative decoding: {}", st.ToString());
    }
  }
}

}  // namespace kvflow
