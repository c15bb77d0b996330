// KV selection at long contexts, on one engine build, in one run: full attention against
// InfiniGen's speculated tokens, H2O's heavy hitters and a 4-bit KV cache, one sequence at a time
// or --batches of them decoding together.
//
//   kvflow_bench_kv_selection --model smollm2-135m --contexts 2048,4096,8192 --threads 2 \
//       --json bench/results/kv_selection_speed.json --md bench/results/kv_selection_speed.md
//
// Per context C and mode:
//   - decode speed: a WikiText-2 prompt of C - new_tokens - 8 tokens (articles concatenated), then
//     --new-tokens greedy tokens; only the decode steps are timed (as `kvflow bench`), median over
//     --repeats with the modes interleaved; with the KV-read counters of those steps (what fraction
//     of the cache attention read, bytes per token);
//   - the pass-key prompt (~C - 32 tokens, key at --passkey-depth): whether the greedy answer holds
//     the key. The prompt is prefilled with full attention in every mode; selection acts while the
//     answer is decoded (InfiniGen as in the paper; H2O keeps its budget from the first decode step).
// Modes: full (the baseline), infinigen (--kv-selection infinigen, the model's skewing file from
// `kvflow skew`), h2o (--h2o-budget of the context), int4 (kv_cache_dtype q4: 4-bit group-quantized
// K/V, every token read); and with the KV pool offloaded (--kv-offload), offload-full (FlexGen:
// every layer fetches every cached token), offload-infinigen and offload-h2o, with the bytes each
// decode token fetched from the host pool. On a CPU the host pool and the staging buffers are the
// same RAM: the offload modes measure the mechanism's cost here, not a PCIe link.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "bench_files.h"
#include "long_context.h"

namespace {

using Json = nlohmann::json;
namespace kb = kvflow::bench;

// "min-max" of a list of runs.
std::string Range(const std::vector<double>& v, const char* format) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return fmt::format(fmt::runtime(format), *lo) + "-" + fmt::format(fmt::runtime(format), *hi);
}

// Whether two sets of runs overlap ([min, max] ranges intersect).
bool Overlap(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.empty() || b.empty()) return false;
  return *std::min_element(a.begin(), a.end()) <= *std::max_element(b.begin(), b.end()) &&
         *std::min_element(b.begin(), b.end()) <= *std::max_element(a.begin(), a.end());
}

kvflow::KvSelectionStats Minus(kvflow::KvSelectionStats a, const kvflow::KvSelectionStats& b) {
  a.Add(b, -1);
  return a;
}

Json OffloadJson(const kvflow::KvOffloadStats& o, int64_t decode_tokens) {
  return {{"prefetches", o.prefetches},
          {"on_demand_fetches", o.on_demand_fetches},
          {"bytes_fetched", o.bytes_fetched},
          {"bytes_written", o.bytes_written},
          {"fetch_seconds", o.fetch_seconds},
          {"bytes_fetched_per_token", decode_tokens > 0 ? static_cast<double>(o.bytes_fetched) / decode_tokens : 0.0}};
}

Json SelectionJson(const kvflow::KvSelectionStats& s) {
  return {{"decode_tokens", s.decode_tokens},
          {"layer_reads_selected", s.layer_reads_selected},
          {"layer_reads_full", s.layer_reads_full},
          {"tokens_selected", s.tokens_selected},
          {"tokens_available", s.tokens_available},
          {"selection_fraction", s.selection_fraction()},
          {"bytes_read", s.bytes_read},
          {"bytes_full", s.bytes_full},
          {"bytes_read_fraction", s.bytes_full > 0 ? static_cast<double>(s.bytes_read) / static_cast<double>(s.bytes_full) : 0.0},
          {"select_seconds", s.select_seconds}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"KV selection at long contexts: decode speed and pass-key retrieval of full attention, InfiniGen, H2O "
               "and a 4-bit KV cache, one sequence at a time. Writes JSON (--json) and Markdown (--md)."};
  std::string model = "smollm2-135m", device = "cpu";
  std::string wikitext = std::string(KVFLOW_SOURCE_DIR) + "/../shared/datasets/wikitext-2/test.txt";
  std::string contexts_arg = "2048,4096,8192", modes_arg = "full,infinigen,h2o,int4", json_path, md_path;
  std::string skew_file, speculate_from = "after-attention", speculate_on = "auto", batches_arg = "1", passkey = "on";
  kvflow::InfiniGenOptions rule;  // the count rule, sinks and recent window (defaults: the engine's)
  int new_tokens = 64, threads = 2, repeats = 3, passkey_tokens = 16, max_model_len = 8192;
  double alpha = 5.0, max_fraction = 0.2, h2o_budget = 0.2, passkey_depth = 0.5;
  app.add_option("--model", model, "Model path or short name")->capture_default_str();
  app.add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--contexts", contexts_arg, "Comma-separated context lengths")->capture_default_str();
  app.add_option("--modes", modes_arg,
                 "Comma-separated: full, infinigen, h2o, int4, offload-full, offload-infinigen, offload-h2o")
      ->capture_default_str();
  app.add_option("--new-tokens", new_tokens, "Decode steps timed per context")->capture_default_str();
  app.add_option("--repeats", repeats, "Timed repeats (modes interleaved); medians are reported")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads")->capture_default_str();
  app.add_option("--infinigen-alpha", alpha, "InfiniGen alpha")->capture_default_str();
  app.add_option("--infinigen-max-fraction", max_fraction, "InfiniGen cap")->capture_default_str();
  app.add_option("--infinigen-speculate-from", speculate_from, "after-attention or layer-input")->capture_default_str();
  app.add_option("--infinigen-skew-file", skew_file, "Skewing file (default: <model>.infinigen)");
  app.add_option("--infinigen-speculate-on", speculate_on, "auto, device or host")->capture_default_str();
  app.add_option("--infinigen-count-rule", rule.count_rule,
                 "query-heads or kv-head-max (the device's kernels run kv-head-max without sinks or recent tokens)")
      ->capture_default_str();
  app.add_option("--infinigen-sink-tokens", rule.sink_tokens, "InfiniGen: first tokens every read takes")->capture_default_str();
  app.add_option("--infinigen-recent-tokens", rule.recent_tokens, "InfiniGen: latest tokens every read takes")
      ->capture_default_str();
  app.add_option("--batches", batches_arg,
                 "Comma-separated batch sizes: that many WikiText-2 prompts of the context decode together")
      ->capture_default_str();
  app.add_option("--passkey", passkey, "on: also answer a pass-key prompt per context and mode (batch 1); off: speed only")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--h2o-budget", h2o_budget, "H2O's kept fraction of the context")->capture_default_str();
  app.add_option("--passkey-tokens", passkey_tokens, "Greedy tokens of the pass-key answer")->capture_default_str();
  app.add_option("--passkey-depth", passkey_depth, "Where the key sits (0 start .. 1 end)")->capture_default_str();
  app.add_option("--max-model-len", max_model_len, "Engine max_model_len")->capture_default_str();
  app.add_option("--wikitext", wikitext, "WikiText-2 test.txt")->capture_default_str();
  app.add_option("--json", json_path, "Write the results as JSON here");
  app.add_option("--md", md_path, "Write a Markdown table here");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow_bench_kv_selection"));

  std::vector<int> contexts;
  for (const std::string& c : kb::SplitCommaList(contexts_arg)) contexts.push_back(std::stoi(c));
  const std::vector<std::string> modes = kb::SplitCommaList(modes_arg);
  std::vector<int> batches;
  for (const std::string& b : kb::SplitCommaList(batches_arg)) batches.push_back(std::stoi(b));
  if (batches.empty() || *std::min_element(batches.begin(), batches.end()) < 1) {
    std::fprintf(stderr, "--batches: sizes >= 1\n");
    return 2;
  }
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  for (int c : contexts) {
    if (c > max_model_len || c - new_tokens - 8 < 64) {
      std::fprintf(stderr, "context %d: must be <= --max-model-len %d and leave room for --new-tokens\n", c, max_model_len);
      return 2;
    }
  }
  if (!std::filesystem::exists(wikitext)) {
    std::fprintf(stderr, "WikiText-2 not found at %s (--wikitext)\n", wikitext.c_str());
    return 77;
  }
  const std::string load_start = kb::LoadAverage();
  kvflow::EngineConfig base;
  base.model = model;
  base.device = device;
  base.num_threads = threads;
  base.max_model_len = max_model_len;
  base.max_num_seqs = max_batch;
  base.num_kv_blocks = max_batch * ((max_model_len + base.block_size - 1) / base.block_size) + 32;
  kb::ModeEngines engines;
  Json engine_json = Json::object();
  const int created = kb::CreateModeEngines(
      modes, base,
      [&](const std::string& mode, kvflow::EngineConfig& c) {
        const bool offload = mode.rfind("offload-", 0) == 0;
        const std::string method = offload ? mode.substr(8) : mode;
        c.kv_offload.enabled = offload;
        if (method == "infinigen") {
          c.kv_selection.method = "infinigen";
          c.kv_selection.infinigen.alpha = alpha;
          c.kv_selection.infinigen.max_fraction = max_fraction;
          c.kv_selection.infinigen.speculate_from = speculate_from;
          c.kv_selection.infinigen.speculate_on = speculate_on;
          c.kv_selection.infinigen.skew_file = skew_file;
          c.kv_selection.infinigen.count_rule = rule.count_rule;
          c.kv_selection.infinigen.sink_tokens = rule.sink_tokens;
          c.kv_selection.infinigen.recent_tokens = rule.recent_tokens;
        } else if (method == "h2o") {
          c.kv_selection.method = "h2o";
          c.kv_selection.h2o.budget = h2o_budget;
        } else if (method == "int4" && !offload) {
          c.kv_cache_dtype = "q4";
        } else if (method != "full") {
          return false;
        }
        return true;
      },
      [](const kvflow::EngineConfig& c) {
        return Json{{"kv_selection", c.kv_selection.method},
                    {"kv_cache_dtype", c.kv_cache_dtype},
                    {"kv_offload", c.kv_offload.enabled},
                    {"infinigen_alpha", c.kv_selection.infinigen.alpha},
                    {"infinigen_max_fraction", c.kv_selection.infinigen.max_fraction},
                    {"infinigen_speculate_from", c.kv_selection.infinigen.speculate_from},
                    {"infinigen_speculate_on", c.kv_selection.infinigen.speculate_on},
                    {"infinigen_count_rule", c.kv_selection.infinigen.count_rule},
                    {"infinigen_sink_tokens", c.kv_selection.infinigen.sink_tokens},
                    {"infinigen_recent_tokens", c.kv_selection.infinigen.recent_tokens},
                    {"h2o_budget", c.kv_selection.h2o.budget}};
      },
      engines, engine_json);
  if (created != 0) return created;
  const kvflow::Tokenizer& tok = engines.begin()->second->tokenizer();
  const std::vector<std::string> articles = kb::Articles(kb::ReadFile(wikitext));
  kvflow::SamplingParams params;
  params.temperature = 0.0f;
  params.max_tokens = new_tokens;
  params.ignore_eos = true;
  kvflow::SamplingParams key_params = params;
  key_params.max_tokens = passkey_tokens;

  {  // warm-up: threads, page faults, first allocations
    const std::vector<int32_t> warm = kb::WikiPrompt(tok, articles, 0, 256);
    kvflow::SamplingParams p = params;
    p.max_tokens = 8;
    for (const std::string& mode : modes) kb::RunTimed(*engines[mode], warm, p);
  }

  Json rows = Json::array();
  std::string table =
      "| context | batch | mode | decode tok/s | ms/step | vs full | KV read (selected layers) | KV bytes read (all layers) | "
      "fetched from host / token | pass key |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n";
  for (int context : contexts) {
   for (int batch : batches) {
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < batch; ++i) {
      prompts.push_back(kb::WikiPrompt(tok, articles, static_cast<size_t>(i) * 7, context - new_tokens - 8));
    }
    const bool answer_key = passkey == "on" && batch == 1;
    const kb::Passkey key = kb::PasskeyPrompt(tok, context - 32, passkey_depth, static_cast<uint32_t>(context));
    std::map<std::string, std::vector<double>> tps;
    std::map<std::string, kvflow::KvSelectionStats> selection;
    std::map<std::string, kb::TimedRun> first_run;
    std::map<std::string, std::string> errors;
    for (int rep = 0; rep < repeats; ++rep) {
      for (const std::string& mode : modes) {
        kvflow::Engine& e = *engines[mode];
        const kvflow::KvSelectionStats before = e.stats().kv_selection;
        const kb::TimedRun r = kb::RunTimedBatch(e, prompts, params);
        if (!r.error.empty()) errors[mode] = r.error;
        tps[mode].push_back(r.decode_s > 0 ? static_cast<double>(r.decode_tokens) / r.decode_s : 0.0);
        if (rep == 0) {
          selection[mode] = Minus(e.stats().kv_selection, before);
          first_run[mode] = r;
        }
        std::fprintf(stderr, "ctx %d batch %d %-9s rep %d: %.1f tok/s%s%s\n", context, batch, mode.c_str(), rep,
                     tps[mode].back(),
                     r.error.empty() ? "" : " error: ", r.error.c_str());
      }
    }
    const double full_tps = tps.count("full") ? kb::Median(tps["full"]) : 0.0;
    const std::vector<double> full_runs = tps.count("full") ? tps["full"] : std::vector<double>();
    for (const std::string& mode : modes) {
      kvflow::Engine& e = *engines[mode];
      const kvflow::KvSelectionStats before = e.stats().kv_selection;
      const kb::TimedRun k = answer_key ? kb::RunTimed(e, key.ids, key_params) : kb::TimedRun{};
      const kvflow::KvSelectionStats key_sel = Minus(e.stats().kv_selection, before);
      const std::string answer = tok.Decode(k.tokens);
      const bool found = answer.find(key.key) != std::string::npos;
      const double median = kb::Median(tps[mode]);
      const kvflow::KvSelectionStats& s = selection[mode];
      const double bytes_fraction =
          s.bytes_full > 0 ? static_cast<double>(s.bytes_read) / static_cast<double>(s.bytes_full) : 1.0;
      // Runs of one repeat ran back to back (every mode, then the next repeat): the per-repeat ratio
      // pairs figures of the same moment; ranges that overlap full's mean "within the run-to-run spread".
      std::vector<double> ratios;
      for (size_t k = 0; k < tps[mode].size() && k < full_runs.size(); ++k) {
        if (full_runs[k] > 0) ratios.push_back(tps[mode][k] / full_runs[k]);
      }
      const bool within_spread = !full_runs.empty() && mode != "full" && Overlap(tps[mode], full_runs);
      rows.push_back({{"context", context},
                      {"batch", batch},
                      {"mode", mode},
                      {"prompt_tokens", prompts[0].size()},
                      {"decode_steps", first_run[mode].decode_steps},
                      {"decode_seconds", first_run[mode].decode_s},
                      {"decode_tokens_per_s", median},
                      {"decode_tokens_per_s_runs", tps[mode]},
                      {"speedup_vs_full_per_repeat", ratios},
                      {"within_run_to_run_spread_of_full", mode == "full" ? Json(nullptr) : Json(within_spread)},
                      {"ms_per_token", median > 0 ? 1000.0 / median : 0.0},
                      {"ms_per_step", median > 0 ? 1000.0 * batch / median : 0.0},
                      {"speedup_vs_full", full_tps > 0 ? median / full_tps : 0.0},
                      {"selection", SelectionJson(s)},
                      {"offload", OffloadJson(first_run[mode].decode_offload, first_run[mode].decode_tokens)},
                      {"error", errors[mode]},
                      {"passkey", !answer_key ? Json(nullptr) : Json{{"prompt_tokens", key.ids.size()},
                                   {"key", key.key},
                                   {"answer", answer},
                                   {"found", found},
                                   {"error", k.error},
                                   {"selection", SelectionJson(key_sel)}}}});
      const kb::TimedRun& fr = first_run[mode];
      const std::string fetched =
          engine_json[mode]["kv_offload"].get<bool>() && fr.decode_tokens > 0
              ? fmt::format("{:.2f} MiB", static_cast<double>(fr.decode_offload.bytes_fetched) / fr.decode_tokens / (1 << 20))
              : "-";
      const std::string vs_full = fmt::format("{:.2f}x", full_tps > 0 ? median / full_tps : 0.0) +
                                  (ratios.size() > 1 && mode != "full" ? " (" + Range(ratios, "{:.2f}") + ")" : std::string()) +
                                  (within_spread ? ", within spread" : "");
      char line[768];
      std::snprintf(line, sizeof line, "| %d | %d | %s | %s | %.2f | %s | %s | %.1f%% | %s | %s |\n", context, batch,
                    mode.c_str(),
                    (fmt::format("{:.1f}", median) + (tps[mode].size() > 1 ? " (" + Range(tps[mode], "{:.1f}") + ")" : "")).c_str(),
                    median > 0 ? 1000.0 * batch / median : 0.0, vs_full.c_str(),
                    s.tokens_available > 0 ? (std::to_string(static_cast<int>(100.0 * s.selection_fraction() + 0.5)) + "%").c_str()
                                           : "100%",
                    100.0 * bytes_fraction, fetched.c_str(), !answer_key ? "-" : found ? "found" : "missed");
      table += line;
    }
   }
  }
  std::printf("%s", table.c_str());
  const Json out = {{"benchmark", "kv_selection"},
                    {"date", kb::NowIso()},
                    {"cpu", kb::CpuModel()},
                    {"threads", threads},
                    {"device", device},
                    {"model", model},
                    {"command", kb::CommandLine(argc, argv)},
                    {"provenance", kb::Provenance(argc, argv, device == "cpu" ? "" : device)},
                    {"load_average_start", load_start},
                    {"load_average_end", kb::LoadAverage()},
                    {"new_tokens", new_tokens},
                    {"repeats", repeats},
                    {"engines", engine_json},
                    {"measured", true},
                    {"rows", rows}};
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  if (!md_path.empty()) {
    std::ofstream md(md_path);
    const bool on_gpu = device != "cpu";
    md << "# KV selection at long contexts (measured)\n\n"
       << (on_gpu ? "device " + device + ", host " : std::string()) << kb::CpuModel() << ", " << threads
       << " threads, " << model << ", " << kb::NowIso() << ". Decode tok/s: median of " << repeats << " runs of "
       << new_tokens
       << " greedy tokens after a WikiText-2 prompt, (min-max) over the runs; \"vs full\": median over full's median, "
          "(min-max) of the ratios of runs made back to back in one repeat, \"within spread\" when the mode's runs and "
          "full's overlap (the difference is inside the run-to-run spread); \"KV read\": the share of the cached tokens attention read at the "
          "layers that select (InfiniGen: all but layer 0; H2O: all), \"bytes read\": K/V bytes over all layers vs full "
          "attention (what an offloaded cache would fetch). offload-*: the KV pool in host memory (--kv-offload), "
          "\"fetched\": bytes each decode token moved from it to the staging buffers ("
       << (on_gpu ? "pinned host memory to the GPU over its PCIe link"
                  : "on a CPU the same RAM: the copy cost is measured, no PCIe link")
       << "). Pass key: prefilled in full, answer decoded under the mode.\n\n"
       << table;
  }
  return 0;
}
