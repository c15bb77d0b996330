#include "infinigen/partial_keys.h"

#include <algorithm>
#include <cmath>

namespace kvflow {

void SkewPartialColumns(const float* rows, int64_t n, int64_t row_stride, const SkewHead& head, int head_dim,
                        float* out) {
  const int D = head_dim;
  const int P = static_cast<int>(head.columns.size());
  for (int64_t t = 0; t < n; ++t) {
    const float* x = rows + t * row_stride;
    float* o = out + t * P;
    for (int c = 0; c < P; ++c) {
      const int col = head.columns[static_cast<size_t>(c)];
      float acc = 0.0f;
      for (int d = 0; d < D; ++d) acc += x[d] * head.matrix[static_cast<size_t>(d) * D + col];
      o[c] = acc;
    }
  }
}

void ScorePartialKeys(const float* queries, int group, const float* keys, int64_t n, int p, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * p;
    float best = -INFINITY;
    for (int j = 0; j < group; ++j) {
      const float* q = queries + static_cast<int64_t>(j) * p;
      float acc = 0.0f;
      for (int c = 0; c < p; ++c) acc += q[c] * k[c];
      best = std::max(best, acc);
    }
    scores[t] = best;
  }
}

}  // namespace kvflow
