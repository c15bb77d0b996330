// CPU decode throughput of the engine, next to the machine's measured memory read bandwidth.
// Decode at small batch is bound by streaming the fp32 weights once per step, so the roofline is
// weight_bytes / read_bandwidth per step.
//
//   kvflow_bench_cpu_decode --benchmark_out=cpu_decode.json --benchmark_out_format=json
// Model: $KVFLOW_BENCH_MODEL (default smollm2-135m).
#include <benchmark/benchmark.h>
#include <spdlog/spdlog.h>

#include <cblas.h>

#include <cstdlib>
#include <numeric>
#include <omp.h>
#include <thread>
#include <vector>

#include "kvflow/engine.h"

namespace {

std::string BenchModel() {
  const char* m = std::getenv("KVFLOW_BENCH_MODEL");
  return m ? m : "smollm2-135m";
}

// Streaming read bandwidth as decode sees it: every thread runs OpenBLAS sgemv over its share of a
// 1 GiB fp32 matrix (larger than the last-level cache), which is what a decode step does with the
// weights. This is the roofline's denominator.
void BM_MemoryReadBandwidth(benchmark::State& state) {
  openblas_set_num_threads(1);
  constexpr size_t kCols = 4096;
  const size_t rows = (size_t{1} << 30) / sizeof(float) / kCols;
  std::vector<float> matrix(rows * kCols), x(kCols, 1.0f), y(rows);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = static_cast<float>(i & 1023);
  for (auto _ : state) {
#pragma omp parallel
    {
      const size_t threads = static_cast<size_t>(omp_get_num_threads());
      const size_t id = static_cast<size_t>(omp_get_thread_num());
      const size_t begin = rows * id / threads, end = rows * (id + 1) / threads;
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(end - begin), kCols, 1.0f,
                  matrix.data() + begin * kCols, kCols, x.data(), 1, 0.0f, y.data() + begin, 1);
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GBps"] = benchmark::Counter(static_cast<double>(matrix.size() * sizeof(float)) * state.iterations() / 1e9,
                                              benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MemoryReadBandwidth)->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();

// One Step() decodes one token for each of `batch` sequences with ~128 tokens of context.
void BM_Decode(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  spdlog::set_level(spdlog::level::warn);
  kvflow::EngineConfig config;
  config.model = BenchModel();
  config.max_model_len = 4096;
  auto engine_or = kvflow::Engine::Create(config);
  if (!engine_or.ok()) {
    state.SkipWithError(engine_or.status().ToString().c_str());
    return;
  }
  auto& engine = *engine_or.value();
  kvflow::SamplingParams p;
  p.temperature = 0.0f;
  p.ignore_eos = true;
  p.max_tokens = 1 << 20;
  std::vector<int32_t> prompt(128);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(100 + 37 * i % 5000);
  for (int i = 0; i < batch; ++i) (void)engine.AddRequest(prompt, p);
  (void)engine.Step();  // prefill
  (void)engine.Step();  // warm-up decode
  for (auto _ : state) {
    auto r = engine.Step();
    if (!r.ok() || r->num_decode_tokens != batch) state.SkipWithError("decode step failed");
  }
  const auto& mc = engine.model_config();
  const double params = static_cast<double>(mc.vocab_size) * mc.hidden_size * (mc.tie_word_embeddings ? 1 : 2) +
                        static_cast<double>(mc.num_layers) *
                            (static_cast<double>(mc.hidden_size) * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads) +
                             3.0 * mc.hidden_size * mc.intermediate_size);
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(batch) * state.iterations(),
                                                      benchmark::Counter::kIsRate);
  state.counters["weight_GBps"] = benchmark::Counter(params * 4 * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["threads"] = omp_get_max_threads();
  state.SetLabel(mc.name);
}
BENCHMARK(BM_Decode)->Arg(1)->Arg(8)->Unit(benchmark::kMillisecond)->MinTime(5.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
