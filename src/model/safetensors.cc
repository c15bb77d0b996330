#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace kvflow {

namespace {

using nlohmann::json;

// The reference implementation refuses larger headers too; it also bounds the JSON we parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool DTypeFromName(const std::string& name, DType* out) {
  if (name == "F32") {
    *out = DType::kF32;
  } else if (name == "F16") {
    *out = DType::kF16;
  } else if (name == "BF16") {
    *out = DType::kBF16;
  } else {
    return false;
  }
  return true;
}

// Checks one header entry against the data section and fills `info` (data relative to `data`).
Status ParseTensorEntry(const std::string& path, const std::string& name, const json& entry,
                        const uint8_t* data, uint64_t data_size, TensorInfo* info,
                        uint64_t* begin_out) {
  const std::string where = path + ": tensor '" + name + "'";
  if (!entry.is_object()) return Status::CorruptFile(where + " is not a JSON object");
  auto dtype = entry.find("dtype");
  auto shape = entry.find("shape");
  auto offsets = entry.find("data_offsets");
  if (dtype == entry.end() || !dtype->is_string() || shape == entry.end() || !shape->is_array() ||
      offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return Status::CorruptFile(where + " lacks a valid dtype, shape or data_offsets");
  }
  const std::string dtype_name = dtype->get<std::string>();
  if (!DTypeFromName(dtype_name, &info->dtype)) {
    return Status::Unsupported(where + " has dtype " + dtype_name + "; supported: F32, F16, BF16");
  }

  uint64_t numel = 1;
  for (const json& extent : *shape) {
    if (!extent.is_number_unsigned()) return Status::CorruptFile(where + " has a bad shape");
    uint64_t e = extent.get<uint64_t>();
    if (e != 0 && numel > data_size / e) {
      return Status::CorruptFile(where + " has a shape larger than the file");
    }
    numel *= e;
    info->shape.push_back(static_cast<int64_t>(e));
  }
  const uint64_t begin = (*offsets)[0].get<uint64_t>();
  const uint64_t end = (*offsets)[1].get<uint64_t>();
  if (begin > end || end > data_size) {
    return Status::CorruptFile(where + " data_offsets [" + std::to_string(begin) + ", " +
                               std::to_string(end) + "] fall outside the " +
                               std::to_string(data_size) + "-byte data section");
  }
  const uint64_t expected = numel * DTypeBlockBytes(info->dtype);
  if (end - begin != expected) {
    return Status::CorruptFile(where + " has " + std::to_string(end - begin) + " bytes but its " +
                               dtype_name + " shape needs " + std::to_string(expected));
  }
  info->name = name;
  info->data = data + begin;
  info->nbytes = static_cast<size_t>(expected);
  info->file = path;
  *begin_out = begin;
  return Status::Ok();
}

Result<json> ParseJsonFile(const MappedFile& file) {
  const char* text = reinterpret_cast<const char*>(file.data());
  json parsed = json::parse(text, text + file.size(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return Status::CorruptFile(file.path() + ": invalid JSON");
  return parsed;
}

}  // namespace

Result<std::unique_ptr<SafetensorsSource>> SafetensorsSource::OpenFile(const std::string& path) {
  KVFLOW_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  std::unique_ptr<SafetensorsSource> source(new SafetensorsSource());
  KVFLOW_RETURN_IF_ERROR(source->AddShard(std::move(file)));
  source->description_ =
      "safetensors file " + path + ", " + std::to_string(source->tensors_.size()) + " tensors";
  return source;
}

Result<std::unique_ptr<SafetensorsSource>> SafetensorsSource::OpenIndex(
    const std::string& index_path) {
  KVFLOW_ASSIGN_OR_RETURN(auto index_file, MappedFile::Open(index_path));
  KVFLOW_ASSIGN_OR_RETURN(json index, ParseJsonFile(*index_file));
  auto weight_map = index.is_object() ? index.find("weight_map") : index.end();
  if (weight_map == index.end() || !weight_map->is_object() || weight_map->empty()) {
    return Status::CorruptFile(index_path + ": no weight_map object");
  }

  std::vector<std::string> shard_names;
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      return Status::CorruptFile(index_path + ": weight_map entry '" + tensor +
                                 "' is not a string");
    }
    const std::string& name = shard.get_ref<const std::string&>();
    // Shards are plain file names beside the index; anything else could escape the directory.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return Status::CorruptFile(index_path + ": bad shard file name '" + name + "'");
    }
    shard_names.push_back(name);
  }
  std::sort(shard_names.begin(), shard_names.end());
  shard_names.erase(std::unique(shard_names.begin(), shard_names.end()), shard_names.end());

  const std::filesystem::path dir = std::filesystem::path(index_path).parent_path();
  std::unique_ptr<SafetensorsSource> source(new SafetensorsSource());
  for (const std::string& name : shard_names) {
    const std::string shard_path = (dir / name).string();
    Result<std::unique_ptr<MappedFile>> shard = MappedFile::Open(shard_path);
    if (!shard.ok()) {
      return Status(
          shard.status().code(),
          index_path + ": shard listed in the index cannot be opened: " + shard.status().message());
    }
    KVFLOW_RETURN_IF_ERROR(source->AddShard(std::move(shard).value()));
  }

  for (const auto& [tensor, shard] : weight_map->items()) {
    const TensorInfo* info = source->Find(tensor);
    const std::string expected_file = (dir / shard.get_ref<const std::string&>()).string();
    if (info == nullptr || info->file != expected_file) {
      return Status::CorruptFile(index_path + ": tensor '" + tensor + "' is not in its shard " +
                                 shard.get_ref<const std::string&>());
    }
  }
  source->description_ = "safetensors index " + index_path + ", " +
                         std::to_string(source->tensors_.size()) + " tensors in " +
                         std::to_string(shard_names.size()) + " shards";
  return source;
}

Status SafetensorsSource::AddShard(std::unique_ptr<MappedFile> file) {
  const std::string& path = file->path();
  uint64_t header_size;
  if (file->size() < sizeof(header_size)) {
    return Status::CorruptFile(path + ": too short for a safetensors header");
  }
  std::memcpy(&header_size, file->data(), sizeof(header_size));  // little-endian on disk and host
  if (header_size > kMaxHeaderBytes || header_size > file->size() - sizeof(header_size)) {
    return Status::CorruptFile(path + ": header length " + std::to_string(header_size) +
                               " exceeds the file size");
  }
  const char* text = reinterpret_cast<const char*>(file->data() + sizeof(header_size));
  json header = json::parse(text, text + header_size, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return Status::CorruptFile(path + ": header is not a JSON object");
  }

  const uint8_t* data = file->data() + sizeof(header_size) + header_size;
  const uint64_t data_size = file->size() - sizeof(header_size) - header_size;
  std::vector<std::pair<uint64_t, size_t>> by_offset;  // (begin, index into tensors_)
  Status unsupported;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    TensorInfo info;
    uint64_t begin = 0;
    Status st = ParseTensorEntry(path, name, entry, data, data_size, &info, &begin);
    if (st.code() == StatusCode::kUnsupported) {
      // Keep validating: a corrupt file should be reported as corrupt, not as unsupported.
      if (unsupported.ok()) unsupported = st;
      continue;
    }
    KVFLOW_RETURN_IF_ERROR(st);
    if (!tensor_index_.emplace(name, tensors_.size()).second) {
      return Status::CorruptFile(path + ": tensor '" + name + "' appears in more than one shard");
    }
    by_offset.emplace_back(begin, tensors_.size());
    tensors_.push_back(std::move(info));
  }

  std::sort(by_offset.begin(), by_offset.end());
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo& prev = tensors_[by_offset[k - 1].second];
    if (by_offset[k - 1].first + prev.nbytes > by_offset[k].first) {
      return Status::CorruptFile(path + ": tensor '" + prev.name + "' overlaps tensor '" +
                                 tensors_[by_offset[k].second].name + "'");
    }
  }
  shards_.push_back(std::move(file));
  return unsupported;
}

const TensorInfo* SafetensorsSource::Find(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::vector<std::string> SafetensorsSource::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const TensorInfo& info : tensors_) names.push_back(info.name);
  return names;
}

std::string SafetensorsSource::Describe() const { return description_; }

}  // namespace kvflow
