// The NCCL transport: GPU ranks whose messages are CUDA device buffers (buffer_space() ==
// kDevice), one GPU per rank. Built when CUDA and NCCL are found (KVFLOW_NCCL); the library then
// defines KVFLOW_WITH_NCCL=1.
//
// NCCL has no tags: it matches the sends and receives between two ranks in the order they are
// posted, so both sides must post them in the same order (tags are checked, not used), and it
// cannot tell a size mismatch (both sides must agree on sizes, as the partition guarantees).
// Operations posted between two launches (a Poll, a Wait or a collective) go out together as one NCCL
// group, so a rank may post a send and a receive (even to itself) before waiting on either. A wait polls
// a CUDA event against its deadline; on timeout the NCCL communicator is aborted and this
// communicator is failed: every later call returns kUnavailable.
#pragma once

#include <memory>

#include "distributed/communicator.h"

namespace kvflow::dist {

// Owns its NCCL communicator, a CUDA stream and its events on `device`. One thread at a time.
class NcclCommunicator final : public Communicator {
 public:
  // Collective over every rank of `bootstrap` (a host communicator; MpiCommunicator in a job
  // started by mpirun): rank 0's ncclUniqueId reaches the others through bootstrap.AllGather,
  // then every rank joins the NCCL world on `device` with its bootstrap rank.
  static Result<std::unique_ptr<NcclCommunicator>> Create(Communicator& bootstrap, int device,
                                                          double timeout_s = kDefaultCommTimeoutSeconds);
  // A world of one on `device`, without MPI: a single GPU tests the transport with messages to
  // itself.
  static Result<std::unique_ptr<NcclCommunicator>> CreateSingleDevice(int device);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string Describe() const override;
  BufferSpace buffer_space() const override { return BufferSpace::kDevice; }

  // Makes the communicator's stream wait for `device_event` (cudaStreamWaitEvent) before the
  // operations posted after it.
  Status OrderAfter(void* device_event) override;
  // Launches what was posted since the last launch (one NCCL group), so that transfers run while
  // the caller computes; the NCCL calls return at once (non-blocking communicator).
  void Poll() override;
  Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) override;
  Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) override;
  Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                   double timeout_s = kDefaultCommTimeoutSeconds) override;
  // ncclAllReduce in place on the communicator's stream (ring or tree: every rank receives the
  // same bits), after what was posted before it.
  Status AllReduceSumOnDevice(void* data, int64_t count, DeviceElement element,
                              double timeout_s = kDefaultCommTimeoutSeconds) override;
  // A one-element all-reduce.
  Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) override;

 private:
  struct Impl;  // NCCL and CUDA handles, kept out of this header
  NcclCommunicator(std::unique_ptr<Impl> impl, int rank, int size);
  static Result<std::unique_ptr<NcclCommunicator>> Init(const void* unique_id, int size, int rank, int device,
                                                        double timeout_s);

  std::unique_ptr<Impl> impl_;
  int rank_;
  int size_;
};

}  // namespace kvflow::dist
