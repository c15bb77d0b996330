// CUDA kernel and end-to-end benchmarks, quoted against limits measured in the same run. Sections
// (--sections; "limits" always runs, the others are ratios of it):
//   limits:  device copy bandwidth (cudaMemcpy device->device, 2 x bytes per copy) and a cuBLAS
//            fp16 GEMM rate (8192^3);
//   decode:  paged decode attention, batch {1, 16, 64, 256} x context {512, 2K, 8K, 32K} for the
//            (query heads, KV heads, head_dim) of Llama-3-8B (32, 8, 128), an MHA model (32, 32,
//            128) and SmolLM2 (9, 3, 64), block 16, shuffled blocks: achieved bandwidth (K/V + Q + O
//            bytes / time) as a share of the copy bandwidth;
//   prefill: paged prefill attention (causal) at 1K..16K tokens: TFLOP/s (4 s^2 h d / 2 causal
//            FLOPs), next to PyTorch SDPA when bench/prefill_sdpa_torch.py wrote its JSON;
//   e2e:     end-to-end decode of SmolLM2-135M, Llama-3.1-8B and Llama-2-7B shapes with random fp16
//            weights (speed is real, outputs are meaningless) at batch {1, 16, 64, 256}, CUDA graphs
//            on and off, after a prefill to --e2e-context tokens: time per step (host to host, greedy
//            sampling on the device as the engine does) vs the roofline, the bytes a step must read
//            (DecodeStepBytes) / copy bandwidth. A config that does not fit is recorded as skipped.
//   moe:     the grouped expert GEMM (kernels/moe.cu) on Qwen3-30B-A3B's, OLMoE's and Mixtral-8x7B's
//            expert shapes (random fp16 weights, random distinct top-k experts per token), one layer's
//            gate|up GEMM, SiLU * up and down GEMM at 1..4096 tokens, against one cuBLAS GEMM pair per
//            routed expert over rows already grouped (the loop a host that knew the counts would run),
//            and against the limits: the routed experts' bytes / copy bandwidth, and the FLOPs / the
//            cuBLAS GEMM rate.
// Kernel times are CUDA events around repeated launches after warm-up (median of repeats). Writes
// JSON + Markdown (default bench/results/cuda_<gpu>.{json,md}), rewritten after every section and
// every end-to-end config, so a run cut short by a timeout keeps what it finished.
// --print-roofline prints the roofline byte counts and exits, without a GPU.
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "attention_decode.h"
#include "bench_files.h"
#include "attention_prefill.h"
#include "forward/llama_model.h"
#include "model/model_shapes.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "activation.h"
#include "fill.h"
#include "moe.h"

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

// Free device memory now (the sections allocate and free as they go).
size_t FreeDeviceBytes() {
  size_t free_bytes = 0, total_bytes = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

json BenchDecode(double copy_gbs) {
  json rows = json::array();
  const int BS = 16;
  struct Heads {
    int q, kv, dim;
    const char* model;
  };
  const Heads shapes[] = {{32, 8, 128, "llama-3-8b"}, {32, 32, 128, "mha"}, {9, 3, 64, "smollm2"}};
  for (const Heads& sh : shapes) {
    const int H = sh.q, kv = sh.kv, D = sh.dim;
    for (int batch : {1, 16, 64, 256}) {
      for (int ctx : {512, 2048, 8192, 32768}) {
        const double kv_bytes = 2.0 * batch * double(ctx) * kv * D * 2;
        json r = {{"shape", sh.model}, {"batch", batch}, {"context", ctx}, {"heads", H}, {"kv_heads", kv},
                  {"head_dim", D}, {"block_size", BS}, {"kv_read_mib", kv_bytes / (1 << 20)}};
        if (kv_bytes > 0.8 * double(FreeDeviceBytes())) {
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
        spdlog::info("decode {}/{}/{} b={:3d} ctx={:5d}: {:8.1f} us {:7.1f} GB/s = {:5.1f}% of copy", H, kv, D, batch,
                     ctx, ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
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

// ---- Mixture of experts ----

json BenchMoe(double copy_gbs, double gemm_tflops) {
  json rows = json::array();
  struct Shape {
    const char* model;
    int H, F, E, K;
  };
  const Shape shapes[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8},
                          {"olmoe-1b-7b", 2048, 1024, 64, 8},
                          {"mixtral-8x7b", 4096, 14336, 8, 2}};
  cublasHandle_t blas;
  cublasCreate(&blas);
  const float one = 1.0f, zero = 0.0f;
  // y[m, n] = x[m, k] w[n, k]^T, row-major (the backend's Gemm).
  auto gemm = [&](const void* x, const void* w, void* y, int m, int n, int k) {
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16F, k, x, CUDA_R_16F, k, &zero, y,
                 CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  for (const Shape& sh : shapes) {
    const size_t H = sh.H, F = sh.F, E = sh.E;
    DeviceBuffer w_gate_up(E * 2 * F * H * 2), w_down(E * H * F * 2);
    CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, w_gate_up.p, int64_t(E * 2 * F * H), 21, 0.02f, 0.0f, nullptr));
    CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, w_down.p, int64_t(E * H * F), 22, 0.02f, 0.0f, nullptr));
    for (int tokens : {1, 8, 64, 512, 4096}) {
      const int pairs = tokens * sh.K;
      // Random distinct experts per token (a trained router's choice is not uniform; this is the
      // spread a random-weight model gives).
      std::mt19937 rng(static_cast<uint32_t>(tokens * 31 + sh.E));
      std::vector<int32_t> ids;
      std::vector<int> order(E);
      std::iota(order.begin(), order.end(), 0);
      for (int t = 0; t < tokens; ++t) {
        std::shuffle(order.begin(), order.end(), rng);
        ids.insert(ids.end(), order.begin(), order.begin() + sh.K);
      }
      std::vector<int> count(E, 0);
      for (int32_t e : ids) ++count[e];
      const int routed = static_cast<int>(std::count_if(count.begin(), count.end(), [](int c) { return c > 0; }));
      const int tile = kvflow::cuda::MoeTileRows(pairs, sh.E);
      const int max_tiles = static_cast<int>(kvflow::cuda::MoeMaxTiles(pairs, sh.E, tile));
      DeviceBuffer d_ids(ids.size() * 4), x(size_t(tokens) * H * 2), gate_up(size_t(pairs) * 2 * F * 2),
          act(size_t(pairs) * F * 2), out(size_t(pairs) * H * 2), grouped_x(size_t(pairs) * H * 2),
          sorted(size_t(kvflow::cuda::MoeSortedCapacity(pairs, sh.E, tile)) * 4), tile_expert(size_t(max_tiles) * 4),
          num_tiles(4);
      CHECK_CUDA(cudaMemcpy(d_ids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, x.p, int64_t(tokens) * sh.H, 23, 1.0f, 0.0f, nullptr));
      CHECK_RC(kvflow::cuda::FillUniform(DType::kF16, grouped_x.p, int64_t(pairs) * sh.H, 24, 1.0f, 0.0f, nullptr));
      const double group_ms = TimeMs([&] {
        CHECK_RC(kvflow::cuda::MoeGroupByExpert(d_ids.as<int32_t>(), pairs, sh.E, tile, sorted.as<int32_t>(),
                                                tile_expert.as<int32_t>(), num_tiles.as<int32_t>(), nullptr));
      });
      const double grouped_ms = TimeMs([&] {
        CHECK_RC(kvflow::cuda::MoeGroupedGemm(DType::kF16, x.p, sh.K, w_gate_up.p, gate_up.p, 2 * sh.F, sh.H,
                                              sorted.as<int32_t>(), tile_expert.as<int32_t>(), num_tiles.as<int32_t>(),
                                              max_tiles, tile, nullptr));
        CHECK_RC(kvflow::cuda::SiluAndMul(DType::kF16, gate_up.p, act.p, pairs, sh.F, nullptr));
        CHECK_RC(kvflow::cuda::MoeGroupedGemm(DType::kF16, act.p, 1, w_down.p, out.p, sh.H, sh.F, sorted.as<int32_t>(),
                                              tile_expert.as<int32_t>(), num_tiles.as<int32_t>(), max_tiles, tile,
                                              nullptr));
      });
      // The baseline: the rows already grouped by expert (grouped_x), one cuBLAS GEMM pair per
      // routed expert; the gather it would need is not timed.
      const double cublas_ms = TimeMs([&] {
        size_t row = 0;
        for (size_t e = 0; e < E; ++e) {
          const int c = count[e];
          if (c == 0) continue;
          char* gu = static_cast<char*>(gate_up.p) + row * 2 * F * 2;
          char* a = static_cast<char*>(act.p) + row * F * 2;
          gemm(static_cast<char*>(grouped_x.p) + row * H * 2, static_cast<char*>(w_gate_up.p) + e * 2 * F * H * 2, gu,
               c, 2 * sh.F, sh.H);
          CHECK_RC(kvflow::cuda::SiluAndMul(DType::kF16, gu, a, c, sh.F, nullptr));
          gemm(a, static_cast<char*>(w_down.p) + e * H * F * 2, static_cast<char*>(out.p) + row * H * 2, c, sh.H,
               sh.F);
          row += static_cast<size_t>(c);
        }
      });
      const double expert_bytes = double(routed) * 3.0 * H * F * 2;
      const double act_bytes = double(pairs) * (H + 2 * F + 2 * F + F + F + H) * 2;
      const double flops = 2.0 * pairs * 3.0 * H * F;
      const double gbs = (expert_bytes + act_bytes) / (grouped_ms * 1e-3) / 1e9;
      const double tflops = flops / (grouped_ms * 1e-3) / 1e12;
      // The limit that binds: reading the routed experts once, or the GEMM rate.
      const double limit_ms = std::max((expert_bytes + act_bytes) / (copy_gbs * 1e9), flops / (gemm_tflops * 1e12)) * 1e3;
      spdlog::info("moe {} T={:4d}: {} experts routed, group {:.1f} us, grouped MLP {:.1f} us ({:.0f} GB/s, {:.1f} "
                   "TFLOP/s, {:.0f}% of the limit), cuBLAS per expert {:.1f} us ({:.2f}x)",
                   sh.model, tokens, routed, group_ms * 1e3, grouped_ms * 1e3, gbs, tflops,
                   100.0 * limit_ms / grouped_ms, cublas_ms * 1e3, cublas_ms / grouped_ms);
      rows.push_back({{"shape", sh.model},        {"hidden", sh.H},
                      {"expert_width", sh.F},     {"experts", sh.E},
                      {"top_k", sh.K},            {"tokens", tokens},
                      {"experts_routed", routed}, {"tile_rows", tile},
                      {"group_us", group_ms * 1e3}, {"grouped_mlp_us", grouped_ms * 1e3},
                      {"cublas_per_expert_us", cublas_ms * 1e3}, {"speedup_vs_cublas_per_expert", cublas_ms / grouped_ms},
                      {"achieved_gbs", gbs},      {"tflops", tflops},
                      {"limit_us", limit_ms * 1e3}, {"pct_of_limit", 100.0 * limit_ms / grouped_ms}});
    }
  }
  cublasDestroy(blas);
  return rows;
}

// ---- End-to-end decode ----

// The shapes --e2e-shapes can name, in the default order (model/model_shapes.h; not its test-only
// "tiny").
const std::vector<std::pair<std::string, kvflow::ModelConfig>>& KnownShapes() {
  static const std::vector<std::pair<std::string, kvflow::ModelConfig>> shapes = [] {
    std::vector<std::pair<std::string, kvflow::ModelConfig>> v;
    for (const std::string& name : kvflow::ModelShapeNames()) {
      if (name == "tiny") continue;
      kvflow::ModelConfig c = kvflow::ModelShape(name).value();
      c.name += " (random fp16 weights)";
      v.emplace_back(name, c);
    }
    return v;
  }();
  return shapes;
}

// Parameters stored (what the weights take on the device): the embedding table, and the LM head
// only when it is not tied to it. No biases: none of these shapes has them.
double ParamCount(const kvflow::ModelConfig& c) {
  const double H = c.hidden_size, F = c.intermediate_size;
  const double q = double(c.num_heads) * c.head_dim, kv = double(c.num_kv_heads) * c.head_dim;
  const double per_layer = H * q + 2 * H * kv + q * H + 3 * H * F + 2 * H;
  return c.num_layers * per_layer + H + double(c.vocab_size) * H * (c.tie_word_embeddings ? 1 : 2);
}

struct StepBytes {
  double weights = 0, kv = 0;
  double total() const { return weights + kv; }
};

// The bytes one decode step of `batch` sequences must read from device memory at least (fp16), the
// roofline's numerator. Weights: every layer's q/k/v/o projections (k and v are only num_kv_heads
// wide under GQA), gate/up/down and its two norms, the final norm and the LM head, whose vocab x
// hidden matrix is the embedding table when tied and so counted once either way; the embedding
// lookup reads only the batch's rows, not the table. KV: K and V of every layer for `kv_context`
// tokens (the context at the middle of the timed steps) per sequence. Activations and logits are
// left out: at these sizes they are a rounding error next to the weights.
StepBytes DecodeStepBytes(const kvflow::ModelConfig& c, int batch, double kv_context) {
  const double H = c.hidden_size, F = c.intermediate_size;
  const double q = double(c.num_heads) * c.head_dim, kv = double(c.num_kv_heads) * c.head_dim;
  const double per_layer = H * q + 2 * H * kv + q * H + 3 * H * F + 2 * H;
  const double weight_elems = c.num_layers * per_layer + H + double(c.vocab_size) * H + double(batch) * H;
  StepBytes b;
  b.weights = 2.0 * weight_elems;
  b.kv = 2.0 * 2.0 * batch * kv_context * c.num_layers * kv;
  return b;
}

// Decode steps run before the timed ones (the first captures the CUDA graph).
constexpr int kWarmupSteps = 3;

// Mean context a timed decode step attends to: the step's own token included, steps after the
// prefill to `context` and the warm-up.
double MidpointContext(int context, int steps) { return context + kWarmupSteps + (steps + 1) / 2.0; }

constexpr double kGiB = double(1 << 30);

// Fills `batch` with `num_seqs` sequences each owning blocks of a shuffled pool.
struct DecodeDriver {
  int block_size, vocab;
  std::vector<std::vector<kvflow::BlockId>> tables;
  std::vector<int> lens;
  std::vector<kvflow::BlockId> free;
  DecodeDriver(int num_blocks, int bs, int num_seqs, int vocab_size)
      : block_size(bs), vocab(vocab_size), tables(num_seqs), lens(num_seqs, 0) {
    free.resize(static_cast<size_t>(num_blocks));
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), std::mt19937(3));
  }
  // Appends `n` tokens of sequence `seq`; false when the pool has no block left for them.
  bool Add(kvflow::ForwardBatch& b, int seq, int n, kvflow::LogitsMode logits) {
    kvflow::SequenceSlice s;
    s.token_offset = static_cast<int32_t>(b.tokens.size());
    s.num_tokens = n;
    for (int i = 0; i < n; ++i) {
      b.tokens.push_back(static_cast<int32_t>((int64_t(seq) * 7919 + lens[seq]) % vocab));
      b.positions.push_back(lens[seq]++);
    }
    s.context_len = lens[seq];
    auto& t = tables[seq];
    while (static_cast<int>(t.size()) * block_size < lens[seq]) {
      if (free.empty()) return false;
      t.push_back(free.back());
      free.pop_back();
    }
    s.block_table = t;
    s.logits = logits;
    b.seqs.push_back(std::move(s));
    return true;
  }
};

// A rough upper bound of what CreateCudaBackendWithRandomWeights allocates for `o` (its carve in
// cuda_backend.cc, plus 1 GiB for cuBLAS, graphs, the decode workspace and slack): lets a config
// that cannot fit be skipped with a reason instead of tried.
double EstimateBackendBytes(const kvflow::ModelConfig& c, const kvflow::CudaBackendOptions& o) {
  const double H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const double q = double(c.num_heads) * c.head_dim, kv = double(c.num_kv_heads) * c.head_dim;
  const double T = std::max(o.max_num_batched_tokens, o.max_num_seqs);
  const double R = std::max(o.max_num_seqs, std::min(o.max_num_batched_tokens, 256));
  const double activations = T * (4 * H + 2 * H + 2 * 2 * (q + 2 * kv) + 2 * q + 2 * H + 2 * 2 * F + 2 * F) +
                             R * (4 * H + 2 * H + 4 * V) + 2.0 * 2 * o.max_model_len * kv;
  const double kv_pool = 2.0 * 2 * double(o.num_kv_blocks) * o.block_size * c.num_layers * kv;
  return 2.0 * ParamCount(c) + kv_pool + activations + kGiB;
}

// One end-to-end config: prefill `batch` sequences to `context` tokens, then `steps` timed decode
// steps. Fills `r`; failures go into r["error"] or r["skipped"], never out of the process.
void RunEndToEnd(const kvflow::ModelConfig& config, int batch, bool graphs, int context, int steps, json& r) {
  kvflow::CudaBackendOptions o;
  o.dtype = "fp16";
  o.block_size = 16;
  o.max_num_seqs = batch;
  // Large prefill steps: filling 256 x 1K tokens of an 8B model stays a few seconds.
  o.max_num_batched_tokens = 8192;
  o.max_model_len = context + kWarmupSteps + steps + 1;
  o.enable_cuda_graphs = graphs;
  // Exactly the blocks the run needs, rather than all the memory left (faster to allocate, and a
  // config that does not fit fails to allocate instead of running out of blocks).
  const int blocks_per_seq = (o.max_model_len + o.block_size - 1) / o.block_size;
  o.num_kv_blocks = batch * blocks_per_seq;
  o.gpu_memory_utilization = 0.95;

  size_t free_now = 0, total = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_now, &total); e != cudaSuccess) {
    r["error"] = std::string("cudaMemGetInfo: ") + cudaGetErrorString(e);
    return;
  }
  const double need = EstimateBackendBytes(config, o), free_bytes = double(free_now);
  r["kv_pool_gib"] = 2.0 * 2 * double(o.num_kv_blocks) * o.block_size * config.num_layers * config.num_kv_heads *
                     config.head_dim / kGiB;
  if (need > free_bytes) {
    r["skipped"] = fmt::format("needs ~{:.1f} GiB (weights {:.1f} + KV pool {:.1f} + activations), {:.1f} GiB free",
                               need / kGiB, 2.0 * ParamCount(config) / kGiB, r["kv_pool_gib"].get<double>(),
                               free_bytes / kGiB);
    return;
  }
  auto created = kvflow::CreateCudaBackendWithRandomWeights(config, o, 42);
  if (!created.ok()) {
    r["error"] = "backend creation: " + created.status().ToString();
    return;
  }
  std::unique_ptr<kvflow::Backend> backend = std::move(created).value();
  r["backend"] = backend->Describe();
  kvflow::LlamaModel model(*backend);
  DecodeDriver d(backend->kv_layout().num_blocks, o.block_size, batch, config.vocab_size);
  std::vector<float> logits;

  // Prefill in steps of max_num_batched_tokens: whole sequences side by side, a long one in
  // chunks; no logits (nothing is sampled from them).
  const auto p0 = std::chrono::steady_clock::now();
  for (int seq = 0; seq < batch;) {
    kvflow::ForwardBatch b;
    int budget = o.max_num_batched_tokens;
    while (seq < batch && budget > 0) {
      const int n = std::min(context - d.lens[seq], budget);
      if (!d.Add(b, seq, n, kvflow::LogitsMode::kNone)) {
        r["error"] = "prefill: out of KV blocks";
        return;
      }
      budget -= n;
      if (d.lens[seq] == context) ++seq;
    }
    if (auto st = model.Forward(b, logits); !st.ok()) {
      r["error"] = "prefill: " + st.ToString();
      return;
    }
  }
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
  r["prefill_s"] = prefill_s;
  r["prefill_tokens_per_s"] = double(batch) * context / prefill_s;

  // Decode steps timed host to host (the engine's view: metadata upload, graph launch or eager
  // kernels, greedy sampling on the device, the sampled tokens back on the host).
  kvflow::SamplingParams greedy;
  greedy.temperature = 0.0f;
  kvflow::DeviceSampleRow row;
  row.params = &greedy;
  const std::vector<kvflow::DeviceSampleRow> rows(static_cast<size_t>(batch), row);
  std::vector<kvflow::SampledToken> sampled;
  std::vector<double> ms;
  for (int i = 0; i < kWarmupSteps + steps; ++i) {
    kvflow::ForwardBatch b;
    for (int seq = 0; seq < batch; ++seq) {
      if (!d.Add(b, seq, 1, kvflow::LogitsMode::kLast)) {
        r["error"] = "decode: out of KV blocks";
        return;
      }
    }
    sampled.clear();
    const auto t0 = std::chrono::steady_clock::now();
    if (auto st = model.ForwardAndSample(b, rows, sampled); !st.ok()) {
      r["error"] = "decode: " + st.ToString();
      return;
    }
    if (i >= kWarmupSteps) {
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double roofline_ms = r["roofline_ms"].get<double>();
  r["sampling"] = "greedy, on the device";
  r["median_step_ms"] = median;
  r["tokens_per_s"] = batch / (median * 1e-3);
  r["pct_of_roofline"] = 100.0 * roofline_ms / median;
}

// Every shape x batch x graph mode into `rows`, calling `checkpoint` after each.
void BenchEndToEnd(double copy_gbs, const std::vector<std::string>& shapes, const std::vector<int>& batches,
                   const std::vector<bool>& graph_modes, int context, int steps, json& rows,
                   const std::function<void()>& checkpoint) {
  for (const std::string& key : shapes) {
    const auto it = std::find_if(KnownShapes().begin(), KnownShapes().end(),
                                 [&](const auto& s) { return s.first == key; });
    const kvflow::ModelConfig& config = it->second;
    for (int batch : batches) {
      for (bool graphs : graph_modes) {
        const StepBytes bytes = DecodeStepBytes(config, batch, MidpointContext(context, steps));
        const double roofline_ms = bytes.total() / (copy_gbs * 1e9) * 1e3;
        json r = {{"shape", key},
                  {"model", config.name},
                  {"cuda_graphs", graphs},
                  {"batch", batch},
                  {"context", context},
                  {"steps", steps},
                  {"kv_context", MidpointContext(context, steps)},
                  {"weight_gib", bytes.weights / kGiB},
                  {"kv_read_gib", bytes.kv / kGiB},
                  {"roofline_ms", roofline_ms}};
        RunEndToEnd(config, batch, graphs, context, steps, r);
        if (r.contains("median_step_ms")) {
          spdlog::info("e2e {} graphs {} batch {}: {:.2f} ms/step, {:.1f} tok/s, roofline {:.2f} ms = {:.1f}%", key,
                       graphs ? "on" : "off", batch, r["median_step_ms"].get<double>(),
                       r["tokens_per_s"].get<double>(), roofline_ms, r["pct_of_roofline"].get<double>());
        } else {
          spdlog::warn("e2e {} graphs {} batch {}: {}", key, graphs ? "on" : "off", batch,
                       r.value("skipped", r.value("error", std::string())));
        }
        rows.push_back(r);
        checkpoint();  // the backend is freed by now; a cut after this keeps the row
      }
    }
  }
}

// ---- Output ----

std::string RenderMarkdown(const json& result) {
  std::string md = fmt::format("# CUDA benchmarks on {}\n\n", result["device"].get<std::string>());
  const double copy_gbs = result["copy_bandwidth_gbs"].get<double>();
  md += fmt::format(
      "Measured in this run: device copy bandwidth **{:.0f} GB/s**, cuBLAS fp16 GEMM (8192^3) **{:.0f} TFLOP/s**.\n",
      copy_gbs, result["cublas_fp16_gemm_tflops"].get<double>());
  if (result.contains("decode_attention")) {
    md += "\n## Paged decode attention (block 16, fp16, shuffled blocks)\n\n";
    md += "| q heads | kv heads | head_dim | batch | context | KV read MiB | time us | GB/s | % of copy bandwidth |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& r : result["decode_attention"]) {
      const std::string head = fmt::format("| {} | {} | {} | {} | {} | {:.0f} |", r["heads"].get<int>(),
                                           r["kv_heads"].get<int>(), r["head_dim"].get<int>(), r["batch"].get<int>(),
                                           r["context"].get<int>(), r["kv_read_mib"].get<double>());
      if (r.contains("skipped")) {
        md += head + fmt::format(" - | - | skipped: {} |\n", r["skipped"].get<std::string>());
        continue;
      }
      md += head + fmt::format(" {:.1f} | {:.0f} | {:.1f}%{} |\n", r["time_us"].get<double>(),
                               r["achieved_gbs"].get<double>(), r["pct_of_copy_bandwidth"].get<double>(),
                               r["goal_applies"].get<bool>() ? "" : " (< 64 MiB)");
    }
  }
  if (result.contains("prefill_attention")) {
    md += "\n## Paged prefill attention (causal, 32 heads, head_dim 128, fp16)\n\n";
    md += "| kv heads | tokens | ms | TFLOP/s | % of GEMM rate | SDPA (flash) TFLOP/s | kvflow / SDPA |\n"
          "|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& r : result["prefill_attention"]) {
      md += fmt::format("| {} | {} | {:.3f} | {:.1f} | {:.1f}% | {} | {} |\n", r["kv_heads"].get<int>(),
                        r["tokens"].get<int>(), r["time_ms"].get<double>(), r["tflops"].get<double>(),
                        r["pct_of_gemm_rate"].get<double>(),
                        r.contains("sdpa_tflops") ? fmt::format("{:.1f}", r["sdpa_tflops"].get<double>()) : "-",
                        r.contains("ratio_to_sdpa") ? fmt::format("{:.2f}x", r["ratio_to_sdpa"].get<double>()) : "-");
    }
  }
  if (result.contains("moe")) {
    md += "\n## Grouped expert GEMM (one MoE layer's experts, random fp16 weights and routing)\n\n";
    md += "The grouped MLP is the gate|up grouped GEMM, SiLU * up and the down grouped GEMM of kernels/moe.cu over "
          "the pairs grouped by MoeGroupByExpert (timed apart). cuBLAS per expert: one GEMM pair per routed expert "
          "over rows already grouped (its gather not timed). The limit is the larger of the routed experts' and the "
          "activations' bytes / the copy bandwidth and the FLOPs / the cuBLAS GEMM rate, both measured above.\n\n";
    md += "| shape | tokens | experts routed | tile | group us | grouped MLP us | GB/s | TFLOP/s | % of limit | cuBLAS "
          "per expert us | grouped vs cuBLAS |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& r : result["moe"]) {
      md += fmt::format("| {} | {} | {} of {} | {} | {:.1f} | {:.1f} | {:.0f} | {:.1f} | {:.0f}% | {:.1f} | {:.2f}x |\n",
                        r["shape"].get<std::string>(), r["tokens"].get<int>(), r["experts_routed"].get<int>(),
                        r["experts"].get<int>(), r["tile_rows"].get<int>(), r["group_us"].get<double>(),
                        r["grouped_mlp_us"].get<double>(), r["achieved_gbs"].get<double>(), r["tflops"].get<double>(),
                        r["pct_of_limit"].get<double>(), r["cublas_per_expert_us"].get<double>(),
                        r["speedup_vs_cublas_per_expert"].get<double>());
    }
  }
  if (result.contains("end_to_end")) {
    md += "\n## End-to-end decode (random fp16 weights)\n\n";
    md += "Weights are random: the speed is that of the real shape, the outputs are meaningless. ms/step is host to "
          "host with greedy sampling on the device. The roofline is the bytes a step must read (weights once, the "
          "tied LM head once, the K/V of every sequence at the mean context of the timed steps) / the measured copy "
          "bandwidth.\n\n";
    md += "| shape | graphs | batch | context | ms/step | tok/s | weights GiB | KV GiB | roofline ms | % of roofline |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& r : result["end_to_end"]) {
      md += fmt::format("| {} | {} | {} | {} |", r["shape"].get<std::string>(), r["cuda_graphs"].get<bool>() ? "on" : "off",
                        r["batch"].get<int>(), r["context"].get<int>());
      if (r.contains("median_step_ms")) {
        md += fmt::format(" {:.2f} | {:.0f} |", r["median_step_ms"].get<double>(), r["tokens_per_s"].get<double>());
      } else {
        md += " - | - |";
      }
      md += fmt::format(" {:.2f} | {:.2f} | {:.2f} |", r["weight_gib"].get<double>(), r["kv_read_gib"].get<double>(),
                        r["roofline_ms"].get<double>());
      if (r.contains("pct_of_roofline")) {
        md += fmt::format(" {:.1f}% |\n", r["pct_of_roofline"].get<double>());
      } else {
        md += fmt::format(" {}: {} |\n", r.contains("skipped") ? "skipped" : "error",
                          r.value("skipped", r.value("error", std::string())));
      }
    }
  }
  return md;
}

// Rewrites <base>.json and <base>.md with everything measured so far.
void WriteResults(const json& result, const std::string& base) {
  std::ofstream js(base + ".json"), md(base + ".md");
  js << result.dump(2) << "\n";
  md << RenderMarkdown(result);
  if (!js || !md) spdlog::warn("cannot write {}.json / {}.md", base, base);
}

// Attaches the PyTorch SDPA figure at the same (tokens, kv heads) to each prefill row.
void MatchSdpa(json& result) {
  if (!result.contains("prefill_sdpa_torch") || !result["prefill_sdpa_torch"].contains("rows")) return;
  for (auto& r : result["prefill_attention"]) {
    for (const auto& t : result["prefill_sdpa_torch"]["rows"]) {
      if (t.value("tokens", 0) != r["tokens"].get<int>() || t.value("kv_heads", 0) != r["kv_heads"].get<int>()) continue;
      const double ref = t.value("tflops", 0.0);
      r["sdpa_tflops"] = ref;
      if (ref > 0) r["ratio_to_sdpa"] = r["tflops"].get<double>() / ref;
    }
  }
}

void PrintRoofline(const std::vector<std::string>& shapes, int context, int steps) {
  const double kv_context = MidpointContext(context, steps);
  fmt::print("Bytes one fp16 decode step reads at least (DecodeStepBytes); KV at context {:.1f} (prefill {} + {} "
             "warm-up steps + mean of {} timed steps)\n",
             kv_context, context, kWarmupSteps, steps);
  for (const std::string& key : shapes) {
    const auto it = std::find_if(KnownShapes().begin(), KnownShapes().end(),
                                 [&](const auto& s) { return s.first == key; });
    const kvflow::ModelConfig& c = it->second;
    fmt::print("{}: {:.2f} M parameters stored ({:.3f} GiB fp16), {} embeddings\n", key, ParamCount(c) / 1e6,
               2.0 * ParamCount(c) / kGiB, c.tie_word_embeddings ? "tied" : "untied");
    for (int batch : {1, 64}) {
      const StepBytes b = DecodeStepBytes(c, batch, kv_context);
      fmt::print("  batch {:2d}: weights {:.0f} B ({:.3f} GiB) + KV {:.0f} B ({:.3f} GiB) = {:.0f} B ({:.3f} GiB)\n", batch,
                 b.weights, b.weights / kGiB, b.kv, b.kv / kGiB, b.total(), b.total() / kGiB);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("kvflow CUDA benchmarks (needs a GPU, but for --print-roofline)");
  std::string out_dir = std::string(KVFLOW_SOURCE_DIR) + "/bench/results";
  std::string sdpa_json, tag;
  std::string sections_arg = "limits,decode,prefill,moe,e2e";
  std::string shapes_arg = "smollm2-135m,llama-3.1-8b,llama-2-7b", batches_arg = "1,16,64,256", graphs_arg = "on,off";
  bool skip_e2e = false, print_roofline = false;
  int e2e_context = 1024, e2e_steps = 32;
  app.add_option("--out-dir", out_dir, "Where cuda_<tag>.json/.md go");
  app.add_option("--tag", tag, "File name tag (default: the GPU's name)");
  app.add_option("--sdpa-json", sdpa_json, "PyTorch SDPA figures from bench/prefill_sdpa_torch.py");
  app.add_option("--sections", sections_arg, "Comma list of limits,decode,prefill,moe,e2e (limits always runs)")
      ->default_val(sections_arg);
  app.add_flag("--skip-e2e", skip_e2e, "Leave out the e2e section");
  app.add_option("--e2e-shapes", shapes_arg, "Comma list of model shapes for e2e")->default_val(shapes_arg);
  app.add_option("--e2e-batches", batches_arg, "Comma list of e2e batch sizes")->default_val(batches_arg);
  app.add_option("--e2e-graphs", graphs_arg, "Comma list of on/off: CUDA graphs in e2e")->default_val(graphs_arg);
  app.add_option("--e2e-context", e2e_context, "Tokens each sequence is prefilled to before the e2e decode")
      ->default_val(1024)
      ->check(CLI::PositiveNumber);
  app.add_option("--e2e-steps", e2e_steps, "Decode steps timed per e2e config")->default_val(32)->check(CLI::PositiveNumber);
  app.add_flag("--print-roofline", print_roofline, "Print the e2e roofline bytes per step at batch 1 and 64 and exit");
  CLI11_PARSE(app, argc, argv);

  std::set<std::string> sections;
  for (const std::string& s : kvflow::bench::SplitCommaList(sections_arg)) {
    if (s != "limits" && s != "decode" && s != "prefill" && s != "moe" && s != "e2e") {
      std::fprintf(stderr, "--sections: unknown section '%s' (limits, decode, prefill, moe, e2e)\n", s.c_str());
      return 2;
    }
    sections.insert(s);
  }
  if (skip_e2e) sections.erase("e2e");
  const std::vector<std::string> shapes = kvflow::bench::SplitCommaList(shapes_arg);
  for (const std::string& s : shapes) {
    if (std::none_of(KnownShapes().begin(), KnownShapes().end(), [&](const auto& k) { return k.first == s; })) {
      std::fprintf(stderr, "--e2e-shapes: unknown shape '%s' (smollm2-135m, llama-3.1-8b, llama-2-7b)\n", s.c_str());
      return 2;
    }
  }
  std::vector<int> batches;
  for (const std::string& s : kvflow::bench::SplitCommaList(batches_arg)) {
    const int b = std::atoi(s.c_str());
    if (b < 1) {
      std::fprintf(stderr, "--e2e-batches: '%s' is not a positive batch size\n", s.c_str());
      return 2;
    }
    batches.push_back(b);
  }
  std::vector<bool> graph_modes;
  for (const std::string& s : kvflow::bench::SplitCommaList(graphs_arg)) {
    if (s != "on" && s != "off") {
      std::fprintf(stderr, "--e2e-graphs: '%s' is neither on nor off\n", s.c_str());
      return 2;
    }
    graph_modes.push_back(s == "on");
  }
  if (print_roofline) {
    PrintRoofline(shapes, e2e_context, e2e_steps);
    return 0;
  }

  if (kvflow::cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA GPU: %s\n", kvflow::cuda::DeviceDescription(0).c_str());
    return 77;
  }
  const std::string device = kvflow::cuda::DeviceDescription(0);
  spdlog::info("device: {}", device);
  if (tag.empty()) {
    tag = device.substr(0, device.find(" ("));
    std::replace_if(tag.begin(), tag.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '_');
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  const std::string base = out_dir + "/cuda_" + tag;
  const auto checkpoint = [&](const json& result) {
    WriteResults(result, base);
    spdlog::info("wrote {}.json and {}.md", base, base);
  };

  json result;
  result["device"] = device;
  result["provenance"] = kvflow::bench::Provenance(argc, argv, device);
  const double copy_gbs = MeasureCopyBandwidth();
  const double gemm = MeasureGemmTflops();
  spdlog::info("copy bandwidth {:.0f} GB/s, cuBLAS fp16 GEMM {:.0f} TFLOP/s", copy_gbs, gemm);
  result["copy_bandwidth_gbs"] = copy_gbs;
  result["cublas_fp16_gemm_tflops"] = gemm;
  checkpoint(result);

  if (sections.count("decode")) {
    result["decode_attention"] = BenchDecode(copy_gbs);
    checkpoint(result);
  }
  if (sections.count("prefill")) {
    result["prefill_attention"] = BenchPrefill(gemm);
    if (!sdpa_json.empty()) {
      try {
        result["prefill_sdpa_torch"] = json::parse(std::ifstream(sdpa_json));
      } catch (const std::exception& e) {
        spdlog::warn("cannot read {}: {}", sdpa_json, e.what());
      }
    }
    MatchSdpa(result);
    checkpoint(result);
  }
  if (sections.count("e2e")) {
    result["end_to_end"] = json::array();
    BenchEndToEnd(copy_gbs, shapes, batches, graph_modes, e2e_context, e2e_steps, result["end_to_end"],
                  [&] { checkpoint(result); });
  }
  // Last: the newest section, so that a failure in it leaves every earlier figure written.
  if (sections.count("moe")) {
    result["moe"] = BenchMoe(copy_gbs, gemm);
    checkpoint(result);
  }
  return 0;
}
