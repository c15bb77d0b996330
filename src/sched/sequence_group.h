// The scheduler's view of requests: a sequence group is one request with one or more sequences
// (parallel samples or beams) that share its prompt. Plain C++ so the scheduler and the block
// manager can be tested with fake sequences, without a model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kv/block_manager.h"
#include "kvflow/request.h"

namespace kvflow {

enum class SeqStatus { kWaiting, kRunning, kSwapped, kFinished };

struct SchedSequence {
  SeqId id = 0;
  std::vector<int32_t> tokens;  // prompt, then output
  int64_t prompt_len = 0;
  int64_t num_computed = 0;  // leading tokens whose K/V are in the cache
  SeqStatus status = SeqStatus::kWaiting;
  // Speculative tokens a drafter proposes to follow `tokens` (not part of them). Schedule() runs
  // as many as fit behind the sequence's last token; CompleteStep clears them, and
  // Scheduler::AcceptDrafts takes the ones the target model confirmed. Dropped on preemption.
  std::vector<int32_t> draft_tokens;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t output_len() const { return num_tokens() - prompt_len; }
  int64_t num_uncomputed() const { return num_tokens() - num_computed; }
  bool finished() const { return status == SeqStatus::kFinished; }
};

struct SequenceGroup {
  RequestId request_id = 0;
  double arrival_time = 0.0;  // seconds on any monotonic clock; FCFS order, ties by request_id
  std::vector<std::unique_ptr<SchedSequence>> seqs;
  int64_t max_output_tokens = 0;  // the request's max_tokens
  // Known only in traces; what the Orca oracle baselines reserve.
  std::optional<int64_t> true_output_len;
  // Filled by a length predictor (S3); policies may reserve by it.
  std::optional<int64_t> predicted_output_len;
  int predicted_bucket = -1;  // the predictor's length bucket, -1: no prediction
  // The prompt's last final-norm hidden row, kept until the request ends for the length probe's
  // online update (S3 with a probe and online updates; empty otherwise).
  std::vector<float> prompt_hidden;
  // Times a sequence of the group outgrew its reservation under a hard-reservation policy (S3);
  // each one doubles the reservation.
  int reservation_misses = 0;
  // KV tokens per sequence the policy reserved at admission (0: allocate on demand).
  int64_t reserved_tokens = 0;
  // Sequences the request forks into after its prompt (n / best_of / beam width).
  int num_candidates = 1;
  // Every prompt token must run, even with its KV in the prefix cache (prompt logprobs).
  bool compute_whole_prompt = false;
  // Prompt tokens from this position on run one per step (SamplingParams::prompt_decode_from; 0: off).
  int64_t prompt_decode_from = 0;
  // Attention may read a selection of the cache (an engine KV selector: InfiniGen, H2O).
  bool kv_selection = false;
  // In a step that is still running (batches in flight): not scheduled, preempted or freed until
  // the step completes.
  bool in_flight = false;

  std::vector<SchedSequence*> unfinished() const {
    std::vector<SchedSequence*> out;
    for (const auto& s : seqs) {
      if (!s->finished()) out.push_back(s.get());
    }
    return out;
  }
  std::vector<SeqId> unfinished_ids() const {
    std::vector<SeqId> out;
    for (const auto& s : seqs) {
      if (!s->finished()) out.push_back(s->id);
    }
    return out;
  }
  int num_unfinished() const { return static_cast<int>(unfinished().size()); }
  // Sequences this group will run at once: before the fork that is already num_candidates.
  int max_running_seqs() const {
    if (seqs.size() == 1 && !seqs.front()->finished() && seqs.front()->output_len() == 0) return num_candidates;
    return num_unfinished();
  }
  int64_t prompt_len() const { return seqs.empty() ? 0 : seqs.front()->prompt_len; }
};

}  // namespace kvflow
