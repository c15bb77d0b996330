// The NCCL entry point in builds without NCCL (no CUDA or no NCCL found).
#include "distributed/world.h"

namespace kvflow::dist {

Result<std::unique_ptr<Communicator>> OpenNcclCommunicator(Communicator& bootstrap, int device, double timeout_s) {
  return Status::Unsupported("kvflow was built without NCCL: install libnccl-dev (with the CUDA toolkit) and rebuild");
}

bool HaveNccl() { return false; }

}  // namespace kvflow::dist
