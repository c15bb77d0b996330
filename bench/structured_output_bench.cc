// Structured output's cost, in one run on one engine: decode tok/s with and without a JSON-schema
// constraint at batch 1 and 32 (the same prompts, the same number of tokens, every sequence alive
// for every timed step, so the batch is the same in both runs), and the time xgrammar takes to
// compile the schema for this tokenizer, first and from the cache. A second, untruncated run checks
// that every constrained output parses and has the schema's required keys.
//
//   kvflow_bench_structured_output --model smollm2-135m --threads 2 --out-dir bench/results
//
// Writes structured_output_<model>.{json,md}.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "bench_files.h"
#include "chat_template/chat_template.h"
#include "kvflow/engine.h"
#include "structured_output/grammar_compiler.h"

namespace {

using Json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// Long enough that no sequence can finish within the timed tokens (at least 40 records), so the
// constrained run keeps the same batch as the free one.
constexpr const char* kTimedSchema = R"({
  "type": "array", "minItems": 40,
  "items": {"type": "object", "properties": {
      "id": {"type": "integer", "minimum": 0},
      "name": {"type": "string", "maxLength": 24},
      "role": {"enum": ["admin", "editor", "viewer"]},
      "active": {"type": "boolean"},
      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["id", "name", "role", "active"], "additionalProperties": false}})";

// A short record, for the check that complete outputs parse and validate.
constexpr const char* kCheckSchema = R"({
  "type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 32}},
  "required": ["name", "age", "city"], "additionalProperties": false})";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct DecodeRun {
  double tok_s = 0.0;
  int64_t steps = 0;
  int64_t tokens = 0;
  std::vector<std::string> texts;
};

// Submits `prompts`, runs the prefill untimed, then times the decode steps in which every sequence
// is alive (all of them, as long as none finishes early).
DecodeRun TimedDecode(kvflow::Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                      const kvflow::SamplingParams& params) {
  DecodeRun r;
  r.texts.resize(prompts.size());
  std::vector<int64_t> generated(prompts.size(), 0);
  std::vector<bool> done(prompts.size(), false);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = engine.AddRequest(prompts[i], params, [&, i](const kvflow::StreamEvent& e) {
      generated[i] += static_cast<int64_t>(e.tokens.size());
      r.texts[i] += e.text_delta;
      if (e.request_finished) done[i] = true;
    });
    if (!id.ok()) {
      spdlog::error("{}", id.status().ToString());
      std::exit(1);
    }
  }
  bool timing = false;
  Clock::time_point start;
  int64_t at_start = 0;
  while (engine.HasUnfinishedRequests()) {
    auto step = engine.Step();
    if (!step.ok()) {
      spdlog::error("{}", step.status().ToString());
      std::exit(1);
    }
    bool all_alive = true;
    for (bool d : done) all_alive &= !d;
    int64_t total = 0;
    for (int64_t g : generated) total += g;
    if (!timing && step->num_prefill_tokens == 0 && all_alive) {
      timing = true;
      start = Clock::now();
      at_start = total;
    } else if (timing && all_alive) {
      r.steps += 1;
      r.tokens = total - at_start;
      r.tok_s = r.tokens / std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Structured output (xgrammar JSON schema) vs free decoding on one engine"};
  std::string model = "smollm2-135m", out_dir = "bench/results";
  int threads = 2, max_tokens = 48, repeats = 5;
  std::vector<int> batches = {1, 32};
  app.add_option("--model", model, "Model path or short name")->default_val(model);
  app.add_option("--threads", threads, "CPU threads")->default_val(threads);
  app.add_option("--max-tokens", max_tokens, "Tokens generated per sequence in the timed runs")->default_val(max_tokens);
  app.add_option("--repeats", repeats, "Timed runs of each kind per batch, interleaved; medians are reported")
      ->default_val(repeats);
  app.add_option("--batches", batches, "Batch sizes, comma-separated")->delimiter(',')->default_str("1,32");
  app.add_option("--out-dir", out_dir)->default_val(out_dir);
  CLI11_PARSE(app, argc, argv);
  if (!kvflow::StructuredOutputAvailable()) {
    std::fprintf(stderr, "%s\n", kvflow::NoXgrammarStatus().ToString().c_str());
    return 77;
  }

  kvflow::EngineConfig config;
  config.model = model;
  config.num_threads = threads;
  config.max_num_seqs = 32;
  config.max_model_len = 1024;
  auto engine_or = kvflow::Engine::Create(config);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    return 1;
  }
  kvflow::Engine& engine = *engine_or.value();
  const kvflow::Tokenizer& tok = engine.tokenizer();

  // Compile time, first and cached, on a compiler of its own (the engine's already holds the schema
  // once a request used it).
  Json compile;
  {
    const auto t0 = Clock::now();
    auto compiler = kvflow::GrammarCompiler::Create(tok, engine.model_config().vocab_size, {tok.eos_id()});
    const auto t1 = Clock::now();
    if (!compiler.ok()) {
      spdlog::error("{}", compiler.status().ToString());
      return 1;
    }
    kvflow::StructuredOutput so{kvflow::StructuredOutput::Kind::kJsonSchema, kTimedSchema};
    const auto t2 = Clock::now();
    if (auto s = compiler.value()->Check(so); !s.ok()) {
      spdlog::error("{}", s.ToString());
      return 1;
    }
    const auto t3 = Clock::now();
    (void)compiler.value()->Check(so);
    const auto t4 = Clock::now();
    auto ms = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    compile = {{"tokenizer_info_ms", ms(t0, t1)}, {"first_compile_ms", ms(t2, t3)}, {"cached_compile_ms", ms(t3, t4)}};
    std::printf("compile: tokenizer info %.1f ms, schema first %.1f ms, cached %.3f ms\n", ms(t0, t1), ms(t2, t3),
                ms(t3, t4));
  }

  auto chat_template = kvflow::ChatTemplate::Create(tok.chat_template(), "", "");
  auto prompt_for = [&](const std::string& user) {
    std::string text = user;
    if (chat_template.ok()) {
      if (auto r = chat_template->Render(kvflow::ChatTemplateInput::User(user)); r.ok()) text = r.value();
    }
    return tok.Encode(text, tok.add_bos());
  };
  const char* topics[] = {"a software team", "a hospital ward", "a football club", "a school class", "a band",
                          "a research lab", "a restaurant", "a newsroom"};
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 32; ++i) {
    prompts.push_back(prompt_for(std::string("List the members of ") + topics[i % 8] + " number " + std::to_string(i) +
                                 " as JSON records with id, name, role and whether they are active."));
  }

  kvflow::SamplingParams free_params;
  free_params.temperature = 0.0f;
  free_params.max_tokens = max_tokens;
  free_params.ignore_eos = true;
  kvflow::SamplingParams constrained = free_params;
  constrained.structured_output = kvflow::StructuredOutput{kvflow::StructuredOutput::Kind::kJsonSchema, kTimedSchema};

  Json rows = Json::array();
  std::string table = "| batch | free tok/s | JSON-schema tok/s | slowdown | timed steps |\n|---:|---:|---:|---:|---:|\n";
  (void)TimedDecode(engine, {prompts[0]}, free_params);  // warm-up: page faults, threads, the grammar cache
  (void)TimedDecode(engine, {prompts[0]}, constrained);
  for (int batch : batches) {
    std::vector<std::vector<int32_t>> batch_prompts(prompts.begin(), prompts.begin() + std::min<size_t>(batch, prompts.size()));
    // Free and constrained runs interleaved, so that a slow spell of this shared machine hits both.
    std::vector<double> free_rates, constrained_rates;
    DecodeRun a, b;
    for (int rep = 0; rep < repeats; ++rep) {
      a = TimedDecode(engine, batch_prompts, free_params);
      b = TimedDecode(engine, batch_prompts, constrained);
      free_rates.push_back(a.tok_s);
      constrained_rates.push_back(b.tok_s);
    }
    a.tok_s = Median(free_rates);
    b.tok_s = Median(constrained_rates);
    const double slowdown = 1.0 - b.tok_s / std::max(1e-9, a.tok_s);
    char row[256];
    std::snprintf(row, sizeof row, "| %d | %.1f | %.1f | %.1f%% | %lld / %lld |\n", batch, a.tok_s, b.tok_s, 100 * slowdown,
                  static_cast<long long>(a.steps), static_cast<long long>(b.steps));
    std::fputs(row, stdout);
    std::fflush(stdout);
    table += row;
    rows.push_back({{"batch", batch}, {"free_decode_tok_s", a.tok_s}, {"constrained_decode_tok_s", b.tok_s},
                    {"slowdown", slowdown}, {"free_runs_tok_s", free_rates},
                    {"constrained_runs_tok_s", constrained_rates}, {"free_timed_steps", a.steps}, {"constrained_timed_steps", b.steps},
                    {"free_timed_tokens", a.tokens}, {"constrained_timed_tokens", b.tokens},
                    {"sample_constrained_output", b.texts.front().substr(0, 200)}});
  }

  // Complete constrained outputs: each must parse and carry the required keys.
  kvflow::SamplingParams check = free_params;
  check.ignore_eos = false;
  check.max_tokens = 200;
  check.structured_output = kvflow::StructuredOutput{kvflow::StructuredOutput::Kind::kJsonSchema, kCheckSchema};
  std::vector<std::vector<int32_t>> check_prompts;
  for (int i = 0; i < 8; ++i) check_prompts.push_back(prompt_for("Describe a person from " + std::string(topics[i]) + " as JSON."));
  const DecodeRun c = TimedDecode(engine, check_prompts, check);
  int valid = 0;
  for (const std::string& text : c.texts) {
    Json j = Json::parse(text, nullptr, false);
    valid += !j.is_discarded() && j.is_object() && j.contains("name") && j["name"].is_string() && j.contains("age") &&
             j["age"].is_number_integer() && j.contains("city") && j["city"].is_string();
  }
  std::printf("complete outputs valid against the schema: %d / %zu (e.g. %s)\n", valid, c.texts.size(),
              c.texts.front().c_str());

  std::filesystem::create_directories(out_dir);
  const std::string stem = out_dir + "/structured_output_" + std::filesystem::path(model).stem().string();
  Json doc = {{"benchmark", "decode with a JSON-schema constraint (xgrammar) vs free decoding, greedy, one engine"},
              {"model", model},
              {"engine", engine.Describe()},
              {"threads", threads},
              {"max_tokens", max_tokens},
              {"repeats", repeats},
              {"schema", Json::parse(kTimedSchema)},
              {"compile", compile},
              {"results", rows},
              {"complete_outputs_valid", valid},
              {"complete_outputs", c.texts.size()},
              {"provenance", kvflow::bench::Provenance(argc, argv)}};
  std::ofstream(stem + ".json") << doc.dump(1) << "\n";
  std::ofstream(stem + ".md") << "# Structured output: JSON-schema constrained vs free decoding, " << model << ", "
                              << threads << " threads, greedy\n\nMeasured in one run on one engine ("
                              << engine.Describe() << "). Decode tok/s over the steps in which every sequence of the "
                              << "batch is alive (" << max_tokens << " tokens each; the schema needs at least 40 records, "
                              << "so no constrained sequence ends early); medians of " << repeats
                              << " interleaved runs of each kind.\n\n" << table
                              << "\nSchema compile time for this tokenizer (xgrammar 0.2.8): first "
                              << compile["first_compile_ms"].get<double>() << " ms, from the cache "
                              << compile["cached_compile_ms"].get<double>() << " ms (tokenizer info "
                              << compile["tokenizer_info_ms"].get<double>() << " ms, once per engine).\n\n"
                              << "Complete constrained outputs (a 3-field record schema, up to 200 tokens): " << valid
                              << " / " << c.texts.size() << " parse and have the required keys and types.\n";
  std::printf("wrote %s.{json,md}\n", stem.c_str());
  return 0;
}
