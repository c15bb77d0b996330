// RMSNorm kernels (kernels/rms_norm.cu) against cpu::RmsNorm on the same (dtype-rounded) inputs.
// Tolerances, relative to the reference (atol = rtol * max|ref|):
//   fp32: 1e-5   (only the summation order differs: a few ulp)
//   fp16: 1e-3   (one rounding of the output: 2^-11 relative, plus fp32 noise)
//   bf16: 8e-3   (one rounding of the output: 2^-8 relative)
// The residual update of FusedAddRmsNorm / AddToResidual is one fp32 add: exact.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "gpu_test_util.h"
#include "rms_norm.h"

namespace kvflow {
namespace {

using cuda::DType;

constexpr DType kAllDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr float kEps = 1e-5f;

double OutputRtol(DType t) { return t == DType::kF32 ? 1e-5 : t == DType::kF16 ? 1e-3 : 8e-3; }

void CheckOutput(const std::string& what, const std::vector<float>& got, const std::vector<float>& ref, DType t) {
  double scale = 0.0;
  for (float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
  test::ExpectClose(what, got, ref, OutputRtol(t) * scale, OutputRtol(t));
}

// Rows with very different magnitudes (the norm must not care), random weights around 1.
std::vector<float> RandomRows(int rows, int n, std::mt19937& rng) {
  std::vector<float> x(static_cast<size_t>(rows) * n);
  test::FillNormal(x, rng);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  for (int r = 0; r < rows; ++r) {
    const float s = std::pow(10.0f, log_scale(rng));
    for (int i = 0; i < n; ++i) x[static_cast<size_t>(r) * n + i] *= s;
  }
  return x;
}
std::vector<float> RandomWeight(int n, std::mt19937& rng) {
  std::vector<float> w(static_cast<size_t>(n));
  std::normal_distribution<float> normal(1.0f, 0.3f);
  for (float& v : w) v = normal(rng);
  return w;
}

std::string Name(const char* op, DType t, int rows, int n) {
  return std::string(op) + " " + cuda::DTypeName(t) + " rows" + std::to_string(rows) + " n" + std::to_string(n);
}

struct Shape {
  int rows, n;
};
// SmolLM2 (576), Llama-7B (4096), and odd sizes that take the element-wise path (65, 1001).
std::vector<Shape> Shapes() {
  if (test::IsEmulator()) return {{200, 576}, {48, 4096}, {4, 8192}, {67, 1000}, {300, 65}, {9, 1001}};
  return {{257, 576}, {300, 4096}, {64, 8192}, {129, 1000}, {100, 65}, {31, 1001}};
}

TEST(RmsNorm, MatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(21);
  for (DType t : kAllDTypes) {
    for (const Shape& s : Shapes()) {
      std::vector<float> x = RandomRows(s.rows, s.n, rng);
      std::vector<float> w = RandomWeight(s.n, rng);
      const std::vector<uint8_t> w_bytes = test::ToDeviceBytes(w, t);
      std::vector<float> ref(x.size());
      cpu::RmsNorm(x.data(), w.data(), ref.data(), s.rows, s.n, kEps);

      test::DeviceBuffer dx = test::DeviceBuffer::From(x), dw = test::DeviceBuffer::From(w_bytes);
      test::DeviceBuffer dout(x.size() * cuda::DTypeSize(t));
      dout.Poison();
      const int rc = cuda::RmsNorm(t, dx.get<float>(), dw.get(), dout.get(), s.rows, s.n, kEps, nullptr);
      KVFLOW_CUDA_OK(rc);
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      CheckOutput(Name("rms_norm", t, s.rows, s.n), test::FromDeviceBytes(dout.Download<uint8_t>(), t), ref, t);
      EXPECT_EQ(dx.Download<float>(), x) << "input modified";
    }
  }
}

// fp32 in place (out == x), as the final norm of the logit rows may run.
TEST(RmsNorm, InPlaceF32) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(22);
  const int rows = 7, n = 576;
  std::vector<float> x = RandomRows(rows, n, rng), w = RandomWeight(n, rng);
  std::vector<float> ref(x.size());
  cpu::RmsNorm(x.data(), w.data(), ref.data(), rows, n, kEps);
  test::DeviceBuffer dx = test::DeviceBuffer::From(x), dw = test::DeviceBuffer::From(w);
  const int rc = cuda::RmsNorm(DType::kF32, dx.get<float>(), dw.get(), dx.get(), rows, n, kEps, nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  CheckOutput("rms_norm fp32 in place rows7 n576", dx.Download<float>(), ref, DType::kF32);
}

TEST(RmsNorm, FusedAddMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  for (DType t : kAllDTypes) {
    for (const Shape& s : Shapes()) {
      std::vector<float> residual = RandomRows(s.rows, s.n, rng);
      std::vector<float> delta = RandomRows(s.rows, s.n, rng);
      std::vector<float> w = RandomWeight(s.n, rng);
      const std::vector<uint8_t> delta_bytes = test::ToDeviceBytes(delta, t);
      const std::vector<uint8_t> w_bytes = test::ToDeviceBytes(w, t);
      std::vector<float> ref_res(residual.size()), ref(residual.size());
      for (size_t i = 0; i < residual.size(); ++i) ref_res[i] = residual[i] + delta[i];
      cpu::RmsNorm(ref_res.data(), w.data(), ref.data(), s.rows, s.n, kEps);

      test::DeviceBuffer dres = test::DeviceBuffer::From(residual), ddelta = test::DeviceBuffer::From(delta_bytes);
      test::DeviceBuffer dw = test::DeviceBuffer::From(w_bytes), dout(residual.size() * cuda::DTypeSize(t));
      dout.Poison();
      const int rc = cuda::FusedAddRmsNorm(t, dres.get<float>(), ddelta.get(), dw.get(), dout.get(), s.rows, s.n,
                                           kEps, nullptr);
      KVFLOW_CUDA_OK(rc);
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      test::ExpectClose(Name("fused_add_rms_norm residual", t, s.rows, s.n), dres.Download<float>(), ref_res, 0.0,
                        0.0);
      CheckOutput(Name("fused_add_rms_norm out", t, s.rows, s.n), test::FromDeviceBytes(dout.Download<uint8_t>(), t),
                  ref, t);
    }
  }
}

// Qwen3's q/k norm: every head of the q part, then of the k part, of qkv rows, in place; rows of
// q, k and v heads side by side as the QKV projection writes them.
TEST(RmsNorm, HeadRmsNormMatchesCpuReference) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(25);
  struct HeadShape {
    int rows, q_heads, kv_heads, head_dim;
  };
  for (DType t : kAllDTypes) {
    for (const HeadShape& s : {HeadShape{37, 6, 2, 64}, HeadShape{5, 16, 8, 128}, HeadShape{130, 4, 1, 48},
                               HeadShape{3, 5, 5, 256}}) {
      const int row = (s.q_heads + 2 * s.kv_heads) * s.head_dim;
      std::vector<float> x = RandomRows(s.rows, row, rng);
      std::vector<float> wq = RandomWeight(s.head_dim, rng), wk = RandomWeight(s.head_dim, rng);
      // Rounded in place to the dtype's values, so both sides start from the same inputs.
      const std::vector<uint8_t> x_bytes = test::ToDeviceBytes(x, t), wq_bytes = test::ToDeviceBytes(wq, t),
                                 wk_bytes = test::ToDeviceBytes(wk, t);
      std::vector<float> ref = x;
      cpu::HeadRmsNorm(ref.data(), row, 0, s.rows, s.q_heads, s.head_dim, wq.data(), kEps);
      cpu::HeadRmsNorm(ref.data(), row, s.q_heads * s.head_dim, s.rows, s.kv_heads, s.head_dim, wk.data(), kEps);
      test::DeviceBuffer dx = test::DeviceBuffer::From(x_bytes), dwq = test::DeviceBuffer::From(wq_bytes),
                         dwk = test::DeviceBuffer::From(wk_bytes);
      KVFLOW_CUDA_OK(cuda::HeadRmsNorm(t, dx.get(), row, 0, s.rows, s.q_heads, s.head_dim, dwq.get(), kEps, nullptr));
      KVFLOW_CUDA_OK(cuda::HeadRmsNorm(t, dx.get(), row, s.q_heads * s.head_dim, s.rows, s.kv_heads, s.head_dim,
                                       dwk.get(), kEps, nullptr));
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> got = test::FromDeviceBytes(dx.Download<uint8_t>(), t);
      CheckOutput("head_rms_norm " + std::string(cuda::DTypeName(t)) + " rows" + std::to_string(s.rows) + " d" +
                      std::to_string(s.head_dim),
                  got, ref, t);
      // The v heads are not touched.
      const int v_first = (s.q_heads + s.kv_heads) * s.head_dim;
      for (int r = 0; r < s.rows; ++r) {
        for (int i = v_first; i < row; ++i) ASSERT_EQ(got[static_cast<size_t>(r) * row + i], x[static_cast<size_t>(r) * row + i]);
      }
    }
  }
  EXPECT_NE(cuda::HeadRmsNorm(DType::kF32, nullptr, 64, 0, 1, 2, 64, nullptr, kEps, nullptr), 0);
}

TEST(RmsNorm, AddToResidualExact) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(24);
  for (DType t : kAllDTypes) {
    for (const Shape& s : Shapes()) {
      std::vector<float> residual = RandomRows(s.rows, s.n, rng), delta = RandomRows(s.rows, s.n, rng);
      const std::vector<uint8_t> delta_bytes = test::ToDeviceBytes(delta, t);
      std::vector<float> ref(residual.size());
      for (size_t i = 0; i < residual.size(); ++i) ref[i] = residual[i] + delta[i];
      test::DeviceBuffer dres = test::DeviceBuffer::From(residual), ddelta = test::DeviceBuffer::From(delta_bytes);
      const int rc = cuda::AddToResidual(t, dres.get<float>(), ddelta.get(), s.rows, s.n, nullptr);
      KVFLOW_CUDA_OK(rc);
      KVFLOW_CUDA_OK(cudaDeviceSynchronize());
      test::ExpectClose(Name("add_to_residual", t, s.rows, s.n), dres.Download<float>(), ref, 0.0, 0.0);
    }
  }
}

TEST(RmsNorm, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  EXPECT_EQ(cuda::RmsNorm(DType::kF16, buf.get<float>(), buf.get(), buf.get(), 1, 0, kEps, nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::RmsNorm(static_cast<DType>(5), buf.get<float>(), buf.get(), buf.get(), 1, 16, kEps, nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::FusedAddRmsNorm(DType::kBF16, buf.get<float>(), buf.get(), buf.get(), buf.get(), -1, 16, kEps,
                                  nullptr),
            cuda::kInvalidValue);
  EXPECT_EQ(cuda::AddToResidual(DType::kF16, buf.get<float>(), buf.get(), 0, 16, nullptr), 0);  // no rows
}

}  // namespace
}  // namespace kvflow
