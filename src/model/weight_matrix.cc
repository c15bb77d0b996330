#include "model/weight_matrix.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvflow {

size_t WeightPart::row_bytes(int64_t cols) const {
  return static_cast<size_t>(cols / DTypeBlockElements(dtype)) * DTypeBlockBytes(dtype);
}

size_t WeightMatrix::bytes() const {
  size_t total = 0;
  for (const WeightPart& p : parts) total += p.dtype == DType::kF32 ? p.f32.size() * sizeof(float) : p.blocks.size();
  return total;
}

void WeightMatrix::DequantizeRow(int64_t r, float* out) const {
  for (const WeightPart& p : parts) {
    if (r >= p.rows) {
      r -= p.rows;
      continue;
    }
    if (p.dtype == DType::kF32) {
      std::memcpy(out, p.f32.data() + r * cols, sizeof(float) * static_cast<size_t>(cols));
      return;
    }
    TensorInfo row;
    row.dtype = p.dtype;
    row.shape = {cols};
    row.nbytes = p.row_bytes(cols);
    row.data = p.blocks.data() + static_cast<size_t>(r) * row.nbytes;
    (void)DequantizeToF32(row, out);  // a part's rows were checked when it was read
    return;
  }
  throw std::out_of_range("WeightMatrix::DequantizeRow: row past the matrix");
}

void WeightMatrix::Append(WeightPart part) {
  rows += part.rows;
  if (!parts.empty() && parts.back().dtype == part.dtype) {
    WeightPart& last = parts.back();
    last.rows += part.rows;
    last.f32.insert(last.f32.end(), part.f32.begin(), part.f32.end());
    last.blocks.insert(last.blocks.end(), part.blocks.begin(), part.blocks.end());
    return;
  }
  parts.push_back(std::move(part));
}

std::string WeightMatrix::FormatName() const {
  std::string name;
  for (const WeightPart& p : parts) name += (name.empty() ? "" : "+") + std::string(DTypeName(p.dtype));
  return name;
}

namespace {

// A part's rows as bytes (fp32 parts keep theirs as floats), and a part of `rows` rows of
// `row_bytes` each in `dtype`, with its storage sized.
const uint8_t* PartBytes(const WeightPart& p) {
  return p.dtype == DType::kF32 ? reinterpret_cast<const uint8_t*>(p.f32.data()) : p.blocks.data();
}

WeightPart EmptyPart(DType dtype, int64_t rows, size_t row_bytes, uint8_t** bytes) {
  WeightPart part;
  part.dtype = dtype;
  part.rows = rows;
  const size_t total = static_cast<size_t>(rows) * row_bytes;
  if (dtype == DType::kF32) {
    part.f32.resize(total / sizeof(float));
    *bytes = reinterpret_cast<uint8_t*>(part.f32.data());
  } else {
    part.blocks.resize(total);
    *bytes = part.blocks.data();
  }
  return part;
}

}  // namespace

WeightMatrix SliceRows(const WeightMatrix& m, std::span<const std::pair<int64_t, int64_t>> ranges) {
  WeightMatrix out;
  out.cols = m.cols;
  for (auto [first, count] : ranges) {
    int64_t part_first = 0;
    for (const WeightPart& p : m.parts) {
      const int64_t lo = std::max(first, part_first), hi = std::min(first + count, part_first + p.rows);
      if (lo < hi) {
        const size_t row = p.row_bytes(m.cols);
        uint8_t* dst = nullptr;
        WeightPart piece = EmptyPart(p.dtype, hi - lo, row, &dst);
        std::memcpy(dst, PartBytes(p) + static_cast<size_t>(lo - part_first) * row, static_cast<size_t>(hi - lo) * row);
        out.Append(std::move(piece));
      }
      part_first += p.rows;
    }
  }
  return out;
}

Result<WeightMatrix> SliceColumns(const WeightMatrix& m, int64_t first, int64_t count) {
  if (first < 0 || count <= 0 || first + count > m.cols) {
    return Status::InvalidArgument("columns [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                   ") of a matrix of " + std::to_string(m.cols));
  }
  WeightMatrix out;
  out.cols = count;
  for (const WeightPart& p : m.parts) {
    const int64_t block = DTypeBlockElements(p.dtype);
    if (first % block != 0 || count % block != 0) {
      return Status::InvalidArgument(std::string("a ") + DTypeName(p.dtype) + " matrix splits only along whole blocks of " +
                                     std::to_string(block) + " columns, not at columns " + std::to_string(first) +
                                     " and " + std::to_string(first + count));
    }
    const size_t in_row = p.row_bytes(m.cols), out_row = p.row_bytes(count), skip = p.row_bytes(first);
    uint8_t* dst = nullptr;
    WeightPart piece = EmptyPart(p.dtype, p.rows, out_row, &dst);
    const uint8_t* src = PartBytes(p);
    for (int64_t r = 0; r < p.rows; ++r) {
      std::memcpy(dst + static_cast<size_t>(r) * out_row, src + static_cast<size_t>(r) * in_row + skip, out_row);
    }
    out.Append(std::move(piece));
  }
  return out;
}

bool IsComputableQuantization(DType t) {
  switch (t) {
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ8_0:
    case DType::kQ2_K:
    case DType::kQ3_K:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K: return true;
    default: return false;
  }
}

Result<WeightPart> ReadWeightPart(const TensorInfo& info, bool keep_quantized) {
  WeightPart part;
  // Rows: the product of every extent but the last (no division: a file may give a zero extent).
  part.rows = 1;
  for (size_t i = 0; i + 1 < info.shape.size(); ++i) part.rows *= info.shape[i];
  const bool half = info.dtype == DType::kF16 || info.dtype == DType::kBF16;  // backend/cpu/half_gemm.h
  if (keep_quantized && (IsComputableQuantization(info.dtype) || half)) {
    const int64_t block = DTypeBlockElements(info.dtype);
    if (info.shape.empty() || info.shape.back() % block != 0 ||
        info.nbytes != static_cast<size_t>(info.numel() / block) * DTypeBlockBytes(info.dtype) || !info.data) {
      return Status::InvalidArgument(info.file + ": tensor '" + info.name + "': " + std::to_string(info.nbytes) +
                                     " bytes do not hold its " + DTypeName(info.dtype) + " blocks");
    }
    part.dtype = info.dtype;
    part.blocks.assign(info.data, info.data + info.nbytes);
    return part;
  }
  part.f32.resize(static_cast<size_t>(info.numel()));
  KVFLOW_RETURN_IF_ERROR(DequantizeToF32(info, part.f32.data()));
  return part;
}

}  // namespace kvflow
