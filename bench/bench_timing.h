// Timing helpers shared by the kernel benchmarks (quant_gemm_bench.cc, half_gemm_bench.cc): median
// seconds per call, and the machine's read bandwidth, the denominator of a decode roofline.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "util/thread_pool.h"

namespace kvflow::bench {

using Clock = std::chrono::steady_clock;

// Bytes that weights rotate through so a call reads them from memory: many times the last-level
// cache (32 MiB here).
constexpr size_t kPoolBytes = size_t{256} << 20;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Runs `call(i)` until at least `min_seconds` have passed and `min_reps` calls are done (at most
// `max_reps`), after one warm-up call; returns the median seconds per call.
template <typename Call>
double MedianSeconds(Call&& call, double min_seconds = 0.3, int min_reps = 5, int max_reps = 400) {
  call(0);
  std::vector<double> times;
  const auto start = Clock::now();
  for (int i = 1; i <= max_reps; ++i) {
    const auto t0 = Clock::now();
    call(i);
    const auto t1 = Clock::now();
    times.push_back(Seconds(t0, t1));
    if (static_cast<int>(times.size()) >= min_reps && Seconds(start, t1) >= min_seconds) break;
  }
  return Median(times);
}

// Read bandwidth: all threads sum their share of a kPoolBytes buffer (integer adds vectorize without
// reassociation concerns). Median of repeated passes, GB/s.
inline double MeasureReadBandwidth(int threads) {
  static std::vector<uint64_t> buffer;
  if (buffer.empty()) {
    buffer.resize(kPoolBytes / sizeof(uint64_t));
    for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = i * 0x9E3779B97F4A7C15ull;
  }
  ThreadPool pool(threads);
  ScopedThreadPool use(&pool);
  volatile uint64_t sink = 0;
  const double seconds = MedianSeconds(
      [&](int) {
        std::atomic<uint64_t> total{0};
        ParallelFor(static_cast<int64_t>(buffer.size()), [&](int64_t first, int64_t last) {
          uint64_t part = 0;
          for (int64_t i = first; i < last; ++i) part += buffer[static_cast<size_t>(i)];
          total += part;
        });
        sink = sink + total.load();
      },
      1.0, 5, 50);
  return static_cast<double>(kPoolBytes) / seconds / 1e9;
}

}  // namespace kvflow::bench
