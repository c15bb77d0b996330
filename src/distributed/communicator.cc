#include "distributed/communicator.h"

#include <algorithm>
#include <vector>

#include <spdlog/fmt/fmt.h>

namespace kvflow::dist {

Status Communicator::Send(int peer, int tag, std::span<const std::byte> data, double timeout_s) {
  KVFLOW_ASSIGN_OR_RETURN(MessageHandle handle, ISend(peer, tag, data));
  return Wait(std::move(handle), timeout_s);
}

Status Communicator::Recv(int peer, int tag, std::span<std::byte> data, double timeout_s) {
  KVFLOW_ASSIGN_OR_RETURN(MessageHandle handle, IRecv(peer, tag, data));
  return Wait(std::move(handle), timeout_s);
}

Status Communicator::AllReduceSum(std::span<float> data, double timeout_s) {
  if (buffer_space() != BufferSpace::kHost) {
    return Status::Unsupported(Describe() + ": the all-reduce of host buffers runs on a host transport");
  }
  if (size() == 1) return Status::Ok();
  std::vector<float>& all = reduce_scratch_;
  all.resize(data.size() * static_cast<size_t>(size()));
  KVFLOW_RETURN_IF_ERROR(AllGather(std::as_bytes(data), std::as_writable_bytes(std::span<float>(all)), timeout_s));
  // Rank order, the same on every rank.
  std::copy(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(data.size()), data.begin());
  for (int r = 1; r < size(); ++r) {
    const float* part = all.data() + static_cast<size_t>(r) * data.size();
    for (size_t i = 0; i < data.size(); ++i) data[i] += part[i];
  }
  return Status::Ok();
}

Status ValidatePeer(const Communicator& comm, int peer, int tag) {
  if (peer < 0 || peer >= comm.size()) {
    return Status::InvalidArgument(
        fmt::format("{}: peer rank {} is outside the world of {} ranks", comm.Describe(), peer, comm.size()));
  }
  if (tag < 0) return Status::InvalidArgument(fmt::format("{}: tag {} is negative", comm.Describe(), tag));
  return Status::Ok();
}

}  // namespace kvflow::dist
