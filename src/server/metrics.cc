#include "server/metrics.h"

#include <algorithm>
#include <cstdio>

namespace kvflow::server {
namespace {

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

void Metric(std::string* out, const std::string& name, const char* type, const std::string& help, double value) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + Num(value) + "\n";
}

}  // namespace

void Histogram::Observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[bucket];
  sum_ += v;
  ++count_;
}

void Histogram::Render(const std::string& name, const std::string& help, std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    char le[32];
    std::snprintf(le, sizeof(le), "%g", bounds_[i]);
    *out += name + "_bucket{le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  cumulative += counts_.back();
  *out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  *out += name + "_sum " + Num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

// Buckets as vLLM sets them.
ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0}),
      tpot_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}),
      e2e_({1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0}) {}

void ServerMetrics::RecordRequest(double ttft_s, double e2e_s, int64_t completion_tokens,
                                  const std::string& finish_reason) {
  if (completion_tokens > 0) ttft_.Observe(ttft_s);
  if (completion_tokens > 1) tpot_.Observe((e2e_s - ttft_s) / static_cast<double>(completion_tokens - 1));
  e2e_.Observe(e2e_s);
  std::lock_guard<std::mutex> lock(mu_);
  ++success_by_reason_[finish_reason];
}

void ServerMetrics::RecordHttpStatus(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++http_by_status_[status];
}

std::string ServerMetrics::Render(const EngineStats& s, std::span<const SystemMetric> system_metrics) const {
  std::string out;
  Metric(&out, "kvflow:num_requests_running", "gauge", "Requests in the running batch.", s.num_running);
  Metric(&out, "kvflow:num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s.num_waiting);
  Metric(&out, "kvflow:num_requests_swapped", "gauge", "Requests swapped out to host memory.", s.num_swapped);
  Metric(&out, "kvflow:num_requests_in_flight", "gauge", "HTTP generation requests being served.",
         in_flight_.load());
  Metric(&out, "kvflow:kv_cache_blocks_total", "gauge", "KV cache blocks on the device.", s.kv_blocks_total);
  Metric(&out, "kvflow:kv_cache_blocks_free", "gauge", "Allocatable device KV blocks (unused prefix-cache blocks "
         "included).", s.kv_blocks_free);
  Metric(&out, "kvflow:kv_cache_usage_perc", "gauge", "Fraction of device KV blocks in use (1 = full).",
         s.kv_blocks_total ? 1.0 - static_cast<double>(s.kv_blocks_free) / s.kv_blocks_total : 0.0);
  Metric(&out, "kvflow:host_kv_cache_blocks_total", "gauge", "Host (swap) KV blocks.", s.host_blocks_total);
  Metric(&out, "kvflow:host_kv_cache_blocks_free", "gauge", "Free host (swap) KV blocks.", s.host_blocks_free);
  Metric(&out, "kvflow:host_kv_cache_usage_perc", "gauge", "Fraction of host KV blocks in use.",
         s.host_blocks_total ? 1.0 - static_cast<double>(s.host_blocks_free) / s.host_blocks_total : 0.0);
  Metric(&out, "kvflow:prefix_cache_hit_rate", "gauge", "Share of full prompt blocks not computed: found on the device or supplied by a KV connector "
         "(the host prefix cache, a prompt prefill across ranks).",
         s.prefix_cache_hit_rate);
  Metric(&out, "kvflow:prefix_cache_queried_blocks_total", "counter",
         "Full prompt blocks looked up in the device prefix cache.", static_cast<double>(s.prefix_cache_queried_blocks));
  Metric(&out, "kvflow:prefix_cache_hit_blocks_total", "counter", "Of those, blocks found on the device.",
         static_cast<double>(s.prefix_cache_hit_blocks));
  Metric(&out, "kvflow:prompt_tokens_total", "counter", "Prompt tokens prefilled.",
         static_cast<double>(s.prompt_tokens_processed));
  Metric(&out, "kvflow:generation_tokens_total", "counter", "Tokens generated.",
         static_cast<double>(s.generated_tokens));
  Metric(&out, "kvflow:num_preemptions_total", "counter", "Preemptions (recompute and swap).",
         static_cast<double>(s.num_preemptions));
  Metric(&out, "kvflow:num_preemptions_swap_total", "counter", "Preemptions by swapping.",
         static_cast<double>(s.num_preemptions_swap));
  // Speculative decoding, as vLLM names its spec_decode counters.
  Metric(&out, "kvflow:spec_decode_num_drafts_total", "counter", "Verification passes of a sequence with drafts.",
         static_cast<double>(s.spec.num_drafts));
  Metric(&out, "kvflow:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
         static_cast<double>(s.spec.num_draft_tokens));
  Metric(&out, "kvflow:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
         static_cast<double>(s.spec.num_accepted_tokens));
  out += "# HELP kvflow:spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by draft position.\n"
         "# TYPE kvflow:spec_decode_num_accepted_tokens_per_pos_total counter\n";
  for (size_t i = 0; i < s.spec.accepted_per_position.size(); ++i) {
    out += "kvflow:spec_decode_num_accepted_tokens_per_pos_total{position=\"" + std::to_string(i) + "\"} " +
           Num(static_cast<double>(s.spec.accepted_per_position[i])) + "\n";
  }
  const KvSelectionStats& k = s.kv_selection;
  Metric(&out, "kvflow:kv_selection_decode_tokens_total", "counter",
         "Decode tokens whose attention read a KV selection (--kv-selection infinigen or h2o).",
         static_cast<double>(k.decode_tokens));
  Metric(&out, "kvflow:kv_selection_tokens_selected_total", "counter",
         "Cached tokens read by layers that read a selection (per KV head, the step's own included).",
         static_cast<double>(k.tokens_selected));
  Metric(&out, "kvflow:kv_selection_tokens_available_total", "counter",
         "Cached tokens those layers could have read (selection fraction = selected / available).",
         static_cast<double>(k.tokens_available));
  Metric(&out, "kvflow:kv_selection_fraction", "gauge", "Tokens selected / available so far.", k.selection_fraction());
  Metric(&out, "kvflow:kv_selection_bytes_read_total", "counter",
         "K/V bytes attention read over all layers of those decode tokens (what an offloaded cache fetches).",
         static_cast<double>(k.bytes_read));
  Metric(&out, "kvflow:kv_selection_bytes_full_total", "counter", "K/V bytes full attention would have read.",
         static_cast<double>(k.bytes_full));
  Metric(&out, "kvflow:kv_selection_tokens_evicted_total", "counter",
         "Cached tokens InfiniGen's capped host KV pool evicted, once per token and layer (--infinigen-host-kv-tokens).",
         static_cast<double>(k.tokens_evicted));
  Metric(&out, "kvflow:kv_selection_bytes_per_token", "gauge", "K/V bytes read per selecting decode token so far.",
         k.decode_tokens > 0 ? static_cast<double>(k.bytes_read) / static_cast<double>(k.decode_tokens) : 0.0);
  // Every system's own metrics (SystemInfo::metrics), samples of one name together.
  for (size_t i = 0; i < system_metrics.size(); ++i) {
    const SystemMetric& m = system_metrics[i];
    if (i == 0 || system_metrics[i - 1].name != m.name) {
      out += "# HELP " + m.name + " " + m.help + "\n# TYPE " + m.name + (m.counter ? " counter\n" : " gauge\n");
    }
    out += m.name + (m.labels.empty() ? "" : "{" + m.labels + "}") + " " + Num(m.value) + "\n";
  }
  Metric(&out, "kvflow:request_cancelled_total", "counter", "Requests cancelled (client gone or shutdown).",
         static_cast<double>(cancelled_.load()));
  Metric(&out, "kvflow:request_failure_total", "counter", "Requests that failed in the engine.",
         static_cast<double>(failed_.load()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    out += "# HELP kvflow:request_success_total Requests finished, by finish reason.\n"
           "# TYPE kvflow:request_success_total counter\n";
    for (const char* reason : {"stop", "length"}) {
      auto it = success_by_reason_.find(reason);
      out += std::string("kvflow:request_success_total{finished_reason=\"") + reason + "\"} " +
             std::to_string(it == success_by_reason_.end() ? 0 : it->second) + "\n";
    }
    out += "# HELP kvflow:http_requests_total HTTP responses, by status code.\n"
           "# TYPE kvflow:http_requests_total counter\n";
    for (const auto& [status, count] : http_by_status_) {
      out += "kvflow:http_requests_total{code=\"" + std::to_string(status) + "\"} " + std::to_string(count) + "\n";
    }
  }
  ttft_.Render("kvflow:time_to_first_token_seconds", "Time to the first token, from arrival.", &out);
  tpot_.Render("kvflow:time_per_output_token_seconds", "Time per output token after the first.", &out);
  e2e_.Render("kvflow:e2e_request_latency_seconds", "Time from arrival to the last token.", &out);
  return out;
}

}  // namespace kvflow::server
