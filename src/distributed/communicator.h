// Point-to-point and collective messages between the ranks of one distributed job (KV-Runahead's
// chain prefill, TSP's all-gather, tensor parallelism's step messages and all-reduce). One interface, four transports:
//   - InProcessWorld (in_process_communicator.h): ranks are threads of one process; unit tests.
//   - MpiCommunicator (mpi/mpi_communicator.h): ranks are processes started by mpirun, one machine
//     or many; built when MPI is found.
//   - NcclCommunicator (nccl/nccl_communicator.h): GPU ranks, bootstrapped over MPI; built when
//     NCCL and CUDA are found.
//   - CudaPeerWorld (cuda/cuda_peer_communicator.h): ranks are threads of one process, one GPU
//     each, messages copied GPU to GPU; built with CUDA (and on the CUDA emulator).
//
// Messages are byte buffers of a size both sides know (the partition tells every rank how many
// tokens it receives). Every wait takes a timeout: a peer that never answers, or a rank that died,
// ends the operation with an error (kUnavailable), never a hang. A communicator is used by one
// thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow::dist {

// An operation in flight (ISend / IRecv); its buffer must stay valid and untouched until Wait
// returns. Destroying an unfinished one is allowed only after the communicator failed.
class PendingMessage {
 public:
  virtual ~PendingMessage() = default;
};
using MessageHandle = std::unique_ptr<PendingMessage>;

// Seconds a wait gives a peer by default before it declares it gone.
constexpr double kDefaultCommTimeoutSeconds = 120.0;

// Where a communicator's message buffers live: host memory (in-process, MPI) or, for NCCL and the
// CUDA peer world, the rank's CUDA device's memory.
enum class BufferSpace { kHost, kDevice };

// The element type of a device buffer summed across the ranks (AllReduceSumOnDevice).
enum class DeviceElement { kF32, kF16, kBF16 };

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "in-process", "mpi" or "nccl", with the rank and size, for logs and errors.
  virtual std::string Describe() const = 0;
  virtual BufferSpace buffer_space() const { return BufferSpace::kHost; }

  // Starts sending `data` to `peer` under `tag` (>= 0); messages between two ranks with the same
  // tag arrive in the order sent.
  virtual Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) = 0;
  // Starts receiving exactly data.size() bytes from `peer` under `tag` (a message of another size
  // is an error at Wait).
  virtual Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) = 0;
  // Waits for an operation to finish; kUnavailable after `timeout_s` seconds or when the peer is
  // gone. The handle is spent either way.
  virtual Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) = 0;

  // Device-buffer transports: operations posted after this call start on the transport's stream
  // only once `device_event` (a cudaEvent_t the caller recorded on its own stream, e.g. after
  // packing the buffer a send reads or unpacking the one a receive overwrites) has completed; the
  // host does not wait for it. Host transports have nothing to order: their callers finish that
  // work before posting.
  virtual Status OrderAfter(void* device_event) { return Status::Ok(); }

  // Lets transfers in flight advance while the caller computes: MPI moves a large message only
  // inside MPI calls, so a rank that computes between posting and waiting should poll now and
  // then. Never blocks; a no-op where transfers advance by themselves.
  virtual void Poll() {}

  // Every rank contributes `mine` (the same size on every rank); `all` (size() * mine.size()
  // bytes) receives rank 0's, then rank 1's, ... on every rank.
  virtual Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                           double timeout_s = kDefaultCommTimeoutSeconds) = 0;
  // Every rank's `data` (the same length on every rank, host memory) becomes the elementwise sum
  // over the ranks, with the same bits on every rank: the parts are all-gathered and summed in rank
  // order, so every rank's residual stream stays identical under tensor parallelism.
  Status AllReduceSum(std::span<float> data, double timeout_s = kDefaultCommTimeoutSeconds);
  // Device-buffer transports (buffer_space() == kDevice): `count` elements at `data`, in this
  // rank's device memory, become their elementwise sum over the ranks (tensor parallelism on GPU
  // ranks). Starts after OrderAfter's event and returns once the sum is in place, so work the
  // caller issues afterwards reads it; kUnavailable after `timeout_s` (the transport then fails).
  virtual Status AllReduceSumOnDevice(void* data, int64_t count, DeviceElement element,
                                      double timeout_s = kDefaultCommTimeoutSeconds) {
    return Status::Unsupported(Describe() + ": sums of device buffers");
  }
  // Returns once every rank has called it.
  virtual Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) = 0;

  // Blocking forms.
  Status Send(int peer, int tag, std::span<const std::byte> data, double timeout_s = kDefaultCommTimeoutSeconds);
  Status Recv(int peer, int tag, std::span<std::byte> data, double timeout_s = kDefaultCommTimeoutSeconds);

 private:
  // AllReduceSum's gathered parts, kept across calls (two sums a layer a step under tensor
  // parallelism); one thread at a time uses a communicator.
  std::vector<float> reduce_scratch_;
};

// Checks a peer rank and a tag against a communicator (InvalidArgument naming what is wrong).
Status ValidatePeer(const Communicator& comm, int peer, int tag);

}  // namespace kvflow::dist
