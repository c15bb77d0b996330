// SiluAndMul and GeluTanhAndMul (kernels/activation.cu) against cpu::SiluMul and cpu::GeluTanhMul on
// the same (dtype-rounded) inputs.
// Tolerances (atol = rtol * max|ref|):
//   fp32: 1e-5 (expf within an ulp or two of glibc's; the rest is the same fp32 expression)
//   fp16: 1e-3, bf16: 8e-3 (one rounding of the output)
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "activation.h"
#include "backend/cpu/cpu_ops.h"
#include "gpu_test_util.h"

namespace kvflow {
namespace {

using cuda::DType;

void RunGated(DType t, int rows, int n, bool gelu, std::mt19937& rng) {
  std::vector<float> gate_up(static_cast<size_t>(rows) * 2 * n);
  test::FillNormal(gate_up, rng, 3.0f);
  // Saturated gates (exp(-g) overflows to inf for g = -100: silu gives -0, not NaN), kept within
  // the normal range of |silu| so that they do not dominate max|ref| and loosen atol.
  if (n > 4) {
    gate_up[0] = -100.0f;
    gate_up[1] = 12.0f;
    gate_up[2] = -20.0f;
    gate_up[3] = -88.0f;
  }
  const std::vector<uint8_t> bytes = test::ToDeviceBytes(gate_up, t);
  std::vector<float> ref(static_cast<size_t>(rows) * n);
  if (gelu) {
    cpu::GeluTanhMul(gate_up.data(), ref.data(), rows, n);
  } else {
    cpu::SiluMul(gate_up.data(), ref.data(), rows, n);
  }

  test::DeviceBuffer din = test::DeviceBuffer::From(bytes), dout(ref.size() * cuda::DTypeSize(t));
  dout.Poison();
  const int rc = gelu ? cuda::GeluTanhAndMul(t, din.get(), dout.get(), rows, n, nullptr)
                      : cuda::SiluAndMul(t, din.get(), dout.get(), rows, n, nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const double rtol = t == DType::kF32 ? 1e-5 : t == DType::kF16 ? 1e-3 : 8e-3;
  double scale = 0.0;
  for (float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
  test::ExpectClose(std::string(gelu ? "gelu_tanh_and_mul " : "silu_and_mul ") + cuda::DTypeName(t) + " rows" + std::to_string(rows) + " n" +
                        std::to_string(n),
                    test::FromDeviceBytes(dout.Download<uint8_t>(), t), ref, rtol * scale, rtol);
}

TEST(Activation, SiluAndMulMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(41);
  struct Shape {
    int rows, n;
  };
  // SmolLM2 (1536), Llama-7B (11008), Llama-3-8B (14336), and odd sizes (element-wise path).
  const std::vector<Shape> shapes =
      test::IsEmulator() ? std::vector<Shape>{{64, 1536}, {8, 11008}, {16, 4096}, {67, 1000}, {100, 65}, {2, 14336}}
                         : std::vector<Shape>{{257, 1536}, {64, 11008}, {128, 14336}, {300, 1000}, {33, 65}, {1, 4096}};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const Shape& s : shapes) RunGated(t, s.rows, s.n, /*gelu=*/false, rng);
  }
}

TEST(Activation, GeluTanhAndMulMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(42);
  // Gemma-2 2B (9216), Gemma-3 1B (6912), and odd sizes (element-wise path).
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    RunGated(t, 16, 9216, /*gelu=*/true, rng);
    RunGated(t, 9, 6912, /*gelu=*/true, rng);
    RunGated(t, 33, 65, /*gelu=*/true, rng);
  }
}

TEST(Activation, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  EXPECT_EQ(cuda::SiluAndMul(DType::kF16, buf.get(), buf.get(), 1, 0, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SiluAndMul(static_cast<DType>(3), buf.get(), buf.get(), 1, 8, nullptr), cuda::kInvalidValue);
  EXPECT_EQ(cuda::SiluAndMul(DType::kF16, buf.get(), buf.get(), 0, 8, nullptr), 0);
  EXPECT_EQ(cuda::GeluTanhAndMul(DType::kF16, buf.get(), buf.get(), 1, 0, nullptr), cuda::kInvalidValue);
}

}  // namespace
}  // namespace kvflow
