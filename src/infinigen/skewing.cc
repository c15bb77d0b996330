#include "infinigen/skewing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvflow {

std::vector<float> SkewingMatrix(std::span<const float> queries, int64_t n, int dim,
                                 std::vector<double>* singular_values) {
  const size_t d = static_cast<size_t>(dim);
  // G = Q^T Q (symmetric), V = identity; Jacobi rotations diagonalize G and accumulate into V.
  std::vector<double> g(d * d, 0.0), v(d * d, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    const float* q = queries.data() + static_cast<size_t>(r) * d;
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = i; j < d; ++j) g[i * d + j] += static_cast<double>(q[i]) * q[j];
    }
  }
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < i; ++j) g[i * d + j] = g[j * d + i];
    v[i * d + i] = 1.0;
  }
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0, diag = 0.0;
    for (size_t i = 0; i < d; ++i) {
      diag += g[i * d + i] * g[i * d + i];
      for (size_t j = i + 1; j < d; ++j) off += g[i * d + j] * g[i * d + j];
    }
    if (off <= 1e-30 * std::max(diag, 1e-300)) break;
    for (size_t p = 0; p < d; ++p) {
      for (size_t q = p + 1; q < d; ++q) {
        const double gpq = g[p * d + q];
        if (std::fabs(gpq) < 1e-300) continue;
        // The rotation that zeroes G[p][q] (Golub & Van Loan, sym.schur2).
        const double tau = (g[q * d + q] - g[p * d + p]) / (2.0 * gpq);
        const double t = (tau >= 0 ? 1.0 : -1.0) / (std::fabs(tau) + std::sqrt(1.0 + tau * tau));
        const double c = 1.0 / std::sqrt(1.0 + t * t), s = t * c;
        for (size_t k = 0; k < d; ++k) {  // G <- G J (columns p, q)
          const double gkp = g[k * d + p], gkq = g[k * d + q];
          g[k * d + p] = c * gkp - s * gkq;
          g[k * d + q] = s * gkp + c * gkq;
        }
        for (size_t k = 0; k < d; ++k) {  // G <- J^T G (rows p, q)
          const double gpk = g[p * d + k], gqk = g[q * d + k];
          g[p * d + k] = c * gpk - s * gqk;
          g[q * d + k] = s * gpk + c * gqk;
        }
        for (size_t k = 0; k < d; ++k) {  // V <- V J
          const double vkp = v[k * d + p], vkq = v[k * d + q];
          v[k * d + p] = c * vkp - s * vkq;
          v[k * d + q] = s * vkp + c * vkq;
        }
      }
    }
  }
  // Columns by decreasing eigenvalue (= squared singular value).
  std::vector<size_t> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return g[a * d + a] > g[b * d + b]; });
  std::vector<float> a(d * d);
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j < d; ++j) a[i * d + j] = static_cast<float>(v[i * d + order[j]]);
  }
  if (singular_values) {
    singular_values->clear();
    for (size_t j : order) singular_values->push_back(std::sqrt(std::max(0.0, g[j * d + j])));
  }
  return a;
}

void ApplySkew(std::span<float> rows, int64_t n, int dim, std::span<const float> a) {
  const size_t d = static_cast<size_t>(dim);
  std::vector<float> out(d);
  for (int64_t r = 0; r < n; ++r) {
    float* x = rows.data() + static_cast<size_t>(r) * d;
    std::fill(out.begin(), out.end(), 0.0f);
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) out[j] += x[i] * a[i * d + j];
    }
    std::copy(out.begin(), out.end(), x);
  }
}

}  // namespace kvflow
