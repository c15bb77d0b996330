// A weight matrix as a backend computes with it: fp32, or rows kept in the file's ggml block
// quantization (issue: dequantizing every weight to fp32 reads ~6x the bytes of Q4 per decode step).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvflow/status.h"
#include "model/tensor_source.h"

namespace kvflow {

// Rows of one storage format.
struct WeightPart {
  DType dtype = DType::kF32;
  int64_t rows = 0;
  std::vector<float> f32;       // dtype kF32: rows x cols floats
  std::vector<uint8_t> blocks;  // quantized: rows x row_bytes(cols), ggml blocks along each row;
                                // kF16 / kBF16: rows x cols 2-byte elements

  size_t row_bytes(int64_t cols) const;
};

// [rows, cols], row-major in HF order ([out_features, in_features]). A fused matrix (Q/K/V,
// gate/up) whose tensors came in different formats (a Q4_K_M file stores V as Q6_K) keeps one part
// per run of rows in one format; the parts' rows follow each other.
struct WeightMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<WeightPart> parts;

  bool empty() const { return rows == 0; }
  // One fp32 part: what the CUDA backend and the exact CPU mode compute with.
  bool is_f32() const { return parts.size() == 1 && parts[0].dtype == DType::kF32; }
  // The fp32 rows; needs is_f32().
  const std::vector<float>& f32() const { return parts.at(0).f32; }
  std::vector<float>& f32() { return parts.at(0).f32; }
  // Bytes the rows take in memory (what a GEMV reads).
  size_t bytes() const;
  int64_t num_parameters() const { return rows * cols; }
  // Row r as fp32 into out[cols] (embedding lookup).
  void DequantizeRow(int64_t r, float* out) const;
  // Appends the rows of `part` (cols wide), merging with the last part when the format matches.
  void Append(WeightPart part);
  // "Q4_1" or "Q4_1+Q6_K" or "F32" or "BF16".
  std::string FormatName() const;
};

// The rows [first, first + count) of each range, in order, in their formats (rows are whole in
// every format: tensor parallelism's column-parallel split).
WeightMatrix SliceRows(const WeightMatrix& m, std::span<const std::pair<int64_t, int64_t>> ranges);
// The columns [first, first + count) of every row (the row-parallel split). A quantized part splits
// only along whole blocks: InvalidArgument naming the format and its block size otherwise.
Result<WeightMatrix> SliceColumns(const WeightMatrix& m, int64_t first, int64_t count);

// Converts one tensor to a part: quantized formats the CPU kernels compute with, and F16 / BF16,
// stay as they are when `keep_quantized`, everything else becomes fp32.
Result<WeightPart> ReadWeightPart(const TensorInfo& info, bool keep_quantized);
// Whether a format can be computed with in its blocks (CPU kernels exist).
bool IsComputableQuantization(DType t);

}  // namespace kvflow
