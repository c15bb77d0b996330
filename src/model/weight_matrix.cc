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

// Bytes one element range of `cols` columns of a part's row takes (whole blocks for quantized parts).
static size_t PartRowBytes(const WeightPart& p, int64_t cols) {
  return p.dtype == DType::kF32 ? static_cast<size_t>(cols) * sizeof(float) : p.row_bytes(cols);
}

WeightMatrix SliceRows(const WeightMatrix& m, std::span<const std::pair<int64_t, int64_t>> ranges) {
  WeightMatrix out;
  out.cols = m.cols;
  for (auto [first, count] : ranges) {
    int64_t part_first = 0;
    for (const WeightPart& p : m.parts) {
      const int64_t lo = std::max(first, part_first), hi = std::min(first + count, part_first + p.rows);
      if (lo < hi) {
        WeightPart piece;
        piece.dtype = p.dtype;
        piece.rows = hi - lo;
        const size_t row = PartRowBytes(p, m.cols);
        const auto* src = p.dtype == DType::kF32 ? reinterpret_cast<const uint8_t*>(p.f32.data()) : p.blocks.data();
        const uint8_t* begin = src + static_cast<size_t>(lo - part_first) * row;
        if (p.dtype == DType::kF32) {
          piece.f32.assign(reinterpret_cast<const float*>(begin),
                           reinterpret_cast<const float*>(begin + static_cast<size_t>(piece.rows) * row));
        } else {
          piece.blocks.assign(begin, begin + static_cast<size_t>(piece.rows) * row);
        }
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
    const int64_t block = p.dtype == DType::kF32 ? 1 : DTypeBlockElements(p.dtype);
    if (first % block != 0 || count % block != 0) {
      return Status::InvalidArgument(std::string("a ") + DTypeName(p.dtype) + " matrix splits only along whole blocks of " +
                                     std::to_string(block) + " columns, not at columns " + std::to_string(first) +
                                     " and " + std::to_string(first + count));
    }
    WeightPart piece;
    piece.dtype = p.dtype;
    piece.rows = p.rows;
    const size_t in_row = PartRowBytes(p, m.cols), out_row = PartRowBytes(p, count);
    const size_t skip = PartRowBytes(p, first);
    const auto* src = p.dtype == DType::kF32 ? reinterpret_cast<const uint8_t*>(p.f32.data()) : p.blocks.data();
    std::vector<uint8_t> bytes(static_cast<size_t>(p.rows) * out_row);
    for (int64_t r = 0; r < p.rows; ++r) {
      std::memcpy(bytes.data() + static_cast<size_t>(r) * out_row, src + static_cast<size_t>(r) * in_row + skip, out_row);
    }
    if (p.dtype == DType::kF32) {
      piece.f32.resize(bytes.size() / sizeof(float));
      std::memcpy(piece.f32.data(), bytes.data(), bytes.size());
    } else {
      piece.blocks = std::move(bytes);
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
