// What the transports share: their waits' deadlines (clamped, so that "wait forever" does not
// overflow the clock) and the tags the collectives of the thread-based worlds reserve.
#pragma once

#include <spdlog/fmt/fmt.h>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

namespace kvflow::dist {

using Clock = std::chrono::steady_clock;

inline Clock::time_point DeadlineAfter(double timeout_s) {
  const double seconds = std::clamp(timeout_s, 0.0, 1e7);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

inline double SecondsLeft(Clock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
}

// Between two polls of a device event: yield at first (the answer is usually near), then sleep
// 100 us, so that a long wait leaves the core to the ranks that compute.
inline void PollPause(int& polls) {
  if (++polls < 200) {
    sched_yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Collectives built from point-to-point messages use tags no caller can (ValidatePeer refuses
// negative tags).
constexpr int kAllGatherTag = -1;
constexpr int kBarrierTag = -2;

// A tag as messages name it.
inline std::string TagName(int tag) {
  if (tag == kAllGatherTag) return "all-gather";
  if (tag == kBarrierTag) return "barrier";
  return fmt::format("tag {}", tag);
}

}  // namespace kvflow::dist
