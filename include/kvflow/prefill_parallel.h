// Prefill across processes (KV-Runahead): under `mpirun -np P`, prompts of at least `min_tokens`
// tokens are prefilled across all P ranks; the engine runs on the last rank, which keeps the KV
// cache and decodes, and the other ranks run prefill workers (the server and CLI start them). The
// prefilled blocks reach the request through the prefix cache, which this turns on.
#pragma once

#include <string>

namespace kvflow {

struct PrefillParallelConfig {
  std::string method;  // "kv-runahead" (the chain) or "tsp" (the all-gather baseline); empty: off
  int min_tokens = 2048;
  // The partition lookup table `kvflow prefill-bench --search` writes; empty, missing or corrupt:
  // the even split (with a warning).
  std::string partition_table;
};

}  // namespace kvflow
