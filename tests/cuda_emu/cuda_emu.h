// CPU emulator of the CUDA runtime and of the kernel execution model.
//
// Kernel sources (kernels/*.cu) compile unchanged as plain C++ (g++) against this header, with
// KVFLOW_CUDA_EMU defined, so that CI machines without a GPU run the real kernel code and compare
// its results with CPU references. Host code (src/backend/cuda) links cuda_emu.cc instead of
// libcudart/libcublas.
//
// Execution model
//   - Blocks run one at a time, in blockIdx order (x fastest), on the launching host thread.
//   - Every thread of the block is a fiber with its own stack, scheduled cooperatively: a thread
//     runs until it reaches a barrier (__syncthreads*) or a warp collective (__shfl*_sync,
//     __ballot_sync, __any/__all_sync, __syncwarp, __reduce_*_sync, __match_*_sync, mma, ldmatrix)
//     and then lets the others run. Warps are 32 consecutive linear thread ids.
//   - Between two barriers the threads of a block run one after the other: in ascending thread
//     order in blocks with even blockIdx.x + y + z, descending in odd ones, so a missing
//     __syncthreads/__syncwarp gives stale data in one of the two (KVFLOW_EMU_SCHEDULE=forward,
//     reverse, alternate (the default) or flipped: descending in even blocks, ascending in odd;
//     ctest runs every emulator test under both alternate and flipped, so every block of every
//     launch runs its threads both ways). Every __syncthreads is the same barrier, wherever it is
//     called from (as bar.sync 0 on a GPU).
//   - __shared__ variables are function-scope statics, shared by the threads of the running block
//     and NOT reset between blocks (as on a GPU, uninitialized shared memory holds garbage).
//     Dynamic shared memory is filled with 0xCD bytes before every block.
//   - Memory is host memory; every runtime call is synchronous, except that work issued to a
//     stream under graph capture is recorded and runs at cudaGraphLaunch. Kernel launches from
//     several host threads are serialized.
//
// What it checks
//   - Indexing and results: every thread of every block runs the kernel's real code.
//   - Barriers: __syncthreads waits for all threads of the block that have not exited (an exited
//     thread does not block the barrier, as on sm_70+). If no thread can make progress (e.g. a
//     __syncthreads in divergent code that some threads never reach) it aborts with the state of
//     every waiting thread.
//   - Warp collectives: all lanes of the warp must take part, in the same collective; a lane
//     that exited or waits elsewhere (a divergent __shfl_sync) aborts with a message naming the
//     kernel, block, warp and collective. Only full-warp masks (0xffffffff) are supported.
//   - Launch configuration: block size <= 1024 threads, block dims <= (1024, 1024, 64), grid
//     dims <= (2^31-1, 65535, 65535), dynamic shared memory <= 227 KiB; otherwise the launch
//     returns cudaErrorInvalidConfiguration / cudaErrorInvalidValue (also for cudaGetLastError).
//   - mma / ldmatrix: the exact PTX fragment layouts; misaligned ldmatrix rows abort.
//   - cudaMalloc'd buffers: fresh memory is filled with 0xFF (NaN in fp32/fp16/bf16) up to 64 MiB;
//     every buffer has guard bytes around it that are checked after every kernel and at cudaFree,
//     so an out-of-bounds write just past either end aborts with the kernel's name.
//   - Runtime API misuse: device ranges of cudaMemcpy/cudaMemset must lie inside a cudaMalloc
//     buffer; synchronous copies and synchronizations during graph capture fail as on CUDA.
//
// What it cannot check
//   - Data races and memory-model/ordering bugs in general: threads interleave only at barriers
//     and collectives, never in between, so races between two writers, read-modify-write races
//     without atomics, missing volatile/fences and the like usually still give the right answer.
//     A missing barrier is only caught when it makes a reader see stale data in one of the two
//     thread orders above; one between a write and a read by the same thread never shows.
//   - cp.async: copies complete at once, so a missing CpAsyncWait is only caught on a GPU.
//   - Out-of-bounds reads, and writes that land inside another allocation or far away.
//   - Performance: occupancy, register pressure, bank conflicts, coalescing, launch overhead;
//     stream concurrency (everything is serialized).
//   - Anything beyond the subset in kernels/device_utils.cuh: inline PTX, textures, cooperative
//     groups, clusters, partial-warp masks, __activemask in divergent code (returns all lanes).
//   - Floating point: CPU math (expf, ...) is used for the fast intrinsics (__expf, ...), so
//     results are usually MORE accurate than on a GPU; tolerances must be set for the GPU.
//     mma sums in fp32 in k order; tensor cores round differently, so compare with tolerances.
//   - __shared__ memory (static) is not poisoned; it keeps what the previous block left there.
//
// Limits and knobs
//   - Each emulated thread has a 256 KiB stack (KVFLOW_EMU_STACK_KB to change); an overflow
//     crashes with "STACK OVERFLOW in an emulated GPU thread".
//   - Device memory: KVFLOW_EMU_DEVICE_MEMORY bytes (suffix K/M/G allowed; default 8G) reported by
//     cudaMemGetInfo/cudaGetDeviceProperties and enforced by cudaMalloc.
//   - Devices: KVFLOW_EMU_DEVICES (default 1, read at every call) emulated devices; the current
//     device is per host thread (cudaSetDevice), every pair can access the other (peer copies),
//     and they share one memory and one KVFLOW_EMU_DEVICE_MEMORY budget, so the emulator does not
//     catch a pointer used on the wrong device.
//   - KVFLOW_EMU_QUIET=1 silences the warnings printed for rejected runtime calls.
//   - Cost: about 7-20 ns per thread per __syncthreads or collective on a 2020s x86 core; a
//     block of 256 threads with 50 barriers takes ~0.1-0.3 ms.
//   - cudaLaunchKernel returns cudaErrorNotSupported: launch through kvflow::cuda::LaunchKernel.
#pragma once

// The real CUDA headers first: the types, enums and runtime/cuBLAS declarations are theirs. They
// compile host-side with g++ (including __half / __nv_bfloat16 arithmetic). <cuda_runtime.h> too,
// because it names parameters gridDim/blockDim, which are macros below.
#include <cuda_runtime.h>
#include <cuda_runtime_api.h>
#include <vector_functions.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- CUDA keywords --------------------------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#undef __constant__
#undef __managed__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Function-scope statics: one block runs at a time and its threads (fibers) share them.
#define __shared__ static
#define __constant__
#define __managed__
#define __grid_constant__
// __align__(n) stays CUDA's host definition, __attribute__((aligned(n))), valid anywhere.
// __noinline__ is deliberately not defined: libstdc++ spells __attribute__((__noinline__)).

namespace kvflow_emu {

// ---- execution state (read by the builtins) ----------------------------------------------------------
namespace internal {

struct ThreadIds {
  uint3 thread_idx;
  int linear_id;   // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
  int lane;        // linear_id % 32
  int warp;        // linear_id / 32
  int warp_lanes;  // lanes that exist in this warp (32 unless the block size is not a multiple)
};

struct BlockState {
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  void* dynamic_smem;
  size_t dynamic_smem_bytes;
};

extern ThreadIds* g_thread;  // the running emulated thread; nullptr outside kernels
extern BlockState g_block;   // the running block

// Aborts with a message that names the running kernel, block and thread.
[[noreturn]] void Fail(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace internal

// The current emulated thread (inside a kernel only).
inline const internal::ThreadIds& CurrentThread() { return *internal::g_thread; }

// The running block's dynamic shared memory: 16-byte aligned, `dynamic_smem` bytes of the launch.
inline void* DynamicSharedMemory() { return internal::g_block.dynamic_smem; }
inline size_t DynamicSharedMemoryBytes() { return internal::g_block.dynamic_smem_bytes; }

}  // namespace kvflow_emu

#define threadIdx (static_cast<const uint3&>(::kvflow_emu::internal::g_thread->thread_idx))
#define blockIdx (static_cast<const uint3&>(::kvflow_emu::internal::g_block.block_idx))
#define blockDim (static_cast<const dim3&>(::kvflow_emu::internal::g_block.block_dim))
#define gridDim (static_cast<const dim3&>(::kvflow_emu::internal::g_block.grid_dim))
// Not a macro: cudaDeviceProp has a member of that name.
inline constexpr int warpSize = 32;

// ---- launch ------------------------------------------------------------------------------------------
namespace kvflow_emu {
namespace internal {

// Validates, then runs `body` once per thread of every block (or records it when `stream` is being
// captured). `kernel` and `signature` only serve error messages. Returns 0 or a cudaError_t.
int LaunchImpl(const void* kernel, const char* signature, dim3 grid, dim3 block, size_t dynamic_smem,
               void* stream, std::function<void()> body);

}  // namespace internal

// Launches `kernel<<<grid, block, dynamic_smem, stream>>>(args...)`: returns 0 or a cudaError_t
// (also recorded for cudaGetLastError). Arguments are converted to the parameter types and copied,
// as a real launch (and a graph capture) does.
template <typename... Params, typename... Args>
int Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, void* stream,
           Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  std::function<void()> body = [kernel, values = std::tuple<std::decay_t<Params>...>(
                                            static_cast<Params>(std::forward<Args>(args))...)]() {
    std::apply(kernel, values);
  };
  return internal::LaunchImpl(reinterpret_cast<const void*>(kernel), __PRETTY_FUNCTION__, grid, block,
                              dynamic_smem, stream, std::move(body));
}

// ---- tensor-core and ldmatrix wrappers (warp collectives) -------------------------------------------
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 with d as both C and D; fragment
// layout as documented in kernels/device_utils.cuh (the PTX ISA's). Products are exact in fp32;
// the sum runs in fp32, k = 0..15, starting from C.
void MmaM16N8K16(bool is_fp16, float d[4], const uint32_t a[4], const uint32_t b[2]);

// ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16: lanes 8i..8i+7 pass the row addresses of
// matrix i (16 bytes each, 16-byte aligned); lane l gets in r[i] the elements (row l/4, columns
// 2(l%4), 2(l%4)+1) of matrix i, or with `trans` (rows 2(l%4), 2(l%4)+1, column l/4); the first
// element in the low 16 bits. num is 1, 2 or 4.
void LdMatrix(int num, bool trans, uint32_t* r, const void* smem_row);

// ---- collectives (used by the intrinsics below) --------------------------------------------------------
namespace internal {

enum class Collective : int {
  kSyncWarp,
  kShfl,
  kShflUp,
  kShflDown,
  kShflXor,
  kBallot,
  kAny,
  kAll,
  kReduce,
  kMatchAny,
  kMatchAll,
  kMma,
  kLdMatrix,
};

// Per-lane exchange slot of a warp collective.
struct alignas(16) LaneSlot {
  unsigned char bytes[48];
};
inline constexpr size_t kMaxCollectiveBytes = sizeof(LaneSlot);

// Deposits `size` bytes of `value` as this lane's contribution, waits until every lane of the warp
// has deposited (in the same collective, with a full mask) and returns the warp's 32 slots (those
// of lanes beyond warp_lanes are unused). Valid until this lane's next collective.
const LaneSlot* WarpExchange(Collective op, unsigned mask, const void* value, size_t size);

// __syncthreads with a block-wide reduction of `predicate`: returns the number of threads
// (0 = count, 1 = and, 2 = or as 0/1) whose predicate is non-zero.
int SyncThreads(int reduce_op, int predicate);

template <typename T>
inline T SlotValue(const LaneSlot* slots, int src_lane, const T& own) {
  if (src_lane < 0 || src_lane >= g_thread->warp_lanes) return own;  // lane absent: undefined on a GPU
  T out = own;
  std::memcpy(static_cast<void*>(&out), slots[src_lane].bytes, sizeof(T));
  return out;
}

inline void CheckWidth(int width, const char* what) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    Fail("%s: width %d is not a power of two in [1, 32]", what, width);
}

}  // namespace internal
}  // namespace kvflow_emu

// ---- barriers and warp intrinsics --------------------------------------------------------------------
inline void __syncthreads() { ::kvflow_emu::internal::SyncThreads(0, 0); }
inline int __syncthreads_count(int predicate) { return ::kvflow_emu::internal::SyncThreads(0, predicate); }
inline int __syncthreads_and(int predicate) { return ::kvflow_emu::internal::SyncThreads(1, predicate); }
inline int __syncthreads_or(int predicate) { return ::kvflow_emu::internal::SyncThreads(2, predicate); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::kvflow_emu::internal::WarpExchange(::kvflow_emu::internal::Collective::kSyncWarp, mask, nullptr, 0);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  static_assert(sizeof(T) <= ::kvflow_emu::internal::kMaxCollectiveBytes, "type too large to shuffle");
  using namespace ::kvflow_emu::internal;
  CheckWidth(width, "__shfl_sync");
  const LaneSlot* slots = WarpExchange(Collective::kShfl, mask, &var, sizeof(T));
  const int lane = g_thread->lane;
  return SlotValue(slots, (lane & ~(width - 1)) + (src_lane & (width - 1)), var);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  static_assert(sizeof(T) <= ::kvflow_emu::internal::kMaxCollectiveBytes, "type too large to shuffle");
  using namespace ::kvflow_emu::internal;
  CheckWidth(width, "__shfl_up_sync");
  const LaneSlot* slots = WarpExchange(Collective::kShflUp, mask, &var, sizeof(T));
  const int lane = g_thread->lane;
  if (static_cast<unsigned>(lane & (width - 1)) < delta) return var;
  return SlotValue(slots, lane - static_cast<int>(delta), var);
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  static_assert(sizeof(T) <= ::kvflow_emu::internal::kMaxCollectiveBytes, "type too large to shuffle");
  using namespace ::kvflow_emu::internal;
  CheckWidth(width, "__shfl_down_sync");
  const LaneSlot* slots = WarpExchange(Collective::kShflDown, mask, &var, sizeof(T));
  const int lane = g_thread->lane;
  if (static_cast<unsigned>(lane & (width - 1)) + delta >= static_cast<unsigned>(width)) return var;
  return SlotValue(slots, lane + static_cast<int>(delta), var);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= ::kvflow_emu::internal::kMaxCollectiveBytes, "type too large to shuffle");
  using namespace ::kvflow_emu::internal;
  CheckWidth(width, "__shfl_xor_sync");
  const LaneSlot* slots = WarpExchange(Collective::kShflXor, mask, &var, sizeof(T));
  const int lane = g_thread->lane;
  const int src = lane ^ (lane_mask & 31);
  // Lanes may read from earlier groups of `width` lanes but not from later ones.
  if (src >= (lane / width + 1) * width) return var;
  return SlotValue(slots, src, var);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  using namespace ::kvflow_emu::internal;
  const int p = predicate != 0;
  const LaneSlot* slots = WarpExchange(Collective::kBallot, mask, &p, sizeof(p));
  unsigned result = 0;
  for (int l = 0; l < g_thread->warp_lanes; ++l) {
    int v;
    std::memcpy(&v, slots[l].bytes, sizeof(v));
    if (v) result |= 1u << l;
  }
  return result;
}
inline int __any_sync(unsigned mask, int predicate) {
  using namespace ::kvflow_emu::internal;
  const int p = predicate != 0;
  const LaneSlot* slots = WarpExchange(Collective::kAny, mask, &p, sizeof(p));
  for (int l = 0; l < g_thread->warp_lanes; ++l) {
    int v;
    std::memcpy(&v, slots[l].bytes, sizeof(v));
    if (v) return 1;
  }
  return 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  using namespace ::kvflow_emu::internal;
  const int p = predicate != 0;
  const LaneSlot* slots = WarpExchange(Collective::kAll, mask, &p, sizeof(p));
  for (int l = 0; l < g_thread->warp_lanes; ++l) {
    int v;
    std::memcpy(&v, slots[l].bytes, sizeof(v));
    if (!v) return 0;
  }
  return 1;
}
// All lanes are active whenever a lane runs (divergence is not tracked).
inline unsigned __activemask() {
  const int n = ::kvflow_emu::internal::g_thread->warp_lanes;
  return n == 32 ? 0xffffffffu : (1u << n) - 1u;
}

namespace kvflow_emu::internal {
template <typename T, typename Op>
inline T WarpReduce(unsigned mask, T value, Op op) {
  const LaneSlot* slots = WarpExchange(Collective::kReduce, mask, &value, sizeof(T));
  T acc;
  std::memcpy(&acc, slots[0].bytes, sizeof(T));
  for (int l = 1; l < g_thread->warp_lanes; ++l) {
    T v;
    std::memcpy(&v, slots[l].bytes, sizeof(T));
    acc = op(acc, v);
  }
  return acc;
}
template <typename T>
inline unsigned MatchAny(unsigned mask, T value) {
  const LaneSlot* slots = WarpExchange(Collective::kMatchAny, mask, &value, sizeof(T));
  unsigned result = 0;
  for (int l = 0; l < g_thread->warp_lanes; ++l)
    if (std::memcmp(slots[l].bytes, &value, sizeof(T)) == 0) result |= 1u << l;
  return result;
}
template <typename T>
inline unsigned MatchAll(unsigned mask, T value, int* pred) {
  const LaneSlot* slots = WarpExchange(Collective::kMatchAll, mask, &value, sizeof(T));
  for (int l = 0; l < g_thread->warp_lanes; ++l) {
    if (std::memcmp(slots[l].bytes, &value, sizeof(T)) != 0) {
      *pred = 0;
      return 0;
    }
  }
  *pred = 1;
  return __activemask();
}
}  // namespace kvflow_emu::internal

inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a + b; });
}
inline int __reduce_add_sync(unsigned mask, int v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](int a, int b) {
    return static_cast<int>(static_cast<unsigned>(a) + static_cast<unsigned>(b));
  });
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a < b ? a : b; });
}
inline int __reduce_min_sync(unsigned mask, int v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](int a, int b) { return a < b ? a : b; });
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline int __reduce_max_sync(unsigned mask, int v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](int a, int b) { return a > b ? a : b; });
}
inline unsigned __reduce_and_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a & b; });
}
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a | b; });
}
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v) {
  return ::kvflow_emu::internal::WarpReduce(mask, v, [](unsigned a, unsigned b) { return a ^ b; });
}
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T value) {
  return ::kvflow_emu::internal::MatchAny(mask, value);
}
template <typename T>
inline unsigned __match_all_sync(unsigned mask, T value, int* pred) {
  return ::kvflow_emu::internal::MatchAll(mask, value, pred);
}

// ---- memory fences and loads ---------------------------------------------------------------------------
// Threads interleave only at barriers and collectives, so fences have nothing to order.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
template <typename T>
inline T __ldca(const T* p) { return *p; }
template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline T __ldlu(const T* p) { return *p; }
template <typename T>
inline T __ldcv(const T* p) { return *p; }
template <typename T>
inline void __stcg(T* p, T v) { *p = v; }
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
template <typename T>
inline void __stwb(T* p, T v) { *p = v; }
template <typename T>
inline void __stwt(T* p, T v) { *p = v; }
inline void __nanosleep(unsigned) {}
[[noreturn]] inline void __trap() { ::kvflow_emu::internal::Fail("__trap() called"); }
inline void __brkpt() { ::kvflow_emu::internal::Fail("__brkpt() called"); }
long long int clock64();

// ---- atomics -------------------------------------------------------------------------------------------
// One block runs at a time on one host thread and fibers switch only at barriers/collectives, so a
// plain read-modify-write is atomic.
namespace kvflow_emu::internal {
template <typename T, typename Op>
inline T AtomicUpdate(T* address, Op op) {
  const T old = *address;
  *address = op(old);
  return old;
}
}  // namespace kvflow_emu::internal

#define KVFLOW_EMU_ATOMIC(name, type, expr)                                                 \
  inline type name(type* address, type val) {                                               \
    return ::kvflow_emu::internal::AtomicUpdate(address, [val]([[maybe_unused]] type old) { return expr; }); \
  }
KVFLOW_EMU_ATOMIC(atomicAdd, int, static_cast<int>(static_cast<unsigned>(old) + static_cast<unsigned>(val)))
KVFLOW_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
KVFLOW_EMU_ATOMIC(atomicAdd, unsigned long long int, old + val)
KVFLOW_EMU_ATOMIC(atomicAdd, float, old + val)
KVFLOW_EMU_ATOMIC(atomicAdd, double, old + val)
KVFLOW_EMU_ATOMIC(atomicAdd, __half, __float2half_rn(__half2float(old) + __half2float(val)))
KVFLOW_EMU_ATOMIC(atomicAdd, __half2, __floats2half2_rn(__low2float(old) + __low2float(val),
                                                        __high2float(old) + __high2float(val)))
KVFLOW_EMU_ATOMIC(atomicAdd, __nv_bfloat16, __float2bfloat16_rn(__bfloat162float(old) + __bfloat162float(val)))
KVFLOW_EMU_ATOMIC(atomicAdd, __nv_bfloat162, __floats2bfloat162_rn(__low2float(old) + __low2float(val),
                                                                   __high2float(old) + __high2float(val)))
KVFLOW_EMU_ATOMIC(atomicSub, int, static_cast<int>(static_cast<unsigned>(old) - static_cast<unsigned>(val)))
KVFLOW_EMU_ATOMIC(atomicSub, unsigned int, old - val)
KVFLOW_EMU_ATOMIC(atomicExch, int, val)
KVFLOW_EMU_ATOMIC(atomicExch, unsigned int, val)
KVFLOW_EMU_ATOMIC(atomicExch, unsigned long long int, val)
KVFLOW_EMU_ATOMIC(atomicExch, float, val)
KVFLOW_EMU_ATOMIC(atomicMax, int, old > val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMax, long long int, old > val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMax, unsigned long long int, old > val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMin, int, old < val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMin, long long int, old < val ? old : val)
KVFLOW_EMU_ATOMIC(atomicMin, unsigned long long int, old < val ? old : val)
KVFLOW_EMU_ATOMIC(atomicAnd, int, old & val)
KVFLOW_EMU_ATOMIC(atomicAnd, unsigned int, old & val)
KVFLOW_EMU_ATOMIC(atomicAnd, unsigned long long int, old & val)
KVFLOW_EMU_ATOMIC(atomicOr, int, old | val)
KVFLOW_EMU_ATOMIC(atomicOr, unsigned int, old | val)
KVFLOW_EMU_ATOMIC(atomicOr, unsigned long long int, old | val)
KVFLOW_EMU_ATOMIC(atomicXor, int, old ^ val)
KVFLOW_EMU_ATOMIC(atomicXor, unsigned int, old ^ val)
KVFLOW_EMU_ATOMIC(atomicXor, unsigned long long int, old ^ val)
KVFLOW_EMU_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1u)
KVFLOW_EMU_ATOMIC(atomicDec, unsigned int, (old == 0u || old > val) ? val : old - 1u)
#undef KVFLOW_EMU_ATOMIC

inline int atomicCAS(int* address, int compare, int val) {
  const int old = *address;
  if (old == compare) *address = val;
  return old;
}
inline unsigned int atomicCAS(unsigned int* address, unsigned int compare, unsigned int val) {
  const unsigned int old = *address;
  if (old == compare) *address = val;
  return old;
}
inline unsigned long long int atomicCAS(unsigned long long int* address, unsigned long long int compare,
                                        unsigned long long int val) {
  const unsigned long long int old = *address;
  if (old == compare) *address = val;
  return old;
}
inline unsigned short int atomicCAS(unsigned short int* address, unsigned short int compare,
                                    unsigned short int val) {
  const unsigned short int old = *address;
  if (old == compare) *address = val;
  return old;
}

// Scoped variants: every scope is the same on the emulator.
#define KVFLOW_EMU_SCOPED_ATOMIC(name)                       \
  template <typename... A>                                   \
  inline auto name##_block(A... a) { return name(a...); }    \
  template <typename... A>                                   \
  inline auto name##_system(A... a) { return name(a...); }
KVFLOW_EMU_SCOPED_ATOMIC(atomicAdd)
KVFLOW_EMU_SCOPED_ATOMIC(atomicSub)
KVFLOW_EMU_SCOPED_ATOMIC(atomicExch)
KVFLOW_EMU_SCOPED_ATOMIC(atomicMax)
KVFLOW_EMU_SCOPED_ATOMIC(atomicMin)
KVFLOW_EMU_SCOPED_ATOMIC(atomicAnd)
KVFLOW_EMU_SCOPED_ATOMIC(atomicOr)
KVFLOW_EMU_SCOPED_ATOMIC(atomicXor)
KVFLOW_EMU_SCOPED_ATOMIC(atomicCAS)
#undef KVFLOW_EMU_SCOPED_ATOMIC

// ---- math intrinsics -------------------------------------------------------------------------------
// glibc declares __expf & co. itself (and libm does not export them), so those names are macros
// that map to the functions below.
namespace kvflow_emu::math {
inline float Expf(float x) { return ::expf(x); }
inline float Logf(float x) { return ::logf(x); }
inline float Sinf(float x) { return ::sinf(x); }
inline float Cosf(float x) { return ::cosf(x); }
inline float Tanf(float x) { return ::tanf(x); }
inline float Powf(float x, float y) { return ::powf(x, y); }
inline float Exp10f(float x) { return ::powf(10.0f, x); }
inline float Log2f(float x) { return ::log2f(x); }
inline float Log10f(float x) { return ::log10f(x); }
inline void Sincosf(float x, float* s, float* c) {
  *s = ::sinf(x);
  *c = ::cosf(x);
}
}  // namespace kvflow_emu::math
#define __expf ::kvflow_emu::math::Expf
#define __logf ::kvflow_emu::math::Logf
#define __sinf ::kvflow_emu::math::Sinf
#define __cosf ::kvflow_emu::math::Cosf
#define __tanf ::kvflow_emu::math::Tanf
#define __powf ::kvflow_emu::math::Powf
#define __exp10f ::kvflow_emu::math::Exp10f
#define __log2f ::kvflow_emu::math::Log2f
#define __log10f ::kvflow_emu::math::Log10f
#define __sincosf ::kvflow_emu::math::Sincosf

inline float __fdividef(float x, float y) { return x / y; }
inline float fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / std::cbrt(x); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }  // NaN -> 0
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float sinpif(float x) { return static_cast<float>(std::sin(M_PI * static_cast<double>(x))); }
inline float cospif(float x) { return static_cast<float>(std::cos(M_PI * static_cast<double>(x))); }
inline void sincospif(float x, float* s, float* c) {
  *s = sinpif(x);
  *c = cospif(x);
}
inline float normcdff(float x) { return 0.5f * std::erfc(-x * static_cast<float>(M_SQRT1_2)); }

inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(std::ceil(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(std::nearbyint(x)); }
inline unsigned __float2uint_rz(float x) { return static_cast<unsigned>(x); }
inline long long __float2ll_rn(float x) { return static_cast<long long>(std::nearbyint(x)); }
inline long long __float2ll_rz(float x) { return static_cast<long long>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline float __ll2float_rn(long long x) { return static_cast<float>(x); }
inline float __double2float_rn(double x) { return static_cast<float>(x); }
inline int __double2int_rn(double x) { return static_cast<int>(std::nearbyint(x)); }

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline double __longlong_as_double(long long x) {
  double d;
  std::memcpy(&d, &x, 8);
  return d;
}
inline long long __double_as_longlong(double x) {
  long long l;
  std::memcpy(&l, &x, 8);
  return l;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned result = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned selector = (s >> (4 * i)) & 7u;
    result |= static_cast<unsigned>((bytes >> (8 * selector)) & 0xffu) << (8 * i);
  }
  return result;
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline long long __mul64hi(long long a, long long b) { return static_cast<long long>((static_cast<__int128>(a) * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (shift & 31)) >> 32);
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>((v << (shift < 32 ? shift : 32)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift & 31));
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned long long v = (static_cast<unsigned long long>(hi) << 32) | lo;
  return static_cast<unsigned>(v >> (shift < 32 ? shift : 32));
}
inline int __mul24(int a, int b) { return ((a << 8) >> 8) * ((b << 8) >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return (a > b ? a - b : b - a) + c; }
inline int __sad(int a, int b, unsigned c) { return static_cast<int>((a > b ? a - b : b - a) + c); }

// CUDA's global min/max overloads (device code calls them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
// CUDA's mixed signed/unsigned overloads compare as unsigned.
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }

// ---- 16-bit helpers the host side of cuda_fp16.h / cuda_bf16.h lacks -----------------------------
inline __half __hfma(__half a, __half b, __half c) {
  return __float2half_rn(std::fma(__half2float(a), __half2float(b), __half2float(c)));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __halves2half2(__hfma(__low2half(a), __low2half(b), __low2half(c)),
                        __hfma(__high2half(a), __high2half(b), __high2half(c)));
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16_rn(std::fma(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __halves2bfloat162(__hfma(__low2bfloat16(a), __low2bfloat16(b), __low2bfloat16(c)),
                            __hfma(__high2bfloat16(a), __high2bfloat16(b), __high2bfloat16(c)));
}
inline int __half2int_rn(__half h) { return static_cast<int>(std::nearbyint(__half2float(h))); }
inline __half hexp(__half h) { return __float2half_rn(std::exp(__half2float(h))); }
inline __half hsqrt(__half h) { return __float2half_rn(std::sqrt(__half2float(h))); }
inline __half hrsqrt(__half h) { return __float2half_rn(1.0f / std::sqrt(__half2float(h))); }
inline __nv_bfloat16 hexp(__nv_bfloat16 h) { return __float2bfloat16_rn(std::exp(__bfloat162float(h))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 h) { return __float2bfloat16_rn(std::sqrt(__bfloat162float(h))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 h) {
  return __float2bfloat16_rn(1.0f / std::sqrt(__bfloat162float(h)));
}

// ---- host-side extras -----------------------------------------------------------------------------
namespace kvflow_emu {

// Bytes currently allocated with cudaMalloc, and the number of live allocations.
size_t LiveDeviceBytes();
size_t LiveDeviceAllocations();

// Checks the guard bytes of every live cudaMalloc buffer; aborts naming `context` on damage.
void CheckAllGuards(const char* context);

// Statistics of the scheduler since the start of the process (for benchmarks of the emulator).
struct Stats {
  uint64_t launches = 0;
  uint64_t blocks = 0;
  uint64_t threads = 0;
  uint64_t context_switches = 0;
};
Stats GetStats();

}  // namespace kvflow_emu
