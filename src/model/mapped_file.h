// Read-only memory mapping of a whole file, unmapped on destruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvflow/status.h"

namespace kvflow {

class MappedFile {
 public:
  // NotFound if the file does not exist, IoError for any other refusal; both name the path.
  static Result<std::unique_ptr<MappedFile>> Open(const std::string& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_;  // nullptr for an empty file (mmap refuses length 0)
  size_t size_;
};

}  // namespace kvflow
