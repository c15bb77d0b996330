#include "util/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVFLOW_CPU_RELAX() _mm_pause()
#else
#define KVFLOW_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvflow {
namespace {

// How long a worker polls for the next job before it sleeps: a decode step issues its loops a few
// microseconds apart, so polling this long keeps wake-up latency out of them, and a server idle
// between requests pays it once.
constexpr auto kSpinFor = std::chrono::microseconds(100);

thread_local ThreadPool* current_pool = nullptr;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks() {
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return;
    (*fn_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;  // the last job this worker looked at
  auto new_job = [&] {
    const uint64_t j = job_.load(std::memory_order_acquire);
    return (j & 1) != 0 && j != seen;
  };
  for (;;) {
    // Poll, then sleep until a new job opens.
    const auto spin_until = std::chrono::steady_clock::now() + kSpinFor;
    int polls = 0;
    while (!new_job() && !stop_.load(std::memory_order_acquire)) {
      KVFLOW_CPU_RELAX();
      if (++polls % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1, std::memory_order_relaxed);
        wake_.wait(lock, [&] { return new_job() || stop_.load(std::memory_order_acquire); });
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        break;
      }
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = job_.load(std::memory_order_acquire);
    // Enter, then check the job is still open (both sequentially consistent, against the caller's
    // close then check of active_): either the caller sees this worker inside and waits for it, or
    // the worker sees the job closed and touches nothing of it.
    active_.fetch_add(1);
    if (job_.load() == seen && (seen & 1) != 0) RunChunks();
    if (active_.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk) {
  if (n <= 0) return;
  if (workers_.empty()) {
    fn(0, n);
    return;
  }
  fn_ = &fn;
  n_ = n;
  chunk_ = chunk > 0 ? chunk : (n + size() - 1) / size();
  next_.store(0, std::memory_order_relaxed);
  {
    // Open the job under the lock, so that a worker going to sleep cannot miss it.
    std::lock_guard<std::mutex> lock(mutex_);
    job_.fetch_add(1);
  }
  if (sleeping_.load(std::memory_order_relaxed) > 0) wake_.notify_all();
  RunChunks();
  // Every chunk is claimed: close the job, then wait for the workers still inside it (polling
  // briefly, as they finish within microseconds of us, then sleeping).
  job_.fetch_add(1);
  const auto spin_until = std::chrono::steady_clock::now() + kSpinFor;
  int polls = 0;
  while (active_.load() > 0) {
    KVFLOW_CPU_RELAX();
    if (++polls % 64 == 0 && std::chrono::steady_clock::now() > spin_until) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return active_.load() == 0; });
      break;
    }
  }
  fn_ = nullptr;
}

ThreadPool* CurrentThreadPool() { return current_pool; }

ScopedThreadPool::ScopedThreadPool(ThreadPool* pool) : previous_(current_pool) { current_pool = pool; }
ScopedThreadPool::~ScopedThreadPool() { current_pool = previous_; }

void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk, int64_t min_parallel) {
  if (n <= 0) return;
  ThreadPool* pool = current_pool;
  if (pool == nullptr || pool->size() == 1 || n < min_parallel) {
    fn(0, n);
    return;
  }
  pool->ParallelFor(n, fn, chunk);
}

int CurrentThreads() { return current_pool ? current_pool->size() : 1; }

int UsableCores() {
#if defined(__linux__)
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) {
    const int cores = CPU_COUNT(&mask);
    if (cores > 0) return cores;
  }
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace kvflow
