// `kvflow bench`: llama-bench's single-sequence measurements on the engine. One request at a time:
// prefill a prompt of `depth` synthetic tokens (timed as prefill), then `decode_tokens` one-token
// decode steps (timed as decode), so decode speed can be read at a given KV depth, as
// `llama-bench -p 0 -n 64 -d DEPTH` does. Header-only so the unit tests can drive it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "kvflow/engine.h"

namespace kvflow {

struct DecodeBenchOptions {
  int depth = 0;           // prompt tokens prefilled before decoding; 0 means a one-token prompt
  int decode_tokens = 64;  // timed decode steps; 0 times the prefill only
  int repeats = 3;         // timed runs; the results are their medians
  bool warmup = true;      // one short untimed run first (allocations, page faults, thread start)
  uint32_t seed = 1;       // for the synthetic prompt's token ids
  int batch = 1;           // sequences decoding together, each with its own prompt of `depth` tokens
};

struct DecodeBenchRun {
  int prompt_tokens = 0;  // over the batch
  int decode_steps = 0;   // tokens decoded over the batch
  double prefill_s = 0.0;  // the steps that prefilled the prompt (and sampled the first token)
  double decode_s = 0.0;   // the one-token decode steps after it
};

struct DecodeBenchResult {
  int depth = 0;
  int decode_tokens = 0;
  std::vector<DecodeBenchRun> runs;
  double prefill_tok_s = 0.0;  // median over runs of prompt_tokens / prefill_s
  double decode_tok_s = 0.0;   // median over runs of decode_steps / decode_s (0 when decode_tokens == 0)
};

// Median of `v` (mean of the middle two for an even count); 0 for an empty vector.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 ? v[mid] : 0.5 * (v[mid - 1] + v[mid]);
}

// `n` reproducible token ids drawn uniformly from the upper part of the vocabulary, away from the
// low ids where tokenizers keep their special tokens (BOS, EOS, chat markers).
inline std::vector<int32_t> SyntheticPrompt(int n, int vocab_size, uint32_t seed) {
  const int32_t lo = std::min(100, vocab_size / 2);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(lo, vocab_size - 1);
  std::vector<int32_t> tokens(static_cast<size_t>(std::max(0, n)));
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

// Requests (one per prompt, added together) through an otherwise idle engine, every Step() timed
// and attributed to prefill (until every step that carried prompt tokens has ended: with one
// request its time to first token) or decode (the steps of one token per sequence after them).
inline Result<DecodeBenchRun> TimeDecodeRun(Engine& engine, std::vector<std::vector<int32_t>> prompts, int decode_tokens) {
  using Clock = std::chrono::steady_clock;
  if (engine.HasUnfinishedRequests()) return Status::InvalidArgument("bench: the engine must be idle");
  SamplingParams p;
  p.temperature = 0.0f;
  p.ignore_eos = true;
  p.max_tokens = decode_tokens + 1;  // the prefill samples the first token, each decode step one more
  DecodeBenchRun run;
  for (std::vector<int32_t>& prompt : prompts) {
    if (prompt.empty()) return Status::InvalidArgument("bench: the prompt needs at least one token");
    run.prompt_tokens += static_cast<int>(prompt.size());
    KVFLOW_ASSIGN_OR_RETURN(auto id, engine.AddRequest(std::move(prompt), p));
    (void)id;
  }
  const int expected_decode = decode_tokens * static_cast<int>(prompts.size());
  int prefilled = 0;
  // The steps started and not yet ended, oldest first: whether each carried prompt tokens. One step
  // at a time a step ends in the call that started it; with batches in flight (pipeline
  // parallelism) it ends in a later call, and that call's time still belongs to the prefill.
  std::deque<bool> in_flight;
  auto prefill_done = [&] {
    return prefilled == run.prompt_tokens && std::find(in_flight.begin(), in_flight.end(), true) == in_flight.end();
  };
  while (engine.HasUnfinishedRequests()) {
    const bool prefilling = !prefill_done();
    const auto start = Clock::now();
    KVFLOW_ASSIGN_OR_RETURN(StepResult step, engine.Step());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (step.num_seqs == 0 && step.num_steps_completed == 0) {
      return Status::Internal("bench: the engine made no progress (KV cache too small for the prompt?)");
    }
    if (step.num_seqs > 0) in_flight.push_back(step.num_prefill_tokens > 0);
    for (int i = 0; i < step.num_steps_completed && !in_flight.empty(); ++i) in_flight.pop_front();
    prefilled += step.num_prefill_tokens;
    if (step.num_prefill_tokens == 0) run.decode_steps += step.num_decode_tokens;
    (prefilling ? run.prefill_s : run.decode_s) += seconds;
  }
  if (prefilled != run.prompt_tokens || run.decode_steps != expected_decode) {
    return Status::Internal("bench: expected " + std::to_string(run.prompt_tokens) + " prefill and " +
                            std::to_string(expected_decode) + " decode tokens, the engine ran " +
                            std::to_string(prefilled) + " and " + std::to_string(run.decode_steps) +
                            " (preempted? use a larger KV cache)");
  }
  return run;
}

inline Result<DecodeBenchResult> RunDecodeBench(Engine& engine, const DecodeBenchOptions& opt) {
  if (opt.depth < 0 || opt.decode_tokens < 0 || opt.repeats < 1 || opt.batch < 1) {
    return Status::InvalidArgument("bench: depth and decode tokens must be >= 0, repeats and batch >= 1");
  }
  const int vocab = engine.model_config().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < opt.batch; ++i) {
    prompts.push_back(SyntheticPrompt(std::max(1, opt.depth), vocab, opt.seed + static_cast<uint32_t>(i)));
  }
  if (opt.warmup) {
    const int n = std::min<int>(16, static_cast<int>(prompts[0].size()));
    KVFLOW_ASSIGN_OR_RETURN(auto ignored, TimeDecodeRun(engine, {{prompts[0].begin(), prompts[0].begin() + n}},
                                                        std::min(opt.decode_tokens, 4)));
    (void)ignored;
  }
  DecodeBenchResult result;
  result.depth = opt.depth;
  result.decode_tokens = opt.decode_tokens;
  std::vector<double> prefill_rates, decode_rates;
  for (int r = 0; r < opt.repeats; ++r) {
    KVFLOW_ASSIGN_OR_RETURN(DecodeBenchRun run, TimeDecodeRun(engine, prompts, opt.decode_tokens));
    prefill_rates.push_back(run.prefill_s > 0 ? run.prompt_tokens / run.prefill_s : 0.0);
    if (run.decode_steps > 0) decode_rates.push_back(run.decode_s > 0 ? run.decode_steps / run.decode_s : 0.0);
    result.runs.push_back(run);
  }
  result.prefill_tok_s = Median(prefill_rates);
  result.decode_tok_s = Median(decode_rates);
  return result;
}

}  // namespace kvflow
