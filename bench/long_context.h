// What the long-context benchmarks (triforce_bench.cc, kv_selection_bench.cc) share: WikiText-2
// prompts of a given length, the pass-key retrieval prompt, one request timed step by step, and
// the machine facts every result file records.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_files.h"
#include "kvflow/engine.h"

namespace kvflow::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}


inline std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

inline std::string LoadAverage() {
  std::string s = ReadFile("/proc/loadavg");
  std::istringstream in(s);
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

inline std::string NowIso() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

inline std::string CommandLine(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    const bool quote = a.empty() || a.find_first_of(" \t\"'$*?;&|<>()") != std::string::npos;
    if (i) out += ' ';
    out += quote ? "'" + a + "'" : a;
  }
  return out;
}

// WikiText-2 articles: a top-level heading line " = Title = " starts one (" = = Section = = " does not).
inline std::vector<std::string> Articles(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const bool heading = line.size() > 4 && line.rfind(" = ", 0) == 0 && line.compare(0, 5, " = = ") != 0;
    if (heading || out.empty()) out.emplace_back();
    out.back() += line;
    out.back() += '\n';
  }
  return out;
}

// `n` tokens of WikiText: articles concatenated from article `first` on (wrapping around).
inline std::vector<int32_t> WikiPrompt(const kvflow::Tokenizer& tok, const std::vector<std::string>& articles, size_t first,
                                int n) {
  std::string text;
  // ~4.5 characters per token in WikiText; take plenty, then cut in tokens.
  for (size_t i = 0; text.size() < static_cast<size_t>(n) * 8 && i < articles.size(); ++i) {
    text += articles[(first + i) % articles.size()];
  }
  std::vector<int32_t> ids = tok.Encode(text, tok.add_bos());
  if (static_cast<int>(ids.size()) > n) ids.resize(static_cast<size_t>(n));
  return ids;
}


// The pass-key retrieval prompt (Mohtashami & Jaggi 2023; TriForce and LongLoRA use it): a task
// line, filler sentences with the key sentence at `depth` (0 = start, 1 = end), the question.
// Filler repetitions are adjusted until the prompt is at most `target` tokens (and as close as a
// whole filler allows).
struct Passkey {
  std::vector<int32_t> ids;
  std::string key;
  int fillers = 0;
};

inline Passkey PasskeyPrompt(const kvflow::Tokenizer& tok, int target, double depth, uint32_t seed) {
  const std::string head =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
      "you about the important information there.";
  const std::string filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  const std::string question = " What is the pass key? The pass key is";
  std::mt19937 rng(seed);
  Passkey p;
  p.key = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
  const std::string needle = " The pass key is " + p.key + ". Remember it. " + p.key + " is the pass key.";
  auto build = [&](int n) {
    const int before = static_cast<int>(n * depth + 0.5);
    std::string text = head;
    for (int i = 0; i < before; ++i) text += filler;
    text += needle;
    for (int i = before; i < n; ++i) text += filler;
    text += question;
    return tok.Encode(text, tok.add_bos());
  };
  const int per_filler = std::max<int>(1, static_cast<int>(tok.Encode(filler, false).size()));
  const int fixed = static_cast<int>(build(0).size());
  int n = std::max(0, (target - fixed) / per_filler);
  std::vector<int32_t> ids = build(n);
  while (static_cast<int>(ids.size()) > target && n > 0) ids = build(--n);
  while (true) {  // grow while one more filler still fits
    std::vector<int32_t> more = build(n + 1);
    if (static_cast<int>(more.size()) > target) break;
    ids = std::move(more);
    ++n;
  }
  p.ids = std::move(ids);
  p.fillers = n;
  return p;
}


// One request through an otherwise idle engine. The steps that prefill the prompt (the last one
// samples the first token) are prefill; the steps after it are decode, timed one by one.
struct TimedRun {
  std::vector<int32_t> tokens;  // every generated token
  int prompt_tokens = 0;
  int64_t decode_tokens = 0;  // tokens generated by decode steps (all but the prefill's)
  int64_t decode_steps = 0;   // = full-cache passes of the sequence
  double prefill_s = 0.0;
  double decode_s = 0.0;
  kvflow::KvOffloadStats decode_offload;  // what the decode steps moved (--kv-offload)
  std::string error;
};

// Runs `prompts` as one batch to completion, timing each engine step: prefill = the steps until
// every sequence has its first token, decode = the rest (a batch decodes together). `tokens` are the
// first prompt's.
inline TimedRun RunTimedBatch(kvflow::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                              const kvflow::SamplingParams& params) {
  TimedRun r;
  r.prompt_tokens = prompts.empty() ? 0 : static_cast<int>(prompts[0].size());
  if (engine.HasUnfinishedRequests()) {
    r.error = "engine not idle";
    return r;
  }
  std::string stream_error;
  std::vector<int64_t> produced(prompts.size(), 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = engine.AddRequest(prompts[i], params, [&, i](const kvflow::StreamEvent& e) {
      produced[i] += static_cast<int64_t>(e.tokens.size());
      if (i == 0) {
        for (const auto& t : e.tokens) r.tokens.push_back(t.token);
      }
      if (e.finish_reason == kvflow::FinishReason::kError) stream_error = e.error.ToString();
    });
    if (!id.ok()) {
      r.error = id.status().ToString();
      while (engine.HasUnfinishedRequests() && engine.Step().ok()) {
      }
      return r;
    }
  }
  auto total = [&] {
    int64_t n = 0;
    for (int64_t p : produced) n += p;
    return n;
  };
  auto all_started = [&] { return std::all_of(produced.begin(), produced.end(), [](int64_t p) { return p > 0; }); };
  bool decoding = false;
  while (engine.HasUnfinishedRequests()) {
    const int64_t had = total();
    const auto t0 = std::chrono::steady_clock::now();
    auto step = engine.Step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!step.ok()) {
      r.error = step.status().ToString();
      break;
    }
    if (step->num_seqs == 0 && step->num_steps_completed == 0) {
      r.error = "the engine made no progress (KV cache too small?)";
      break;
    }
    // Prefill = the steps up to and including the one that sampled every sequence's first token.
    // (Not StepResult::num_prefill_tokens: the engine counts a speculative verification step, which
    // carries several tokens, as prefill too.)
    if (!decoding) {
      r.prefill_s += s;
      if (all_started()) {
        decoding = true;
        r.decode_offload.Add(engine.stats().kv_offload, -1);  // decode starts here
      }
    } else {
      r.decode_s += s;
      ++r.decode_steps;
      r.decode_tokens += total() - had;
    }
  }
  if (r.error.empty() && !stream_error.empty()) r.error = stream_error;
  if (decoding) r.decode_offload.Add(engine.stats().kv_offload);
  return r;
}

inline TimedRun RunTimed(kvflow::Engine& engine, const std::vector<int32_t>& prompt, const kvflow::SamplingParams& params) {
  return RunTimedBatch(engine, {prompt}, params);
}

// One engine per mode, created once and reused for every context: `configure` sets the mode's
// options on a copy of `base` (false: an unknown mode), `describe` gives the mode's entry in the
// result file's "engines" (with the engine's Describe() added). Each engine is announced on stderr.
// Returns 0, or the exit code after the error is printed (2: unknown mode, 1: the engine failed).
using ModeEngines = std::map<std::string, std::unique_ptr<kvflow::Engine>>;

inline int CreateModeEngines(const std::vector<std::string>& modes, const kvflow::EngineConfig& base,
                             const std::function<bool(const std::string& mode, kvflow::EngineConfig& c)>& configure,
                             const std::function<nlohmann::json(const kvflow::EngineConfig& c)>& describe,
                             ModeEngines& engines, nlohmann::json& engine_json) {
  for (const std::string& mode : modes) {
    kvflow::EngineConfig c = base;
    if (!configure(mode, c)) {
      std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
      return 2;
    }
    auto engine = kvflow::Engine::Create(c);
    if (!engine.ok()) {
      std::fprintf(stderr, "mode %s: %s\n", mode.c_str(), engine.status().ToString().c_str());
      return 1;
    }
    engine_json[mode] = describe(c);
    engine_json[mode]["describe"] = engine.value()->Describe();
    std::fprintf(stderr, "[engine] %s: %s\n", mode.c_str(), engine.value()->Describe().c_str());
    engines[mode] = std::move(engine.value());
  }
  return 0;
}

}  // namespace kvflow::bench
