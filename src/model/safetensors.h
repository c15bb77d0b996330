// safetensors reader: a single file, or the shards listed by a `model.safetensors.index.json`.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvflow/status.h"
#include "model/mapped_file.h"
#include "model/tensor_source.h"

namespace kvflow {

class SafetensorsSource : public TensorSource {
 public:
  static Result<std::unique_ptr<SafetensorsSource>> OpenFile(const std::string& path);
  // Shards named by the index's `weight_map` are looked up beside the index, each mapped once.
  static Result<std::unique_ptr<SafetensorsSource>> OpenIndex(const std::string& index_path);

  const TensorInfo* Find(const std::string& name) const override;
  std::vector<std::string> Names() const override;
  std::string Describe() const override;

 private:
  SafetensorsSource() = default;
  // Validates the shard's header and adds its tensors; the source keeps the mapping alive.
  Status AddShard(std::unique_ptr<MappedFile> file);

  std::string description_;
  std::vector<std::unique_ptr<MappedFile>> shards_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace kvflow
