// InfiniGen's skewing (src/infinigen/skewing.h): the matrix is orthogonal, Q~ K~^T equals Q K^T,
// it recovers a known SVD (singular values and the directions up to sign), and skewed queries put
// their magnitude into the first columns, which is what makes a 30% partial key cache speculate well.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "infinigen/skewing.h"

namespace kvflow {
namespace {

// A random orthogonal d x d matrix (Gram-Schmidt of Gaussian columns), row-major.
std::vector<double> RandomOrthogonal(int d, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> w(static_cast<size_t>(d * d));
  for (double& x : w) x = normal(rng);
  for (int j = 0; j < d; ++j) {
    for (int k = 0; k < j; ++k) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += w[i * d + j] * w[i * d + k];
      for (int i = 0; i < d; ++i) w[i * d + j] -= dot * w[i * d + k];
    }
    double norm = 0;
    for (int i = 0; i < d; ++i) norm += w[i * d + j] * w[i * d + j];
    for (int i = 0; i < d; ++i) w[i * d + j] /= std::sqrt(norm);
  }
  return w;
}

TEST(InfiniGenSkewing, OrthogonalAndLeavesScoresUnchanged) {
  for (int dim : {64, 40}) {
    std::mt19937 rng(dim);
    std::normal_distribution<float> normal;
    const int n = 300, m = 50;
    std::vector<float> q(static_cast<size_t>(n * dim)), k(static_cast<size_t>(m * dim));
    for (float& x : q) x = normal(rng) * (1.0f + 3.0f * static_cast<float>(rng() % 2));
    for (float& x : k) x = normal(rng);
    const std::vector<float> a = SkewingMatrix(q, n, dim);
    double ortho = 0;
    for (int i = 0; i < dim; ++i) {
      for (int j = 0; j < dim; ++j) {
        double dot = 0;
        for (int r = 0; r < dim; ++r) dot += double(a[r * dim + i]) * a[r * dim + j];
        ortho = std::max(ortho, std::fabs(dot - (i == j ? 1.0 : 0.0)));
      }
    }
    std::vector<float> qs = q, ks = k;
    ApplySkew(qs, n, dim, a);
    ApplySkew(ks, m, dim, a);
    double max_rel = 0;
    for (int i = 0; i < n; i += 7) {
      for (int j = 0; j < m; ++j) {
        double ref = 0, got = 0, scale = 0;
        for (int t = 0; t < dim; ++t) {
          ref += double(q[i * dim + t]) * k[j * dim + t];
          got += double(qs[i * dim + t]) * ks[j * dim + t];
          scale += std::fabs(double(q[i * dim + t]) * k[j * dim + t]);
        }
        max_rel = std::max(max_rel, std::fabs(got - ref) / scale);
      }
    }
    std::printf("  head_dim %d: max |A^T A - I| %.1e, max |Q~K~^T - QK^T| / sum|q k| %.1e\n", dim, ortho, max_rel);
    EXPECT_LT(ortho, 1e-6);
    EXPECT_LT(max_rel, 1e-6);
  }
}

TEST(InfiniGenSkewing, RecoversAKnownSvdAndConcentratesMagnitude) {
  const int dim = 64, n = 2048;
  std::mt19937 rng(9);
  const std::vector<double> w = RandomOrthogonal(dim, rng);
  // Q = Z diag(s) W^T with white Z: singular values ~ s * sqrt(n), right singular vectors W.
  std::vector<double> s(dim);
  for (int j = 0; j < dim; ++j) s[j] = 8.0 * std::exp(-0.15 * j) + 0.05;
  std::normal_distribution<double> normal;
  std::vector<float> q(static_cast<size_t>(n * dim));
  std::vector<double> z(dim);
  for (int r = 0; r < n; ++r) {
    for (double& x : z) x = normal(rng);
    for (int i = 0; i < dim; ++i) {
      double x = 0;
      for (int j = 0; j < dim; ++j) x += z[j] * s[j] * w[i * dim + j];
      q[r * dim + i] = static_cast<float>(x);
    }
  }
  std::vector<double> sv;
  const std::vector<float> a = SkewingMatrix(q, n, dim, &sv);
  for (int j = 0; j + 1 < dim; ++j) EXPECT_GE(sv[j], sv[j + 1]);
  // The leading directions are W's first columns, up to sign.
  for (int j = 0; j < 4; ++j) {
    double dot = 0;
    for (int i = 0; i < dim; ++i) dot += a[i * dim + j] * w[i * dim + j];
    EXPECT_GT(std::fabs(dot), 0.99) << "column " << j;
    EXPECT_NEAR(sv[j] / std::sqrt(double(n)), s[j], 0.1 * s[j]);
  }
  // Magnitude: the first 30% of the skewed columns hold far more of |Q~| than the best 30% of Q's.
  std::vector<float> qs = q;
  ApplySkew(qs, n, dim, a);
  auto top_share = [&](const std::vector<float>& m, bool first) {
    std::vector<double> col(dim, 0.0);
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < dim; ++i) col[i] += double(m[r * dim + i]) * m[r * dim + i];
    }
    const double total = std::accumulate(col.begin(), col.end(), 0.0);
    if (!first) std::sort(col.begin(), col.end(), std::greater<>());
    return std::accumulate(col.begin(), col.begin() + dim * 3 / 10, 0.0) / total;
  };
  const double skewed = top_share(qs, true), plain = top_share(q, false);
  std::printf("  share of ||Q||^2 in 30%% of the columns: skewed (first) %.3f, unskewed (best) %.3f\n", skewed, plain);
  EXPECT_GT(skewed, 0.95);
  EXPECT_GT(skewed, plain + 0.3);
}

}  // namespace
}  // namespace kvflow
