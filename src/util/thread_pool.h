// The CPU backend's worker threads: a fixed pool whose idle workers spin briefly and then sleep, as
// llama.cpp's ggml threadpool does, so that between steps they never take the cores a server's
// HTTP threads and the engine thread need (OpenMP's default spin-wait did).
//
// A step's parallel loops run on the pool made current on the stepping thread (ScopedThreadPool);
// without one they run inline on the caller.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvflow {

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the calling thread: num_threads - 1 workers are started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(begin, end) over [0, n) in chunks of `chunk` items handed out on demand (dynamic
  // scheduling; 0: one equal share per thread). The caller works too; returns when every chunk ran.
  // Not reentrant: fn must not call back into the pool.
  void ParallelFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn, int64_t chunk = 0);

 private:
  void WorkerLoop();
  void RunChunks();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;   // workers wait here for a new job
  std::condition_variable done_;   // the caller waits here for the workers inside a job to leave
  // Odd while a job is open to workers, even once the caller has closed it (every item claimed).
  // A worker enters a job by counting itself in active_ and then seeing it still open; the caller
  // waits only for the workers that entered. One that wakes too late (descheduled: more threads
  // than cores, as when tests run side by side) finds the job closed and leaves it alone, so the
  // caller, which runs every chunk nobody claimed, never waits for a thread that is not running.
  std::atomic<uint64_t> job_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  // The current job; written only while no worker is inside one.
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

// The pool parallel loops on this thread use (null: run inline).
ThreadPool* CurrentThreadPool();

// Makes `pool` current on this thread for the scope (the backend does this around a step).
class ScopedThreadPool {
 public:
  explicit ScopedThreadPool(ThreadPool* pool);
  ~ScopedThreadPool();

 private:
  ThreadPool* previous_;
};

// fn(begin, end) over [0, n) on the current pool, or inline; with chunk 0 one equal share per
// thread (static loops: GEMV rows), else dynamic chunks of that size (uneven work: attention).
// Runs inline when n < min_parallel (too little work to wake anyone).
void ParallelFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn, int64_t chunk = 0,
                 int64_t min_parallel = 2);
// Threads of the current pool (1 without one).
int CurrentThreads();

// The cores this process may run on: its CPU affinity mask (taskset, a container's cpuset), else
// every online core; at least 1. The default thread count everywhere.
int UsableCores();

}  // namespace kvflow
