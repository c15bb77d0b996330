// TriForce's retrieval cache (seed 003, §4.1): the middle level of the hierarchy is the target
// model attending to a subset of its own KV cache. A chunk is a KV block, so the subset is a list of
// the sequence's full blocks, read by the existing paged kernels as a block-table subset
// (KvView::kBlocks); the sequence's partial last block and its drafts live in a scratch lane
// (triforce/lane_pass.h).
//
// What this file decides (policy; the scoring itself is a Backend primitive, ScoreKvBlocks):
// - the budget: how many tokens the selection holds for a given context;
// - which blocks the middle reads: the selection made at the last build, then every block that
//   filled up since (new tokens are appended, never dropped, until the next rebuild);
// - when to rebuild: on a stride of appended tokens, or when the rolling acceptance rate of the
//   middle's drafts at the top level falls below a threshold;
// - when TriForce does not pay for a sequence (short context, acceptance too low) and it should
//   decode plainly for a while.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace kvflow {

struct RetrievalPolicy {
  int budget_tokens = 0;            // selection size; 0: auto (RetrievalBudgetTokens)
  int rebuild_stride = 1024;        // tokens appended before a rebuild; 0: only on low acceptance
  double rebuild_acceptance = 0.5;  // rolling top-level acceptance below which the cache is rebuilt
  int acceptance_window = 8;        // verification rounds in the rolling rate
  int64_t min_context = 4096;       // below this context a sequence decodes plainly
  // Rolling acceptance below which speculation does not pay (fewer than ~1.2 tokens per full
  // pass): the sequence decodes plainly for pause_steps steps, then rebuilds and tries again.
  double pause_acceptance = 0.2;
  int pause_steps = 64;
};

// The selection's size in tokens for a context of `context` tokens: the configured budget, or by
// default (0) an eighth of the context between 256 and 4096 tokens (the paper's 4K at 120K is
// 3%; on a 2-8K context a fixed 4K would be most of the cache and save nothing).
int64_t RetrievalBudgetTokens(int configured, int64_t context);

// Blocks always kept after the first one: the most recent eighth of the budget (at least one).
int RecentBlocks(int64_t budget_blocks);

class RetrievalCache {
 public:
  bool built() const { return built_; }
  // Selections made so far (each Build adds one).
  int64_t builds() const { return builds_; }
  // A new selection (ascending logical indices of full blocks) made with `cached` tokens cached.
  void Build(std::vector<int32_t> selected, int64_t cached);
  // The logical full blocks the middle reads with `cached` tokens cached (those of the partial
  // last block are in the lane): the selection, then every block filled since the build.
  void ViewBlocks(int64_t cached, int block_size, std::vector<int32_t>& out) const;

  // The top level verified `drafted` of the middle's tokens and kept `accepted`.
  void RecordVerification(int64_t drafted, int64_t accepted);
  // Rolling acceptance over the window (1 with no rounds yet).
  double RollingAcceptance() const;

  enum class Action { kDraft, kBuild, kPlain };
  // What to do this step: draft over the cache, (re)build it first, or decode plainly. Counts down
  // a pause.
  Action Decide(int64_t cached, int64_t budget_tokens, const RetrievalPolicy& policy);

 private:
  bool built_ = false;
  int64_t builds_ = 0;
  std::vector<int32_t> selected_;
  int64_t built_at_ = 0;  // tokens cached when built: blocks filled after it are appended
  std::deque<std::pair<int64_t, int64_t>> rounds_;  // (drafted, accepted)
  int rounds_since_build_ = 0;
  int pause_left_ = 0;
};

}  // namespace kvflow
