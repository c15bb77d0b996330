#include "engine/decoding/beam_search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "engine/engine_core.h"

namespace kvflow {
namespace {

double BeamScore(double cumulative_logprob, int64_t length, float length_penalty) {
  return cumulative_logprob / std::pow(static_cast<double>(std::max<int64_t>(1, length)), length_penalty);
}

}  // namespace

void BeamSearch::OnLogits(EngineCore& core, RequestState& req, std::span<const SeqLogits> rows) {
  for (const SeqLogits& r : rows) pending_[r.seq->index].assign(r.logits.begin(), r.logits.end());
  std::vector<SeqState*> beams;
  for (auto& s : req.seqs) {
    if (s->finish != FinishReason::kNone) continue;
    if (!pending_.count(s->index)) return;  // a beam still prefilling (after recompute): wait for it
    beams.push_back(s.get());
  }
  const SamplingParams& p = req.params;
  const int width = p.num_candidates();

  struct Candidate {
    SeqState* parent;
    SampledToken token;
    double cumulative;
  };
  std::vector<Candidate> candidates;
  std::vector<int32_t> order;
  for (SeqState* beam : beams) {
    std::vector<float>& logits = pending_[beam->index];
    const auto V = static_cast<int64_t>(logits.size());
    TokenConstraint constraint;
    if (const TokenConstraint* c = core.Constrain(p, *beam, beam->output(), constraint)) c->ApplyTo(logits);
    // log-softmax, then the 2 * width best continuations of this beam.
    const float max = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    for (float l : logits) sum += std::exp(static_cast<double>(l - max));
    const double log_z = static_cast<double>(max) + std::log(sum);
    order.resize(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    const size_t keep = std::min<size_t>(static_cast<size_t>(2 * width), order.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                      [&](int32_t a, int32_t b) {
                        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
                               (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
                      });
    for (size_t k = 0; k < keep; ++k) {
      // A token the constraint rules out (a structured-output mask) is no continuation.
      if (logits[static_cast<size_t>(order[k])] == -std::numeric_limits<float>::infinity()) break;
      SampledToken tok;
      tok.token = order[k];
      tok.logprob = static_cast<float>(logits[static_cast<size_t>(tok.token)] - log_z);
      for (int j = 0; j < p.logprobs && j < static_cast<int>(keep); ++j) {
        tok.top_logprobs.push_back({order[static_cast<size_t>(j)],
                                    static_cast<float>(logits[static_cast<size_t>(order[static_cast<size_t>(j)])] - log_z)});
      }
      candidates.push_back({beam, std::move(tok), beam->cumulative_logprob + (logits[static_cast<size_t>(order[k])] - log_z)});
    }
    pending_.erase(beam->index);
  }
  if (candidates.empty()) {
    // The constraint allows no token to any beam (min_tokens banning the EOS a complete grammar
    // needs): the beams end where they are.
    for (SeqState* beam : beams) {
      AddHypothesis(req, *beam, nullptr, beam->cumulative_logprob, FinishReason::kStop);
      core.FinishSequence(*beam, FinishReason::kStop);
    }
    return;
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.cumulative > b.cumulative; });

  // Top candidates: those ending the sequence become hypotheses (only within the first `width`
  // ranks, as vLLM and HF do); the rest continue until `width` beams are chosen.
  std::vector<Candidate> chosen;
  for (size_t rank = 0; rank < candidates.size() && static_cast<int>(chosen.size()) < width; ++rank) {
    Candidate& c = candidates[rank];
    const bool eos = core.IsEos(p, c.token.token);
    if (eos || EngineCore::IsStopToken(p, c.token.token)) {
      if (static_cast<int>(rank) < width) {
        AddHypothesis(req, *c.parent, &c.token, c.cumulative, eos ? FinishReason::kEos : FinishReason::kStop);
      }
      continue;
    }
    chosen.push_back(std::move(c));
  }

  // Fork extra children from untouched parents first, then append.
  std::vector<std::pair<SeqState*, Candidate*>> assignments;
  std::vector<SeqState*> used;
  for (Candidate& c : chosen) {
    SeqState* target = c.parent;
    if (std::find(used.begin(), used.end(), c.parent) != used.end()) {
      target = &core.Fork(req, *c.parent, static_cast<int>(req.seqs.size()), req.seed);
      target->logprobs = c.parent->logprobs;
    } else {
      used.push_back(c.parent);
    }
    assignments.emplace_back(target, &c);
  }
  for (SeqState* beam : beams) {
    if (std::find(used.begin(), used.end(), beam) == used.end()) core.FinishSequence(*beam, FinishReason::kStop);
  }
  for (auto& [target, c] : assignments) {
    core.AppendUnchecked(*target, c->token);
    target->cumulative_logprob = c->cumulative;  // the exact sum: a forked child starts from 0
  }

  // Beams that hit the length limit finish; then the vLLM early-stopping test.
  std::vector<SeqState*> running;
  for (auto& [target, c] : assignments) {
    if (core.ReachedLength(p, *target->seq)) {
      AddHypothesis(req, *target, nullptr, target->cumulative_logprob, FinishReason::kLength);
      core.FinishSequence(*target, FinishReason::kLength);
    } else {
      running.push_back(target);
    }
  }
  bool done = running.empty();
  if (!done && static_cast<int>(done_.size()) >= width) {
    std::vector<double> scores;
    for (const auto& h : done_) scores.push_back(h.score);
    std::sort(scores.rbegin(), scores.rend());
    const double worst_kept = scores[static_cast<size_t>(width - 1)];
    double best_running = -std::numeric_limits<double>::infinity();
    for (SeqState* r : running) {
      best_running = std::max(best_running, BeamScore(r->cumulative_logprob, r->seq->num_tokens(), p.length_penalty));
    }
    done = worst_kept >= best_running;
  }
  if (!done) return;
  for (SeqState* r : running) core.FinishSequence(*r, FinishReason::kStop);
}

void BeamSearch::AddHypothesis(const RequestState& req, const SeqState& beam, const SampledToken* last,
                               double cumulative, FinishReason why) {
  Hypothesis h;
  h.tokens.assign(beam.output().begin(), beam.output().end());
  h.logprobs = beam.logprobs;
  const int64_t length = beam.seq->num_tokens();  // an ending EOS does not count (vLLM)
  if (last) {
    h.tokens.push_back(last->token);
    h.logprobs.push_back(*last);
  }
  h.cumulative_logprob = cumulative;
  h.score = BeamScore(cumulative, length, req.params.length_penalty);
  h.finish = why;
  done_.push_back(std::move(h));
}

void BeamSearch::Deliver(EngineCore& core, RequestState& req) {
  std::stable_sort(done_.begin(), done_.end(), [](const Hypothesis& a, const Hypothesis& b) { return a.score > b.score; });
  const int n = std::min<int>(req.params.n, static_cast<int>(done_.size()));
  for (int i = 0; i < n; ++i) {
    const Hypothesis& h = done_[static_cast<size_t>(i)];
    StreamEvent e;
    e.id = req.id;
    e.index = i;
    e.tokens = h.logprobs;
    std::vector<int32_t> text_tokens = h.tokens;
    if (h.finish == FinishReason::kEos && !text_tokens.empty()) text_tokens.pop_back();
    e.text_delta = core.Decode(text_tokens);
    e.finished = true;
    e.finish_reason = h.finish;
    e.request_finished = i + 1 == n;
    EngineCore::AttachPromptLogprobs(req, e);
    if (req.on_event) req.on_event(e);
  }
}

}  // namespace kvflow
