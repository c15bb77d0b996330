// Rotary embedding (kernels/rotary.cu) against ApplyRope (model/rope.h) on the Q and K heads of
// fused QKV rows, with default, llama3 and YaRN (attention_scale != 1) frequency tables and
// positions up to ~32K. V heads and row padding must be left bit-for-bit untouched.
// Tolerances (ExpectClose's relative metric floors |ref| at 1e-3 * max|ref|):
//   fp32: atol 4e-6, rtol 2e-4. A GPU's sinf/cosf may differ from glibc's by an ulp or two
//         (~1e-7 of |x| ~ 4); only outputs that are near zero through cancellation see a larger
//         relative error, bounded by the floor.
//   fp16: rtol 1e-3, bf16: rtol 8e-3 (one rounding of the output), atol = rtol * max|ref|.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kvflow/config.h"
#include "model/rope.h"
#include "rotary.h"

namespace kvflow {
namespace {

using cuda::DType;

ModelConfig Config(int head_dim, float theta, RopeScaling scaling = {}) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  c.max_position_embeddings = 8192;
  c.rope_scaling = scaling;
  return c;
}

RopeScaling Llama3() {
  RopeScaling s;
  s.type = RopeScaling::Type::kLlama3;
  s.factor = 8.0f;
  s.low_freq_factor = 1.0f;
  s.high_freq_factor = 4.0f;
  s.original_max_position_embeddings = 8192;
  return s;
}
RopeScaling Yarn() {
  RopeScaling s;
  s.type = RopeScaling::Type::kYarn;
  s.factor = 4.0f;
  s.original_max_position_embeddings = 4096;
  return s;
}

struct Shape {
  int num_tokens, num_q_heads, num_k_heads, num_v_heads, row_pad;
};

void RunRotary(DType t, const char* rope_name, const ModelConfig& config, const Shape& s, std::mt19937& rng) {
  const int D = config.head_dim;
  const RopeFrequencies freqs = ComputeRopeFrequencies(config);
  const int heads = s.num_q_heads + s.num_k_heads;
  const int64_t stride = static_cast<int64_t>(heads + s.num_v_heads) * D + s.row_pad;
  std::vector<float> qkv(static_cast<size_t>(s.num_tokens * stride));
  test::FillNormal(qkv, rng);
  const std::vector<uint8_t> qkv_bytes = test::ToDeviceBytes(qkv, t);

  // Positions: small, mid and long-context ones (up to ~32K), a 0 among them.
  std::vector<int32_t> positions(static_cast<size_t>(s.num_tokens));
  std::uniform_int_distribution<int32_t> small(0, 64), large(0, 32767);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = i % 3 == 0 ? small(rng) : large(rng);
  positions[0] = 0;
  if (positions.size() > 1) positions[1] = 32767;

  std::vector<float> ref, ref_all = qkv;
  for (int tok = 0; tok < s.num_tokens; ++tok) {
    for (int h = 0; h < heads; ++h) {
      float* head = &ref_all[static_cast<size_t>(tok * stride + static_cast<int64_t>(h) * D)];
      ApplyRope(head, D, positions[static_cast<size_t>(tok)], freqs);
      ref.insert(ref.end(), head, head + D);
    }
  }

  test::DeviceBuffer d_qkv = test::DeviceBuffer::From(qkv_bytes), d_pos = test::DeviceBuffer::From(positions);
  test::DeviceBuffer d_freq = test::DeviceBuffer::From(freqs.inv_freq);
  const int rc = cuda::ApplyRotaryEmbedding(t, d_qkv.get(), stride, d_pos.get<int32_t>(), s.num_tokens,
                                            s.num_q_heads, s.num_k_heads, D, d_freq.get<float>(),
                                            freqs.attention_scale, nullptr);
  KVFLOW_CUDA_OK(rc);
  KVFLOW_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> out_bytes = d_qkv.Download<uint8_t>();
  const std::vector<float> out = test::FromDeviceBytes(out_bytes, t);

  std::vector<float> got;
  const size_t es = cuda::DTypeSize(t);
  size_t untouched_bad = 0;
  for (int tok = 0; tok < s.num_tokens; ++tok) {
    const size_t row = static_cast<size_t>(tok * stride);
    got.insert(got.end(), &out[row], &out[row + static_cast<size_t>(heads) * D]);
    const size_t rest = row + static_cast<size_t>(heads) * D;  // V heads and padding
    untouched_bad += std::memcmp(&out_bytes[rest * es], &qkv_bytes[rest * es],
                                 (static_cast<size_t>(stride) - static_cast<size_t>(heads) * D) * es) != 0;
  }
  EXPECT_EQ(untouched_bad, 0u) << "V heads or row padding modified";

  const double rtol = t == DType::kF32 ? 2e-4 : t == DType::kF16 ? 1e-3 : 8e-3;
  double scale = 0.0;
  for (float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
  const double atol = t == DType::kF32 ? 4e-6 : rtol * scale;
  test::ExpectClose(std::string("rope ") + rope_name + " " + cuda::DTypeName(t) + " d" + std::to_string(D) + " q" +
                        std::to_string(s.num_q_heads) + " k" + std::to_string(s.num_k_heads) + " tokens" +
                        std::to_string(s.num_tokens) + " stride" + std::to_string(stride),
                    got, ref, atol, rtol);
}

TEST(Rotary, MatchesApplyRope) {
  KVFLOW_SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  const bool emu = test::IsEmulator();
  const Shape shapes[] = {
      {emu ? 97 : 300, 4, 2, 2, 0},   // GQA, 16-byte vectors
      {emu ? 31 : 64, 9, 3, 3, 8},     // SmolLM2-like 9 / 3 heads, padded rows
      {emu ? 17 : 33, 2, 1, 1, 1},     // odd stride: element-wise path
  };
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const Shape& s : shapes) {
      RunRotary(t, "default", Config(64, 10000.0f), s, rng);
      RunRotary(t, "llama3", Config(128, 500000.0f, Llama3()), s, rng);
    }
    RunRotary(t, "yarn", Config(128, 10000.0f, Yarn()), shapes[0], rng);
    RunRotary(t, "default", Config(18, 10000.0f), shapes[0], rng);  // half = 9: element-wise path
  }
}

TEST(Rotary, RejectsBadArguments) {
  KVFLOW_SKIP_WITHOUT_GPU();
  test::DeviceBuffer buf(4096);
  EXPECT_EQ(cuda::ApplyRotaryEmbedding(DType::kF16, buf.get(), 64, buf.get<int32_t>(), 1, 1, 0, 63,
                                       buf.get<float>(), 1.0f, nullptr),
            cuda::kInvalidValue);  // odd head_dim
  EXPECT_EQ(cuda::ApplyRotaryEmbedding(DType::kF16, buf.get(), 100, buf.get<int32_t>(), 1, 1, 1, 64,
                                       buf.get<float>(), 1.0f, nullptr),
            cuda::kInvalidValue);  // stride shorter than the Q and K heads
  EXPECT_EQ(cuda::ApplyRotaryEmbedding(DType::kF16, buf.get(), 128, buf.get<int32_t>(), 0, 1, 1, 64,
                                       buf.get<float>(), 1.0f, nullptr),
            0);
}

}  // namespace
}  // namespace kvflow
