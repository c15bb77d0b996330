// The CPU paged attention (backend/cpu/paged_attention.h) alone, on SmolLM2-135M's head layout
// (9 query heads, 3 KV heads, head_dim 64, 16-token blocks, fp16 cache) for one layer:
//   BM_Decode/CONTEXT/THREADS        one sequence decoding one token over CONTEXT cached tokens
//   BM_Prefill/PAST/THREADS          a 512-token prefill chunk after PAST cached tokens
//   BM_Verify/CONTEXT/THREADS/N      N tokens (a token and its drafts) verified at the end of CONTEXT
//   BM_ReadBandwidth/THREADS         the machine's read bandwidth (the decode rows' roofline)
// The KV pools rotate through copies larger than the last-level cache, as a model's layers do, so
// decode reads them from memory. Reported: KV bytes read per second (decode reads every cached K and V row once per step, so this
// is its roofline measure) and GFLOP/s (4 * query heads * head_dim per query-key pair: the two
// products). Kernel set: $KVFLOW_ATTENTION_ISA (avx2, portable; default: the best this CPU has).
//
//   kvflow_bench_attention --benchmark_min_time=1
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "backend/cpu/attention_kernels.h"
#include "backend/cpu/paged_attention.h"
#include "util/half.h"
#include "util/thread_pool.h"

namespace {

using namespace kvflow;

constexpr int kHeads = 9, kKvHeads = 3, kHeadDim = 64, kBlock = 16;

constexpr size_t kRotateBytes = size_t{128} << 20;  // several times the last-level cache

struct Setup {
  KvCacheLayout layout;
  std::vector<uint16_t> keys, values;
  int copies = 1, next = 0;
  std::vector<float> query, out;
  ForwardBatch batch;
  std::vector<std::vector<int64_t>> views;
  int64_t pairs = 0;  // query-key pairs per call (per query head)

  Setup(int past, int fresh) {
    const int context = past + fresh;
    layout = {1, (context + kBlock - 1) / kBlock, kKvHeads, kBlock, kHeadDim};
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // KVFLOW_BENCH_ROTATE_MIB=0: one copy (cache-resident at small contexts: the kernels' own speed).
    const char* rotate = std::getenv("KVFLOW_BENCH_ROTATE_MIB");
    const size_t rotate_bytes = rotate ? static_cast<size_t>(std::atoll(rotate)) << 20 : kRotateBytes;
    copies = static_cast<int>(std::max<size_t>(1, rotate_bytes / (4 * layout.layer_stride())));
    keys.resize(layout.layer_stride() * copies);
    values.resize(layout.layer_stride() * copies);
    for (auto* pool : {&keys, &values}) {
      for (uint16_t& x : *pool) x = FloatToHalfBits(normal(rng));
    }
    SequenceSlice slice;
    slice.num_tokens = fresh;
    slice.context_len = context;
    slice.block_table.resize(static_cast<size_t>(layout.num_blocks));
    std::iota(slice.block_table.begin(), slice.block_table.end(), 0);
    if (!std::getenv("KVFLOW_BENCH_CONTIGUOUS")) std::shuffle(slice.block_table.begin(), slice.block_table.end(), rng);
    for (int i = 0; i < fresh; ++i) {
      batch.tokens.push_back(0);
      batch.positions.push_back(past + i);
      pairs += past + i + 1;
    }
    batch.seqs = {slice};
    views.resize(1);
    ViewSlots(slice, kBlock, views[0]);
    query.resize(static_cast<size_t>(fresh) * kHeads * kHeadDim);
    for (float& x : query) x = normal(rng);
    out.resize(query.size());
  }

  void Run() {
    cpu::AttentionIo io{query.data(), kHeads * kHeadDim, out.data(), kHeads * kHeadDim, nullptr};
    const size_t layer = layout.layer_stride() * static_cast<size_t>(next);
    next = (next + 1) % copies;
    cpu::PagedAttention(batch, views, layout, kHeads, io, cpu::KvElement::kF16, keys.data() + layer,
                        values.data() + layer, 0.125f);
  }
};

void Measure(benchmark::State& state, int past, int fresh, int64_t kv_bytes) {
  if (const char* isa = std::getenv("KVFLOW_ATTENTION_ISA")) cpu::LimitAttentionIsa(isa);
  ThreadPool threads(static_cast<int>(state.range(1)));
  ScopedThreadPool use(&threads);
  Setup setup(past, fresh);
  for (auto _ : state) {
    setup.Run();
    benchmark::DoNotOptimize(setup.out.data());
  }
  state.SetLabel(cpu::SelectAttentionKernels(kHeadDim).isa);
  state.counters["KV_GB/s"] = benchmark::Counter(static_cast<double>(kv_bytes) * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * kHeads * kHeadDim * setup.pairs * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

void BM_Decode(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  Measure(state, context - 1, 1, int64_t{2} * context * kKvHeads * kHeadDim * 2);
}

void BM_Prefill(benchmark::State& state) {
  const int past = static_cast<int>(state.range(0));
  Measure(state, past, 512, int64_t{2} * (past + 512) * kKvHeads * kHeadDim * 2);
}

// Speculative verification (TriForce's top level, n-gram, draft models): a token and its drafts
// (range 2: 1 + drafts) at the end of a context of range 0 tokens.
void BM_Verify(benchmark::State& state) {
  const int context = static_cast<int>(state.range(0));
  const int fresh = static_cast<int>(state.range(2));
  Measure(state, context - fresh, fresh, int64_t{2} * context * kKvHeads * kHeadDim * 2);
}

// The machine's read bandwidth on THREADS threads (bench_timing.h: every thread sums its share of a
// buffer far larger than the caches): decode's KV_GB/s over this is its share of the roofline.
void BM_ReadBandwidth(benchmark::State& state) {
  double gbps = 0.0;
  for (auto _ : state) gbps = bench::MeasureReadBandwidth(static_cast<int>(state.range(0)));
  state.counters["read_GB/s"] = gbps;
}

BENCHMARK(BM_ReadBandwidth)->Arg(1)->Arg(2)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Decode)->ArgsProduct({{1024, 4096, 8192}, {1, 2}})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_Prefill)->ArgsProduct({{0, 3584}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Verify)->ArgsProduct({{8192}, {2}, {1, 5, 9}})->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
