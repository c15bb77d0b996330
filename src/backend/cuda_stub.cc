// Device discovery in builds without CUDA: there are no devices.
#ifndef KVFLOW_WITH_CUDA
#include "backend/cuda/cuda_device.h"

namespace kvflow::cuda {

int DeviceCount() { return 0; }
std::string DeviceDescription(int) { return "kvflow was built without CUDA (KVFLOW_CUDA=OFF or no nvcc)"; }

}  // namespace kvflow::cuda
#endif
