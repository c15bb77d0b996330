// Small integer hashing shared by the prefix cache and per-candidate seeds.
#pragma once

#include <cstdint>

namespace kvflow {

inline constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;

// The splitmix64 finalizer: a cheap, well-mixed bijection of 64-bit values.
inline uint64_t SplitMix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace kvflow
