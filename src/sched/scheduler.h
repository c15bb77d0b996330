// Iteration-level scheduler (vLLM §4.5): every step builds one batch of prefill chunks and decode
// tokens under max_num_seqs and max_num_batched_tokens, in the policy's order (FCFS by default).
// When blocks run out it preempts whole sequence groups from the end of that order, by swapping
// them to host memory or by dropping their KV for recomputation. While any group is swapped out
// nothing new is admitted, and swapped groups come back first. Plain C++, no backend.
//
// Speculative decoding (vLLM v1): a decoding sequence runs its last token plus the drafts a
// drafter proposed (SchedSequence::draft_tokens) in one step, with KV slots reserved for them;
// after verification AcceptDrafts keeps the accepted ones and releases the rest.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kv/block_manager.h"
#include "kvflow/status.h"
#include "sched/policy.h"
#include "sched/sequence_group.h"

namespace kvflow {

enum class PreemptionMode { kAuto, kSwap, kRecompute };
// "auto" (recompute single sequences, swap groups that share blocks), "swap", "recompute".
Result<PreemptionMode> ParsePreemptionMode(std::string_view name);
const char* PreemptionModeName(PreemptionMode mode);

struct SchedulerConfig {
  int max_num_seqs = 64;
  int64_t max_num_batched_tokens = 2048;
  int64_t max_model_len = 2048;
  PreemptionMode preemption_mode = PreemptionMode::kAuto;
  // Steps the engine keeps in flight at once (vLLM V1's batch queue, for pipeline parallelism):
  // with more than one, a scheduled group is in flight until CompleteStep, the next steps leave it
  // alone (its next token is not known yet), and each step takes about 1/batches_in_flight of the
  // sequences, so that the steps in flight share the work.
  int batches_in_flight = 1;
};

// One sequence's part of a step: num_tokens new positions from seq->num_computed on, first its
// uncomputed tokens (all of them, or a prefill chunk), then its first num_draft_tokens drafts
// (seq->draft_tokens), which get KV slots like real tokens. Drafts run only behind all of a
// sequence's real tokens, only once its prompt is computed, only in single-candidate groups,
// never past max_model_len, and only with the token budget and free blocks that the step's real
// tokens left: fewer drafts, never fewer real tokens, and never a preemption for a draft.
struct ScheduledSeq {
  SequenceGroup* group = nullptr;
  SchedSequence* seq = nullptr;
  int64_t num_tokens = 0;        // new positions this step, drafts included
  int64_t num_draft_tokens = 0;  // the last num_draft_tokens of them are drafts
  // The step computes the sequence's last real token: sample after it. Logit rows: one for that
  // token, plus one per draft (num_draft_tokens + 1, in position order); row j verifies draft j
  // and the last row gives the bonus token when every draft is accepted.
  bool needs_logits = false;

  int64_t num_real_tokens() const { return num_tokens - num_draft_tokens; }
  // The token at new position i (0 <= i < num_tokens), real or draft. Valid until CompleteStep.
  int32_t token(int64_t i) const {
    const int64_t real = num_real_tokens();
    return i < real ? seq->tokens[static_cast<size_t>(seq->num_computed + i)]
                    : seq->draft_tokens[static_cast<size_t>(i - real)];
  }
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> scheduled;
  // Executed before the forward pass, in this order: swap-out (device -> host), swap-in
  // (host -> device), copy-on-write copies (device -> device).
  std::vector<BlockMove> swap_out;
  std::vector<BlockMove> swap_in;
  std::vector<BlockMove> copies;
  // The KV connectors' moves (kv/kv_connector_scheduler.h): all their saves run before the swap-out, all
  // their loads after the swap-in, the copy-on-write copies last.
  std::vector<KvConnectorMoves> connector_moves;
  // Groups that can never fit; already removed from the scheduler, to be failed by the caller.
  std::vector<std::pair<RequestId, Status>> rejected;
  // Groups preempted this step because a sequence outgrew its reservation (S3 mispredictions);
  // they come back with the reservation doubled.
  std::vector<RequestId> reservation_exhausted;
  int num_preempted_recompute = 0;
  int num_preempted_swap = 0;
  int64_t num_batched_tokens = 0;
  bool empty() const { return scheduled.empty(); }
};

struct SchedulerStats {
  int num_waiting = 0;  // groups
  int num_running = 0;
  int num_swapped = 0;
  int num_running_seqs = 0;
  int64_t num_preemptions_recompute = 0;
  int64_t num_preemptions_swap = 0;
  int64_t num_reservation_preemptions = 0;  // of the preemptions above, those of exhausted reservations
  int64_t blocks_swapped_out = 0;
  int64_t blocks_swapped_in = 0;
  int64_t blocks_copied = 0;
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, BlockManager& blocks, std::unique_ptr<SchedulingPolicy> policy);

  // Queues a new request (its sequences waiting, nothing computed). Sequence ids must be unique;
  // NewSeqId() hands out ones that are.
  void AddGroup(std::unique_ptr<SequenceGroup> group);
  SeqId NewSeqId() { return next_seq_id_++; }

  // Plans one step. The caller runs it, then calls CompleteStep.
  SchedulerOutput Schedule();
  // Advances every scheduled sequence's num_computed by its real tokens and publishes full blocks
  // to the prefix cache (drafts are never published: they are not computed tokens). Call before
  // appending the sampled tokens. A sequence whose last token ran loses its draft_tokens; the KV
  // slots of the ones that ran stay reserved until AcceptDrafts.
  void CompleteStep(const SchedulerOutput& out);
  // After CompleteStep, for a `step` that computed its sequence's last token: the verification's
  // outcome (vLLM's update_from_output). `accepted_drafts`, the leading drafts the target model
  // confirmed (at most step.num_draft_tokens, as scheduled), join the tokens with their KV already
  // computed; `next_token` (the correction at the first rejected draft, or the bonus token after
  // all of them) is appended uncomputed; blocks beyond what the sequence and its policy
  // reservation now hold (the rejected drafts' slots) go back to the pool. Without drafts it only
  // appends next_token. It takes the ScheduledSeq because it needs the step's draft count and the
  // group. Errors change nothing: more drafts accepted than ran, or a sequence that did not just
  // compute its last token (call once per step, after CompleteStep, before FinishSequence).
  Status AcceptDrafts(const ScheduledSeq& step, std::span<const int32_t> accepted_drafts, int32_t next_token);
  // The same for a caller that appended the accepted drafts and the next token to seq->tokens
  // itself (the engine core, which checks stops token by token as it appends).
  Status CommitDrafts(const ScheduledSeq& step, int64_t accepted);

  // After a policy's reservation for `group` shrank (S3's probe re-sizing it after the prefill):
  // each running, device-resident sequence gives back the blocks past what it holds and what it
  // now reserves. Returns the blocks freed (a block shared with a fork or the prefix cache counts,
  // though the pool gains it only when the last holder lets go).
  int ReleaseBeyondReservation(const SequenceGroup& group);

  // A new sequence in `group` sharing all of `parent`'s tokens and blocks.
  SchedSequence* Fork(SequenceGroup& group, const SchedSequence& parent);
  // Marks a sequence finished and frees its blocks (the group stays until RemoveGroup).
  void FinishSequence(SchedSequence& seq);
  // Frees everything of a request and forgets it (finished, cancelled or failed).
  void RemoveGroup(RequestId id);

  SequenceGroup* Find(RequestId id) const;
  // The groups in the running batch.
  const std::vector<SequenceGroup*>& running() const { return running_; }
  bool HasWork() const { return !groups_.empty(); }
  SchedulerStats stats() const;
  const SchedulerConfig& config() const { return config_; }
  const SchedulingPolicy& policy() const { return *policy_; }
  BlockManager& block_manager() { return blocks_; }
  const BlockManager& block_manager() const { return blocks_; }

 private:
  enum class Queue { kWaiting, kRunning, kSwapped };
  void SortByPolicy(std::vector<SequenceGroup*>& queue) const;
  void Preempt(SequenceGroup* group, SchedulerOutput& out);
  // Drops the group's KV (device or host) and queues it to prefill all its tokens again.
  void RequeueForRecompute(SequenceGroup* group);
  // Blocks the group's sequences need to run `tokens[i]` new tokens each (including growth the
  // policy reserves); fills `targets` with each sequence's table size in tokens.
  int BlocksForStep(const SequenceGroup& g, const std::vector<int64_t>& tokens, std::vector<int64_t>& targets) const;
  // KV tokens per sequence of `g` if the group took all that one admission can take.
  int64_t PoolShare(const SequenceGroup& g) const;
  // KV tokens a sequence of `g` may hold under the policy's reservation, within its PoolShare.
  int64_t ReservationFor(const SequenceGroup& g, const SchedSequence& s) const;
  // Under a hard-reservation policy: whether `tokens` would take a sequence of `g` past a
  // reservation that a doubling could still enlarge.
  bool ExhaustsReservation(const SequenceGroup& g, const std::vector<int64_t>& tokens) const;
  // Drops the blocks of `s` past both its tokens and its policy reservation.
  Status TrimToReservation(const SequenceGroup& g, const SchedSequence& s);
  // Device blocks the group needs beyond its own to keep running after a swap-in.
  int GrowthAfterSwapIn(const SequenceGroup& g) const;
  // Splits the token budget over the group's sequences; false when not even one token fits.
  bool PlanTokens(const SequenceGroup& g, int64_t budget, std::vector<int64_t>& tokens) const;
  void Emit(SequenceGroup* g, const std::vector<int64_t>& tokens, SchedulerOutput& out);
  // Drafts `s` may run behind its last token with `room` tokens of budget left.
  int64_t DraftsFor(const SequenceGroup& g, const SchedSequence& s, int64_t room) const;
  // Extends the scheduled sequences whose last token runs with their drafts, in batch order, as
  // far as the leftover `budget` and the free blocks go; reserves the drafts' KV slots.
  void ScheduleDrafts(SchedulerOutput& out, int64_t budget);
  void Reject(SequenceGroup* g, Status why, SchedulerOutput& out);
  int RunningSeqs() const;
  // Sequences one step may take with batches in flight (no limit with one).
  int BatchSeqCap() const;
  // The last running group in policy order that is not in flight (null: none).
  SequenceGroup* LastPreemptible() const;
  bool AnyInFlight() const;

  SchedulerConfig config_;
  BlockManager& blocks_;
  std::unique_ptr<SchedulingPolicy> policy_;
  std::unordered_map<RequestId, std::unique_ptr<SequenceGroup>> groups_;
  std::vector<SequenceGroup*> waiting_;
  std::vector<SequenceGroup*> running_;
  std::vector<SequenceGroup*> swapped_;
  SchedulerStats counters_;
  SeqId next_seq_id_ = 1;
};

}  // namespace kvflow
