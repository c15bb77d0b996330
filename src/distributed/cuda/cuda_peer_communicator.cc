#include "distributed/cuda/cuda_peer_communicator.h"

#include "distributed/deadline.h"
#include "util/half.h"

#ifdef KVFLOW_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif
#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>

namespace kvflow::dist {

namespace {

Status CudaError(cudaError_t code, std::string_view what) {
  if (code == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return Status::Internal(fmt::format("{}: CUDA error: {}", what, cudaGetErrorString(code)));
}

// Makes `device` current for the scope and restores the thread's previous device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      cudaSetDevice(device);
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// An event and the device it belongs to, destroyed on that device.
struct OwnedEvent {
  OwnedEvent(int device, cudaEvent_t event) : device(device), event(event) {}
  ~OwnedEvent() {
    DeviceGuard guard(device);
    cudaEventDestroy(event);
  }
  int device;
  cudaEvent_t event;
};

Result<std::shared_ptr<OwnedEvent>> RecordEvent(int device, cudaStream_t stream, std::string_view what) {
  cudaEvent_t event = nullptr;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), what));
  auto owned = std::make_shared<OwnedEvent>(device, event);
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventRecord(event, stream), what));
  return owned;
}

// A posted send or receive. `ready` marks, on its poster's stream, the work the poster ordered
// before it; once matched, `done` marks the copy's end (on the stream of whichever side issued it).
struct PeerOp {
  bool is_send = false;
  int owner = 0;  // rank that posted it
  int peer = 0;
  int tag = 0;
  std::byte* data = nullptr;
  size_t bytes = 0;
  int device = 0;
  std::shared_ptr<OwnedEvent> ready;
  bool matched = false;
  Status result;
  std::shared_ptr<OwnedEvent> done;
};

struct Mailbox {
  std::deque<std::shared_ptr<PeerOp>> sends;  // posted before their receive
  std::deque<std::shared_ptr<PeerOp>> recvs;  // posted before their send
};

}  // namespace

struct CudaPeerWorldState {
  explicit CudaPeerWorldState(int size) : gone(static_cast<size_t>(size), false) {}
  Mailbox& Box(int src, int dst, int tag) { return mailboxes[std::make_tuple(src, dst, tag)]; }

  std::mutex mu;
  std::condition_variable changed;
  std::vector<bool> gone;
  std::map<std::tuple<int, int, int>, Mailbox> mailboxes;  // (source, destination, tag)
};

namespace {

class PeerMessage final : public PendingMessage {
 public:
  PeerMessage(std::shared_ptr<CudaPeerWorldState> world, const CudaPeerCommunicator* owner, std::shared_ptr<PeerOp> op)
      : world_(std::move(world)), owner_(owner), op_(std::move(op)) {}
  ~PeerMessage() override {
    std::lock_guard lock(world_->mu);
    if (op_->matched) return;
    const int src = op_->is_send ? op_->owner : op_->peer, dst = op_->is_send ? op_->peer : op_->owner;
    auto& queue = op_->is_send ? world_->Box(src, dst, op_->tag).sends : world_->Box(src, dst, op_->tag).recvs;
    queue.erase(std::remove(queue.begin(), queue.end(), op_), queue.end());
  }
  const CudaPeerCommunicator* owner() const { return owner_; }
  const std::shared_ptr<PeerOp>& op() const { return op_; }

 private:
  std::shared_ptr<CudaPeerWorldState> world_;
  const CudaPeerCommunicator* owner_;  // compared, never dereferenced
  std::shared_ptr<PeerOp> op_;
};

// Issues the copy between a send and its receive on `stream` (of `device`, the caller's), after
// the other side's ready event; both ops are then matched. Under the world's lock.
void IssueCopy(PeerOp& mine, PeerOp& theirs, int device, cudaStream_t stream) {
  PeerOp& send = mine.is_send ? mine : theirs;
  PeerOp& recv = mine.is_send ? theirs : mine;
  Status st;
  std::shared_ptr<OwnedEvent> done;
  if (send.bytes != recv.bytes) {
    st = Status::InvalidArgument(fmt::format("CUDA peer rank {} expected {} bytes from rank {} ({}) but the message has {}",
                                             recv.owner, recv.bytes, send.owner, TagName(send.tag), send.bytes));
  } else {
    st = CudaError(cudaStreamWaitEvent(stream, theirs.ready->event, 0), "cudaStreamWaitEvent");
    if (st.ok() && send.bytes > 0) {
      st = CudaError(cudaMemcpyPeerAsync(recv.data, recv.device, send.data, send.device, send.bytes, stream),
                     fmt::format("cudaMemcpyPeerAsync of {} bytes from device {} to device {}", send.bytes,
                                 send.device, recv.device));
    }
    if (st.ok()) {
      Result<std::shared_ptr<OwnedEvent>> recorded = RecordEvent(device, stream, "the copy's event");
      if (recorded.ok()) {
        done = std::move(recorded).value();
      } else {
        st = recorded.status();
      }
    }
  }
  for (PeerOp* op : {&send, &recv}) {
    op->matched = true;
    op->result = st;
    op->done = done;
  }
}

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> CudaPeerWorld::Create(const std::vector<int>& devices) {
  if (devices.empty()) return Status::InvalidArgument("a CUDA peer world needs at least one device");
  int count = 0;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  for (int d : devices) {
    if (d < 0 || d >= count) {
      return Status::InvalidArgument(fmt::format("CUDA device {} does not exist ({} visible)", d, count));
    }
  }
  // Direct peer access where the hardware has it; the copies work without it (staged).
  for (int a : devices) {
    DeviceGuard guard(a);
    for (int b : devices) {
      int can = 0;
      if (a == b || cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || can == 0) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess) cudaGetLastError();  // already enabled, or not possible: the copy still works
    }
  }
  auto world = std::make_shared<CudaPeerWorldState>(static_cast<int>(devices.size()));
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (size_t r = 0; r < devices.size(); ++r) {
    DeviceGuard guard(devices[r]);
    cudaStream_t stream = nullptr;
    KVFLOW_RETURN_IF_ERROR(CudaError(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                     fmt::format("cudaStreamCreate on device {}", devices[r])));
    ranks.push_back(std::make_unique<CudaPeerCommunicator>(world, static_cast<int>(r), devices[r], stream));
  }
  return ranks;
}

CudaPeerCommunicator::CudaPeerCommunicator(std::shared_ptr<CudaPeerWorldState> world, int rank, int device,
                                           void* stream)
    : world_(std::move(world)), rank_(rank), device_(device), stream_(stream) {}

CudaPeerCommunicator::~CudaPeerCommunicator() {
  MarkGone();
  DeviceGuard guard(device_);
  // Copies this rank issued may still be writing a peer's buffer.
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (reduce_parts_ != nullptr) cudaFree(reduce_parts_);
}

int CudaPeerCommunicator::size() const { return static_cast<int>(world_->gone.size()); }

std::string CudaPeerCommunicator::Describe() const {
  return fmt::format("cuda-peer rank {} of {} (device {})", rank_, size(), device_);
}

void CudaPeerCommunicator::MarkGone() {
  {
    std::lock_guard lock(world_->mu);
    world_->gone[static_cast<size_t>(rank_)] = true;
  }
  world_->changed.notify_all();
}

Status CudaPeerCommunicator::OrderAfter(void* device_event) {
  if (device_event == nullptr) return Status::Ok();
  DeviceGuard guard(device_);
  return CudaError(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(device_event), 0),
                   fmt::format("{}: cudaStreamWaitEvent", Describe()));
}

Result<MessageHandle> CudaPeerCommunicator::ISend(int peer, int tag, std::span<const std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return Post(true, peer, tag, const_cast<std::byte*>(data.data()), data.size());
}

Result<MessageHandle> CudaPeerCommunicator::IRecv(int peer, int tag, std::span<std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  return Post(false, peer, tag, data.data(), data.size());
}

Result<MessageHandle> CudaPeerCommunicator::Post(bool is_send, int peer, int tag, std::byte* data, size_t bytes) {
  DeviceGuard guard(device_);
  auto stream = static_cast<cudaStream_t>(stream_);
  auto op = std::make_shared<PeerOp>();
  op->is_send = is_send;
  op->owner = rank_;
  op->peer = peer;
  op->tag = tag;
  op->data = data;
  op->bytes = bytes;
  op->device = device_;
  KVFLOW_ASSIGN_OR_RETURN(op->ready, RecordEvent(device_, stream, Describe()));
  {
    std::lock_guard lock(world_->mu);
    if (world_->gone[static_cast<size_t>(rank_)] || (is_send && world_->gone[static_cast<size_t>(peer)])) {
      const int who = world_->gone[static_cast<size_t>(rank_)] ? rank_ : peer;
      return Status::Unavailable(fmt::format("{}: cannot {} rank {} ({}): rank {} is gone", Describe(),
                                             is_send ? "send to" : "receive from", peer, TagName(tag), who));
    }
    Mailbox& box = is_send ? world_->Box(rank_, peer, tag) : world_->Box(peer, rank_, tag);
    auto& theirs = is_send ? box.recvs : box.sends;
    if (theirs.empty()) {
      (is_send ? box.sends : box.recvs).push_back(op);
    } else {
      std::shared_ptr<PeerOp> other = theirs.front();
      theirs.pop_front();
      IssueCopy(*op, *other, device_, stream);
    }
  }
  world_->changed.notify_all();
  return MessageHandle(std::make_unique<PeerMessage>(world_, this, std::move(op)));
}

Status CudaPeerCommunicator::Wait(MessageHandle handle, double timeout_s) {
  auto* message = dynamic_cast<PeerMessage*>(handle.get());
  if (message == nullptr || message->owner() != this) {
    return Status::InvalidArgument(fmt::format("{}: Wait on a handle of another communicator", Describe()));
  }
  const std::shared_ptr<PeerOp>& op = message->op();
  const auto deadline = DeadlineAfter(timeout_s);
  std::shared_ptr<OwnedEvent> done;
  {
    std::unique_lock lock(world_->mu);
    const bool settled = world_->changed.wait_until(
        lock, deadline, [&] { return op->matched || world_->gone[static_cast<size_t>(op->peer)]; });
    if (!op->matched) {
      if (settled) {
        return Status::Unavailable(fmt::format("{}: rank {} is gone; it never {} the message ({})", Describe(),
                                               op->peer, op->is_send ? "took" : "sent", TagName(op->tag)));
      }
      return Status::Unavailable(fmt::format("{}: rank {} waited {:.1f} s for rank {} ({}); {}", Describe(), rank_,
                                             timeout_s, op->peer, TagName(op->tag),
                                             op->is_send ? "it never took the message" : "no message came"));
    }
    KVFLOW_RETURN_IF_ERROR(op->result);
    done = op->done;
  }
  // The copy is issued; wait for the device, against the same deadline.
  int polls = 0;
  for (;;) {
    const cudaError_t state = cudaEventQuery(done->event);
    if (state == cudaSuccess) return Status::Ok();
    if (state != cudaErrorNotReady) return CudaError(state, Describe());
    if (Clock::now() >= deadline) {
      return Status::Unavailable(fmt::format("{}: the copy from rank {} did not finish within {:.1f} s ({})",
                                             Describe(), op->peer, timeout_s, TagName(op->tag)));
    }
    PollPause(polls);
  }
}

Status CudaPeerCommunicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all, double timeout_s) {
  const size_t part = mine.size();
  if (all.size() != part * static_cast<size_t>(size())) {
    return Status::InvalidArgument(fmt::format("{}: all-gather of {} bytes per rank needs {} bytes, got {}", Describe(),
                                               part, part * static_cast<size_t>(size()), all.size()));
  }
  const auto deadline = DeadlineAfter(timeout_s);
  std::vector<MessageHandle> pending;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_) continue;
    KVFLOW_ASSIGN_OR_RETURN(MessageHandle recv,
                            Post(false, peer, kAllGatherTag, all.data() + static_cast<size_t>(peer) * part, part));
    pending.push_back(std::move(recv));
  }
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_) continue;
    KVFLOW_ASSIGN_OR_RETURN(MessageHandle send,
                            Post(true, peer, kAllGatherTag, const_cast<std::byte*>(mine.data()), part));
    pending.push_back(std::move(send));
  }
  {
    DeviceGuard guard(device_);
    auto stream = static_cast<cudaStream_t>(stream_);
    if (part > 0) {
      KVFLOW_RETURN_IF_ERROR(CudaError(cudaMemcpyAsync(all.data() + static_cast<size_t>(rank_) * part, mine.data(),
                                                       part, cudaMemcpyDeviceToDevice, stream),
                                       Describe()));
    }
    KVFLOW_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), Describe()));
  }
  for (MessageHandle& h : pending) KVFLOW_RETURN_IF_ERROR(Wait(std::move(h), SecondsLeft(deadline)));
  return Status::Ok();
}

Status CudaPeerCommunicator::AllReduceSumOnDevice(void* data, int64_t count, DeviceElement element,
                                                  double timeout_s) {
  if (count < 0 || (count > 0 && data == nullptr)) {
    return Status::InvalidArgument(fmt::format("{}: all-reduce of {} elements at {}", Describe(), count, data));
  }
  if (count == 0) return Status::Ok();
  const size_t width = element == DeviceElement::kF32 ? 4 : 2;
  const size_t part = static_cast<size_t>(count) * width, parts = part * static_cast<size_t>(size());
  {
    DeviceGuard guard(device_);
    if (reduce_parts_bytes_ < parts) {
      if (reduce_parts_ != nullptr) cudaFree(reduce_parts_);
      reduce_parts_ = nullptr;
      reduce_parts_bytes_ = 0;
      KVFLOW_RETURN_IF_ERROR(CudaError(cudaMalloc(&reduce_parts_, parts), Describe() + ": all-reduce parts"));
      reduce_parts_bytes_ = parts;
    }
  }
  const auto deadline = DeadlineAfter(timeout_s);
  KVFLOW_RETURN_IF_ERROR(AllGather(std::span(static_cast<const std::byte*>(data), part),
                                   std::span(static_cast<std::byte*>(reduce_parts_), parts), SecondsLeft(deadline)));
  std::vector<std::byte> host(parts);
  DeviceGuard guard(device_);
  KVFLOW_RETURN_IF_ERROR(
      CudaError(cudaMemcpy(host.data(), reduce_parts_, parts, cudaMemcpyDeviceToHost), Describe() + ": all-reduce"));
  auto load = [&](size_t rank, size_t i) -> float {
    const std::byte* at = host.data() + rank * part + i * width;
    if (element == DeviceElement::kF32) {
      float f;
      std::memcpy(&f, at, 4);
      return f;
    }
    uint16_t bits;
    std::memcpy(&bits, at, 2);
    return element == DeviceElement::kF16 ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
  };
  std::vector<std::byte> sum(part);
  for (size_t i = 0; i < static_cast<size_t>(count); ++i) {
    float total = load(0, i);
    for (size_t r = 1; r < static_cast<size_t>(size()); ++r) total += load(r, i);
    std::byte* at = sum.data() + i * width;
    if (element == DeviceElement::kF32) {
      std::memcpy(at, &total, 4);
    } else {
      const uint16_t bits = element == DeviceElement::kF16 ? FloatToHalfBits(total) : FloatToBf16Bits(total);
      std::memcpy(at, &bits, 2);
    }
  }
  return CudaError(cudaMemcpy(data, sum.data(), part, cudaMemcpyHostToDevice), Describe() + ": all-reduce");
}

Status CudaPeerCommunicator::Barrier(double timeout_s) {
  const auto deadline = DeadlineAfter(timeout_s);
  std::vector<MessageHandle> pending;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank_) continue;
    KVFLOW_ASSIGN_OR_RETURN(MessageHandle recv, Post(false, peer, kBarrierTag, nullptr, 0));
    pending.push_back(std::move(recv));
    KVFLOW_ASSIGN_OR_RETURN(MessageHandle send, Post(true, peer, kBarrierTag, nullptr, 0));
    pending.push_back(std::move(send));
  }
  for (MessageHandle& h : pending) KVFLOW_RETURN_IF_ERROR(Wait(std::move(h), SecondsLeft(deadline)));
  return Status::Ok();
}

}  // namespace kvflow::dist
