// A world whose ranks are threads of one process, each driving its own CUDA device, with messages
// in device memory (buffer_space() == kDevice) copied GPU to GPU (cudaMemcpyPeerAsync: NVLink or
// PCIe peer-to-peer where the devices allow it, staged by the driver otherwise). The device
// transport of a one-process, several-GPU job without NCCL, and the one the tests run the
// device-buffer chain on (the CUDA emulator's devices, KVFLOW_EMU_DEVICES).
//
// Sends and receives rendezvous: the rank that posts second issues the copy on its own stream,
// after the other side's post-time event, so neither host waits for the other's device work (the
// order each side asked for with OrderAfter holds on the device). A send's buffer must stay
// untouched until its Wait returns, as with NCCL. Every Wait takes a deadline; a rank whose
// communicator is gone fails the waits on messages it never posted (kUnavailable naming it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "distributed/communicator.h"

namespace kvflow::dist {

struct CudaPeerWorldState;  // the mailboxes, shared by the world's communicators and handles

class CudaPeerWorld {
 public:
  // One communicator per entry of `devices` (rank i drives devices[i]; a device may repeat, which
  // makes the copies device-local). Each is to be driven by one thread.
  static Result<std::vector<std::unique_ptr<Communicator>>> Create(const std::vector<int>& devices);
};

class CudaPeerCommunicator final : public Communicator {
 public:
  CudaPeerCommunicator(std::shared_ptr<CudaPeerWorldState> world, int rank, int device, void* stream);
  ~CudaPeerCommunicator() override;  // marks the rank gone, then waits for its copies in flight

  int rank() const override { return rank_; }
  int size() const override;
  std::string Describe() const override;
  BufferSpace buffer_space() const override { return BufferSpace::kDevice; }

  Status OrderAfter(void* device_event) override;
  Result<MessageHandle> ISend(int peer, int tag, std::span<const std::byte> data) override;
  Result<MessageHandle> IRecv(int peer, int tag, std::span<std::byte> data) override;
  Status Wait(MessageHandle handle, double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status AllGather(std::span<const std::byte> mine, std::span<std::byte> all,
                   double timeout_s = kDefaultCommTimeoutSeconds) override;
  // The parts all-gathered on the device, then added on the host in rank order (in fp32, rounded
  // once to the element type) and written back: every rank gets the same bits. The tests' and a
  // one-process job's transport, not a fast path (NCCL's ring is).
  Status AllReduceSumOnDevice(void* data, int64_t count, DeviceElement element,
                              double timeout_s = kDefaultCommTimeoutSeconds) override;
  Status Barrier(double timeout_s = kDefaultCommTimeoutSeconds) override;

  // This rank leaves the world (as if its thread died). Idempotent.
  void MarkGone();

 private:
  Result<MessageHandle> Post(bool is_send, int peer, int tag, std::byte* data, size_t bytes);

  std::shared_ptr<CudaPeerWorldState> world_;
  int rank_;
  int device_;
  void* stream_;  // cudaStream_t on device_, owned
  void* reduce_parts_ = nullptr;  // AllReduceSumOnDevice's gathered parts, on device_, owned
  size_t reduce_parts_bytes_ = 0;
};

}  // namespace kvflow::dist
