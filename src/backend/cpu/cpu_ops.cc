#include "backend/cpu/cpu_ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

namespace kvflow::cpu {

void MatmulTransposedB(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                       bool accumulate) {
  const float beta = accumulate ? 1.0f : 0.0f;
  // OpenBLAS runs single-threaded; OpenMP splits the output features across threads. One thread
  // pool only: OpenMP workers spinning between regions would starve OpenBLAS's own threads.
  const int64_t threads = omp_get_max_threads();
  const int64_t chunk = ((N + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel for schedule(static) if (threads > 1 && N >= 64)
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    if (M == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(K), 1.0f, w + n0 * K,
                  static_cast<blasint>(K), x, 1, beta, y + n0, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(M), static_cast<blasint>(n),
                  static_cast<blasint>(K), 1.0f, x, static_cast<blasint>(K), w + n0 * K, static_cast<blasint>(K),
                  beta, y + n0, static_cast<blasint>(N));
    }
  }
}

void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void SiluMul(const float* gate_up, float* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n > 16384)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void SetNumThreads(int n) {
  openblas_set_num_threads(1);
  if (n <= 0) return;
  omp_set_num_threads(n);
  openblas_set_num_threads(1);
}

int NumThreads() { return omp_get_max_threads(); }

}  // namespace kvflow::cpu
