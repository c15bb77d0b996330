// Speculative decoding (n-gram drafts) against plain decoding on the same engine and prompts, in
// one run: decode tok/s, acceptance rate, mean accepted length and acceptance by draft position,
// on a repetitive task (the chat model asked to rewrite WikiText-2 passages) and on Alpaca
// instructions, at batch 1 and batch 8. Greedy, so both runs must produce the same tokens (checked).
//
//   kvflow_bench_spec --model smollm2-135m --threads 2 --out-dir bench/results
//
// Writes spec_decode_<model>.{json,md}.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "chat_template/chat_template.h"
#include "bench_files.h"
#include "kvflow/engine.h"
#include "util/alpaca.h"

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

using kvflow::bench::ReadFile;

// WikiText-2 paragraphs of 400..900 characters (the body lines of articles).
std::vector<std::string> Passages(const std::string& path, size_t count) {
  std::vector<std::string> out;
  std::istringstream in(ReadFile(path));
  for (std::string line; std::getline(in, line) && out.size() < count;) {
    if (line.size() >= 400 && line.size() <= 900 && line.find(" = ") == std::string::npos) out.push_back(line);
  }
  return out;
}

std::vector<std::string> AlpacaInstructions(const std::string& path, size_t count) {
  const Json data = Json::parse(ReadFile(path));
  std::vector<std::string> out;
  for (size_t i = 0; i < data.size() && out.size() < count; i += 37) {  // a fixed spread over the set
    out.push_back(kvflow::AlpacaPrompt(data[i].value("instruction", ""), data[i].value("input", "")));
  }
  return out;
}

struct RunResult {
  double decode_tok_s = 0.0;
  double seconds = 0.0;
  int64_t generated = 0;
  std::vector<std::vector<int32_t>> tokens;
  kvflow::SpecDecodeStats spec;
};

// Runs `prompts` `batch` at a time to completion; decode rate = generated tokens / wall time of
// the steps after each batch's prefill.
RunResult Run(kvflow::Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int batch,
              const kvflow::SamplingParams& params) {
  RunResult r;
  r.tokens.resize(prompts.size());
  const kvflow::SpecDecodeStats before = engine.stats().spec;
  double decode_s = 0.0;
  int64_t decode_tokens = 0;
  const auto start = Clock::now();
  for (size_t first = 0; first < prompts.size(); first += static_cast<size_t>(batch)) {
    const size_t last = std::min(prompts.size(), first + static_cast<size_t>(batch));
    for (size_t i = first; i < last; ++i) {
      (void)engine.AddRequest(prompts[i], params, [&r, i](const kvflow::StreamEvent& e) {
        for (const auto& t : e.tokens) r.tokens[i].push_back(t.token);
      });
    }
    bool prefilled = false;
    Clock::time_point decode_start;
    int64_t at_decode_start = 0;
    while (engine.HasUnfinishedRequests()) {
      auto step = engine.Step();
      if (!step.ok()) {
        spdlog::error("{}", step.status().ToString());
        break;
      }
      if (!prefilled && step->num_prefill_tokens == 0) {
        prefilled = true;
        decode_start = Clock::now();
        at_decode_start = 0;
        for (size_t i = first; i < last; ++i) at_decode_start += static_cast<int64_t>(r.tokens[i].size());
      }
    }
    if (prefilled) {
      decode_s += std::chrono::duration<double>(Clock::now() - decode_start).count();
      for (size_t i = first; i < last; ++i) decode_tokens += static_cast<int64_t>(r.tokens[i].size());
      decode_tokens -= at_decode_start;
    }
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (const auto& t : r.tokens) r.generated += static_cast<int64_t>(t.size());
  r.decode_tok_s = decode_s > 0 ? decode_tokens / decode_s : 0.0;
  const kvflow::SpecDecodeStats after = engine.stats().spec;
  r.spec.num_drafts = after.num_drafts - before.num_drafts;
  r.spec.num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens;
  r.spec.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens;
  r.spec.accepted_per_position = after.accepted_per_position;
  for (size_t i = 0; i < before.accepted_per_position.size() && i < r.spec.accepted_per_position.size(); ++i) {
    r.spec.accepted_per_position[i] -= before.accepted_per_position[i];
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Speculative decoding (n-gram) vs plain decoding on one engine"};
  std::string model = "smollm2-135m", out_dir = "bench/results", shared = std::string(KVFLOW_SOURCE_DIR) + "/../shared";
  int threads = 2, max_tokens = 128, num_prompts = 8, k = 4, ngram_max = 4, ngram_min = 1;
  app.add_option("--model", model, "Model path or short name")->default_val(model);
  app.add_option("--threads", threads, "CPU threads")->default_val(threads);
  app.add_option("--max-tokens", max_tokens, "Tokens generated per prompt")->default_val(max_tokens);
  app.add_option("--num-prompts", num_prompts, "Prompts per task")->default_val(num_prompts);
  app.add_option("--num-speculative-tokens", k, "Drafts per step")->default_val(k);
  app.add_option("--ngram-max", ngram_max)->default_val(ngram_max);
  app.add_option("--ngram-min", ngram_min)->default_val(ngram_min);
  app.add_option("--shared", shared, "The shared/ folder with datasets/")->default_val(shared);
  app.add_option("--out-dir", out_dir)->default_val(out_dir);
  CLI11_PARSE(app, argc, argv);

  const std::string wiki = shared + "/datasets/wikitext-2/test.txt";
  const std::string alpaca = shared + "/datasets/alpaca/alpaca_5000.json";
  if (!std::filesystem::exists(wiki) || !std::filesystem::exists(alpaca)) {
    std::fprintf(stderr, "skipping: the datasets are not under %s\n", shared.c_str());
    return 77;
  }
  kvflow::EngineConfig base;
  base.model = model;
  base.num_threads = threads;
  base.max_num_seqs = 8;
  base.max_model_len = 2048;
  kvflow::EngineConfig spec_config = base;
  spec_config.speculative.method = "ngram";
  spec_config.speculative.num_tokens = k;
  spec_config.speculative.ngram.max = ngram_max;
  spec_config.speculative.ngram.min = ngram_min;
  auto plain = kvflow::Engine::Create(base);
  auto spec = kvflow::Engine::Create(spec_config);
  if (!plain.ok() || !spec.ok()) {
    spdlog::error("{}", (plain.ok() ? spec.status() : plain.status()).ToString());
    return 1;
  }
  const kvflow::Tokenizer& tok = plain.value()->tokenizer();
  // The model's own template, without a BOS text (Encode adds the tokenizer's).
  auto chat_template = kvflow::ChatTemplate::Create(tok.chat_template(), "", "");
  auto chat = [&](const std::string& user) {
    if (!chat_template.ok()) return user;
    auto prompt = chat_template->Render(kvflow::ChatTemplateInput::User(user));
    return prompt.ok() ? prompt.value() : user;
  };
  struct Task {
    std::string name;
    std::vector<std::vector<int32_t>> prompts;
  };
  std::vector<Task> tasks(2);
  tasks[0].name = "rewrite WikiText-2 passages";
  for (const std::string& p : Passages(wiki, static_cast<size_t>(num_prompts))) {
    tasks[0].prompts.push_back(tok.Encode(chat("Rewrite the following text, keeping its wording:\n\n" + p), tok.add_bos()));
  }
  tasks[1].name = "Alpaca instructions";
  for (const std::string& p : AlpacaInstructions(alpaca, static_cast<size_t>(num_prompts))) {
    tasks[1].prompts.push_back(tok.Encode(chat(p), tok.add_bos()));
  }
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = max_tokens;

  Json results = Json::array();
  std::string table =
      "| task | batch | plain tok/s | speculative tok/s | speed-up | acceptance | mean accepted length | "
      "accepted by position | same tokens |\n|---|---:|---:|---:|---:|---:|---:|---|---|\n";
  for (const Task& task : tasks) {
    for (int batch : {1, 8}) {
      // Warm-up keeps the first measured run from paying for page faults and thread start-up.
      (void)Run(*plain.value(), {task.prompts.front()}, 1, params);
      const RunResult a = Run(*plain.value(), task.prompts, batch, params);
      const RunResult b = Run(*spec.value(), task.prompts, batch, params);
      const double acceptance = b.spec.num_draft_tokens ? double(b.spec.num_accepted_tokens) / b.spec.num_draft_tokens : 0.0;
      const double mean_len = b.spec.num_drafts ? 1.0 + double(b.spec.num_accepted_tokens) / b.spec.num_drafts : 1.0;
      std::string positions;
      for (size_t i = 0; i < b.spec.accepted_per_position.size(); ++i) {
        positions += (i ? " / " : "") + std::to_string(b.spec.num_drafts ? 100 * b.spec.accepted_per_position[i] / b.spec.num_drafts : 0) + "%";
      }
      const bool same = a.tokens == b.tokens;
      char row[512];
      std::snprintf(row, sizeof row, "| %s | %d | %.1f | %.1f | %.2fx | %.1f%% | %.2f | %s | %s |\n", task.name.c_str(), batch,
                    a.decode_tok_s, b.decode_tok_s, b.decode_tok_s / std::max(1e-9, a.decode_tok_s), 100 * acceptance,
                    mean_len, positions.c_str(), same ? "yes" : "NO");
      table += row;
      std::fputs(row, stdout);
      std::fflush(stdout);
      results.push_back({{"task", task.name}, {"batch", batch}, {"prompts", task.prompts.size()},
                         {"plain_decode_tok_s", a.decode_tok_s}, {"spec_decode_tok_s", b.decode_tok_s},
                         {"speedup", b.decode_tok_s / std::max(1e-9, a.decode_tok_s)}, {"plain_seconds", a.seconds},
                         {"spec_seconds", b.seconds}, {"generated_tokens", b.generated},
                         {"num_drafts", b.spec.num_drafts}, {"num_draft_tokens", b.spec.num_draft_tokens},
                         {"num_accepted_tokens", b.spec.num_accepted_tokens}, {"acceptance_rate", acceptance},
                         {"mean_accepted_length", mean_len},
                         {"accepted_per_position", b.spec.accepted_per_position}, {"identical_tokens", same}});
    }
  }
  std::filesystem::create_directories(out_dir);
  const std::string stem = out_dir + "/spec_decode_" + std::filesystem::path(model).stem().string();
  Json doc = {{"benchmark", "speculative decoding (ngram) vs plain, greedy, one engine each, same prompts"},
              {"model", model},
              {"engine", spec.value()->Describe()},
              {"threads", threads},
              {"max_tokens", max_tokens},
              {"num_speculative_tokens", k},
              {"ngram_max", ngram_max},
              {"ngram_min", ngram_min},
              {"results", results},
              {"provenance", kvflow::bench::Provenance(argc, argv)}};
  std::ofstream(stem + ".json") << doc.dump(1) << "\n";
  std::ofstream(stem + ".md") << "# Speculative decoding (n-gram, k = " << k << ") vs plain decoding, " << model
                              << ", " << threads << " threads, greedy, " << max_tokens
                              << " tokens per prompt\n\nDecode tok/s measured after each batch's prefill, one run "
                                 "each on the same prompts (" << spec.value()->Describe() << ").\n\n"
                              << table;
  std::printf("wrote %s.{json,md}\n", stem.c_str());
  return 0;
}
