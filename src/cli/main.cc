// `kvflow` command line: generate text, measure perplexity or speed, inspect a model.
#include <algorithm>
#include <chrono>
#include <optional>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "cli/decode_bench.h"
#include "cli/engine_flags.h"
#include "cli/prefill_bench.h"
#include "kv_runahead/prompt_prefill_service.h"
#include "model_parallel/model_parallel_service.h"
#include "distributed/world.h"
#include "chat_template/chat_template.h"
#include "cli/chat_template_command.h"
#include "cli/tokenize_command.h"
#include "backend/backend_factory.h"
#include "eval/perplexity.h"
#include "infinigen/calibration.h"
#include "infinigen/skew_file.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"

namespace {

using Clock = std::chrono::steady_clock;

struct GenerateOptions {
  kvflow::EngineConfig engine;
  kvflow::SamplingParams sampling;
  std::string prompt;
  bool chat = false;
  std::string chat_template;
  bool show_logprobs = false;
};

// Under mpirun with --tensor-parallel-size / --pipeline-parallel-size, every rank but rank 0 runs
// its share of each step: the exit code of a process that was such a worker, nullopt on rank 0
// (and whenever the model is whole).
std::optional<int> RunAsModelParallelWorker(const kvflow::EngineConfig& config) {
  auto worker = kvflow::mp::RunModelParallelWorkerIfNotDriver(config);
  if (!worker.ok()) {
    spdlog::error("{}", worker.status().ToString());
    return 1;
  }
  if (worker.value()) return 0;
  return std::nullopt;
}

int RunGenerate(GenerateOptions& opt) {
  // Under mpirun with --prefill-parallel, every rank but the last is a prefill worker.
  auto worker = kvflow::dist::RunPrefillWorkerIfNotLastRank(opt.engine);
  if (!worker.ok()) {
    spdlog::error("{}", worker.status().ToString());
    return 1;
  }
  if (worker.value()) return 0;
  if (auto exit_code = RunAsModelParallelWorker(opt.engine)) return *exit_code;
  auto engine_or = kvflow::Engine::Create(opt.engine);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    // The prefill workers wait for this rank: end the whole job.
    if (!opt.engine.prefill_parallel.method.empty() || opt.engine.model_parallel_ranks() > 1) kvflow::dist::AbortJob(1);
    return 1;
  }
  auto& engine = *engine_or.value();
  std::string prompt = opt.prompt;
  if (opt.chat) {
    const kvflow::Tokenizer& tok = engine.tokenizer();
    std::string source = tok.chat_template();
    if (!opt.chat_template.empty()) {
      auto read = kvflow::ChatTemplate::ReadSource(opt.chat_template);
      if (!read.ok()) {
        spdlog::error("--chat-template: {}", read.status().ToString());
        return 1;
      }
      source = read.value();
    }
    if (source.empty()) {
      spdlog::error("--chat: the model has no chat template; give one with --chat-template");
      return 1;
    }
    auto chat_template = kvflow::ChatTemplate::Create(source, tok);
    auto rendered = chat_template.ok() ? chat_template->Render(kvflow::ChatTemplateInput::User(opt.prompt))
                                       : kvflow::Result<std::string>(chat_template.status());
    if (!rendered.ok()) {
      spdlog::error("--chat: {}", rendered.status().ToString());
      return 1;
    }
    prompt = rendered.value();
    // Generate adds the tokenizer's BOS; one the template wrote is dropped so it is not doubled.
    const std::string& bos = chat_template->bos_token();
    if (tok.add_bos() && !bos.empty() && prompt.rfind(bos, 0) == 0) prompt.erase(0, bos.size());
  }

  const auto start = Clock::now();
  Clock::time_point first_token;
  int64_t generated = 0;
  auto on_event = [&](const kvflow::StreamEvent& e) {
    if (!e.tokens.empty() && generated == 0) first_token = Clock::now();
    generated += static_cast<int64_t>(e.tokens.size());
    std::fwrite(e.text_delta.data(), 1, e.text_delta.size(), stdout);  // the text may hold NUL bytes
    std::fflush(stdout);
    if (opt.show_logprobs) {
      for (const auto& t : e.tokens) {
        std::fprintf(stderr, "\n[token %d logprob %.4f; top:", t.token, t.logprob);
        for (const auto& alt : t.top_logprobs) std::fprintf(stderr, " %d:%.3f", alt.token, alt.logprob);
        std::fputs("]", stderr);
      }
    }
  };
  auto out = engine.Generate(prompt, opt.sampling, on_event);
  if (!out.ok()) {
    spdlog::error("{}", out.status().ToString());
    return 1;
  }
  const auto end = Clock::now();
  std::fputs("\n", stdout);
  const double prefill_s = std::chrono::duration<double>((generated ? first_token : end) - start).count();
  const double decode_s = std::chrono::duration<double>(end - (generated ? first_token : end)).count();
  const size_t prompt_tokens = out->prompt_tokens.size();
  std::fprintf(stderr, "\n--- finish: %s | prompt: %zu tokens, %.1f tok/s | decode: %lld tokens, %.1f tok/s\n",
               kvflow::FinishReasonName(out->first().finish_reason), prompt_tokens,
               prefill_s > 0 ? prompt_tokens / prefill_s : 0.0, static_cast<long long>(generated),
               decode_s > 0 && generated > 1 ? (generated - 1) / decode_s : 0.0);
  const kvflow::SpecDecodeStats spec = engine.stats().spec;
  if (spec.num_drafts > 0) {
    std::fprintf(stderr, "--- speculative: %lld verification passes with drafts, %lld of %lld drafts kept (%.0f%%)\n",
                 static_cast<long long>(spec.num_drafts), static_cast<long long>(spec.num_accepted_tokens),
                 static_cast<long long>(spec.num_draft_tokens),
                 100.0 * spec.num_accepted_tokens / std::max<int64_t>(1, spec.num_draft_tokens));
  }
  if (spec.middle_passes > 0 || spec.plain_steps > 0) {
    std::fprintf(stderr,
                 "--- triforce: %lld retrieval-cache passes (%.2f s) kept %lld of %lld bottom drafts; %lld bottom passes "
                 "(%.2f s); %lld cache builds; %lld steps decoded plainly\n",
                 static_cast<long long>(spec.middle_passes), spec.middle_seconds,
                 static_cast<long long>(spec.middle_accepted_tokens), static_cast<long long>(spec.middle_draft_tokens),
                 static_cast<long long>(spec.bottom_passes), spec.bottom_seconds,
                 static_cast<long long>(spec.retrieval_builds), static_cast<long long>(spec.plain_steps));
  }
  return 0;
}

struct PerplexityCliOptions {
  kvflow::EngineConfig engine;
  std::string file;
  int ctx = 2048;
  int stride = 0;
  std::string method = "sliding-window";
  int max_windows = 0;
  int windows_in_flight = 2;
  std::string json_out;
  bool dump_tokens = false;
  bool token_by_token = false;
  int decode_from = 0;
  int position_chunk = 0;
};

// A progress bar on stderr, redrawn in place; on a pipe only every tenth.
void DrawProgress(int64_t done, int64_t total, double seconds, const char* unit = "windows") {
  static const bool tty = isatty(fileno(stderr));
  if (!tty && done != total && done % std::max<int64_t>(1, total / 10) != 0) return;
  const int width = 30;
  const int filled = static_cast<int>(width * done / std::max<int64_t>(1, total));
  const double eta = done > 0 ? seconds / done * (total - done) : 0.0;
  std::fprintf(stderr, "%s[%s%s] %lld/%lld %s, %.0f s, eta %.0f s%s", tty ? "\r" : "",
               std::string(static_cast<size_t>(filled), '#').c_str(), std::string(static_cast<size_t>(width - filled), '.').c_str(),
               static_cast<long long>(done), static_cast<long long>(total), unit, seconds, eta, tty ? "" : "\n");
  if (tty && done == total) std::fputs("\n", stderr);
}

int RunPerplexity(PerplexityCliOptions& opt) {
  auto method = kvflow::ParsePerplexityMethod(opt.method);
  if (!method.ok()) {
    spdlog::error("{}", method.status().ToString());
    return 1;
  }
  std::ifstream in(opt.file, std::ios::binary);
  if (!in) {
    spdlog::error("cannot read {}", opt.file);
    return 1;
  }
  std::stringstream text;
  text << in.rdbuf();
  // Windows of ctx tokens need a context that long (the flag's default prefills in chunks of 512,
  // since every prompt token's logits are held per chunk).
  if (opt.engine.max_model_len == 0) opt.engine.max_model_len = opt.ctx;
  if (opt.decode_from > 0 && opt.token_by_token) {
    spdlog::error("--decode-from runs its tokens one per step already (and prefills the rest): drop --token-by-token");
    return 1;
  }
  if (opt.token_by_token) {
    // One token per step and window: every position is scored by a decode step, so a KV selection
    // acts at every position as it would while decoding.
    opt.engine.max_num_batched_tokens = 1;
    opt.windows_in_flight = 1;
  }
  if (auto exit_code = RunAsModelParallelWorker(opt.engine)) return *exit_code;
  auto engine_or = kvflow::Engine::Create(opt.engine);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    if (opt.engine.model_parallel_ranks() > 1) kvflow::dist::AbortJob(1);  // the workers wait for rank 0
    return 1;
  }
  auto& engine = *engine_or.value();
  // As Hugging Face's guide tokenizes the joined text: no BOS (the second-half method puts BOS
  // first in every chunk itself, as llama-perplexity does).
  const std::vector<int32_t> tokens = engine.tokenizer().Encode(text.str(), /*add_bos=*/false);
  spdlog::info("perplexity of {} ({} tokens) by {}, ctx {}{}", opt.file, tokens.size(), method.value() ==
               kvflow::PerplexityMethod::kSlidingWindow ? "sliding window" : "second half (llama.cpp)", opt.ctx,
               method.value() == kvflow::PerplexityMethod::kSlidingWindow
                   ? ", stride " + std::to_string(opt.stride > 0 ? opt.stride : opt.ctx) : std::string());
  kvflow::PerplexityOptions p;
  p.ctx = opt.ctx;
  p.stride = opt.stride;
  p.method = method.value();
  p.max_windows = opt.max_windows;
  p.decode_from = opt.decode_from;
  p.position_chunk = opt.position_chunk;
  p.windows_in_flight = opt.windows_in_flight;
  const auto start = Clock::now();
  p.progress = [&](int64_t done, int64_t total) {
    DrawProgress(done, total, std::chrono::duration<double>(Clock::now() - start).count());
  };
  auto r = kvflow::ComputePerplexity(engine, tokens, p);
  if (!r.ok()) {
    spdlog::error("{}", r.status().ToString());
    return 1;
  }
  if (!engine.config().kv_selection.method.empty()) {
    const kvflow::KvSelectionStats k = engine.stats().kv_selection;
    std::printf("kv selection %s: %.2f%% of the cached tokens read at selecting layers, %.2f%% of full attention's KV bytes "
                "(all layers), over %lld decode-mode tokens\n",
                engine.config().kv_selection.method.c_str(), 100.0 * k.selection_fraction(),
                k.bytes_full > 0 ? 100.0 * static_cast<double>(k.bytes_read) / static_cast<double>(k.bytes_full) : 0.0,
                static_cast<long long>(k.decode_tokens));
    if (engine.config().kv_selection.infinigen.host_kv_tokens > 0) {
      std::printf("host KV pool capped at %d tokens per sequence and layer (%s eviction): %lld (token, layer) entries evicted\n",
                  engine.config().kv_selection.infinigen.host_kv_tokens, engine.config().kv_selection.infinigen.eviction.c_str(),
                  static_cast<long long>(k.tokens_evicted));
    }
  }
  if (engine.config().kv_offload.enabled) {
    const kvflow::KvOffloadStats o = engine.stats().kv_offload;
    std::printf("kv offload: %.1f MiB fetched from the host pool (%lld prefetched layers, %lld on demand, %.2f s), "
                "%.1f MiB written to it\n",
                static_cast<double>(o.bytes_fetched) / (1 << 20), static_cast<long long>(o.prefetches),
                static_cast<long long>(o.on_demand_fetches), o.fetch_seconds,
                static_cast<double>(o.bytes_written) / (1 << 20));
  }
  std::printf("perplexity %.4f (mean NLL %.5f nats over %lld tokens, %lld windows, %.1f s, %.0f tok/s)\n",
              r->perplexity, r->mean_nll, static_cast<long long>(r->scored_tokens), static_cast<long long>(r->windows),
              r->seconds, r->input_tokens / std::max(1e-9, r->seconds));
  if (!opt.json_out.empty()) {
    nlohmann::json j = {{"file", opt.file},
                        {"model", engine.model_config().name},
                        {"engine", engine.Describe()},
                        {"method", kvflow::PerplexityMethodName(p.method)},
                        {"ctx", p.ctx},
                        {"stride", p.method == kvflow::PerplexityMethod::kSlidingWindow ? (p.stride > 0 ? p.stride : p.ctx) : p.ctx},
                        {"num_tokens", tokens.size()},
                        {"perplexity", r->perplexity},
                        {"mean_nll", r->mean_nll},
                        {"scored_tokens", r->scored_tokens},
                        {"windows", r->windows},
                        {"input_tokens", r->input_tokens},
                        {"seconds", r->seconds},
                        {"window_nll", r->window_nll}};
    if (r->first_token_bos >= 0) j["first_token_bos"] = r->first_token_bos;
    j["token_by_token"] = opt.token_by_token;
    j["decode_from"] = opt.decode_from;
    if (p.position_chunk > 0) {
      nlohmann::json chunks = nlohmann::json::array();
      for (size_t k = 0; k < r->chunk_nll.size(); ++k) {
        if (r->chunk_tokens[k] == 0) continue;
        const double mean = r->chunk_nll[k] / static_cast<double>(r->chunk_tokens[k]);
        chunks.push_back({{"from", static_cast<int64_t>(k) * p.position_chunk},
                          {"to", static_cast<int64_t>(k + 1) * p.position_chunk},
                          {"scored_tokens", r->chunk_tokens[k]},
                          {"mean_nll", mean},
                          {"perplexity", std::exp(mean)}});
      }
      j["position_chunk"] = p.position_chunk;
      j["position_chunks"] = chunks;
    }
    const kvflow::EngineConfig& ec = engine.config();
    if (!ec.kv_selection.method.empty()) {
      const kvflow::KvSelectionStats k = engine.stats().kv_selection;
      j["kv_selection"] = {{"method", ec.kv_selection.method},
                           {"infinigen_alpha", ec.kv_selection.infinigen.alpha},
                           {"infinigen_max_fraction", ec.kv_selection.infinigen.max_fraction},
                           {"infinigen_max_tokens", ec.kv_selection.infinigen.max_tokens},
                           {"infinigen_speculate_from", ec.kv_selection.infinigen.speculate_from},
                           {"infinigen_count_rule", ec.kv_selection.infinigen.count_rule},
                           {"infinigen_dense_layers", ec.kv_selection.infinigen.dense_layers},
                           {"infinigen_sink_tokens", ec.kv_selection.infinigen.sink_tokens},
                           {"infinigen_recent_tokens", ec.kv_selection.infinigen.recent_tokens},
                           {"min_context", ec.kv_selection.min_context},
                           {"infinigen_host_kv_tokens", ec.kv_selection.infinigen.host_kv_tokens},
                           {"infinigen_eviction", ec.kv_selection.infinigen.eviction},
                           {"h2o_budget", ec.kv_selection.h2o.budget},
                           {"decode_tokens", k.decode_tokens},
                           {"layer_reads_selected", k.layer_reads_selected},
                           {"layer_reads_full", k.layer_reads_full},
                           {"tokens_selected", k.tokens_selected},
                           {"tokens_available", k.tokens_available},
                           {"selection_fraction", k.selection_fraction()},
                           {"bytes_read", k.bytes_read},
                           {"bytes_full", k.bytes_full},
                           {"select_seconds", k.select_seconds},
                           {"tokens_evicted", k.tokens_evicted}};
    }
    if (opt.dump_tokens) j["tokens"] = tokens;
    std::ofstream out(opt.json_out);
    out << j.dump(1) << "\n";
    if (!out) {
      spdlog::error("cannot write {}", opt.json_out);
      return 1;
    }
  }
  return 0;
}

struct SkewCliOptions {
  kvflow::EngineConfig engine;
  std::string file;
  int tokens = 2048;
  double partial_ratio = 0.5;
  std::string partial_rule = "abs-sum";
  std::string out;
};

// `kvflow skew`: InfiniGen's offline step, once per model.
int RunSkew(SkewCliOptions& opt) {
  auto fail = [](const kvflow::Status& st) {
    spdlog::error("{}", st.ToString());
    return 1;
  };
  auto path = kvflow::ResolveModel(opt.engine.model);
  if (!path.ok()) return fail(path.status());
  auto files = kvflow::OpenModelFiles(path.value());
  if (!files.ok()) return fail(files.status());
  if (!files->tokenizer) return fail(kvflow::Status::NotFound("no tokenizer found for " + path.value()));
  std::ifstream in(opt.file, std::ios::binary);
  if (!in) return fail(kvflow::Status::NotFound("cannot read " + opt.file));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<int32_t> tokens = files->tokenizer->Encode(text.str(), files->tokenizer->add_bos());
  if (opt.tokens < 16) return fail(kvflow::Status::InvalidArgument("--tokens must be >= 16"));
  if (static_cast<int64_t>(tokens.size()) > opt.tokens) tokens.resize(static_cast<size_t>(opt.tokens));
  tokens.resize(std::min<size_t>(tokens.size(), static_cast<size_t>(files->config.max_position_embeddings)));
  kvflow::EngineConfig& c = opt.engine;
  c.max_model_len = static_cast<int>(tokens.size());
  c.num_kv_blocks = (c.max_model_len + c.block_size - 1) / c.block_size + 1;
  c.num_host_kv_blocks = 0;
  // A random:<shape> model's weights are generated on the GPU (its skew then serves speed runs only).
  auto backend = kvflow::CreateBackendForModel(c, true, files.value());
  if (!backend.ok()) return fail(backend.status());
  spdlog::info("skewing {} ({} layers, {} KV heads of {} query heads, head_dim {}) from {} tokens of {}",
               files->config.name, files->config.num_layers, files->config.num_kv_heads, files->config.num_heads,
               files->config.head_dim, tokens.size(), opt.file);
  kvflow::SkewCalibrationOptions o;
  o.partial_ratio = opt.partial_ratio;
  auto rule = kvflow::ParsePartialColumnRule(opt.partial_rule);
  if (!rule.ok()) return fail(rule.status());
  o.rule = rule.value();
  o.chunk_tokens = std::max(1, std::min(c.max_num_batched_tokens, 512));
  const auto start = Clock::now();
  o.on_layers = [&](int done, int total) {
    DrawProgress(done, total, std::chrono::duration<double>(Clock::now() - start).count(), "layers");
  };
  auto table = kvflow::CalibrateSkew(*backend.value(), tokens, o);
  if (!table.ok()) return fail(table.status());
  const std::string out = opt.out.empty() ? kvflow::DefaultSkewPath(path.value()) : opt.out;
  const kvflow::Status st = kvflow::WriteSkewTable(table.value(), out);
  if (!st.ok()) return fail(st);
  std::printf("wrote %s: per layer and KV head an orthogonal %dx%d skewing matrix and %d partial columns (%.0f%% of "
              "head_dim), from %lld tokens, in %.1f s\n",
              out.c_str(), table->head_dim, table->head_dim, table->num_partial_columns, 100.0 * opt.partial_ratio,
              static_cast<long long>(table->calibration_tokens),
              std::chrono::duration<double>(Clock::now() - start).count());
  return 0;
}

struct BenchCliOptions {
  kvflow::EngineConfig engine;
  std::vector<int> depths = {0};
  int batch = 1;
  int decode_tokens = 64;
  int repeats = 3;
  std::string json_out;
};

// Prefill and decode speed of one sequence at each depth (see cli/decode_bench.h), as a table on
// stdout and optionally JSON.
int RunBench(BenchCliOptions& opt) {
  const int deepest = *std::max_element(opt.depths.begin(), opt.depths.end());
  if (opt.engine.max_model_len == 0) opt.engine.max_model_len = std::max(1, deepest) + opt.decode_tokens + 1;
  opt.engine.max_num_seqs = std::max(opt.engine.max_num_seqs, opt.batch);
  // The whole batch's prompts prefill in one step (as llama-bench's -p), so no decode step mixes
  // with a prefill chunk and each is timed as what it is.
  opt.engine.max_num_batched_tokens = std::max(opt.engine.max_num_batched_tokens, opt.batch * std::max(1, deepest));
  if (auto exit_code = RunAsModelParallelWorker(opt.engine)) return *exit_code;
  auto engine_or = kvflow::Engine::Create(opt.engine);
  if (!engine_or.ok()) {
    spdlog::error("{}", engine_or.status().ToString());
    if (opt.engine.model_parallel_ranks() > 1) kvflow::dist::AbortJob(1);  // the workers wait for rank 0
    return 1;
  }
  auto& engine = *engine_or.value();
  spdlog::info("bench: {}, batch {}, {} decode tokens, {} repeats (medians)", engine.Describe(), opt.batch,
               opt.decode_tokens, opt.repeats);
  std::printf("%8s %6s %8s %14s %14s %10s\n", "depth", "batch", "decode", "prefill tok/s", "decode tok/s", "comm");
  nlohmann::json runs = nlohmann::json::array();
  for (const int depth : opt.depths) {
    kvflow::DecodeBenchOptions b;
    b.depth = depth;
    b.decode_tokens = opt.decode_tokens;
    b.repeats = opt.repeats;
    b.batch = opt.batch;
    const kvflow::ModelParallelStats before = engine.stats().model_parallel;
    const auto started = std::chrono::steady_clock::now();
    auto r = kvflow::RunDecodeBench(engine, b);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const kvflow::ModelParallelStats after = engine.stats().model_parallel;
    // A split model: the share of the bench's wall time rank 0 spent communicating (all-reduces,
    // sending steps, sending the residual stream on) and, under pipeline parallelism, waiting for
    // the last stage's logits once its own layers had run.
    using kvflow::ModelParallelStats;
    auto delta = [&](double ModelParallelStats::*field) { return after.*field - before.*field; };
    const double comm_s = delta(&ModelParallelStats::all_reduce_seconds) + delta(&ModelParallelStats::send_seconds) +
                          delta(&ModelParallelStats::residual_send_seconds);
    const double wait_s = delta(&ModelParallelStats::logits_wait_seconds);
    if (!r.ok()) {
      spdlog::error("depth {}: {}", depth, r.status().ToString());
      return 1;
    }
    std::printf("%8d %6d %8d %14.1f %14.2f %9.1f%%\n", depth, opt.batch, opt.decode_tokens, r->prefill_tok_s,
                r->decode_tok_s, 100.0 * comm_s / elapsed);
    std::fflush(stdout);
    nlohmann::json samples = nlohmann::json::array();
    for (const auto& run : r->runs) {
      samples.push_back({{"prompt_tokens", run.prompt_tokens}, {"prefill_s", run.prefill_s},
                         {"decode_steps", run.decode_steps}, {"decode_s", run.decode_s}});
    }
    runs.push_back({{"depth", depth}, {"batch", opt.batch}, {"decode_tokens", opt.decode_tokens},
                    {"prefill_tok_s", r->prefill_tok_s}, {"decode_tok_s", r->decode_tok_s}, {"runs", samples},
                    {"seconds", elapsed},
                    {"model_parallel",
                     {{"ranks", after.ranks},
                      {"tensor_parallel_size", after.tensor_parallel_size},
                      {"pipeline_parallel_size", after.pipeline_parallel_size},
                      {"steps", after.steps - before.steps},
                      {"microbatches", after.microbatches - before.microbatches},
                      {"batches_in_flight", after.batches_in_flight},
                      {"overlapped_steps", after.overlapped_steps - before.overlapped_steps},
                      {"all_reduce_seconds", delta(&ModelParallelStats::all_reduce_seconds)},
                      {"send_seconds", delta(&ModelParallelStats::send_seconds)},
                      {"residual_send_seconds", delta(&ModelParallelStats::residual_send_seconds)},
                      {"logits_wait_seconds", wait_s},
                      {"all_reduces", after.all_reduces - before.all_reduces},
                      {"all_reduce_bytes", after.all_reduce_bytes - before.all_reduce_bytes},
                      {"residual_bytes", after.residual_bytes - before.residual_bytes},
                      {"comm_share", comm_s / elapsed},
                      {"logits_wait_share", wait_s / elapsed}}}});
  }
  if (!opt.json_out.empty()) {
    nlohmann::json j = {{"model", engine.model_config().name}, {"engine", engine.Describe()},
                        {"dtype", opt.engine.dtype}, {"threads", opt.engine.num_threads},
                        {"repeats", opt.repeats}, {"results", runs}};
    std::ofstream out(opt.json_out);
    out << j.dump(1) << "\n";
    if (!out) {
      spdlog::error("cannot write {}", opt.json_out);
      return 1;
    }
  }
  return 0;
}

int RunInfo(const std::string& model) {
  auto path = kvflow::ResolveModel(model);
  if (!path.ok()) {
    spdlog::error("{}", path.status().ToString());
    return 1;
  }
  auto files = kvflow::OpenModelFiles(path.value());
  if (!files.ok()) {
    spdlog::error("{}", files.status().ToString());
    return 1;
  }
  std::printf("path: %s\nweights: %s\n%s", path.value().c_str(), files->tensors->Describe().c_str(),
              files->config.Describe().c_str());
  if (files->tokenizer) {
    const kvflow::Tokenizer& tok = *files->tokenizer;
    std::printf("tokenizer: byte-level BPE, %d tokens, bos %d, eos %d, add_bos %s\n", tok.vocab_size(), tok.bos_id(),
                tok.eos_id(), tok.add_bos() ? "yes" : "no");
    if (tok.chat_template().empty()) {
      std::printf("chat template: none\n");
    } else {
      auto parsed = kvflow::ChatTemplate::Create(tok.chat_template(), "", "");
      std::printf("chat template: %zu bytes of Jinja, %s\n", tok.chat_template().size(),
                  parsed.ok() ? "parses" : parsed.status().message().c_str());
    }
  } else {
    std::printf("tokenizer: none found\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvflow: LLM inference with a paged KV cache.\n\n"
      "  kvflow generate --model smollm2-135m --prompt \"Tell me about cats\" --chat\n"
      "  kvflow perplexity --model smollm2-135m --file wiki.test.raw --ctx 2048\n"
      "  kvflow bench --model smollm2-135m --depth 0,1024,4096 --decode-tokens 64\n"
      "  kvflow skew --model smollm2-135m --file wiki.valid.raw   (InfiniGen's skewing file, once)\n"
      "  kvflow perplexity --model smollm2-135m --file wiki.test.raw --kv-selection infinigen --token-by-token\n"
      "  kvflow chat-template --model smollm2-135m --messages '[{\"role\": \"user\", \"content\": \"Hi\"}]'\n"
      "  kvflow tokenize --model smollm2-135m --text \"Hello world\"\n"
      "  kvflow info --model smollm2-135m\n\n"
      "Models: a .gguf file, a .safetensors file or HF directory, or a short name: tiny-random\n"
      "(built in, random weights) or smollm2-135m (run tools/fetch-model first). With --device cuda,\n"
      "random:llama-3.1-8b, random:llama-2-7b or random:smollm2-135m are those shapes with random\n"
      "weights generated on the GPU: real speed, meaningless text."};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Debug logging");

  GenerateOptions gen;
  gen.sampling.max_tokens = 128;
  CLI::App* generate = app.add_subcommand("generate", "Generate text from a prompt, streaming it to stdout");
  generate->add_option("-p,--prompt", gen.prompt, "Prompt text")->required();
  generate->add_flag("--chat", gen.chat, "Wrap the prompt as a user message in the model's chat template");
  generate->add_option("--chat-template", gen.chat_template,
                       "Override the chat template: chatml, llama3, or a file (Jinja, or a tokenizer_config.json)");
  generate->add_option("-n,--max-tokens", gen.sampling.max_tokens, "Tokens to generate at most")->default_val(128);
  generate->add_option("--min-tokens", gen.sampling.min_tokens, "Tokens to generate before EOS/stop may end it");
  generate->add_option("-t,--temperature", gen.sampling.temperature, "0 = greedy")->default_val(0.7);
  generate->add_option("--top-k", gen.sampling.top_k, "Keep the k most likely tokens (0 = off)")->default_val(0);
  generate->add_option("--top-p", gen.sampling.top_p, "Nucleus sampling mass (1 = off)")->default_val(0.95);
  generate->add_option("--min-p", gen.sampling.min_p, "Drop tokens below min_p * max prob (0 = off)");
  generate->add_option("--repetition-penalty", gen.sampling.repetition_penalty, "CTRL-style penalty (1 = off)");
  generate->add_option("--frequency-penalty", gen.sampling.frequency_penalty, "OpenAI frequency penalty");
  generate->add_option("--presence-penalty", gen.sampling.presence_penalty, "OpenAI presence penalty");
  generate->add_option("--seed", gen.sampling.seed, "Seed: same seed, same output");
  generate->add_option("--stop", gen.sampling.stop, "Stop string (repeatable)");
  generate->add_option("--stop-token-id", gen.sampling.stop_token_ids, "Stop token id (repeatable)");
  generate->add_flag("--ignore-eos", gen.sampling.ignore_eos, "Keep generating past EOS");
  generate->add_option("--logprobs", gen.sampling.logprobs, "Print this many top logprobs per token to stderr");
  double swap_space_gib = 4.0;
  kvflow::AddEngineFlags(generate, &gen.engine, &swap_space_gib);

  PerplexityCliOptions ppl;
  CLI::App* perplexity = app.add_subcommand(
      "perplexity", "Perplexity of the model on a text file (WikiText-2 style), from the engine's prompt logprobs");
  perplexity->add_option("-f,--file", ppl.file, "Text file (e.g. WikiText-2 test)")->required();
  perplexity->add_option("-c,--ctx", ppl.ctx, "Tokens per window")->default_val(2048);
  perplexity->add_option("--stride", ppl.stride,
                         "sliding-window: tokens between window starts (0 = ctx: no overlap); each window scores "
                         "only the tokens the previous one did not")
      ->default_val(0);
  perplexity->add_option("--method", ppl.method,
                         "sliding-window (Hugging Face's guide) or second-half (llama.cpp's llama-perplexity: score "
                         "tokens ctx/2.. of each chunk)")
      ->default_val("sliding-window");
  perplexity->add_option("--max-windows", ppl.max_windows, "Score only the first N windows (0 = all)")->default_val(0);
  perplexity->add_option("--windows-in-flight", ppl.windows_in_flight, "Windows batched together")->default_val(2);
  perplexity->add_option("--json", ppl.json_out, "Write the result (and per-window NLL) as JSON here");
  perplexity->add_option("--position-chunk", ppl.position_chunk,
                         "Also report the perplexity of each N-token span of window positions over all windows "
                         "(in --json: position_chunks): how the loss moves along a sequence (0 = off)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  perplexity->add_flag("--dump-tokens", ppl.dump_tokens, "Include the token ids in the JSON (reference checks)");
  perplexity->add_flag("--token-by-token", ppl.token_by_token,
                       "Score one token per step (decode mode: a --kv-selection acts at every position as in "
                       "decoding; slow, pair with --max-windows)");
  perplexity->add_option("--decode-from", ppl.decode_from,
                         "Prefill each window's first N tokens as a prompt, then run the rest one per step as decode "
                         "steps and score only those: what a --kv-selection costs while serving after a dense prompt "
                         "(InfiniGen's protocol: --ctx 2048 --decode-from 1920; 0 = off)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  double ppl_swap_gib = 0.0;
  kvflow::AddEngineFlags(perplexity, &ppl.engine, &ppl_swap_gib);
  perplexity->get_option("--max-num-batched-tokens")->default_val(512);
  perplexity->get_option("--swap-space")->default_val(0.0);

  BenchCliOptions bench_opt;
  CLI::App* bench = app.add_subcommand(
      "bench", "Prefill and decode speed of one sequence: prefill DEPTH synthetic tokens, then time N one-token "
               "decode steps (llama-bench -p 0 -n N -d DEPTH; prefill speed as llama-bench -p DEPTH -n 0)");
  bench->add_option("-d,--depth", bench_opt.depths, "Prompt tokens before decoding, comma-separated (0: one token)")
      ->delimiter(',')
      ->default_str("0");
  bench->add_option("-b,--batch", bench_opt.batch, "Sequences decoding together, each with a prompt of DEPTH tokens "
                                                  "(prefill tok/s then counts the whole batch's prompts)")
      ->default_val(1)
      ->check(CLI::Range(1, 4096));
  bench->add_option("-n,--decode-tokens", bench_opt.decode_tokens, "Timed decode steps (0: prefill only)")
      ->default_val(64);
  bench->add_option("-r,--repeats", bench_opt.repeats, "Timed runs per depth; medians are reported")->default_val(3);
  bench->add_option("--json", bench_opt.json_out, "Write the results (and every run) as JSON here");
  double bench_swap_gib = 0.0;
  kvflow::AddEngineFlags(bench, &bench_opt.engine, &bench_swap_gib);
  bench->get_option("--swap-space")->default_val(0.0);
  bench->get_option("--max-model-len")->description("Context limit (0 = deepest depth + decode tokens + 1)");

  SkewCliOptions skew_opt;
  CLI::App* skew = app.add_subcommand(
      "skew", "InfiniGen's offline step (once per model): run the model over sample text and write, per layer and KV "
              "head, the skewing matrix (SVD of the post-RoPE queries) and partial columns next to the model");
  skew->add_option("-f,--file", skew_opt.file, "Sample text (e.g. WikiText-2 valid)")->required();
  skew->add_option("--tokens", skew_opt.tokens, "Tokens of the sample to run (the paper: 2048)")->default_val(2048);
  skew->add_option("--partial-ratio", skew_opt.partial_ratio,
                   "Partial columns kept, a fraction of head_dim (the paper: 0.3 of 128; 0.5 of SmolLM2's 64 predicts "
                   "better, bench/results/infinigen_accuracy.md)")
      ->default_val(0.5)
      ->check(CLI::Range(0.01, 1.0));
  skew->add_option("--partial-rule", skew_opt.partial_rule,
                   "How the partial columns are ranked after skewing: abs-sum (column sums of |Q| + |K|, the paper's "
                   "text) or product (mean |Q| x mean |K|: what a column adds to q.k)")
      ->default_val("abs-sum")
      ->check(CLI::IsMember({"abs-sum", "product"}));
  skew->add_option("-o,--out", skew_opt.out, "Output file (default: <model path>.infinigen, where the engine looks)");
  double skew_swap_gib = 0.0;
  kvflow::AddEngineFlags(skew, &skew_opt.engine, &skew_swap_gib);

  kvflow::PrefillBenchOptions prefill_opt;
  CLI::App* prefill_bench = app.add_subcommand(
      "prefill-bench",
      "Time-to-first-token of a long prompt prefilled across the ranks of an mpirun job (KV-Runahead's chain, or the "
      "TSP all-gather baseline; one rank: a plain prefill), and KV-Runahead's partition search:\n"
      "  mpirun -np 1 kvflow prefill-bench --threads 2\n"
      "  mpirun -np 2 kvflow prefill-bench --threads 1 --search --table partitions.json");
  prefill_bench->add_option("--contexts", prefill_opt.contexts, "Prompt lengths, comma-separated")
      ->delimiter(',')
      ->default_str("2048,4096,8192");
  prefill_bench->add_option("--methods", prefill_opt.methods, "kv-runahead and/or tsp, comma-separated")
      ->delimiter(',')
      ->default_str("kv-runahead,tsp");
  prefill_bench->add_option("-r,--repeats", prefill_opt.repeats, "Timed runs per point; medians are reported")
      ->default_val(3);
  prefill_bench->add_option("--search-repeats", prefill_opt.search_repeats,
                            "Timed runs per partition the search tries (medians)")
      ->default_val(1);
  prefill_bench->add_flag("--search", prefill_opt.search,
                          "KVR-S: search each context's partition by measuring TTFT (binary search for 2 ranks, "
                          "hierarchical grid beyond) and write --table");
  prefill_bench->add_option("--table", prefill_opt.table,
                            "Partition lookup table to write (--search) or read (--predict)");
  prefill_bench->add_option("--predict", prefill_opt.predict,
                            "KVR-P: contexts to run with the table's interpolated partition, comma-separated")
      ->delimiter(',');
  prefill_bench->add_option("--granularity", prefill_opt.granularity, "The search's finest step in tokens")
      ->default_val(64);
  prefill_bench->add_option("--timeout", prefill_opt.timeout_s, "Seconds a rank waits for a peer before giving up")
      ->default_val(300);
  prefill_bench->add_option("--json", prefill_opt.json_out, "Write every measurement as JSON here (last rank)");
  double prefill_swap_gib = 0.0;
  kvflow::AddEngineFlags(prefill_bench, &prefill_opt.engine, &prefill_swap_gib);

  kvflow::ChatTemplateCommandOptions chat_template_opt;
  CLI::App* chat_template_cmd = kvflow::AddChatTemplateCommand(app, &chat_template_opt);

  kvflow::TokenizeCommandOptions tokenize_opt;
  CLI::App* tokenize_cmd = kvflow::AddTokenizeCommand(app, &tokenize_opt);

  std::string info_model = "smollm2-135m";
  CLI::App* info = app.add_subcommand("info", "Print a model's configuration and tokenizer");
  info->add_option("-m,--model", info_model, "Model path or short name")->default_val("smollm2-135m");

  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_mt("kvflow"));
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::info);

  if (*generate) {
    kvflow::ApplySwapSpace(&gen.engine, swap_space_gib);
    gen.show_logprobs = gen.sampling.logprobs > 0;
    return RunGenerate(gen);
  }
  if (*perplexity) {
    kvflow::ApplySwapSpace(&ppl.engine, ppl_swap_gib);
    return RunPerplexity(ppl);
  }
  if (*skew) return RunSkew(skew_opt);
  if (*chat_template_cmd) return kvflow::RunChatTemplateCommand(chat_template_opt);
  if (*tokenize_cmd) return kvflow::RunTokenizeCommand(tokenize_opt);
  if (*prefill_bench) return kvflow::RunPrefillBench(prefill_opt);
  if (*bench) {
    kvflow::ApplySwapSpace(&bench_opt.engine, bench_swap_gib);
    return RunBench(bench_opt);
  }
  return RunInfo(info_model);
}
