// KV-Runahead's partition lookup table (seed 001, §4.2): the best context partitions, searched
// offline by measuring TTFT on the target hardware (partition_search.h), stored by (ranks, context
// length) as fractions of the context. At run time a prompt's partition is the entry for its
// length or, between two entries, the linear interpolation of their fractions (the paper predicts
// 10K from 8K and 12K, within 1.3% of the searched TTFT at 4K spacing); outside the table's range
// the nearest entry's fractions are used.
//
// File format (JSON, written by Save, read by Load):
//   {
//     "format": "kvflow-partition-table",
//     "version": 1,
//     "model": "llama-7b",                       // what was measured
//     "description": "fp16, KVR chain prefill",  // free text, may be ""
//     "hardware": "8x A100-SXM4 80GB, NVLink",   // where it was measured
//     "entries": [
//       { "num_ranks": 4, "context_len": 8192,
//         "fractions": [0.36, 0.26, 0.21, 0.17],  // one per rank, each > 0, summing to 1
//         "ttft_s": 0.41,                          // measured TTFT of this partition (optional)
//         "even_ttft_s": 0.45,                     // measured TTFT of the even split (optional)
//         "measurements": 180 }                    // TTFT runs the search took (optional)
//     ]
//   }
// At most one entry per (num_ranks, context_len); a file that breaks any rule is CorruptFile.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kv_runahead/context_partition.h"
#include "kvflow/status.h"

namespace kvflow::dist {

struct PartitionTableEntry {
  int num_ranks = 0;
  int64_t context_len = 0;
  std::vector<double> fractions;
  std::optional<double> ttft_s;
  std::optional<double> even_ttft_s;
  int64_t measurements = 0;
};

class PartitionTable {
 public:
  static constexpr int kFormatVersion = 1;

  PartitionTable(std::string model, std::string hardware, std::string description = "");

  static Result<PartitionTable> Load(const std::filesystem::path& path);
  Status Save(const std::filesystem::path& path) const;

  // Adds or replaces the entry for (num_ranks, context_len); InvalidArgument for fractions that
  // are not one positive share per rank summing to 1, or a context shorter than the ranks.
  Status Add(PartitionTableEntry entry);

  bool HasRanks(int num_ranks) const;
  bool HasEntry(int num_ranks, int64_t context_len) const;
  // The shortest and longest context with an entry for num_ranks; nothing when there is none.
  std::optional<std::pair<int64_t, int64_t>> ContextRange(int num_ranks) const;
  // The table's partition for a prompt of `context_len` tokens on `num_ranks` ranks: the exact
  // entry, the interpolation of the two nearest, or the nearest when outside the range. NotFound
  // when the table has no entry for num_ranks; InvalidArgument when context_len < num_ranks.
  Result<ContextPartition> Lookup(int num_ranks, int64_t context_len) const;
  // The fractions behind Lookup (normalised to sum to 1).
  Result<std::vector<double>> LookupFractions(int num_ranks, int64_t context_len) const;

  // Entries ordered by (num_ranks, context_len).
  std::vector<PartitionTableEntry> entries() const;
  const std::string& model() const { return model_; }
  const std::string& hardware() const { return hardware_; }
  const std::string& description() const { return description_; }

 private:
  std::string model_;
  std::string hardware_;
  std::string description_;
  std::map<std::pair<int, int64_t>, PartitionTableEntry> entries_;
};

// Where ChoosePartition's answer came from.
enum class PartitionSource { kTableExact, kTableInterpolated, kTableClamped, kEvenFallback };
const char* PartitionSourceName(PartitionSource source);

struct PartitionChoice {
  ContextPartition partition;
  PartitionSource source = PartitionSource::kEvenFallback;
};

// The partition a prompt runs with: the table's (aligned to `alignment` tokens when > 1, e.g. the
// KV block size) or, when there is no table (nullptr) or it has no entry for num_ranks, the even
// split, with a spdlog warning the first time each such reason occurs (not once per request).
// InvalidArgument only when no partition exists at all (context_len < num_ranks).
Result<PartitionChoice> ChoosePartition(const PartitionTable* table_or_null, int64_t context_len, int num_ranks,
                                        int64_t alignment = 1);

// Loads the table at `path` for serving; a missing or corrupt file is not fatal to the server, so
// it logs a warning and returns nothing, and ChoosePartition then falls back to the even split.
std::optional<PartitionTable> LoadPartitionTableOrWarn(const std::filesystem::path& path);

}  // namespace kvflow::dist
