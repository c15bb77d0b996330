// InfiniGen's per-model skewing file (seed 000, §4.2), written once by `kvflow skew` and read at
// engine start: for every layer and KV head, an orthogonal skewing matrix A (applied to post-RoPE
// queries and keys at run time: with rotary embeddings A cannot be folded into W_Q / W_K, since
// RoPE sits between the projection and the dot product) and the partial column indices, the
// columns of Q·A and K·A that carry most of the magnitude.
//
// With grouped-query attention one A serves a KV head and every query head of its group: the
// key is shared, and Q_h·A·(K·A)^T = Q_h·K^T holds for any orthogonal A, so A is taken from the
// SVD of the group's queries stacked together and the group shares one set of partial columns
// (the speculation then scores each query head against the one partial key cache of its KV head).
//
// Layout (little-endian): "KVFSKEW1", u32 version, u32 num_layers, num_heads, num_kv_heads,
// head_dim, num_partial_columns, u32 calibration_tokens, f64 partial_ratio, u32 name length + the
// model name, then per layer and KV head A (head_dim x head_dim fp32, row-major: x~ = x·A) and the
// partial columns (int32, ascending), then u64 FNV-1a of every byte before it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvflow/config.h"
#include "kvflow/status.h"

namespace kvflow {

struct SkewHead {
  std::vector<float> matrix;     // head_dim x head_dim, row-major: x~[c] = sum_d x[d] * matrix[d * head_dim + c]
  std::vector<int32_t> columns;  // partial columns of x~, ascending
};

struct SkewTable {
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int num_partial_columns = 0;
  int64_t calibration_tokens = 0;
  double partial_ratio = 0.0;
  std::string model_name;
  std::vector<SkewHead> heads;  // layer * num_kv_heads + kv_head

  const SkewHead& at(int layer, int kv_head) const { return heads[static_cast<size_t>(layer) * num_kv_heads + kv_head]; }
};

// Where the engine looks for a model's skewing file unless told otherwise.
std::string DefaultSkewPath(const std::string& model_path);

Status WriteSkewTable(const SkewTable& table, const std::string& path);
// Reads and checks a skewing file against the model it is for: a missing, truncated, corrupt
// (checksum, non-orthogonal matrix, bad column indices) or other model's file is a clear error.
Result<SkewTable> ReadSkewTable(const std::string& path, const ModelConfig& model);

}  // namespace kvflow
