// The MPI entry point in builds without MPI (KVFLOW_MPI=OFF, or no MPI found).
#include "distributed/world.h"

namespace kvflow::dist {

Result<std::unique_ptr<Communicator>> OpenMpiWorldCommunicator() {
  return Status::Unsupported("kvflow was built without MPI: install libopenmpi-dev and rebuild");
}

void AbortMpiJob(int exit_code) {}

}  // namespace kvflow::dist
