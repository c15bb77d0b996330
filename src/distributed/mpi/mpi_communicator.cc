#include "distributed/mpi/mpi_communicator.h"

#include "distributed/deadline.h"

#include <mpi.h>
#include <sched.h>
#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>

#include "distributed/world.h"

namespace kvflow::dist {

namespace {

// After a timeout, how long a cancelled request gets to finish before it is let go.
constexpr double kCancelGraceSeconds = 0.5;

Status MpiError(int code, std::string_view what) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  return Status::Internal(fmt::format("{}: MPI error {}: {}", what, code, std::string_view(text, static_cast<size_t>(length))));
}

Status CheckMpi(int code, std::string_view what) { return code == MPI_SUCCESS ? Status::Ok() : MpiError(code, what); }

bool MpiFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// Between polls: yield at first (a chain hop's answer is usually near), then sleep, up to 1 ms, so
// that a long wait leaves the cores to the ranks that compute.
class Backoff {
 public:
  void Pause() {
    if (++polls_ < 200) {
      sched_yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  int polls_ = 0;
  std::chrono::microseconds sleep_{20};
};

std::mutex g_session_mu;
std::weak_ptr<MpiSession> g_session;  // guarded by g_session_mu

class MpiMessage final : public PendingMessage {
 public:
  MpiMessage(const void* owner, bool is_recv, int peer, int tag) : owner(owner), is_recv(is_recv), peer(peer), tag(tag) {}
  // Only a failed communicator leaves requests behind: receives are cancelled, and every request
  // is let go so MPI can finish it on its own.
  ~MpiMessage() override {
    if (MpiFinalized()) return;
    for (MPI_Request& request : requests) {
      if (request == MPI_REQUEST_NULL) continue;
      if (is_recv) MPI_Cancel(&request);
      MPI_Request_free(&request);
    }
  }

  const void* owner;
  bool is_recv;
  int peer;
  int tag;
  std::vector<MPI_Request> requests;  // one per chunk
  std::vector<size_t> chunk_bytes;    // what each chunk carries (a receive: must carry)
};

}  // namespace

Result<std::shared_ptr<MpiSession>> MpiSession::Acquire() {
  std::lock_guard lock(g_session_mu);
  if (auto session = g_session.lock()) return session;
  if (MpiFinalized()) return Status::Unavailable("MPI was finalised in this process; it cannot start again");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    // SERIALIZED, not FUNNELED: the server opens the world on its main thread and its engine thread
    // then drives it (one thread at a time).
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread"));
    if (provided < MPI_THREAD_SERIALIZED) {
      MPI_Finalize();
      return Status::Unsupported("this MPI does not provide MPI_THREAD_SERIALIZED");
    }
  }
  std::shared_ptr<MpiSession> session(new MpiSession(/*finalize_at_end=*/!initialized));
  g_session = session;
  return session;
}

MpiSession::~MpiSession() {
  if (finalize_at_end_ && !MpiFinalized()) MPI_Finalize();
}

struct MpiCommunicator::Impl {
  ~Impl() {
    if (comm != MPI_COMM_NULL && !MpiFinalized()) MPI_Comm_free(&comm);
  }

  std::shared_ptr<MpiSession> session;  // declared first: released after the communicator is freed
  MPI_Comm comm = MPI_COMM_NULL;
  int tag_ub = 32767;  // the least MPI allows
  size_t max_chunk_bytes = 0;
  Status failed;  // set by a timeout that left a request MPI may still complete
  // Collective buffers MPI may still write into after a timeout; kept until the communicator goes.
  std::vector<std::vector<std::byte>> orphaned;
};

Result<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Create(MpiCommunicatorOptions options) {
  auto impl = std::make_unique<Impl>();
  KVFLOW_ASSIGN_OR_RETURN(impl->session, MpiSession::Acquire());
  impl->max_chunk_bytes = std::clamp<size_t>(options.max_chunk_bytes, 1, INT_MAX);
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl->comm), "MPI_Comm_dup"));
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler"));
  int rank = 0, size = 0, has_tag_ub = 0;
  int* tag_ub = nullptr;
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Comm_rank(impl->comm, &rank), "MPI_Comm_rank"));
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Comm_size(impl->comm, &size), "MPI_Comm_size"));
  KVFLOW_RETURN_IF_ERROR(
      CheckMpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_tag_ub), "MPI_Comm_get_attr(MPI_TAG_UB)"));
  if (has_tag_ub && tag_ub != nullptr) impl->tag_ub = *tag_ub;
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl), rank, size));
}

MpiCommunicator::MpiCommunicator(std::unique_ptr<Impl> impl, int rank, int size)
    : impl_(std::move(impl)), rank_(rank), size_(size) {}

MpiCommunicator::~MpiCommunicator() = default;

std::string MpiCommunicator::Describe() const { return fmt::format("mpi rank {} of {}", rank_, size_); }

Status MpiCommunicator::CheckUsable() const {
  if (impl_->failed.ok()) return Status::Ok();
  return Status::Unavailable(fmt::format("{}: unusable after an earlier failure ({})", Describe(), impl_->failed.message()));
}

Status MpiCommunicator::CheckTag(int tag) const {
  if (tag <= impl_->tag_ub) return Status::Ok();
  return Status::InvalidArgument(fmt::format("{}: tag {} is above MPI_TAG_UB ({})", Describe(), tag, impl_->tag_ub));
}

Result<MessageHandle> MpiCommunicator::ISend(int peer, int tag, std::span<const std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(CheckUsable());
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  KVFLOW_RETURN_IF_ERROR(CheckTag(tag));
  auto message = std::make_unique<MpiMessage>(this, /*is_recv=*/false, peer, tag);
  size_t offset = 0;
  do {  // an empty message is still one (empty) MPI message
    const size_t bytes = std::min(impl_->max_chunk_bytes, data.size() - offset);
    MPI_Request request = MPI_REQUEST_NULL;
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Isend(data.data() + offset, static_cast<int>(bytes), MPI_BYTE, peer, tag,
                                              impl_->comm, &request),
                                    fmt::format("{}: MPI_Isend to rank {} (tag {})", Describe(), peer, tag)));
    message->requests.push_back(request);
    message->chunk_bytes.push_back(bytes);
    offset += bytes;
  } while (offset < data.size());
  return MessageHandle(std::move(message));
}

Result<MessageHandle> MpiCommunicator::IRecv(int peer, int tag, std::span<std::byte> data) {
  KVFLOW_RETURN_IF_ERROR(CheckUsable());
  KVFLOW_RETURN_IF_ERROR(ValidatePeer(*this, peer, tag));
  KVFLOW_RETURN_IF_ERROR(CheckTag(tag));
  auto message = std::make_unique<MpiMessage>(this, /*is_recv=*/true, peer, tag);
  size_t offset = 0;
  do {
    const size_t bytes = std::min(impl_->max_chunk_bytes, data.size() - offset);
    MPI_Request request = MPI_REQUEST_NULL;
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Irecv(data.data() + offset, static_cast<int>(bytes), MPI_BYTE, peer, tag,
                                              impl_->comm, &request),
                                    fmt::format("{}: MPI_Irecv from rank {} (tag {})", Describe(), peer, tag)));
    message->requests.push_back(request);
    message->chunk_bytes.push_back(bytes);
    offset += bytes;
  } while (offset < data.size());
  return MessageHandle(std::move(message));
}

namespace {

// Cancels what is left of a timed-out message and gives it a moment to end; true when every
// request ended (MPI holds none of the caller's memory any more).
bool CancelAndDrain(std::vector<MPI_Request>& requests) {
  for (MPI_Request& request : requests) {
    if (request != MPI_REQUEST_NULL) MPI_Cancel(&request);
  }
  const auto grace = DeadlineAfter(kCancelGraceSeconds);
  Backoff backoff;
  for (;;) {
    bool ended = true;
    for (MPI_Request& request : requests) {
      if (request == MPI_REQUEST_NULL) continue;
      int flag = 0;
      if (MPI_Test(&request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) ended = false;
    }
    if (ended) return true;
    if (Clock::now() >= grace) return false;
    backoff.Pause();
  }
}

}  // namespace

Status MpiCommunicator::Wait(MessageHandle handle, double timeout_s) {
  auto* message = dynamic_cast<MpiMessage*>(handle.get());
  if (message == nullptr || message->owner != this) {
    return Status::InvalidArgument(fmt::format("{}: Wait on a handle of another communicator", Describe()));
  }
  const auto deadline = DeadlineAfter(timeout_s);
  Backoff backoff;
  for (;;) {
    bool done = true;
    for (size_t i = 0; i < message->requests.size(); ++i) {
      MPI_Request& request = message->requests[i];
      if (request == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Status status;
      const int code = MPI_Test(&request, &flag, &status);
      if (code == MPI_ERR_TRUNCATE) {
        return Status::InvalidArgument(fmt::format("{}: the message from rank {} (tag {}) is longer than expected",
                                                   Describe(), message->peer, message->tag));
      }
      KVFLOW_RETURN_IF_ERROR(CheckMpi(code, fmt::format("{}: MPI_Test on a message {} rank {} (tag {})", Describe(),
                                                        message->is_recv ? "from" : "to", message->peer, message->tag)));
      if (!flag) {
        done = false;
        continue;
      }
      if (message->is_recv) {
        int count = 0;
        KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count"));
        if (static_cast<size_t>(count) != message->chunk_bytes[i]) {
          return Status::InvalidArgument(fmt::format("{}: the message from rank {} (tag {}) is shorter than expected",
                                                     Describe(), message->peer, message->tag));
        }
      }
    }
    if (done) return Status::Ok();
    if (Clock::now() >= deadline) break;
    backoff.Pause();
  }
  const std::string what =
      message->is_recv ? fmt::format("rank {} waited {:.1f} s for rank {} (tag {}); no message came", rank_, timeout_s,
                                     message->peer, message->tag)
                       : fmt::format("rank {} waited {:.1f} s for rank {} to take its message (tag {})", rank_,
                                     timeout_s, message->peer, message->tag);
  Status timed_out = Status::Unavailable(fmt::format("{}: {}", Describe(), what));
  if (!CancelAndDrain(message->requests)) impl_->failed = timed_out;
  return timed_out;
}

namespace {

// A datatype of `bytes` contiguous bytes built from blocks of at most `block` bytes, so that any
// size travels as count 1 (MPI counts are ints). The caller frees it.
Status LargeBytesType(size_t bytes, size_t block, MPI_Datatype* type) {
  const size_t blocks = bytes / block, tail = bytes % block;
  if (blocks > static_cast<size_t>(INT_MAX)) return Status::InvalidArgument("all-gather part too large for MPI");
  MPI_Datatype block_type, body;
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Type_contiguous(static_cast<int>(block), MPI_BYTE, &block_type), "MPI_Type_contiguous"));
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Type_contiguous(static_cast<int>(blocks), block_type, &body), "MPI_Type_contiguous"));
  MPI_Type_free(&block_type);
  if (tail == 0) {
    *type = body;
  } else {
    MPI_Datatype tail_type;
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Type_contiguous(static_cast<int>(tail), MPI_BYTE, &tail_type), "MPI_Type_contiguous"));
    int lengths[2] = {1, 1};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * block)};
    MPI_Datatype types[2] = {body, tail_type};
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Type_create_struct(2, lengths, displacements, types, type), "MPI_Type_create_struct"));
    MPI_Type_free(&body);
    MPI_Type_free(&tail_type);
  }
  return CheckMpi(MPI_Type_commit(type), "MPI_Type_commit");
}

}  // namespace

Status MpiCommunicator::AllGather(std::span<const std::byte> mine, std::span<std::byte> all, double timeout_s) {
  KVFLOW_RETURN_IF_ERROR(CheckUsable());
  const size_t part = mine.size();
  if (all.size() != part * static_cast<size_t>(size_)) {
    return Status::InvalidArgument(fmt::format("{}: all-gather of {} bytes per rank needs {} bytes, got {}", Describe(),
                                               part, part * static_cast<size_t>(size_), all.size()));
  }
  std::vector<std::byte> send(mine.begin(), mine.end());
  std::vector<std::byte> receive(all.size());
  MPI_Datatype type = MPI_BYTE;
  int count = static_cast<int>(part);
  if (part > impl_->max_chunk_bytes) {
    KVFLOW_RETURN_IF_ERROR(LargeBytesType(part, impl_->max_chunk_bytes, &type));
    count = 1;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  const int code = MPI_Iallgather(send.data(), count, type, receive.data(), count, type, impl_->comm, &request);
  if (type != MPI_BYTE) MPI_Type_free(&type);  // MPI keeps it alive while the gather needs it
  KVFLOW_RETURN_IF_ERROR(CheckMpi(code, fmt::format("{}: MPI_Iallgather", Describe())));

  const auto deadline = DeadlineAfter(timeout_s);
  Backoff backoff;
  for (;;) {
    int flag = 0;
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), fmt::format("{}: all-gather", Describe())));
    if (flag) break;
    if (Clock::now() >= deadline) {
      impl_->orphaned.push_back(std::move(send));
      impl_->orphaned.push_back(std::move(receive));
      impl_->failed = Status::Unavailable(fmt::format(
          "{}: rank {} waited {:.1f} s for the other ranks in an all-gather; a peer hangs or is gone", Describe(), rank_,
          timeout_s));
      return impl_->failed;
    }
    backoff.Pause();
  }
  std::memcpy(all.data(), receive.data(), receive.size());
  return Status::Ok();
}

void MpiCommunicator::Poll() {
  if (!impl_->failed.ok()) return;
  int flag = 0;
  MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, impl_->comm, &flag, MPI_STATUS_IGNORE);
}

Status MpiCommunicator::Barrier(double timeout_s) {
  KVFLOW_RETURN_IF_ERROR(CheckUsable());
  MPI_Request request = MPI_REQUEST_NULL;
  KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Ibarrier(impl_->comm, &request), fmt::format("{}: MPI_Ibarrier", Describe())));
  const auto deadline = DeadlineAfter(timeout_s);
  Backoff backoff;
  for (;;) {
    int flag = 0;
    KVFLOW_RETURN_IF_ERROR(CheckMpi(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), fmt::format("{}: barrier", Describe())));
    if (flag) return Status::Ok();
    if (Clock::now() >= deadline) {
      impl_->failed = Status::Unavailable(fmt::format(
          "{}: rank {} waited {:.1f} s for the other ranks at a barrier; a peer hangs or is gone", Describe(), rank_,
          timeout_s));
      return impl_->failed;
    }
    backoff.Pause();
  }
}

void AbortMpiJob(int exit_code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

Result<std::unique_ptr<Communicator>> OpenMpiWorldCommunicator() {
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<MpiCommunicator> comm, MpiCommunicator::Create());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace kvflow::dist
