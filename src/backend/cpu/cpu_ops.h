// fp32 building blocks of the CPU reference backend. Multithreaded with OpenMP / OpenBLAS.
#pragma once

#include <cstdint>

namespace kvflow::cpu {

// y[M, N] = x[M, K] * w[N, K]^T (+ y when accumulate). w is row-major [out, in] as HF stores it.
void MatmulTransposedB(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                       bool accumulate = false);

// out[r] = x[r] / rms(x[r]) * weight, for each of `rows` rows of length n.
void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps);

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]: gate and up halves side by side per row.
void SiluMul(const float* gate_up, float* out, int64_t rows, int64_t n);

void SetNumThreads(int n);
int NumThreads();

}  // namespace kvflow::cpu
