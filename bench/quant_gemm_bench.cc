// Quantized-weight matmuls (backend/cpu/quant_gemm.h) against the fp32 sgemm path, on SmolLM2-135M
// shapes and (for the K-quants, whose rows must hold whole 256-element super-blocks, and the
// others alike) Llama-3.2-1B shapes, next to the machine's measured memory read bandwidth.
//
//   kvflow_bench_quant_gemm [--json out.json] [--isa dispatched|avx2|portable] [--threads 1,2]
//                           [--types F32,Q4_0,Q4_K,...] [--m 1,4,16]
//
// Decode (M = 1) streams every weight once per token, so its roofline is weight bytes / read
// bandwidth: the weights rotate through copies larger than the last-level cache, as a whole model
// does. Prefill (M = 128, 512) is compute-bound; its rate is GFLOP/s (2 * M * N * K per call). The
// quantized times include quantizing the activations, which the fp32 path does not need.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/quant_gemm.h"
#include "bench_files.h"
#include "bench_timing.h"
#include "util/thread_pool.h"

namespace {

using kvflow::DType;
using namespace kvflow::bench;

// A pool of weight rows of one type, filled with valid blocks (random quants, scales ~ 0.01), that
// the measurements cut into copies of a matrix.
struct WeightPool {
  DType type;
  std::vector<uint8_t> bytes;
  std::vector<float> floats;  // for kF32
};

WeightPool MakePool(DType type, std::mt19937& rng) {
  WeightPool pool{type, {}, {}};
  if (type == DType::kF32) {
    pool.floats.resize(kPoolBytes / sizeof(float));
    std::uniform_real_distribution<float> dist(-0.05f, 0.05f);
    for (float& v : pool.floats) v = dist(rng);
    return pool;
  }
  const size_t block_bytes = kvflow::DTypeBlockBytes(type);
  pool.bytes.resize(kPoolBytes / block_bytes * block_bytes);
  std::uniform_int_distribution<uint32_t> dist;
  for (size_t i = 0; i + 4 <= pool.bytes.size(); i += 4) {
    const uint32_t v = dist(rng);
    std::memcpy(&pool.bytes[i], &v, 4);
  }
  const uint16_t scale = 0x2120;  // f16 ~0.0102: finite, normal
  // Where each block keeps its f16 scale and, if it has one, its f16 min / dmin.
  size_t d_at = 0, min_at = SIZE_MAX;
  switch (type) {
    case DType::kQ4_1: min_at = 2; break;
    case DType::kQ2_K: d_at = 80; min_at = 82; break;
    case DType::kQ3_K: d_at = 108; break;
    case DType::kQ4_K:
    case DType::kQ5_K: min_at = 2; break;
    case DType::kQ6_K: d_at = 208; break;
    default: break;
  }
  for (size_t b = 0; b < pool.bytes.size(); b += block_bytes) {
    std::memcpy(&pool.bytes[b + d_at], &scale, 2);
    if (min_at != SIZE_MAX) std::memcpy(&pool.bytes[b + min_at], &scale, 2);
  }
  return pool;
}

struct Shape {
  const char* name;
  int64_t k, n;
};

struct Result {
  std::string type;
  const char* shape;
  int64_t k, n, m;
  int threads;
  double seconds, quantize_seconds, weight_gbps, gflops, bandwidth_ratio;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Quantized-weight matmul kernels vs fp32 sgemm"};
  std::string json_path, isa = "dispatched";
  std::vector<int> thread_counts = {1, 2};
  std::vector<int64_t> ms = {1, 4, 16, 128, 512};
  bool warm = false;
  app.add_option("--json", json_path, "Write the results as JSON here");
  app.add_option("--isa", isa, "Kernel path: dispatched, avx2 or portable")
      ->check(CLI::IsMember({"dispatched", "avx2", "portable"}));
  app.add_option("--threads", thread_counts, "Thread counts")->delimiter(',');
  app.add_option("--m", ms, "Activation rows (tokens)")->delimiter(',');
  std::vector<std::string> type_names = {"F32", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
  app.add_option("--types", type_names, "Weight types")->delimiter(',');
  app.add_flag("--warm", warm, "Reuse one copy of each matrix (cache-resident weights: the compute ceiling)");
  CLI11_PARSE(app, argc, argv);

  if (isa == "portable") kvflow::cpu::ForcePortableQuantKernels(true);
  if (isa == "avx2") kvflow::cpu::LimitQuantKernelIsa("avx2");
  std::printf("quant kernels: %s\n", kvflow::cpu::QuantKernelIsa());

  std::vector<double> read_gbps(*std::max_element(thread_counts.begin(), thread_counts.end()) + 1, 0.0);
  for (int t : thread_counts) {
    read_gbps[t] = MeasureReadBandwidth(t);
    std::printf("memory read bandwidth, %d thread(s): %.1f GB/s (sum over 256 MiB)\n", t, read_gbps[t]);
  }

  // SmolLM2-135M, then Llama-3.2-1B (K a multiple of 256).
  const Shape shapes[] = {{"q/o proj", 576, 576},   {"k/v proj", 576, 192},    {"gate/up", 576, 1536},
                          {"lm head", 576, 49152},  {"down", 1536, 576},       {"1B q/o", 2048, 2048},
                          {"1B k/v", 2048, 512},    {"1B gate/up", 2048, 8192}, {"1B down", 8192, 2048}};
  std::vector<DType> types;
  for (const std::string& name : type_names) {
    bool known = false;
    for (DType t : {DType::kF32, DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                    DType::kQ5_K, DType::kQ6_K}) {
      if (name == kvflow::DTypeName(t)) {
        types.push_back(t);
        known = true;
      }
    }
    if (!known) {
      std::fprintf(stderr, "unknown type %s\n", name.c_str());
      return 2;
    }
  }
  std::mt19937 rng(42);
  std::vector<Result> results;

  std::printf("\n%-5s %-10s %5s %6s %4s %3s %11s %9s %9s %9s %7s\n", "type", "shape", "K", "N", "M", "thr",
              "median_us", "quant_us", "wGB/s", "GFLOP/s", "%readBW");
  for (DType type : types) {
    const WeightPool pool = MakePool(type, rng);
    const bool fp32 = type == DType::kF32;
    const int64_t block = fp32 ? 1 : kvflow::DTypeBlockElements(type);
    const size_t block_bytes = fp32 ? sizeof(float) : kvflow::DTypeBlockBytes(type);
    for (const Shape& shape : shapes) {
      if (shape.k % block != 0) continue;  // the K-quants need whole super-blocks per row
      const size_t weight_bytes = static_cast<size_t>(shape.n) * static_cast<size_t>(shape.k / block) * block_bytes;
      const size_t copies = warm ? 1 : std::max<size_t>(1, kPoolBytes / weight_bytes);
      for (int64_t m : ms) {
        std::vector<float> x(static_cast<size_t>(m * shape.k)), y(static_cast<size_t>(m * shape.n));
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& v : x) v = normal(rng);
        kvflow::cpu::QuantizedActivations qx;
        for (int threads : thread_counts) {
          kvflow::ThreadPool thread_pool(threads);
          kvflow::ScopedThreadPool use_pool(&thread_pool);
          double quantize_seconds = 0.0;
          double seconds;
          if (fp32) {
            seconds = MedianSeconds([&](int i) {
              const float* w = pool.floats.data() + (i % copies) * weight_bytes / sizeof(float);
              kvflow::cpu::MatmulTransposedB(x.data(), w, y.data(), m, shape.n, shape.k);
            });
          } else {
            quantize_seconds = MedianSeconds(
                [&](int) { kvflow::cpu::QuantizeActivations(x.data(), m, shape.k, type, qx); }, 0.05, 5, 200);
            seconds = MedianSeconds([&](int i) {
              kvflow::cpu::QuantizeActivations(x.data(), m, shape.k, type, qx);
              kvflow::cpu::QuantizedMatmul(qx, pool.bytes.data() + (i % copies) * weight_bytes, shape.n, y.data(),
                                           shape.n, false);
            });
          }
          Result r{kvflow::DTypeName(type), shape.name, shape.k, shape.n, m, threads, seconds, quantize_seconds,
                   static_cast<double>(weight_bytes) / seconds / 1e9,
                   2.0 * static_cast<double>(m) * shape.n * shape.k / seconds / 1e9, 0.0};
          r.bandwidth_ratio = r.weight_gbps / read_gbps[threads];
          results.push_back(r);
          std::printf("%-5s %-10s %5ld %6ld %4ld %3d %11.1f %9.1f %9.1f %9.1f %6.0f%%\n", r.type.c_str(), r.shape,
                      static_cast<long>(r.k), static_cast<long>(r.n), static_cast<long>(r.m), r.threads, r.seconds * 1e6,
                      r.quantize_seconds * 1e6, r.weight_gbps, r.gflops, 100.0 * r.bandwidth_ratio);
          std::fflush(stdout);
        }
      }
    }
  }

  if (!json_path.empty()) {
    nlohmann::json out;
    out["isa"] = kvflow::cpu::QuantKernelIsa();
    out["warm"] = warm;
    out["provenance"] = kvflow::bench::Provenance(argc, argv);
    for (int t : thread_counts) out["read_bandwidth_gbps"][std::to_string(t)] = read_gbps[t];
    out["note"] = "median seconds per call; quantized times include QuantizeActivations; weight_gbps = weight bytes / time";
    for (const Result& r : results) {
      out["results"].push_back({{"type", r.type}, {"shape", r.shape}, {"K", r.k}, {"N", r.n}, {"M", r.m},
                                {"threads", r.threads}, {"median_seconds", r.seconds},
                                {"quantize_seconds", r.quantize_seconds}, {"weight_gbps", r.weight_gbps},
                                {"gflops", r.gflops}, {"read_bandwidth_ratio", r.bandwidth_ratio}});
    }
    std::ofstream(json_path) << out.dump(2) << "\n";
    std::printf("\nwrote %s\n", json_path.c_str());
  }
  return 0;
}
