#include "sched/scheduler.h"

#include <algorithm>
#include <limits>
#include <string>

#include <spdlog/spdlog.h>

namespace kvflow {

Result<PreemptionMode> ParsePreemptionMode(std::string_view name) {
  if (name == "auto") return PreemptionMode::kAuto;
  if (name == "swap") return PreemptionMode::kSwap;
  if (name == "recompute") return PreemptionMode::kRecompute;
  return Status::InvalidArgument("unknown preemption mode '" + std::string(name) + "' (auto, swap, recompute)");
}

const char* PreemptionModeName(PreemptionMode mode) {
  switch (mode) {
    case PreemptionMode::kAuto: return "auto";
    case PreemptionMode::kSwap: return "swap";
    case PreemptionMode::kRecompute: return "recompute";
  }
  return "unknown";
}

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager& blocks, std::unique_ptr<SchedulingPolicy> policy)
    : config_(config), blocks_(blocks), policy_(std::move(policy)) {}

void Scheduler::AddGroup(std::unique_ptr<SequenceGroup> group) {
  for (auto& s : group->seqs) {
    s->status = SeqStatus::kWaiting;
    s->num_computed = 0;
    s->draft_tokens.clear();
  }
  waiting_.push_back(group.get());
  groups_.emplace(group->request_id, std::move(group));
}

SequenceGroup* Scheduler::Find(RequestId id) const {
  auto it = groups_.find(id);
  return it == groups_.end() ? nullptr : it->second.get();
}

void Scheduler::SortByPolicy(std::vector<SequenceGroup*>& queue) const {
  auto before = [this](const SequenceGroup* a, const SequenceGroup* b) { return policy_->Before(*a, *b); };
  // Queues are almost always still in order from the last step: one linear check then.
  if (!std::is_sorted(queue.begin(), queue.end(), before)) std::stable_sort(queue.begin(), queue.end(), before);
}

int Scheduler::RunningSeqs() const {
  int n = 0;
  for (const SequenceGroup* g : running_) n += g->max_running_seqs();
  return n;
}

int Scheduler::BatchSeqCap() const {
  const int depth = config_.batches_in_flight;
  if (depth <= 1) return std::numeric_limits<int>::max();
  int seqs = RunningSeqs();
  for (const SequenceGroup* g : swapped_) seqs += g->max_running_seqs();
  for (const SequenceGroup* g : waiting_) seqs += g->max_running_seqs();
  seqs = std::min(seqs, config_.max_num_seqs);
  return std::max(1, (seqs + depth - 1) / depth);
}

SequenceGroup* Scheduler::LastPreemptible() const {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    if (!(*it)->in_flight) return *it;
  }
  return nullptr;
}

bool Scheduler::AnyInFlight() const {
  return std::any_of(running_.begin(), running_.end(), [](const SequenceGroup* g) { return g->in_flight; });
}

bool Scheduler::PlanTokens(const SequenceGroup& g, int64_t budget, std::vector<int64_t>& tokens) const {
  tokens.clear();
  int64_t total = 0;
  for (const auto& s : g.seqs) {
    int64_t n = s->finished() ? 0 : std::min(s->num_uncomputed(), budget - total);
    // Teacher-forced decoding: the prompt's chunks stop at prompt_decode_from, then one token a step.
    if (const int64_t from = g.prompt_decode_from; from > 0 && n > 0 && s->num_computed < s->prompt_len) {
      n = std::min(n, s->num_computed >= from ? int64_t{1} : from - s->num_computed);
    }
    tokens.push_back(n);
    total += n;
  }
  return total > 0;
}

namespace {
int64_t Capacity(const BlockManager& blocks, const SchedSequence& s) {
  return static_cast<int64_t>(blocks.BlockTable(s.id).size()) * blocks.block_size();
}
}  // namespace

int64_t Scheduler::DraftsFor(const SequenceGroup& g, const SchedSequence& s, int64_t room) const {
  // Forked candidates (n > 1, beams) would each need drafts of their own: kept simple, they get
  // none. A prompt still being computed has nothing to speculate on.
  if (s.draft_tokens.empty() || g.num_candidates > 1 || s.num_computed < s.prompt_len) return 0;
  int64_t n = std::min(static_cast<int64_t>(s.draft_tokens.size()), room);
  // Even with every draft accepted, the bonus token after them must fit in max_model_len.
  n = std::min(n, config_.max_model_len - 1 - s.num_tokens());
  // Speculation never grows a hard reservation: S3's supervisor judges real lengths only.
  if (policy_->PreemptsOnExhaustedReservation()) n = std::min(n, Capacity(blocks_, s) - s.num_tokens());
  return std::max<int64_t>(0, n);
}

void Scheduler::ScheduleDrafts(SchedulerOutput& out, int64_t budget) {
  for (ScheduledSeq& s : out.scheduled) {
    if (budget <= 0) break;
    // Drafts follow the last real token: only a sequence whose last token runs can have any.
    if (!s.needs_logits) continue;
    int64_t n = DraftsFor(*s.group, *s.seq, budget);
    const int64_t write_from = s.seq->num_tokens();
    while (n > 0 && blocks_.BlocksToAppend(s.seq->id, write_from, write_from + n) > blocks_.device().num_free()) --n;
    if (n == 0) continue;
    if (Status st = blocks_.AppendSlots(s.seq->id, write_from, write_from + n); !st.ok()) {
      spdlog::error("scheduler: counted blocks for drafts of request {} are missing: {}", s.group->request_id,
                    st.ToString());
      continue;  // the step runs without them
    }
    s.num_tokens += n;
    s.num_draft_tokens = n;
    out.num_batched_tokens += n;
    budget -= n;
  }
}

int64_t Scheduler::PoolShare(const SequenceGroup& g) const {
  return static_cast<int64_t>(blocks_.MaxAdmissibleBlocks()) * blocks_.block_size() / std::max(1, g.max_running_seqs());
}

int64_t Scheduler::ReservationFor(const SequenceGroup& g, const SchedSequence& s) const {
  return std::min(policy_->AdmissionReservation(g, s, config_.max_model_len), PoolShare(g));
}

bool Scheduler::ExhaustsReservation(const SequenceGroup& g, const std::vector<int64_t>& tokens) const {
  if (!policy_->PreemptsOnExhaustedReservation()) return false;
  const int64_t pool_share = PoolShare(g);
  for (size_t i = 0; i < g.seqs.size(); ++i) {
    const SchedSequence& s = *g.seqs[i];
    if (tokens[i] == 0) continue;
    const int64_t write_to = s.num_computed + tokens[i];
    if (write_to <= Capacity(blocks_, s)) continue;
    // A sequence never outgrows the policy's ceiling (max_model_len, its max_tokens), so past the
    // reservation a doubling always helps, unless the pool could not hold the doubled one: then
    // the sequence grows on demand instead of being preempted forever.
    const int64_t reserved = policy_->AdmissionReservation(g, s, config_.max_model_len);
    if (write_to > reserved && reserved < pool_share) return true;
  }
  return false;
}

int Scheduler::GrowthAfterSwapIn(const SequenceGroup& g) const {
  int blocks = 0;
  for (const SchedSequence* s : g.unfinished()) {
    const int table = static_cast<int>(blocks_.BlockTable(s->id).size());
    const int reserved = policy_->PreemptsOnExhaustedReservation()
                             ? BlocksForTokens(ReservationFor(g, *s), blocks_.block_size())
                             : 0;
    blocks += std::max(1, reserved - table);  // at least room for the next token
  }
  return blocks;
}

int Scheduler::BlocksForStep(const SequenceGroup& g, const std::vector<int64_t>& tokens,
                             std::vector<int64_t>& targets) const {
  int needed = 0;
  targets.assign(g.seqs.size(), 0);
  for (size_t i = 0; i < g.seqs.size(); ++i) {
    const SchedSequence& s = *g.seqs[i];
    if (tokens[i] == 0) continue;
    const int64_t write_to = s.num_computed + tokens[i];
    // Growth the policy reserves ahead, within the group's share of the pool.
    targets[i] = write_to > Capacity(blocks_, s)
                     ? std::max(write_to, std::min(PoolShare(g), policy_->GrowReservation(g, s, write_to,
                                                                                           config_.max_model_len)))
                     : write_to;
    needed += blocks_.BlocksToAppend(s.id, s.num_computed, write_to, targets[i]);
  }
  return needed;
}

void Scheduler::Emit(SequenceGroup* g, const std::vector<int64_t>& tokens, SchedulerOutput& out) {
  for (size_t i = 0; i < g->seqs.size(); ++i) {
    if (tokens[i] == 0) continue;
    SchedSequence* s = g->seqs[i].get();
    const bool last_token_runs = s->num_computed + tokens[i] == s->num_tokens();
    out.scheduled.push_back({g, s, tokens[i], /*num_draft_tokens=*/0, last_token_runs});
    out.num_batched_tokens += tokens[i];
  }
  if (config_.batches_in_flight > 1) g->in_flight = true;
}

void Scheduler::Reject(SequenceGroup* g, Status why, SchedulerOutput& out) {
  out.rejected.emplace_back(g->request_id, std::move(why));
  RemoveGroup(g->request_id);
}

void Scheduler::RequeueForRecompute(SequenceGroup* g) {
  for (SchedSequence* s : g->unfinished()) {
    blocks_.Free(s->id);
    s->num_computed = 0;
    s->status = SeqStatus::kWaiting;
  }
  waiting_.push_back(g);
}

void Scheduler::Preempt(SequenceGroup* g, SchedulerOutput& out) {
  const std::vector<SeqId> ids = g->unfinished_ids();
  PreemptionMode mode = config_.preemption_mode;
  if (mode == PreemptionMode::kAuto) mode = ids.size() > 1 ? PreemptionMode::kSwap : PreemptionMode::kRecompute;
  running_.erase(std::find(running_.begin(), running_.end(), g));
  // Drafts were proposed for the next step; after preemption the drafter proposes afresh.
  for (SchedSequence* s : g->unfinished()) s->draft_tokens.clear();
  if (mode == PreemptionMode::kSwap && blocks_.CanSwapOut(ids)) {
    auto moves = blocks_.SwapOut(ids).value();
    counters_.blocks_swapped_out += static_cast<int64_t>(moves.size());
    out.swap_out.insert(out.swap_out.end(), moves.begin(), moves.end());
    for (SchedSequence* s : g->unfinished()) s->status = SeqStatus::kSwapped;
    swapped_.push_back(g);
    ++out.num_preempted_swap;
    ++counters_.num_preemptions_swap;
    spdlog::debug("preempted request {} by swap ({} blocks to host)", g->request_id, moves.size());
    return;
  }
  if (mode == PreemptionMode::kSwap) {
    spdlog::debug("swap space full: preempting request {} by recompute instead", g->request_id);
  }
  RequeueForRecompute(g);
  ++out.num_preempted_recompute;
  ++counters_.num_preemptions_recompute;
  spdlog::debug("preempted request {} by recompute", g->request_id);
}

SchedulerOutput Scheduler::Schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;
  std::vector<int64_t> tokens, targets;
  // With batches in flight: this step's share of the sequences.
  const int seq_cap = BatchSeqCap();
  int batch_seqs = 0;
  auto batch_full = [&] { return batch_seqs >= seq_cap; };

  // Groups that can be scheduled now: give them their blocks and put them in the batch. The
  // block counts were checked; a failure here is a bookkeeping bug, and costs only this group.
  auto apply = [&](SequenceGroup* g) {
    for (size_t i = 0; i < g->seqs.size(); ++i) {
      if (tokens[i] == 0) continue;
      const SchedSequence& s = *g->seqs[i];
      if (Status st = blocks_.AppendSlots(s.id, s.num_computed, s.num_computed + tokens[i], targets[i]); !st.ok()) {
        spdlog::error("scheduler: planned blocks for request {} are missing: {}", g->request_id, st.ToString());
        Reject(g, Status::Internal("KV block accounting error: " + st.message()), out);
        return false;
      }
    }
    Emit(g, tokens, out);
    for (int64_t n : tokens) budget -= n;
    batch_seqs += g->max_running_seqs();
    return true;
  };

  // 1. Running groups in policy order; the last ones give way when blocks run out.
  SortByPolicy(running_);
  for (size_t i = 0; i < running_.size();) {
    SequenceGroup* g = running_[i];
    // A group in a step still in flight waits for that step's tokens.
    if (g->in_flight || budget <= 0 || batch_full() || !PlanTokens(*g, budget, tokens)) {
      ++i;
      continue;
    }
    if (ExhaustsReservation(*g, tokens)) {
      // S3's supervisor: the prediction was too short. Preempt, double, reschedule.
      ++g->reservation_misses;
      ++counters_.num_reservation_preemptions;
      out.reservation_exhausted.push_back(g->request_id);
      spdlog::debug("request {} outgrew its KV reservation; preempting it (miss {})", g->request_id,
                    g->reservation_misses);
      Preempt(g, out);
      continue;
    }
    const int need = BlocksForStep(*g, tokens, targets);
    if (need <= blocks_.device().num_free()) {
      if (apply(g)) ++i;
      continue;
    }
    // Groups in flight keep their blocks: the last of the others gives way. When that is this group
    // while steps are in flight, it waits for them (they may finish and free blocks).
    SequenceGroup* victim = LastPreemptible();
    if (victim == g && AnyInFlight()) {
      ++i;
      continue;
    }
    if (victim == g && i == 0) {
      Reject(g, Status::OutOfMemory("the KV cache cannot hold request " + std::to_string(g->request_id) +
                                    " even alone (" + std::to_string(blocks_.device().num_blocks()) + " blocks)"),
             out);
      continue;
    }
    Preempt(victim, out);
  }
  const bool preempted = out.num_preempted_recompute + out.num_preempted_swap > 0;

  // 2. Swapped groups come back first, and only in a step that preempted nothing.
  SortByPolicy(swapped_);
  while (!preempted && !swapped_.empty() && budget > 0 && !batch_full()) {
    SequenceGroup* g = swapped_.front();
    const std::vector<SeqId> ids = g->unfinished_ids();
    if (RunningSeqs() + g->max_running_seqs() > config_.max_num_seqs) break;
    if (!blocks_.CanSwapIn(ids, GrowthAfterSwapIn(*g))) {
      if (!running_.empty()) break;
      // Even an idle device cannot take the group back with room to grow: recompute it instead.
      spdlog::debug("request {} cannot be swapped back in; recomputing it", g->request_id);
      swapped_.erase(swapped_.begin());
      RequeueForRecompute(g);
      continue;
    }
    auto moves = blocks_.SwapIn(ids).value();
    counters_.blocks_swapped_in += static_cast<int64_t>(moves.size());
    out.swap_in.insert(out.swap_in.end(), moves.begin(), moves.end());
    for (SchedSequence* s : g->unfinished()) s->status = SeqStatus::kRunning;
    swapped_.erase(swapped_.begin());
    running_.push_back(g);
    if (PlanTokens(*g, budget, tokens) && BlocksForStep(*g, tokens, targets) <= blocks_.device().num_free()) apply(g);
  }

  // 3. New (or recompute-preempted) groups, only while nothing is swapped out.
  SortByPolicy(waiting_);
  for (size_t k = 0; swapped_.empty() && k < waiting_.size() && budget > 0 && !batch_full();) {
    SequenceGroup* g = waiting_[k];
    const std::vector<SchedSequence*> seqs = g->unfinished();
    if (g->max_running_seqs() > config_.max_num_seqs) {
      Reject(g, Status::InvalidArgument("request " + std::to_string(g->request_id) + " runs " +
                                        std::to_string(g->max_running_seqs()) + " sequences at once; max_num_seqs is " +
                                        std::to_string(config_.max_num_seqs)),
             out);
      continue;
    }
    if (RunningSeqs() + g->max_running_seqs() > config_.max_num_seqs) break;
    std::vector<int64_t> reserve;
    int need = 0;
    for (const SchedSequence* s : seqs) {
      reserve.push_back(std::max(s->num_tokens(), ReservationFor(*g, *s)));
      need += blocks_.BlocksToAllocate(s->tokens, reserve.back(), !g->compute_whole_prompt);
    }
    if (need > blocks_.MaxAdmissibleBlocks()) {
      Reject(g, Status::OutOfMemory("request " + std::to_string(g->request_id) + " needs " + std::to_string(need) +
                                        " KV blocks; the cache admits at most " +
                                        std::to_string(blocks_.MaxAdmissibleBlocks())),
             out);
      continue;
    }
    if (!blocks_.CanAdmit(need)) {
      if (policy_->AdmitOutOfOrder()) {
        ++k;
        continue;
      }
      break;
    }
    Status allocated;
    for (size_t j = 0; j < seqs.size() && allocated.ok(); ++j) {
      auto cached = blocks_.Allocate(seqs[j]->id, seqs[j]->tokens, reserve[j], !g->compute_whole_prompt);
      if (!cached.ok()) {
        allocated = cached.status();
        break;
      }
      seqs[j]->num_computed = cached.value();
      seqs[j]->status = SeqStatus::kRunning;
    }
    if (!allocated.ok()) {  // admission counted these blocks: a bookkeeping bug, fail only this group
      spdlog::error("scheduler: admitting request {} failed: {}", g->request_id, allocated.ToString());
      Reject(g, Status::Internal("KV block accounting error: " + allocated.message()), out);
      continue;
    }
    g->reserved_tokens = reserve.front();
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(k));
    running_.push_back(g);
    if (PlanTokens(*g, budget, tokens) && BlocksForStep(*g, tokens, targets) <= blocks_.device().num_free()) apply(g);
  }

  // 4. Drafts, from what the real work of every group left of the budget and the blocks: a bet
  // never delays or preempts anyone.
  ScheduleDrafts(out, budget);

  out.copies = blocks_.TakePendingCopies();
  out.connector_moves = blocks_.TakeConnectorMoves();
  counters_.blocks_copied += static_cast<int64_t>(out.copies.size());
  return out;
}

void Scheduler::CompleteStep(const SchedulerOutput& out) {
  for (const ScheduledSeq& s : out.scheduled) {
    s.group->in_flight = false;
    s.seq->num_computed += s.num_real_tokens();
    blocks_.MarkComputed(s.seq->id, s.seq->tokens, s.seq->num_computed);
    // The drafts were proposed to follow the token sampled next; they are stale once it exists.
    if (s.needs_logits) s.seq->draft_tokens.clear();
  }
}

Status Scheduler::AcceptDrafts(const ScheduledSeq& step, std::span<const int32_t> accepted_drafts, int32_t next_token) {
  SchedSequence& s = *step.seq;
  const int64_t accepted = static_cast<int64_t>(accepted_drafts.size());
  if (accepted > step.num_draft_tokens) {
    return Status::InvalidArgument("sequence " + std::to_string(s.id) + ": " + std::to_string(accepted) +
                                   " drafts accepted, " + std::to_string(step.num_draft_tokens) + " ran");
  }
  if (!step.needs_logits || s.status != SeqStatus::kRunning || s.num_computed != s.num_tokens() ||
      !blocks_.Has(s.id) || blocks_.IsSwapped(s.id)) {
    return Status::InvalidArgument("sequence " + std::to_string(s.id) +
                                   " did not just compute its last token (AcceptDrafts: once per step, after "
                                   "CompleteStep)");
  }
  s.tokens.insert(s.tokens.end(), accepted_drafts.begin(), accepted_drafts.end());
  s.tokens.push_back(next_token);
  return CommitDrafts(step, accepted);
}

Status Scheduler::CommitDrafts(const ScheduledSeq& step, int64_t accepted) {
  SchedSequence& s = *step.seq;
  if (accepted < 0 || accepted > step.num_draft_tokens || s.num_tokens() != s.num_computed + accepted + 1 ||
      !step.needs_logits || s.status != SeqStatus::kRunning || !blocks_.Has(s.id) || blocks_.IsSwapped(s.id)) {
    return Status::InvalidArgument("sequence " + std::to_string(s.id) + ": " + std::to_string(accepted) +
                                   " accepted drafts and the next token were not appended as CommitDrafts expects");
  }
  // The accepted drafts ran at exactly these positions after exactly these tokens: their KV is
  // the real tokens' KV. Only now may their full blocks be published.
  s.num_computed += accepted;
  blocks_.MarkComputed(s.id, s.tokens, s.num_computed);
  return TrimToReservation(*step.group, s);
}

Status Scheduler::TrimToReservation(const SequenceGroup& g, const SchedSequence& s) {
  // Never below the tokens it holds (the next one included), so no KV and no slot of the next
  // step is lost.
  return blocks_.Truncate(s.id, std::max(s.num_tokens(), ReservationFor(g, s)));
}

int Scheduler::ReleaseBeyondReservation(const SequenceGroup& group) {
  int released = 0;
  for (const auto& seq : group.seqs) {
    const SchedSequence& s = *seq;
    if (s.status != SeqStatus::kRunning || !blocks_.Has(s.id) || blocks_.IsSwapped(s.id)) continue;
    const int before = static_cast<int>(blocks_.BlockTable(s.id).size());
    if (!TrimToReservation(group, s).ok()) continue;  // refused only in cases excluded above
    released += before - static_cast<int>(blocks_.BlockTable(s.id).size());
  }
  return released;
}

SchedSequence* Scheduler::Fork(SequenceGroup& group, const SchedSequence& parent) {
  auto child = std::make_unique<SchedSequence>(parent);
  child->id = NewSeqId();
  child->draft_tokens.clear();
  blocks_.Fork(parent.id, child->id);
  group.seqs.push_back(std::move(child));
  return group.seqs.back().get();
}

void Scheduler::FinishSequence(SchedSequence& seq) {
  seq.status = SeqStatus::kFinished;
  blocks_.Free(seq.id);
}

void Scheduler::RemoveGroup(RequestId id) {
  auto it = groups_.find(id);
  if (it == groups_.end()) return;
  SequenceGroup* g = it->second.get();
  for (auto& s : g->seqs) blocks_.Free(s->id);
  for (auto* q : {&waiting_, &running_, &swapped_}) {
    if (auto pos = std::find(q->begin(), q->end(), g); pos != q->end()) q->erase(pos);
  }
  groups_.erase(it);
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s = counters_;
  s.num_waiting = static_cast<int>(waiting_.size());
  s.num_running = static_cast<int>(running_.size());
  s.num_swapped = static_cast<int>(swapped_.size());
  s.num_running_seqs = RunningSeqs();
  return s;
}

}  // namespace kvflow
