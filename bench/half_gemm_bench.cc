// fp16 / bf16 weight matmuls (backend/cpu/half_gemm.h) against the fp32 sgemm path, next to the
// machine's measured memory read bandwidth.
//
//   kvflow_bench_half_gemm [--isa dispatched|avx2|portable] [--threads 1,2] [--m 1,64,256]
//                          [--sgemm-min-rows N] [--bf16-dot] [--warm]
//
// Decode (M = 1) streams every weight once per token: its figure of merit is GB/s of weight bytes
// read, with the weights rotating through copies larger than the last-level cache, as a whole model
// does. Prefill (M >= 32) is compute-bound: GFLOP/s (2 * M * N * K per call); --sgemm-min-rows 0
// runs the direct kernels there too, to compare with the widen-then-sgemm path.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/half_gemm.h"
#include "bench_timing.h"
#include "util/half.h"
#include "util/thread_pool.h"

namespace {

using kvflow::DType;
using namespace kvflow::bench;

struct Shape {
  const char* name;
  int64_t k, n;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fp16 / bf16 weight matmul kernels vs fp32 sgemm"};
  std::string isa = "dispatched";
  std::vector<int> thread_counts = {1, 2};
  std::vector<int64_t> ms = {1, 64, 256};
  int64_t sgemm_min_rows = -1;
  bool warm = false, bf16_dot = false;
  app.add_option("--isa", isa, "Kernel path: dispatched, avx2 or portable")
      ->check(CLI::IsMember({"dispatched", "avx2", "portable"}));
  app.add_option("--threads", thread_counts, "Thread counts")->delimiter(',');
  app.add_option("--m", ms, "Activation rows (tokens)")->delimiter(',');
  app.add_option("--sgemm-min-rows", sgemm_min_rows, "Widen-then-sgemm from this many rows on (0: never; default: the library's)");
  app.add_flag("--bf16-dot", bf16_dot, "bf16: activations rounded to bf16 and AVX512_BF16 vdpbf16ps (llama.cpp's way)");
  app.add_flag("--warm", warm, "Reuse one copy of each matrix (cache-resident weights)");
  CLI11_PARSE(app, argc, argv);

  if (isa != "dispatched") kvflow::cpu::LimitHalfKernelIsa(isa.c_str());
  if (sgemm_min_rows >= 0) kvflow::cpu::SetHalfSgemmMinRows(sgemm_min_rows);
  kvflow::cpu::SetHalfBf16DotProducts(bf16_dot);
  std::printf("half kernels: %s%s\n", kvflow::cpu::HalfKernelIsa(),
              bf16_dot && kvflow::cpu::HalfBf16DotAvailable() ? " (bf16: vdpbf16ps)" : "");
  std::vector<double> read_gbps(*std::max_element(thread_counts.begin(), thread_counts.end()) + 1, 0.0);
  for (int t : thread_counts) {
    read_gbps[t] = MeasureReadBandwidth(t);
    std::printf("memory read bandwidth, %d thread(s): %.1f GB/s (sum over 256 MiB)\n", t, read_gbps[t]);
  }

  const Shape shapes[] = {{"576x1536", 576, 1536}, {"1536x576", 1536, 576}, {"4096x4096", 4096, 4096}};
  std::mt19937 rng(42);
  std::vector<uint16_t> pool16(kPoolBytes / 2);
  std::vector<float> pool32(kPoolBytes / 4);
  {
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (float& v : pool32) v = normal(rng);
    for (size_t i = 0; i < pool16.size(); ++i) pool16[i] = kvflow::FloatToHalfBits(pool32[i % pool32.size()]);
  }
  std::printf("\n%-5s %-10s %5s %5s %4s %3s %11s %9s %9s %7s\n", "type", "shape", "K", "N", "M", "thr", "median_us",
              "wGB/s", "GFLOP/s", "%readBW");
  for (DType type : {DType::kF32, DType::kF16, DType::kBF16}) {
    const size_t elem = type == DType::kF32 ? 4 : 2;
    for (const Shape& shape : shapes) {
      const size_t weight_bytes = static_cast<size_t>(shape.n * shape.k) * elem;
      const size_t copies = warm ? 1 : std::max<size_t>(1, kPoolBytes / weight_bytes);
      for (int64_t m : ms) {
        std::vector<float> x(static_cast<size_t>(m * shape.k)), y(static_cast<size_t>(m * shape.n));
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& v : x) v = normal(rng);
        for (int threads : thread_counts) {
          kvflow::ThreadPool thread_pool(threads);
          kvflow::ScopedThreadPool use_pool(&thread_pool);
          const double seconds = MedianSeconds([&](int i) {
            const size_t offset = (i % copies) * weight_bytes;
            if (type == DType::kF32) {
              kvflow::cpu::MatmulTransposedB(x.data(), pool32.data() + offset / 4, y.data(), m, shape.n, shape.k);
            } else {
              kvflow::cpu::HalfMatmul(type, x.data(), m, shape.k,
                                      reinterpret_cast<const uint8_t*>(pool16.data()) + offset, shape.n, y.data(),
                                      shape.n);
            }
          });
          const double gbps = static_cast<double>(weight_bytes) / seconds / 1e9;
          std::printf("%-5s %-10s %5ld %5ld %4ld %3d %11.1f %9.1f %9.1f %6.0f%%\n", kvflow::DTypeName(type), shape.name,
                      static_cast<long>(shape.k), static_cast<long>(shape.n), static_cast<long>(m), threads,
                      seconds * 1e6, gbps, 2.0 * static_cast<double>(m) * shape.n * shape.k / seconds / 1e9,
                      100.0 * gbps / read_gbps[threads]);
        }
      }
    }
  }
  return 0;
}
