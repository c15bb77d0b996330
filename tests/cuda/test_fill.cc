// FillUniform (kernels/fill.cu): deterministic (two runs equal, equal to a host model of the
// documented hash, independent of the buffer's alignment), plausible statistics, different seeds
// give different data.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "fill.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace {

using cuda::DType;

// Host model of the kernel's value for element i (see kernels/fill.cu).
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float HostValue(uint64_t seed, int64_t i, float scale, float offset) {
  const uint64_t h = Mix64(Mix64(seed) + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull);
  const float u = static_cast<float>(static_cast<uint32_t>(h >> 40)) * (1.0f / 8388608.0f) - 1.0f;
  return std::fma(scale, u, offset);
}

std::vector<uint8_t> Fill(DType t, int64_t count, uint64_t seed, float scale, float offset, int64_t skip = 0) {
  const size_t es = cuda::DTypeSize(t);
  test::DeviceBuffer buf(static_cast<size_t>(count + skip) * es);
  buf.Poison();
  // `skip` elements in: a buffer that is not 16-byte aligned (element-wise stores).
  const int rc = cuda::FillUniform(t, buf.get<uint8_t>() + skip * es, count, seed, scale, offset, nullptr);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> bytes = buf.Download<uint8_t>();
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<long>(skip * es));
  return bytes;
}

void CheckFill(DType t, int64_t count, float scale, float offset) {
  const std::string name = std::string(cuda::DTypeName(t)) + " scale " + std::to_string(scale) + " offset " +
                           std::to_string(offset);
  const size_t es = cuda::DTypeSize(t);
  const std::vector<uint8_t> a = Fill(t, count, 42, scale, offset);
  const std::vector<uint8_t> b = Fill(t, count, 42, scale, offset);
  EXPECT_EQ(a, b) << name << ": two runs differ";
  const std::vector<uint8_t> c = Fill(t, count, 43, scale, offset);
  size_t same = 0;
  for (size_t i = 0; i < a.size(); i += es) same += std::memcmp(&a[i], &c[i], es) == 0;
  // Equal elements by chance: rare in fp32, up to ~10% in bf16 around 0.5 +- 0.02 (few values).
  EXPECT_LT(static_cast<double>(same), (offset == 0.0f ? 0.01 : 0.2) * static_cast<double>(count))
      << name << ": seeds 42 and 43 agree too often";
  // Misaligned buffer: same values (the vector and element-wise paths agree).
  const std::vector<uint8_t> m = Fill(t, count - 1, 42, scale, offset, 1);
  EXPECT_TRUE(std::equal(m.begin(), m.end(), a.begin())) << name << ": misaligned fill differs";

  const std::vector<float> v = test::FromDeviceBytes(a, t);
  // Exactly the documented hash (the sequence benchmarks rely on), rounded to the dtype.
  std::vector<float> want(v.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = HostValue(42, static_cast<int64_t>(i), scale, offset);
  test::ToDeviceBytes(want, t);
  test::ExpectClose("fill_uniform " + name + " vs host hash model", v, want, 0.0, 0.0);

  double sum = 0.0, sq = 0.0, lo = 1e30, hi = -1e30;
  size_t non_finite = 0;
  for (float x : v) {
    if (!std::isfinite(x)) {
      ++non_finite;
      continue;
    }
    sum += x;
    sq += static_cast<double>(x) * x;
    lo = std::min(lo, static_cast<double>(x));
    hi = std::max(hi, static_cast<double>(x));
  }
  const double n = static_cast<double>(v.size());
  const double mean = sum / n, var = sq / n - mean * mean;
  const double want_var = static_cast<double>(scale) * scale / 3.0;  // uniform on [offset - scale, offset + scale)
  std::printf("  fill_uniform %-36s count %lld: mean %.6f (want %.6f)  var %.4g (want %.4g)  range [%.5f, %.5f]%s\n",
              name.c_str(), static_cast<long long>(count), mean, offset, var, want_var, lo, hi,
              test::IsEmulator() ? "  [emulator]" : "");
  EXPECT_EQ(non_finite, 0u) << name;
  // Standard error of the mean: scale / sqrt(3 count) < 2e-3 * scale; 16-bit rounding adds a little.
  EXPECT_NEAR(mean, offset, 1e-2 * scale + 1e-3 * std::fabs(offset)) << name;
  EXPECT_NEAR(var, want_var, 0.05 * want_var) << name;
  // The bounds, widened by half an ulp of the dtype (rounding may reach offset +- scale).
  const double half_ulp = (t == DType::kF32 ? 1e-7 : t == DType::kF16 ? 5e-4 : 4e-3) * (std::fabs(offset) + scale);
  EXPECT_GE(lo, offset - scale - half_ulp) << name;
  EXPECT_LE(hi, offset + scale + half_ulp) << name;
}

TEST(Fill, UniformIsDeterministicAndPlausible) {
  KVFLOW_SKIP_WITHOUT_GPU();
  const int64_t count = test::IsEmulator() ? 100003 : 10000019;  // odd: a partial last vector
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    CheckFill(t, count, 1.0f, 0.0f);
    CheckFill(t, count, 0.02f, 0.5f);
  }
}

TEST(Fill, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(64);
  EXPECT_EQ(cuda::FillUniform(DType::kF16, buf.get(), -1, 0, 1.0f, 0.0f, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::FillUniform(DType::kF16, buf.get(), 0, 0, 1.0f, 0.0f, nullptr), 0);
}

}  // namespace
}  // namespace kvflow
