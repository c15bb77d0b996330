// InfiniGen's two per-token computations, as plain functions: the CPU path runs them and they are
// the reference of the CUDA kernels (kernels/infinigen_score.cu).
#pragma once

#include <cstdint>

#include "infinigen/skew_file.h"

namespace kvflow {

// out[t][c] = (row_t . A)[columns[c]] for `n` rows of head_dim floats (row t at rows + t *
// row_stride): the partial columns of skewed keys (or queries), n x columns.size() floats.
void SkewPartialColumns(const float* rows, int64_t n, int64_t row_stride, const SkewHead& head, int head_dim,
                        float* out);

// scores[t] = max over the `group` query rows q_j (group x p floats) of q_j . keys[t] (keys: n x p
// floats): a KV head's speculated score of each cached token, the best of its query heads.
void ScorePartialKeys(const float* queries, int group, const float* keys, int64_t n, int p, float* scores);

}  // namespace kvflow
