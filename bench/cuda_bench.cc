// CUDA kernel and end-to-end benchmarks, quoted against limits measured in the same run:
//   1. device copy bandwidth (cudaMemcpy device->device, 2 x bytes per copy) and a cuBLAS fp16
//      GEMM rate (8192^3): the physical limits the other figures are ratios of;
//   2. paged decode attention, batch {1, 8, 64, 256} x context {512, 2K, 8K, 32K}, 32 query heads,
//      KV heads {32, 8}, head_dim 128, block 16, shuffled blocks: achieved bandwidth (K/V + Q + O
//      bytes / time) as a share of the copy bandwidth;
//   3. paged prefill attention (causal) at 1K..16K tokens: TFLOP/s (4 s^2 h d / 2 causal FLOPs),
//      next to PyTorch SDPA when bench/prefill_sdpa_torch.py wrote its JSON;
//   4. end-to-end decode of a Llama-2-7B-shaped model with random fp16 weights: time per token at
//      batch 1 and context 1K vs the roofline (weight bytes + KV bytes) / copy bandwidth, and
//      throughput at batch 64.
// Every time is CUDA events around repeated launches after warm-up (median of repeats). Writes
// JSON + a Markdown table (default bench/results/cuda_<gpu>.{json,md}).
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "attention_decode.h"
#include "attention_prefill.h"
#include "model/llama_model.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "fill.h"

namespace {

using kvflow::cuda::DType;
using json = nlohmann::json;

#define CHECK_CUDA(expr)                                                                      \
  do {                                                                                        \
    cudaError_t e_ = (expr);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_RC(expr)                                                                              \
  do {                                                                                              \
    int rc_ = (expr);                                                                               \
    if (rc_ != 0) {                                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,                              \
                   cudaGetErrorString(static_cast<cudaError_t>(rc_)));                              \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Median milliseconds of `fn` over `repeats` timed runs of `inner` calls each, after warm-up.
template <typename Fn>
double TimeMs(Fn&& fn, int inner = 10, int repeats = 5) {
  for (int i = 0; i < 3; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(a));
    for (int i = 0; i < inner; ++i) fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / inner);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double MeasureCopyBandwidth() {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer src(bytes), dst(bytes);
  CHECK_CUDA(cudaMemset(src.p, 1, bytes));
  const double ms = TimeMs([&] { CHECK_CUDA(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice)); }, 5, 5);
  return 2.0 * bytes / (ms * 1e-3) / 1e9;  // read + write, GB/s
}

double MeasureGemmTflops() {
  const int n = 8192;
  DeviceBuffer a(size_t{2} * n * n), b(size_t{2} * n * n), c(size_t{2} * n * n);
  CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, a.p, int64_t{n} * n, 1, 1.0f, 0.0f, nullptr));
  CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, b.p, int64_t{n} * n, 2, 1.0f, 0.0f, nullptr));
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.0f, zero = 0.0f;
  const double ms = TimeMs(
      [&] {
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.p, CUDA_R_16F, n, b.p, CUDA_R_16F, n, &zero, c.p,
                     CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      5, 5);
  cublasDestroy(h);
  return 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
}

// One layer's paged pools with `num_seqs` sequences of `context` tokens on shuffled blocks.
struct PagedSetup {
  int num_blocks = 0, max_blocks = 0;
  std::unique_ptr<DeviceBuffer> key, value, tables, context_lens, rows;
  PagedSetup(int num_seqs, int context, int kv_heads, int head_dim, int block_size, uint64_t seed) {
    max_blocks = (context + block_size - 1) / block_size;
    num_blocks = num_seqs * max_blocks;
    const size_t pool = size_t(num_blocks) * kv_heads * block_size * head_dim * 2;
    key = std::make_unique<DeviceBuffer>(pool);
    value = std::make_unique<DeviceBuffer>(pool);
    CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, key->p, int64_t(pool / 2), seed, 1.0f, 0.0f, nullptr));
    CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, value->p, int64_t(pool / 2), seed + 1, 1.0f, 0.0f, nullptr));
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
    tables = std::make_unique<DeviceBuffer>(ids.size() * 4);
    CHECK_CUDA(cudaMemcpy(tables->p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(static_cast<size_t>(num_seqs), context), row(static_cast<size_t>(num_seqs));
    std::iota(row.begin(), row.end(), 0);
    context_lens = std::make_unique<DeviceBuffer>(lens.size() * 4);
    rows = std::make_unique<DeviceBuffer>(row.size() * 4);
    CHECK_CUDA(cudaMemcpy(context_lens->p, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(rows->p, row.data(), row.size() * 4, cudaMemcpyHostToDevice));
  }
  // The pools and tables of this setup, fp16, for `heads` query heads over dense q/out rows.
  kvflow::cuda::PagedAttentionArgs Args(void* out, const void* query, int num_seqs, int heads, int kv_heads,
                                        int head_dim, int block_size) const {
    kvflow::cuda::PagedAttentionArgs a;
    a.dtype = DType::kF16;
    a.out = out;
    a.out_row_stride = heads * head_dim;
    a.query = query;
    a.query_row_stride = heads * head_dim;
    a.key_cache = key->p;
    a.value_cache = value->p;
    a.block_tables = tables->as<int32_t>();
    a.block_table_stride = max_blocks;
    a.context_lens = context_lens->as<int32_t>();
    a.num_seqs = num_seqs;
    a.num_heads = heads;
    a.num_kv_heads = kv_heads;
    a.head_dim = head_dim;
    a.block_size = block_size;
    a.scale = 1.0f / std::sqrt(float(head_dim));
    return a;
  }
};

json BenchDecode(double copy_gbs, size_t free_bytes) {
  json rows = json::array();
  const int H = 32, D = 128, BS = 16;
  for (int kv : {32, 8}) {
    for (int batch : {1, 8, 64, 256}) {
      for (int ctx : {512, 2048, 8192, 32768}) {
        const double kv_bytes = 2.0 * batch * double(ctx) * kv * D * 2;
        json r = {{"batch", batch}, {"context", ctx}, {"heads", H}, {"kv_heads", kv}, {"head_dim", D},
                  {"block_size", BS}, {"kv_read_mib", kv_bytes / (1 << 20)}};
        if (kv_bytes > 0.8 * free_bytes) {
          r["skipped"] = "KV does not fit the GPU";
          rows.push_back(r);
          continue;
        }
        PagedSetup s(batch, ctx, kv, D, BS, 7);
        DeviceBuffer q(size_t(batch) * H * D * 2), o(size_t(batch) * H * D * 2);
        CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, q.p, int64_t(batch) * H * D, 3, 1.0f, 0.0f, nullptr));
        const size_t ws = kvflow::cuda::PagedDecodeWorkspaceBytes(batch, H, D, ctx);
        DeviceBuffer workspace(ws);
        kvflow::cuda::PagedDecodeArgs a;
        static_cast<kvflow::cuda::PagedAttentionArgs&>(a) = s.Args(o.p, q.p, batch, H, kv, D, BS);
        a.query_rows = s.rows->as<int32_t>();
        a.max_context_len = ctx;
        a.workspace = workspace.p;
        a.workspace_bytes = ws;
        const double ms = TimeMs([&] { CHECK_RC(kvflow::cuda::PagedAttentionDecode(a, nullptr)); });
        const double bytes = kv_bytes + 2.0 * batch * H * D * 2;
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        r["time_us"] = ms * 1e3;
        r["achieved_gbs"] = gbs;
        r["pct_of_copy_bandwidth"] = 100.0 * gbs / copy_gbs;
        r["goal_applies"] = kv_bytes >= 64.0 * (1 << 20);
        spdlog::info("decode b={:3d} ctx={:5d} kv={:2d}: {:8.1f} us {:7.1f} GB/s = {:5.1f}% of copy", batch, ctx, kv,
                     ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
        rows.push_back(r);
      }
    }
  }
  return rows;
}

json BenchPrefill(double gemm_tflops) {
  json rows = json::array();
  const int H = 32, D = 128, BS = 16;
  for (int kv : {32, 8}) {
    for (int s : {1024, 2048, 4096, 8192, 16384}) {
      PagedSetup p(1, s, kv, D, BS, 11);
      DeviceBuffer q(size_t(s) * H * D * 2), o(size_t(s) * H * D * 2);
      CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, q.p, int64_t(s) * H * D, 5, 1.0f, 0.0f, nullptr));
      const int32_t zero = 0;
      DeviceBuffer starts(4), lens(4);
      CHECK_CUDA(cudaMemcpy(starts.p, &zero, 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(lens.p, &s, 4, cudaMemcpyHostToDevice));
      kvflow::cuda::PagedPrefillArgs a;
      static_cast<kvflow::cuda::PagedAttentionArgs&>(a) = p.Args(o.p, q.p, 1, H, kv, D, BS);
      a.query_starts = starts.as<int32_t>();
      a.query_lens = lens.as<int32_t>();
      a.max_query_len = s;
      const double ms = TimeMs([&] { CHECK_RC(kvflow::cuda::PagedAttentionPrefill(a, nullptr)); }, 5, 5);
      const double flops = 4.0 * double(s) * s * H * D / 2.0;  // causal
      const double tflops = flops / (ms * 1e-3) / 1e12;
      spdlog::info("prefill s={:5d} kv={:2d}: {:8.3f} ms {:6.1f} TFLOP/s ({:4.1f}% of the measured GEMM rate)", s, kv, ms,
                   tflops, 100.0 * tflops / gemm_tflops);
      rows.push_back({{"tokens", s}, {"heads", H}, {"kv_heads", kv}, {"head_dim", D}, {"block_size", BS},
                      {"time_ms", ms}, {"tflops", tflops}, {"pct_of_gemm_rate", 100.0 * tflops / gemm_tflops}});
    }
  }
  return rows;
}

kvflow::ModelConfig Llama2_7B() {
  kvflow::ModelConfig c;
  c.name = "llama-2-7b-shape (random fp16 weights)";
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5f;
  return c;
}

// Fills `batch` with `num_seqs` sequences each owning contiguous-id blocks of a shuffled pool.
struct DecodeDriver {
  int block_size;
  std::vector<std::vector<kvflow::BlockId>> tables;
  std::vector<int> lens;
  std::vector<kvflow::BlockId> free;
  DecodeDriver(int num_blocks, int bs, int num_seqs) : block_size(bs), tables(num_seqs), lens(num_seqs, 0) {
    free.resize(static_cast<size_t>(num_blocks));
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), std::mt19937(3));
  }
  void Add(kvflow::ForwardBatch& b, int seq, int n, kvflow::LogitsMode logits) {
    kvflow::SequenceSlice s;
    s.token_offset = static_cast<int32_t>(b.tokens.size());
    s.num_tokens = n;
    for (int i = 0; i < n; ++i) {
      b.tokens.push_back((seq * 7919 + lens[seq]) % 32000);
      b.positions.push_back(lens[seq]++);
    }
    s.context_len = lens[seq];
    auto& t = tables[seq];
    while (static_cast<int>(t.size()) * block_size < lens[seq]) {
      t.push_back(free.back());
      free.pop_back();
    }
    s.block_table = t;
    s.logits = logits;
    b.seqs.push_back(s);
  }
};

json BenchEndToEnd(double copy_gbs, int context, int steps) {
  json out;
  const kvflow::ModelConfig config = Llama2_7B();
  for (int batch : {1, 64}) {
    kvflow::CudaBackendOptions o;
    o.dtype = "fp16";
    o.block_size = 16;
    o.max_num_seqs = batch;
    o.max_num_batched_tokens = 4096;
    o.max_model_len = context + steps + 16;
    o.gpu_memory_utilization = 0.92;
    auto created = kvflow::CreateCudaBackendWithRandomWeights(config, o, 42);
    if (!created.ok()) {
      out[fmt::format("batch_{}", batch)] = {{"error", created.status().ToString()}};
      continue;
    }
    auto backend = std::move(created).value();
    spdlog::info("{}", backend->Describe());
    DecodeDriver d(backend->kv_layout().num_blocks, o.block_size, batch);
    std::vector<float> logits;
    // Prefill every sequence to `context` tokens, a few sequences per step.
    for (int seq = 0; seq < batch;) {
      kvflow::ForwardBatch b;
      int tokens = 0;
      while (seq < batch && tokens + context <= o.max_num_batched_tokens) {
        d.Add(b, seq++, context, kvflow::LogitsMode::kLast);
        tokens += context;
      }
      if (b.seqs.empty()) d.Add(b, seq++, context, kvflow::LogitsMode::kLast);
      if (auto st = kvflow::LlamaModel(*backend).Forward(b, logits); !st.ok()) {
        spdlog::error("prefill: {}", st.ToString());
        std::exit(1);
      }
    }
    // Decode steps, timed host-to-host (the engine's view: metadata upload, graph, logits copy).
    std::vector<double> ms;
    for (int i = 0; i < steps; ++i) {
      kvflow::ForwardBatch b;
      for (int seq = 0; seq < batch; ++seq) d.Add(b, seq, 1, kvflow::LogitsMode::kLast);
      const auto t0 = std::chrono::steady_clock::now();
      if (auto st = kvflow::LlamaModel(*backend).Forward(b, logits); !st.ok()) {
        spdlog::error("decode: {}", st.ToString());
        std::exit(1);
      }
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    ms.erase(ms.begin(), ms.begin() + std::min<size_t>(3, ms.size()));  // first steps capture graphs
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    const double weight_bytes = 2.0 * (double(config.vocab_size) * config.hidden_size * 2 +
                                       config.num_layers * (4.0 * config.hidden_size * config.hidden_size +
                                                            3.0 * config.hidden_size * config.intermediate_size));
    const double kv_bytes = 2.0 * batch * double(context + steps / 2) * config.num_layers * config.num_kv_heads *
                            config.head_dim * 2;
    const double roofline_ms = (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3;
    json r = {{"batch", batch}, {"context", context}, {"median_step_ms", median},
              {"tokens_per_s", batch / (median * 1e-3)}, {"weight_gib", weight_bytes / double(1 << 30)},
              {"kv_read_gib", kv_bytes / double(1 << 30)}, {"roofline_ms", roofline_ms},
              {"pct_of_roofline", 100.0 * roofline_ms / median}, {"backend", backend->Describe()}};
    spdlog::info("e2e batch {}: {:.2f} ms/step, {:.1f} tok/s, roofline {:.2f} ms = {:.1f}%", batch, median,
                 batch / (median * 1e-3), roofline_ms, 100.0 * roofline_ms / median);
    out[fmt::format("batch_{}", batch)] = r;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("kvflow CUDA benchmarks (needs a GPU)");
  std::string out_dir = std::string(KVFLOW_SOURCE_DIR) + "/bench/results";
  std::string sdpa_json;
  bool skip_e2e = false;
  int e2e_context = 1024, e2e_steps = 32;
  app.add_option("--out-dir", out_dir, "Where cuda_<gpu>.json/.md go");
  app.add_option("--sdpa-json", sdpa_json, "PyTorch SDPA figures from bench/prefill_sdpa_torch.py");
  app.add_flag("--skip-e2e", skip_e2e, "Skip the Llama-2-7B-shaped end-to-end decode");
  app.add_option("--e2e-context", e2e_context, "Context of the end-to-end decode")->default_val(1024);
  app.add_option("--e2e-steps", e2e_steps, "Decode steps timed")->default_val(32);
  CLI11_PARSE(app, argc, argv);
  if (kvflow::cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA GPU: %s\n", kvflow::cuda::DeviceDescription(0).c_str());
    return 77;
  }
  const std::string device = kvflow::cuda::DeviceDescription(0);
  spdlog::info("device: {}", device);
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));

  json result;
  result["device"] = device;
  const double copy_gbs = MeasureCopyBandwidth();
  const double gemm = MeasureGemmTflops();
  spdlog::info("copy bandwidth {:.0f} GB/s, cuBLAS fp16 GEMM {:.0f} TFLOP/s", copy_gbs, gemm);
  result["copy_bandwidth_gbs"] = copy_gbs;
  result["cublas_fp16_gemm_tflops"] = gemm;
  result["decode_attention"] = BenchDecode(copy_gbs, free_bytes);
  result["prefill_attention"] = BenchPrefill(gemm);
  if (!sdpa_json.empty()) {
    try {
      result["prefill_sdpa_torch"] = json::parse(std::ifstream(sdpa_json));
    } catch (const std::exception& e) {
      spdlog::warn("cannot read {}: {}", sdpa_json, e.what());
    }
  }
  if (!skip_e2e) result["end_to_end_llama2_7b_shape"] = BenchEndToEnd(copy_gbs, e2e_context, e2e_steps);

  std::string tag = device.substr(0, device.find(" ("));
  std::replace_if(tag.begin(), tag.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '_');
  const std::string base = out_dir + "/cuda_" + tag;
  // Markdown summary.
  std::ofstream md(base + ".md");
  md << "# CUDA benchmarks on " << device << "\n\n";
  md << fmt::format("Measured in this run: device copy bandwidth **{:.0f} GB/s**, cuBLAS fp16 GEMM (8192^3) **{:.0f} TFLOP/s**.\n\n",
                    copy_gbs, gemm);
  md << "## Paged decode attention (32 query heads, head_dim 128, block 16, fp16)\n\n";
  md << "| kv heads | batch | context | KV read MiB | time us | GB/s | % of copy bandwidth |\n|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : result["decode_attention"]) {
    if (r.contains("skipped")) {
      md << fmt::format("| {} | {} | {} | {:.0f} | - | - | skipped: {} |\n", r["kv_heads"].get<int>(), r["batch"].get<int>(),
                        r["context"].get<int>(), r["kv_read_mib"].get<double>(), r["skipped"].get<std::string>());
      continue;
    }
    md << fmt::format("| {} | {} | {} | {:.0f} | {:.1f} | {:.0f} | {:.1f}%{} |\n", r["kv_heads"].get<int>(), r["batch"].get<int>(),
                      r["context"].get<int>(), r["kv_read_mib"].get<double>(), r["time_us"].get<double>(),
                      r["achieved_gbs"].get<double>(), r["pct_of_copy_bandwidth"].get<double>(),
                      r["goal_applies"].get<bool>() ? "" : " (< 64 MiB)");
  }
  md << "\n## Paged prefill attention (causal, 32 heads, head_dim 128, fp16)\n\n";
  md << "| kv heads | tokens | ms | TFLOP/s | % of GEMM rate | SDPA (flash) TFLOP/s | kvflow / SDPA |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n";
  for (auto& r : result["prefill_attention"]) {
    std::string sdpa = "-", ratio = "-";
    if (result.contains("prefill_sdpa_torch") && result["prefill_sdpa_torch"].contains("rows")) {
      for (const auto& t : result["prefill_sdpa_torch"]["rows"]) {
        if (t.value("tokens", 0) == r["tokens"].get<int>() && t.value("kv_heads", 0) == r["kv_heads"].get<int>()) {
          const double ref = t.value("tflops", 0.0);
          sdpa = fmt::format("{:.1f}", ref);
          if (ref > 0) {
            ratio = fmt::format("{:.2f}x", r["tflops"].get<double>() / ref);
            r["ratio_to_sdpa"] = r["tflops"].get<double>() / ref;
          }
        }
      }
    }
    md << fmt::format("| {} | {} | {:.3f} | {:.1f} | {:.1f}% | {} | {} |\n", r["kv_heads"].get<int>(), r["tokens"].get<int>(),
                      r["time_ms"].get<double>(), r["tflops"].get<double>(), r["pct_of_gemm_rate"].get<double>(), sdpa,
                      ratio);
  }
  if (result.contains("end_to_end_llama2_7b_shape")) {
    md << "\n## End-to-end decode, Llama-2-7B shape, random fp16 weights\n\n";
    md << "| batch | context | ms/step | tokens/s | roofline ms | % of roofline |\n|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& [k, r] : result["end_to_end_llama2_7b_shape"].items()) {
      if (r.contains("error")) {
        md << "| " << k << " | error: " << r["error"].get<std::string>() << " |\n";
        continue;
      }
      md << fmt::format("| {} | {} | {:.2f} | {:.1f} | {:.2f} | {:.1f}% |\n", r["batch"].get<int>(), r["context"].get<int>(),
                        r["median_step_ms"].get<double>(), r["tokens_per_s"].get<double>(), r["roofline_ms"].get<double>(),
                        r["pct_of_roofline"].get<double>());
    }
  }
  std::ofstream(base + ".json") << result.dump(2) << "\n";
  spdlog::info("wrote {}.json and {}.md", base, base);
  return 0;
}
