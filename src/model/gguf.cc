#include "model/gguf.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <limits>
#include <type_traits>

namespace kvflow {

static_assert(std::endian::native == std::endian::little, "GGUF is read in place as little-endian");

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxArrayNesting = 8;          // deeper nesting only ever comes from garbage
constexpr uint32_t kMaxTensorDims = 4;       // GGML_MAX_DIMS
// Caps on string lengths, so a garbage length never becomes a huge allocation. Keys are limited
// by the spec, tensor names by ggml (64); no real value (chat templates included) comes close.
constexpr uint64_t kMaxKeyBytes = 65535;
constexpr uint64_t kMaxTensorNameBytes = 4096;
constexpr uint64_t kMaxStringValueBytes = 64 << 20;

bool IsIntegerType(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64: return true;
    default: return false;
  }
}

// Size of a fixed-size scalar, 0 for string/array, -1 for an id that is not a GGUF type.
int ScalarSize(uint32_t type) {
  switch (static_cast<GgufType>(type)) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool: return 1;
    case GgufType::kUint16:
    case GgufType::kInt16: return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32: return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64: return 8;
    case GgufType::kString:
    case GgufType::kArray: return 0;
  }
  return -1;
}

// Fewest bytes one value of `type` can occupy; bounds array counts before anything is allocated.
uint64_t MinEncodedSize(GgufType type) {
  if (type == GgufType::kString) return 8;  // length
  if (type == GgufType::kArray) return 12;  // element type + count
  return static_cast<uint64_t>(ScalarSize(static_cast<uint32_t>(type)));
}

// Counts are only bounded by the file size until every entry has parsed, so a huge garbage count
// must not turn into a huge up-front reservation.
size_t ReservationFor(uint64_t count) {
  return static_cast<size_t>(std::min<uint64_t>(count, 4096));
}

const char* GgmlTypeName(uint32_t type) {
  static const char* const kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2",   "Q4_3",  "Q5_0",  "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",   "Q5_K",  "Q6_K",  "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",   "F64",    "IQ1_M", "BF16"};
  return type < std::size(kNames) ? kNames[type] : "unknown";
}

bool DTypeFromGgml(uint32_t type, DType* out) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: *out = DType::kF32; return true;
    case GgmlType::kF16: *out = DType::kF16; return true;
    case GgmlType::kBF16: *out = DType::kBF16; return true;
    case GgmlType::kQ8_0: *out = DType::kQ8_0; return true;
    case GgmlType::kQ4_0: *out = DType::kQ4_0; return true;
    case GgmlType::kQ4_1: *out = DType::kQ4_1; return true;
    case GgmlType::kQ2_K: *out = DType::kQ2_K; return true;
    case GgmlType::kQ3_K: *out = DType::kQ3_K; return true;
    case GgmlType::kQ4_K: *out = DType::kQ4_K; return true;
    case GgmlType::kQ5_K: *out = DType::kQ5_K; return true;
    case GgmlType::kQ6_K: *out = DType::kQ6_K; return true;
  }
  return false;
}

}  // namespace

// Bounds-checked little-endian reads; every Read* returns false instead of running past the end.
class GgufCursor {
 public:
  GgufCursor(const uint8_t* data, size_t size, size_t pos) : data_(data), size_(size), pos_(pos) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <typename T>
  bool Read(T* out) {
    if (remaining() < sizeof(T)) return false;
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

  bool Skip(uint64_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }

  bool ReadString(std::string* out, uint64_t max_length = kMaxStringValueBytes) {
    uint64_t length;
    if (!Read(&length) || length > max_length || length > remaining()) return false;
    out->assign(reinterpret_cast<const char*>(data_ + pos_), length);
    pos_ += length;
    return true;
  }

  // Steps over one value of `type`, checking every length and count it contains.
  bool SkipValue(uint32_t type, int depth) {
    int size = ScalarSize(type);
    if (size < 0) return false;
    if (size > 0) return Skip(size);
    uint64_t length;
    if (static_cast<GgufType>(type) == GgufType::kString) {
      return Read(&length) && length <= kMaxStringValueBytes && Skip(length);
    }
    uint32_t element_type;
    uint64_t count;
    if (depth >= kMaxArrayNesting || !Read(&element_type) || !Read(&count)) return false;
    return SkipArray(element_type, count, depth + 1);
  }

  bool SkipArray(uint32_t element_type, uint64_t count, int depth) {
    int size = ScalarSize(element_type);
    if (size < 0) return false;
    if (count > remaining() / MinEncodedSize(static_cast<GgufType>(element_type))) return false;
    if (size > 0) return Skip(count * size);
    for (uint64_t i = 0; i < count; ++i) {
      if (!SkipValue(element_type, depth)) return false;
    }
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_;
};

const char* GgufTypeName(GgufType t) {
  switch (t) {
    case GgufType::kUint8: return "uint8";
    case GgufType::kInt8: return "int8";
    case GgufType::kUint16: return "uint16";
    case GgufType::kInt16: return "int16";
    case GgufType::kUint32: return "uint32";
    case GgufType::kInt32: return "int32";
    case GgufType::kFloat32: return "float32";
    case GgufType::kBool: return "bool";
    case GgufType::kString: return "string";
    case GgufType::kArray: return "array";
    case GgufType::kUint64: return "uint64";
    case GgufType::kInt64: return "int64";
    case GgufType::kFloat64: return "float64";
  }
  return "invalid";
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  std::unique_ptr<GgufFile> gguf(new GgufFile(std::move(file)));
  KVFLOW_RETURN_IF_ERROR(gguf->Parse());
  return gguf;
}

Status GgufFile::Corrupt(const std::string& what) const {
  return Status::CorruptFile(path() + ": " + what);
}

Status GgufFile::Parse() {
  GgufCursor cursor(file_->data(), file_->size(), 0);
  uint32_t magic;
  if (!cursor.Read(&magic) || magic != kGgufMagic) return Corrupt("not a GGUF file (bad magic)");
  if (!cursor.Read(&version_)) return Corrupt("truncated header");
  if (version_ == 1) return Status::Unsupported(path() + ": GGUF v1 is not supported");
  if (version_ != 2 && version_ != 3) {
    if (__builtin_bswap32(version_) <= 3) {
      return Status::Unsupported(path() + ": big-endian GGUF is not supported");
    }
    return Corrupt("unknown GGUF version " + std::to_string(version_));
  }
  uint64_t tensor_count, kv_count;
  if (!cursor.Read(&tensor_count) || !cursor.Read(&kv_count)) return Corrupt("truncated header");
  KVFLOW_RETURN_IF_ERROR(ParseMetadata(cursor, kv_count));
  KVFLOW_RETURN_IF_ERROR(ParseTensorInfos(cursor, tensor_count));

  uint64_t aligned = (cursor.pos() + alignment_ - 1) / alignment_ * alignment_;
  data_offset_ = static_cast<size_t>(aligned);
  return PlaceTensorData();
}

Status GgufFile::ParseMetadata(GgufCursor& cursor, uint64_t kv_count) {
  // A key/value takes at least 13 bytes (key length, type, one-byte value).
  if (kv_count > cursor.remaining() / 13) {
    return Corrupt("metadata count " + std::to_string(kv_count) + " exceeds the file size");
  }
  keys_.reserve(ReservationFor(kv_count));
  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key;
    uint32_t type;
    if (!cursor.ReadString(&key, kMaxKeyBytes) || !cursor.Read(&type)) {
      return Corrupt("truncated metadata key " + std::to_string(i));
    }
    if (ScalarSize(type) < 0) {
      return Corrupt("metadata '" + key + "' has invalid type " + std::to_string(type));
    }
    Value value{static_cast<GgufType>(type)};
    bool ok;
    if (value.type == GgufType::kArray) {
      uint32_t element_type;
      ok = cursor.Read(&element_type) && cursor.Read(&value.count);
      value.element_type = static_cast<GgufType>(element_type);
      value.offset = cursor.pos();
      ok = ok && cursor.SkipArray(element_type, value.count, 1);
    } else {
      value.offset = cursor.pos();
      ok = cursor.SkipValue(type, 0);
    }
    if (!ok) return Corrupt("metadata '" + key + "' is truncated or malformed");
    if (!metadata_.emplace(key, value).second) {
      return Corrupt("duplicate metadata key '" + key + "'");
    }
    keys_.push_back(std::move(key));
  }

  if (Has("general.alignment")) {
    Result<uint32_t> alignment = GetU32("general.alignment");
    if (!alignment.ok()) return alignment.status();
    if (*alignment == 0 || !std::has_single_bit(*alignment)) {
      return Corrupt("general.alignment " + std::to_string(*alignment) + " is not a power of two");
    }
    alignment_ = *alignment;
  }
  return Status::Ok();
}

Status GgufFile::ParseTensorInfos(GgufCursor& cursor, uint64_t tensor_count) {
  // A tensor info takes at least 32 bytes (name length, n_dims, one dim, type, offset).
  if (tensor_count > cursor.remaining() / 32) {
    return Corrupt("tensor count " + std::to_string(tensor_count) + " exceeds the file size");
  }
  Status unsupported;
  tensors_.reserve(ReservationFor(tensor_count));
  tensor_offsets_.reserve(ReservationFor(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    TensorInfo info;
    uint32_t n_dims;
    if (!cursor.ReadString(&info.name, kMaxTensorNameBytes) || !cursor.Read(&n_dims)) {
      return Corrupt("truncated tensor info " + std::to_string(i));
    }
    const std::string where = "tensor '" + info.name + "'";
    if (n_dims == 0 || n_dims > kMaxTensorDims) {
      return Corrupt(where + " has " + std::to_string(n_dims) + " dimensions");
    }
    info.shape.resize(n_dims);
    uint64_t numel = 1, nonzero_numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t extent;
      if (!cursor.Read(&extent)) return Corrupt("truncated " + where);
      // No ggml type packs an element into less than a bit, so anything larger cannot fit. A zero
      // extent does not exempt the others: TensorInfo::numel multiplies them in another order.
      if (extent != 0) {
        if (nonzero_numel > file_->size() * 8 / extent) return Corrupt(where + " has a shape larger than the file");
        nonzero_numel *= extent;
      }
      numel *= extent;
      info.shape[n_dims - 1 - d] = static_cast<int64_t>(extent);  // GGUF lists innermost first
    }
    uint32_t type;
    uint64_t offset;
    if (!cursor.Read(&type) || !cursor.Read(&offset)) return Corrupt("truncated " + where);

    if (!DTypeFromGgml(type, &info.dtype)) {
      // Keep parsing: a corrupt file should be reported as corrupt, not as unsupported.
      if (type >= 64) return Corrupt(where + " has invalid ggml type " + std::to_string(type));
      if (unsupported.ok()) {
        unsupported = Status::Unsupported(path() + ": " + where + " has ggml type " +
                                          GgmlTypeName(type) + " (" + std::to_string(type) +
                                          "); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K");
      }
      continue;
    }
    int64_t block = DTypeBlockElements(info.dtype);
    if (info.shape.back() % block != 0) {
      return Corrupt(where + " innermost dimension " + std::to_string(info.shape.back()) +
                     " is not a multiple of the " + DTypeName(info.dtype) + " block size (" +
                     std::to_string(block) + ")");
    }
    info.nbytes = static_cast<size_t>(numel / block * DTypeBlockBytes(info.dtype));
    info.file = path();
    if (!tensor_index_.emplace(info.name, tensors_.size()).second) {
      return Corrupt("duplicate " + where);
    }
    tensors_.push_back(std::move(info));
    tensor_offsets_.push_back(offset);
  }
  return unsupported;
}

Status GgufFile::PlaceTensorData() {
  const size_t size = file_->size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    TensorInfo& info = tensors_[i];
    uint64_t offset = tensor_offsets_[i];
    if (offset % alignment_ != 0) {
      return Corrupt("tensor '" + info.name + "' offset " + std::to_string(offset) +
                     " is not aligned to " + std::to_string(alignment_));
    }
    if (data_offset_ > size || offset > size - data_offset_ ||
        info.nbytes > size - data_offset_ - offset) {
      return Corrupt("tensor '" + info.name + "' runs past the end of the file");
    }
    info.data = file_->data() + data_offset_ + offset;
  }

  std::vector<size_t> by_offset(tensors_.size());
  for (size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(),
            [&](size_t a, size_t b) { return tensor_offsets_[a] < tensor_offsets_[b]; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    size_t prev = by_offset[k - 1], cur = by_offset[k];
    if (tensor_offsets_[prev] + tensors_[prev].nbytes > tensor_offsets_[cur]) {
      return Corrupt("tensor '" + tensors_[prev].name + "' overlaps tensor '" + tensors_[cur].name +
                     "'");
    }
  }
  return Status::Ok();
}

std::vector<std::string> GgufFile::Keys() const { return keys_; }

Result<const GgufFile::Value*> GgufFile::Lookup(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) {
    return Status::NotFound(path() + ": metadata key '" + key + "' missing");
  }
  return &it->second;
}

Result<int64_t> GgufFile::GetInteger(const std::string& key, int64_t min, int64_t max) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (!IsIntegerType(value->type)) {
    return Corrupt("metadata '" + key + "' is " + GgufTypeName(value->type) +
                   ", expected an integer");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  int64_t result = 0;
  bool in_range = true;
  auto read = [&](auto sample) {
    decltype(sample) raw;
    if (!cursor.Read(&raw)) return false;
    if constexpr (std::is_same_v<decltype(sample), uint64_t>) {
      in_range = raw <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    }
    result = static_cast<int64_t>(raw);
    return true;
  };
  bool ok = false;
  switch (value->type) {
    case GgufType::kUint8: ok = read(uint8_t{}); break;
    case GgufType::kInt8: ok = read(int8_t{}); break;
    case GgufType::kUint16: ok = read(uint16_t{}); break;
    case GgufType::kInt16: ok = read(int16_t{}); break;
    case GgufType::kUint32: ok = read(uint32_t{}); break;
    case GgufType::kInt32: ok = read(int32_t{}); break;
    case GgufType::kUint64: ok = read(uint64_t{}); break;
    case GgufType::kInt64: ok = read(int64_t{}); break;
    default: break;
  }
  if (!ok) return Corrupt("metadata '" + key + "' is truncated");
  if (!in_range || result < min || result > max) {
    return Corrupt("metadata '" + key + "' value " + std::to_string(result) + " is out of range");
  }
  return result;
}

Result<uint32_t> GgufFile::GetU32(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(int64_t v, GetInteger(key, 0, std::numeric_limits<uint32_t>::max()));
  return static_cast<uint32_t>(v);
}

Result<int32_t> GgufFile::GetI32(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(int64_t v, GetInteger(key, std::numeric_limits<int32_t>::min(),
                                                std::numeric_limits<int32_t>::max()));
  return static_cast<int32_t>(v);
}

Result<uint64_t> GgufFile::GetU64(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(int64_t v, GetInteger(key, 0, std::numeric_limits<int64_t>::max()));
  return static_cast<uint64_t>(v);
}

Result<float> GgufFile::GetF32(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  if (value->type == GgufType::kFloat32) {
    float v;
    if (cursor.Read(&v)) return v;
  } else if (value->type == GgufType::kFloat64) {
    double v;
    if (cursor.Read(&v)) return static_cast<float>(v);
  } else {
    return Corrupt("metadata '" + key + "' is " + GgufTypeName(value->type) + ", expected a float");
  }
  return Corrupt("metadata '" + key + "' is truncated");
}

Result<bool> GgufFile::GetBool(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type != GgufType::kBool) {
    return Corrupt("metadata '" + key + "' is " + GgufTypeName(value->type) + ", expected a bool");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  uint8_t v;
  if (!cursor.Read(&v)) return Corrupt("metadata '" + key + "' is truncated");
  return v != 0;
}

Result<std::string> GgufFile::GetString(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type != GgufType::kString) {
    return Corrupt("metadata '" + key + "' is " + GgufTypeName(value->type) +
                   ", expected a string");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  std::string s;
  if (!cursor.ReadString(&s)) return Corrupt("metadata '" + key + "' is truncated");
  return s;
}

Result<uint64_t> GgufFile::GetArrayLength(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type != GgufType::kArray) {
    return Corrupt("metadata '" + key + "' is " + GgufTypeName(value->type) +
                   ", expected an array");
  }
  return value->count;
}

Result<std::vector<std::string>> GgufFile::GetStringArray(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type != GgufType::kArray || value->element_type != GgufType::kString) {
    return Corrupt("metadata '" + key + "' is not an array of strings");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  std::vector<std::string> strings(value->count);  // count was bounded by the file size in Parse
  for (std::string& s : strings) {
    if (!cursor.ReadString(&s)) return Corrupt("metadata '" + key + "' is truncated");
  }
  return strings;
}

Result<std::vector<int64_t>> GgufFile::GetIntArray(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type != GgufType::kArray || !IsIntegerType(value->element_type)) {
    return Corrupt("metadata '" + key + "' is not an array of integers");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  std::vector<int64_t> ints(value->count);
  auto read_all = [&](auto sample) {
    for (int64_t& v : ints) {
      decltype(sample) raw;
      if (!cursor.Read(&raw)) return false;
      v = static_cast<int64_t>(raw);
    }
    return true;
  };
  bool ok = false;
  switch (value->element_type) {
    case GgufType::kUint8: ok = read_all(uint8_t{}); break;
    case GgufType::kInt8: ok = read_all(int8_t{}); break;
    case GgufType::kUint16: ok = read_all(uint16_t{}); break;
    case GgufType::kInt16: ok = read_all(int16_t{}); break;
    case GgufType::kUint32: ok = read_all(uint32_t{}); break;
    case GgufType::kInt32: ok = read_all(int32_t{}); break;
    case GgufType::kUint64: ok = read_all(uint64_t{}); break;
    case GgufType::kInt64: ok = read_all(int64_t{}); break;
    default: break;
  }
  if (!ok) return Corrupt("metadata '" + key + "' is truncated");
  return ints;
}

Result<std::vector<float>> GgufFile::GetFloatArray(const std::string& key) const {
  KVFLOW_ASSIGN_OR_RETURN(const Value* value, Lookup(key));
  if (value->type == GgufType::kArray && IsIntegerType(value->element_type)) {
    KVFLOW_ASSIGN_OR_RETURN(std::vector<int64_t> ints, GetIntArray(key));
    return std::vector<float>(ints.begin(), ints.end());
  }
  const bool f32 = value->element_type == GgufType::kFloat32;
  if (value->type != GgufType::kArray || (!f32 && value->element_type != GgufType::kFloat64)) {
    return Corrupt("metadata '" + key + "' is not an array of numbers");
  }
  GgufCursor cursor(file_->data(), file_->size(), value->offset);
  std::vector<float> out(value->count);
  for (float& v : out) {
    bool ok;
    if (f32) {
      ok = cursor.Read(&v);
    } else {
      double d = 0;
      ok = cursor.Read(&d);
      v = static_cast<float>(d);
    }
    if (!ok) return Corrupt("metadata '" + key + "' is truncated");
  }
  return out;
}

const TensorInfo* GgufFile::Find(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::vector<std::string> GgufFile::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const TensorInfo& info : tensors_) names.push_back(info.name);
  return names;
}

std::string GgufFile::Describe() const {
  return "GGUF v" + std::to_string(version_) + " file " + path() + ", " +
         std::to_string(tensors_.size()) + " tensors, " + std::to_string(keys_.size()) +
         " metadata keys";
}

namespace {

// Reads an optional token id, checking it names a real token.
Status ReadTokenId(const GgufFile& gguf, const std::string& key, size_t vocab, int32_t* id) {
  if (!gguf.Has(key)) return Status::Ok();
  KVFLOW_ASSIGN_OR_RETURN(uint32_t v, gguf.GetU32(key));
  if (v >= vocab) {
    return Status::CorruptFile(gguf.path() + ": " + key + " " + std::to_string(v) +
                               " is outside the vocabulary of " + std::to_string(vocab));
  }
  *id = static_cast<int32_t>(v);
  return Status::Ok();
}

// llama.cpp marks Phi-3's special tokens as swallowing the whitespace after them (HF's Phi-3
// tokenizer has rstrip on them), by the model's name, since GGUF has no key for it.
Status SetPhi3StripAttributes(const GgufFile& gguf, TokenizerSpec* spec) {
  if (!gguf.Has("general.name")) return Status::Ok();
  KVFLOW_ASSIGN_OR_RETURN(std::string name, gguf.GetString("general.name"));
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  if (name.find("phi-3") == std::string::npos && name.find("phi3") == std::string::npos) {
    return Status::Ok();
  }
  for (size_t id = 0; id < spec->tokens.size(); ++id) {
    const int32_t type = id < spec->token_types.size() ? spec->token_types[id] : 1;
    const std::string& text = spec->tokens[id];
    const bool special = type == 2 || type == 3 || type == 4 || text == "</s>";
    if (special && text != "<unk>" && text != "<s>" && text != "<|endoftext|>") {
      spec->rstrip_ids.push_back(static_cast<int32_t>(id));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<TokenizerSpec> TokenizerSpecFromGguf(const GgufFile& gguf) {
  if (!gguf.Has("tokenizer.ggml.model")) {
    return Status::NotFound(gguf.path() + ": no tokenizer metadata (tokenizer.ggml.model)");
  }
  TokenizerSpec spec;
  KVFLOW_ASSIGN_OR_RETURN(spec.model, gguf.GetString("tokenizer.ggml.model"));
  if (spec.model != "gpt2" && spec.model != "llama") {
    return Status::Unsupported(gguf.path() + ": tokenizer model '" + spec.model +
                               "' is not supported (known: 'gpt2', byte-level BPE; 'llama', "
                               "SentencePiece)");
  }
  KVFLOW_ASSIGN_OR_RETURN(spec.tokens, gguf.GetStringArray("tokenizer.ggml.tokens"));
  if (spec.tokens.empty()) return Status::CorruptFile(gguf.path() + ": tokenizer has no tokens");
  if (gguf.Has("tokenizer.ggml.merges")) {
    KVFLOW_ASSIGN_OR_RETURN(spec.merges, gguf.GetStringArray("tokenizer.ggml.merges"));
  }
  if (gguf.Has("tokenizer.ggml.token_type")) {
    KVFLOW_ASSIGN_OR_RETURN(std::vector<int64_t> types,
                            gguf.GetIntArray("tokenizer.ggml.token_type"));
    if (types.size() != spec.tokens.size()) {
      return Status::CorruptFile(gguf.path() + ": " + std::to_string(types.size()) +
                                 " token types for " + std::to_string(spec.tokens.size()) +
                                 " tokens");
    }
    spec.token_types.assign(types.begin(), types.end());
  }
  if (gguf.Has("tokenizer.ggml.pre")) {
    KVFLOW_ASSIGN_OR_RETURN(spec.pre, gguf.GetString("tokenizer.ggml.pre"));
  }
  const size_t vocab = spec.tokens.size();
  const bool spm = spec.model == "llama";
  if (spm) {
    // llama.cpp's SentencePiece defaults: ids 1, 2, 0; a "▁" before the text; BOS added.
    spec.bos_id = 1;
    spec.eos_id = 2;
    spec.unk_id = 0;
    if (vocab < 3) return Status::CorruptFile(gguf.path() + ": SentencePiece vocabulary of " + std::to_string(vocab) + " tokens");
    if (!gguf.Has("tokenizer.ggml.scores")) {
      return Status::CorruptFile(gguf.path() + ": SentencePiece tokenizer without tokenizer.ggml.scores");
    }
    KVFLOW_ASSIGN_OR_RETURN(spec.scores, gguf.GetFloatArray("tokenizer.ggml.scores"));
    if (spec.scores.size() < vocab) {
      return Status::CorruptFile(gguf.path() + ": " + std::to_string(spec.scores.size()) +
                                 " token scores for " + std::to_string(vocab) + " tokens");
    }
    spec.scores.resize(vocab);
    bool add_space_prefix = true;
    if (gguf.Has("tokenizer.ggml.add_space_prefix")) {
      KVFLOW_ASSIGN_OR_RETURN(add_space_prefix, gguf.GetBool("tokenizer.ggml.add_space_prefix"));
    }
    spec.space_prefix = add_space_prefix ? TokenizerSpec::SpacePrefix::kAfterSpecial
                                         : TokenizerSpec::SpacePrefix::kNone;
    for (const char* key : {"tokenizer.ggml.remove_extra_whitespaces", "tokenizer.ggml.add_eos_token"}) {
      if (!gguf.Has(key)) continue;
      KVFLOW_ASSIGN_OR_RETURN(bool on, gguf.GetBool(key));
      if (on) return Status::Unsupported(gguf.path() + ": " + key + " = true is not supported");
    }
    KVFLOW_RETURN_IF_ERROR(SetPhi3StripAttributes(gguf, &spec));
  }
  KVFLOW_RETURN_IF_ERROR(ReadTokenId(gguf, "tokenizer.ggml.bos_token_id", vocab, &spec.bos_id));
  KVFLOW_RETURN_IF_ERROR(ReadTokenId(gguf, "tokenizer.ggml.eos_token_id", vocab, &spec.eos_id));
  KVFLOW_RETURN_IF_ERROR(ReadTokenId(gguf, "tokenizer.ggml.unknown_token_id", vocab, &spec.unk_id));
  KVFLOW_RETURN_IF_ERROR(ReadTokenId(gguf, "tokenizer.ggml.padding_token_id", vocab, &spec.pad_id));
  // Qwen2's tokenizer.json puts text in NFC (llama.cpp skips that; HF is the reference).
  spec.nfc = spec.pre == "qwen2";
  // llama.cpp's default when the key is absent: SentencePiece and the Llama-3 pre-tokenizer add BOS.
  spec.add_bos = spm || spec.pre == "llama-bpe" || spec.pre == "llama3";
  if (gguf.Has("tokenizer.ggml.add_bos_token")) {
    KVFLOW_ASSIGN_OR_RETURN(spec.add_bos, gguf.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (gguf.Has("tokenizer.chat_template")) {
    KVFLOW_ASSIGN_OR_RETURN(spec.chat_template, gguf.GetString("tokenizer.chat_template"));
  }
  return spec;
}

}  // namespace kvflow
