#include "backend/cpu/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "util/thread_pool.h"

namespace kvflow::cpu {

void MatmulTransposedB(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                       bool accumulate, int64_t ldy) {
  const float beta = accumulate ? 1.0f : 0.0f;
  if (ldy == 0) ldy = N;
  // OpenBLAS runs single-threaded (InitBlas); the backend's pool splits the output features, in
  // multiples of 16 so each thread's sgemm keeps whole vector tiles.
  const int64_t threads = CurrentThreads();
  const int64_t chunk = N >= 64 ? ((N + threads - 1) / threads + 15) / 16 * 16 : N;
  ParallelFor(
      N,
      [&](int64_t n0, int64_t n1) {
        const int64_t n = n1 - n0;
        if (M == 1) {
          cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(K), 1.0f,
                      w + n0 * K, static_cast<blasint>(K), x, 1, beta, y + n0, 1);
        } else {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(M), static_cast<blasint>(n),
                      static_cast<blasint>(K), 1.0f, x, static_cast<blasint>(K), w + n0 * K,
                      static_cast<blasint>(K), beta, y + n0, static_cast<blasint>(ldy));
        }
      },
      chunk, N >= 64 ? 2 : N + 1);
}

void AddBias(float* y, const float* bias, int64_t rows, int64_t n) {
  ParallelFor(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* yr = y + r * n;
      for (int64_t i = 0; i < n; ++i) yr[i] += bias[i];
    }
  }, 0, rows * n > 16384 ? 2 : rows + 1);
}

void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps) {
  ParallelFor(rows, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
  });
}

void HeadRmsNorm(float* x, int64_t row_stride, int64_t first, int64_t rows, int64_t heads, int64_t head_dim,
                 const float* weight, float eps) {
  ParallelFor(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + r * row_stride + first + h * head_dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < head_dim; ++i) sum += v[i] * v[i];
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(head_dim) + eps);
        for (int64_t i = 0; i < head_dim; ++i) v[i] = weight[i] * (v[i] * inv);
      }
    }
  });
}

void SiluMul(const float* gate_up, float* out, int64_t rows, int64_t n) {
  // Rows of a decode batch are short: below ~16K elements the work is not worth a wake-up.
  ParallelFor(rows, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
  }, 0, rows * n > 16384 ? 2 : rows + 1);
}

void GeluTanhMul(const float* gate_up, float* out, int64_t rows, int64_t n) {
  // PyTorch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  ParallelFor(rows, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      o[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x))) * u[i];
    }
  }
  }, 0, rows * n > 16384 ? 2 : rows + 1);
}

void InitBlas() { openblas_set_num_threads(1); }

}  // namespace kvflow::cpu
