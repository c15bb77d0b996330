// KV-Runahead's offline partition search (seed 001, §4.2): finds the context partition with the
// lowest measured TTFT for one (ranks, context length), to be stored in a PartitionTable. The
// search knows nothing about models or hardware: it calls back a measurement that runs one prefill
// with the given partition and returns its TTFT, so the same code drives real runs (the
// measurement tool) and analytic models (tests, the simulator).
//
//   p = 2  a bracketing search along the split point (the paper's binary search, as golden-section
//          search): TTFT is unimodal in the split (a small first chunk makes rank 1 the bottleneck,
//          a large one makes rank 1 wait), so O(log C) measurements; the probes sit at fixed
//          fractions of the bracket, so measurement noise of a few percent does not decide the
//          early steps, as it does when the slope is probed between neighbouring splits;
//   p > 2  hierarchical grid search: a grid of (2k+1) points per inner bound around the current
//          best (at first the even split) with a coarse step, then a grid with half the step around
//          the best point found, recursively until the step reaches the granularity; the paper's
//          5 values per bound is k = 2.
//
// Every distinct partition is measured once (repeats come from a cache), and the even split is
// always measured, so the result is never worse than even on the measurements taken.
#pragma once

#include <cstdint>
#include <functional>

#include "kv_runahead/context_partition.h"
#include "kvflow/status.h"

namespace kvflow::dist {

// Runs one prefill with the partition and returns its TTFT in seconds (finite, >= 0), or an error,
// which ends the search.
using TtftMeasurement = std::function<Result<double>(const ContextPartition&)>;

struct PartitionSearchOptions {
  // Split points move in multiples of this many tokens (e.g. 64, or the KV block size so chunks
  // stay block-aligned); the finest step of either search. A context too short for it falls back
  // to single tokens.
  int64_t granularity = 64;
  // Grid search: points on each side of the centre, per inner bound, at every level.
  int points_per_side = 2;
};

struct PartitionSearchResult {
  ContextPartition best;
  double best_ttft_s = 0;
  ContextPartition even;
  double even_ttft_s = 0;
  int64_t measurements = 0;  // calls to the measurement (distinct partitions)
};

// p = 2. InvalidArgument when context_len < 2.
Result<PartitionSearchResult> SearchPartitionBinary(int64_t context_len, const TtftMeasurement& measure,
                                                    const PartitionSearchOptions& options = {});

// p >= 2 (normally p > 2). InvalidArgument when context_len < num_ranks or the options are invalid.
Result<PartitionSearchResult> SearchPartitionGrid(int64_t context_len, int num_ranks, const TtftMeasurement& measure,
                                                  const PartitionSearchOptions& options = {});

// The paper's choice: the even split alone for p = 1, binary search for p = 2, the grid beyond.
Result<PartitionSearchResult> SearchPartition(int64_t context_len, int num_ranks, const TtftMeasurement& measure,
                                              const PartitionSearchOptions& options = {});

}  // namespace kvflow::dist
