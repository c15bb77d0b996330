// KV pack kernels (kernels/kv_pack.cu) against the host model of the packed format, the loop the
// CPU backend's KvPacking runs (K then V, per KV head, the slots' rows in list order): bit-exact for
// every dtype, on shuffled slot lists that mix runs inside a block, runs across block edges and
// single slots. Unpack writes exactly the listed slots (the rest of the cache keeps its poison) and
// packing what was unpacked gives the same bytes back.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gpu_test_util.h"
#include "kv/kv_cache_layout.h"
#include "kv_pack.h"

namespace kvflow {
namespace {

using cuda::DType;

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// Slots of a shuffled block table: a run of whole positions (consecutive slots inside blocks,
// broken at block edges), then scattered single positions; no slot twice.
std::vector<int64_t> RandomSlots(const KvCacheLayout& layout, std::mt19937& rng, int count) {
  std::vector<BlockId> table(static_cast<size_t>(layout.num_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int capacity = layout.num_blocks * layout.block_size;
  std::vector<int32_t> positions(static_cast<size_t>(capacity));
  std::iota(positions.begin(), positions.end(), 0);
  const int run = std::min(count, capacity) * 2 / 3;
  std::shuffle(positions.begin() + run, positions.end(), rng);
  std::vector<int64_t> slots;
  for (int i = 0; i < std::min(count, capacity); ++i) {
    slots.push_back(SlotOf(table, positions[static_cast<size_t>(i)], layout.block_size));
  }
  return slots;
}

// The host model: packed bytes of `slots` from one layer's K and V caches.
std::vector<uint8_t> HostPack(const KvCacheLayout& layout, size_t es, const std::vector<uint8_t>& key,
                              const std::vector<uint8_t>& value, const std::vector<int64_t>& slots) {
  const size_t n = slots.size(), row = static_cast<size_t>(layout.head_dim) * es;
  std::vector<uint8_t> packed(2 * static_cast<size_t>(layout.num_kv_heads) * n * row);
  for (int kv = 0; kv < 2; ++kv) {
    const std::vector<uint8_t>& cache = kv == 0 ? key : value;
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      for (size_t i = 0; i < n; ++i) {
        const int64_t slot = slots[i];
        const size_t from = layout.offset(static_cast<int>(slot / layout.block_size), h,
                                          static_cast<int>(slot % layout.block_size)) * es;
        const size_t to = ((static_cast<size_t>(kv) * layout.num_kv_heads + h) * n + i) * row;
        std::memcpy(&packed[to], &cache[from], row);
      }
    }
  }
  return packed;
}

size_t DifferingBytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) bad += a[i] != b[i];
  return bad;
}

void RunPackRoundTrip(DType dtype, const KvCacheLayout& layout, int count, std::mt19937& rng) {
  const size_t es = cuda::DTypeSize(dtype);
  std::vector<float> k(layout.layer_stride()), v(layout.layer_stride());
  test::FillNormal(k, rng);
  test::FillNormal(v, rng);
  const std::vector<uint8_t> key = test::ToDeviceBytes(k, dtype), value = test::ToDeviceBytes(v, dtype);
  const std::vector<int64_t> slots = RandomSlots(layout, rng, count);
  const int n = static_cast<int>(slots.size());
  const std::vector<uint8_t> want = HostPack(layout, es, key, value, slots);
  const std::string what = std::string(cuda::DTypeName(dtype)) + " kv" + std::to_string(layout.num_kv_heads) + " d" +
                           std::to_string(layout.head_dim) + " bs" + std::to_string(layout.block_size) + " slots" +
                           std::to_string(n);

  test::DeviceBuffer dk = test::DeviceBuffer::From(key), dv = test::DeviceBuffer::From(value);
  test::DeviceBuffer dslots = test::DeviceBuffer::From(slots);
  test::DeviceBuffer packed(want.size());
  packed.Poison();
  KVFLOW_CUDA_OK(cuda::PackKv(dtype, dk.get(), dv.get(), dslots.get<int64_t>(), n, packed.get(), layout.num_kv_heads,
                              layout.head_dim, layout.block_size, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = packed.Download<uint8_t>();
  const size_t bad = DifferingBytes(got, want);
  std::printf("  pack   %-40s %zu of %zu bytes differ from the host model (bit-exact)%s\n", what.c_str(), bad,
              want.size(), test::IsEmulator() ? "  [emulator]" : "");
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_EQ(dk.Download<uint8_t>(), key) << what << ": packing reads the cache only";

  // Unpack into a poisoned cache: exactly the listed slots take the packed rows.
  test::DeviceBuffer uk(key.size()), uv(value.size());
  uk.Poison();
  uv.Poison();
  KVFLOW_CUDA_OK(cuda::UnpackKv(dtype, packed.get(), dslots.get<int64_t>(), n, uk.get(), uv.get(), layout.num_kv_heads,
                                layout.head_dim, layout.block_size, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> want_k(key.size(), 0xFF), want_v(value.size(), 0xFF);
  const size_t row = static_cast<size_t>(layout.head_dim) * es;
  for (int64_t slot : slots) {
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      const size_t at = layout.offset(static_cast<int>(slot / layout.block_size), h,
                                      static_cast<int>(slot % layout.block_size)) * es;
      std::memcpy(&want_k[at], &key[at], row);
      std::memcpy(&want_v[at], &value[at], row);
    }
  }
  const size_t bad_k = DifferingBytes(uk.Download<uint8_t>(), want_k);
  const size_t bad_v = DifferingBytes(uv.Download<uint8_t>(), want_v);
  std::printf("  unpack %-40s %zu + %zu bytes of K + V differ (listed slots written, the rest untouched)\n",
              what.c_str(), bad_k, bad_v);
  EXPECT_EQ(bad_k, 0u) << what;
  EXPECT_EQ(bad_v, 0u) << what;
}

TEST(KvPack, PackAndUnpackMatchTheHostModel) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(29);
  for (DType dtype : kAllDTypes) {
    RunPackRoundTrip(dtype, KvCacheLayout{1, 12, 2, 16, 128}, 150, rng);  // 16-byte words
    RunPackRoundTrip(dtype, KvCacheLayout{1, 9, 1, 8, 64}, 40, rng);      // MQA, small blocks
    RunPackRoundTrip(dtype, KvCacheLayout{1, 5, 3, 4, 6}, 17, rng);       // odd head: narrow words
    RunPackRoundTrip(dtype, KvCacheLayout{1, 4, 2, 16, 64}, 1, rng);      // one slot
  }
}

TEST(KvPack, RefusesBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer k(4096), v(4096), p(4096), s(64);
  EXPECT_NE(cuda::PackKv(DType::kF16, k.get(), v.get(), s.get<int64_t>(), -1, p.get(), 2, 64, 16, nullptr), 0);
  EXPECT_NE(cuda::PackKv(DType::kF16, k.get(), v.get(), s.get<int64_t>(), 2, p.get(), 0, 64, 16, nullptr), 0);
  EXPECT_NE(cuda::UnpackKv(DType::kF16, nullptr, s.get<int64_t>(), 2, k.get(), v.get(), 2, 64, 16, nullptr), 0);
  EXPECT_NE(cuda::PackKv(static_cast<DType>(7), k.get(), v.get(), s.get<int64_t>(), 2, p.get(), 2, 64, 16, nullptr), 0);
  // Nothing to move is not an error, whatever the pointers.
  EXPECT_EQ(cuda::PackKv(DType::kF16, k.get(), v.get(), nullptr, 0, nullptr, 2, 64, 16, nullptr), 0);
}

}  // namespace
}  // namespace kvflow
