// What proposes draft tokens for speculative decoding (engine/decoding/speculative_sampling.h): the n-gram
// lookup (speculative/ngram_drafter.h) or a draft model (speculative/draft_model.h). Once per step, before the
// step is scheduled, the engine hands the drafter every sequence that drafts, in one batch.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kv/block_allocator.h"
#include "kvflow/status.h"

namespace kvflow {

class Sampler;
class StepHooks;
struct SamplingParams;
struct SchedSequence;
struct SpecDecodeStats;

// One sequence's drafts for the coming step. The sequence is decoding: all its tokens but the last
// are in the KV cache.
struct DraftJob {
  const SchedSequence* seq = nullptr;
  std::span<const BlockId> block_table;  // the sequence's KV blocks (the engine fills it in)
  const SamplingParams* params = nullptr;
  int max_drafts = 0;
  // The drafter's own sampler for this sequence (a drafter that samples draws its drafts with it).
  Sampler* sampler = nullptr;
  // Out: at most max_drafts tokens to follow the sequence (none is a valid answer) and, from a
  // drafter that samples, the distribution each was drawn from (drafts.size() rows of vocab
  // floats); empty probs: each draft was chosen deterministically (one-hot).
  std::vector<int32_t> drafts;
  std::vector<float> probs;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // The most drafts it proposes per sequence and step (k).
  virtual int num_speculative_tokens() const = 0;
  // Fills every job's drafts, as one batch.
  virtual void Propose(std::span<DraftJob* const> jobs) = 0;
  // The target verified `drafted` of a sequence's drafts and kept `accepted` (a drafter that
  // adapts, e.g. TriForce's retrieval cache, learns from it).
  virtual void OnVerified(int64_t seq_id, int64_t drafted, int64_t accepted) {}
  // The sequence is gone (finished, failed or cancelled): drop what the drafter keeps for it.
  virtual void Forget(int64_t seq_id) {}
  // What the drafter runs inside the target's own passes (null: nothing); installed in the executor.
  virtual StepHooks* step_hooks() { return nullptr; }
  // Adds the drafter's own counters (its levels, passes) to the engine's.
  virtual void AddStats(SpecDecodeStats& stats) const {}
};

// Clears every job's drafts, then runs `propose` over the jobs in chunks of at most `chunk` (a
// drafter's scratch capacity). A chunk that fails is left without drafts (its sequences decode
// without speculation this step); `failures` counts them and the first is logged as `who`.
void ProposeInChunks(std::span<DraftJob* const> jobs, size_t chunk,
                     const std::function<Status(std::span<DraftJob* const>)>& propose, const char* who,
                     int64_t& failures);

}  // namespace kvflow
