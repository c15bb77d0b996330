// Device-side helpers shared by the kernels: element conversion, warp reductions, tensor-core
// fragments, asynchronous copies, and the kernel launch.
//
// Every kernel file includes this header instead of <cuda_runtime.h>. With KVFLOW_CUDA_EMU
// defined the same kernel sources compile as plain C++ against the CPU emulator in
// tests/cuda_emu (one thread block at a time, its threads as fibers), which is how CI runs the
// kernels on machines without a GPU. So kernels use only:
//   - __global__ / __device__ / __forceinline__ / __launch_bounds__, threadIdx, blockIdx,
//     blockDim, gridDim;
//   - __shared__ arrays declared at function scope of trivially constructible types, and dynamic
//     shared memory only through KVFLOW_DYNAMIC_SMEM;
//   - __syncthreads, __syncwarp, full-warp (0xffffffff) __shfl_*_sync, atomicAdd/atomicMax;
//   - the wrappers below for mma.sync, ldmatrix and cp.async: no inline asm in kernels;
//   - launches through LaunchKernel: no <<<...>>>.
#pragma once

#ifdef KVFLOW_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernel_common.h"

// Declares `type* name` pointing at the block's dynamic shared memory (16-byte aligned).
#ifdef KVFLOW_CUDA_EMU
#define KVFLOW_DYNAMIC_SMEM(type, name) \
  type* name = reinterpret_cast<type*>(::kvflow_emu::DynamicSharedMemory())
#else
#define KVFLOW_DYNAMIC_SMEM(type, name)                          \
  extern __shared__ __align__(16) unsigned char kvflow_smem_[]; \
  type* name = reinterpret_cast<type*>(kvflow_smem_)
#endif

// Runs `...` with `T` bound to the element type of `dtype` (float, __half, __nv_bfloat16);
// returns kInvalidValue from the enclosing function for an unknown dtype.
#define KVFLOW_DISPATCH_DTYPE(dtype, T, ...)           \
  switch (dtype) {                                     \
    case ::kvflow::cuda::DType::kF32: {                \
      using T = float;                                 \
      __VA_ARGS__;                                     \
    } break;                                           \
    case ::kvflow::cuda::DType::kF16: {                \
      using T = __half;                                \
      __VA_ARGS__;                                     \
    } break;                                           \
    case ::kvflow::cuda::DType::kBF16: {               \
      using T = __nv_bfloat16;                         \
      __VA_ARGS__;                                     \
    } break;                                           \
    default:                                           \
      return ::kvflow::cuda::kInvalidValue;            \
  }

// As above for the 16-bit types only (kernels built on tensor cores).
#define KVFLOW_DISPATCH_HALF_DTYPE(dtype, T, ...)      \
  switch (dtype) {                                     \
    case ::kvflow::cuda::DType::kF16: {                \
      using T = __half;                                \
      __VA_ARGS__;                                     \
    } break;                                           \
    case ::kvflow::cuda::DType::kBF16: {               \
      using T = __nv_bfloat16;                         \
      __VA_ARGS__;                                     \
    } break;                                           \
    default:                                           \
      return ::kvflow::cuda::kInvalidValue;            \
  }

namespace kvflow::cuda {

// Opaque copy units for byte-exact copies (KV rows of any dtype). Plain structs, not uint4, so the
// same code builds against the emulator.
struct alignas(16) Word16 {
  uint32_t w[4];
};
struct alignas(8) Word8 {
  uint32_t w[2];
};
using Word4 = uint32_t;
using Word2 = uint16_t;

// The widest Word (16, 8, 4 or 2 bytes; 1 when none) that every byte address and byte count of
// `values` is a multiple of: what a launcher of a Word-templated copy kernel instantiates.
inline int CommonAlignment(std::initializer_list<uint64_t> values) {
  int align = 16;
  for (uint64_t v : values) {
    while (align > 1 && v % static_cast<uint64_t>(align) != 0) align /= 2;
  }
  return align;
}


// ---- launch -------------------------------------------------------------------------------------

namespace detail {
template <typename Tuple, size_t... I>
void FillArgPointers(Tuple& values, void** pointers, std::index_sequence<I...>) {
  ((pointers[I] = static_cast<void*>(&std::get<I>(values))), ...);
}
}  // namespace detail

// Launches `kernel` on `stream` (a cudaStream_t as void*); returns 0 or the cudaError_t. Arguments
// are converted to the kernel's parameter types first, as a <<<...>>> launch would.
template <typename... Params, typename... Args>
int LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, void* stream,
                 Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return 0;
#ifdef KVFLOW_CUDA_EMU
  return ::kvflow_emu::Launch(kernel, grid, block, dynamic_smem, stream, static_cast<Params>(args)...);
#else
  if (dynamic_smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(dynamic_smem));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  std::tuple<std::decay_t<Params>...> values(static_cast<Params>(args)...);
  void* pointers[sizeof...(Params) + 1] = {};
  detail::FillArgPointers(values, pointers, std::index_sequence_for<Params...>{});
  return static_cast<int>(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, pointers,
                                           dynamic_smem, static_cast<cudaStream_t>(stream)));
#endif
}

namespace dev {

// ---- element conversion ---------------------------------------------------------------------------

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two 16-bit values in one 32-bit register, `lo` in the low half (the order mma fragments use).
template <typename T>
__device__ __forceinline__ uint32_t PackTwo(float lo, float hi) {
  static_assert(sizeof(T) == 2, "16-bit types only");
  const T a = FromFloat<T>(lo), b = FromFloat<T>(hi);
  uint16_t ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
}

// N elements of T as one aligned unit: with sizeof(T) * N == 16 a load or store of it is one
// 16-byte vector access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// ---- reductions ---------------------------------------------------------------------------------

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. `scratch` is __shared__ float[32]. Contains __syncthreads: call from all threads.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}
__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// ---- tensor cores (sm_80+) ------------------------------------------------------------------------
//
// D = A * B + D for one warp: A 16x16 row-major, B 16x8 column-major, fp32 accumulators. Fragment
// layout as in the PTX ISA for mma.m16n8k16 with .f16/.bf16 inputs; with g = lane / 4 and
// t = lane % 4 (each a/b register packs two 16-bit values, the lower column/row index in the low
// half):
//   a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//   a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t, 2t+1]   d[2], d[3] = D[g+8][2t, 2t+1]
template <typename T>
__device__ __forceinline__ void MmaM16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16");
#ifdef KVFLOW_CUDA_EMU
  ::kvflow_emu::MmaM16N8K16(std::is_same_v<T, __half>, d, a, b);
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices of 16-bit elements from shared
// memory. Lane 8i + j passes the address of row j of matrix i (16 contiguous bytes, 16-byte
// aligned). Lane l receives in r[i] the elements (row l/4, columns 2(l%4), 2(l%4)+1) of matrix i;
// with the .trans variant, (rows 2(l%4), 2(l%4)+1, column l/4) instead.
__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* smem_row) {
#ifdef KVFLOW_CUDA_EMU
  ::kvflow_emu::LdMatrix(4, false, r, smem_row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t r[4], const void* smem_row) {
#ifdef KVFLOW_CUDA_EMU
  ::kvflow_emu::LdMatrix(4, true, r, smem_row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}
// Two matrices: lanes 0..15 pass row addresses (lanes 16..31 must pass a valid address too).
__device__ __forceinline__ void LdMatrixX2(uint32_t r[2], const void* smem_row) {
#ifdef KVFLOW_CUDA_EMU
  ::kvflow_emu::LdMatrix(2, false, r, smem_row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
#endif
}
__device__ __forceinline__ void LdMatrixX2Trans(uint32_t r[2], const void* smem_row) {
#ifdef KVFLOW_CUDA_EMU
  ::kvflow_emu::LdMatrix(2, true, r, smem_row);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
#endif
}

// ---- asynchronous global -> shared copies (sm_80+) --------------------------------------------------
//
// Copies 16 bytes (both addresses 16-byte aligned); when !valid the destination is zero-filled and
// `gmem` is not read (it must still be a valid address expression). The emulator copies at once, so
// a missing wait is only caught on a GPU.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
#ifdef KVFLOW_CUDA_EMU
  if (valid) {
    memcpy(smem, gmem, 16);
  } else {
    memset(smem, 0, 16);
  }
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void CpAsyncCommit() {
#ifndef KVFLOW_CUDA_EMU
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
#ifndef KVFLOW_CUDA_EMU
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace dev
}  // namespace kvflow::cuda
