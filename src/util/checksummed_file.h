// The envelope of kvflow's small binary model files (S3's length predictor "KVFLOWLP" and length
// probe "KVFLOWLH"): an 8-byte magic, a u32 format version, a u64 header length, a JSON header,
// a payload of raw little-endian values, then a u64 checksum (FNV-1a finished by SplitMix64) of
// everything before it. The format of the header and payload is the caller's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvflow/status.h"

namespace kvflow {

inline constexpr uint64_t kChecksummedFileMaxHeaderBytes = 1 << 20;

// The whole file's bytes; `magic` must be 8 bytes.
std::string PackChecksummedFile(std::string_view magic, uint32_t version, std::string_view header,
                                std::string_view payload);

// Writes `bytes` beside `path` and renames it over it, so a reader never sees half a file.
Status WriteFileAtomically(const std::string& path, std::string_view bytes);

struct ChecksummedFile {
  std::string bytes;  // the whole file
  size_t header_begin = 0, header_len = 0;
  size_t payload_begin = 0, payload_len = 0;  // up to the checksum
  std::string_view header() const { return std::string_view(bytes).substr(header_begin, header_len); }
  const char* payload() const { return bytes.data() + payload_begin; }
};

// Reads and checks the envelope; `what` names the kind in errors ("length probe"). NotFound for a
// missing file; CorruptFile for one too short, larger than max_payload_bytes allows, with another
// magic or version, a header running past its end, or a checksum mismatch.
Result<ChecksummedFile> ReadChecksummedFile(const std::string& path, std::string_view magic, uint32_t version,
                                            uint64_t max_payload_bytes, std::string_view what);

}  // namespace kvflow
