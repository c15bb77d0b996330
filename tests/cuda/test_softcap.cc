// SoftCap (kernels/softcap.cu) against the CPU backend's expression, cap * tanh(x / cap) in fp32,
// on fresh random logits spread well past the cap (the cap changes them) and saturating ones.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "softcap.h"

namespace kvflow {
namespace {

TEST(SoftCap, MatchesCpuExpression) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(51);
  for (const auto& [n, cap] : {std::pair<int64_t, float>{1000, 30.0f}, {256 * 1031 + 7, 30.0f}, {17, 2.5f}}) {
    std::vector<float> x(static_cast<size_t>(n));
    test::FillNormal(x, rng, 2.0f * cap);
    x[0] = 1e30f;   // saturates at cap
    x[1] = -1e30f;  // and at -cap
    std::vector<float> ref(x.size());
    for (size_t i = 0; i < x.size(); ++i) ref[i] = cap * std::tanh(x[i] / cap);
    test::DeviceBuffer d = test::DeviceBuffer::From(x);
    KVFLOW_CUDA_OK(cuda::SoftCap(d.get<float>(), n, cap, nullptr));
    KVFLOW_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = d.Download<float>();
    // tanhf and x * (1 / cap) against x / cap: a few ulps of cap.
    test::ExpectClose("softcap n" + std::to_string(n) + " cap" + std::to_string(cap), got, ref, 4e-6 * cap, 1e-5);
    EXPECT_EQ(got[0], cap);
    EXPECT_EQ(got[1], -cap);
  }
}

TEST(SoftCap, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer d(64);
  EXPECT_EQ(cuda::SoftCap(d.get<float>(), 4, 0.0f, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SoftCap(d.get<float>(), 4, -1.0f, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SoftCap(d.get<float>(), -1, 30.0f, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SoftCap(nullptr, 0, 30.0f, nullptr), 0);
}

}  // namespace
}  // namespace kvflow
