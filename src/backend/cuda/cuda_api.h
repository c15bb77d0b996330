// The CUDA runtime and cuBLAS, or their CPU emulation (tests/cuda_emu) in the emulator build.
// Host code of the CUDA backend includes this instead of the CUDA headers.
#pragma once

#ifdef KVFLOW_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

#include <string>

namespace kvflow::cuda {

inline std::string CudaErrorText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

}  // namespace kvflow::cuda
