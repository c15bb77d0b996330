// CUDA device discovery, usable from code that includes no CUDA headers.
#pragma once

#include <string>

namespace kvflow::cuda {

// Number of usable CUDA devices; 0 when the build has no CUDA, no driver or no GPU.
int DeviceCount();
// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for device `index`, or why there is none.
std::string DeviceDescription(int index);

}  // namespace kvflow::cuda
