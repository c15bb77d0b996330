// How KV-Runahead (seed 001) splits a prompt of C tokens between p ranks: p contiguous chunks
// [bounds[i], bounds[i+1]), rank i computes chunk i and receives the KV of every earlier chunk from
// rank i-1. The chain makes the load uneven, so the best split is not the even one: earlier chunks
// are larger, the last (on the critical path) is small. Partitions are stored as fractions of the
// context (PartitionTable) so that one searched split serves nearby context lengths too.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvflow/status.h"

namespace kvflow::dist {

struct ContextPartition {
  // p+1 ascending token positions: 0, s_1, ..., s_{p-1}, C; every chunk holds >= 1 token.
  std::vector<int64_t> bounds;

  int num_ranks() const { return bounds.empty() ? 0 : static_cast<int>(bounds.size()) - 1; }
  int64_t context_len() const { return bounds.empty() ? 0 : bounds.back(); }
  int64_t chunk_begin(int rank) const { return bounds[static_cast<size_t>(rank)]; }
  int64_t chunk_size(int rank) const {
    return bounds[static_cast<size_t>(rank) + 1] - bounds[static_cast<size_t>(rank)];
  }

  bool operator==(const ContextPartition&) const = default;
};

// "[0, 9728, 16384]", for logs and errors.
std::string PartitionToString(const ContextPartition& partition);

// InvalidArgument naming the first broken rule: at least 2 bounds, the first 0, strictly ascending.
Status ValidatePartition(const ContextPartition& partition);
// The same, and the partition must cover exactly `context_len` tokens over `num_ranks` ranks.
Status ValidatePartition(const ContextPartition& partition, int64_t context_len, int num_ranks);

// Chunks of C/p tokens; the C % p leftover tokens go one each to the first ranks (earlier chunks
// are the cheaper place for extra tokens in the chain). InvalidArgument when C < p or p < 1.
Result<ContextPartition> EvenPartition(int64_t context_len, int num_ranks);

// Each chunk's share of the context (sums to 1).
std::vector<double> PartitionFractions(const ContextPartition& partition);

// InvalidArgument unless there is at least one fraction, each finite and > 0, summing to 1 within
// `tolerance`.
Status ValidateFractions(std::span<const double> fractions, double tolerance = 1e-6);

// Token bounds for `fractions` (any positive weights; they are normalised) over `context_len`
// tokens. Cumulative rounding, so each bound is within half a token of the exact split, then
// nudged where needed so every chunk keeps >= 1 token; the bounds end at context_len exactly.
Result<ContextPartition> PartitionFromFractions(std::span<const double> fractions, int64_t context_len);

// Moves every inner bound to the nearest multiple of `alignment` (e.g. the KV block size, so no
// block is split between two ranks), keeping bounds strictly ascending: a bound that would collide
// with its neighbour moves to the next free multiple. The last chunk may end unaligned at C.
// InvalidArgument when the context has too few aligned positions for the ranks
// ((C-1)/alignment < p-1).
Result<ContextPartition> AlignPartition(const ContextPartition& partition, int64_t alignment);

}  // namespace kvflow::dist
