// reshape_and_cache on the GPU against the CPU reference (cpu::WriteKvCache). Skips with a
// message when the build has no CUDA or the machine has no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/cpu/paged_attention.h"
#include "backend/cuda/cuda_device.h"

#ifdef KVFLOW_WITH_CUDA
#include <cuda_runtime.h>

#include "cache_ops.h"
#endif

namespace kvflow {
namespace {

TEST(CudaCacheOps, ReshapeAndCacheMatchesCpuReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU: " << cuda::DeviceDescription(0);
#ifdef KVFLOW_WITH_CUDA
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int block_size : {8, 16, 32}) {
    KvCacheLayout layout{1, 37, 3, block_size, 64};
    ForwardBatch batch;
    std::vector<int64_t> slots;
    std::vector<BlockId> pool(static_cast<size_t>(layout.num_blocks));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    size_t next = 0;
    for (int len : {1, 13, 40, 77}) {
      SequenceSlice s;
      s.token_offset = static_cast<int32_t>(batch.tokens.size());
      s.num_tokens = len;
      s.context_len = len;
      const int nb = (len + block_size - 1) / block_size;
      s.block_table.assign(pool.begin() + static_cast<long>(next), pool.begin() + static_cast<long>(next + nb));
      next += static_cast<size_t>(nb);
      for (int t = 0; t < len; ++t) {
        batch.tokens.push_back(0);
        batch.positions.push_back(t);
        slots.push_back(static_cast<int64_t>(s.block_table[static_cast<size_t>(t / block_size)]) * block_size + t % block_size);
      }
      batch.seqs.push_back(s);
    }
    const size_t rows = batch.tokens.size() * layout.num_kv_heads * layout.head_dim;
    std::vector<float> k(rows), v(rows);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    std::vector<float> ref_k(layout.layer_stride(), NAN), ref_v(layout.layer_stride(), NAN);
    cpu::WriteKvCache(batch, layout, k.data(), v.data(), ref_k.data(), ref_v.data());

    float *dk, *dv, *dkc, *dvc;
    int64_t* dslots;
    ASSERT_EQ(cudaMalloc(&dk, rows * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dv, rows * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dkc, layout.layer_stride() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dvc, layout.layer_stride() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dslots, slots.size() * 8), cudaSuccess);
    std::vector<float> poison(layout.layer_stride(), NAN);
    cudaMemcpy(dk, k.data(), rows * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dv, v.data(), rows * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dkc, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dvc, poison.data(), poison.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dslots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice);
    ASSERT_EQ(cuda::ReshapeAndCacheF32(dk, dv, dkc, dvc, dslots, static_cast<int>(slots.size()), layout.num_kv_heads,
                                       layout.head_dim, block_size, nullptr),
              0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got_k(layout.layer_stride()), got_v(layout.layer_stride());
    cudaMemcpy(got_k.data(), dkc, got_k.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(got_v.data(), dvc, got_v.size() * 4, cudaMemcpyDeviceToHost);
    // Bitwise equal, NaN poison included: written slots match, untouched ones stay untouched.
    EXPECT_EQ(std::memcmp(got_k.data(), ref_k.data(), got_k.size() * 4), 0) << "block size " << block_size;
    EXPECT_EQ(std::memcmp(got_v.data(), ref_v.data(), got_v.size() * 4), 0) << "block size " << block_size;
    for (void* p : {static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(dkc), static_cast<void*>(dvc),
                    static_cast<void*>(dslots)}) {
      cudaFree(p);
    }
  }
#endif
}

}  // namespace
}  // namespace kvflow
