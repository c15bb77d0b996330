#include "util/checksummed_file.h"

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "util/hash.h"

namespace kvflow {
namespace {

static_assert(std::endian::native == std::endian::little, "checksummed files are written as little-endian");

constexpr size_t kMagicBytes = 8;
constexpr size_t kPreambleBytes = kMagicBytes + sizeof(uint32_t) + sizeof(uint64_t);

uint64_t Checksum(const char* data, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ULL;
  return SplitMix64(h);
}

template <typename T>
void AppendPod(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

std::string PackChecksummedFile(std::string_view magic, uint32_t version, std::string_view header,
                                std::string_view payload) {
  std::string bytes(magic.substr(0, kMagicBytes));
  bytes.resize(kMagicBytes, '\0');
  AppendPod(bytes, version);
  AppendPod(bytes, static_cast<uint64_t>(header.size()));
  bytes += header;
  bytes += payload;
  AppendPod(bytes, Checksum(bytes.data(), bytes.size()));
  return bytes;
}

Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::IoError("cannot write " + tmp);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) return Status::IoError("error writing " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Status::IoError("cannot rename " + tmp + " to " + path + ": " + ec.message());
  return Status::Ok();
}

Result<ChecksummedFile> ReadChecksummedFile(const std::string& path, std::string_view magic, uint32_t version,
                                            uint64_t max_payload_bytes, std::string_view what) {
  const std::string kind(what);
  auto corrupt = [&](const std::string& why) { return Status::CorruptFile(path + ": " + why); };
  std::error_code ec;
  const uintmax_t file_size = std::filesystem::file_size(path, ec);
  if (ec) {
    return std::filesystem::exists(path) ? Status::IoError("cannot stat " + path + ": " + ec.message())
                                         : Status::NotFound("no " + kind + " file " + path);
  }
  const uint64_t max_file_bytes = kPreambleBytes + kChecksummedFileMaxHeaderBytes + sizeof(uint64_t) + max_payload_bytes;
  if (file_size < kPreambleBytes) return corrupt("too short to be a " + kind);
  if (file_size > max_file_bytes) return corrupt("larger than any " + kind + " can be");
  ChecksummedFile file;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::IoError("cannot open " + path);
    file.bytes.assign(static_cast<size_t>(file_size), '\0');
    if (!in.read(file.bytes.data(), static_cast<std::streamsize>(file.bytes.size()))) {
      return Status::IoError("cannot read " + path);
    }
  }
  const std::string& bytes = file.bytes;
  if (magic.size() != kMagicBytes || std::memcmp(bytes.data(), magic.data(), kMagicBytes) != 0) {
    return corrupt("not a " + kind + " (bad magic)");
  }
  uint32_t stored_version = 0;
  uint64_t header_len = 0;
  std::memcpy(&stored_version, bytes.data() + kMagicBytes, sizeof(stored_version));
  std::memcpy(&header_len, bytes.data() + kMagicBytes + sizeof(stored_version), sizeof(header_len));
  if (stored_version != version) {
    return corrupt("format version " + std::to_string(stored_version) + ", this build reads " + std::to_string(version));
  }
  if (header_len > kChecksummedFileMaxHeaderBytes || header_len > file_size - kPreambleBytes) {
    return corrupt("header length " + std::to_string(header_len) + " runs past the end of the file");
  }
  if (file_size < kPreambleBytes + header_len + sizeof(uint64_t)) return corrupt("truncated (no checksum)");
  const size_t checked_len = static_cast<size_t>(file_size) - sizeof(uint64_t);
  uint64_t stored_checksum = 0;
  std::memcpy(&stored_checksum, bytes.data() + checked_len, sizeof(stored_checksum));
  if (Checksum(bytes.data(), checked_len) != stored_checksum) {
    return corrupt("checksum mismatch (truncated or damaged file)");
  }
  file.header_begin = kPreambleBytes;
  file.header_len = static_cast<size_t>(header_len);
  file.payload_begin = kPreambleBytes + file.header_len;
  file.payload_len = checked_len - file.payload_begin;
  return file;
}

}  // namespace kvflow
