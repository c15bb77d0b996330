// KV-cache kernels (kernels/cache_ops.cu) against the CPU reference: reshape_and_cache vs
// cpu::WriteKvCache, gather_slots and copy_blocks vs host memcpy models. Both are copies, so every comparison is
// bit-exact, including the NaN poison of every element the kernel must not touch.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/paged_attention.h"
#include "cache_ops.h"
#include "gpu_test_util.h"
#include "kv/kv_cache_layout.h"

namespace kvflow {
namespace {

using cuda::DType;

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

// The bytes a cache of `dtype` must hold: the reference values (exactly representable: they were
// rounded by ToDeviceBytes), and 0xFF poison wherever the reference is NaN (not written).
std::vector<uint8_t> ExpectedCacheBytes(const std::vector<float>& ref, DType dtype) {
  const size_t es = cuda::DTypeSize(dtype);
  std::vector<uint8_t> bytes(ref.size() * es, 0xFF);
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) continue;
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &ref[i], 4);
    } else {
      const uint16_t b = test::FloatToBits(ref[i], dtype);
      std::memcpy(&bytes[i * 2], &b, 2);
    }
  }
  return bytes;
}

// Elements (not bytes) that differ; prints the line every test reports.
size_t CountMismatches(const std::string& what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                       size_t elem_size) {
  size_t bad = 0, written = 0;
  for (size_t i = 0; i + elem_size <= want.size(); i += elem_size) {
    bool poison = true;
    for (size_t b = 0; b < elem_size; ++b) poison = poison && want[i + b] == 0xFF;
    written += !poison;
    bad += i + elem_size > got.size() || std::memcmp(&got[i], &want[i], elem_size) != 0;
  }
  std::printf("  %-60s %zu of %zu elements differ (bit-exact check; %zu hold data, %zu poison)%s\n", what.c_str(),
              bad, want.size() / elem_size, written, want.size() / elem_size - written,
              test::IsEmulator() ? "  [emulator]" : "");
  return bad;
}

struct CacheCase {
  int num_kv_heads;
  int head_dim;
  int block_size;
  int num_q_heads;  // Q heads in front of K in the fused row
  int row_pad;      // extra elements at the end of each fused row
};

// One batch of sequences with random (shuffled) blocks; padding tokens (slot -1) interleaved.
struct PagedBatch {
  ForwardBatch batch;           // the real tokens only (what the CPU reference sees)
  std::vector<int64_t> slots;   // per device token, -1 for padding
  std::vector<int> real_index;  // per device token: index into batch.tokens, or -1
};

PagedBatch MakeBatch(const KvCacheLayout& layout, const std::vector<int>& lens, std::mt19937& rng) {
  PagedBatch pb;
  std::vector<BlockId> pool(static_cast<size_t>(layout.num_blocks));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  int pad_counter = 0;
  for (int len : lens) {
    SequenceSlice s;
    s.token_offset = static_cast<int32_t>(pb.batch.tokens.size());
    s.num_tokens = len;
    s.context_len = len;
    const int nb = (len + layout.block_size - 1) / layout.block_size;
    s.block_table.assign(pool.begin() + static_cast<long>(next), pool.begin() + static_cast<long>(next + nb));
    next += static_cast<size_t>(nb);
    for (int t = 0; t < len; ++t) {
      if (++pad_counter % 7 == 3) {  // a padding token now and then
        pb.slots.push_back(-1);
        pb.real_index.push_back(-1);
      }
      pb.real_index.push_back(static_cast<int>(pb.batch.tokens.size()));
      pb.batch.tokens.push_back(0);
      pb.batch.positions.push_back(t);
      pb.slots.push_back(static_cast<int64_t>(s.block_table[static_cast<size_t>(t / layout.block_size)]) *
                             layout.block_size +
                         t % layout.block_size);
    }
    pb.batch.seqs.push_back(s);
  }
  pb.slots.push_back(-1);  // trailing padding
  pb.real_index.push_back(-1);
  return pb;
}

void RunReshapeAndCache(DType dtype, const CacheCase& c, std::mt19937& rng) {
  const int D = c.head_dim, KV = c.num_kv_heads;
  const std::vector<int> lens = {1, 13, 40, 77};
  int blocks_needed = 0;
  for (int len : lens) blocks_needed += (len + c.block_size - 1) / c.block_size;
  KvCacheLayout layout{1, blocks_needed + 5, KV, c.block_size, D};
  const PagedBatch pb = MakeBatch(layout, lens, rng);
  const int num_dev_tokens = static_cast<int>(pb.slots.size());

  // Fused QKV rows: [Q heads | K heads | V heads | pad].
  const int64_t row_stride = static_cast<int64_t>(c.num_q_heads + 2 * KV) * D + c.row_pad;
  const int64_t k_off = static_cast<int64_t>(c.num_q_heads) * D, v_off = k_off + static_cast<int64_t>(KV) * D;
  std::vector<float> qkv(static_cast<size_t>(num_dev_tokens * row_stride));
  test::FillNormal(qkv, rng);
  const std::vector<uint8_t> qkv_bytes = test::ToDeviceBytes(qkv, dtype);

  // CPU reference on the real tokens, dense [tokens, KV, D].
  const size_t n = static_cast<size_t>(KV) * D;
  std::vector<float> k(pb.batch.tokens.size() * n), v(pb.batch.tokens.size() * n);
  for (int t = 0; t < num_dev_tokens; ++t) {
    if (pb.real_index[t] < 0) continue;
    const float* row = &qkv[static_cast<size_t>(t * row_stride)];
    std::copy(row + k_off, row + k_off + n, &k[static_cast<size_t>(pb.real_index[t]) * n]);
    std::copy(row + v_off, row + v_off + n, &v[static_cast<size_t>(pb.real_index[t]) * n]);
  }
  std::vector<float> ref_k(layout.layer_stride(), NAN), ref_v(layout.layer_stride(), NAN);
  cpu::WriteKvCache(pb.batch, layout, k.data(), v.data(), ref_k.data(), ref_v.data());

  const size_t es = cuda::DTypeSize(dtype);
  test::DeviceBuffer d_qkv = test::DeviceBuffer::From(qkv_bytes);
  test::DeviceBuffer d_slots = test::DeviceBuffer::From(pb.slots);
  test::DeviceBuffer d_kc(layout.layer_stride() * es), d_vc(layout.layer_stride() * es);
  d_kc.Poison();
  d_vc.Poison();
  const uint8_t* base = d_qkv.get<uint8_t>();
  const int rc = cuda::ReshapeAndCache(dtype, base + k_off * es, row_stride, base + v_off * es, row_stride,
                                       d_kc.get(), d_vc.get(), d_slots.get<int64_t>(), num_dev_tokens, KV, D,
                                       c.block_size, nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());

  const std::string what = std::string("reshape_and_cache ") + cuda::DTypeName(dtype) + " kv" + std::to_string(KV) +
                           " d" + std::to_string(D) + " bs" + std::to_string(c.block_size) + " stride" +
                           std::to_string(row_stride);
  EXPECT_EQ(CountMismatches(what + " K", d_kc.Download<uint8_t>(), ExpectedCacheBytes(ref_k, dtype), es), 0u);
  EXPECT_EQ(CountMismatches(what + " V", d_vc.Download<uint8_t>(), ExpectedCacheBytes(ref_v, dtype), es), 0u);
  // The source rows are read-only.
  EXPECT_EQ(d_qkv.Download<uint8_t>(), qkv_bytes) << what;
}

TEST(CacheOps, ReshapeAndCacheFusedQkvAllDTypes) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(1234);
  const CacheCase cases[] = {
      {2, 128, 16, 4, 0},  // 16-byte words
      {1, 64, 8, 2, 0},    // MQA
      {4, 128, 32, 8, 8},  // padded fused rows (still 16-byte aligned in fp16/fp32)
      {3, 36, 16, 3, 0},   // head_dim * elem_size = 72 / 144 bytes: 8 / 16-byte words
      {2, 33, 16, 2, 1},   // odd head_dim and stride: element-sized words
  };
  for (DType dtype : kAllDTypes) {
    for (const CacheCase& c : cases) RunReshapeAndCache(dtype, c, rng);
  }
}

// The fp32 launcher kept from issue 2: dense K and V rows.
TEST(CacheOps, ReshapeAndCacheF32MatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  for (int block_size : {8, 16, 32}) {
    KvCacheLayout layout{1, 37, 3, block_size, 64};
    const PagedBatch pb = MakeBatch(layout, {1, 13, 40, 77}, rng);
    // This launcher has no padding concept in its test: keep the real tokens only.
    std::vector<int64_t> slots;
    for (int64_t s : pb.slots) {
      if (s >= 0) slots.push_back(s);
    }
    const size_t rows = pb.batch.tokens.size() * layout.num_kv_heads * layout.head_dim;
    std::vector<float> k(rows), v(rows);
    test::FillNormal(k, rng);
    test::FillNormal(v, rng);
    std::vector<float> ref_k(layout.layer_stride(), NAN), ref_v(layout.layer_stride(), NAN);
    cpu::WriteKvCache(pb.batch, layout, k.data(), v.data(), ref_k.data(), ref_v.data());

    test::DeviceBuffer dk = test::DeviceBuffer::From(k), dv = test::DeviceBuffer::From(v);
    test::DeviceBuffer dslots = test::DeviceBuffer::From(slots);
    test::DeviceBuffer dkc(layout.layer_stride() * 4), dvc(layout.layer_stride() * 4);
    dkc.Poison();
    dvc.Poison();
    const int rc = cuda::ReshapeAndCacheF32(dk.get<float>(), dv.get<float>(), dkc.get<float>(), dvc.get<float>(),
                                            dslots.get<int64_t>(), static_cast<int>(slots.size()),
                                            layout.num_kv_heads, layout.head_dim, block_size, nullptr);
    KVFLOW_CUDA_OK(rc);
    KVFLOW_CUDA_OK(cudaDeviceSynchronize());
    const std::string what = "reshape_and_cache_f32 bs" + std::to_string(block_size);
    EXPECT_EQ(CountMismatches(what + " K", dkc.Download<uint8_t>(), ExpectedCacheBytes(ref_k, DType::kF32), 4), 0u);
    EXPECT_EQ(CountMismatches(what + " V", dvc.Download<uint8_t>(), ExpectedCacheBytes(ref_v, DType::kF32), 4), 0u);
  }
}

TEST(CacheOps, ReshapeAndCacheRejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096), slots(64);
  void* p = buf.get();
  const int64_t* s = slots.get<int64_t>();
  EXPECT_EQ(cuda::ReshapeAndCache(DType::kF16, p, 64, p, 64, p, p, s, 1, 1, 0, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ReshapeAndCache(DType::kF16, p, 64, p, 64, p, p, s, 1, 1, 64, 0, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ReshapeAndCache(DType::kF16, p, 63, p, 64, p, p, s, 1, 1, 64, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::ReshapeAndCache(static_cast<DType>(7), p, 64, p, 64, p, p, s, 1, 1, 64, 16, nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::ReshapeAndCache(DType::kF16, p, 64, p, 64, p, p, s, 0, 1, 64, 16, nullptr), 0);  // no tokens
  EXPECT_EQ(cuda::CopyBlocks(DType::kF16, p, p, 1, 64, 0, slots.get<int32_t>(), 1, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::CopyBlocks(DType::kF16, p, p, 1, 32, 64, slots.get<int32_t>(), 1, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::CopyBlocks(DType::kF16, p, p, 1, 64, 64, slots.get<int32_t>(), 0, nullptr), 0);  // no pairs
}

// gather_slots: the slots of several KV views (sinks + window of a sequence, a shuffled subset with
// a repeated slot, a single token), each starting on a block boundary of the destination with -1
// padding up to it, as the CUDA backend lays out its gather scratch. Host model: memcpy of each
// head row; padding slots keep the poison; the source cache is read-only.
void RunGatherSlots(DType dtype, const KvCacheLayout& layout, std::mt19937& rng) {
  const size_t es = cuda::DTypeSize(dtype);
  const int bs = layout.block_size, KV = layout.num_kv_heads, D = layout.head_dim;
  std::vector<float> key(layout.layer_stride()), value(layout.layer_stride());
  test::FillNormal(key, rng);
  test::FillNormal(value, rng);
  const std::vector<uint8_t> key_bytes = test::ToDeviceBytes(key, dtype);
  const std::vector<uint8_t> value_bytes = test::ToDeviceBytes(value, dtype);

  std::vector<BlockId> table(static_cast<size_t>(layout.num_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  const int32_t context = layout.num_blocks * bs - 3;
  std::vector<std::vector<int64_t>> views;
  views.push_back(KvView::SinksAndWindow(table, context, 4, 2 * bs + 5, bs).slots);
  std::vector<int64_t> subset(static_cast<size_t>(context));
  std::iota(subset.begin(), subset.end(), 0);
  std::shuffle(subset.begin(), subset.end(), rng);
  subset.resize(static_cast<size_t>(3 * bs + 1));
  subset.push_back(subset.front());  // a slot twice
  views.push_back(subset);
  views.push_back({static_cast<int64_t>(table[1]) * bs + bs - 1});
  std::vector<int64_t> slots;
  for (const auto& v : views) {
    slots.insert(slots.end(), v.begin(), v.end());
    while (slots.size() % static_cast<size_t>(bs) != 0) slots.push_back(-1);
  }
  const int num_slots = static_cast<int>(slots.size());

  // Host model: destination block i / bs, offset i % bs gets source slot slots[i], head by head.
  const size_t dst_elems = static_cast<size_t>(num_slots / bs) * layout.block_stride();
  std::vector<uint8_t> want_k(dst_elems * es, 0xFF), want_v(dst_elems * es, 0xFF);
  const size_t row_bytes = static_cast<size_t>(D) * es;
  for (int i = 0; i < num_slots; ++i) {
    const int64_t src = slots[static_cast<size_t>(i)];
    if (src < 0) continue;
    for (int h = 0; h < KV; ++h) {
      const size_t from = layout.offset(static_cast<int>(src / bs), h, static_cast<int>(src % bs)) * es;
      const size_t to = (static_cast<size_t>(i / bs) * layout.block_stride() +
                         (static_cast<size_t>(h) * bs + static_cast<size_t>(i % bs)) * D) * es;
      std::memcpy(&want_k[to], &key_bytes[from], row_bytes);
      std::memcpy(&want_v[to], &value_bytes[from], row_bytes);
    }
  }

  test::DeviceBuffer dk = test::DeviceBuffer::From(key_bytes), dv = test::DeviceBuffer::From(value_bytes);
  test::DeviceBuffer dslots = test::DeviceBuffer::From(slots);
  test::DeviceBuffer gk(dst_elems * es), gv(dst_elems * es);
  gk.Poison();
  gv.Poison();
  const int rc = cuda::GatherSlots(dtype, dk.get(), dv.get(), dslots.get<int64_t>(), num_slots, gk.get(), gv.get(), KV,
                                   D, bs, nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::string what = std::string("gather_slots ") + cuda::DTypeName(dtype) + " kv" + std::to_string(KV) + " d" +
                           std::to_string(D) + " bs" + std::to_string(bs) + " slots" + std::to_string(num_slots);
  EXPECT_EQ(CountMismatches(what + " K", gk.Download<uint8_t>(), want_k, es), 0u);
  EXPECT_EQ(CountMismatches(what + " V", gv.Download<uint8_t>(), want_v, es), 0u);
  EXPECT_EQ(dk.Download<uint8_t>(), key_bytes) << what << ": the cache is read-only";
  EXPECT_EQ(dv.Download<uint8_t>(), value_bytes) << what << ": the cache is read-only";
}

TEST(CacheOps, GatherSlotsMatchesHostModel) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(2024);
  for (DType dtype : kAllDTypes) {
    RunGatherSlots(dtype, KvCacheLayout{1, 12, 2, 16, 128}, rng);  // 16-byte words
    RunGatherSlots(dtype, KvCacheLayout{1, 9, 1, 8, 64}, rng);     // MQA, small blocks
    RunGatherSlots(dtype, KvCacheLayout{1, 6, 3, 32, 36}, rng);    // 72 / 144-byte heads: 8 / 16-byte words
    RunGatherSlots(dtype, KvCacheLayout{1, 7, 2, 8, 33}, rng);     // odd head_dim: element-sized words
  }
}

TEST(CacheOps, GatherSlotsRejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096), slots = test::DeviceBuffer::From(std::vector<int64_t>{0});
  void* p = buf.get();
  const int64_t* s = slots.get<int64_t>();
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, s, 1, p, p, 0, 64, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, s, 1, p, p, 1, 0, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, s, 1, p, p, 1, 64, 0, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, s, -1, p, p, 1, 64, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, nullptr, 1, p, p, 1, 64, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(static_cast<DType>(7), p, p, s, 1, p, p, 1, 64, 16, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherSlots(DType::kF16, p, p, s, 0, p, p, 1, 64, 16, nullptr), 0);  // nothing to gather
}

// copy_blocks: random disjoint (src, dst) pairs, some sources copied to several destinations (a
// fork into several children), over every layer of both pools; everything else must stay as it was.
void RunCopyBlocks(DType dtype, const KvCacheLayout& layout, int num_pairs, std::mt19937& rng) {
  const size_t es = cuda::DTypeSize(dtype);
  const size_t pool_elems = layout.layer_stride() * static_cast<size_t>(layout.num_layers);
  std::vector<float> key(pool_elems), value(pool_elems);
  test::FillNormal(key, rng);
  test::FillNormal(value, rng);
  const std::vector<uint8_t> key_bytes = test::ToDeviceBytes(key, dtype);
  const std::vector<uint8_t> value_bytes = test::ToDeviceBytes(value, dtype);

  std::vector<int32_t> perm(static_cast<size_t>(layout.num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int num_src = std::max(1, num_pairs * 2 / 3);
  ASSERT_LE(num_src + num_pairs, layout.num_blocks);
  std::vector<int32_t> pairs;
  for (int i = 0; i < num_pairs; ++i) {
    pairs.push_back(perm[static_cast<size_t>(i % num_src)]);            // sources: the first num_src blocks
    pairs.push_back(perm[static_cast<size_t>(num_src + i)]);            // destinations: distinct, disjoint
  }

  // Host model.
  std::vector<uint8_t> want_k = key_bytes, want_v = value_bytes;
  const size_t block_bytes = layout.block_stride() * es, layer_bytes = layout.layer_stride() * es;
  for (int l = 0; l < layout.num_layers; ++l) {
    for (int i = 0; i < num_pairs; ++i) {
      const size_t src = l * layer_bytes + static_cast<size_t>(pairs[2 * i]) * block_bytes;
      const size_t dst = l * layer_bytes + static_cast<size_t>(pairs[2 * i + 1]) * block_bytes;
      std::memcpy(&want_k[dst], &key_bytes[src], block_bytes);
      std::memcpy(&want_v[dst], &value_bytes[src], block_bytes);
    }
  }

  test::DeviceBuffer dk = test::DeviceBuffer::From(key_bytes), dv = test::DeviceBuffer::From(value_bytes);
  test::DeviceBuffer dpairs = test::DeviceBuffer::From(pairs);
  const int rc = cuda::CopyBlocks(dtype, dk.get(), dv.get(), layout.num_layers,
                                  static_cast<int64_t>(layout.layer_stride()),
                                  static_cast<int64_t>(layout.block_stride()), dpairs.get<int32_t>(), num_pairs,
                                  nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::string what = std::string("copy_blocks ") + cuda::DTypeName(dtype) + " layers" +
                           std::to_string(layout.num_layers) + " block_stride" +
                           std::to_string(layout.block_stride()) + " pairs" + std::to_string(num_pairs);
  EXPECT_EQ(CountMismatches(what + " K", dk.Download<uint8_t>(), want_k, es), 0u);
  EXPECT_EQ(CountMismatches(what + " V", dv.Download<uint8_t>(), want_v, es), 0u);
}

TEST(CacheOps, CopyBlocksAllLayersBothPools) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  for (DType dtype : kAllDTypes) {
    RunCopyBlocks(dtype, KvCacheLayout{3, 24, 2, 16, 64}, 7, rng);   // 16-byte words
    RunCopyBlocks(dtype, KvCacheLayout{2, 12, 1, 8, 128}, 1, rng);   // a single pair
    RunCopyBlocks(dtype, KvCacheLayout{2, 10, 3, 5, 33}, 4, rng);    // odd block_stride: element words
  }
}

}  // namespace
}  // namespace kvflow
