#include "distributed/communicator.h"

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

Status ValidatePeer(const Communicator& comm, int peer, int tag) {
  if (peer < 0 || peer >= comm.size()) {
    return Status::InvalidArgument(
        fmt::format("{}: peer rank {} is outside the world of {} ranks", comm.Describe(), peer, comm.size()));
  }
  if (tag < 0) return Status::InvalidArgument(fmt::format("{}: tag {} is negative", comm.Describe(), tag));
  return Status::Ok();
}

}  // namespace kvflow::dist
