// GGUF (v2/v3) reader: metadata key/values and tensor views over a memory-mapped file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvflow/status.h"
#include "kvflow/tokenizer.h"
#include "model/mapped_file.h"
#include "model/tensor_source.h"

namespace kvflow {

class GgufCursor;

// Metadata value types as numbered in the GGUF spec.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
const char* GgufTypeName(GgufType t);

// ggml tensor type ids this reader can hand out (the rest are refused as Unsupported).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30
};

class GgufFile : public TensorSource {
 public:
  // Parses and validates the whole header; tensor data stays in the mapping untouched.
  static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);

  uint32_t version() const { return version_; }
  const std::string& path() const { return file_->path(); }
  uint32_t alignment() const { return alignment_; }
  size_t data_offset() const { return data_offset_; }

  bool Has(const std::string& key) const { return metadata_.count(key) != 0; }
  std::vector<std::string> Keys() const;  // in file order
  // Getters fail with NotFound for a missing key and CorruptFile for a value of the wrong type.
  // Integer getters accept any integer type whose value fits; GetF32 also accepts float64.
  Result<std::string> GetString(const std::string& key) const;
  Result<uint32_t> GetU32(const std::string& key) const;
  Result<int32_t> GetI32(const std::string& key) const;
  Result<uint64_t> GetU64(const std::string& key) const;
  Result<float> GetF32(const std::string& key) const;
  Result<bool> GetBool(const std::string& key) const;
  Result<std::vector<std::string>> GetStringArray(const std::string& key) const;
  Result<std::vector<int64_t>> GetIntArray(const std::string& key) const;
  // An array of float32 or float64 (or of integers, converted).
  Result<std::vector<float>> GetFloatArray(const std::string& key) const;
  // Element count of an array value (without decoding it).
  Result<uint64_t> GetArrayLength(const std::string& key) const;

  // TensorSource.
  const TensorInfo* Find(const std::string& name) const override;
  std::vector<std::string> Names() const override;
  std::string Describe() const override;

 private:
  // A value is decoded on demand from the (already validated) bytes at `offset`; for arrays the
  // offset is that of the first element.
  struct Value {
    GgufType type;
    GgufType element_type = GgufType::kUint8;  // arrays only
    uint64_t count = 0;                        // arrays only
    size_t offset = 0;
  };

  explicit GgufFile(std::unique_ptr<MappedFile> file) : file_(std::move(file)) {}
  Status Parse();
  Status ParseMetadata(GgufCursor& cursor, uint64_t kv_count);
  Status ParseTensorInfos(GgufCursor& cursor, uint64_t tensor_count);
  Status PlaceTensorData();
  Status Corrupt(const std::string& what) const;
  Result<const Value*> Lookup(const std::string& key) const;
  Result<int64_t> GetInteger(const std::string& key, int64_t min, int64_t max) const;

  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  size_t data_offset_ = 0;
  std::vector<std::string> keys_;
  std::unordered_map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::vector<uint64_t> tensor_offsets_;  // relative to data_offset_, parallel to tensors_
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Byte-level BPE tokenizer description from `tokenizer.ggml.*` metadata. Unsupported when the
// file's tokenizer is not byte-level BPE ("gpt2"), NotFound when it carries no tokenizer at all.
Result<TokenizerSpec> TokenizerSpecFromGguf(const GgufFile& gguf);

}  // namespace kvflow
