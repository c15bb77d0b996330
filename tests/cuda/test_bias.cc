// AddBias (kernels/bias.cu) against cpu::AddBias on fresh random inputs: the product rows in the
// device dtype (the CPU reference adds to the same rounded values), fp32 biases.
// Tolerances: fp32 exact (the same single fp32 add); fp16 / bf16: one rounding of the sum, half an
// ulp of |y + b| (2^-11 and 2^-8 relative).
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "bias.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace {

using cuda::DType;

void RunAddBias(DType t, int rows, int n, std::mt19937& rng) {
  std::vector<float> y(static_cast<size_t>(rows) * n), bias(static_cast<size_t>(n));
  test::FillNormal(y, rng, 2.0f);
  test::FillNormal(bias, rng, 0.7f);
  const std::vector<uint8_t> bytes = test::ToDeviceBytes(y, t);  // rounds y to what the device holds
  std::vector<float> ref = y;
  cpu::AddBias(ref.data(), bias.data(), rows, n);

  test::DeviceBuffer dy = test::DeviceBuffer::From(bytes);
  test::DeviceBuffer dbias = test::DeviceBuffer::From(test::ToDeviceBytes(bias, DType::kF32));
  KVFLOW_CUDA_OK(cuda::AddBias(t, dy.get(), static_cast<const float*>(dbias.get()), rows, n, nullptr));
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = test::FromDeviceBytes(dy.Download<uint8_t>(), t);
  const double rtol = t == DType::kF32 ? 0.0 : t == DType::kF16 ? 0x1p-11 : 0x1p-8;
  double worst = 0.0, max_abs = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(got[i]) - ref[i]);
    max_abs = std::max(max_abs, d);
    // Half an ulp of the result (relative to it; subnormal-free at these magnitudes but for ~0).
    worst = std::max(worst, d / std::max(std::fabs(double(ref[i])), 1e-3));
    if (!(d <= rtol * std::fabs(double(ref[i])) + 1e-7)) {
      ADD_FAILURE() << DTypeName(t) << " rows " << rows << " n " << n << " at " << i << ": got " << got[i]
                    << " want " << ref[i];
      return;
    }
  }
  std::printf("  add_bias %-4s rows %4d n %5d: max|d| = %.3g  max rel = %.3g (bound %.3g)%s\n", DTypeName(t), rows,
              n, max_abs, worst, rtol, test::IsEmulator() ? "  [emulator]" : "");
}

TEST(Bias, AddBiasMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(43);
  struct Shape {
    int rows, n;
  };
  // Fused q|k|v widths of tiny-random (256) and SmolLM2 (960 + 2 * 320), gate|up, odd sizes.
  const std::vector<Shape> shapes = test::IsEmulator()
                                        ? std::vector<Shape>{{7, 256}, {3, 1600}, {5, 3072}, {33, 65}, {1, 1}}
                                        : std::vector<Shape>{{257, 256}, {64, 1600}, {300, 11008}, {33, 65}, {1, 1}};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const Shape& s : shapes) RunAddBias(t, s.rows, s.n, rng);
  }
}

TEST(Bias, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  const float* bias = static_cast<const float*>(buf.get());
  EXPECT_EQ(cuda::AddBias(DType::kF16, buf.get(), bias, 1, 0, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::AddBias(DType::kF16, buf.get(), bias, -1, 8, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::AddBias(DType::kF16, buf.get(), nullptr, 1, 8, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::AddBias(static_cast<DType>(3), buf.get(), bias, 1, 8, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::AddBias(DType::kF16, buf.get(), bias, 0, 8, nullptr), 0);
}

}  // namespace
}  // namespace kvflow
