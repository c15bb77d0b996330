// KV selection: which cached tokens decoding attention reads, per layer and step. Its configuration
// (EngineConfig::kv_selection) and counters (EngineStats::kv_selection). Prefill chunks and steps of
// more than one token read the whole cache.
#pragma once

#include <cstdint>
#include <string>

namespace kvflow {

// InfiniGen: at layer i-1 speculate layer i's attention with a partial query against a partial key
// cache, both skewed, and read the tokens scoring within `alpha` of each head's max, at most
// `max_fraction` of the cache. Layer 0 reads everything. Needs the model's skewing file (`kvflow skew`).
struct InfiniGenOptions {
  std::string skew_file;  // empty: <model path>.infinigen
  // Where layer i is speculated at layer i-1: "after-attention" (once its attention output joined
  // the residual; the prefetch overlaps its MLP) or "layer-input" (the paper: from its input; the
  // prefetch overlaps the whole layer). "oracle": no speculation, layer i chooses from its own query
  // against its whole keys as it runs (the ceiling of any speculation at the same budget; nothing
  // is known ahead, so an offloaded pool cannot prefetch it).
  std::string speculate_from = "after-attention";
  double alpha = 5.0;         // logit margin below each head's max (the paper: 4 OPT, 5 Llama-2)
  double max_fraction = 0.2;  // cap on the tokens a layer reads (the paper: 20%)
  // A cap in tokens instead (0: max_fraction of the context): the published accuracy code caps at
  // 20% of its 2048-token window, 409 tokens, whatever the context so far.
  int max_tokens = 0;
  // How many tokens a speculated layer reads and which: "query-heads" (each query head counts the
  // tokens within alpha of its own max; the count is averaged over the query heads; a KV head reads
  // the union of its query heads' top tokens, taken in turn) or "kv-head-max" (a KV head scores a
  // token by its query heads' maximum, counts and picks on that). The same under multi-head attention.
  // The defaults are the measured best on SmolLM2 (bench/results/infinigen_accuracy.md); the device's
  // kernels run kv-head-max only (for query-heads speculation stays on the host).
  std::string count_rule = "query-heads";
  int dense_layers = 1;   // the first layers read everything (at least 1: layer 0 has nothing to speculate from)
  // Forced into every speculated read, within the cap: the context's first tokens (attention sinks)
  // and its latest. Off by default: after a prompt they are worth no more than noise once counting
  // is per query head, and at short contexts they crowd out the speculated tokens.
  int sink_tokens = 0;
  int recent_tokens = 0;
  // The host KV pool manager (the paper's §4.4): the most cached tokens kept per sequence and layer
  // (0: no cap). Past it, each new token evicts a victim chosen by `eviction`: "counter" (the
  // fewest fetches, every count halved when one saturates), "lru" or "fifo"; an evicted token is
  // never read again at that layer.
  int host_kv_tokens = 0;
  std::string eviction = "counter";
  // Where speculation runs: "auto" (on the device where the backend can: CUDA, without a host pool
  // cap), "device" (refuse to start otherwise) or "host" (the CPU reference path everywhere).
  std::string speculate_on = "auto";
};

// H2O: keep the heavy hitters by accumulated attention plus a recent window, evicting the rest for good.
struct H2OOptions {
  double budget = 0.2;        // fraction of the context kept
  double recent_share = 0.5;  // of the budget, the recent window (the rest: heavy hitters)
};

struct KvSelectionConfig {
  std::string method;          // "infinigen", "h2o"; empty: off (attention reads every cached token)
  bool apply_by_default = true;  // for requests that leave SamplingParams::kv_selection unset
  int min_context = 0;         // shorter contexts read the whole cache
  InfiniGenOptions infinigen;
  H2OOptions h2o;
};

// A "read" is one sequence step of one token at one layer; its tokens are those each KV head read.
struct KvSelectionStats {
  int64_t decode_tokens = 0;         // sequence steps of one token under a selection method
  int64_t layer_reads_selected = 0;  // reads over a selection (InfiniGen: speculated layers)
  int64_t layer_reads_full = 0;      // reads of the whole cache (InfiniGen's layer 0, short contexts)
  int64_t tokens_selected = 0;   // cached tokens the selected reads took, per KV head (the step's own included)
  int64_t tokens_available = 0;  // cached tokens those reads could have taken
  int64_t bytes_read = 0;        // K and V bytes attention read at every layer (what an offloaded cache fetches)
  int64_t bytes_full = 0;        // K and V bytes full attention would have read
  double select_seconds = 0;     // host time speculating and selecting
  int64_t tokens_evicted = 0;    // (token, layer) entries InfiniGen's capped host pool evicted

  // Adds `sign` times every counter of `o` (sign -1: the difference of two snapshots).
  void Add(const KvSelectionStats& o, int sign = 1) {
    decode_tokens += sign * o.decode_tokens;
    layer_reads_selected += sign * o.layer_reads_selected;
    layer_reads_full += sign * o.layer_reads_full;
    tokens_selected += sign * o.tokens_selected;
    tokens_available += sign * o.tokens_available;
    bytes_read += sign * o.bytes_read;
    bytes_full += sign * o.bytes_full;
    select_seconds += sign * o.select_seconds;
    tokens_evicted += sign * o.tokens_evicted;
  }

  double selection_fraction() const {
    return tokens_available > 0 ? static_cast<double>(tokens_selected) / static_cast<double>(tokens_available) : 0.0;
  }
};

}  // namespace kvflow
