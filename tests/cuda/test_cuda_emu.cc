// Self-tests of the CUDA emulator (tests/cuda_emu): execution model, warp intrinsics, tensor-core
// wrappers, graphs, cuBLAS and error paths. Tests with kernels run on the emulator only (a .cc is
// compiled by g++ in the GPU build, so it cannot hold kernels there); the runtime/cuBLAS-only tests
// also run on a GPU, which checks that the emulator's semantics match the real libraries.
#include "gpu_test_util.h"

#include <cublas_v2.h>

#include <time.h>

#include <chrono>
#include <cstdio>
#include <numeric>

#ifdef KVFLOW_CUDA_EMU
#include "device_utils.cuh"
#endif

namespace kvflow::test {
namespace {

#define KVFLOW_EMU_ONLY() \
  if (!IsEmulator()) GTEST_SKIP() << "kernels of the emulator self-test are compiled for the emulator only"

#ifdef KVFLOW_CUDA_EMU
using cuda::LaunchKernel;
namespace dev = cuda::dev;

// ---- kernels --------------------------------------------------------------------------------------------

// Tree reduction in shared memory: correct only if __syncthreads orders the steps.
__global__ void TreeSumKernel(const float* x, float* block_sums, float* block_sums_helper) {
  __shared__ float partial[256];
  __shared__ float scratch[32];
  const int t = threadIdx.x;
  const float v = x[blockIdx.x * blockDim.x + t];
  partial[t] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  const float helper = dev::BlockSum(v, scratch);
  if (t == 0) block_sums[blockIdx.x] = partial[0];
  if (t == 5) block_sums_helper[blockIdx.x] = helper;
}

__global__ void IndexKernel(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  out[block * threads + thread] = (blockIdx.z << 24) | (blockIdx.y << 20) | (blockIdx.x << 16) | (threadIdx.z << 12) |
                                  (threadIdx.y << 8) | threadIdx.x;
}

// Per lane: 12 shuffle results for every type and width case.
template <typename T>
__global__ void ShuffleKernel(const T* in, T* out, int src, int delta, int lane_mask, int width) {
  const int t = threadIdx.x;
  const T v = in[t];
  T* o = out + t * 4;
  o[0] = __shfl_sync(0xffffffffu, v, src, width);
  o[1] = __shfl_up_sync(0xffffffffu, v, delta, width);
  o[2] = __shfl_down_sync(0xffffffffu, v, delta, width);
  o[3] = __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}

__global__ void VoteKernel(const int* pred, unsigned* out) {
  const int t = threadIdx.x;
  const int p = pred[t];
  unsigned* o = out + t * 8;
  o[0] = __ballot_sync(0xffffffffu, p);
  o[1] = __any_sync(0xffffffffu, p);
  o[2] = __all_sync(0xffffffffu, p);
  o[3] = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(t));
  o[4] = static_cast<unsigned>(__reduce_max_sync(0xffffffffu, p ? t : -1));
  o[5] = __match_any_sync(0xffffffffu, t % 3);
  __syncwarp();
  o[6] = static_cast<unsigned>(__syncthreads_count(p));
  o[7] = static_cast<unsigned>(__syncthreads_or(p) * 2 + __syncthreads_and(p));
}

__global__ void AtomicsKernel(int* i, float* f, unsigned long long* u, double* d, int* mx, int* mn, unsigned* cas_counter,
                              int* exch) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(i, 1);
  atomicAdd(f, 0.5f);
  atomicAdd(u, static_cast<unsigned long long>(g));
  atomicAdd(d, 0.25);
  atomicMax(mx, g);
  atomicMin(mn, -g);
  unsigned old = *cas_counter, assumed;
  do {  // increment through atomicCAS
    assumed = old;
    old = atomicCAS(cas_counter, assumed, assumed + 2u);
  } while (old != assumed);
  if (g == 77) atomicExch(exch, 1234);
}

__global__ void DynamicSmemKernel(const int* in, int* out, int* first_word) {
  KVFLOW_DYNAMIC_SMEM(int, buffer);
  const int t = threadIdx.x, n = blockDim.x;
  if (t == 0) first_word[blockIdx.x] = buffer[n - 1];  // before anyone writes: the fill pattern
  __syncthreads();
  buffer[t] = in[blockIdx.x * n + t];
  __syncthreads();
  out[blockIdx.x * n + t] = buffer[n - 1 - t];
}

// Threads that returned do not hold back __syncthreads.
__global__ void EarlyExitKernel(int* out) {
  __shared__ int value;
  if (threadIdx.x >= 64) return;
  if (threadIdx.x == 0) value = 42 + blockIdx.x;
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = value;
}

// Reads its neighbour's shared value WITHOUT the __syncthreads it needs.
__global__ void MissingBarrierKernel(int* out) {
  __shared__ int cell[128];
  const int t = threadIdx.x;
  cell[t] = 1000 * blockIdx.x + t;
  out[blockIdx.x * blockDim.x + t] = t > 0 ? cell[t - 1] : -1;
}

__global__ void BarrierLoopKernel(int iterations, float* out) {
  __shared__ float cell[1024];
  float acc = 0.0f;
  for (int i = 0; i < iterations; ++i) {
    cell[threadIdx.x] = acc + 1.0f;
    __syncthreads();
    acc = cell[(threadIdx.x + 1) % blockDim.x];
    __syncthreads();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// One warp: fragments loaded from global memory by the documented (PTX) layout, then one mma.
template <typename T>
__global__ void MmaKernel(const T* a, const T* b, const float* c, float* d) {  // a 16x16, b 16x8 (k-major), c/d 16x8
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto pack = [](T lo, T hi) {
    uint16_t ulo, uhi;
    memcpy(&ulo, &lo, 2);
    memcpy(&uhi, &hi, 2);
    return static_cast<uint32_t>(ulo) | (static_cast<uint32_t>(uhi) << 16);
  };
  uint32_t fa[4], fb[2];
  fa[0] = pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
  fa[1] = pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
  fa[2] = pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
  fa[3] = pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
  fb[0] = pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);
  fb[1] = pack(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  dev::MmaM16N8K16<T>(acc, fa, fb);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// Four 8x8 matrices of uint16 (value = 64 i + 8 row + col) stored with scrambled row addresses;
// every variant of ldmatrix; out[lane][variant][4].
__global__ void LdMatrixKernel(uint32_t* out) {
  __shared__ __align__(16) uint16_t rows[32 * 8];
  const int lane = threadIdx.x;
  // Row j of matrix i lives at slot (5 * (8 i + j) + 3) % 32.
  for (int c = 0; c < 8; ++c) rows[((5 * lane + 3) % 32) * 8 + c] = static_cast<uint16_t>(64 * (lane / 8) + 8 * (lane % 8) + c);
  __syncwarp();
  const int slot = (5 * lane + 3) % 32;  // lane l passes row l % 8 of matrix l / 8
  const uint16_t* my_row = &rows[slot * 8];
  uint32_t r[4] = {0, 0, 0, 0};
  uint32_t* o = out + lane * 6 * 4;
  kvflow_emu::LdMatrix(1, false, r, my_row);
  o[0] = r[0];
  kvflow_emu::LdMatrix(1, true, r, my_row);
  o[4] = r[0];
  dev::LdMatrixX2(r, my_row);
  o[8] = r[0], o[9] = r[1];
  dev::LdMatrixX2Trans(r, my_row);
  o[12] = r[0], o[13] = r[1];
  dev::LdMatrixX4(r, my_row);
  for (int i = 0; i < 4; ++i) o[16 + i] = r[i];
  dev::LdMatrixX4Trans(r, my_row);
  for (int i = 0; i < 4; ++i) o[20 + i] = r[i];
}

// D(16x8) = A(16x16) B(16x8) through shared memory, ldmatrix and mma: the pattern real kernels use.
// B is loaded twice, from B^T (8x16, ldmatrix) and from B (16x8, ldmatrix.trans); d and d2.
template <typename T>
__global__ void SmemMmaKernel(const T* a, const T* b, float* d, float* d2) {
  __shared__ __align__(16) T sa[16 * 16];
  __shared__ __align__(16) T sbt[8 * 16];  // B^T, row-major
  __shared__ __align__(16) T sb[16 * 8];   // B, row-major
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) sa[i] = a[i];
  for (int i = lane; i < 128; i += 32) {
    sb[i] = b[i];
    const int k = i / 8, n = i % 8;
    sbt[n * 16 + k] = b[i];
  }
  __syncthreads();
  uint32_t fa[4], fb[2], fb2[2];
  dev::LdMatrixX4(fa, &sa[(lane % 16) * 16 + (lane / 16) * 8]);
  const int r = lane % 16;  // lanes 16..31 pass valid (ignored) addresses
  dev::LdMatrixX2(fb, &sbt[(r % 8) * 16 + (r / 8) * 8]);
  dev::LdMatrixX2Trans(fb2, &sb[r * 8]);
  float acc[4] = {0, 0, 0, 0}, acc2[4] = {0, 0, 0, 0};
  dev::MmaM16N8K16<T>(acc, fa, fb);
  dev::MmaM16N8K16<T>(acc2, fa, fb2);
  const int g = lane / 4, t = lane % 4;
  d[g * 8 + 2 * t] = acc[0], d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2], d[(g + 8) * 8 + 2 * t + 1] = acc[3];
  d2[g * 8 + 2 * t] = acc2[0], d2[g * 8 + 2 * t + 1] = acc2[1];
  d2[(g + 8) * 8 + 2 * t] = acc2[2], d2[(g + 8) * 8 + 2 * t + 1] = acc2[3];
}

__global__ void AddKernel(float* x, float value, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += value;
}
__global__ void ScaleKernel(const float* x, float* y, float s, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * s;
}

__global__ void EmptyKernel() {}

__global__ void DivergentShuffleKernel(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

__global__ void OutOfBoundsWriteKernel(float* x, int n) {
  if (threadIdx.x == 0) x[n] = 1.0f;  // one past the end
}
#endif  // KVFLOW_CUDA_EMU

// ---- execution model ---------------------------------------------------------------------------------------

TEST(CudaEmu, SyncthreadsOrdersSharedMemoryReduction) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int blocks = 64, threads = 256;
  std::vector<float> x(blocks * threads);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> dist(-8, 8);
  for (float& v : x) v = static_cast<float>(dist(rng));  // integers: every summation order is exact
  DeviceBuffer dx = DeviceBuffer::From(x), sums(blocks * 4), helper(blocks * 4);
  KVFLOW_CUDA_OK(LaunchKernel(TreeSumKernel, blocks, threads, 0, nullptr, dx.get<const float>(), sums.get<float>(),
                              helper.get<float>()));
  const auto got = sums.Download<float>(), got_helper = helper.Download<float>();
  for (int b = 0; b < blocks; ++b) {
    const float ref = std::accumulate(x.begin() + b * threads, x.begin() + (b + 1) * threads, 0.0f);
    EXPECT_EQ(got[b], ref) << "block " << b;
    EXPECT_EQ(got_helper[b], ref) << "block " << b;
  }
#endif
}

TEST(CudaEmu, BuiltinIndicesIn3D) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  const int threads = 64, total = 12 * threads;
  DeviceBuffer out(total * 4);
  KVFLOW_CUDA_OK(LaunchKernel(IndexKernel, grid, block, 0, nullptr, out.get<int>()));
  const auto got = out.Download<int>();
  int i = 0;
  for (unsigned bz = 0; bz < 2; ++bz)
    for (unsigned by = 0; by < 2; ++by)
      for (unsigned bx = 0; bx < 3; ++bx)
        for (unsigned tz = 0; tz < 2; ++tz)
          for (unsigned ty = 0; ty < 4; ++ty)
            for (unsigned tx = 0; tx < 8; ++tx, ++i)
              ASSERT_EQ(got[i], static_cast<int>((bz << 24) | (by << 20) | (bx << 16) | (tz << 12) | (ty << 8) | tx))
                  << "index " << i;
#endif
}

#ifdef KVFLOW_CUDA_EMU
// Expected shuffle sources by the CUDA programming guide; -1: the lane keeps its own value.
int ShflSource(int lane, int src, int width) { return (lane / width) * width + (src % width + width) % width; }
int ShflUpSource(int lane, int delta, int width) { return lane % width >= delta ? lane - delta : -1; }
int ShflDownSource(int lane, int delta, int width) { return lane % width + delta < width ? lane + delta : -1; }
int ShflXorSource(int lane, int mask, int width) {
  const int s = lane ^ mask;
  return s < (lane / width + 1) * width ? s : -1;
}

template <typename T>
void CheckShuffles(const std::vector<T>& in, int src, int delta, int lane_mask, int width, const char* type) {
  const int threads = static_cast<int>(in.size());
  DeviceBuffer din = DeviceBuffer::From(in), dout(threads * 4 * sizeof(T));
  ASSERT_EQ(LaunchKernel(ShuffleKernel<T>, 1, threads, 0, nullptr, din.get<const T>(), dout.get<T>(), src, delta,
                         lane_mask, width),
            0);
  const auto out = dout.Download<T>();
  for (int t = 0; t < threads; ++t) {
    const int lane = t % 32, base = t - lane;
    const int sources[4] = {ShflSource(lane, src, width), ShflUpSource(lane, delta, width),
                            ShflDownSource(lane, delta, width), ShflXorSource(lane, lane_mask, width)};
    for (int k = 0; k < 4; ++k) {
      const T& want = in[sources[k] < 0 ? t : base + sources[k]];
      ASSERT_EQ(std::memcmp(&out[t * 4 + k], &want, sizeof(T)), 0)
          << type << " variant " << k << " thread " << t << " src " << src << " delta " << delta << " mask "
          << lane_mask << " width " << width;
    }
  }
}
#endif

TEST(CudaEmu, ShufflesMatchCudaSemantics) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int threads = 96;
  std::vector<float> f(threads);
  std::vector<int> i(threads);
  std::vector<double> d(threads);
  std::vector<long long> ll(threads);
  std::vector<__half> h(threads);
  std::vector<__half2> h2(threads);
  std::vector<__nv_bfloat16> bf(threads);
  for (int t = 0; t < threads; ++t) {
    f[t] = 0.5f * t - 7.0f;
    i[t] = t * 7 - 100;
    d[t] = 1e10 * t + 0.125;
    ll[t] = (1LL << 40) * t - 3;
    h[t] = __float2half_rn(static_cast<float>(t));
    h2[t] = __floats2half2_rn(static_cast<float>(t), -static_cast<float>(t));
    bf[t] = __float2bfloat16_rn(static_cast<float>(t) * 2.0f);
  }
  struct Case {
    int src, delta, mask, width;
  };
  const Case cases[] = {{0, 1, 1, 32}, {31, 16, 16, 32}, {5, 3, 7, 32}, {-1, 31, 31, 32}, {33, 2, 8, 32},
                        {3, 1, 1, 16}, {9, 4, 12, 8},    {7, 2, 17, 8}, {1, 1, 3, 2},     {0, 0, 0, 1}};
  for (const Case& c : cases) {
    CheckShuffles(f, c.src, c.delta, c.mask, c.width, "float");
    CheckShuffles(i, c.src, c.delta, c.mask, c.width, "int");
    CheckShuffles(d, c.src, c.delta, c.mask, c.width, "double");
    CheckShuffles(ll, c.src, c.delta, c.mask, c.width, "long long");
    CheckShuffles(h, c.src, c.delta, c.mask, c.width, "__half");
    CheckShuffles(h2, c.src, c.delta, c.mask, c.width, "__half2");
    CheckShuffles(bf, c.src, c.delta, c.mask, c.width, "__nv_bfloat16");
  }
  // The reductions in device_utils.cuh.
  std::vector<unsigned> u(threads);
  for (int t = 0; t < threads; ++t) u[t] = 1000u + t;
  CheckShuffles(u, 17, 5, 21, 32, "unsigned");
#endif
}

TEST(CudaEmu, BallotAnyAllReduceMatchAndCountingBarriers) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int threads = 64;
  std::vector<int> pred(threads);
  for (int t = 0; t < threads; ++t) pred[t] = (t < 32) ? (t % 3 == 0) : 1;  // warp 1: all true
  DeviceBuffer dpred = DeviceBuffer::From(pred), dout(threads * 8 * 4);
  KVFLOW_CUDA_OK(LaunchKernel(VoteKernel, 1, threads, 0, nullptr, dpred.get<const int>(), dout.get<unsigned>()));
  const auto out = dout.Download<unsigned>();
  unsigned ballot0 = 0;
  for (int l = 0; l < 32; ++l)
    if (l % 3 == 0) ballot0 |= 1u << l;
  const unsigned count = 11 + 32;
  for (int t = 0; t < threads; ++t) {
    const unsigned* o = &out[t * 8];
    const bool warp0 = t < 32;
    EXPECT_EQ(o[0], warp0 ? ballot0 : 0xffffffffu) << t;
    EXPECT_EQ(o[1], 1u) << t;
    EXPECT_EQ(o[2], warp0 ? 0u : 1u) << t;
    const unsigned base = warp0 ? 0 : 32;
    EXPECT_EQ(o[3], 32 * base + 496) << t;
    EXPECT_EQ(o[4], warp0 ? 30u : 63u) << t;
    unsigned match = 0;
    for (int l = 0; l < 32; ++l)
      if ((base + l) % 3 == t % 3) match |= 1u << l;
    EXPECT_EQ(o[5], match) << t;
    EXPECT_EQ(o[6], count) << t;
    EXPECT_EQ(o[7], 2u) << t;  // or = 1, and = 0
  }
#endif
}

TEST(CudaEmu, AtomicsAcrossBlocks) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int blocks = 40, threads = 128, n = blocks * threads;
  DeviceBuffer i(4), f(4), u(8), d(8), mx(4), mn(4), cas(4), exch(4);
  for (DeviceBuffer* b : {&i, &f, &u, &d, &mx, &mn, &cas, &exch}) KVFLOW_CUDA_OK(cudaMemset(b->get(), 0, b->bytes()));
  KVFLOW_CUDA_OK(LaunchKernel(AtomicsKernel, blocks, threads, 0, nullptr, i.get<int>(), f.get<float>(),
                              u.get<unsigned long long>(), d.get<double>(), mx.get<int>(), mn.get<int>(),
                              cas.get<unsigned>(), exch.get<int>()));
  EXPECT_EQ(i.Download<int>()[0], n);
  EXPECT_EQ(f.Download<float>()[0], 0.5f * n);
  EXPECT_EQ(u.Download<unsigned long long>()[0], static_cast<unsigned long long>(n) * (n - 1) / 2);
  EXPECT_EQ(d.Download<double>()[0], 0.25 * n);
  EXPECT_EQ(mx.Download<int>()[0], n - 1);
  EXPECT_EQ(mn.Download<int>()[0], -(n - 1));
  EXPECT_EQ(cas.Download<unsigned>()[0], 2u * n);
  EXPECT_EQ(exch.Download<int>()[0], 1234);
#endif
}

TEST(CudaEmu, DynamicSharedMemoryIsPerBlockAndPoisoned) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int blocks = 5, threads = 160;
  std::vector<int> in(blocks * threads);
  std::iota(in.begin(), in.end(), 1000);
  DeviceBuffer din = DeviceBuffer::From(in), dout(in.size() * 4), first(blocks * 4);
  KVFLOW_CUDA_OK(LaunchKernel(DynamicSmemKernel, blocks, threads, threads * sizeof(int), nullptr, din.get<const int>(),
                              dout.get<int>(), first.get<int>()));
  const auto out = dout.Download<int>();
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t) ASSERT_EQ(out[b * threads + t], in[b * threads + threads - 1 - t]);
  for (int v : first.Download<int>()) EXPECT_EQ(static_cast<unsigned>(v), 0xCDCDCDCDu);
  // 200 KiB needs the opt-in on a GPU but is within the 227 KiB limit.
  KVFLOW_CUDA_OK(LaunchKernel(DynamicSmemKernel, 1, threads, 200 * 1024, nullptr, din.get<const int>(),
                              dout.get<int>(), first.get<int>()));
#endif
}

TEST(CudaEmu, ExitedThreadsDoNotBlockSyncthreads) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  DeviceBuffer out(3 * 64 * 4);
  KVFLOW_CUDA_OK(LaunchKernel(EarlyExitKernel, 3, 256, 0, nullptr, out.get<int>()));
  const auto got = out.Download<int>();
  for (int i = 0; i < 3 * 64; ++i) ASSERT_EQ(got[i], 42 + i / 64);
#endif
}

// Threads run in ascending order in even blocks and descending order in odd ones (flipped: the
// other way round), so a missing barrier shows whichever thread reads.
TEST(CudaEmu, MissingBarrierShowsInOneOfTheThreadOrders) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const char* schedule = std::getenv("KVFLOW_EMU_SCHEDULE");
  const std::string order = schedule ? schedule : "";
  if (order != "" && order != "alternate" && order != "flipped") GTEST_SKIP() << "KVFLOW_EMU_SCHEDULE=" << order;
  const bool flipped = order == "flipped";
  DeviceBuffer out(2 * 128 * 4);
  KVFLOW_CUDA_OK(LaunchKernel(MissingBarrierKernel, 2, 128, 0, nullptr, out.get<int>()));
  const auto got = out.Download<int>();
  int stale_block0 = 0, stale_block1 = 0;
  for (int t = 1; t < 128; ++t) {
    stale_block0 += got[t] != t - 1;
    stale_block1 += got[128 + t] != 1000 + t - 1;
  }
  // Ascending: the writer ran first, nothing stale. Descending: every read is stale (in the launch's
  // first block a stale cell may hold the expected value by chance: shared memory keeps whatever it
  // held before).
  const int ascending = flipped ? stale_block1 : stale_block0, descending = flipped ? stale_block0 : stale_block1;
  EXPECT_EQ(ascending, 0);
  EXPECT_GE(descending, 120);
#endif
}

// Not a correctness test: prints what a barrier costs (the report quotes it).
TEST(CudaEmu, BarrierCost) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int blocks = 64, threads = 256, iterations = 50;
  DeviceBuffer out(blocks * threads * 4);
  // CPU time of this thread: the machines running CI are shared, wall time is noise.
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
  };
  const auto before = kvflow_emu::GetStats();
  const double t0 = cpu_seconds();
  KVFLOW_CUDA_OK(LaunchKernel(BarrierLoopKernel, blocks, threads, 0, nullptr, iterations, out.get<float>()));
  const double seconds = cpu_seconds() - t0;
  const auto after = kvflow_emu::GetStats();
  const double barriers = 2.0 * iterations * blocks * threads;
  std::printf("  %d blocks x %d threads x %d __syncthreads: %.1f ms CPU, %.1f ns per thread-barrier, %.2f switches each\n",
              blocks, threads, 2 * iterations, seconds * 1e3, seconds * 1e9 / barriers,
              (after.context_switches - before.context_switches) / barriers);
  const auto got = out.Download<float>();
  for (float v : got) ASSERT_EQ(v, static_cast<float>(iterations));
  // And launch overhead.
  const double t1 = cpu_seconds();
  for (int i = 0; i < 1000; ++i) KVFLOW_CUDA_OK(LaunchKernel(EmptyKernel, 1, 32, 0, nullptr));
  std::printf("  empty launch (1 block x 32 threads): %.2f us CPU\n", (cpu_seconds() - t1) * 1e3);
#endif
}

// ---- tensor cores ---------------------------------------------------------------------------------------------

#ifdef KVFLOW_CUDA_EMU
// 16-bit inputs rounded like the device sees them; c in fp32. Returns the reference D (16x8).
std::vector<float> MmaReference(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& c) {
  std::vector<float> d(128);
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      float acc = c[r * 8 + n];
      for (int k = 0; k < 16; ++k) acc += a[r * 16 + k] * b[k * 8 + n];
      d[r * 8 + n] = acc;
    }
  return d;
}

template <typename T>
void RunMmaTest(cuda::DType dtype) {
  std::mt19937 rng(7);
  std::vector<float> a(256), b(128), c(128);
  FillNormal(a, rng);
  FillNormal(b, rng);
  FillNormal(c, rng);
  const auto a_bytes = ToDeviceBytes(a, dtype), b_bytes = ToDeviceBytes(b, dtype);
  DeviceBuffer da = DeviceBuffer::From(a_bytes), db = DeviceBuffer::From(b_bytes), dc = DeviceBuffer::From(c),
               dd(128 * 4);
  ASSERT_EQ(LaunchKernel(MmaKernel<T>, 1, 32, 0, nullptr, da.get<const T>(), db.get<const T>(), dc.get<const float>(),
                         dd.get<float>()),
            0);
  const auto ref = MmaReference(a, b, c);
  const auto got = dd.Download<float>();
  for (int i = 0; i < 128; ++i) EXPECT_EQ(got[i], ref[i]) << cuda::DTypeName(dtype) << " element " << i;

  // And through shared memory with ldmatrix (B both ways), C = 0.
  DeviceBuffer d1(128 * 4), d2(128 * 4);
  ASSERT_EQ(LaunchKernel(SmemMmaKernel<T>, 1, 32, 0, nullptr, da.get<const T>(), db.get<const T>(), d1.get<float>(),
                         d2.get<float>()),
            0);
  const auto ref0 = MmaReference(a, b, std::vector<float>(128, 0.0f));
  const auto got1 = d1.Download<float>(), got2 = d2.Download<float>();
  for (int i = 0; i < 128; ++i) {
    EXPECT_EQ(got1[i], ref0[i]) << cuda::DTypeName(dtype) << " ldmatrix B^T, element " << i;
    EXPECT_EQ(got2[i], ref0[i]) << cuda::DTypeName(dtype) << " ldmatrix.trans B, element " << i;
  }
}
#endif

TEST(CudaEmu, MmaM16N8K16MatchesNaiveMatmul) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  RunMmaTest<__half>(cuda::DType::kF16);
  RunMmaTest<__nv_bfloat16>(cuda::DType::kBF16);
#endif
}

TEST(CudaEmu, LdMatrixMatchesPtxMapping) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  DeviceBuffer out(32 * 6 * 4 * 4);
  KVFLOW_CUDA_OK(LaunchKernel(LdMatrixKernel, 1, 32, 0, nullptr, out.get<uint32_t>()));
  const auto got = out.Download<uint32_t>();
  auto element = [](int matrix, int row, int col) { return static_cast<uint32_t>(64 * matrix + 8 * row + col); };
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t* o = &got[lane * 24];
    for (int variant = 0; variant < 6; ++variant) {
      const int num = variant < 2 ? 1 : variant < 4 ? 2 : 4;
      const bool trans = variant % 2 == 1;
      for (int i = 0; i < num; ++i) {
        const uint32_t lo = trans ? element(i, 2 * t, g) : element(i, g, 2 * t);
        const uint32_t hi = trans ? element(i, 2 * t + 1, g) : element(i, g, 2 * t + 1);
        EXPECT_EQ(o[variant * 4 + i], lo | (hi << 16))
            << "lane " << lane << " .x" << num << (trans ? ".trans" : "") << " matrix " << i;
      }
    }
  }
#endif
}

// ---- graphs ----------------------------------------------------------------------------------------------------

TEST(CudaEmu, GraphCaptureRecordsAndReplaysKernelsAndCopies) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  const int n = 1000;
  std::vector<float> x(n);
  std::iota(x.begin(), x.end(), 0.0f);
  DeviceBuffer dx = DeviceBuffer::From(x), dcopy(n * 4), dy(n * 4);
  KVFLOW_CUDA_OK(cudaMemset(dy.get(), 0, n * 4));
  KVFLOW_CUDA_OK(cudaMemset(dcopy.get(), 0, n * 4));
  cudaStream_t stream;
  KVFLOW_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  KVFLOW_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus status;
  KVFLOW_CUDA_OK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  float scale = 3.0f;  // captured by value: changing it later must not matter
  KVFLOW_CUDA_OK(LaunchKernel(AddKernel, (n + 127) / 128, 128, 0, stream, dx.get<float>(), 1.0f, n));
  KVFLOW_CUDA_OK(cudaMemcpyAsync(dcopy.get(), dx.get(), n * 4, cudaMemcpyDeviceToDevice, stream));
  KVFLOW_CUDA_OK(LaunchKernel(ScaleKernel, (n + 127) / 128, 128, 0, stream, dcopy.get<const float>(), dy.get<float>(),
                              scale, n));
  scale = 100.0f;
  // Nothing ran yet. (A synchronous copy would end the capture; emulated device memory is host memory.)
  EXPECT_EQ(std::vector<float>(dx.get<float>(), dx.get<float>() + n), x);
  cudaGraph_t graph;
  KVFLOW_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  KVFLOW_CUDA_OK(cudaStreamIsCapturing(stream, &status));
  EXPECT_EQ(status, cudaStreamCaptureStatusNone);
  cudaGraphExec_t exec;
  KVFLOW_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 1; replay <= 2; ++replay) {
    KVFLOW_CUDA_OK(cudaGraphLaunch(exec, stream));
    KVFLOW_CUDA_OK(cudaStreamSynchronize(stream));
    const auto got_x = dx.Download<float>(), got_y = dy.Download<float>();
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(got_x[i], x[i] + replay);
      ASSERT_EQ(got_y[i], (x[i] + replay) * 3.0f);
    }
  }
  KVFLOW_CUDA_OK(cudaGraphExecDestroy(exec));
  KVFLOW_CUDA_OK(cudaGraphDestroy(graph));

  // A synchronous copy during a global capture is an error and invalidates the capture.
  KVFLOW_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  std::vector<float> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), dx.get(), n * 4, cudaMemcpyDeviceToHost), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  cudaGetLastError();
  KVFLOW_CUDA_OK(cudaStreamDestroy(stream));
#endif
}

// ---- cuBLAS ------------------------------------------------------------------------------------------------------

// Column-major reference: C = alpha op(A) op(B) + beta C in double.
std::vector<float> GemmReference(bool ta, bool tb, int m, int n, int k, float alpha, const std::vector<float>& a, int lda,
                                 const std::vector<float>& b, int ldb, float beta, const std::vector<float>& c, int ldc) {
  std::vector<float> out = c;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double acc = 0;
      for (int p = 0; p < k; ++p) {
        const float av = ta ? a[p + static_cast<size_t>(i) * lda] : a[i + static_cast<size_t>(p) * lda];
        const float bv = tb ? b[j + static_cast<size_t>(p) * ldb] : b[p + static_cast<size_t>(j) * ldb];
        acc += static_cast<double>(av) * bv;
      }
      const size_t ci = i + static_cast<size_t>(j) * ldc;
      out[ci] = static_cast<float>(alpha * acc + (beta != 0.0f ? beta * static_cast<double>(c[ci]) : 0.0));
    }
  return out;
}

cudaDataType CudaType(cuda::DType t) {
  return t == cuda::DType::kF32 ? CUDA_R_32F : t == cuda::DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
}

TEST(CudaEmu, CublasGemmExMatchesReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  std::mt19937 rng(3);
  const int m = 37, n = 23, k = 45;
  struct Types {
    cuda::DType ab, c;
  };
  const Types types[] = {{cuda::DType::kF32, cuda::DType::kF32},
                         {cuda::DType::kF16, cuda::DType::kF16},
                         {cuda::DType::kBF16, cuda::DType::kBF16},
                         {cuda::DType::kF16, cuda::DType::kF32},
                         {cuda::DType::kBF16, cuda::DType::kF32}};
  for (const Types& ty : types) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        for (const float beta : {0.0f, 0.5f}) {
          const int lda = (ta ? k : m) + 3, ldb = (tb ? n : k) + 1, ldc = m + 2;
          std::vector<float> a(static_cast<size_t>(lda) * (ta ? m : k)), b(static_cast<size_t>(ldb) * (tb ? k : n)),
              c(static_cast<size_t>(ldc) * n);
          FillNormal(a, rng);
          FillNormal(b, rng);
          FillNormal(c, rng);
          const auto a_bytes = ToDeviceBytes(a, ty.ab), b_bytes = ToDeviceBytes(b, ty.ab);
          auto c_bytes = ToDeviceBytes(c, ty.c);
          DeviceBuffer da = DeviceBuffer::From(a_bytes), db = DeviceBuffer::From(b_bytes), dc(c_bytes.size());
          if (beta == 0.0f) {
            dc.Poison();  // NaN: C must not be read when beta == 0
            std::fill(c.begin(), c.end(), 0.0f);
          } else {
            KVFLOW_CUDA_OK(cudaMemcpy(dc.get(), c_bytes.data(), c_bytes.size(), cudaMemcpyHostToDevice));
          }
          const float alpha = 1.25f;
          ASSERT_EQ(cublasGemmEx(handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, &alpha,
                                 da.get(), CudaType(ty.ab), lda, db.get(), CudaType(ty.ab), ldb, &beta, dc.get(),
                                 CudaType(ty.c), ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    CUBLAS_STATUS_SUCCESS);
          KVFLOW_CUDA_OK(cudaDeviceSynchronize());
          auto got = FromDeviceBytes(dc.Download<uint8_t>(), ty.c);
          auto ref = GemmReference(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
          // Only the m x n block; padding rows of C are not written.
          std::vector<float> got_block, ref_block;
          for (int j = 0; j < n; ++j)
            for (int i = 0; i < m; ++i) {
              got_block.push_back(got[i + static_cast<size_t>(j) * ldc]);
              ref_block.push_back(ref[i + static_cast<size_t>(j) * ldc]);
            }
          const double tol = ty.c == cuda::DType::kF32 ? (ty.ab == cuda::DType::kF32 ? 1e-4 : 2e-3) : 2e-2;
          char what[128];
          std::snprintf(what, sizeof(what), "gemm %s->%s %c%c beta %.1f", cuda::DTypeName(ty.ab), cuda::DTypeName(ty.c),
                        ta ? 'T' : 'N', tb ? 'T' : 'N', beta);
          ExpectClose(what, got_block, ref_block, tol * 10, tol * 4);
        }
      }
    }
  }
  ASSERT_EQ(cublasDestroy(handle), CUBLAS_STATUS_SUCCESS);
}

TEST(CudaEmu, CublasStridedBatchedAndSgemm) {
  KVFLOW_SKIP_WITHOUT_GPU();
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  std::mt19937 rng(5);
  const int m = 16, n = 9, k = 33, batch = 3;
  const long long sa = m * k + 5, sb = k * n + 7, sc = m * n + 1;
  std::vector<float> a(sa * batch), b(sb * batch), c(sc * batch, 0.0f);
  FillNormal(a, rng);
  FillNormal(b, rng);
  DeviceBuffer da = DeviceBuffer::From(a), db = DeviceBuffer::From(b), dc = DeviceBuffer::From(c);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, da.get(), CUDA_R_32F, m, sa,
                                       db.get(), CUDA_R_32F, k, sb, &beta, dc.get(), CUDA_R_32F, m, sc, batch,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const auto got = dc.Download<float>();
  for (int i = 0; i < batch; ++i) {
    std::vector<float> ai(a.begin() + i * sa, a.begin() + i * sa + m * k), bi(b.begin() + i * sb, b.begin() + i * sb + k * n);
    const auto ref = GemmReference(false, false, m, n, k, 1.0f, ai, m, bi, k, 0.0f, std::vector<float>(m * n), m);
    ExpectClose("strided batch " + std::to_string(i), std::vector<float>(got.begin() + i * sc, got.begin() + i * sc + m * n),
                ref, 1e-4, 1e-3);
  }
  // Sgemm: C^T trick (row-major) used by callers: C(n x m) = B^T A^T.
  DeviceBuffer dc2(m * n * 4);
  ASSERT_EQ(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, da.get<float>(), k, db.get<float>(), k, &beta,
                        dc2.get<float>(), m),
            CUBLAS_STATUS_SUCCESS);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> a0(a.begin(), a.begin() + m * k), b0(b.begin(), b.begin() + k * n);
  ExpectClose("sgemm TN", dc2.Download<float>(),
              GemmReference(true, false, m, n, k, 1.0f, a0, k, b0, k, 0.0f, std::vector<float>(m * n), m), 1e-4, 1e-3);
  ASSERT_EQ(cublasDestroy(handle), CUBLAS_STATUS_SUCCESS);
}

TEST(CudaEmu, CublasLargeGemmSpeed) {
  KVFLOW_EMU_ONLY();
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const int m = 2048, n = 2048, k = 512;
  std::vector<float> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n);
  std::mt19937 rng(9);
  FillNormal(a, rng);
  FillNormal(b, rng);
  const auto a16 = ToDeviceBytes(a, cuda::DType::kF16), b16 = ToDeviceBytes(b, cuda::DType::kF16);
  DeviceBuffer da = DeviceBuffer::From(a16), db = DeviceBuffer::From(b16), dc(static_cast<size_t>(m) * n * 2);
  const float alpha = 1.0f, beta = 0.0f;
  auto cpu_seconds = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
  };
  const double t0 = cpu_seconds();
  // Row-major activations x weights^T, as the backend calls it: C^T = W X^T.
  ASSERT_EQ(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, da.get(), CUDA_R_16F, k, db.get(),
                         CUDA_R_16F, k, &beta, dc.get(), CUDA_R_16F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  const double seconds = cpu_seconds() - t0;
  std::printf("  cublasGemmEx fp16 %dx%dx%d: %.3f s CPU (%.1f GFLOP/s)\n", m, n, k, seconds,
              2.0 * m * n * k / seconds * 1e-9);
  // Spot-check a few elements.
  const auto got = FromDeviceBytes(dc.Download<uint8_t>(), cuda::DType::kF16);
  for (int s = 0; s < 16; ++s) {
    const int i = (s * 977) % m, j = (s * 613) % n;
    double ref = 0;
    for (int p = 0; p < k; ++p) ref += static_cast<double>(a[p + static_cast<size_t>(i) * k]) * b[p + static_cast<size_t>(j) * k];
    EXPECT_NEAR(got[i + static_cast<size_t>(j) * m], ref, 0.02 + 0.005 * std::fabs(ref));
  }
  ASSERT_EQ(cublasDestroy(handle), CUBLAS_STATUS_SUCCESS);
}

// ---- errors ---------------------------------------------------------------------------------------------------

TEST(CudaEmu, InvalidLaunchConfigurationsReturnErrors) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  cudaGetLastError();
  EXPECT_EQ(LaunchKernel(EmptyKernel, 1, 1025, 0, nullptr), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(LaunchKernel(EmptyKernel, 1, dim3(32, 32, 2), 0, nullptr), cudaErrorInvalidConfiguration);
  EXPECT_EQ(LaunchKernel(EmptyKernel, 1, dim3(1, 1, 65), 0, nullptr), cudaErrorInvalidConfiguration);
  EXPECT_EQ(LaunchKernel(EmptyKernel, dim3(1, 65536), 32, 0, nullptr), cudaErrorInvalidConfiguration);
  EXPECT_EQ(LaunchKernel(EmptyKernel, 1, 32, 228 * 1024, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchKernel(EmptyKernel, 0, 32, 0, nullptr), 0);  // LaunchKernel skips empty grids
  EXPECT_EQ(std::string(cudaGetErrorString(cudaErrorInvalidConfiguration)), "invalid configuration argument");
  EXPECT_EQ(std::string(cudaGetErrorName(cudaErrorInvalidValue)), "cudaErrorInvalidValue");
  cudaGetLastError();
#endif
}

TEST(CudaEmu, RuntimeApiChecksDeviceRanges) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  DeviceBuffer buf(1000);
  std::vector<uint8_t> host(2000);
  EXPECT_EQ(cudaMemcpy(buf.get(), host.data(), 1001, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), buf.get<uint8_t>() + 1, 1000, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 1000, 10, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemset(buf.get<uint8_t>() + 500, 0, 501), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(buf.get(), host.data(), 1000, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaFree(host.data()), cudaErrorInvalidValue);
  // Memory accounting and the limit.
  size_t free0 = 0, total = 0;
  KVFLOW_CUDA_OK(cudaMemGetInfo(&free0, &total));
  void* p = nullptr;
  KVFLOW_CUDA_OK(cudaMalloc(&p, size_t{64} << 20));
  size_t free1 = 0;
  KVFLOW_CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(free0 - free1, size_t{64} << 20);
  KVFLOW_CUDA_OK(cudaFree(p));
  EXPECT_EQ(cudaMalloc(&p, total + 1), cudaErrorMemoryAllocation);
  EXPECT_EQ(p, nullptr);
  cudaDeviceProp prop{};
  KVFLOW_CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  EXPECT_EQ(std::string(prop.name), "kvflow CUDA emulator (CPU)");
  EXPECT_EQ(prop.major, 9);
  EXPECT_EQ(prop.sharedMemPerBlockOptin, 232448u);
  EXPECT_EQ(prop.totalGlobalMem, total);
  cudaGetLastError();
#endif
}

TEST(CudaEmuDeathTest, CollectiveWithExitedLanesAborts) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DeviceBuffer out(32 * 4);
  EXPECT_DEATH(LaunchKernel(DivergentShuffleKernel, 1, 32, 0, nullptr, out.get<float>()),
               "DivergentShuffleKernel.*already returned|DivergentShuffleKernel.*returned while other lanes");
#endif
}

TEST(CudaEmuDeathTest, OutOfBoundsWriteIsCaughtByGuards) {
  KVFLOW_EMU_ONLY();
#ifdef KVFLOW_CUDA_EMU
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DeviceBuffer buf(100 * 4);
  EXPECT_DEATH(LaunchKernel(OutOfBoundsWriteKernel, 1, 32, 0, nullptr, buf.get<float>(), 100),
               "OUT-OF-BOUNDS WRITE detected after kernel .*OutOfBoundsWriteKernel");
#endif
}

}  // namespace
}  // namespace kvflow::test
