// Perplexity of a causal LM on a token stream, computed through the engine's prompt logprobs, in
// the two ways people compare models:
//   - sliding window (Hugging Face, "Perplexity of fixed-length models"): windows of `ctx` tokens
//     every `stride` tokens; each window scores only the tokens the previous one did not, with
//     everything before them in the window as context;
//   - second half (llama.cpp's llama-perplexity): non-overlapping chunks of `ctx` tokens, each
//     scoring its second half (ctx/2 .. ctx-1) with the first half as context; the first token of a
//     chunk is the BOS token when the tokenizer adds one.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvflow/engine.h"
#include "kvflow/status.h"

namespace kvflow {

enum class PerplexityMethod { kSlidingWindow, kSecondHalf };
Result<PerplexityMethod> ParsePerplexityMethod(const std::string& name);  // "sliding-window", "second-half"
const char* PerplexityMethodName(PerplexityMethod m);

// Tokens [begin, end) of the stream go in as one prompt; the tokens at [score_from, end) are
// scored (each from the logits of the token before it, so score_from > begin).
struct PerplexityWindow {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t score_from = 0;
};

// The windows of a stream of `num_tokens` tokens; InvalidArgument for ctx < 2, a stride outside
// [1, ctx], or a stream shorter than one window's worth of scoring.
Result<std::vector<PerplexityWindow>> PlanPerplexityWindows(int64_t num_tokens, int ctx, int stride,
                                                            PerplexityMethod method);

struct PerplexityOptions {
  int ctx = 2048;
  int stride = 0;  // sliding window only; 0: ctx (non-overlapping)
  PerplexityMethod method = PerplexityMethod::kSlidingWindow;
  // > 0: each window's first decode_from tokens go in as a prompt (prefilled in chunks), the rest
  // run one per step as decode steps (SamplingParams::prompt_decode_from) and only they are scored:
  // what a decode-time feature costs after a dense prompt (InfiniGen's serving protocol: ctx 2048,
  // decode_from 1920). Windows with nothing past it are left out; windows run one at a time.
  int decode_from = 0;
  int max_windows = 0;         // 0: all
  int windows_in_flight = 2;   // requests batched together
  // > 0: also sum the NLL by window position in spans of this many tokens (positions [0, n), [n,
  // 2n), ... of every window): how the loss moves along a sequence (InfiniGen's Fig. 12: 256).
  int position_chunk = 0;
  // Called after each finished window with (windows done, windows total).
  std::function<void(int64_t, int64_t)> progress;
};

struct PerplexityResult {
  double perplexity = 0.0;
  double mean_nll = 0.0;  // nats per scored token
  int64_t scored_tokens = 0;
  int64_t windows = 0;
  int64_t input_tokens = 0;  // tokens run through the model (overlap counted again)
  double seconds = 0.0;
  std::vector<double> window_nll;  // summed NLL of each window's scored tokens
  int32_t first_token_bos = -1;    // second-half: the BOS id each chunk starts with, -1: none
  // With PerplexityOptions::position_chunk: span k's summed NLL and scored tokens over all windows.
  std::vector<double> chunk_nll;
  std::vector<int64_t> chunk_tokens;
};

Result<PerplexityResult> ComputePerplexity(Engine& engine, std::span<const int32_t> tokens,
                                           const PerplexityOptions& options);

}  // namespace kvflow
