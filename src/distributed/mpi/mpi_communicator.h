// The MPI transport: ranks are the processes mpirun started (one machine or many), over a
// duplicate of MPI_COMM_WORLD so kvflow's tags never meet another library's. Built when CMake finds
// MPI (KVFLOW_MPI); the library then defines KVFLOW_WITH_MPI=1.
//
// Failures: when a process dies, mpirun ends the whole job (Open MPI's default), so the survivors
// never see a dead peer; a peer that hangs is caught by the timeouts: every wait polls its requests
// against a deadline and returns kUnavailable naming the peer. A timed-out receive is cancelled; a
// send or a collective cannot be (Open MPI does not cancel sends, MPI forbids cancelling
// collectives), so after one of those the communicator is failed: every later call returns
// kUnavailable, and the job should end (exit non-zero; mpirun ends the rest).
#pragma once

#include <memory>
#include <vector>

#include "distributed/communicator.h"

namespace kvflow::dist {

// MPI for this process. The first Acquire initialises it (MPI_THREAD_SERIALIZED: one thread at a
// time drives the communicators, not necessarily the one that initialised MPI) unless the
// application already did; the last holder to let go finalises it,
// and only if Acquire initialised it. MPI cannot start again once finalised. Thread-safe.
class MpiSession {
 public:
  static Result<std::shared_ptr<MpiSession>> Acquire();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  explicit MpiSession(bool finalize_at_end) : finalize_at_end_(finalize_at_end) {}
  bool finalize_at_end_;
};

struct MpiCommunicatorOptions {
  // Messages (and all-gather parts) larger than this travel as several MPI messages (MPI counts
  // are ints); smaller in tests, to exercise the split.
  size_t max_chunk_bytes = size_t{1} << 30;
};

// Owns its duplicate of MPI_COMM_WORLD (freed with it) and a share of the MpiSession. One thread
// at a time.
class MpiCommunicator final : public Communicator {
 public:
  // Collective: every rank of MPI_COMM_WORLD creates its communicator together.
  static Result<std::unique_ptr<MpiCommunicator>> Create(MpiCommunicatorOptions options = {});
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string Describe() const override;

  // Tags must also be at most MPI_TAG_UB (at least 32767).
  Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) override;
  Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) override;
  Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) override;
  // MPI_Iallgather through buffers of the communicator's own, so that a late peer can never write
  // into the caller's memory after a timeout.
  Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                   double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) override;
  // One turn of MPI's progress engine (MPI_Iprobe).
  void Poll() override;

 private:
  struct Impl;  // the MPI handles, kept out of this header so that it does not need mpi.h
  MpiCommunicator(std::unique_ptr<Impl> impl, int rank, int size);
  Status CheckUsable() const;
  Status CheckTag(int tag) const;

  std::unique_ptr<Impl> impl_;
  int rank_;
  int size_;
};

}  // namespace kvflow::dist
