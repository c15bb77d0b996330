// Quantized-weight products (backend/cpu/quant_gemm.h) against plain float references, on every
// kernel path the CPU offers (AVX-512 VNNI, AVX2, portable).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/quant_gemm.h"
#include "model/ggml_kquant.h"
#include "model/tensor_source.h"
#include "util/thread_pool.h"

namespace kvflow::cpu {
namespace {

constexpr int64_t kBlock = 32;
constexpr DType kWeightTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0};

// ---- the test's own half conversions and ggml reference quantizers ----------------------------

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even; the tests only convert zero and normal-range halves.
uint16_t FloatToHalf(float f) {
  if (f == 0.0f) return std::signbit(f) ? 0x8000 : 0;
  const float magnitude = std::fabs(f);
  EXPECT_TRUE(magnitude >= 6.103515625e-05f && magnitude < 65504.0f) << f;
  int exponent;
  const float fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent
  // 11 significant bits: mantissa in [1024, 2048).
  const float scaled = std::nearbyint(std::ldexp(fraction, 11));
  uint32_t mantissa = static_cast<uint32_t>(scaled);
  int biased = exponent - 1 + 15;
  if (mantissa == 2048) {
    mantissa = 1024;
    ++biased;
  }
  return static_cast<uint16_t>((f < 0 ? 0x8000 : 0) | (biased << 10) | (mantissa - 1024));
}

void PutU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
void PutF32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
float GetF32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
uint16_t GetU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ggml's quantize_row_q4_0_ref / q4_1_ref / q8_0_ref for one block.
void QuantizeWeightBlock(DType type, const float* x, uint8_t* out) {
  if (type == DType::kQ4_0) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kBlock; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f, inv_d = d != 0.0f ? 1.0f / d : 0.0f;
    PutU16(out, FloatToHalf(d));
    for (int j = 0; j < 16; ++j) {
      const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * inv_d + 8.5f)));
      const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + 16] * inv_d + 8.5f)));
      out[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else if (type == DType::kQ4_1) {
    float min = INFINITY, max = -INFINITY;
    for (int j = 0; j < kBlock; ++j) {
      min = std::min(min, x[j]);
      max = std::max(max, x[j]);
    }
    const float d = (max - min) / 15.0f, inv_d = d != 0.0f ? 1.0f / d : 0.0f;
    PutU16(out, FloatToHalf(d));
    PutU16(out + 2, FloatToHalf(min));
    for (int j = 0; j < 16; ++j) {
      const int lo = std::min(15, static_cast<int>(static_cast<int8_t>((x[j] - min) * inv_d + 0.5f)));
      const int hi = std::min(15, static_cast<int>(static_cast<int8_t>((x[j + 16] - min) * inv_d + 0.5f)));
      out[4 + j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  } else {
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, inv_d = d != 0.0f ? 1.0f / d : 0.0f;
    PutU16(out, FloatToHalf(d));
    for (int j = 0; j < kBlock; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * inv_d)));
  }
}

std::vector<uint8_t> QuantizeWeights(DType type, const std::vector<float>& w, int64_t n_rows, int64_t cols) {
  const size_t block_bytes = DTypeBlockBytes(type);
  std::vector<uint8_t> out(static_cast<size_t>(n_rows * cols / kBlock) * block_bytes);
  for (int64_t b = 0; b < n_rows * cols / kBlock; ++b) QuantizeWeightBlock(type, &w[b * kBlock], &out[b * block_bytes]);
  return out;
}

// Random block bytes: every quant value (Q8_0 includes -128, which ggml's quantizer never makes),
// finite scales and mins of both signs.
std::vector<uint8_t> RandomWeightBytes(DType type, int64_t n_rows, int64_t cols, std::mt19937& rng) {
  const size_t block_bytes = DTypeBlockBytes(type);
  std::vector<uint8_t> out(static_cast<size_t>(n_rows * cols / kBlock) * block_bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-3f, 2e-2f);
  std::bernoulli_distribution negative(0.5);
  for (size_t b = 0; b < out.size() / block_bytes; ++b) {
    uint8_t* block = &out[b * block_bytes];
    for (size_t i = 0; i < block_bytes; ++i) block[i] = static_cast<uint8_t>(byte(rng));
    PutU16(block, FloatToHalf(negative(rng) ? -scale(rng) : scale(rng)));
    if (type == DType::kQ4_1) PutU16(block + 2, FloatToHalf(negative(rng) ? -scale(rng) * 8 : scale(rng) * 8));
  }
  return out;
}

std::vector<float> Dequantize(DType type, const std::vector<uint8_t>& bytes, int64_t n_rows, int64_t cols) {
  TensorInfo info;
  info.name = "w";
  info.dtype = type;
  info.shape = {n_rows, cols};
  info.data = bytes.data();
  info.nbytes = bytes.size();
  std::vector<float> out(static_cast<size_t>(n_rows * cols));
  EXPECT_TRUE(DequantizeToF32(info, out.data()).ok());
  return out;
}

// The activations as the kernels see them: q * d per element.
std::vector<float> DequantizeActivations(const QuantizedActivations& x) {
  std::vector<float> out(static_cast<size_t>(x.rows * x.cols));
  const bool q8_1 = x.weight_type == DType::kQ4_1;
  const size_t block_bytes = q8_1 ? 40 : 34, quant_offset = q8_1 ? 8 : 2;
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t b = 0; b < x.cols / kBlock; ++b) {
      const uint8_t* block = x.row(r) + b * block_bytes;
      const float d = q8_1 ? GetF32(block) : HalfToFloat(GetU16(block));
      const int8_t* qs = reinterpret_cast<const int8_t*>(block + quant_offset);
      for (int j = 0; j < kBlock; ++j) out[r * x.cols + b * kBlock + j] = qs[j] * d;
    }
  }
  return out;
}

// ggml's quantize_row_q8_0 / q8_1 as its SIMD versions round (half to even).
std::vector<uint8_t> ReferenceActivationBytes(DType weight_type, const std::vector<float>& x, int64_t rows, int64_t cols) {
  const bool q8_1 = weight_type == DType::kQ4_1;
  const size_t block_bytes = q8_1 ? 40 : 34;
  std::vector<uint8_t> out(static_cast<size_t>(rows * cols / kBlock) * block_bytes);
  for (int64_t b = 0; b < rows * cols / kBlock; ++b) {
    const float* xb = &x[b * kBlock];
    uint8_t* block = &out[b * block_bytes];
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, inv_d = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int q = static_cast<int>(std::nearbyint(xb[j] * inv_d));
      block[(q8_1 ? 8 : 2) + j] = static_cast<uint8_t>(static_cast<int8_t>(q));
      sum += q;
    }
    if (q8_1) {
      PutF32(block, d);
      PutF32(block + 4, d * static_cast<float>(sum));
    } else {
      PutU16(block, FloatToHalf(d));
    }
  }
  return out;
}

// Activations shaped like a residual stream: mostly N(0, 1) with a few large channels.
std::vector<float> RandomActivations(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> row_scale(0.1f, 4.0f);
  std::bernoulli_distribution outlier(0.01);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = row_scale(rng);
    for (int64_t c = 0; c < cols; ++c) x[r * cols + c] = scale * normal(rng) * (outlier(rng) ? 20.0f : 1.0f);
  }
  return x;
}

std::vector<float> RandomWeights(int64_t n_rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::uniform_real_distribution<float> bias(-0.02f, 0.02f);
  std::vector<float> w(static_cast<size_t>(n_rows * cols));
  for (int64_t n = 0; n < n_rows; ++n) {
    const float row_bias = bias(rng);  // gives Q4_1's min something to carry
    for (int64_t c = 0; c < cols; ++c) w[n * cols + c] = normal(rng) + row_bias;
  }
  return w;
}

// ---- kernel paths ---------------------------------------------------------------------------------

enum class Path { kDispatched, kAvx2, kPortable };
constexpr Path kPaths[] = {Path::kDispatched, Path::kAvx2, Path::kPortable};

// Selects a path for its lifetime. A path the CPU lacks falls back to a lesser one; QuantKernelIsa()
// names what actually ran.
class ScopedPath {
 public:
  explicit ScopedPath(Path path)
      : previous_portable_(ForcePortableQuantKernels(path == Path::kPortable)),
        previous_limit_(LimitQuantKernelIsa(path == Path::kAvx2 ? "avx2" : nullptr)) {}
  ~ScopedPath() {
    ForcePortableQuantKernels(previous_portable_);
    LimitQuantKernelIsa(previous_limit_);
  }

 private:
  bool previous_portable_;
  const char* previous_limit_;
};

struct Shape {
  int64_t rows, cols, n_rows;
};

std::string Describe(DType type, const Shape& s) {
  return std::string(DTypeName(type)) + " rows=" + std::to_string(s.rows) + " cols=" + std::to_string(s.cols) +
         " n_rows=" + std::to_string(s.n_rows);
}

// Largest errors seen over a test, relative to the scale each one is bounded by.
struct ErrorStats {
  double max_abs = 0.0, max_rel = 0.0;
  void Add(double abs_error, double scale) {
    max_abs = std::max(max_abs, abs_error);
    if (scale > 0) max_rel = std::max(max_rel, abs_error / scale);
  }
};

// Relative to sum |w * x| of the output (what float summation error scales with).
constexpr double kVsDequantizedTolerance = 1e-5;
// Paths differ only in float summation order (lanes, then a horizontal sum).
constexpr double kPathTolerance = 2e-6;

struct TypeStats {
  ErrorStats vs_dequantized, vs_fp32_activations, between_paths;
};

// Runs every path on one shape and checks it against the references; `weights` holds the block bytes.
void CheckShape(DType type, const Shape& s, const std::vector<uint8_t>& weights, std::mt19937& rng, TypeStats& stats) {
  SCOPED_TRACE(Describe(type, s));
  const std::vector<float> w = Dequantize(type, weights, s.n_rows, s.cols);
  const std::vector<float> x = RandomActivations(s.rows, s.cols, rng);

  QuantizedActivations qx;
  QuantizeActivations(x.data(), s.rows, s.cols, type, qx);
  ASSERT_EQ(qx.rows, s.rows);
  ASSERT_EQ(qx.cols, s.cols);
  ASSERT_EQ(qx.data.size(), static_cast<size_t>(s.rows) * qx.row_bytes());
  const std::vector<float> xq = DequantizeActivations(qx);

  // References in double: on the quantized activations (what the integer kernels must reproduce)
  // and on the fp32 activations, with the bound the 8-bit activation rounding allows: per element
  // |x - q * d| <= d / 2 for q = round(x / d), plus, for Q8_0's f16 d, |q| * |d - f16(d)| <=
  // 127 * d * 2^-11; so |y - y_fp32| <= sum_k |w_k| * d_block(k) * (0.5 + 127 / 2048).
  const size_t outputs = static_cast<size_t>(s.rows * s.n_rows);
  std::vector<double> ref(outputs), magnitude(outputs), ref_fp32(outputs), fp32_bound(outputs);
  const double d_factor = type == DType::kQ4_1 ? 0.5 * (1 + 1e-6) : 0.5 + 127.0 / 2048.0;
  for (int64_t m = 0; m < s.rows; ++m) {
    for (int64_t n = 0; n < s.n_rows; ++n) {
      double dot = 0, mag = 0, dot32 = 0, bound = 0;
      for (int64_t b = 0; b < s.cols / kBlock; ++b) {
        double amax = 0;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[m * s.cols + b * kBlock + j])));
        const double d = amax / 127.0;
        for (int j = 0; j < kBlock; ++j) {
          const int64_t k = b * kBlock + j;
          const double wk = w[n * s.cols + k];
          dot += wk * xq[m * s.cols + k];
          mag += std::fabs(wk * xq[m * s.cols + k]);
          dot32 += wk * x[m * s.cols + k];
          bound += std::fabs(wk) * d * d_factor;
        }
      }
      const size_t i = static_cast<size_t>(m * s.n_rows + n);
      ref[i] = dot;
      magnitude[i] = mag;
      ref_fp32[i] = dot32;
      fp32_bound[i] = bound;
    }
  }

  // Output rows wider than n_rows: the padding must stay untouched.
  const int64_t ldy = s.n_rows + 3;
  std::uniform_real_distribution<float> initial(-2.0f, 2.0f);
  std::vector<float> y0(static_cast<size_t>(s.rows * ldy));
  for (float& v : y0) v = initial(rng);

  for (bool accumulate : {false, true}) {
    std::vector<float> dispatched_y;
    for (Path path : kPaths) {
      ScopedPath scoped(path);
      SCOPED_TRACE(std::string("isa=") + QuantKernelIsa() + (accumulate ? " accumulate" : ""));
      QuantizedActivations px;
      QuantizeActivations(x.data(), s.rows, s.cols, type, px);
      ASSERT_EQ(px.data, qx.data) << "activation quantization differs between paths";

      std::vector<float> y = y0;
      QuantizedMatmul(px, weights.data(), s.n_rows, y.data(), ldy, accumulate);
      for (int64_t m = 0; m < s.rows; ++m) {
        for (int64_t n = 0; n < ldy; ++n) {
          const size_t at = static_cast<size_t>(m * ldy + n);
          if (n >= s.n_rows) {
            ASSERT_EQ(y[at], y0[at]) << "padding written at m=" << m << " n=" << n;
            continue;
          }
          const size_t i = static_cast<size_t>(m * s.n_rows + n);
          const double base = accumulate ? y0[at] : 0.0;
          const double scale = magnitude[i] + std::fabs(base);
          const double error = std::fabs(y[at] - (base + ref[i]));
          stats.vs_dequantized.Add(error, scale);
          ASSERT_LE(error, kVsDequantizedTolerance * scale + 1e-30) << "m=" << m << " n=" << n;
          const double error32 = std::fabs(y[at] - (base + ref_fp32[i]));
          stats.vs_fp32_activations.Add(error32, fp32_bound[i] + kVsDequantizedTolerance * scale);
          ASSERT_LE(error32, fp32_bound[i] + kVsDequantizedTolerance * scale) << "m=" << m << " n=" << n;
          if (!dispatched_y.empty()) {
            const double between = std::fabs(static_cast<double>(y[at]) - dispatched_y[at]);
            stats.between_paths.Add(between, scale);
            ASSERT_LE(between, kPathTolerance * scale + 1e-30) << "m=" << m << " n=" << n;
          }
        }
      }
      if (path == Path::kDispatched) dispatched_y = y;

      // One output through QuantizedDot: the same per-output arithmetic as the matmul's tiles.
      if (!accumulate) {
        const int64_t m = s.rows - 1, n = s.n_rows / 2;
        const float dot = QuantizedDot(type, weights.data() + n * (s.cols / kBlock) * DTypeBlockBytes(type), px.row(m), s.cols);
        EXPECT_EQ(dot, y[m * ldy + n]);
      }
    }
  }
}

std::vector<Shape> AllShapes() {
  std::vector<Shape> shapes;
  for (int64_t rows : {1, 3, 17, 64})
    for (int64_t cols : {32, 64, 576, 1536})
      for (int64_t n_rows : {1, 5, 64, 577}) shapes.push_back({rows, cols, n_rows});
  return shapes;
}

void Report(const char* what, DType type, const TypeStats& stats) {
  std::printf("[quant_gemm] %-14s %s  vs dequantized: max abs %.3g, max rel %.3g | vs fp32 activations: max abs %.3g, "
              "max error / bound %.3g | between paths: max abs %.3g, max rel %.3g\n",
              what, DTypeName(type), stats.vs_dequantized.max_abs, stats.vs_dequantized.max_rel,
              stats.vs_fp32_activations.max_abs, stats.vs_fp32_activations.max_rel, stats.between_paths.max_abs,
              stats.between_paths.max_rel);
}

TEST(QuantGemm, ReportsDispatchedIsa) {
  const std::string isa = QuantKernelIsa();
  std::printf("[quant_gemm] dispatched ISA: %s\n", isa.c_str());
  EXPECT_TRUE(isa == "avx512vnni" || isa == "avx2" || isa == "portable");
  {
    ScopedPath portable(Path::kPortable);
    EXPECT_STREQ(QuantKernelIsa(), "portable");
  }
  {
    ScopedPath avx2(Path::kAvx2);
    EXPECT_TRUE(std::string(QuantKernelIsa()) == "avx2" || isa == "portable");
  }
  EXPECT_EQ(QuantKernelIsa(), isa);
}

TEST(QuantGemm, ActivationQuantizationMatchesGgml) {
  std::mt19937 rng(11);
  for (DType type : kWeightTypes) {
    for (int64_t cols : {32, 576}) {
      std::vector<float> x = RandomActivations(5, cols, rng);
      std::fill(x.begin() + 32, x.begin() + 64, 0.0f);  // an all-zero block: d = 0, q = 0
      // A block with d = 1 exactly and round-half ties, which go to even: 62.5 -> 62, -3.5 -> -4.
      for (int j = 64; j < 96; ++j) x[j] = std::clamp(x[j], -100.0f, 100.0f);
      x[71] = 127.0f;
      x[70] = 62.5f;
      x[72] = -3.5f;
      const std::vector<uint8_t> expected = ReferenceActivationBytes(type, x, 5, cols);
      for (Path path : kPaths) {
        ScopedPath scoped(path);
        QuantizedActivations qx;
        QuantizeActivations(x.data(), 5, cols, type, qx);
        EXPECT_EQ(qx.weight_type, type);
        ASSERT_EQ(qx.data.size(), expected.size());
        EXPECT_EQ(qx.data, expected) << DTypeName(type) << " cols=" << cols << " isa=" << QuantKernelIsa();
      }
    }
  }
}

TEST(QuantGemm, MatchesReferencesOnQuantizedWeights) {
  std::mt19937 rng(1234);
  for (DType type : kWeightTypes) {
    TypeStats stats;
    for (const Shape& s : AllShapes()) {
      const std::vector<uint8_t> weights = QuantizeWeights(type, RandomWeights(s.n_rows, s.cols, rng), s.n_rows, s.cols);
      CheckShape(type, s, weights, rng, stats);
      if (HasFatalFailure()) return;
    }
    Report("quantized", type, stats);
  }
}

TEST(QuantGemm, MatchesReferencesOnRandomBlockBytes) {
  std::mt19937 rng(99);
  for (DType type : kWeightTypes) {
    TypeStats stats;
    for (const Shape& s : {Shape{1, 1536, 577}, Shape{17, 576, 64}, Shape{64, 64, 5}, Shape{3, 32, 577}}) {
      CheckShape(type, s, RandomWeightBytes(type, s.n_rows, s.cols, rng), rng, stats);
      if (HasFatalFailure()) return;
    }
    Report("random bytes", type, stats);
  }
}

// The activation buffer is reused: a smaller call keeps the storage, a larger one grows it.
TEST(QuantGemm, QuantizeReusesActivationStorage) {
  std::mt19937 rng(5);
  const std::vector<float> x = RandomActivations(8, 576, rng);
  QuantizedActivations qx;
  QuantizeActivations(x.data(), 8, 576, DType::kQ4_1, qx);
  const uint8_t* storage = qx.data.data();
  QuantizeActivations(x.data(), 2, 576, DType::kQ4_1, qx);
  EXPECT_EQ(qx.data.data(), storage);
  EXPECT_EQ(qx.rows, 2);
  EXPECT_EQ(qx.row_bytes(), 576 / 32 * 40u);
  QuantizeActivations(x.data(), 8, 576, DType::kQ8_0, qx);
  EXPECT_EQ(qx.row_bytes(), 576 / 32 * 34u);
  EXPECT_EQ(qx.weight_type, DType::kQ8_0);
}

// ---- K-quants (Q2_K..Q6_K with Q8_K activations) --------------------------------------------------

constexpr int64_t kSuperBlock = 256;
constexpr size_t kQ8_KBytes = 292;
constexpr DType kKQuantTypes[] = {DType::kQ4_K, DType::kQ6_K, DType::kQ5_K, DType::kQ2_K, DType::kQ3_K};

// ggml's quantize_row_q8_K_ref, written out independently: the element m of largest magnitude
// (first on ties) maps to -127; q = round-half-even(x * (-127 / m)) capped at 127, d = 1 / (-127 / m).
std::vector<uint8_t> ReferenceQ8K(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(static_cast<size_t>(rows * cols / kSuperBlock) * kQ8_KBytes, 0);
  for (int64_t b = 0; b < rows * cols / kSuperBlock; ++b) {
    const float* xb = &x[b * kSuperBlock];
    uint8_t* block = &out[b * kQ8_KBytes];
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kSuperBlock; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    if (amax == 0.0f) continue;  // d = 0, q = 0, bsums = 0
    const float iscale = -127.0f / max;
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) {
        const int q = std::min(127, static_cast<int>(std::nearbyint(iscale * xb[16 * g + l])));
        block[4 + 16 * g + l] = static_cast<uint8_t>(static_cast<int8_t>(q));
        sum += q;
      }
      const int16_t bsum = static_cast<int16_t>(sum);
      std::memcpy(block + 260 + 2 * g, &bsum, 2);
    }
    PutF32(block, 1.0f / iscale);
  }
  return out;
}

std::vector<float> DequantizeQ8K(const QuantizedActivations& x) {
  std::vector<float> out(static_cast<size_t>(x.rows * x.cols));
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t b = 0; b < x.cols / kSuperBlock; ++b) {
      const uint8_t* block = x.row(r) + b * kQ8_KBytes;
      const float d = GetF32(block);
      for (int j = 0; j < kSuperBlock; ++j) {
        out[r * x.cols + b * kSuperBlock + j] = static_cast<int8_t>(block[4 + j]) * d;
      }
    }
  }
  return out;
}

// Random valid K-quant blocks: every quant and scale byte random (all scales, mins and quant
// values occur, none forced to zero), the f16 super-block scales random in [2^-10, 2^-6) of
// either sign for d, positive for dmin (ggml's quantizers make d of either sign, dmin >= 0).
std::vector<uint8_t> RandomKQuantBytes(DType type, int64_t n_rows, int64_t cols, std::mt19937& rng) {
  const size_t block_bytes = DTypeBlockBytes(type);
  std::vector<uint8_t> out(static_cast<size_t>(n_rows * cols / kSuperBlock) * block_bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1.0f / 1024, 1.0f / 64);
  std::bernoulli_distribution negative(0.5);
  for (size_t b = 0; b < out.size() / block_bytes; ++b) {
    uint8_t* block = &out[b * block_bytes];
    for (size_t i = 0; i < block_bytes; ++i) block[i] = static_cast<uint8_t>(byte(rng));
    const uint16_t d = FloatToHalf(negative(rng) ? -scale(rng) : scale(rng));
    const uint16_t dmin = FloatToHalf(scale(rng));
    switch (type) {
      case DType::kQ2_K: PutU16(block + 80, d); PutU16(block + 82, dmin); break;
      case DType::kQ3_K: PutU16(block + 108, d); break;
      case DType::kQ4_K:
      case DType::kQ5_K: PutU16(block, d); PutU16(block + 2, dmin); break;
      default: PutU16(block + 208, d); break;  // Q6_K
    }
  }
  return out;
}

// |dmin * min| of the sub-block holding element k of a row (0 for the types without mins): the
// kernels subtract the min term separately, so float rounding scales with it as well as with |w|.
double MinMagnitude(DType type, const uint8_t* row, int64_t k) {
  const uint8_t* block = row + (k / kSuperBlock) * DTypeBlockBytes(type);
  const int e = static_cast<int>(k % kSuperBlock);
  if (type == DType::kQ2_K) return std::fabs(HalfToFloat(GetU16(block + 82))) * (block[e / 16] >> 4);
  if (type == DType::kQ4_K || type == DType::kQ5_K) {
    int scale, min;
    UnpackScaleMin6(block + 4, e / 32, &scale, &min);
    return std::fabs(HalfToFloat(GetU16(block + 2))) * min;
  }
  return 0.0;
}

// Relative to sum |x_q| * (|w| + |min term|) of the output; the integer sums are exact, the float
// scaling of a super-block's int32 lanes and the lane / chunk sums round.
constexpr double kKQuantVsDequantizedTolerance = 1e-5;
constexpr double kKQuantPathTolerance = 2e-6;

struct KQuantStats {
  std::map<std::string, ErrorStats> vs_dequantized;  // per path
  ErrorStats vs_fp32_activations, between_paths;
};

void CheckKQuantShape(DType type, const Shape& s, std::mt19937& rng, KQuantStats& stats) {
  SCOPED_TRACE(Describe(type, s));
  const std::vector<uint8_t> weights = RandomKQuantBytes(type, s.n_rows, s.cols, rng);
  const std::vector<float> w = Dequantize(type, weights, s.n_rows, s.cols);
  const std::vector<float> x = RandomActivations(s.rows, s.cols, rng);
  const size_t w_row_bytes = static_cast<size_t>(s.cols / kSuperBlock) * DTypeBlockBytes(type);

  QuantizedActivations qx;
  QuantizeActivations(x.data(), s.rows, s.cols, type, qx);
  ASSERT_EQ(qx.row_bytes(), static_cast<size_t>(s.cols / kSuperBlock) * kQ8_KBytes);
  ASSERT_EQ(qx.data, ReferenceQ8K(x, s.rows, s.cols));
  const std::vector<float> xq = DequantizeQ8K(qx);

  const size_t outputs = static_cast<size_t>(s.rows * s.n_rows);
  std::vector<double> ref(outputs), magnitude(outputs), ref_fp32(outputs), fp32_bound(outputs);
  for (int64_t m = 0; m < s.rows; ++m) {
    for (int64_t n = 0; n < s.n_rows; ++n) {
      double dot = 0, mag = 0, dot32 = 0, bound = 0;
      for (int64_t b = 0; b < s.cols / kSuperBlock; ++b) {
        double amax = 0;
        for (int j = 0; j < kSuperBlock; ++j) {
          amax = std::max(amax, std::fabs(static_cast<double>(x[m * s.cols + b * kSuperBlock + j])));
        }
        for (int j = 0; j < kSuperBlock; ++j) {
          const int64_t k = b * kSuperBlock + j;
          const double wk = w[n * s.cols + k], xk = xq[m * s.cols + k];
          dot += wk * xk;
          mag += std::fabs(xk) * (std::fabs(wk) + MinMagnitude(type, weights.data() + n * w_row_bytes, k));
          dot32 += wk * x[m * s.cols + k];
          // |x - q d| <= |d| / 2 with |d| = amax / 127 (float-rounded, hence the 1e-6).
          bound += std::fabs(wk) * amax / 127.0 * 0.5 * (1 + 1e-6);
        }
      }
      const size_t i = static_cast<size_t>(m * s.n_rows + n);
      ref[i] = dot;
      magnitude[i] = mag;
      ref_fp32[i] = dot32;
      fp32_bound[i] = bound;
    }
  }

  const int64_t ldy = s.n_rows + 3;
  std::uniform_real_distribution<float> initial(-2.0f, 2.0f);
  std::vector<float> y0(static_cast<size_t>(s.rows * ldy));
  for (float& v : y0) v = initial(rng);
  for (bool accumulate : {false, true}) {
    std::vector<float> dispatched_y;
    for (Path path : kPaths) {
      ScopedPath scoped(path);
      const std::string isa = QuantKernelIsa();
      SCOPED_TRACE("isa=" + isa + (accumulate ? " accumulate" : ""));
      QuantizedActivations px;
      QuantizeActivations(x.data(), s.rows, s.cols, type, px);
      ASSERT_EQ(px.data, qx.data) << "activation quantization differs between paths";
      std::vector<float> y = y0;
      QuantizedMatmul(px, weights.data(), s.n_rows, y.data(), ldy, accumulate);
      for (int64_t m = 0; m < s.rows; ++m) {
        for (int64_t n = 0; n < ldy; ++n) {
          const size_t at = static_cast<size_t>(m * ldy + n);
          if (n >= s.n_rows) {
            ASSERT_EQ(y[at], y0[at]) << "padding written at m=" << m << " n=" << n;
            continue;
          }
          const size_t i = static_cast<size_t>(m * s.n_rows + n);
          const double base = accumulate ? y0[at] : 0.0;
          const double scale = magnitude[i] + std::fabs(base);
          const double error = std::fabs(y[at] - (base + ref[i]));
          stats.vs_dequantized[isa].Add(error, scale);
          ASSERT_LE(error, kKQuantVsDequantizedTolerance * scale + 1e-30) << "m=" << m << " n=" << n;
          const double error32 = std::fabs(y[at] - (base + ref_fp32[i]));
          const double bound32 = fp32_bound[i] + kKQuantVsDequantizedTolerance * scale;
          stats.vs_fp32_activations.Add(error32, bound32);
          ASSERT_LE(error32, bound32) << "m=" << m << " n=" << n;
          if (!dispatched_y.empty()) {
            const double between = std::fabs(static_cast<double>(y[at]) - dispatched_y[at]);
            stats.between_paths.Add(between, scale);
            ASSERT_LE(between, kKQuantPathTolerance * scale + 1e-30) << "m=" << m << " n=" << n;
          }
        }
      }
      if (path == Path::kDispatched) dispatched_y = y;
      if (!accumulate) {
        const int64_t m = s.rows - 1, n = s.n_rows / 2;
        EXPECT_EQ(QuantizedDot(type, weights.data() + n * w_row_bytes, px.row(m), s.cols), y[m * ldy + n]);
      }
    }
  }
}

TEST(KQuantGemm, Q8KQuantizationMatchesGgml) {
  std::mt19937 rng(21);
  for (int64_t cols : {256, 1024}) {
    std::vector<float> x = RandomActivations(3, cols, rng);
    std::fill(x.begin() + 256, x.begin() + 512, 0.0f);  // an all-zero super-block (row 0 or 1)
    // A super-block where -127 / max = -1 exactly: ties go to even (62.5 -> -62, -3.5 -> 4).
    for (int j = 0; j < 256; ++j) x[j] = std::clamp(x[j], -100.0f, 100.0f);
    x[7] = 127.0f;
    x[8] = 62.5f;
    x[9] = -3.5f;
    x[10] = -127.0f;  // same magnitude as the max, later: the first one sets the sign
    const std::vector<uint8_t> expected = ReferenceQ8K(x, 3, cols);
    for (DType type : kKQuantTypes) {
      for (Path path : kPaths) {
        ScopedPath scoped(path);
        QuantizedActivations qx;
        QuantizeActivations(x.data(), 3, cols, type, qx);
        ASSERT_EQ(qx.data, expected) << DTypeName(type) << " cols=" << cols << " isa=" << QuantKernelIsa();
      }
    }
    QuantizedActivations qx;
    QuantizeActivations(x.data(), 3, cols, DType::kQ4_K, qx);
    EXPECT_EQ(GetF32(qx.row(0)), -1.0f);
    EXPECT_EQ(static_cast<int8_t>(qx.row(0)[4 + 8]), -62);
    EXPECT_EQ(static_cast<int8_t>(qx.row(0)[4 + 9]), 4);
    EXPECT_EQ(static_cast<int8_t>(qx.row(0)[4 + 10]), 127);
    // bsums are the sums of 16 quants; round trip within |d| / 2 per element.
    const std::vector<float> back = DequantizeQ8K(qx);
    double max_error_over_d = 0;
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
        const uint8_t* block = qx.row(r) + b * kQ8_KBytes;
        const float d = GetF32(block);
        for (int g = 0; g < 16; ++g) {
          int sum = 0;
          for (int l = 0; l < 16; ++l) sum += static_cast<int8_t>(block[4 + 16 * g + l]);
          int16_t bsum;
          std::memcpy(&bsum, block + 260 + 2 * g, 2);
          EXPECT_EQ(bsum, sum);
        }
        for (int j = 0; j < kSuperBlock; ++j) {
          const int64_t k = r * cols + b * kSuperBlock + j;
          const double error = std::fabs(static_cast<double>(x[k]) - back[k]);
          if (d == 0.0f) {
            EXPECT_EQ(x[k], 0.0f);
            EXPECT_EQ(back[k], 0.0f);
          } else {
            max_error_over_d = std::max(max_error_over_d, error / std::fabs(d));
            EXPECT_LE(error, std::fabs(d) * 0.5 * (1 + 1e-5)) << "k=" << k;
          }
        }
      }
    }
    std::printf("[quant_gemm] Q8_K cols=%lld round trip: max |x - q d| / |d| = %.4f\n", static_cast<long long>(cols),
                max_error_over_d);
  }
}

// One Q8_K quantization serves every K-quant (the backend reuses it across a matrix's parts).
TEST(KQuantGemm, ActivationsAreSharedAcrossKQuants) {
  EXPECT_TRUE(SameActivationFormat(DType::kQ4_K, DType::kQ6_K));
  EXPECT_TRUE(SameActivationFormat(DType::kQ2_K, DType::kQ5_K));
  EXPECT_TRUE(SameActivationFormat(DType::kQ4_0, DType::kQ8_0));
  EXPECT_FALSE(SameActivationFormat(DType::kQ4_0, DType::kQ4_1));
  EXPECT_FALSE(SameActivationFormat(DType::kQ8_0, DType::kQ4_K));
  std::mt19937 rng(8);
  const std::vector<float> x = RandomActivations(3, 512, rng);
  QuantizedActivations first;
  QuantizeActivations(x.data(), 3, 512, DType::kQ4_K, first);
  for (DType type : kKQuantTypes) {
    QuantizedActivations own;
    QuantizeActivations(x.data(), 3, 512, type, own);
    EXPECT_EQ(own.data, first.data) << DTypeName(type);
  }
}

// Threads split the weight rows; each output's arithmetic is the same as on one thread.
TEST(KQuantGemm, ThreadsGiveTheSameOutputs) {
  std::mt19937 rng(77);
  for (DType type : kKQuantTypes) {
    const int64_t rows = 5, cols = 1024, n_rows = 203;
    const std::vector<uint8_t> weights = RandomKQuantBytes(type, n_rows, cols, rng);
    const std::vector<float> x = RandomActivations(rows, cols, rng);
    QuantizedActivations qx;
    QuantizeActivations(x.data(), rows, cols, type, qx);
    std::vector<float> serial(static_cast<size_t>(rows * n_rows)), parallel(serial.size());
    QuantizedMatmul(qx, weights.data(), n_rows, serial.data(), n_rows, false);
    ThreadPool pool(2);
    ScopedThreadPool use(&pool);
    QuantizedActivations px;
    QuantizeActivations(x.data(), rows, cols, type, px);
    EXPECT_EQ(px.data, qx.data) << DTypeName(type);
    QuantizedMatmul(px, weights.data(), n_rows, parallel.data(), n_rows, false);
    EXPECT_EQ(parallel, serial) << DTypeName(type);
  }
}

TEST(KQuantGemm, MatchesDequantizedOnRandomBlocks) {
  std::mt19937 rng(4321);
  std::vector<Shape> shapes;
  for (int64_t rows : {1, 3, 17})
    for (int64_t cols : {256, 768, 2048})
      for (int64_t n_rows : {1, 5, 64, 133}) shapes.push_back({rows, cols, n_rows});
  for (DType type : kKQuantTypes) {
    KQuantStats stats;
    for (const Shape& s : shapes) {
      CheckKQuantShape(type, s, rng, stats);
      if (HasFatalFailure()) return;
    }
    for (const auto& [isa, e] : stats.vs_dequantized) {
      std::printf("[quant_gemm] %s %-10s vs dequantized weights x Q8_K activations: max abs %.3g, max rel %.3g\n",
                  DTypeName(type), isa.c_str(), e.max_abs, e.max_rel);
    }
    std::printf("[quant_gemm] %s vs fp32 activations: max abs %.3g, max error / bound %.3g | between paths: max abs "
                "%.3g, max rel %.3g\n",
                DTypeName(type), stats.vs_fp32_activations.max_abs, stats.vs_fp32_activations.max_rel,
                stats.between_paths.max_abs, stats.between_paths.max_rel);
  }
}

}  // namespace
}  // namespace kvflow::cpu
