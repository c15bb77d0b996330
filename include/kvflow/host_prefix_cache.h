// The host-memory tier of the prefix cache (llama.cpp's --cache-ram, vLLM's CPU offload, SGLang's
// HiCache): full prompt blocks the device prefix cache evicts are saved to a capped pool in host
// memory, and a later prompt that starts with them loads them back instead of computing them
// again. Its configuration (EngineConfig::host_prefix_cache) and counters
// (EngineStats::host_prefix_cache). It needs prefix caching.
#pragma once

#include <cstdint>

namespace kvflow {

struct HostPrefixCacheConfig {
  int64_t bytes = 0;    // host memory for the tier; 0: off
  int num_blocks = -1;  // overrides bytes when >= 0 (0: off)

  // Blocks of `block_bytes` (one block, every layer, K and V) the tier holds.
  int64_t BlocksFor(int64_t block_bytes) const {
    if (num_blocks >= 0) return num_blocks;
    return block_bytes > 0 ? bytes / block_bytes : 0;
  }
  bool enabled() const { return num_blocks > 0 || (num_blocks < 0 && bytes > 0); }
};

struct HostPrefixCacheStats {
  int64_t capacity_blocks = 0;
  int64_t used_blocks = 0;
  int64_t queried_blocks = 0;  // prompt blocks looked up past the device's hits
  int64_t hit_blocks = 0;      // of those, found in host memory (loaded instead of computed)
  int64_t saved_blocks = 0;    // evicted device blocks saved to host memory
  int64_t loaded_blocks = 0;   // blocks loaded back to the device
  int64_t evicted_blocks = 0;  // host blocks dropped to make room (least recently used first)
  int64_t bytes_saved = 0;
  int64_t bytes_loaded = 0;
};

}  // namespace kvflow
