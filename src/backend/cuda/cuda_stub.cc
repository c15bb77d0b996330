// The CUDA entry points in builds without CUDA: there are no devices and no CUDA backend.
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"

namespace kvflow {
namespace cuda {

int DeviceCount() { return 0; }
std::string DeviceDescription(int) { return "kvflow was built without CUDA (KVFLOW_CUDA=OFF or no nvcc)"; }

}  // namespace cuda

namespace {
Status NoCuda() {
  return Status::Unsupported("kvflow was built without CUDA (configure with nvcc on PATH, or -DKVFLOW_CUDA=ON)");
}
}  // namespace

Result<std::unique_ptr<Backend>> CreateCudaBackend(const ModelConfig&, const LlamaWeights&, const CudaBackendOptions&) {
  return NoCuda();
}
Result<std::unique_ptr<Backend>> CreateCudaBackendWithRandomWeights(const ModelConfig&, const CudaBackendOptions&,
                                                                    uint64_t) {
  return NoCuda();
}

}  // namespace kvflow
