// Serving-benchmark reports: sweep options, sustainable rates, and the Markdown tables of a sweep and of a library-vs-server comparison.
#include "serving/report.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include "bench_files.h"
#include "engine/engine_core.h"
#include "engine/evaluation.h"
#include "systems/builtin_systems.h"
#include "kv/block_manager.h"
#include "kvflow/engine.h"
#include "model/tensor_source.h"
#include "model/tiny_random.h"
#include "sched/length_predictor.h"
#include "sched/length_supervisor.h"
#include "sched/policy.h"
#include "sched/scheduler.h"
#include "sched/sequence_group.h"
#include "util/alpaca.h"

namespace kvflow::bench::serving {

namespace {

const Json* FindRun(const Json& runs, const std::string& policy, double rate) {
  for (const Json& r : runs) {
    if (r["policy"] == policy && RateFromJson(r["rate_req_s"]) == rate) return &r;
  }
  return nullptr;
}
}  // namespace

Json SustainableRates(const Json& runs, const SweepOptions& opt, Json& bound_info) {
  std::vector<double> rates = opt.rates;
  std::sort(rates.begin(), rates.end());
  double bound = opt.latency_bound;
  if (bound > 0) {
    bound_info = Json{{"rule", "fixed bound on normalized latency (--latency-bound)"}, {"bound_s_per_token", bound}};
  } else {
    // The reference is paged at the lowest rate, or the best policy there when paged is not run.
    double reference = std::numeric_limits<double>::infinity();
    std::string reference_policy;
    for (const std::string& p : opt.policies) {
      const Json* r = FindRun(runs, p, rates.front());
      if (!r || r->at("normalized_latency_s_per_token").is_null()) continue;
      const double v = r->at("normalized_latency_s_per_token");
      if (p == "paged" || (reference_policy != "paged" && v < reference)) {
        reference = v;
        reference_policy = p;
      }
    }
    bound = opt.latency_bound_factor * reference;
    bound_info = Json{{"rule", Fixed(opt.latency_bound_factor, 1) + "x the normalized latency of " + reference_policy +
                                   " at the lowest tested rate (" + Fixed(rates.front(), 2) + " req/s)"},
                      {"factor", opt.latency_bound_factor},
                      {"reference_policy", reference_policy},
                      {"reference_s_per_token", reference},
                      {"bound_s_per_token", bound}};
  }
  bound_info["sustainable_rate"] =
      "highest tested rate r such that at every tested rate <= r all requests completed and normalized latency "
      "<= bound";
  Json sustainable = Json::object();
  for (const std::string& p : opt.policies) {
    Json best = nullptr;
    for (double rate : rates) {
      const Json* r = FindRun(runs, p, rate);
      if (!r || r->at("failed").get<int64_t>() > 0 || r->at("normalized_latency_s_per_token").is_null() ||
          r->at("normalized_latency_s_per_token").get<double>() > bound) {
        break;
      }
      best = RateJson(rate);
    }
    sustainable[p] = best;
  }
  return sustainable;
}
Json Ratios(const Json& sustainable) {
  Json ratios = Json::object();
  if (!sustainable.contains("paged")) return ratios;
  for (const auto& [policy, rate] : sustainable.items()) {
    if (policy == "paged") continue;
    const bool defined = !rate.is_null() && !sustainable["paged"].is_null() && RateFromJson(rate) > 0 &&
                         !rate.is_string() && !sustainable["paged"].is_string();
    ratios["paged/" + policy] =
        defined ? Json(RateFromJson(sustainable["paged"]) / RateFromJson(rate)) : Json(nullptr);
  }
  return ratios;
}
std::string Cell(const Json& v, int decimals) {
  if (v.is_null()) return "n/a";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  return decimals < 0 ? Sig3(v.get<double>()) : Fixed(v.get<double>(), decimals);
}
namespace {

std::string Percent(const Json& v) { return v.is_null() ? "n/a" : Fixed(100 * v.get<double>(), 1) + "%"; }

std::string Triple(const Json& d) { return Cell(d["p50"]) + " / " + Cell(d["p90"]) + " / " + Cell(d["p99"]); }
}  // namespace

std::string Markdown(const Json& report) {
  std::string md = "# Serving benchmark: " + report["trace"]["name"].get<std::string>() + " trace, " +
                   report["executor"]["name"].get<std::string>() + " executor\n\n";
  md += "- executor: " + report["executor"]["description"].get<std::string>() + "\n";
  if (report["executor"].contains("server") && report["executor"]["server"].contains("args")) {
    const auto args = report["executor"]["server"]["args"].get<std::vector<std::string>>();
    md += "- server: `kvflow-server " + Join(args, " ") + "`\n";
  }
  const Json& t = report["trace"];
  md += "- trace: " + t["source"].get<std::string>() + "; " + std::to_string(t["num_requests"].get<int64_t>()) +
        " requests, Poisson arrivals (seed " + std::to_string(report["arrival_seed"].get<uint64_t>()) +
        "); tokenizer: " + t["tokenizer"].get<std::string>() + "\n";
  md += "- lengths (tokens): input mean " + Fixed(t["input_len"]["mean"], 1) + " (max " + Cell(t["input_len"]["max"]) +
        "), output mean " + Fixed(t["output_len"]["mean"], 1) + " (max " + Cell(t["output_len"]["max"]) + "); " +
        Cell(t["num_truncated_to_max_model_len"]) + " truncated to max_model_len\n";
  const Json& c = report["config"];
  md += "- KV budget: " + Cell(c["num_device_blocks"]) + " blocks x " + Cell(c["block_size"]) + " tokens; swap " +
        Cell(c["num_host_blocks"]) + " blocks; max_num_seqs " + Cell(c["max_num_seqs"]) + ", max_num_batched_tokens " +
        Cell(c["max_num_batched_tokens"]) + ", max_model_len " + Cell(c["max_model_len"]) + ", preemption " +
        c["preemption_mode"].get<std::string>() + "\n\n";
  md += "Normalized latency = mean over requests of end-to-end latency / output tokens. TTFT and TPOT in seconds "
        "(p50 / p90 / p99). KV used = allocated device blocks / all; KV filled = tokens with stored KV / allocated "
        "block capacity (both averaged over steps).\n\n";
  md += "| policy | rate (req/s) | done / failed | req/s | output tok/s | norm. latency (s/tok) | TTFT (s) | TPOT (s) "
        "| avg batch | steps | preemptions | KV used | KV filled | duration (s) |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    md += "| " + r["policy"].get<std::string>() + " | " + RateLabel(RateFromJson(r["rate_req_s"])) + " | " +
          Cell(r["completed"]) +
          " / " + Cell(r["failed"]) + " | " + Fixed(r["throughput_req_s"], 2) + " | " +
          Fixed(r["throughput_output_tok_s"], 0) + " | " + Cell(r["normalized_latency_s_per_token"]) + " | " +
          Triple(r["ttft_s"]) + " | " + Triple(r["tpot_s"]) + " | " + Cell(r["avg_batch_seqs"], 1) + " | " +
          Cell(r["num_steps"]) + " | " + std::to_string(r["preemptions"]["recompute"].get<int64_t>() + r["preemptions"]["swap"].get<int64_t>()) +
          " | " + Percent(r["kv_used_block_fraction"]) + " | " + Percent(r["kv_filled_token_fraction"]) + " | " +
          Fixed(r["duration_s"], 1) + " |\n";
  }
  // S3: what the predictor and its supervisor did, and what preemption cost.
  std::string s3;
  for (const Json& r : report["runs"]) {
    const bool has_penalty = r.contains("preemption_penalty") && r["preemption_penalty"].contains("modelled_s");
    if (!r.contains("s3") && !has_penalty) continue;
    const Json none = Json::object();
    const Json& l = r.contains("s3") ? r["s3"] : none;
    const double duration = r["duration_s"].get<double>();
    auto share = [&](double seconds) { return duration > 0 ? Fixed(100 * seconds / duration, 2) + "%" : "n/a"; };
    const double overhead = l.empty() ? 0.0 : l["predict_s"].get<double>() + l["update_s"].get<double>();
    s3 += "| " + r["policy"].get<std::string>() + " | " + RateLabel(RateFromJson(r["rate_req_s"])) + " | " +
          (l.empty() ? "-" : Percent(l["bucket_accuracy"])) + " | " +
          (l.empty() ? "-" : Cell(l["under_predicted"]) + " / " + Cell(l["over_predicted"])) + " | " +
          Cell(r["preemption_penalty"]["reservation_preemptions"]) + " | " +
          (has_penalty ? share(r["preemption_penalty"]["modelled_s"].get<double>()) : "n/a") + " | " +
          (l.empty() ? "-" : Cell(l["predict_us_per_request"], 1) + " / " + Cell(l["update_us_per_step"], 1)) + " | " +
          (l.empty() ? "-" : share(overhead)) + " |\n";
  }
  if (!s3.empty()) {
    md += "\nS3: bucket accuracy of the predictions at arrival (finished requests), mispredicted requests (under / "
          "over), preemptions of exhausted reservations, the preemption penalty (recomputing KV already computed "
          "once, and swapping) as a share of the run, and the predictor's cost on this CPU (predict per request / "
          "online update per step, and their total as a share of the run).\n\n";
    md += "| policy | rate | bucket accuracy | under / over | reservation preemptions | penalty | predictor us | "
          "predictor overhead |\n|---|---|---|---|---|---|---|---|\n" + s3;
  }
  const Json& bound = report["latency_bound"];
  md += "\nSustainable rate: " + bound["sustainable_rate"].get<std::string>() + "; bound = " +
        bound["rule"].get<std::string>() + " = " + Sig3(bound["bound_s_per_token"]) + " s/token.\n\n";
  md += "| policy | sustainable rate (req/s) | paged / policy |\n|---|---|---|\n";
  for (const auto& [policy, rate] : report["sustainable_rate_req_s"].items()) {
    const std::string key = "paged/" + policy;
    const std::string ratio =
        policy == "paged" ? "1" : report["ratios"].contains(key) ? Cell(report["ratios"][key], 2) : "n/a";
    md += "| " + policy + " | " + (rate.is_null() ? "n/a" : RateLabel(RateFromJson(rate))) + " | " + ratio + " |\n";
  }
  return md;
}
Status WriteFile(const fs::path& path, const std::string& text) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return Status::IoError("cannot write " + path.string());
  return Status::Ok();
}
std::string BaseName(const std::string& trace, const std::string& executor, const std::string& tag) {
  return "serving_" + trace + "_" + executor + (tag.empty() ? "" : "_" + tag);
}
Json SafeRatio(const Json& num, const Json& den) {
  if (!num.is_number() || !den.is_number() || den.get<double>() == 0) return nullptr;
  return num.get<double>() / den.get<double>();
}
Json Difference(const Json& a, const Json& b) {
  if (!a.is_number() || !b.is_number()) return nullptr;
  return a.get<double>() - b.get<double>();
}
namespace {

std::string Ms(const Json& seconds) { return seconds.is_null() ? "n/a" : Sig3(1e3 * seconds.get<double>()); }

// "inf", or "inf #2" for the second of repeated runs.
std::string RunLabel(const Json& run) {
  return RateLabel(RateFromJson(run["rate_req_s"])) +
         (run.contains("repeat") ? " #" + std::to_string(run["repeat"].get<int>()) : "");
}
}  // namespace

std::string CompareMarkdown(const Json& report) {
  const Json& t = report["trace"];
  const Json& c = report["config"];
  const Json& m = report["machine"];
  std::string md = "# Serving benchmark: kvflow-server (HTTP) vs the library, " + t["name"].get<std::string>() +
                   " trace, " + report["model"].get<std::string>() + "\n\n";
  md += "- library: `real` executor, kvflow::Engine driven in-process (wall clock), policy paged\n";
  const std::string server_args =
      report["server"].contains("args")
          ? ": `" + (report["server"].value("env", Json(nullptr)).is_string()
                         ? report["server"]["env"].get<std::string>() + " "
                         : std::string()) +
                "kvflow-server " + Join(report["server"]["args"].get<std::vector<std::string>>(), " ") + "`"
          : "";
  md += "- server: `http` executor, " + report["server"]["url"].get<std::string>() + " (" +
        report["server"]["mode"].get<std::string>() + ")" + server_args + "\n";
  md += "- client: " + report["client"].get<std::string>() + "\n";
  md += "- machine: " + m["cpu"].get<std::string>() + ", " + Cell(m["hardware_threads"]) + " hardware threads, " +
        "engine threads " + Cell(m["engine_threads"]) + ", OMP_WAIT_POLICY " +
        m["omp_wait_policy"].get<std::string>() + "; the client, the server and the library share these cores\n";
  md += "- trace: " + t["source"].get<std::string>() + "; " + std::to_string(t["num_requests"].get<int64_t>()) +
        " requests, Poisson arrivals (seed " + std::to_string(report["arrival_seed"].get<uint64_t>()) +
        "; rate inf = all at t = 0); tokenizer " + t["tokenizer"].get<std::string>() + "; input mean " +
        Fixed(t["input_len"]["mean"], 1) + " (max " + Cell(t["input_len"]["max"]) + "), output mean " +
        Fixed(t["output_len"]["mean"], 1) + " (max " + Cell(t["output_len"]["max"]) + ") tokens\n";
  md += "- engine (both): KV " + Cell(c["num_device_blocks"]) + " blocks x " + Cell(c["block_size"]) +
        " tokens; swap " + Cell(c["num_host_blocks"]) + " blocks; max_num_seqs " + Cell(c["max_num_seqs"]) +
        ", max_num_batched_tokens " + Cell(c["max_num_batched_tokens"]) + ", max_model_len " +
        Cell(c["max_model_len"]) + ", preemption " + c["preemption_mode"].get<std::string>() + "\n";
  md += "- order: per rate (and repeat), the library run, then the server run (one server for all rates; a "
        "warm-up request before each run on both sides)\n\n";
  md += "TTFT: arrival (scheduled send time) to the first token (library: the engine's stream callback; server: "
        "the first SSE event with a choice, as the client reads it). TPOT = (finish - first token) / (output tokens "
        "- 1). e2e = finish - arrival. Throughput = completed requests (output tokens) / (last finish - first "
        "arrival). A server request counts as failed unless it streams to finish_reason \"length\" with "
        "usage.completion_tokens = the trace's output length. CPU = user + system seconds over the run "
        "(library: the benchmark process; server: the server process + the client). Prefill tokens = prompt "
        "tokens the engine processed, recomputation after preemption included. Other load = CPU that other "
        "processes on the machine used during the run, in cores (0 on an otherwise idle machine); runs with other "
        "load are not clean comparisons.\n\n";
  md += "| rate (req/s) | side | done / failed | req/s | output tok/s | TTFT p50 / p90 / p99 (s) | "
        "TPOT p50 / p90 / p99 (s) | e2e p50 / p99 (s) | preemptions | prefill tokens | CPU (s) | "
        "other load (cores) | duration (s) |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    const std::string rate = RunLabel(r);
    for (const char* side : {"library", "server"}) {
      const Json& s = r[side];
      const std::string cpu =
          std::string(side) == "library"
              ? Cell(s["process_cpu_s"], 1)
              : (s.contains("server_cpu_s") ? Cell(s["server_cpu_s"], 1) + " + " : std::string("? + ")) +
                    Cell(s["client_cpu_s"], 1) + " client";
      md += "| " + rate + " | " + side + " | " + Cell(s["completed"]) + " / " + Cell(s["failed"]) + " | " +
            Fixed(s["throughput_req_s"], 2) + " | " + Fixed(s["throughput_output_tok_s"], 0) + " | " +
            Triple(s["ttft_s"]) + " | " + Triple(s["tpot_s"]) + " | " + Cell(s["e2e_s"]["p50"]) + " / " +
            Cell(s["e2e_s"]["p99"]) + " | " +
            std::to_string(s["preemptions"]["recompute"].get<int64_t>() + s["preemptions"]["swap"].get<int64_t>()) +
            " | " + Cell(s.value("prefill_tokens", Json(nullptr))) + " | " + cpu + " | " +
            Cell(s["other_load_cores"], 2) + " | " + Fixed(s["duration_s"], 1) + " |\n";
    }
  }
  md += "\n| rate (req/s) | server / library req/s | server / library output tok/s | HTTP overhead (1 - ratio) | "
        "TTFT p50 server - library (ms) | TPOT p50 server - library (ms) | e2e p50 server - library (ms) | "
        "SSE events per output token |\n";
  md += "|---|---|---|---|---|---|---|---|\n";
  for (const Json& r : report["runs"]) {
    const Json& cmp = r["comparison"];
    md += "| " + RunLabel(r) + " | " + Cell(cmp["throughput_req_ratio"], 3) + " | " +
          Cell(cmp["throughput_tok_ratio"], 3) + " | " + Percent(cmp["http_overhead"]) + " | " +
          Ms(cmp["ttft_p50_delta_s"]) + " | " + Ms(cmp["tpot_p50_delta_s"]) + " | " + Ms(cmp["e2e_p50_delta_s"]) +
          " | " + Cell(r["server"]["http"]["token_events_per_output_token"], 3) + " |\n";
  }
  if (report["repeats"].get<int>() > 1) {
    md += "\nOver the " + std::to_string(report["repeats"].get<int>()) + " repeats of each rate:\n\n"
          "| rate (req/s) | server / library output tok/s: median (min - max) | HTTP overhead: median |\n"
          "|---|---|---|\n";
    for (const Json& rate : report["rates_req_s"]) {
      std::vector<double> ratios;
      for (const Json& r : report["runs"]) {
        if (r["rate_req_s"] == rate && r["comparison"]["throughput_tok_ratio"].is_number()) {
          ratios.push_back(r["comparison"]["throughput_tok_ratio"].get<double>());
        }
      }
      if (ratios.empty()) continue;
      std::sort(ratios.begin(), ratios.end());
      const double median = Percentile(ratios, 0.5);
      md += "| " + RateLabel(RateFromJson(rate)) + " | " + Fixed(median, 3) + " (" + Fixed(ratios.front(), 3) + " - " +
            Fixed(ratios.back(), 3) + ") | " + Fixed(100 * (1 - median), 1) + "% |\n";
    }
  }
  bool any_failed = false;
  for (const Json& r : report["runs"]) {
    for (const char* side : {"library", "server"}) {
      if (r[side]["failed"].get<int64_t>() == 0) continue;
      any_failed = true;
      md += "\n- rate " + RunLabel(r) + ", " + side + ": " +
            Cell(r[side]["failed"]) + " failed; first: " + r[side].value("first_error", std::string("?"));
      if (r[side].contains("http")) md += "; reasons " + r[side]["http"]["failure_reasons"].dump();
    }
  }
  if (any_failed) md += "\n";
  if (!report["server_exit"].is_null()) {
    md += "\nServer exit after SIGTERM: " + report["server_exit"]["after_sigterm"].get<std::string>() + ".\n";
  }
  return md;
}

}  // namespace kvflow::bench::serving
