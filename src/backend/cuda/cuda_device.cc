#include "backend/cuda/cuda_device.h"

#include "backend/cuda/cuda_api.h"

#include <spdlog/fmt/fmt.h>

namespace kvflow::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string DeviceDescription(int index) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, index); e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(e);
  }
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", prop.name, prop.major, prop.minor,
                     prop.totalGlobalMem / double(1 << 30));
}

}  // namespace kvflow::cuda
