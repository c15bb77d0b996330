// GPT-2's byte-to-unicode alphabet, as byte-level BPE vocabularies spell raw bytes.
#pragma once

#include <cstdint>
#include <string>

namespace kvflow {

// The UTF-8 text that stands for `byte` in a byte-level vocabulary (e.g. 0x20 -> "Ġ").
const std::string& ByteLevelSpelling(uint8_t byte);

}  // namespace kvflow
