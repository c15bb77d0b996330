#include "distributed/nccl/nccl_communicator.h"

#include "distributed/deadline.h"
#include "distributed/world.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace kvflow::dist {

namespace {

// How long the destructor lets a healthy communicator finish its work before aborting it.
constexpr double kFinalizeSeconds = 10.0;

Status CudaError(cudaError_t code, std::string_view what) {
  if (code == cudaSuccess) return Status::Ok();
  return Status::Internal(fmt::format("{}: CUDA error: {}", what, cudaGetErrorString(code)));
}

// Operations posted since the last launch; one NCCL group, one event.
struct Batch {
  ~Batch() {
    if (done != nullptr) cudaEventDestroy(done);
  }
  cudaEvent_t done = nullptr;  // recorded after the group's kernels; null until launched
};

struct PostedOp {
  bool is_send;
  int peer;
  void* data;
  size_t bytes;
};

class NcclMessage final : public PendingMessage {
 public:
  NcclMessage(const void* owner, std::shared_ptr<Batch> batch, bool is_send, int peer, int tag)
      : owner(owner), batch(std::move(batch)), is_send(is_send), peer(peer), tag(tag) {}
  const void* owner;
  std::shared_ptr<Batch> batch;
  bool is_send;
  int peer;
  int tag;
};

}  // namespace

struct NcclCommunicator::Impl {
  ~Impl() {
    if (device >= 0) cudaSetDevice(device);
    if (comm != nullptr) {
      const bool finished =
          failed.ok() && Call(ncclCommFinalize(comm), DeadlineAfter(kFinalizeSeconds), "ncclCommFinalize").ok();
      if (finished) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (scratch != nullptr) cudaFree(scratch);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  Status NcclError(ncclResult_t code, std::string_view what) const {
    const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    return Status::Internal(fmt::format("{}: NCCL error: {}{}{}", what, ncclGetErrorString(code),
                                        last != nullptr && *last != '\0' ? ": " : "", last != nullptr ? last : ""));
  }

  // A non-blocking NCCL call answers ncclInProgress and goes on in the background: polls until it
  // settled, or the deadline (kUnavailable; the caller aborts).
  Status Settle(Clock::time_point deadline, std::string_view what) const {
    int polls = 0;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t code = ncclCommGetAsyncError(comm, &state);
      if (code != ncclSuccess) return NcclError(code, what);
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) return NcclError(state, what);
      if (Clock::now() >= deadline) return Status::Unavailable(fmt::format("{}: still in progress at the deadline", what));
      PollPause(polls);
    }
  }

  Status Call(ncclResult_t code, Clock::time_point deadline, std::string_view what) const {
    if (code == ncclInProgress) return Settle(deadline, what);
    return code == ncclSuccess ? Status::Ok() : NcclError(code, what);
  }

  // Launches the open batch as one NCCL group and records its event; later posts open a new one.
  Status LaunchOpenBatch(Clock::time_point deadline, const std::string& who);
  // Waits for `event` (recorded on `stream`) until the deadline; on timeout aborts the NCCL
  // communicator, whose kernels might otherwise wait forever for a peer.
  Status AwaitEvent(cudaEvent_t event, Clock::time_point deadline, const std::string& on_timeout);
  Status Abort(std::string why) {
    ncclCommAbort(comm);
    comm = nullptr;
    failed = Status::Unavailable(std::move(why));
    return failed;
  }

  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = -1;
  int* scratch = nullptr;  // the barrier's one element, on the device
  Status failed;           // set by a timeout (the NCCL communicator was aborted)
  std::shared_ptr<Batch> open = std::make_shared<Batch>();
  std::vector<PostedOp> posted;  // the open batch's operations
};

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Init(const void* unique_id, int size, int rank, int device,
                                                                 double timeout_s) {
  auto impl = std::make_unique<Impl>();
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device)));
  impl->device = device;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaMalloc(&impl->scratch, sizeof(int)), "cudaMalloc"));
  ncclUniqueId id;
  std::memcpy(&id, unique_id, sizeof(id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once, so that the deadlines hold
  const auto deadline = DeadlineAfter(timeout_s);
  const ncclResult_t code = ncclCommInitRankConfig(&impl->comm, size, id, rank, &config);
  Status st = impl->Call(code, deadline, fmt::format("ncclCommInitRank (rank {} of {}, device {})", rank, size, device));
  if (!st.ok()) {
    impl->failed = st;  // the destructor aborts what was started
    return st;
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl), rank, size));
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(Communicator& bootstrap, int device,
                                                                   double timeout_s) {
  if (bootstrap.buffer_space() != BufferSpace::kHost) {
    return Status::InvalidArgument("NCCL's bootstrap needs a host communicator (in-process or MPI)");
  }
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (bootstrap.rank() == 0) {
    const ncclResult_t code = ncclGetUniqueId(&id);
    if (code != ncclSuccess) return Status::Internal(fmt::format("ncclGetUniqueId: {}", ncclGetErrorString(code)));
  }
  std::vector<std::byte> ids(sizeof(id) * static_cast<size_t>(bootstrap.size()));
  KVFLOW_RETURN_IF_ERROR(bootstrap.AllGather(std::as_bytes(std::span(&id, 1)), ids, timeout_s));
  return Init(ids.data(), bootstrap.size(), bootstrap.rank(), device, timeout_s);  // rank 0's id comes first
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::CreateSingleDevice(int device) {
  ncclUniqueId id;
  const ncclResult_t code = ncclGetUniqueId(&id);
  if (code != ncclSuccess) return Status::Internal(fmt::format("ncclGetUniqueId: {}", ncclGetErrorString(code)));
  return Init(&id, 1, 0, device, kDefaultCommTimeoutSeconds);
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl, int rank, int size)
    : impl_(std::move(impl)), rank_(rank), size_(size) {}

NcclCommunicator::~NcclCommunicator() = default;

std::string NcclCommunicator::Describe() const {
  return fmt::format("nccl rank {} of {} (device {})", rank_, size_, impl_->device);
}

Status NcclCommunicator::OrderAfter(void* device_event) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  if (device_event == nullptr) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaSetDevice(impl_->device), Describe()));
  // Operations already posted but not launched are enqueued after this wait too (they launch later).
  return CudaError(cudaStreamWaitEvent(impl_->stream, static_cast<cudaEvent_t>(device_event), 0),
                   fmt::format("{}: cudaStreamWaitEvent", Describe()));
}

void NcclCommunicator::Poll() {
  if (!impl_->failed.ok() || impl_->posted.empty()) return;
  // A launch that fails leaves its error to the Wait on its handles: the batch's event is then
  // null and Wait reports the communicator's state.
  Status launched = impl_->LaunchOpenBatch(DeadlineAfter(kDefaultCommTimeoutSeconds), Describe());
  if (!launched.ok()) (void)impl_->Abort(fmt::format("{}: launching posted operations: {}", Describe(), launched.message()));
}

Result<MessageHandle> NcclCommunicator::ISend(int peer, int tag, std::span<const std::byte> data) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  impl_->posted.push_back({true, peer, const_cast<std::byte*>(data.data()), data.size()});
  return MessageHandle(std::make_unique<NcclMessage>(this, impl_->open, true, peer, tag));
}

Result<MessageHandle> NcclCommunicator::IRecv(int peer, int tag, std::span<std::byte> data) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  impl_->posted.push_back({false, peer, data.data(), data.size()});
  return MessageHandle(std::make_unique<NcclMessage>(this, impl_->open, false, peer, tag));
}

Status NcclCommunicator::Impl::LaunchOpenBatch(Clock::time_point deadline, const std::string& who) {
  std::shared_ptr<Batch> batch = std::move(open);
  std::vector<PostedOp> ops = std::move(posted);
  open = std::make_shared<Batch>();
  posted.clear();
  if (ops.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaSetDevice(device), who));
  ncclGroupStart();
  for (const PostedOp& op : ops) {
    const ncclResult_t code = op.is_send ? ncclSend(op.data, op.bytes, ncclUint8, op.peer, comm, stream)
                                         : ncclRecv(op.data, op.bytes, ncclUint8, op.peer, comm, stream);
    if (code != ncclSuccess && code != ncclInProgress) {
      ncclGroupEnd();
      return NcclError(code, fmt::format("{}: {} rank {}", who, op.is_send ? "ncclSend to" : "ncclRecv from", op.peer));
    }
  }
  KVFLOW_RETURN_IF_ERROR(Call(ncclGroupEnd(), deadline, fmt::format("{}: ncclGroupEnd", who)));
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&batch->done, cudaEventDisableTiming), who));
  return CudaError(cudaEventRecord(batch->done, stream), who);
}

Status NcclCommunicator::Impl::AwaitEvent(cudaEvent_t event, Clock::time_point deadline,
                                          const std::string& on_timeout) {
  int polls = 0;
  for (;;) {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaSuccess) return Status::Ok();
    if (state != cudaErrorNotReady) return CudaError(state, on_timeout);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, on_timeout);
    if (Clock::now() >= deadline) return Abort(on_timeout);
    PollPause(polls);
  }
}

Status NcclCommunicator::Wait(MessageHandle handle, double timeout_s) {
  auto* message = dynamic_cast<NcclMessage*>(handle.get());
  if (message == nullptr || message->owner != this) {
    return Status::InvalidArgument(fmt::format("{}: Wait on a handle of another communicator", Describe()));
  }
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  const auto deadline = DeadlineAfter(timeout_s);
  const std::string on_timeout =
      message->is_send ? fmt::format("{}: rank {} waited {:.1f} s for rank {} to take its message (tag {})", Describe(),
                                     rank_, timeout_s, message->peer, message->tag)
                       : fmt::format("{}: rank {} waited {:.1f} s for rank {} (tag {}); no message came", Describe(),
                                     rank_, timeout_s, message->peer, message->tag);
  if (message->batch->done == nullptr) {
    Status launched = impl_->LaunchOpenBatch(deadline, Describe());
    if (launched.code() == StatusCode::kUnavailable) return impl_->Abort(on_timeout);
    KVFLOW_RETURN_IF_ERROR(launched);
  }
  return impl_->AwaitEvent(message->batch->done, deadline, on_timeout);
}

Status NcclCommunicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all, double timeout_s) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  if (all.size() != mine.size() * static_cast<size_t>(size_)) {
    return Status::InvalidArgument(fmt::format("{}: all-gather of {} bytes per rank needs {} bytes, got {}", Describe(),
                                               mine.size(), mine.size() * static_cast<size_t>(size_), all.size()));
  }
  const auto deadline = DeadlineAfter(timeout_s);
  KVFLOW_RETURN_IF_ERROR(impl_->LaunchOpenBatch(deadline, Describe()));  // what was posted goes first
  KVFLOW_RETURN_IF_ERROR(impl_->Call(
      ncclAllGather(mine.data(), all.data(), mine.size(), ncclUint8, impl_->comm, impl_->stream), deadline,
      fmt::format("{}: ncclAllGather", Describe())));
  Batch finished;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&finished.done, cudaEventDisableTiming), Describe()));
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventRecord(finished.done, impl_->stream), Describe()));
  return impl_->AwaitEvent(finished.done, deadline,
                    fmt::format("{}: rank {} waited {:.1f} s for the other ranks in an all-gather", Describe(), rank_,
                                timeout_s));
}

Status NcclCommunicator::AllReduceSumOnDevice(void* data, int64_t count, DeviceElement element, double timeout_s) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  if (count < 0 || (count > 0 && data == nullptr)) {
    return Status::InvalidArgument(fmt::format("{}: all-reduce of {} elements at {}", Describe(), count, data));
  }
  if (count == 0) return Status::Ok();
  const ncclDataType_t type = element == DeviceElement::kF32   ? ncclFloat32
                              : element == DeviceElement::kF16 ? ncclFloat16
                                                               : ncclBfloat16;
  const auto deadline = DeadlineAfter(timeout_s);
  KVFLOW_RETURN_IF_ERROR(impl_->LaunchOpenBatch(deadline, Describe()));  // what was posted goes first
  KVFLOW_RETURN_IF_ERROR(impl_->Call(
      ncclAllReduce(data, data, static_cast<size_t>(count), type, ncclSum, impl_->comm, impl_->stream), deadline,
      fmt::format("{}: ncclAllReduce", Describe())));
  Batch finished;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&finished.done, cudaEventDisableTiming), Describe()));
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventRecord(finished.done, impl_->stream), Describe()));
  return impl_->AwaitEvent(finished.done, deadline,
                           fmt::format("{}: rank {} waited {:.1f} s for the other ranks in an all-reduce", Describe(),
                                       rank_, timeout_s));
}

Status NcclCommunicator::Barrier(double timeout_s) {
  if (!impl_->failed.ok()) return Status::Unavailable(fmt::format("{}: unusable: {}", Describe(), impl_->failed.message()));
  const auto deadline = DeadlineAfter(timeout_s);
  KVFLOW_RETURN_IF_ERROR(impl_->LaunchOpenBatch(deadline, Describe()));
  KVFLOW_RETURN_IF_ERROR(impl_->Call(
      ncclAllReduce(impl_->scratch, impl_->scratch, 1, ncclInt32, ncclSum, impl_->comm, impl_->stream), deadline,
      fmt::format("{}: ncclAllReduce (barrier)", Describe())));
  Batch finished;
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&finished.done, cudaEventDisableTiming), Describe()));
  KVFLOW_RETURN_IF_ERROR(CudaError(cudaEventRecord(finished.done, impl_->stream), Describe()));
  return impl_->AwaitEvent(finished.done, deadline,
                    fmt::format("{}: rank {} waited {:.1f} s for the other ranks at a barrier", Describe(), rank_,
                                timeout_s));
}

Result<std::unique_ptr<Communicator>> OpenNcclCommunicator(Communicator& bootstrap, int device, double timeout_s) {
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> nccl, NcclCommunicator::Create(bootstrap, device, timeout_s));
  return std::unique_ptr<Communicator>(std::move(nccl));
}

bool HaveNccl() { return true; }

}  // namespace kvflow::dist
