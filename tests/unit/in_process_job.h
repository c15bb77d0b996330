// A job of in-process ranks for the tests of distributed serving: every rank but the serving one
// runs `worker` on a thread of its own (KV-Runahead's prefill workers, tensor parallelism's
// workers); the test drives the serving rank's engine over serving().
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "distributed/in_process_communicator.h"
#include "kvflow/status.h"

namespace kvflow::test {

class InProcessJob {
 public:
  InProcessJob(int ranks, int serving_rank, const std::function<Status(dist::Communicator&)>& worker)
      : comms_(dist::InProcessWorld::Create(ranks)), results_(static_cast<size_t>(ranks)), serving_(serving_rank) {
    for (int r = 0; r < ranks; ++r) {
      if (r == serving_rank) continue;
      workers_.emplace_back([this, r, worker] { results_[static_cast<size_t>(r)] = worker(*comms_[r]); });
    }
  }
  ~InProcessJob() { Join(); }
  dist::Communicator& serving() { return *comms_[serving_]; }
  dist::InProcessCommunicator& rank(int r) { return static_cast<dist::InProcessCommunicator&>(*comms_[r]); }
  void Join() {
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }
  // A worker's result, once joined.
  const Status& result(int r) const { return results_[static_cast<size_t>(r)]; }

 private:
  std::vector<std::unique_ptr<dist::Communicator>> comms_;
  std::vector<Status> results_;
  int serving_;
  std::vector<std::thread> workers_;
};

}  // namespace kvflow::test
