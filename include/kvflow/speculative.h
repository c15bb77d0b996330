// Speculative decoding: its configuration (EngineConfig::speculative) and counters
// (EngineStats::spec). Every method is lossless: greedy outputs are those of plain decoding and
// sampled ones follow the target's distribution. Requests opt out with SamplingParams::speculative.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvflow {

// Prompt lookup: draft the tokens that followed the sequence's last max..min tokens earlier on.
struct NgramOptions {
  int max = 4;
  int min = 1;
};

// TriForce (hierarchical speculation for long contexts): the target over a retrieval cache (its
// own top KV blocks) drafts gamma2 = SpeculativeConfig::num_tokens tokens for the target with its
// full cache to verify; a bottom drafter proposes gamma1 = draft_tokens tokens at a time for that
// middle level to verify. Exact rejection sampling at both levels.
struct TriForceOptions {
  std::string draft = "ngram";  // bottom: "ngram", "streaming" (the target over sinks + window) or "draft_model"
  int draft_tokens = 3;         // gamma1
  int budget = 0;               // retrieval cache tokens; 0: context/8 within [256, 4096]
  int rebuild_stride = 1024;    // tokens appended before the cache is rebuilt; 0: on low acceptance only
  double rebuild_acceptance = 0.5;  // rolling acceptance below which it is rebuilt
  int min_context = 4096;       // shorter contexts decode plainly
  int sinks = 16;               // streaming / draft-model bottom: attention-sink tokens
  int window = 256;             // streaming / draft-model bottom: recent tokens
};

struct SpeculativeConfig {
  // "ngram", "draft_model" (drafts sampled from `model`, a smaller model with the same tokenizer on
  // the same device, its KV cache following the target's blocks) or "triforce"; empty: off, or
  // "draft_model" when `model` is set.
  std::string method;
  std::string model;
  int num_tokens = 0;  // drafts per step at most (triforce: gamma2); 0: the method's default
  NgramOptions ngram;
  TriForceOptions triforce;
};

// vLLM's spec_decode metrics: acceptance rate = accepted / draft tokens; mean accepted length =
// 1 + accepted / drafts (tokens per verification pass of a sequence).
struct SpecDecodeStats {
  int64_t num_drafts = 0;           // verification passes of a sequence with at least one draft
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_position;  // drafts accepted at position 0, 1, ...
  // TriForce: its middle level (the target over a retrieval cache) verifying the bottom drafter's
  // tokens, per sequence pass.
  int64_t middle_passes = 0;
  int64_t middle_draft_tokens = 0;     // bottom drafts the middle verified
  int64_t middle_accepted_tokens = 0;  // of those, kept
  int64_t bottom_passes = 0;           // model passes of a bottom drafter (none for n-gram)
  int64_t retrieval_builds = 0;        // retrieval caches built or rebuilt (full-cache middle passes)
  int64_t retrieval_copied_blocks = 0; // KV blocks copied to the device for the middle (offloaded pool)
  int64_t plain_steps = 0;             // sequence steps decoded without drafts because TriForce would not pay
  int64_t retrieval_caches = 0;        // sequences holding a retrieval cache now (a gauge)
  double middle_seconds = 0;           // wall time in middle passes
  double bottom_seconds = 0;           // wall time in the bottom drafter

  // Adds `sign` times every counter of `o` (sign -1: the difference of two snapshots).
  void Add(const SpecDecodeStats& o, int sign = 1) {
    num_drafts += sign * o.num_drafts;
    num_draft_tokens += sign * o.num_draft_tokens;
    num_accepted_tokens += sign * o.num_accepted_tokens;
    if (accepted_per_position.size() < o.accepted_per_position.size()) {
      accepted_per_position.resize(o.accepted_per_position.size(), 0);
    }
    for (size_t i = 0; i < o.accepted_per_position.size(); ++i) accepted_per_position[i] += sign * o.accepted_per_position[i];
    middle_passes += sign * o.middle_passes;
    middle_draft_tokens += sign * o.middle_draft_tokens;
    middle_accepted_tokens += sign * o.middle_accepted_tokens;
    bottom_passes += sign * o.bottom_passes;
    retrieval_builds += sign * o.retrieval_builds;
    retrieval_copied_blocks += sign * o.retrieval_copied_blocks;
    plain_steps += sign * o.plain_steps;
    retrieval_caches += sign * o.retrieval_caches;
    middle_seconds += sign * o.middle_seconds;
    bottom_seconds += sign * o.bottom_seconds;
  }
};

}  // namespace kvflow
