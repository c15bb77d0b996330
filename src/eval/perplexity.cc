#include "eval/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace kvflow {

Result<PerplexityMethod> ParsePerplexityMethod(const std::string& name) {
  if (name == "sliding-window" || name == "hf") return PerplexityMethod::kSlidingWindow;
  if (name == "second-half" || name == "llama.cpp") return PerplexityMethod::kSecondHalf;
  return Status::InvalidArgument("perplexity method must be sliding-window (hf) or second-half (llama.cpp), not '" +
                                 name + "'");
}

const char* PerplexityMethodName(PerplexityMethod m) {
  return m == PerplexityMethod::kSlidingWindow ? "sliding-window" : "second-half";
}

Result<std::vector<PerplexityWindow>> PlanPerplexityWindows(int64_t num_tokens, int ctx, int stride,
                                                            PerplexityMethod method) {
  if (ctx < 2) return Status::InvalidArgument("the perplexity context must be at least 2 tokens, not " + std::to_string(ctx));
  std::vector<PerplexityWindow> windows;
  if (method == PerplexityMethod::kSecondHalf) {
    // llama.cpp scores positions first + 1 .. ctx - 1 of each whole chunk, first = ctx / 2.
    for (int64_t begin = 0; begin + ctx <= num_tokens; begin += ctx) {
      windows.push_back({begin, begin + ctx, begin + ctx / 2 + 1});
    }
    if (windows.empty()) {
      return Status::InvalidArgument("the text has " + std::to_string(num_tokens) + " tokens, less than one chunk of " +
                                     std::to_string(ctx) + "; lower --ctx");
    }
    return windows;
  }
  if (stride < 1 || stride > ctx) {
    return Status::InvalidArgument("the stride must be in [1, ctx = " + std::to_string(ctx) + "], not " + std::to_string(stride));
  }
  if (num_tokens < 2) return Status::InvalidArgument("the text has fewer than 2 tokens: nothing to score");
  int64_t prev_end = 0;
  for (int64_t begin = 0; begin < num_tokens; begin += stride) {
    const int64_t end = std::min<int64_t>(begin + ctx, num_tokens);
    // As the HF guide: labels before the window's new tokens are masked, and the window's first
    // token has no prediction.
    const int64_t from = std::max(prev_end, begin + 1);
    if (from < end) windows.push_back({begin, end, from});
    prev_end = end;
    if (end == num_tokens) break;
  }
  return windows;
}

Result<PerplexityResult> ComputePerplexity(Engine& engine, std::span<const int32_t> tokens,
                                           const PerplexityOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const int stride = options.stride > 0 ? options.stride : options.ctx;
  KVFLOW_ASSIGN_OR_RETURN(std::vector<PerplexityWindow> windows,
                          PlanPerplexityWindows(static_cast<int64_t>(tokens.size()), options.ctx, stride, options.method));
  if (options.decode_from < 0 || options.decode_from >= options.ctx) {
    return Status::InvalidArgument("decode_from must be in [0, ctx = " + std::to_string(options.ctx) + "), not " +
                                   std::to_string(options.decode_from));
  }
  if (options.position_chunk < 0) {
    return Status::InvalidArgument("the position chunk must be >= 0, not " + std::to_string(options.position_chunk));
  }
  if (options.decode_from > 0) {
    std::vector<PerplexityWindow> kept;
    for (PerplexityWindow w : windows) {
      w.score_from = std::max(w.score_from, w.begin + options.decode_from);
      if (w.score_from < w.end) kept.push_back(w);
    }
    if (kept.empty()) return Status::InvalidArgument("no window is longer than decode_from: nothing to score");
    windows = std::move(kept);
  }
  if (options.max_windows > 0 && static_cast<int64_t>(windows.size()) > options.max_windows) {
    windows.resize(static_cast<size_t>(options.max_windows));
  }
  if (options.ctx > engine.config().max_model_len) {
    return Status::InvalidArgument("--ctx " + std::to_string(options.ctx) + " exceeds the engine's max_model_len " +
                                   std::to_string(engine.config().max_model_len));
  }
  const int32_t bos = engine.tokenizer().bos_id();
  const bool replace_bos = options.method == PerplexityMethod::kSecondHalf && engine.tokenizer().add_bos() && bos >= 0;

  SamplingParams params;
  params.max_tokens = 0;  // the prompt's logprobs only
  params.prompt_logprobs = 0;
  params.temperature = 0.0f;
  params.prompt_decode_from = options.decode_from;

  PerplexityResult result;
  result.window_nll.assign(windows.size(), 0.0);
  result.first_token_bos = replace_bos ? bos : -1;
  std::vector<std::vector<SampledToken>> logprobs(windows.size());
  std::vector<Status> errors(windows.size());
  size_t submitted = 0, finished = 0;
  // With decode_from, one window at a time: beside another window's steps a prompt chunk could be cut
  // to a single token before decode_from, which a KV selection would take for a decode step.
  const size_t limit = options.decode_from > 0 ? 1 : static_cast<size_t>(std::max(1, options.windows_in_flight));
  while (finished < windows.size()) {
    for (; submitted < windows.size() && submitted - finished < limit; ++submitted) {
      const PerplexityWindow& win = windows[submitted];
      std::vector<int32_t> prompt(tokens.begin() + win.begin, tokens.begin() + win.end);
      if (replace_bos) prompt.front() = bos;
      result.input_tokens += static_cast<int64_t>(prompt.size());
      const size_t w = submitted;
      KVFLOW_RETURN_IF_ERROR(engine
                                 .AddRequest(std::move(prompt), params,
                                             [&, w](const StreamEvent& e) {
                                               if (!e.prompt_logprobs.empty()) logprobs[w] = e.prompt_logprobs;
                                               if (e.finish_reason == FinishReason::kError) errors[w] = e.error;
                                               if (!e.request_finished) return;
                                               ++finished;
                                               if (options.progress) {
                                                 options.progress(static_cast<int64_t>(finished),
                                                                  static_cast<int64_t>(windows.size()));
                                               }
                                             })
                                 .status());
    }
    KVFLOW_RETURN_IF_ERROR(engine.Step().status());
  }
  double nll = 0.0;
  for (size_t w = 0; w < windows.size(); ++w) {
    const PerplexityWindow& win = windows[w];
    KVFLOW_RETURN_IF_ERROR(errors[w]);
    const std::vector<SampledToken>& lp = logprobs[w];
    if (static_cast<int64_t>(lp.size()) != win.end - win.begin - 1) {
      return Status::Internal("window " + std::to_string(w) + " returned " + std::to_string(lp.size()) +
                              " prompt logprobs for " + std::to_string(win.end - win.begin) + " tokens");
    }
    // lp[i] is the logprob of window token i + 1.
    for (int64_t pos = win.score_from; pos < win.end; ++pos) {
      const double token_nll = -lp[static_cast<size_t>(pos - win.begin - 1)].logprob;
      result.window_nll[w] += token_nll;
      if (options.position_chunk > 0) {
        const size_t k = static_cast<size_t>((pos - win.begin) / options.position_chunk);
        if (result.chunk_nll.size() <= k) {
          result.chunk_nll.resize(k + 1, 0.0);
          result.chunk_tokens.resize(k + 1, 0);
        }
        result.chunk_nll[k] += token_nll;
        ++result.chunk_tokens[k];
      }
    }
    nll += result.window_nll[w];
    result.scored_tokens += win.end - win.score_from;
  }
  result.windows = static_cast<int64_t>(windows.size());
  result.mean_nll = nll / static_cast<double>(result.scored_tokens);
  result.perplexity = std::exp(result.mean_nll);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace kvflow
