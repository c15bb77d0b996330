// The CPU backend's thread pool: every item of every loop runs exactly once, whatever the chunking,
// the thread count and the jobs that ran before it (workers that wake late must neither miss a job
// nor run a closed one), and pools that together hold more threads than the machine has cores
// (tests side by side, engines in one process) still finish every loop with the right result.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <thread>
#include <vector>

#include "util/thread_pool.h"

#if defined(__linux__)
#include <sched.h>
#endif

namespace kvflow {
namespace {

TEST(ThreadPool, EveryItemRunsOnceForEveryChunkingAndThreadCount) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 3, 7, 100, 1000}) {
      for (int64_t chunk : {0, 1, 3, 64}) {
        // Back-to-back jobs: a worker still waking for the previous one must not touch this one.
        for (int round = 0; round < 20; ++round) {
          std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
          pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
            ASSERT_LT(begin, end);
            for (int64_t i = begin; i < end; ++i) runs[static_cast<size_t>(i)].fetch_add(1);
          }, chunk);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 1)
                << "item " << i << " of " << n << ", chunk " << chunk << ", " << threads << " threads";
          }
        }
      }
    }
  }
}

TEST(ThreadPool, PoolsWithMoreThreadsThanCoresFinishEveryLoop) {
  // Four callers, each with a pool of three threads, on however few cores this machine has: each
  // runs many short loops, as a decode step does, and checks every sum.
  constexpr int kCallers = 4, kThreads = 3, kJobs = 400;
  std::vector<int64_t> wrong(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      ThreadPool pool(kThreads);
      ScopedThreadPool use(&pool);
      EXPECT_EQ(CurrentThreads(), kThreads);
      for (int job = 0; job < kJobs; ++job) {
        const int64_t n = 1 + (job * 37 + c) % 500;
        std::vector<int64_t> values(static_cast<size_t>(n), 0);
        ParallelFor(n, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) values[static_cast<size_t>(i)] = i + job;
        }, job % 3 == 0 ? 0 : 1 + job % 17);
        const int64_t sum = std::accumulate(values.begin(), values.end(), int64_t{0});
        if (sum != n * (n - 1) / 2 + n * job) ++wrong[static_cast<size_t>(c)];
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(wrong[static_cast<size_t>(c)], 0) << "caller " << c;
}

TEST(ThreadPool, LoopsRunInlineWithoutAPoolOrBelowTheirMinimum) {
  EXPECT_EQ(CurrentThreadPool(), nullptr);
  EXPECT_EQ(CurrentThreads(), 1);
  const std::thread::id caller = std::this_thread::get_id();
  int calls = 0;
  ParallelFor(10, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 10);
    ++calls;
  });
  EXPECT_EQ(calls, 1);
  ThreadPool pool(2);
  ScopedThreadPool use(&pool);
  calls = 0;
  ParallelFor(5, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(end - begin, 5);
    ++calls;
  }, 0, /*min_parallel=*/6);
  EXPECT_EQ(calls, 1);
  {
    ScopedThreadPool none(nullptr);
    EXPECT_EQ(CurrentThreads(), 1);
  }
  EXPECT_EQ(CurrentThreads(), 2);
}

TEST(ThreadPool, DefaultThreadCountFollowsTheCpuAffinity) {
  const int cores = UsableCores();
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
#if defined(__linux__)
  // A thread pinned to one core (as taskset or a container's cpuset would) counts one.
  int pinned = 0;
  std::thread([&] {
    cpu_set_t mask;
    ASSERT_EQ(sched_getaffinity(0, sizeof(mask), &mask), 0);
    int first = 0;
    while (first < CPU_SETSIZE && !CPU_ISSET(first, &mask)) ++first;
    ASSERT_LT(first, CPU_SETSIZE);
    CPU_ZERO(&mask);
    CPU_SET(first, &mask);
    ASSERT_EQ(sched_setaffinity(0, sizeof(mask), &mask), 0);
    pinned = UsableCores();
  }).join();
  EXPECT_EQ(pinned, 1);
#endif
}

}  // namespace
}  // namespace kvflow
