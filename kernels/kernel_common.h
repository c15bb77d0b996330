// Types shared by every kernel launcher. Plain C++: callers need no CUDA headers.
//
// Conventions of every launcher in kernels/*.h:
//   - pointers are device pointers unless a comment says otherwise;
//   - `stream` is a cudaStream_t passed as void* (nullptr: the legacy default stream);
//   - strides and sizes count elements, not bytes;
//   - the return value is 0 or a cudaError_t value (a bad argument is cudaErrorInvalidValue, 1);
//     launchers never synchronize and never allocate.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvflow::cuda {

// Element type of weights, activations and the KV cache. Accumulation is always fp32.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr const char* DTypeName(DType t) {
  return t == DType::kF32 ? "fp32" : t == DType::kF16 ? "fp16" : "bf16";
}

constexpr int kInvalidValue = 1;  // cudaErrorInvalidValue

}  // namespace kvflow::cuda
