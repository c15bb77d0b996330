// KV offload (InfiniGen's and FlexGen's setting): every sequence's KV lives in a host pool (the KV
// cache size is host memory then) and the device keeps two layers' staging buffers; each layer's
// attention fetches what it reads, prefetched during the previous layer where it is known by then:
// every cached token (FlexGen's full offload), or with InfiniGen only the speculated tokens.
// Preemption recomputes (there is no swap space).
#pragma once

#include <cstdint>

namespace kvflow {

struct KvOffloadConfig {
  bool enabled = false;
};

// What moved between the host pool and the device's staging buffers. A fetch is one layer of one step.
struct KvOffloadStats {
  int64_t prefetches = 0;         // fetches issued during the previous layer (overlappable with its compute)
  int64_t on_demand_fetches = 0;  // fetches attention issued itself (layer 0; selections known only at the layer)
  int64_t bytes_fetched = 0;      // K and V bytes host pool -> staging
  int64_t bytes_written = 0;      // K and V bytes of the steps' new tokens written to the host pool
  double fetch_seconds = 0;       // time spent fetching (on the CPU backend: the copies themselves)

  void Add(const KvOffloadStats& o, int sign = 1) {
    prefetches += sign * o.prefetches;
    on_demand_fetches += sign * o.on_demand_fetches;
    bytes_fetched += sign * o.bytes_fetched;
    bytes_written += sign * o.bytes_written;
    fetch_seconds += sign * o.fetch_seconds;
  }
};

}  // namespace kvflow
