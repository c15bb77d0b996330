// Row gather into fp32 (kernels/embedding.cu) against a host gather: the conversion to fp32 is
// exact, so the comparison is exact (atol = rtol = 0); out-of-range indices must give NaN rows.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "embedding.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace {

using cuda::DType;

struct GatherCase {
  int n;
  int64_t num_src_rows;
  int64_t row_pad;  // src_row_stride = n + row_pad
  int num_rows;
};

void RunGather(DType dtype, const GatherCase& c, std::mt19937& rng, float scale = 1.0f) {
  const int64_t stride = c.n + c.row_pad;
  std::vector<float> table(static_cast<size_t>(c.num_src_rows * stride));
  test::FillNormal(table, rng);
  const std::vector<uint8_t> table_bytes = test::ToDeviceBytes(table, dtype);

  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(c.num_src_rows - 1));
  std::vector<int32_t> indices(static_cast<size_t>(c.num_rows));
  for (int32_t& i : indices) i = pick(rng);
  // A few out-of-range ids (only possible through a host bug): NaN rows.
  std::vector<bool> bad(indices.size(), false);
  if (c.num_rows > 3) {
    indices[1] = -1;
    indices[static_cast<size_t>(c.num_rows - 2)] = static_cast<int32_t>(c.num_src_rows);
    bad[1] = bad[static_cast<size_t>(c.num_rows - 2)] = true;
  }

  std::vector<float> ref;
  for (size_t r = 0; r < indices.size(); ++r) {
    if (bad[r]) continue;
    const float* row = &table[static_cast<size_t>(indices[r] * stride)];
    for (int i = 0; i < c.n; ++i) ref.push_back(row[i] * scale);  // one fp32 product, as the kernel
  }

  test::DeviceBuffer d_table = test::DeviceBuffer::From(table_bytes);
  test::DeviceBuffer d_idx = test::DeviceBuffer::From(indices);
  test::DeviceBuffer d_out(static_cast<size_t>(c.num_rows) * c.n * sizeof(float));
  d_out.Poison();
  const int rc = cuda::GatherRowsToF32(dtype, d_table.get(), stride, c.num_src_rows, d_idx.get<int32_t>(), c.num_rows,
                                       c.n, d_out.get<float>(), nullptr, scale);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> out = d_out.Download<float>();

  std::vector<float> got;
  size_t nan_rows_ok = 0, nan_rows = 0;
  for (size_t r = 0; r < indices.size(); ++r) {
    const float* row = &out[r * static_cast<size_t>(c.n)];
    if (bad[r]) {
      ++nan_rows;
      bool all_nan = true;
      for (int i = 0; i < c.n; ++i) all_nan = all_nan && std::isnan(row[i]);
      nan_rows_ok += all_nan;
      continue;
    }
    got.insert(got.end(), row, row + c.n);
  }
  EXPECT_EQ(nan_rows_ok, nan_rows) << "out-of-range indices must write NaN rows";
  test::ExpectClose(std::string("gather ") + cuda::DTypeName(dtype) + " n" + std::to_string(c.n) + " stride" +
                        std::to_string(stride) + " rows" + std::to_string(c.num_rows) +
                        (scale != 1.0f ? " scale " + std::to_string(scale) : ""),
                    got, ref, 0.0, 0.0);
}

TEST(Embedding, GatherRowsToF32AllDTypes) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  const GatherCase cases[] = {
      {576, 300, 0, 37},    // SmolLM2 hidden size
      {4096, 64, 0, 9},     // 4 chunks per row
      {1000, 50, 8, 21},    // padded rows
      {65, 40, 0, 33},      // odd: element-wise path
      {2500, 20, 3, 5},     // odd stride: element-wise path, partial last chunk
  };
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const GatherCase& c : cases) RunGather(dtype, c, rng);
  }
}

// Gemma's scaled embeddings: sqrt(2304) = 48 and sqrt(3584), each element one fp32 product.
// A vocabulary shard (tensor parallelism): rows [first, first + rows) of a larger table; ids of the
// other ranks' rows give zero rows, and the shards' outputs summed are the whole table's gather.
TEST(Embedding, GatherRowsToF32OverShardsSumsToTheWholeTable) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(0x73686172);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const int n : {64, 72}) {  // vectorized and scalar paths
      const int64_t vocab = 259;
      std::vector<float> table(static_cast<size_t>(vocab * n));
      test::FillNormal(table, rng);
      const std::vector<uint8_t> bytes = test::ToDeviceBytes(table, dtype);
      const size_t elem = bytes.size() / table.size();
      std::vector<int32_t> indices;
      std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
      for (int i = 0; i < 40; ++i) indices.push_back(pick(rng));
      indices[0] = 0;
      indices[1] = static_cast<int32_t>(vocab - 1);
      test::DeviceBuffer d_idx = test::DeviceBuffer::From(indices);
      std::vector<float> sum(indices.size() * n, 0.0f);
      const int64_t firsts[] = {0, 86, 173, vocab};  // three shards of 86, 87, 86 rows
      for (int s = 0; s < 3; ++s) {
        const int64_t first = firsts[s], rows = firsts[s + 1] - first;
        const std::vector<uint8_t> shard(bytes.begin() + first * n * elem, bytes.begin() + (first + rows) * n * elem);
        test::DeviceBuffer d_table = test::DeviceBuffer::From(shard);
        test::DeviceBuffer d_out(indices.size() * n * sizeof(float));
        d_out.Poison();
        KVFLOW_CUDA_OK(cuda::GatherRowsToF32(dtype, d_table.get(), n, rows, d_idx.get<int32_t>(),
                                             static_cast<int>(indices.size()), n, d_out.get<float>(), nullptr, 0.5f,
                                             first));
        KVFLOW_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> out = d_out.Download<float>();
        for (size_t r = 0; r < indices.size(); ++r) {
          const bool mine = indices[r] >= first && indices[r] < first + rows;
          for (int i = 0; i < n; ++i) {
            const float v = out[r * n + static_cast<size_t>(i)];
            if (!mine) ASSERT_EQ(v, 0.0f) << "another shard's token, row " << r;
            sum[r * n + static_cast<size_t>(i)] += v;
          }
        }
      }
      std::vector<float> whole_table = test::FromDeviceBytes(bytes, dtype);
      std::vector<float> ref;
      for (int32_t index : indices) {
        for (int i = 0; i < n; ++i) ref.push_back(whole_table[static_cast<size_t>(index) * n + i] * 0.5f);
      }
      test::ExpectClose(std::string("sharded gather ") + cuda::DTypeName(dtype) + " n" + std::to_string(n), sum, ref,
                        0.0, 0.0);
    }
  }
}

TEST(Embedding, GatherRowsToF32Scaled) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    RunGather(dtype, {2304, 30, 0, 11}, rng, std::sqrt(2304.0f));
    RunGather(dtype, {65, 40, 0, 33}, rng, std::sqrt(3584.0f));
  }
}

TEST(Embedding, GatherRejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  EXPECT_EQ(cuda::GatherRowsToF32(DType::kF16, buf.get(), 8, 4, buf.get<int32_t>(), 1, 16, buf.get<float>(), nullptr),
            cuda::kInvalidValue);  // rows overlap (stride < n)
  EXPECT_EQ(cuda::GatherRowsToF32(DType::kF16, buf.get(), 16, 4, buf.get<int32_t>(), -1, 16, buf.get<float>(),
                                  nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::GatherRowsToF32(DType::kF16, buf.get(), 16, 4, buf.get<int32_t>(), 0, 16, buf.get<float>(), nullptr),
            0);
}

}  // namespace
}  // namespace kvflow
