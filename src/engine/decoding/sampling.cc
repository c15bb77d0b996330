#include "engine/decoding/sampling.h"

#include <algorithm>
#include <vector>

#include "engine/engine_core.h"
#include "util/hash.h"

namespace kvflow {

uint64_t CandidateSeed(uint64_t seed, int index) {
  if (index == 0) return seed;
  return SplitMix64(seed + kGoldenGamma * static_cast<uint64_t>(index));
}

void SampleAndAppend(EngineCore& core, RequestState& req, SeqState& seq, std::span<float> logits) {
  TokenConstraint constraint;
  const TokenConstraint* allowed = core.Constrain(req.params, seq, seq.output(), constraint);
  const SampledToken token = seq.sampler.Sample(logits, seq.prompt(), seq.output(), allowed);
  core.AppendTokens(req, seq, {&token, 1});
}

void PlainSampling::OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) {
  for (const SeqLogits& r : rows) SampleAndAppend(core, req, *r.seq, r.logits);
}

void ParallelSampling::OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) {
  std::vector<SeqLogits> all(rows.begin(), rows.end());
  std::vector<std::vector<float>> fork_logits;
  if (!forked_) {
    // The prompt's logits are in: every further candidate forks off the first and shares its
    // prompt blocks, then samples from the same logits.
    forked_ = true;
    const SeqLogits& first = rows.front();
    const int candidates = req.params.num_candidates();
    for (int i = 1; i < candidates; ++i) {
      core.Fork(req, *first.seq, i, CandidateSeed(req.seed, i));
      fork_logits.emplace_back(first.logits.begin(), first.logits.end());
    }
    for (int i = 1; i < candidates; ++i) {
      all.push_back({req.seqs[static_cast<size_t>(i)].get(), fork_logits[static_cast<size_t>(i - 1)], {}, nullptr});
    }
  }
  for (const SeqLogits& r : all) SampleAndAppend(core, req, *r.seq, r.logits);
}

bool ParallelSampling::Finished(const RequestState& req) const {
  return forked_ && DecodingStrategy::Finished(req);
}

void ParallelSampling::Deliver(EngineCore& core, RequestState& req) {
  if (req.params.streams()) return;
  std::vector<SeqState*> order;
  for (auto& s : req.seqs) order.push_back(s.get());
  std::stable_sort(order.begin(), order.end(), [](const SeqState* a, const SeqState* b) {
    return a->cumulative_logprob > b->cumulative_logprob;
  });
  for (int i = 0; i < req.params.n; ++i) {
    const SeqState* s = order[static_cast<size_t>(i)];
    StreamEvent e;
    e.id = req.id;
    e.index = i;
    e.tokens = s->logprobs;
    e.text_delta = s->text;
    e.finished = true;
    e.finish_reason = s->finish;
    e.request_finished = i + 1 == req.params.n;
    EngineCore::AttachPromptLogprobs(req, e);
    if (req.on_event) req.on_event(e);
  }
}

}  // namespace kvflow
