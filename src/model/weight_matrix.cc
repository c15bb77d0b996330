#include "model/weight_matrix.h"

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
