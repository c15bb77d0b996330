// fp32 building blocks of the CPU backend, parallel on the current thread pool (util/thread_pool.h).
#pragma once

#include <cstdint>

namespace kvflow::cpu {

// y[M, N] = x[M, K] * w[N, K]^T (+ y when accumulate). w is row-major [out, in] as HF stores it;
// y's rows are ldy apart (0: N).
void MatmulTransposedB(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                       bool accumulate = false, int64_t ldy = 0);

// y[r, i] += bias[i] for each of `rows` rows of n (a Linear layer's bias, after its product).
void AddBias(float* y, const float* bias, int64_t rows, int64_t n);

// out[r] = x[r] / rms(x[r]) * weight, for each of `rows` rows of length n.
void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps);
// In place, per head: for each of `rows` rows (`row_stride` apart) and each of its `heads` heads of
// head_dim values from offset `first`, head = RmsNorm(head) * weight (Qwen3's q_norm / k_norm).
void HeadRmsNorm(float* x, int64_t row_stride, int64_t first, int64_t rows, int64_t heads, int64_t head_dim,
                 const float* weight, float eps);

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i]: gate and up halves side by side per row.
void SiluMul(const float* gate_up, float* out, int64_t rows, int64_t n);
// The same with PyTorch's tanh-approximated GELU (GeGLU, Gemma's gelu_pytorch_tanh).
void GeluTanhMul(const float* gate_up, float* out, int64_t rows, int64_t n);

// OpenBLAS runs single-threaded inside our pool's threads (its own threads would compete).
void InitBlas();

}  // namespace kvflow::cpu
