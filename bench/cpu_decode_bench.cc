// CPU decode throughput of the engine, next to the machine's measured memory read bandwidth.
// Decode at small batch is bound by streaming the fp32 weights once per step, so the roofline is
// weight_bytes / read_bandwidth per step.
//
//   kvflow_bench_cpu_decode --benchmark_out=cpu_decode.json --benchmark_out_format=json
// Model: $KVFLOW_BENCH_MODEL (default smollm2-135m).
#include <benchmark/benchmark.h>
#include <spdlog/spdlog.h>

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

// Read bandwidth with all threads summing a 1 GiB array (larger than any cache).
void BM_MemoryReadBandwidth(benchmark::State& state) {
  const size_t n = (size_t{1} << 30) / sizeof(float);
  std::vector<float> data(n);
#pragma omp parallel for
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<float>(i & 1023);
  double sink = 0;
  for (auto _ : state) {
    float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (size_t i = 0; i < n; ++i) total += data[i];
    sink += total;
  }
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
  state.counters["GBps"] = benchmark::Counter(static_cast<double>(n * sizeof(float)) * state.iterations() / 1e9,
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
