// InfiniGen's skewing (seed 000, §4.2), the offline step: for one head, an orthogonal matrix A such
// that the queries Q~ = Q A (and keys K~ = K A) concentrate their magnitude in a few columns, while
// Q~ K~^T = Q A A^T K^T = Q K^T is unchanged. A = V of the SVD Q = U S V^T of sample queries.
//
// With rotary embeddings A cannot be folded into W_Q and W_K (RoPE sits between the projection and
// the dot product), so it is applied to the rotated queries and keys at run time, as the published
// Llama code does; the sample queries are therefore post-RoPE.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvflow {

// A for one head from `n` sample query rows of `dim` floats (row-major): the eigenvectors of Q^T Q
// (= V), by cyclic Jacobi rotations in double precision, columns ordered by decreasing singular
// value; row-major dim x dim (A[i * dim + j]: row i, column j). `singular_values` (optional)
// receives S in the same order.
std::vector<float> SkewingMatrix(std::span<const float> queries, int64_t n, int dim,
                                 std::vector<double>* singular_values = nullptr);

// rows[r] <- rows[r] A for `n` rows of `dim` floats, in place.
void ApplySkew(std::span<float> rows, int64_t n, int dim, std::span<const float> a);

}  // namespace kvflow
